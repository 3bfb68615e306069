"""``save_sharded``: write an FSDP2 model as a safetensors checkpoint, rank 0 alone writing.

all ranks  describe the model, layout flags, agree (same model, same options)  -> _meta, _layout, _distribute
rank 0     plan: saved names, dtypes, files split like huggingface_hub, headers -> _saveplan.plan_save
all ranks  rank 0's plan, or its error                                       -> _distribute.from_rank0
all ranks  allocate staging; rank 0 creates out_dir, the temporary files and
           their headers; settle                                               -> _outputs.Outputs.open
all ranks  stream: each rank sends its rows / TP blocks, rank 0 writes         -> _write.stream
rank 0     config.json, fsync, rename, index last, remove stale files; settle  -> _outputs.commit
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..common import _distribute
from ..common._report import Clock, peak_rss_bytes, progress_bar
from ..common._staging import DEFAULT_STAGING_BYTES, MIN_STAGING_BYTES
from ..errors import SaveError
from ..integrations import _peft
from ..integrations._compat import local_tensor
from ..integrations._convert import original_format_reversal
from ..model._layout import layout_flags
from ..model._meta import describe, strip_wrappers
from . import _outputs, _write
from ._saveplan import Revert, SaveKind, parse_size, plan_save

logger = logging.getLogger(__name__)


@dataclass
class SaveReport:
    """What a save did (on every rank; byte counts are the saved files')."""

    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    stream_seconds: float = 0.0
    files: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()  # model keys key_map mapped to None
    # DTensors no chunk of rows can describe (Partial, a non-contiguous local shard, 0-d), gathered
    # whole on every rank outside max_staging_bytes; never a Shard/_StridedShard/Replicate mix
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
    adapter: str | None = None,
) -> SaveReport:
    """Write ``model`` (FSDP2 or HSDP, sharded or not) to ``out_dir`` as a safetensors checkpoint
    that ``from_pretrained`` and :func:`load_sharded` read as it is.

    (all ranks) Every rank calls this with the same arguments; rank 0 alone writes. Each rank sends
    its own rows (or tensor-parallel blocks) to rank 0, point to point; replicas send once. Host RAM
    for staging is bounded by ``max_staging_bytes`` on every rank; only a DTensor no chunk can
    describe (``Partial``, a non-contiguous local shard, 0-d) is gathered whole with ``full_tensor()``
    on every rank, outside that bound (``SaveReport.gathered_whole``, warned).

    The files (and a transformers or diffusers model's config files) are named as the model's
    library names them. They are written under temporary names, fsynced and renamed, the index last;
    an earlier save's files of the same names are removed only then. On any failure the temporary
    files are removed and the previous checkpoint in ``out_dir`` is left as it was.

    Args:
        model: the model, the same on every rank.
        out_dir: the directory, needed on rank 0 only (created if missing).
        max_shard_size: the largest file (bytes, or ``"5GB"``-style as huggingface_hub parses it);
            a tensor larger than that gets a file of its own.
        dtype: a floating dtype for the saved floating tensors; integer, bool and float8 tensors are
            never cast. ``None``: as the model holds them.
        key_map: maps a model key (wrapper prefixes removed) to its saved name, or to None to skip it
            (called on rank 0). Tied parameters are saved once, under their first name.
        original_format: for a transformers model, revert transformers' conversions as
            ``save_pretrained`` does (fused MoE parameters saved per expert, renamed modules under
            their checkpoint names). For a ``PeftModel``, its base model is saved so, for the base
            model's ``from_pretrained``, and the adapters' tensors under the PeftModel's names, which
            ``load_sharded`` of the same PeftModel loads back. Applied to the names key_map returns.
            False: the model's own names (a PeftModel's included, with no config files).
        max_staging_bytes: host RAM for staging on each rank.
        adapter: the name of a PEFT adapter of a ``PeftModel`` (``"default"``): save that adapter
            alone in PEFT's layout (``adapter_model.safetensors``, ``adapter_config.json``), as
            ``PeftModel.save_pretrained`` does; same staging bound. Not with key_map. Embedding
            layers PEFT's "auto" would add are not saved.

    Returns:
        A :class:`SaveReport`, on every rank.

    Raises:
        SaveError: on every rank, with the same message, for a failure on any rank (out_dir not
            writable, disk full, a cast error, a rank that died); other LoadErrors for models that
            differ between ranks (``RankMismatchError``).
    """
    _distribute.require_process_group(SaveError)
    stem, write_configs = _outputs.layout_of(model, original_format, adapter)
    if adapter is not None:  # one file whatever its size, PEFT's names
        key_map = _adapter_names(model, adapter, key_map)
        max_shard_size, original_format = sys.maxsize, False
    clock, rank, out = Clock(), dist.get_rank(), os.fspath(out_dir)
    options = {"dtype": dtype, "max_shard_size": max_shard_size, "max_staging_bytes": max_staging_bytes}
    tensors, flags = _distribute.agree(_distribute.attempt(lambda: _describe(model, options)))
    clock("agree")
    plan = _distribute.from_rank0(
        lambda: plan_save(
            tensors,
            flags,
            key_map,
            options,
            _reversal(model, original_format),
            stem,
        ),
        lambda exc: SaveError(f"planning the checkpoint failed on rank 0: {type(exc).__name__}: {exc}"),
    )
    clock("plan")
    dtensors = (t for t in tensors.values() if isinstance(t, DTensor))
    mesh_device = next(
        (_distribute.mesh_device(t.device_mesh.device_type) for t in dtensors), torch.device("cpu")
    )

    outputs = _outputs.Outputs(out) if rank == 0 else None  # rank 0's, discarded below

    def prepare() -> _write.Staging:
        staging = _write.allocate_staging(plan.piece_bytes, mesh_device, max_staging_bytes)
        if outputs is not None:
            outputs.open(plan)
        return staging

    try:
        staging = _distribute.run(prepare, "creating the output files", _write.TODO, SaveError)
        with progress_bar(plan.total_size, show=rank == 0) as on_bytes:
            _write.stream(plan, tensors, outputs, staging, on_bytes)
        clock("stream")
        _distribute.run(
            lambda: _outputs.commit(outputs, plan, stem, write_configs) if outputs is not None else None,
            "committing the checkpoint",
            _write.TODO,
            SaveError,
        )
        clock("commit")
    finally:
        if outputs is not None:
            outputs.discard()  # nothing left once committed
    report = SaveReport(
        tensors=sum(len(i.saved) for i in plan.items),
        bytes=plan.total_size,
        seconds=time.perf_counter() - clock.started,
        stream_seconds=clock.phases.get("stream", 0.0),
        files=plan.files,
        skipped=plan.skipped,
        gathered_whole=tuple(i.key for i in plan.items if i.kind is SaveKind.GATHER),
        phases=clock.phases,
        peak_rss_bytes=peak_rss_bytes(),
        rank=rank,
        world_size=dist.get_world_size(),
    )
    if rank == 0:  # a warning for what was gathered whole, then one INFO line
        if report.gathered_whole:
            logger.warning(
                "%d tensors were gathered whole on every rank (full_tensor), outside max_staging_bytes: "
                "a Partial placement, a non-contiguous local shard or a 0-d DTensor: %s",
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
    return report


def _adapter_names(
    model: nn.Module, adapter: str, key_map: Callable[[str], str | None] | None
) -> Callable[[str], str | None]:
    """(all ranks) The key_map of a save of PEFT adapter ``adapter``: a model key to PEFT's name."""
    if key_map is not None:
        raise SaveError("save_sharded(adapter=...) saves under PEFT's names: drop key_map")
    _peft.peft_config(model, adapter)  # the same answer on every rank: raises everywhere or nowhere

    @functools.cache
    def names() -> dict[str, str]:  # (rank 0, while planning) model key -> PEFT's name
        return {strip_wrappers(k): v for k, v in _peft.adapter_names(model, adapter).items()}

    return lambda key: names().get(key)


def _describe(
    model: nn.Module, options: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], _distribute.Proposal]:
    """(all ranks) Check the options, then the model's tensors by canonical key, in the model's order
    (ModelLayout.tensors), and this rank's proposal."""
    dtype, staging = options["dtype"], options["max_staging_bytes"]
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise SaveError(f"dtype={dtype} is not a floating torch.dtype; integer tensors are never cast")
    if isinstance(staging, bool) or not isinstance(staging, int) or staging < MIN_STAGING_BYTES:
        raise SaveError(f"max_staging_bytes={staging!r} must be an int of at least {MIN_STAGING_BYTES}")
    parse_size(options["max_shard_size"])
    layout = describe(model)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    tensors = {k: params[k] if t.is_param else buffers[k] for k, t in layout.tensors.items()}
    # layout_flags of a contiguous local shard, so that each part of a chunk is a range of it
    flags = tuple(
        layout_flags(t, t.device_mesh) if isinstance(t, DTensor) and local_tensor(t).is_contiguous() else 0
        for t in tensors.values()
    )
    return tensors, _distribute.Proposal(layout.fingerprint(), options, flags)


def _reversal(model: nn.Module, original_format: bool) -> Revert | None:
    """(rank 0) With original_format, the model's conversions reverted (see ``save_sharded``)."""
    if not original_format:
        return None
    adapters = frozenset(strip_wrappers(k) for k in _peft.adapter_parameters(model))
    return original_format_reversal(model, adapters)
