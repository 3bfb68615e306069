"""A new classification head on a pretrained body: the head is missing from the checkpoint, the
checkpoint's LM head is not wanted. ``strict=False`` initialises the first and skips the second.

    torchrun --nproc-per-node 2 examples/new_head.py CKPT
"""

from __future__ import annotations

import sys

from _common import finish, init, say
from transformers import AutoModelForSequenceClassification

import rank0load


def main(ckpt: str) -> None:
    init()
    # --- recipe: new head ---
    model = rank0load.load_pretrained(
        AutoModelForSequenceClassification, ckpt, config_overrides={"num_labels": 3}, strict=False
    )
    report = model.rank0load_report
    say("missing:", report.missing)  # ('score.weight',): initialised by the model's own _init_weights
    say("unexpected:", report.unexpected)  # ('lm_head.weight',), or () when the head is tied
    # --- end recipe ---
    say(f"num_labels {model.config.num_labels}, {report.tensors} tensors loaded")
    finish()


if __name__ == "__main__":
    main(sys.argv[1])
