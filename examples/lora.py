"""LoRA fine-tuning on FSDP2: load the base model into a PEFT model, train the adapters, save the
adapter in PEFT's layout, and resume from it.

    torchrun --nproc-per-node 2 examples/lora.py BASE_CKPT OUT_DIR
"""

from __future__ import annotations

import os
import sys

import torch
from _common import batch, finish, init, say
from peft import LoraConfig
from transformers import AutoModelForCausalLM

import rank0load


def main(base: str, out_dir: str) -> None:
    device = init()
    torch.manual_seed(0)  # rank 0's random state draws lora_A, the same on every rank
    # --- recipe: lora ---
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    model = rank0load.load_pretrained(AutoModelForCausalLM, base, dtype=torch.bfloat16, peft_config=lora)
    report = model.rank0load_report  # base weights loaded; adapters as PEFT initialised them
    say(f"loaded {report.tensors} base tensors, kept {len(report.kept)} adapter tensors")

    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]  # the adapters (float32)
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    for step in range(3):
        loss = model(**batch(model.config.vocab_size, device, step)).loss
        loss.backward()
        norm = rank0load.clip_grad_norm_(trainable, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        say(f"step {step}: loss {loss.item():.4f}, grad norm {norm.item():.4f}")

    rank0load.save_sharded(model, out_dir, adapter="default")  # adapter_model.safetensors + config

    # Resume: the base checkpoint and the adapter in one load, both read on rank 0 only.
    resumed = rank0load.load_pretrained(
        AutoModelForCausalLM, base, dtype=torch.bfloat16, peft_config=lora, adapter=out_dir
    )
    # --- end recipe ---
    same = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for (name, a), b in zip(model.named_parameters(), resumed.parameters())
        if "lora_" in name
    )
    say(f"saved {sorted(os.listdir(out_dir))}; resumed adapters equal the trained ones: {same}")
    finish()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
