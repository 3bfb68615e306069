"""The loading methods the benchmark compares (all ranks call the same function, in lock step).

Each method takes ``(cfg, ckpt_dir, mesh, options)`` and returns ``(model, info)``: the FSDP2-sharded
model with real data — :class:`~.model.BenchLlama` for a :class:`~.model.BenchConfig`, transformers'
Qwen3-MoE for a :class:`~.moe.MoeConfig` — and a dict of method-specific facts (``tie_kept``:
whether the head was still the embedding's Parameter when the method returned, before the
benchmark re-tied it, None for the untied MoE model; ``stream_seconds`` where the method reports
one). ``options`` holds keyword arguments for the method under its name
(``{"rank0load": {"max_staging_bytes": ...}}``).

The torch-native methods build the model the same way (meta build, ``fully_shard`` on each
decoder layer then on the root, ``to_empty``, the rotary buffers recomputed) so that only the
loading differs; rank0load builds it itself inside :func:`rank0load.load_sharded`.

The MoE checkpoint stores one tensor per expert, the model holds them fused: ``broadcast-rank0``
and ``every-rank`` fuse them in the full state dict (:func:`~.moe.fuse_experts`, ``torch.stack`` /
``torch.cat``), ``dcp-hf`` hands DCP views of each rank's own experts under their checkpoint keys
(:func:`~.moe.expert_views`), rank0load converts them itself (transformers' conversion mapping).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from rank0load._api import LoadReport
from rank0load.common._memory import prefault
from rank0load.integrations._compat import local_tensor

from . import moe
from .model import BenchConfig, BenchLlama, expected_inv_freq

__all__ = [
    "METHODS",
    "METHOD_NOTES",
    "SAVE_METHODS",
    "SAVE_METHOD_NOTES",
    "build_sharded",
    "model_fn",
    "read_header",
]

Config = BenchConfig | moe.MoeConfig
Method = Callable[[Config, str, DeviceMesh, dict], tuple[nn.Module, dict]]


def _tied(model: nn.Module) -> bool:
    return model.get_parameter("lm_head.weight") is model.get_parameter("model.embed_tokens.weight")


def model_fn(cfg: Config) -> Callable[[], nn.Module]:
    """The zero-argument constructor of ``cfg``'s model (what rank0load is given)."""
    if isinstance(cfg, moe.MoeConfig):
        return lambda: moe.build_model(cfg)
    return lambda: BenchLlama(cfg)


def build_sharded(cfg: Config, mesh: DeviceMesh) -> nn.Module:
    """(all ranks) Meta build, fully_shard each layer then the root, allocate the local shards."""
    with torch.device("meta"):
        model = model_fn(cfg)()
    layers = model.get_submodule("model.layers")
    assert isinstance(layers, nn.ModuleList)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    # to_empty leaves the non-persistent rotary buffers uninitialised; recompute them.
    rotary = model.get_submodule("model.rotary_emb")
    if isinstance(cfg, moe.MoeConfig):
        for name, value in moe.expected_buffers(cfg).items():
            setattr(rotary, name.rsplit(".", 1)[1], value)
    else:
        rotary.inv_freq = expected_inv_freq(cfg)
    return model


def _finish(model: nn.Module, cfg: Config) -> dict:
    """Record whether the tie survived, then make sure it holds (a broken tie is what a user must fix).
    The MoE model has no tie: None."""
    if isinstance(cfg, moe.MoeConfig):
        return {"tie_kept": None}
    kept = _tied(model)
    if not kept:
        model.lm_head.weight = model.model.embed_tokens.weight  # type: ignore[union-attr]
    return {"tie_kept": kept}


def _shard_files(ckpt: str) -> list[str]:
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    return [os.path.join(ckpt, name) for name in sorted(set(weight_map.values()))]


