"""Host RAM per rank before and after a load, the way a benchmark script of your own would measure it:
the peak resident set size (``VmHWM``) of each process, and how much the load added to it.

    torchrun --nproc-per-node 2 examples/measure_ram.py CKPT
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from _common import finish, init, say
from transformers import AutoModelForCausalLM

import rank0load


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (not Linux?)")


def main(ckpt: str) -> None:
    init()
    before = peak_rss_mib()
    model = rank0load.load_pretrained(AutoModelForCausalLM, ckpt)
    after = peak_rss_mib()
    report = model.rank0load_report
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 2**20
    row = torch.tensor([before, after, local], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    lines = [
        f"checkpoint {report.bytes / 2**20:.1f} MiB, loaded in {report.seconds:.2f} s",
        "rank  peak RSS before  after  (MiB)  local shard (MiB)",
        *(
            f"{rank:4d}  {b:15.1f}  {a:6.1f}         {s:17.2f}"
            for rank, (b, a, s) in enumerate(r.tolist() for r in rows)
        ),
    ]
    say("\n".join(lines))  # the table in one write: the other ranks' lines cannot split it
    finish()


if __name__ == "__main__":
    main(sys.argv[1])
