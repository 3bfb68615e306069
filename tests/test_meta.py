"""The meta build: parameters never materialise, buffers are real, ties survive (single process)."""

from __future__ import annotations

import torch
from torch import nn

from rank0load._meta import build_on_meta, describe
from tests.models import Toy


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class Huge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32768, 16384)  # 2 GiB of fp32 if it were ever touched
        self.emb = nn.Embedding(65536, 4096)  # 1 GiB
        self.register_buffer("table", torch.arange(1000, dtype=torch.float32), persistent=False)


def test_build_touches_no_parameter_memory():
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM
    model, _ = build_on_meta(Huge)
    grown = _status("VmHWM") - before
    assert grown < 64 << 20, f"building grew the peak RSS by {grown >> 20} MiB"
    assert model.proj.weight.is_meta and model.emb.weight.is_meta
    assert torch.equal(model.table, torch.arange(1000, dtype=torch.float32))


def test_buffers_real_parameters_meta_ties_kept():
    model, _ = build_on_meta(Toy)
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    assert torch.equal(model.scale, torch.arange(5, dtype=torch.float32) / 3)
    assert model.head.weight is model.emb.weight
    layout = describe(model)
    assert layout.tie_groups == (("emb.weight", "head.weight"),)
    assert layout.aliases == {"head.weight": "emb.weight"}
    assert "scale" in layout.non_persistent and "scale" not in layout.tensors
    assert layout.tensors["bn.running_mean"].is_param is False


class SharedBeforeRegistering(nn.Module):
    """A tie made by registering one Parameter object in two modules during construction."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Parameter(torch.empty(4, 3))
        self.a = nn.Linear(3, 4, bias=False)
        self.b = nn.Linear(3, 4, bias=False)
        self.a.weight = shared
        self.b.weight = shared


def test_tie_made_before_registration_survives():
    model, _ = build_on_meta(SharedBeforeRegistering)
    assert model.a.weight is model.b.weight and model.a.weight.is_meta