def _full_state_dict(ckpt: str, cfg: Config) -> dict[str, torch.Tensor]:
    """Every shard ``load_file``d into one dict; the MoE experts then fused, as the model holds them."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in _shard_files(ckpt):
        state.update(load_file(path))
    if isinstance(cfg, moe.MoeConfig):
        moe.fuse_experts(state, cfg)
    return state


def build_only(cfg: Config, ckpt: str, mesh: DeviceMesh, options: dict) -> tuple[nn.Module, dict]:
    """Meta build + fully_shard + allocate the local shards and fault them in (rank0load's own
    ``prefault``: the cheapest way to make them resident, so nobody is charged more than this)."""
    model = build_sharded(cfg, mesh)
    with torch.no_grad():
        for p in model.parameters():
            prefault(local_tensor(p))
    return model, _finish(model, cfg)


def floor(cfg: Config, ckpt: str, mesh: DeviceMesh, options: dict) -> tuple[nn.Module, dict]:
    """build-only, then each rank reads its own rows of every tensor with one ``os.preadv`` each
    straight into its shard (offsets from each file's header, parsed on every rank; nothing
    checked, no collective): the least work any loader must do. MoE: into the views of the rank's
    own experts that ``dcp-hf`` is given (:func:`_own_targets`)."""
    model, info = build_only(cfg, ckpt, mesh, options)
    targets = _own_targets(model, cfg)
    read = sum(_read_own_rows(path, targets) for path in _shard_files(ckpt))
    return model, {**info, "floor_bytes_read": read}


def read_header(fd: int) -> tuple[int, dict]:
    """A safetensors file's header length and its tensors' entries (``__metadata__`` left out),
    read from the open descriptor ``fd`` without checks (the floors' shortcut)."""
    n = int.from_bytes(os.pread(fd, 8, 0), "little")
    header = json.loads(os.pread(fd, n, 8))
    header.pop("__metadata__", None)
    return n, header


def _read_own_rows(path: str, targets: dict[str, torch.Tensor]) -> int:
    """Read this rank's rows of every tensor in the file ``path`` into ``targets`` (a DTensor: its
    local rows; a plain tensor: all of it), one ``os.preadv`` each; the bytes read."""
    read = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        n, header = read_header(fd)
        for key, entry in header.items():
            target = targets.get(key)
            if target is None:
                if ".mlp.experts." in key:  # another rank's expert
                    continue
                raise KeyError(f"{key} of {path} is not in the model")
            first = 0
            if isinstance(target, DTensor):
                first = compute_local_shape_and_global_offset(
                    target.shape, target.device_mesh, target.placements
                )[1][0]
            local = local_tensor(target).detach()
            size = local.numel() * local.element_size()
            if size == 0:
                continue
            row = size // local.shape[0] if local.dim() > 1 else local.element_size()
            got = os.preadv(
                fd,
                [memoryview(local.view(-1).view(torch.uint8).numpy())],  # type: ignore[arg-type]
                8 + n + entry["data_offsets"][0] + first * row,
            )
            if got != size:
                raise OSError(f"short read of {key} in {path}: {got} of {size} bytes")
            read += got
    finally:
        os.close(fd)
    return read


def rank0load_method(cfg: Config, ckpt: str, mesh: DeviceMesh, options: dict) -> tuple[nn.Module, dict]:
    """``rank0load.load_sharded``: rank 0 opens and validates the checkpoint; the ranks on its host
    (here: all) read their own shards through its descriptors, the others would receive theirs (MoE
    experts assembled into the fused parameters by rank0load, from transformers' conversion mapping)."""
    return _rank0load(cfg, ckpt, mesh, options.get("rank0load", {}))


def rank0load_stream(cfg: Config, ckpt: str, mesh: DeviceMesh, options: dict) -> tuple[nn.Module, dict]:
    """``rank0load.load_sharded(..., local_reads=False)``: rank 0 reads every byte and sends each rank
    its own shard, as it must for ranks on other hosts."""
    return _rank0load(cfg, ckpt, mesh, {**options.get("rank0load", {}), "local_reads": False})


def rank0load_host(cfg: Config, ckpt: str, mesh: DeviceMesh, options: dict) -> tuple[nn.Module, dict]:
    """``rank0load.load_sharded(..., readers="host")``: every host whose copy is rank 0's reads for its
    own ranks (on one host: as ``rank0load``)."""
    return _rank0load(cfg, ckpt, mesh, {**options.get("rank0load", {}), "readers": "host"})


def _rank0load(cfg: Config, ckpt: str, mesh: DeviceMesh, kwargs: dict) -> tuple[nn.Module, dict]:
    import rank0load

    model = rank0load.load_sharded(model_fn(cfg), ckpt, mesh, **kwargs)
    report: LoadReport = model.rank0load_report  # type: ignore[assignment]
    # No re-tie here: rank0load must keep the tie itself (verification requires it).
    return model, {
        "tie_kept": None if isinstance(cfg, moe.MoeConfig) else _tied(model),
        "stream_seconds": report.stream_seconds,
        "stream_gbps": report.gb_per_s,
        "report_bytes": report.bytes,
        "phases": dict(getattr(report, "phases", {}) or {}),
        "local_read": report.local_read,
        "local_readers": len(report.local_readers),
    }


def broadcast_rank0(cfg: Config, ckpt: str, mesh: DeviceMesh, options: dict) -> tuple[nn.Module, dict]:
    """Rank 0 holds the full state dict (``load_file``); ``set_model_state_dict(full_state_dict=True,
    broadcast_from_rank0=True)`` broadcasts every tensor and each rank keeps its shard.

    ``strict=False`` because the checkpoint stores the tied head once (as the embedding): with it the
    embedding is broadcast once, not twice; verification still checks every tensor. MoE: rank 0
    fuses the experts in its state dict first (:func:`~.moe.fuse_experts`).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = build_sharded(cfg, mesh)
    state = _full_state_dict(ckpt, cfg) if dist.get_rank() == 0 else {}
    set_model_state_dict(
        model,
        state,  # type: ignore[arg-type]  # a dict[str, Tensor] is a valid state dict
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False),
    )
    del state
    return model, _finish(model, cfg)


def every_rank(cfg: Config, ckpt: str, mesh: DeviceMesh, options: dict) -> tuple[nn.Module, dict]:
    """Every rank ``load_file``s the whole checkpoint (MoE: and fuses the experts), then
    ``set_model_state_dict(full_state_dict=True)`` (torch's ``distribute_tensor`` per tensor keeps
    the local shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = build_sharded(cfg, mesh)
    state = _full_state_dict(ckpt, cfg)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))  # type: ignore[arg-type]
    del state
    return model, _finish(model, cfg)


