"""What every example shares: start the process group on the right backend, and a toy batch.

Not part of rank0load: a training script of your own has its own versions of these few lines.
"""

from __future__ import annotations

import os
import sys

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


def finish() -> None:
    """End the run on every rank: destroy every process group (the default group and the device
    meshes' sub-groups: ``destroy_process_group()`` with no argument takes them all; a group left
    undestroyed at exit is one cause of torch's exit-time abort, pytorch issue 190489), then say so.
    The line is what the tests judge a run by: torch 2.13 on the CPU can still abort in interpreter
    shutdown after all the work is done (shared/DESIGN.md), which no script can prevent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    # Private, read only to report it: every group torch still holds (0 once all are destroyed).
    left = len(dist.distributed_c10d._world.pg_map)
    _write_line(f"rank {rank}/{world}: done, {left} process groups left")


def say(*args: object) -> None:
    """Print on rank 0 only (in one write, see :func:`_write_line`)."""
    if dist.get_rank() == 0:
        _write_line(" ".join(str(a) for a in args))


def _write_line(text: str) -> None:
    """``text`` and its newline in one write: the ranks share torchrun's stdout, and print() may
    write the text and its newline separately (unbuffered, ``PYTHONUNBUFFERED``), letting another
    rank's line land in between."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (text + "\n").encode())


def _seed(step: int, rank: int | None) -> int:
    """Data parallelism: every rank its own batch at every step (``rank``: the data-parallel rank,
    by default this process's)."""
    return step * 100_003 + (dist.get_rank() if rank is None else rank)


def batch(
    vocab_size: int, device: str, step: int, rank: int | None = None, size: int = 2, length: int = 16
) -> dict:
    """This rank's batch of random token ids at ``step`` (your DataLoader with a DistributedSampler
    goes here): a different one on every data-parallel rank."""
    generator = torch.Generator().manual_seed(_seed(step, rank))
    ids = torch.randint(0, vocab_size, (size, length), generator=generator).to(device)
    return {"input_ids": ids, "labels": ids}


def denoising_batch(
    channels: int, text_dim: int, device: str, step: int, rank: int | None = None, size: int = 2
) -> dict:
    """A flow-matching batch for a video transformer: clean latents [B, C, frames 1, 4, 4], noise, one
    time in (0, 1) per sample, text embeddings [B, 3, text_dim] (your VAE and text encoder go here); a
    different batch on every rank."""
    generator = torch.Generator().manual_seed(_seed(step, rank))
    out = {
        "latents": torch.randn(size, channels, 1, 4, 4, generator=generator),
        "noise": torch.randn(size, channels, 1, 4, 4, generator=generator),
        "t": torch.rand(size, generator=generator),
        "text": torch.randn(size, 3, text_dim, generator=generator),
    }
    return {k: v.to(device) for k, v in out.items()}
