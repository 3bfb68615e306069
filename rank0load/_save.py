"""``save_sharded``: write an FSDP2 model as a safetensors checkpoint, rank 0 alone writing.

all ranks  describe the model, layout flags, agree (same model, same options)  -> _meta, _layout, _distribute
rank 0     plan: saved names, dtypes, files split like huggingface_hub, headers -> plan_save (here)
all ranks  share the plan, or rank 0's error                                  -> _distribute.share
rank 0     create out_dir, open the temporary files, write the headers         -> _write.open_outputs
all ranks  allocate staging; settle                                           -> _write.settle
all ranks  stream: each rank sends its own rows, rank 0 writes                 -> _write.stream
rank 0     config.json, fsync, rename, index last, remove stale files; settle  -> _write.commit
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from . import _distribute, _write
from ._compat import hf_conversions, is_transformers_model, local_tensor
from ._format import DTYPES
from ._layout import ROWS_OK, layout_flags, rank_coordinates, rows_of
from ._meta import ModelLayout, describe, strip_wrappers
from ._progress import peak_rss_bytes, progress_bar
from ._report import Clock
from ._write import SaveItem, SaveKind, SavePlan
from .errors import LoadError, SaveError

__all__ = ["SaveReport", "parse_size", "plan_save", "save_sharded"]

logger = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 16 << 20
ALIGN = 64  # piece sizes stay multiples of every element size
ROUND_PIECES = 64  # a round (one failure check) carries at least this many pieces' worth of bytes
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # huggingface_hub's parse_size_to_int


@dataclass
class SaveReport:
    """What a save did (on every rank; byte counts are the saved files')."""

    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    stream_seconds: float = 0.0
    files: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()  # model keys key_map mapped to None
    # DTensors neither Shard(0) nor Replicate (tensor parallel): gathered whole on every rank with
    # full_tensor(), outside max_staging_bytes, for that one tensor.
    gathered_whole: tuple[str, ...] = ()
    phases: dict[str, float] = field(default_factory=dict)
    peak_rss_bytes: int = 0  # this rank's peak resident set size (VmHWM) when the save finished
    rank: int = 0
    world_size: int = 1

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.stream_seconds if self.stream_seconds > 0 else 0.0


def save_sharded(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    key_map: Callable[[str], str | None] | None = None,
    original_format: bool = True,
    max_staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> SaveReport:
    """Write ``model`` (FSDP2 or HSDP, sharded or not) to ``out_dir`` as a safetensors checkpoint
    that ``from_pretrained`` and :func:`load_sharded` read as it is.

    (all ranks) Every rank calls this with the same arguments. Rank 0 alone writes: each rank sends
    its own rows of every ``Shard(0)`` parameter to rank 0, point to point, in pieces of at most
    ``max_staging_bytes / 4``; replicas (HSDP's ``Replicate`` dimensions) send once. Host RAM for
    staging is bounded by ``max_staging_bytes`` on every rank. DTensors placed otherwise (tensor
    parallel ``Shard(1)``, ``_StridedShard``) are, for now, gathered whole with ``full_tensor()`` on
    every rank, one at a time, outside that bound (listed in ``SaveReport.gathered_whole``, warned).

    Files are written under temporary names, fsynced and renamed; the index is written last and an
    earlier save's files are removed only then. On any failure the temporary files are removed and
    the previous checkpoint in ``out_dir`` is left as it was.

    Args:
        model: the model, the same on every rank.
        out_dir: the directory, needed on rank 0 only (created if missing).
        max_shard_size: the largest file (bytes, or ``"5GB"``-style as huggingface_hub parses it);
            a tensor larger than that gets a file of its own.
        dtype: a floating dtype for the saved floating tensors; integer, bool and float8 tensors are
            never cast. ``None``: as the model holds them.
        key_map: maps a model key (wrapper prefixes removed) to its saved name, or to None to skip it
            (called on rank 0). Tied parameters are saved once, under their first name.
        original_format: accepted for compatibility with the planned MoE reversal; transformers'
            conversions (fused experts) are not reverted yet: such models save their fused names.
        max_staging_bytes: host RAM for staging on each rank.

    Returns:
        A :class:`SaveReport`, on every rank.

    Raises:
        SaveError: on every rank, with the same message, for a failure on any rank (out_dir not
            writable, disk full, a cast error, a rank that died); other LoadErrors for models that
            differ between ranks (``RankMismatchError``).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise SaveError("torch.distributed is not initialised: call dist.init_process_group() first")
    clock, rank, out = Clock(), dist.get_rank(), os.fspath(out_dir)
    options = {"dtype": dtype, "max_shard_size": max_shard_size, "max_staging_bytes": max_staging_bytes}
    described, error = _attempt(lambda: _describe(model, options))
    flags = _distribute.agree(described[2] if described else None, error)
    assert described is not None  # agree() raised otherwise
    layout, tensors, _ = described
    clock("agree")
    planned = _plan_or_error(layout, tensors, flags, key_map, options) if rank == 0 else None
    plan: SavePlan = _distribute.share(planned)
    clock("plan")
    outputs: _write.Outputs | None = None
    try:
        comm = _comm_device(tensors)
        staging, error = _attempt(lambda: _write.allocate_staging(plan.piece_bytes, comm))
        if rank == 0 and error is None:
            outputs, error = _attempt(lambda: _write.open_outputs(out, plan))
        _write.settle(error, "creating the output files")
        assert staging is not None
        with progress_bar(plan.total_size) if rank == 0 else contextlib.nullcontext() as on_bytes:
            gathered = _write.stream(plan, tensors, outputs, staging, on_bytes)
        clock("stream")
        if rank == 0:
            assert outputs is not None
            _, error = _attempt(lambda: _finish(model, outputs, plan, original_format))
        _write.settle(error, "committing the checkpoint")
        clock("commit")
    finally:
        if outputs is not None:
            outputs.discard()  # nothing left once committed
    report = _report(plan, clock, gathered)
    if rank == 0:
        _log_summary(report)
    return report


R = TypeVar("R")


def _attempt(step: Callable[[], R]) -> tuple[R | None, Exception | None]:
    """Run a step whose failure every rank must learn of before raising: (result, None) or (None, error)."""
    try:
        return step(), None
    except Exception as exc:
        return None, exc


def parse_size(size: int | str) -> int:
    """``max_shard_size`` in bytes, parsed as huggingface_hub's ``parse_size_to_int`` does."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str) and size.strip()[-2:].upper() in _UNITS:
        text = size.strip()
        try:
            value = int(float(text[:-2].strip()) * _UNITS[text[-2:].upper()])
        except ValueError:
            value = 0
        if value > 0:
            return value
    raise SaveError(f"max_shard_size={size!r} is not a positive number of bytes nor a size like '5GB'")


def _describe(
    model: nn.Module, options: dict[str, Any]
) -> tuple[ModelLayout, dict[str, torch.Tensor], _distribute.Proposal]:
    """(all ranks) Check the options, describe the model, and make this rank's proposal."""
    dtype, staging = options["dtype"], options["max_staging_bytes"]
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise SaveError(f"dtype={dtype} is not a floating torch.dtype; integer tensors are never cast")
    if isinstance(staging, bool) or not isinstance(staging, int) or staging < ALIGN * _write.SLOTS:
        raise SaveError(f"max_staging_bytes={staging!r} must be an int of at least {ALIGN * _write.SLOTS}")
    parse_size(options["max_shard_size"])
    layout = describe(model)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    tensors = {k: params[k] if t.is_param else buffers[k] for k, t in layout.tensors.items()}
    flags = tuple(_flags(tensors[k]) for k in layout.tensors)
    proposal = _distribute.Proposal(layout.fingerprint(), _distribute.options_of(**options), flags)
    return layout, tensors, proposal


def _flags(t: torch.Tensor) -> int:
    """ROWS_OK when this rank's shard of ``t`` is its contiguous row range (to send as it is)."""
    if not isinstance(t, DTensor):
        return 0
    return layout_flags(t, t.device_mesh) & ROWS_OK if local_tensor(t).is_contiguous() else 0


def _comm_device(tensors: dict[str, torch.Tensor]) -> torch.device:
    for t in tensors.values():
        if isinstance(t, DTensor):
            return _distribute.mesh_device(t.device_mesh.device_type)
    return torch.device("cpu")


def _plan_or_error(
    layout: ModelLayout,
    tensors: dict[str, torch.Tensor],
    flags: tuple[int, ...],
    key_map: Callable[[str], str | None] | None,
    options: dict[str, Any],
) -> SavePlan | LoadError:
    """(rank 0) The plan, or the error every rank will raise."""
    try:
        return plan_save(layout, tensors, flags, key_map, options)
    except LoadError as exc:
        return exc
    except Exception as exc:
        return SaveError(f"planning the checkpoint failed on rank 0: {type(exc).__name__}: {exc}")


def plan_save(
    layout: ModelLayout,
    tensors: dict[str, torch.Tensor],
    flags: tuple[int, ...],
    key_map: Callable[[str], str | None] | None,
    options: dict[str, Any],
) -> SavePlan:
    """(rank 0) Names, dtypes, the split into files, the headers and the senders of every tensor."""
    dtype: torch.dtype | None = options["dtype"]
    rows: list[tuple[str, str, torch.dtype, SaveKind, tuple[tuple[int, int, int], ...]]] = []
    skipped, seen = [], dict[str, str]()
    for key, flag in zip(layout.tensors, flags):
        t, plain = tensors[key], strip_wrappers(key)
        name = key_map(plain) if key_map is not None else plain
        if name is None:
            skipped.append(plain)
            continue
        if not isinstance(name, str) or not name:
            raise SaveError(f"key_map({plain!r}) returned {name!r}; return a saved name or None")
        if name in seen:
            raise SaveError(f"{seen[name]!r} and {plain!r} would both be saved as {name!r}; fix key_map")
        seen[name] = plain
        wire = dtype if dtype is not None and t.dtype.is_floating_point and t.dtype.itemsize > 1 else t.dtype
        if wire not in _NAMES or wire == DTYPES.get("F4"):
            raise SaveError(f"{plain!r}: dtype {t.dtype} cannot be saved in safetensors")
        kind = SaveKind.PLAIN if not isinstance(t, DTensor) else SaveKind.ROWS if flag else SaveKind.GATHER
        rows.append((key, name, wire, kind, _senders(t) if isinstance(t, DTensor) and flag else ()))
    if not rows:
        raise SaveError("nothing to save: the model has no tensors, or key_map skipped them all")
    piece_bytes = max(ALIGN, options["max_staging_bytes"] // _write.SLOTS // ALIGN * ALIGN)
    return _lay_out(rows, tensors, parse_size(options["max_shard_size"]), piece_bytes, tuple(skipped))


def _senders(t: DTensor) -> tuple[tuple[int, int, int], ...]:
    """(rank 0) Who sends which rows of a Shard(0)/Replicate DTensor: the replica at coordinate 0 of
    every Replicate mesh dimension, each its own row range."""
    mesh, placements = t.device_mesh, t.placements
    replicated = [d for d, p in enumerate(placements) if isinstance(p, Replicate)]
    out = []
    for rank, coord in rank_coordinates(mesh):
        if all(coord[d] == 0 for d in replicated):
            lo, hi = rows_of(tuple(mesh.shape), placements, t.shape[0], coord)
            if hi > lo:
                out.append((rank, lo, hi))
    return tuple(sorted(out, key=lambda s: s[1]))


def _split(sizes: list[int], limit: int) -> list[list[int]]:
    """huggingface_hub's split: in order, a new file when the next tensor would tip over the limit;
    a tensor larger than the limit alone in its own file."""
    files: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, size in enumerate(sizes):
        if size > limit:
            files.append([i])
            continue
        if used + size > limit and current:
            files.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        files.append(current)
    return files


def _lay_out(
    rows: list[tuple[str, str, torch.dtype, SaveKind, tuple[tuple[int, int, int], ...]]],
    tensors: dict[str, torch.Tensor],
    limit: int,
    piece_bytes: int,
    skipped: tuple[str, ...],
) -> SavePlan:
    """(rank 0) Files, headers and offsets: in each file tensors by element size, largest first, then
    name (as safetensors orders them), so each is aligned; the JSON header padded with spaces to 8."""
    nbytes = [tensors[key].numel() * wire.itemsize for key, _, wire, _, _ in rows]
    groups = _split(nbytes, limit)
    names = (
        [_write.SINGLE_NAME]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    items: list[SaveItem] = []
    headers: list[bytes] = []
    for file, group in enumerate(groups):
        order = sorted(group, key=lambda i: (-rows[i][2].itemsize, rows[i][1]))
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        at = 0
        for i in order:
            shape = tuple(tensors[rows[i][0]].shape)
            header[rows[i][1]] = {
                "dtype": _NAMES[rows[i][2]],
                "shape": list(shape),
                "data_offsets": [at, at + nbytes[i]],
            }
            at += nbytes[i]
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        headers.append(len(text).to_bytes(8, "little") + text)
        for i in order:
            key, name, wire, kind, senders = rows[i]
            start = len(headers[-1]) + header[name]["data_offsets"][0]
            shape = tuple(tensors[key].shape)
            items.append(SaveItem(key, name, _NAMES[wire], shape, file, start, nbytes[i], kind, senders))
    return SavePlan(
        tuple(names), tuple(headers), tuple(items), _rounds(items, piece_bytes), piece_bytes, skipped
    )


def _rounds(items: list[SaveItem], piece_bytes: int) -> tuple[int, ...]:
    ends, used = [], 0
    for i, item in enumerate(items):
        used += item.nbytes
        if used >= ROUND_PIECES * piece_bytes:
            ends.append(i + 1)
            used = 0
    if not ends or ends[-1] != len(items):
        ends.append(len(items))
    return tuple(ends)


def _finish(model: nn.Module, outputs: _write.Outputs, plan: SavePlan, original_format: bool) -> None:
    """(rank 0) Write a transformers model's config files beside the checkpoint, then commit."""
    extras: list[tuple[str, str]] = []
    if is_transformers_model(model):
        extras = _hf_configs(model, outputs, plan, original_format)
    _write.commit(outputs, plan, extras)


def _hf_configs(
    model: nn.Module, outputs: _write.Outputs, plan: SavePlan, original_format: bool
) -> list[tuple[str, str]]:
    """(rank 0) ``config.json`` (its dtype the saved floating tensors') and ``generation_config.json``
    in a temporary folder of out_dir: (temporary path, final name) for :func:`_write.commit`."""
    if original_format:
        try:
            converters = hf_conversions(model)[1]
        except Exception:  # no conversion mapping for this model
            converters = []
        if converters:
            logger.warning(
                "original_format=True: transformers' conversions (%d, e.g. fused MoE experts) are not "
                "reverted yet; the fused names are saved (load them back with rank0load or transformers)",
                len(converters),
            )
    folder = os.path.join(outputs.directory, f".rank0load-config.tmp-{outputs.token}")
    os.makedirs(folder)
    outputs.temps.append(folder)
    floats: dict[str, int] = {}
    for item in plan.items:
        if DTYPES[item.dtype].is_floating_point and DTYPES[item.dtype].itemsize > 1:
            floats[item.dtype] = floats.get(item.dtype, 0) + item.nbytes
    config: Any = copy.deepcopy(model.config)
    if floats:
        config.dtype = str(DTYPES[max(floats, key=lambda d: floats[d])]).removeprefix("torch.")
    config.save_pretrained(folder)
    generation: Any = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(folder)
    return [(os.path.join(folder, name), name) for name in sorted(os.listdir(folder))]


def _report(plan: SavePlan, clock: Clock, gathered: tuple[str, ...]) -> SaveReport:
    return SaveReport(
        tensors=len(plan.items),
        bytes=plan.total_size,
        seconds=time.perf_counter() - clock.started,
        stream_seconds=clock.phases.get("stream", 0.0),
        files=plan.files,
        skipped=plan.skipped,
        gathered_whole=gathered,
        phases=clock.phases,
        peak_rss_bytes=peak_rss_bytes(),
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
    )


def _log_summary(report: SaveReport) -> None:
    """(rank 0) A warning for what was gathered whole, then one INFO line."""
    if report.gathered_whole:
        logger.warning(
            "%d tensors were gathered whole on every rank (full_tensor), outside max_staging_bytes: "
            "their placements are not Shard(0)/Replicate: %s",
            len(report.gathered_whole),
            ", ".join(report.gathered_whole[:10]),
        )
    logger.info(
        "rank0load: saved %d tensors, %.2f GB in %d files in %.2f s (stream %.2f GB/s) over %d ranks, "
        "rank 0 peak RSS %.0f MB",
        report.tensors,
        report.bytes / 1e9,
        len(report.files),
        report.seconds,
        report.gb_per_s,
        report.world_size,
        report.peak_rss_bytes / 1e6,
    )
