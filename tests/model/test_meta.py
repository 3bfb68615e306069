"""The meta build: parameters never materialise, buffers are real, ties survive (single process)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from rank0load.model._meta import build_on_meta, describe
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


class _Initialised(nn.Module):
    """Initialisers as transformers' ``_init_weights`` and timm run them, plus in-place operations
    that must still run on meta: a shape change, one with a tensor argument, one on an integer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)
        self.count = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
        self.register_buffer("stats", torch.ones(4))
        with torch.no_grad():
            self.proj.weight.normal_(mean=0.0, std=0.02)
            nn.init.trunc_normal_(self.proj.weight, std=0.02)
            self.proj.weight.clamp_(-1.0, 1.0)
            self.proj.bias.zero_()
            self.proj.bias.clamp_(min=self.proj.bias.new_zeros(4))  # a tensor argument: runs
            self.count.random_(0, 5)  # integer: runs
            self.stats.uniform_()  # a real buffer: runs, from the CPU random stream
        self.flat = nn.Parameter(torch.empty(2, 3))
        with torch.no_grad():
            self.flat.t_()  # a shape change: runs


class _SeenOnMeta(TorchDispatchMode):
    """The operations that reach the dispatcher with a meta tensor first, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_meta_initialisers_skipped_everything_else_runs(monkeypatch):
    """Value-only in-place initialisers on floating meta parameters return at once (on meta torch
    runs some through Python reference code: ~0.5 ms for normal_, 1.5 ms for clamp_), anything
    that could change a shape or fail on one still reaches the dispatcher; the build is otherwise
    the one without skipping: the same shapes, the same real buffers, the same CPU random state."""
    import contextlib

    from rank0load.model import _meta

    torch.manual_seed(0)
    with monkeypatch.context() as m:
        m.setattr(_meta, "_MetaValuesSkipped", contextlib.nullcontext)
        plain, _ = build_on_meta(_Initialised)
    plain_state = torch.get_rng_state()
    torch.manual_seed(0)
    with _SeenOnMeta() as seen:
        model, _ = build_on_meta(_Initialised)
    assert torch.equal(torch.get_rng_state(), plain_state)
    assert not {"normal_", "uniform_", "zero_", "erfinv_"} & set(seen.ops), seen.ops
    assert seen.ops.count("clamp_") == 1, seen.ops  # the one with a tensor argument
    assert "random_" in seen.ops and "t_" in seen.ops, seen.ops
    assert model.proj.weight.is_meta and model.flat.shape == (3, 2) == plain.flat.shape
    assert torch.equal(model.stats, plain.stats)


def test_transformers_guarded_initialisers_skipped_on_meta():
    """transformers 5 initialises weights with torch.nn.init's functions swapped for its own guarded
    ones of the same names, so torch's ``normal_`` dispatches with transformers' as the function:
    those too return at once on meta (none reaches the dispatcher), and the model is the same."""
    import pytest

    pytest.importorskip("transformers.initialization", reason="transformers 4.x: no guarded initialisers")
    from transformers import AutoModelForCausalLM

    from tests.hf import config

    cfg = config("llama")
    with _SeenOnMeta() as seen:
        model, _ = build_on_meta(lambda: AutoModelForCausalLM.from_config(cfg))
    assert not {"normal_", "uniform_", "zero_", "fill_"} & set(seen.ops), seen.ops
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(cfg)
    assert [(n, p.shape, p.dtype) for n, p in model.named_parameters()] == [
        (n, p.shape, p.dtype) for n, p in plain.named_parameters()
    ]
    assert all(p.is_meta for p in model.parameters())


def test_canonical_all_answers_as_canonical_does():
    """The bulk lookup gives each key the answer ``canonical`` gives it: direct names, the other name
    of a tie, wrapper segments on either side, unknown keys; with and without a wrapped key present."""
    from rank0load.model._meta import describe
    from tests.models import Toy

    model, _ = build_on_meta(Toy)
    layout = describe(model)
    assert layout.aliases, "the toy has a tie"
    known = [*layout.tensors, *layout.aliases]
    plain = [*known, "nope.weight", "blocks.0", "", "emb.weight.extra", "\n"]
    wrapped = (
        [f"_orig_mod.{k}" for k in known]
        + [k.replace(".", "._checkpoint_wrapped_module.", 1) for k in known]
        + ["_orig_mod.nope.weight"]
    )
    for keys in (plain, plain + wrapped, wrapped):
        assert layout.canonical_all(keys) == [layout.canonical(k) for k in keys]
    assert any(layout.canonical_all(wrapped))  # wrapped names do resolve
