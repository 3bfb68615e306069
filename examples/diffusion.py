"""Diffusion transformers: a diffusers model (Wan, Flux, SD3, ...) from a pipeline folder, loaded in
bf16 on FSDP2, a few flow-matching training steps with gradient clipping, saved as diffusers saves it.

    torchrun --nproc-per-node 2 examples/diffusion.py OUT_DIR [PIPELINE]

PIPELINE: a folder written by a diffusers pipeline's ``save_pretrained`` (or downloaded from the Hub),
whose ``transformer/`` is loaded; only rank 0 reads it. Without one, rank 0 first writes a tiny Wan
pipeline folder to ``OUT_DIR-input``. OUT_DIR is written by rank 0 alone and loads with diffusers'
``from_pretrained`` as it is.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import denoising_batch, finish, init, say
from diffusers import WanTransformer3DModel

import rank0load


def tiny_pipeline(path: str) -> str:
    """(rank 0 writes, every rank waits) A pipeline folder holding a tiny Wan transformer."""
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        tiny = WanTransformer3DModel(
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=4,
            out_channels=4,
            text_dim=16,
            freq_dim=16,
            ffn_dim=36,
            num_layers=2,
            rope_max_seq_len=32,
        )
        tiny.save_pretrained(f"{path}/transformer", max_shard_size="20KB")
        say(f"wrote a tiny Wan transformer to {path}/transformer")
    dist.barrier()
    return path


def main(out_dir: str, pipeline: str | None = None, steps: int = 3) -> None:
    device = init()
    pipeline = pipeline or tiny_pipeline(out_dir + "-input")
    # --- recipe: diffusion ---
    model = rank0load.load_pretrained(
        WanTransformer3DModel, pipeline, subfolder="transformer", dtype=torch.bfloat16
    )  # scale_shift_table, time_embedder, norm2 stay float32, as diffusers' from_pretrained keeps them
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    for step in range(steps):
        b = denoising_batch(model.config.in_channels, model.config.text_dim, device, step)
        t = b["t"].view(-1, 1, 1, 1, 1)
        noisy = ((1 - t) * b["latents"] + t * b["noise"]).to(torch.bfloat16)
        text = b["text"].to(torch.bfloat16)
        pred = model(hidden_states=noisy, timestep=b["t"] * 1000, encoder_hidden_states=text).sample
        loss = F.mse_loss(pred.float(), b["noise"] - b["latents"])  # flow matching: predict the velocity
        loss.backward()
        norm = rank0load.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        say(f"step {step}: loss {loss.item():.4f}, grad norm {norm.item():.4f}")
    report = rank0load.save_sharded(model, out_dir)  # diffusion_pytorch_model*.safetensors, config.json
    # --- end recipe ---
    say(f"saved {report.tensors} tensors as {', '.join(report.files)}")
    weight = model.proj_out.weight.full_tensor()  # a collective: every rank takes part
    if dist.get_rank() == 0:
        back = WanTransformer3DModel.from_pretrained(out_dir, torch_dtype=torch.bfloat16)
        same = torch.equal(back.proj_out.weight, weight)
        say(
            f"diffusers' from_pretrained reads {out_dir}: {type(back).__name__}, proj_out.weight equal: {same}"
        )
    finish()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