def dcp_hf(cfg: Config, ckpt: str, mesh: DeviceMesh, options: dict) -> tuple[nn.Module, dict]:
    """``dcp.load`` with ``HuggingFaceStorageReader``: every rank reads the slices of its own shards
    straight into the model's sharded state dict (in place).

    MoE: DCP cannot map per-expert checkpoint keys to a fused parameter, so each fused expert
    parameter is replaced in the state dict by plain-tensor views of this rank's own experts
    (whole experts: FSDP2 shards dim 0, the expert index) under their checkpoint keys; DCP reads
    each owned expert's tensors into them, and no other expert's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    model = build_sharded(cfg, mesh)
    state = _own_targets(model, cfg)
    dcp.load(state, storage_reader=HuggingFaceStorageReader(ckpt))
    del state
    return model, _finish(model, cfg)


def _own_targets(model: nn.Module, cfg: Config) -> dict[str, torch.Tensor]:
    """The model's state dict under the checkpoint's keys: each tied tensor once (the checkpoint
    stores it once); MoE: each fused expert parameter replaced by plain-tensor views of this rank's
    own experts under their checkpoint keys (FSDP2 shards dim 0, the expert index)."""
    first: dict[int, str] = {}
    alias: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            alias.add(name)
        else:
            first[id(p)] = name
    state = {k: v for k, v in model.state_dict().items() if k not in alias}
    if isinstance(cfg, moe.MoeConfig):
        for name in [k for k in state if moe.is_fused_expert(k)]:
            param = state.pop(name)
            local = local_tensor(param)
            offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)[
                1
            ]
            state.update(moe.expert_views(name, local, offset[0], cfg))
    return state


METHODS: dict[str, Method] = {
    "build-only": build_only,
    "floor": floor,
    "rank0load": rank0load_method,
    "rank0load-stream": rank0load_stream,
    "rank0load-host": rank0load_host,
    "broadcast-rank0": broadcast_rank0,
    "dcp-hf": dcp_hf,
    "every-rank": every_rank,
}

METHOD_NOTES: dict[str, str] = {
    "build-only": "meta build + `fully_shard` + allocate the local shards and fault them in: the least every method pays; loads nothing",
    "floor": "build-only, then each rank reads its own rows of every tensor with one `os.preadv` each straight into its shard (offsets from the headers, parsed on every rank; nothing checked, no collective; MoE: into views of its own experts, as `dcp-hf`): the least work any loader must do",
    "rank0load": "`rank0load.load_sharded(model_fn, ckpt, mesh)`: rank 0 opens the checkpoint, the ranks on its host (here: all) read their own rows through its descriptors",
    "rank0load-stream": "`rank0load.load_sharded(model_fn, ckpt, mesh, local_reads=False)`: rank 0 reads every byte, sends each rank its rows",
    "rank0load-host": '`rank0load.load_sharded(model_fn, ckpt, mesh, readers="host")`: each host whose files are rank 0\'s (size, header, sampled bytes) reads for its own ranks',
    "broadcast-rank0": "rank 0 `load_file`s every shard (MoE: and fuses the experts with `torch.stack`/`torch.cat`); `set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`",
    "dcp-hf": "`dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(ckpt))`: every rank reads its slices (MoE: each fused expert parameter replaced by views of the rank's own experts under their checkpoint keys)",
    "every-rank": "every rank `load_file`s every shard (MoE: and fuses the experts with `torch.stack`/`torch.cat`); `set_model_state_dict(full_state_dict=True)`",
}


# ------------------------------------------------------------------------------------------ saving
#
# ``python -m benchmarks.bench --save``: each save method takes ``(model, out_dir, options)`` (the
# FSDP2 model already loaded, outside the measurement) and writes ``out_dir``; it returns a dict of
# method-specific facts. The worker verifies the top-level ``*.safetensors`` in ``out_dir`` after
# the measurement.

SaveMethod = Callable[[nn.Module, str, dict], dict]


def _unaliased_state(model: nn.Module, state: dict) -> dict:
    """``state`` without the second name of each tied parameter (the checkpoint stores it once, under
    its first name; safetensors' ``save_file`` refuses shared tensors)."""
    first: set[int] = set()
    alias: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            alias.add(name)
        first.add(id(p))
    return {k: v for k, v in state.items() if k not in alias}


def save_rank0load(model: nn.Module, out_dir: str, options: dict) -> dict:
    """``rank0load.save_sharded(model, out_dir)``: each rank sends its own rows, rank 0 writes."""
    import rank0load

    report = rank0load.save_sharded(model, out_dir, **options.get("save-rank0load", {}))
    return {
        "stream_seconds": report.stream_seconds,
        "report_bytes": report.bytes,
        "files": list(report.files),
    }


def save_full_sd(model: nn.Module, out_dir: str, options: dict) -> dict:
    """``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` (rank 0 gets the full state
    dict, the others an empty one), then rank 0 ``save_file``s it as one ``model.safetensors`` and
    fsyncs it (rank0load and DCP fsync too). No index: one file."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "model.safetensors")
        save_file(_unaliased_state(model, state), path, metadata={"format": "pt"})
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    del state
    return {}


def save_dcp_hf(model: nn.Module, out_dir: str, options: dict) -> dict:
    """``dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(out_dir,
    save_distributed=True, enable_consolidation=True))``: every rank writes its shards to
    ``out_dir/sharded``, then the coordinator (rank 0) consolidates them into one full safetensors
    file in ``out_dir`` (torch's ``consolidate_safetensors_files``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    writer = HuggingFaceStorageWriter(out_dir, save_distributed=True, enable_consolidation=True)
    dcp.save(_unaliased_state(model, model.state_dict()), storage_writer=writer)
    return {}


SAVE_METHODS: dict[str, SaveMethod] = {
    "save-rank0load": save_rank0load,
    "save-full-sd": save_full_sd,
    "save-dcp-hf": save_dcp_hf,
}

SAVE_METHOD_NOTES: dict[str, str] = {
    "save-rank0load": "`rank0load.save_sharded(model, out_dir)`: each rank sends its own rows, rank 0 writes",
    "save-full-sd": "`get_model_state_dict(model, StateDictOptions(full_state_dict=True, cpu_offload=True))`, then rank 0 `safetensors.torch.save_file` (one file, no index) and fsync",
    "save-dcp-hf": "`dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(out_dir, save_distributed=True, enable_consolidation=True))`: every rank writes its shards, rank 0 consolidates them into one file",
}
