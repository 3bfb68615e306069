"""Every dtype safetensors can store round-trips bit for bit, as a sharded parameter and as a buffer;
integers, bools, complex and float8/float4 are never cast (a mismatch is a ModelMismatchError)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests import _dist
from tests.models import ALL_DTYPES

ROWS = 5  # uneven over 2 and 3 ranks: shards of 3+2 and 2+2+1 rows
# torch < 2.12's fully_shard raises for an integer or bool parameter: the default policy replicates them
FSDP_TAKES_INTEGERS = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 12)


def dtype_of(name: str) -> torch.dtype:
    from rank0load.checkpoint._format import DTYPES

    return DTYPES[name]


class Holder(nn.Module):
    """One dtype: a (5, 4) parameter (trainable where torch allows) and a persistent (3, 2) buffer.
    F4 (float4_e2m1fn_x2) packs two values per element: torch shape (5, 2), safetensors (5, 4)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        dt = dtype_of(name)
        cols = 2 if name == "F4" else 4
        trainable = dt.is_floating_point or dt.is_complex  # torch refuses grads for ints and bools
        self.weight = nn.Parameter(
            torch.zeros(ROWS, cols, dtype=torch.uint8).view(dt)
            if dt.itemsize == 1
            else torch.zeros(ROWS, cols, dtype=dt),
            requires_grad=trainable,
        )
        self.register_buffer(
            "stat",
            torch.zeros(3, 2, dtype=torch.uint8).view(dt)
            if dt.itemsize == 1
            else torch.zeros(3, 2, dtype=dt),
        )


class Zoo(nn.Module):
    """One Holder per dtype; the default policy gives each its own FSDP group (one dtype each)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(Holder(n) for n in names)


class ZooFactory:
    def __init__(self, names: list[str]) -> None:
        self.names = names

    def __call__(self) -> Zoo:
        return Zoo(self.names)


def _random(shape: tuple[int, ...], dt: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs and all) of dtype ``dt``; bools only 0/1."""
    n = dt.itemsize
    for s in shape:
        n *= s
    high = 2 if dt == torch.bool else 256
    return torch.randint(0, high, (n,), dtype=torch.uint8, generator=gen).view(dt).reshape(shape)


def write_zoo(path: str, names: list[str], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for i, name in enumerate(names):
        dt = dtype_of(name)
        cols = 2 if name == "F4" else 4
        sd[f"parts.{i}.weight"] = _random((ROWS, cols), dt, gen)
        sd[f"parts.{i}.stat"] = _random((3, 2), dt, gen)
    save_file(sd, path)
    return sd


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


def _load_local(rank: int, world: int, path: str, names: list[str], mismatches: list[tuple]) -> dict:
    """Load the zoo; return this rank's local shards and buffers as raw bytes. Then try each mismatch."""
    from torch.distributed.tensor import DTensor, Shard

    import rank0load

    model = rank0load.load_sharded(ZooFactory(names), path)
    out: dict = {"params": {}, "buffers": {}, "errors": [], "replicated": model.rank0load_report.replicated}
    for key, p in model.named_parameters():
        if isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),):
            local = p.to_local()
        elif not isinstance(p, DTensor) and not FSDP_TAKES_INTEGERS and not p.is_floating_point():
            local = p  # replicated: torch < 2.12's fully_shard cannot take it
        else:
            raise AssertionError(f"{key}: not a Shard(0) DTensor: {type(p).__name__}")
        out["params"][key] = (
            str(p.dtype),
            tuple(p.shape),
            tuple(local.shape),
            _bytes(local),
            p.requires_grad,
        )
    for key, b in model.named_buffers():
        out["buffers"][key] = (str(b.dtype), tuple(b.shape), _bytes(b))
    for ckpt, model_names in mismatches:
        try:
            rank0load.load_sharded(ZooFactory(model_names), ckpt)
            out["errors"].append(None)
        except rank0load.LoadError as exc:
            out["errors"].append((type(exc).__name__, str(exc)))
    return out


# checkpoint dtype -> model dtype: never cast (ints, bools, complex, float8/float4 on either side).
NEVER_CAST = [
    ("I32", "I64"),
    ("I64", "F32"),
    ("U8", "I8"),
    ("BOOL", "U8"),
    ("F8_E4M3", "F8_E5M2"),
    ("F8_E4M3", "BF16"),
    ("BF16", "F8_E4M3"),
    ("F4", "U8"),
    ("C64", "F64"),
    ("F32", "I32"),
    ("F8_E8M0", "F8_E4M3FNUZ"),
]


