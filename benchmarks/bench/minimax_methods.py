"""The methods ``--model minimax`` compares (every rank of a run calls the same one, in lock step).

Each takes ``(cfg, ckpt_dir, mesh, options)`` like :mod:`~.methods`' and returns ``(model, info)``:
transformers' ``MiniMaxM2ForCausalLM`` in bf16 holding the dequantised checkpoint.

- ``rank0load``: ``rank0load.load_pretrained(AutoModelForCausalLM, ckpt, mesh, dtype=torch.bfloat16)``.
- ``build-only``: the model rank0load builds (``from_config`` on meta in bf16, ``rank0load.load._model.cast``),
  sharded by rank0load's own default policy (``rank0load.model._shard.default_shard_fn``: the same FSDP
  groups), ``to_empty``, every local shard faulted in; loads nothing.
- ``floor``: build-only, then each rank reads every file whole (one ``os.preadv`` each) and
  dequantises the elements it holds itself, with no per-tensor bookkeeping (:func:`floor_fill`):
  the least work any loader must do.
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)`` in one
  process (``SINGLE_PROCESS``: the driver runs it with one rank): on a machine without a GPU,
  transformers 5 dequantises the FP8 checkpoint to bf16 by itself (no ``quantization_config``
  argument needed; ``FineGrainedFP8Config(dequantize=True)`` gives the same).
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from rank0load._api import LoadReport
from rank0load.checkpoint._fp8 import to_float32
from rank0load.common._memory import prefault
from rank0load.integrations._compat import local_tensor

from .methods import read_header
from .minimax import MiniMaxConfig, build_model, expected_buffers

__all__ = ["MINIMAX_METHODS", "MINIMAX_METHOD_NOTES", "SINGLE_PROCESS", "build_sharded", "floor_fill"]

Method = Callable[[MiniMaxConfig, str, DeviceMesh, dict], tuple[nn.Module, dict]]
SINGLE_PROCESS = frozenset({"transformers"})
Got = dict[str, torch.Tensor]  # checkpoint key -> the rows of it read


def build_sharded(cfg: MiniMaxConfig, mesh: DeviceMesh) -> nn.Module:
    """(all ranks) The model rank0load's ``load_pretrained`` builds, sharded by its default policy,
    allocated (not faulted in) with the rotary buffers recomputed. Built on meta as rank0load
    builds it (``build_on_meta``: initialisers skipped on meta), so that no method is charged a
    slower build than rank0load's."""
    from rank0load.load._model import cast
    from rank0load.model._meta import build_on_meta
    from rank0load.model._shard import default_shard_fn

    model, _ = build_on_meta(lambda: build_model(cfg))
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


def rank0load_host(cfg: MiniMaxConfig, ckpt: str, mesh: DeviceMesh, options: dict) -> tuple[nn.Module, dict]:
    """``rank0load`` with ``readers="host"``: every host whose copy is rank 0's reads for its own ranks."""
    return rank0load_method(
        cfg, ckpt, mesh, {**options, "rank0load": {**options.get("rank0load", {}), "readers": "host"}}
    )


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


_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "BF16": torch.bfloat16}


class _File:
    """One checkpoint file read whole with one ``os.preadv`` (into ``buf``, reused across files):
    ``self[key]`` is a view of that tensor's bytes in its dtype and shape."""

    def __init__(self, path: str, buf: list[torch.Tensor]) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            n, self.header = read_header(fd)
            size = os.fstat(fd).st_size - 8 - n
            if buf[0].numel() < size:
                buf[0] = torch.empty(size, dtype=torch.uint8)
            self.data = buf[0][:size]
            got = os.preadv(fd, [memoryview(self.data.numpy())], 8 + n)  # type: ignore[arg-type]
            if got != size:
                raise OSError(f"short read of {path}: {got} of {size} bytes")
        finally:
            os.close(fd)

    def __getitem__(self, key: str) -> torch.Tensor:
        entry = self.header[key]
        start, stop = entry["data_offsets"]
        return self.data[start:stop].view(_DTYPES[entry["dtype"]]).view(entry["shape"])

    def stacked(self, keys: list[str]) -> torch.Tensor:
        """The tensors ``keys`` (one dtype and shape) stacked: one slice per key, one view for all."""
        entry = self.header[keys[0]]
        q = torch.stack([self.data[slice(*self.header[k]["data_offsets"])] for k in keys])
        return q.view(_DTYPES[entry["dtype"]]).view(len(keys), *entry["shape"])


