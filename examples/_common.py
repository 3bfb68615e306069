"""What every example shares: start the process group on the right backend, and a toy batch.

Not part of rank0load: a training script of your own has its own versions of these few lines.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init() -> str:
    """Start the process group under torchrun: NCCL on GPUs, gloo on the CPU. Returns the device type."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        return "cuda"
    dist.init_process_group("gloo")
    return "cpu"


def say(*args: object) -> None:
    """Print on rank 0 only."""
    if dist.get_rank() == 0:
        print(*args, flush=True)


def batch(vocab_size: int, device: str, seed: int, size: int = 2, length: int = 16) -> dict:
    """A batch of random token ids (your DataLoader with a DistributedSampler goes here)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (size, length), generator=generator).to(device)
    return {"input_ids": ids, "labels": ids}