def test_every_dtype_is_known():
    from rank0load.checkpoint._format import DTYPES

    assert sorted(DTYPES) == sorted(ALL_DTYPES), (
        f"torch {torch.__version__} lacks {sorted(set(ALL_DTYPES) - set(DTYPES))}"
    )


# 2 ranks also run the never-cast checks and stay in the quick loop.
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_dtype_round_trip(tmp_path, world):
    path = str(tmp_path / "zoo.safetensors")
    sd = write_zoo(path, ALL_DTYPES)
    assert {k: _bytes(v) for k, v in load_file(path).items()} == {k: _bytes(v) for k, v in sd.items()}
    mismatches = []
    if world == 2:  # the never-cast checks need only run once
        for ckpt_name, model_name in NEVER_CAST:
            ckpt = str(tmp_path / f"{ckpt_name}-into-{model_name}.safetensors")
            write_zoo(ckpt, [ckpt_name])
            mismatches.append((ckpt, [model_name]))
    results = _dist.ok(_dist.run(_load_local, world, path, ALL_DTYPES, mismatches, timeout=180))

    for i, name in enumerate(ALL_DTYPES):
        key = f"parts.{i}.weight"
        dt = dtype_of(name)
        shards = [r["params"][key] for r in results]
        assert all(s[0] == str(dt) and s[1] == tuple(sd[key].shape) for s in shards), (name, shards[0][:2])
        rows = [s[2][0] for s in shards]
        if FSDP_TAKES_INTEGERS or dt.is_floating_point or dt.is_complex:
            assert rows == {2: [3, 2], 3: [2, 2, 1]}[world], f"{name}: local rows {rows}"  # uneven chunks
            assert b"".join(s[3] for s in shards) == _bytes(sd[key]), f"{name}: parameter bytes differ"
            assert all(key not in r["replicated"] for r in results), f"{name}: replicated"
        else:  # a whole copy on every rank, reported as replicated
            assert rows == [ROWS] * world, f"{name}: local rows {rows}"
            assert all(s[3] == _bytes(sd[key]) for s in shards), f"{name}: parameter bytes differ"
            assert all(key in r["replicated"] for r in results), f"{name}: not reported as replicated"
        assert all(s[4] == (dt.is_floating_point or dt.is_complex) for s in shards), f"{name}: requires_grad"
        buf = f"parts.{i}.stat"
        for r in results:
            assert r["buffers"][buf][0] == str(dt), f"{name}: buffer dtype {r['buffers'][buf][0]}"
            assert r["buffers"][buf][2] == _bytes(sd[buf]), f"{name}: buffer bytes differ"

    for (ckpt_name, model_name), *errors in zip(
        NEVER_CAST if world == 2 else [], *[r["errors"] for r in results]
    ):
        assert all(e is not None for e in errors), f"{ckpt_name} loaded into a {model_name} model"
        assert len(set(errors)) == 1, f"{ckpt_name} -> {model_name}: ranks differ: {errors}"
        cls, message = errors[0]
        assert cls == "ModelMismatchError", f"{ckpt_name} -> {model_name}: {cls}: {message}"
        assert ckpt_name in message and str(dtype_of(model_name)) in message and "'parts.0." in message, (
            message
        )


def _shard_whole(model: nn.Module, mesh) -> None:
    """A caller's shard_fn: one FSDP group for the whole model, integer parameters included."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh)


def _load_with_shard_fn(rank: int, world: int, path: str) -> dict:
    import rank0load

    model = rank0load.load_sharded(ZooFactory(["I64", "F32"]), path, shard_fn=_shard_whole)
    return {n: str(p.dtype) for n, p in model.named_parameters()}


def test_a_shard_fn_that_shards_an_integer_parameter(tmp_path):
    """torch < 2.12's fully_shard raises for an integer parameter: every rank raises a
    ModelMismatchError naming it, 2.12 and the ways out, before any data moves. 2.12 and later load."""
    path = str(tmp_path / "zoo.safetensors")
    write_zoo(path, ["I64", "F32"])
    results = _dist.run(_load_with_shard_fn, 2, path, timeout=120)
    if FSDP_TAKES_INTEGERS:
        assert _dist.ok(results)[0] == {"parts.0.weight": "torch.int64", "parts.1.weight": "torch.float32"}
        return
    message = _dist.same_error(results, "ModelMismatchError").message
    assert "cannot shard integer or bool parameters ('parts.0.weight')" in message, message
    for words in ("torch 2.12", "ignored_params", "shard_fn=None"):
        assert words in message, message
