"""rank0load needs no numpy (torch does not require it, and neither do our dependencies): a load in
a process where importing numpy fails is exact."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from tests.models import assert_same

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import sys
sys.modules["numpy"] = None  # any "import numpy" now raises ImportError
sys.path.insert(0, sys.argv[3])
import torch
import torch.distributed as dist
import rank0load
from tests.models import gather, toy

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = rank0load.load_sharded(toy, sys.argv[1])
torch.save(gather(model), sys.argv[2])
assert "numpy" not in sys.modules or sys.modules["numpy"] is None
"""


def test_loads_without_numpy(tmp_path, toy_checkpoint, toy_reference):
    out = tmp_path / "loaded.pt"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, toy_checkpoint, str(out), REPO],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same(torch.load(out), toy_reference)