def _dequantize_into(dst: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, row0: int, block: int) -> None:
    """``dst[...] = bf16(to_float32(q) * scale)``; ``q``'s rows start at row ``row0`` of the weight,
    ``scale``'s first grid row is ``row0 // block`` (leading dims: experts). Whole blocks: the
    scales broadcast over each block, no full-size scale tensor."""
    rows, cols = q.shape[-2:]
    lead = q.shape[:-2]
    x = to_float32(q)
    if row0 % block == 0 and rows % block == 0 and cols % block == 0:
        g = x.view(*lead, rows // block, block, cols // block, block)
        g.mul_(scale[..., : rows // block, None, : cols // block, None])
    else:
        skip = row0 % block
        full = scale.repeat_interleave(block, -2)[..., skip : skip + rows, :].repeat_interleave(block, -1)
        x.mul_(full[..., :cols])
    dst.copy_(x)


Fill = Callable[[_File], None]


def _fills(model: nn.Module, cfg: MiniMaxConfig, where: dict[str, str]) -> dict[str, list[Fill]]:
    """File -> how each of this rank's local tensors is filled from it: its experts' w1/w2/w3
    (batched per projection), its rows of the attention weights, norms, router and head, and the
    whole e_score_correction_bias (a buffer every rank holds)."""
    b = cfg.block
    fills: dict[str, list[Fill]] = {}
    for name, p in model.named_parameters():
        local = local_tensor(p).data
        first = 0
        if isinstance(p, DTensor):
            first = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1][0]
        count = local.shape[0]
        if count == 0:
            continue
        prefix = ".".join(name.split(".")[:3]) + "."  # model.layers.{l}.
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            ws = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
            keys = [
                [f"{prefix}block_sparse_moe.experts.{e}.{w}.weight" for e in range(first, first + count)]
                for w in ws
            ]

            def fill_experts(f: _File, local: torch.Tensor = local, keys: list[list[str]] = keys) -> None:
                at = 0
                for ks in keys:
                    q = f.stacked(ks)
                    s = f.stacked([k + "_scale_inv" for k in ks])
                    _dequantize_into(local[:, at : at + q.shape[1]], q, s, 0, b)
                    at += q.shape[1]

            fills.setdefault(where[keys[0][0]], []).append(fill_experts)
            continue
        key = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")

        def fill(f: _File, local: torch.Tensor = local, key: str = key, first: int = first) -> None:
            rows = f[key][first : first + local.shape[0]]
            if rows.dtype == torch.float8_e4m3fn:
                _dequantize_into(local, rows, f[key + "_scale_inv"][first // b :], first, b)
            else:
                local.copy_(rows)  # bf16 as it is; the float32 router cast to bf16

        fills.setdefault(where[key], []).append(fill)
    for name, buffer in model.named_buffers():
        if name.endswith("mlp.e_score_correction_bias"):
            key = name.replace(".mlp.", ".block_sparse_moe.")

            def fill_buffer(f: _File, buffer: torch.Tensor = buffer, key: str = key) -> None:
                buffer.copy_(f[key])

            fills.setdefault(where[key], []).append(fill_buffer)
    return fills


def floor_fill(model: nn.Module, cfg: MiniMaxConfig, ckpt: str) -> dict:
    """(all ranks, no collectives) Fill this rank's local shards from the checkpoint, doing no more
    than any loader must: the garbage collector paused (as rank0load pauses it while it parses
    headers), each file (one a layer) read whole with one ``os.preadv`` into one reused buffer and
    its header parsed, then every float8 element this rank holds dequantised with
    ``rank0load.checkpoint._fp8.to_float32`` times its block's scale (broadcast over the block) and cast to
    bf16 into the shard, a layer's experts batched per projection. Reading whole files reads
    each rank's share of every file and the rest of it (page cache to memory, about 0.1 s per
    GB): cheaper than one read per tensor. Returns the bytes it read."""
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        where: dict[str, str] = json.load(f)["weight_map"]
    fills = _fills(model, cfg, where)
    read, buf = 0, [torch.empty(0, dtype=torch.uint8)]
    was = gc.isenabled()
    gc.disable()
    try:
        with torch.no_grad():
            for name in sorted(fills):
                opened = _File(os.path.join(ckpt, name), buf)
                read += opened.data.numel()
                for fill in fills[name]:
                    fill(opened)
                del opened
    finally:
        if was:
            gc.enable()
    return {"floor_bytes_read": read}


MINIMAX_METHODS: dict[str, Method] = {
    "build-only": build_only,
    "rank0load": rank0load_method,
    "rank0load-host": rank0load_host,
    "floor": floor,
    "transformers": transformers_method,
}

MINIMAX_METHOD_NOTES: dict[str, str] = {
    "build-only": "`AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)` on meta, sharded by rank0load's default policy (`default_shard_fn`), `to_empty`, local shards faulted in: loads nothing",
    "rank0load": "`rank0load.load_pretrained(AutoModelForCausalLM, ckpt, mesh, dtype=torch.bfloat16)`: config, build, default policy, FP8 dequantised on each rank",
    "rank0load-host": '`rank0load.load_pretrained(AutoModelForCausalLM, ckpt, mesh, dtype=torch.bfloat16, readers="host")`: each host whose files are rank 0\'s reads for its own ranks',
    "floor": "build-only, then each rank, garbage collector paused, reads each file whole with one `os.preadv` and dequantises every float8 element it holds (`rank0load.checkpoint._fp8.to_float32` x its block's scale, broadcast -> bf16) into its shards, experts batched per layer and projection: the least work any loader must do",
    "transformers": "one process: `AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)` (transformers 5 dequantises FP8 on a machine without a GPU)",
}
