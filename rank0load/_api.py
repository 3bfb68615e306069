"""``load_sharded``: the pipeline, one step per line, each step one call into the module that owns it.

all ranks  build model_fn() on meta, cast, shard          -> _model (_meta, _shard)
all ranks  agree: same model, same options, or all raise  -> _distribute.agree
rank 0     resolve, open, read headers, validate          -> _source, _format, _manifest
all ranks  share the manifest, or raise rank 0's error    -> _distribute.share
all ranks  allocate shards and staging, init what's missing, plan -> _model, _transfer, _plan
all ranks  settle: any rank's failure raised everywhere   -> _distribute.settle
all ranks  stream round by round; rank 0 reads and sends  -> _transfer (_stream reads)
all ranks  re-tie, verify nothing is left on meta         -> _model.finish
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import _distribute, _model, _transfer
from ._manifest import Manifest, read_manifest
from ._plan import ALIGN, build_plan
from ._progress import peak_rss_bytes, progress_bar
from ._report import Clock, LoadReport, log_summary
from .errors import LoadError

__all__ = ["load_sharded", "LoadReport", "DEFAULT_STAGING_BYTES"]

DEFAULT_STAGING_BYTES = 16 << 20
MIN_STAGING_BYTES = 2 * ALIGN * _transfer.SLOTS  # two aligned halves per staging slot


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
        key_map: maps a checkpoint key to a model key, or to ``None`` to drop it (used on rank 0).
        revision: the Hub revision, when ``ckpt_path`` is a repo id (used on rank 0).
        max_staging_bytes: host RAM the loader may use for staging on each rank.

    Returns:
        The sharded model, its parameters DTensors on the mesh device, ready for training.
        ``model.rank0load_report`` holds a :class:`LoadReport`.

    Raises:
        LoadError: on every rank, with the same message, for any problem with the checkpoint,
            the model, the arguments or the ranks' agreement, and for a failure on any rank during
            the transfer. Subclasses: ``CheckpointNotFoundError``, ``CheckpointFormatError``,
            ``CheckpointChangedError``, ``ModelMismatchError``, ``RankMismatchError``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise LoadError(
            "torch.distributed is not initialised: call dist.init_process_group() first "
            "(torchrun sets the environment for it)"
        )
    clock, rank = Clock(), dist.get_rank()
    mesh = mesh if mesh is not None else init_device_mesh(_default_device_type(), (dist.get_world_size(),))
    built, proposal, error = None, None, None
    try:  # every rank's outcome is agreed on below, so nothing raises here
        _check_options(dtype, max_staging_bytes)
        _model.check_mesh(mesh, dist.get_world_size())
        built = _model.build_sharded(model_fn, mesh, shard_fn, dtype)
        options = _distribute.options_of(
            strict=strict,
            dtype=dtype,
            max_staging_bytes=max_staging_bytes,
            mesh=(mesh.shape, mesh.mesh_dim_names),
        )
        proposal = _distribute.Proposal(built.layout.fingerprint(), options, tuple(built.flags.values()))
    except Exception as exc:
        error = exc
    clock("build")
    agreed = _distribute.agree(proposal, error)
    assert built is not None  # agree() raised otherwise
    flags = dict(zip(built.flags, agreed))
    clock("agree")
    with contextlib.ExitStack() as opened:  # rank 0's checkpoint files, open until the stream ends
        result, files = (
            read_manifest(ckpt_path, revision, built.layout, strict, key_map, opened)
            if rank == 0
            else (None, {})
        )
        manifest: Manifest = _distribute.share(result)
        clock("manifest")
        comm = _distribute.mesh_device(mesh.device_type)
        try:
            _model.materialise(built.model, comm)
            _model.init_missing(built.model, built.layout, manifest.missing)
            found = _model.targets(built.model, built.layout)
            plan = build_plan(
                manifest.entries,
                [found[e.key] for e in manifest.entries],
                [flags[e.key] for e in manifest.entries],
                mesh,
                max_staging_bytes // _transfer.SLOTS,
            )
            staging = _transfer.allocate_staging(rank, plan.piece_bytes, comm)
            error = None
        except Exception as exc:
            error = exc
        _distribute.settle(
            error, "allocating or initialising the model", "No data was moved; fix the cause and load again."
        )
        clock("allocate")
        with progress_bar(manifest.total_bytes) if rank == 0 else contextlib.nullcontext() as on_bytes:
            targets = [_transfer.target_of(found[e.key]) for e in manifest.entries]
            _transfer.stream(plan, targets, staging, comm, files, on_bytes)
        clock("stream")
    _model.finish(built.model, built.layout)
    clock("finish")
    report = LoadReport(
        tensors=len(manifest.entries),
        bytes=manifest.total_bytes,
        seconds=time.perf_counter() - clock.started,
        stream_seconds=clock.phases["stream"],
        missing=manifest.missing,
        unexpected=manifest.unexpected,
        ignored=manifest.ignored,
        broadcast_whole=plan.broadcast_whole,
        files=manifest.files,
        phases=clock.phases,
        peak_rss_bytes=peak_rss_bytes(),
        rank=rank,
        world_size=dist.get_world_size(),
    )
    built.model.rank0load_report = report  # type: ignore[assignment]
    if rank == 0:
        log_summary(report, {e.key: e.nbytes for e in manifest.entries})
    return built.model


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_options(dtype: object, max_staging_bytes: object) -> None:
    """(all ranks) Arguments that would fail later, checked before anything is built."""
    if isinstance(max_staging_bytes, bool) or not isinstance(max_staging_bytes, int):
        raise LoadError(f"max_staging_bytes={max_staging_bytes!r} is not an int (bytes)")
    if max_staging_bytes < MIN_STAGING_BYTES:
        raise LoadError(
            f"max_staging_bytes={max_staging_bytes} is too small: use at least {MIN_STAGING_BYTES} bytes "
            f"(the default, {DEFAULT_STAGING_BYTES >> 20} MiB, keeps the stream fast)"
        )
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise LoadError(f"dtype={dtype} is not a floating torch.dtype; integer tensors are never cast")
