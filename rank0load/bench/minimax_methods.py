"""The methods ``--model minimax`` compares (every rank of a run calls the same one, in lock step).

Each takes ``(cfg, ckpt_dir, mesh, options)`` like :mod:`~.methods`' and returns ``(model, info)``:
transformers' ``MiniMaxM2ForCausalLM`` in bf16 holding the dequantised checkpoint.

- ``rank0load``: ``rank0load.load_pretrained(AutoModelForCausalLM, ckpt, mesh, dtype=torch.bfloat16)``.
- ``build-only``: the model rank0load builds (``from_config`` on meta in bf16, ``rank0load._model.cast``),
  sharded by rank0load's own default policy (``rank0load._shard.default_shard_fn``: the same FSDP
  groups), ``to_empty``, every local shard faulted in; loads nothing.
- ``floor``: build-only, then each rank reads its own bytes and dequantises them itself
  (:func:`floor_fill`): the least work any loader must do.
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)`` in one
  process (``SINGLE_PROCESS``: the driver runs it with one rank): on a machine without a GPU,
  transformers 5 dequantises the FP8 checkpoint to bf16 by itself (no ``quantization_config``
  argument needed; ``FineGrainedFP8Config(dequantize=True)`` gives the same).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from rank0load._api import LoadReport
from rank0load._compat import local_tensor
from rank0load._fp8 import to_float32
from rank0load._memory import prefault

from .minimax import MiniMaxConfig, build_model, expected_buffers

__all__ = ["MINIMAX_METHODS", "MINIMAX_METHOD_NOTES", "SINGLE_PROCESS", "build_sharded", "floor_fill"]

Method = Callable[[MiniMaxConfig, str, DeviceMesh, dict], tuple[nn.Module, dict]]
SINGLE_PROCESS = frozenset({"transformers"})
Got = dict[str, torch.Tensor]  # checkpoint key -> the rows of it read


def build_sharded(cfg: MiniMaxConfig, mesh: DeviceMesh) -> nn.Module:
    """(all ranks) The model rank0load's ``load_pretrained`` builds, sharded by its default policy,
    allocated (not faulted in) with the rotary buffers recomputed."""
    from rank0load._model import cast
    from rank0load._shard import default_shard_fn

    with torch.device("meta"):
        model = build_model(cfg)
    cast(model, torch.bfloat16)
    default_shard_fn(model, mesh)
    model.to_empty(device="cpu")
    for name, value in expected_buffers(cfg).items():  # to_empty leaves them uninitialised
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, value)
    return model


def build_only(cfg: MiniMaxConfig, ckpt: str, mesh: DeviceMesh, options: dict) -> tuple[nn.Module, dict]:
    """Build, shard, allocate and fault in the local shards (rank0load's ``prefault``)."""
    model = build_sharded(cfg, mesh)
    with torch.no_grad():
        for p in model.parameters():
            prefault(local_tensor(p))
    return model, {"tie_kept": None}


def rank0load_method(
    cfg: MiniMaxConfig, ckpt: str, mesh: DeviceMesh, options: dict
) -> tuple[nn.Module, dict]:
    """``rank0load.load_pretrained``: config from the checkpoint, build, default policy, load."""
    from transformers import AutoModelForCausalLM

    import rank0load

    model = rank0load.load_pretrained(
        AutoModelForCausalLM, ckpt, mesh, dtype=torch.bfloat16, **options.get("rank0load", {})
    )
    report: LoadReport = model.rank0load_report  # type: ignore[assignment]
    return model, {
        "tie_kept": None,
        "stream_seconds": report.stream_seconds,
        "stream_gbps": report.gb_per_s,
        "report_bytes": report.bytes,
        "phases": dict(getattr(report, "phases", {}) or {}),
        "local_read": report.local_read,
        "local_readers": len(report.local_readers),
    }


def floor(cfg: MiniMaxConfig, ckpt: str, mesh: DeviceMesh, options: dict) -> tuple[nn.Module, dict]:
    """build-only, then :func:`floor_fill`."""
    model, info = build_only(cfg, ckpt, mesh, options)
    return model, {**info, **floor_fill(model, cfg, ckpt)}


def transformers_method(
    cfg: MiniMaxConfig, ckpt: str, mesh: DeviceMesh, options: dict
) -> tuple[nn.Module, dict]:
    """One process: ``AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)``."""
    from transformers import AutoModelForCausalLM

    if mesh.size() != 1:
        raise ValueError("the transformers method runs in one process (the driver gives it one rank)")
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16), {"tie_kept": None}


