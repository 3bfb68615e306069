"""A custom training loop: load, a few AdamW steps with gradient clipping, save.

    torchrun --nproc-per-node 2 examples/train.py CKPT OUT_DIR

CKPT: a directory written by ``save_pretrained``, a .safetensors file, or a Hub repo id. Only rank 0
reads it (other nodes need not have it); OUT_DIR is written by rank 0 alone and loads with
``from_pretrained`` as it is.
"""

from __future__ import annotations

import sys

import torch
from _common import batch, finish, init, say
from transformers import AutoModelForCausalLM

import rank0load


def main(ckpt: str, out_dir: str, steps: int = 3) -> None:
    device = init()
    # --- recipe: train ---
    model = rank0load.load_pretrained(AutoModelForCausalLM, ckpt, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for step in range(steps):
        loss = model(**batch(model.config.vocab_size, device, step)).loss
        loss.backward()
        norm = rank0load.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        say(f"step {step}: loss {loss.item():.4f}, grad norm {norm.item():.4f}")
    report = rank0load.save_sharded(model, out_dir)
    # --- end recipe ---
    say(f"saved {report.tensors} tensors, {report.bytes} bytes to {out_dir}")
    finish()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
