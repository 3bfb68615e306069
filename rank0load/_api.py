"""``load_sharded``: the whole pipeline, top to bottom.

all ranks  build model_fn() on meta (buffers real)         -> _meta
all ranks  dtype cast, shard (default policy or shard_fn)  -> _shard
all ranks  agree: every rank built and sharded the same model, or all raise
rank 0     resolve checkpoint, read headers, validate      -> _source, _format, _manifest
all ranks  share the manifest, or raise rank 0's error      <- first data-free collective
all ranks  allocate local shards, restore buffers, init what the checkpoint lacks
all ranks  stream: rank 0 reads and sends, others receive   -> _plan, _stream, _distribute
all ranks  re-tie, verify nothing is left on meta
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from . import _distribute, _plan
from ._compat import local_tensor
from ._manifest import Manifest, build_manifest
from ._memory import prefault
from ._meta import ModelLayout, build_on_meta, describe, hf_init_weights, resolve_module
from ._progress import peak_rss_bytes, progress_bar
from ._shard import default_shard_fn
from ._source import resolve
from .errors import LoadError, ModelMismatchError, RankMismatchError

__all__ = ["load_sharded", "LoadReport", "DEFAULT_STAGING_BYTES"]

logger = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 16 << 20
_SLOTS = 4


@dataclass
class LoadReport:
    """What a load did (on every rank; byte counts are the checkpoint's)."""

    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    stream_seconds: float = 0.0
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    files: tuple[str, ...] = field(default=())
    # Keys broadcast whole and cut on every rank (see Limits in the README): each one was, for a
    # moment, held in full on every rank, outside the staging budget. Empty for FSDP, HSDP and TP.
    broadcast_whole: tuple[str, ...] = ()
    phases: dict[str, float] = field(default_factory=dict)  # seconds per pipeline phase, this rank
    peak_rss_bytes: int = 0  # this rank's peak resident set size (VmHWM) when the load finished
    rank: int = 0
    world_size: int = 1

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.stream_seconds if self.stream_seconds > 0 else 0.0


def load_sharded(
    model_fn: Callable[[], nn.Module],
    ckpt_path: str | os.PathLike[str],
    mesh: DeviceMesh | None = None,
    *,
    shard_fn: Callable[[nn.Module, DeviceMesh], object] | None = None,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    key_map: Callable[[str], str | None] | None = None,
    revision: str | None = None,
    max_staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> nn.Module:
    """Build ``model_fn()`` sharded with FSDP2 over ``mesh`` and load a safetensors checkpoint into it.

    Every rank calls this with the same arguments. Only rank 0 opens the checkpoint: it validates
    it against the model, broadcasts a manifest, then streams each tensor so that every rank
    receives just its own shard, with host RAM bounded by ``max_staging_bytes`` on every rank.

    Args:
        model_fn: zero-argument callable returning the model; called on every rank with
            parameters created on meta (their initialisers cost nothing) and buffers created for real.
        ckpt_path: a directory (``model.safetensors`` or ``*.safetensors.index.json``), a
            ``.safetensors`` file, an index ``.json``, or a Hugging Face Hub repo id. Read on rank 0 only.
        mesh: the device mesh. ``None``: a 1-D mesh over the world on ``cuda`` if available, else ``cpu``.
        shard_fn: ``shard_fn(model, mesh)`` applies the caller's own ``fully_shard`` / parallelisation.
            ``None``: ``fully_shard`` on each block (``model._no_split_modules`` or the largest
            ``nn.ModuleList``), on top-level pieces of another dtype, then on the root.
        dtype: ``None`` keeps the dtypes ``model_fn`` gave; a floating dtype casts the model's floating
            tensors to it (like ``model.to(dtype)``) before sharding.
        strict: raise on missing or unexpected keys. ``False``: skip unexpected keys and give missing
            parameters the model's own initialisation (``reset_parameters`` / ``_init_weights``).
        key_map: maps a checkpoint key to a model key, or to ``None`` to drop it.
        revision: the Hub revision, when ``ckpt_path`` is a repo id.
        max_staging_bytes: host RAM the loader may use for staging on each rank.

    Returns:
        The sharded model, its parameters DTensors on the mesh device, ready for training.
        ``model.rank0load_report`` holds a :class:`LoadReport`.

    Raises:
        LoadError: on every rank, with the same message, for any problem with the checkpoint,
            the model or the ranks' agreement. Subclasses: ``CheckpointNotFoundError``,
            ``CheckpointFormatError``, ``ModelMismatchError``, ``RankMismatchError``.
    """
    started = time.perf_counter()
    if not dist.is_available() or not dist.is_initialized():
        raise LoadError(
            "torch.distributed is not initialised: call dist.init_process_group() first "
            "(torchrun sets the environment for it)"
        )
    if max_staging_bytes < 2 * _plan.ALIGN * _SLOTS:
        raise LoadError(f"max_staging_bytes={max_staging_bytes} is too small; use at least 1 MiB")
    if dtype is not None and not dtype.is_floating_point:
        raise LoadError(f"dtype={dtype} is not a floating dtype; integer tensors are never cast")
    mesh = mesh if mesh is not None else _default_mesh()
    _check_mesh(mesh)
    rank = dist.get_rank()
    phases: dict[str, float] = {}
    mark = _Clock(phases)

    # 1-2. Build and shard on every rank; capture failures instead of raising before agreeing.
    model: nn.Module | None = None
    status: tuple[Any, ...]
    try:
        model = build_on_meta(model_fn)
        if dtype is not None:
            model.to(dtype)
        mark("build")
        (shard_fn or default_shard_fn)(model, mesh)
        mark("shard")
        layout = describe(model)
        targets_by_key = _targets(model, layout)
        layouts = {k: _plan.entry_layout(t, mesh) for k, t in targets_by_key.items()}
        kinds = {k: kind for k, (kind, _) in layouts.items()}
        runs = {k: block for k, (_, block) in layouts.items() if block is not None}
        status = ("ok", layout.fingerprint(), tuple(sorted(kinds.items())), runs, max_staging_bytes)
    except Exception as exc:  # reported to every rank by agree()
        status = ("error", f"{type(exc).__name__}: {exc}")
        logger.debug("build failed on rank %d", rank, exc_info=True)
    gathered = _distribute.agree(status)
    mark("agree")
    assert model is not None  # agree() raised otherwise
    # A rank that could not compute a row or block layout for a key makes it GENERIC everywhere.
    for gathered_status in gathered:
        for key, kind in gathered_status[2]:
            if kind != kinds[key]:
                kinds[key] = _plan.GENERIC
    budgets = sorted({g[4] for g in gathered})
    if len(budgets) > 1:  # the pieces, hence the messages, depend on it
        raise RankMismatchError(
            f"the ranks passed different max_staging_bytes ({budgets}); pass every rank the same value"
        )
    slots = _SLOTS
    piece_bytes = max_staging_bytes // slots

    # 3-4. Rank 0 alone touches the checkpoint; the others learn the outcome from share().
    manifest_or_error: Manifest | LoadError | None = None
    if rank == 0:
        try:
            manifest_or_error = build_manifest(
                resolve(ckpt_path, revision), layout, strict=strict, key_map=key_map
            )
        except LoadError as exc:
            manifest_or_error = exc
        except Exception as exc:  # anything unforeseen must still reach every rank
            manifest_or_error = LoadError(
                f"rank 0 could not read checkpoint {os.fspath(ckpt_path)!r}: {type(exc).__name__}: {exc}"
            )
    manifest: Manifest = _distribute.share(manifest_or_error)
    mark("manifest")

    # 5. Allocate the local shards, put the real buffers back, initialise what the checkpoint lacks.
    # This runs the model's own init code on every rank: agree on its outcome before any data moves.
    try:
        device = _mesh_device(mesh)
        _materialise(model, device)
        _init_missing(model, layout, manifest.missing)
        targets_by_key = _targets(model, layout)
        init_error: Exception | None = None
    except Exception as exc:  # reported to every rank by agree_outcome()
        init_error = exc
        logger.debug("allocating or initialising failed on rank %d", rank, exc_info=True)
    _distribute.agree_outcome(init_error, "allocating or initialising the model")
    mark("allocate")

    # 6. Stream.
    entries = manifest.entries
    targets = [_target(targets_by_key[e.key]) for e in entries]
    placements = [
        _plan.placements_on(t, mesh) if isinstance(t := targets_by_key[e.key], DTensor) else None
        for e in entries
    ]
    for e in entries:  # rows wider than half a staging slot cannot be cut in chunks
        if kinds[e.key] == _plan.BLOCK and _plan.block_chunk_rows(e, piece_bytes) == 0:
            kinds[e.key] = _plan.GENERIC
    entry_kinds = [kinds[e.key] for e in entries]
    # Block layouts: rank 0 needs every rank's, the others their own.
    entry_runs = [
        {r: g[3][e.key] for r, g in enumerate(gathered) if r == rank or rank == 0}
        if kinds[e.key] == _plan.BLOCK
        else None
        for e in entries
    ]
    stream_started = time.perf_counter()
    try:
        # Rank 0 alone draws a bar (a TTY, HF_HUB_DISABLE_PROGRESS_BARS unset); others count nothing.
        with progress_bar(manifest.total_bytes) if rank == 0 else contextlib.nullcontext() as on_bytes:
            _distribute.stream(
                entries,
                entry_runs,
                lambda: _plan.pieces(entries, entry_kinds, placements, mesh, piece_bytes, entry_runs, rank),
                targets,
                mesh,
                piece_bytes=piece_bytes,
                slots=slots,
                on_bytes=on_bytes,
            )
    except LoadError:
        raise
    except Exception as exc:  # a rank died or stalled, or the network failed: no model is returned
        raise _distribute.peer_failure("moving tensor data", exc) from exc
    stream_seconds = time.perf_counter() - stream_started
    mark("stream")

    # 7. Finish: ties, nothing on meta.
    _retie(model, layout)
    _verify(model)
    mark("finish")
    report = LoadReport(
        tensors=len(entries),
        bytes=manifest.total_bytes,
        seconds=time.perf_counter() - started,
        stream_seconds=stream_seconds,
        missing=manifest.missing,
        unexpected=manifest.unexpected,
        ignored=manifest.ignored,
        broadcast_whole=tuple(e.key for e in entries if kinds[e.key] == _plan.GENERIC),
        files=manifest.files,
        phases=phases,
        peak_rss_bytes=peak_rss_bytes(),
        rank=rank,
        world_size=dist.get_world_size(),
    )
    model.rank0load_report = report  # type: ignore[assignment]
    if rank == 0:
        if manifest.missing:
            logger.warning(
                "initialised %d tensors absent from the checkpoint: %s",
                len(manifest.missing),
                ", ".join(manifest.missing[:10]),
            )
        if manifest.unexpected:
            logger.warning(
                "skipped %d unexpected checkpoint keys: %s",
                len(manifest.unexpected),
                ", ".join(manifest.unexpected[:10]),
            )
        whole = [e for e in entries if kinds[e.key] == _plan.GENERIC]
        if whole:
            largest = max(whole, key=lambda e: e.nbytes)
            logger.warning(
                "%d tensors were broadcast whole and cut on every rank, outside max_staging_bytes "
                "(their placements are not Shard/_StridedShard/Replicate, or their rows are wider than "
                "max_staging_bytes / 8); the largest, %s, holds %.1f MB: %s",
                len(whole),
                largest.key,
                largest.nbytes / 1e6,
                ", ".join(e.key for e in whole[:10]),
            )
        logger.info(
            "rank0load: %d tensors, %.2f GB in %.2f s (stream %.2f GB/s) over %d ranks, rank 0 peak RSS %.0f MB",
            report.tensors,
            report.bytes / 1e9,
            report.seconds,
            report.gb_per_s,
            report.world_size,
            report.peak_rss_bytes / 1e6,
        )
    return model


class _Clock:
    """Records the seconds since the previous mark under each phase name."""

    def __init__(self, phases: dict[str, float]) -> None:
        self.phases = phases
        self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self.last
        self.last = now


def _default_mesh() -> DeviceMesh:
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _check_mesh(mesh: DeviceMesh) -> None:
    ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    if ranks != list(range(dist.get_world_size())):
        raise LoadError(
            f"the mesh spans ranks {ranks[:8]}{'...' if len(ranks) > 8 else ''} but the world has "
            f"{dist.get_world_size()} ranks: load_sharded needs a mesh over every rank"
        )
    coord = _plan.rank_coordinates(mesh)[0]
    if any(coord):
        raise LoadError(f"global rank 0 sits at mesh coordinate {coord}; rank0load needs it at the origin")


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def _targets(model: nn.Module, layout: ModelLayout) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, info in layout.tensors.items():
        module, leaf = resolve_module(model, key)
        out[key] = module._parameters[leaf] if info.is_param else module._buffers[leaf]  # type: ignore[assignment]
    return out


def _target(t: torch.Tensor) -> _distribute.Target:
    if isinstance(t, DTensor):
        return _distribute.Target(local_tensor(t), t)
    return _distribute.Target(t.data, None)


def _materialise(model: nn.Module, device: torch.device) -> None:
    """(all ranks) Allocate every local shard on ``device``; keep the real buffers built by model_fn.

    ``to_empty`` is FSDP2's supported way to allocate sharded parameters (it re-pads the local
    shards and keeps tied parameters one object), but it also empties buffers: save and restore them.
    Local shards are faulted in, and their storage's bytes outside the shard zeroed (see _memory).
    Plain buffers are made contiguous so pieces can land in them directly.
    """
    saved: list[tuple[nn.Module, str, torch.Tensor]] = []
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                saved.append((module, name, buf))
    model.to_empty(device=device)
    # Fault every local shard in now, in bulk, and zero what the stream never writes (see _memory).
    with torch.no_grad():
        for p in model.parameters():
            prefault(_local(p))
    moved: dict[int, torch.Tensor] = {}
    for module, name, buf in saved:
        new = moved.get(id(buf))
        if new is None:
            new = moved[id(buf)] = buf.to(device).contiguous()
        module._buffers[name] = new
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) and not p.is_contiguous():
            raise LoadError(f"parameter {name!r} is not contiguous after allocation")


def _init_missing(model: nn.Module, layout: ModelLayout, missing: tuple[str, ...]) -> None:
    """(all ranks, strict=False) Give parameters absent from the checkpoint the model's own init.

    The nearest ancestor's ``_init_weights(module)`` (transformers: the same init
    ``from_pretrained`` gives new heads), else the owning module's ``reset_parameters()``. Floating
    parameters are first filled with NaN, so a parameter that neither initialiser wrote is caught
    (on every rank) instead of leaving uninitialised memory. Runs before streaming: loaded values win.
    """
    owners: dict[str, tuple[nn.Module, list[torch.Tensor]]] = {}
    for key in missing:
        if layout.tensors[key].is_param:
            module, leaf = resolve_module(model, key)
            param = module._parameters[leaf]
            if param is not None:
                owners.setdefault(key.rpartition(".")[0], (module, []))[1].append(param)
    left: list[str] = []
    with torch.no_grad():
        for module_name, (module, params) in owners.items():
            # transformers skips tensors flagged as initialised; these are not.
            module.__dict__.pop("_is_hf_initialized", None)
            for t in params:
                if hasattr(t, "_is_hf_initialized"):
                    del t._is_hf_initialized
                if t.is_floating_point():
                    _local(t).fill_(float("nan"))
            init = hf_init_weights(model, module_name)
            if init is not None:
                init(module)
            reset = getattr(module, "reset_parameters", None)
            if callable(reset) and (init is None or any(_has_nan(t) for t in params)):
                reset()
            left += [
                f"{module_name}.{n}" for n, t in module._parameters.items() if t is not None and _has_nan(t)
            ]
    if left:  # load_sharded's agreement step raises this on every rank
        raise ModelMismatchError(
            "strict=False: parameters absent from the checkpoint were not initialised by the model's "
            f"_init_weights() or reset_parameters(): {left[:10]}. Give their "
            "module a reset_parameters() or add them to the checkpoint."
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t)


def _has_nan(t: torch.Tensor) -> bool:
    return t.is_floating_point() and bool(torch.isnan(_local(t)).any())


def _retie(model: nn.Module, layout: ModelLayout) -> None:
    """(all ranks) Every name of a tied parameter must be the same Parameter object."""
    for group in layout.tie_groups:
        first_module, first_leaf = resolve_module(model, group[0])
        is_param = first_leaf in first_module._parameters
        primary = (first_module._parameters if is_param else first_module._buffers)[first_leaf]
        for name in group[1:]:
            module, leaf = resolve_module(model, name)
            store = module._parameters if is_param else module._buffers
            if store[leaf] is not primary:
                store[leaf] = primary  # type: ignore[assignment]


def _verify(model: nn.Module) -> None:
    left = [n for n, p in model.named_parameters() if p.is_meta or local_tensor(p).is_meta]
    left += [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        from .errors import format_keys

        raise RankMismatchError(f"tensors left on meta after loading: {format_keys(left)}")