# ------------------------------------------------------------------------------------------ the floor


@dataclass(frozen=True)
class _Need:
    """Rows ``[lo, hi)`` of checkpoint tensor ``key``: bytes ``[start, stop)`` of ``file``."""

    key: str
    file: str
    start: int
    stop: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # of the rows read


_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "BF16": torch.bfloat16}


def _headers(path: str) -> dict[str, dict]:
    """The safetensors header of ``path``, ``data_offsets`` made absolute."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    for entry in header.values():
        entry["data_offsets"] = [8 + n + o for o in entry["data_offsets"]]
    return header


def _rows(key: str, lo: int, hi: int, where: dict[str, str], headers: dict[str, dict]) -> _Need:
    entry = headers[where[key]][key]
    shape = tuple(entry["shape"])
    dtype = _DTYPES[entry["dtype"]]
    row = dtype.itemsize * (shape[1] if len(shape) > 1 else 1)
    start = entry["data_offsets"][0]
    return _Need(key, where[key], start + lo * row, start + hi * row, dtype, (hi - lo, *shape[1:]))


def _read(ckpt: str, needs: list[_Need]) -> dict[str, torch.Tensor]:
    """One file's needs read with one ``os.preadv`` per contiguous run of them; key -> its rows."""
    needs = sorted(needs, key=lambda n: n.start)
    runs: list[list[_Need]] = []
    for need in needs:
        if runs and runs[-1][-1].stop == need.start:
            runs[-1].append(need)
        else:
            runs.append([need])
    # Each run lands at the same address modulo 8 as in the file, so float32 rows stay aligned.
    buf = torch.empty(sum(n.stop - n.start for n in needs) + 8 * len(runs), dtype=torch.uint8)
    view = memoryview(buf.numpy())  # type: ignore[arg-type]  # a numpy array is a writable buffer
    out: dict[str, torch.Tensor] = {}
    fd = os.open(os.path.join(ckpt, needs[0].file), os.O_RDONLY)
    try:
        at = 0
        for run in runs:
            at += (run[0].start - at) % 8
            size = run[-1].stop - run[0].start
            got = os.preadv(fd, [view[at : at + size]], run[0].start)
            if got != size:
                raise OSError(f"short read of {needs[0].file}: {got} of {size} bytes at {run[0].start}")
            for n in run:
                out[n.key] = buf[at : at + n.stop - n.start].view(n.dtype).view(n.shape)
                at += n.stop - n.start
    finally:
        os.close(fd)
    return out


def _dequantize_into(dst: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, row0: int, block: int) -> None:
    """``dst[...] = bf16(to_float32(q) * scale)``; ``q``'s rows start at row ``row0`` of the weight,
    ``scale``'s first grid row is ``row0 // block`` (leading dims: experts)."""
    rows, cols = q.shape[-2:]
    skip = row0 % block
    full = scale.repeat_interleave(block, -2)[..., skip : skip + rows, :].repeat_interleave(block, -1)
    dst.copy_(to_float32(q).mul_(full[..., :cols]))


def floor_fill(model: nn.Module, cfg: MiniMaxConfig, ckpt: str) -> dict:
    """(all ranks, no collectives) Fill this rank's local shards from the checkpoint: per file (one a
    layer), the rows of every tensor this rank holds — its experts' w1/w2/w3 and their scales, its
    rows of the attention weights, norms, router and head, and the whole e_score_correction_bias
    (a buffer every rank holds) — are read with one ``os.preadv`` per contiguous run of them, then
    every float8 element dequantised with ``rank0load._fp8.to_float32`` times its block's scale
    and cast to bf16 into the shard (experts batched per layer and projection). Returns the
    bytes it read."""
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        where: dict[str, str] = json.load(f)["weight_map"]
    headers = {name: _headers(os.path.join(ckpt, name)) for name in sorted(set(where.values()))}
    b = cfg.block
    per_file: dict[str, dict[str, _Need]] = {}  # file -> its needs, by key
    fills: dict[str, list[Callable[[Got], object]]] = {}  # file -> what fills from it

    def fill_from(file: str, fill: Callable[[Got], object]) -> None:
        fills.setdefault(file, []).append(fill)

    def need(key: str, lo: int, hi: int) -> None:
        n = _rows(key, lo, hi, where, headers)
        per_file.setdefault(n.file, {})[key] = n

    for name, p in model.named_parameters():
        local = local_tensor(p).data
        first = 0
        if isinstance(p, DTensor):
            first = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1][0]
        count = local.shape[0]
        if count == 0:
            continue
        parts = name.split(".")
        prefix = ".".join(parts[:3]) + "."  # model.layers.{l}.
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            ws = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
            keys = {
                w: [f"{prefix}block_sparse_moe.experts.{e}.{w}.weight" for e in range(first, first + count)]
                for w in ws
            }
            for w in ws:
                for k in keys[w]:
                    need(k, 0, cfg.intermediate if w != "w2" else cfg.hidden)
                    need(k + "_scale_inv", 0, headers[where[k]][k + "_scale_inv"]["shape"][0])

            def fill_experts(
                got: Got,
                local: torch.Tensor = local,
                keys: dict[str, list[str]] = keys,
                ws: tuple[str, ...] = ws,
            ) -> None:
                at = 0
                for w in ws:
                    q = torch.stack([got[k].view(torch.uint8) for k in keys[w]]).view(torch.float8_e4m3fn)
                    s = torch.stack([got[k + "_scale_inv"] for k in keys[w]])
                    _dequantize_into(local[:, at : at + q.shape[1]], q, s, 0, b)
                    at += q.shape[1]

            fill_from(where[keys[ws[0]][0]], fill_experts)
            continue
        key = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        need(key, first, first + count)
        if headers[where[key]][key]["dtype"] == "F8_E4M3":
            need(key + "_scale_inv", first // b, (first + count - 1) // b + 1)

            def fill_fp8(got: Got, local: torch.Tensor = local, key: str = key, first: int = first) -> None:
                _dequantize_into(local, got[key], got[key + "_scale_inv"], first, b)

            fill_from(where[key], fill_fp8)
        else:

            def fill_plain(got: Got, local: torch.Tensor = local, key: str = key) -> None:
                local.copy_(got[key])  # bf16 as it is; the float32 router cast to bf16

            fill_from(where[key], fill_plain)
    buffers = [n for n, _ in model.named_buffers() if n.endswith("mlp.e_score_correction_bias")]
    for name in buffers:
        key = name.replace(".mlp.", ".block_sparse_moe.")
        need(key, 0, headers[where[key]][key]["shape"][0])

        def fill_buffer(got: Got, name: str = name, key: str = key) -> None:
            owner, _, leaf = name.rpartition(".")
            getattr(model.get_submodule(owner), leaf).copy_(got[key])

        fill_from(where[key], fill_buffer)
    read = 0
    with torch.no_grad():
        for file, needs in per_file.items():
            got = _read(ckpt, list(needs.values()))
            read += sum(n.stop - n.start for n in needs.values())
            for fill in fills.get(file, []):
                fill(got)
            del got
    return {"floor_bytes_read": read}


MINIMAX_METHODS: dict[str, Method] = {
    "build-only": build_only,
    "rank0load": rank0load_method,
    "floor": floor,
    "transformers": transformers_method,
}

MINIMAX_METHOD_NOTES: dict[str, str] = {
    "build-only": "`AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)` on meta, sharded by rank0load's default policy (`default_shard_fn`), `to_empty`, local shards faulted in: loads nothing",
    "rank0load": "`rank0load.load_pretrained(AutoModelForCausalLM, ckpt, mesh, dtype=torch.bfloat16)`: config, build, default policy, FP8 dequantised on each rank",
    "floor": "build-only, then each rank `os.preadv`s its own rows (one call per contiguous run in each file) and dequantises every float8 element it holds (`rank0load._fp8.to_float32` x block scale -> bf16): the least work any loader must do",
    "transformers": "one process: `AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)` (transformers 5 dequantises FP8 on a machine without a GPU)",
}
