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
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..checkpoint._format import DTYPES
from ..checkpoint._training import FOLDER, OPTIMIZER_STEM, RECORD, TrainingRecord, encode, save_metadata
from ..common import _distribute
from ..common._report import Clock, peak_rss_bytes, progress_bar
from ..common._staging import DEFAULT_STAGING_BYTES, MIN_STAGING_BYTES
from ..errors import SaveError
from ..integrations import _peft
from ..integrations._compat import local_tensor
from ..integrations._convert import original_format_reversal
from ..model._layout import layout_flags
from ..model._meta import describe, strip_wrappers
from ..model._optim import OptimizerRecord, describe_optimizer
from . import _outputs, _write
from ._saveplan import Revert, SaveKind, SavePlan, parse_size, plan_save

_NAMES = {dtype: name for name, dtype in DTYPES.items()}

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
    # with optimizer= or training_state=: the optimizer's tensor states saved, their bytes, the save's id
    state_tensors: int = 0
    state_bytes: int = 0
    save_id: str | None = None

    @property
    def gb_per_s(self) -> float:
        """Bytes written per second of ``stream_seconds``, in GB/s (0.0 when nothing was written)."""
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
    optimizer: torch.optim.Optimizer | None = None,
    training_state: dict[str, Any] | None = None,
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
        optimizer: the model's optimizer (any ``torch.optim.Optimizer`` over the model's
            parameters): with the weights, in ``out_dir/training_state/``, its every tensor state as
            safetensors under torch's flattened names (``state.<fqn>.<key>``, full tensors: any world
            size restores them), streamed to rank 0 as the weights are, and its param groups and
            other state in ``training_state.json``. :func:`load_training_state` restores it.
        training_state: small state of the caller's to resume with (an lr scheduler's
            ``state_dict()``, the step, the data position, ``torch.get_rng_state()``): JSON values and
            small tensors; rank 0's is saved, and :func:`load_training_state` returns it.

    With ``optimizer`` or ``training_state``, the weights and the training state are one
    checkpoint: every file carries the save's id, and all of them are renamed into place only once
    every byte is written and fsynced, ``training_state.json`` last. Not with ``adapter``.

    Returns:
        A :class:`SaveReport`, on every rank.

    Raises:
        SaveError: on every rank, with the same message, for a failure on any rank (out_dir not
            writable, disk full, a cast error, a rank that died); other LoadErrors for models that
            differ between ranks (``RankMismatchError``).
    """
    _distribute.require_process_group(SaveError)
    training = optimizer is not None or training_state is not None
    if training and adapter is not None:
        raise SaveError(
            "save_sharded(adapter=...) saves an adapter alone; save the training state with the whole "
            "model (adapter=None, as load_sharded(..., adapter=) reads it back)"
        )
    stem, write_configs = _outputs.layout_of(model, original_format, adapter)
    if adapter is not None:  # one file whatever its size, PEFT's names
        key_map = _adapter_names(model, adapter, key_map)
        max_shard_size, original_format = sys.maxsize, False
    clock, rank, out = Clock(), dist.get_rank(), os.fspath(out_dir)
    options = {"dtype": dtype, "max_shard_size": max_shard_size, "max_staging_bytes": max_staging_bytes}
    tensors, flags = _distribute.agree(_distribute.attempt(lambda: _describe(model, options)))
    kept = _kept(model, optimizer, training_state, options) if training else None
    clock("agree")
    metadata = save_metadata(kept.record.save_id, kept.record.step) if kept is not None else None
    plan = _distribute.from_rank0(
        lambda: plan_save(
            tensors,
            flags,
            key_map,
            options,
            _reversal(model, original_format),
            stem,
            metadata,
        ),
        _planning_failed,
    )
    state_plan = None
    if kept is not None and kept.tensors:
        state_plan = _distribute.from_rank0(
            lambda: plan_save(kept.tensors, kept.flags, None, kept.options, None, OPTIMIZER_STEM, metadata),
            _planning_failed,
        )
    clock("plan")
    dtensors = (t for t in tensors.values() if isinstance(t, DTensor))
    mesh_device = next(
        (_distribute.mesh_device(t.device_mesh.device_type) for t in dtensors), torch.device("cpu")
    )

    outputs = _outputs.Outputs(out) if rank == 0 else None  # rank 0's, discarded below
    # rank 0's files of the training state, in their own folder, under the same temporary token
    state_outputs = (
        _outputs.Outputs(os.path.join(out, FOLDER), outputs.token) if outputs is not None and kept else None
    )

    def prepare() -> _write.Staging:
        staging = _write.allocate_staging(plan.piece_bytes, mesh_device, max_staging_bytes)
        if outputs is not None:
            outputs.open(plan)
        if state_outputs is not None and state_plan is not None:
            state_outputs.open(state_plan)
        return staging

    def commit() -> None:  # rank 0: everything written; the renames, the training state's record last
        assert outputs is not None
        record = None
        if state_outputs is not None and kept is not None:
            record = _outputs.write_temp(state_outputs, RECORD, kept.text(state_plan))
        _outputs.commit(outputs, plan, stem, write_configs)
        if state_outputs is not None and record is not None:
            if state_plan is not None:
                _outputs.commit(state_outputs, state_plan, OPTIMIZER_STEM, None)
            else:
                _outputs.remove_stale(state_outputs.directory, OPTIMIZER_STEM, set())
            _outputs.rename_last(state_outputs, record, RECORD)

    try:
        staging = _distribute.run(prepare, "creating the output files", _write.TODO, SaveError)
        with progress_bar(
            plan.total_size + (state_plan.total_size if state_plan else 0), show=rank == 0
        ) as on:
            _write.stream(plan, tensors, outputs, staging, on)
            if state_plan is not None and kept is not None:
                _write.stream(state_plan, kept.tensors, state_outputs, staging, on)
        clock("stream")
        _distribute.run(
            lambda: commit() if outputs is not None else None,
            "committing the checkpoint",
            _write.TODO,
            SaveError,
        )
        clock("commit")
    finally:
        for opened in (outputs, state_outputs):
            if opened is not None:
                opened.discard()  # nothing left once committed
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
        state_tensors=sum(len(i.saved) for i in state_plan.items) if state_plan else 0,
        state_bytes=state_plan.total_size if state_plan else 0,
        save_id=kept.record.save_id if kept is not None else None,
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


@dataclass
class _Kept:
    """A training save's state besides the weights: the optimizer's tensors by flattened name, their
    layout flags AND-ed over the ranks, their options, and rank 0's record (on every rank)."""

    tensors: dict[str, torch.Tensor]
    flags: tuple[int, ...]
    options: dict[str, Any]
    record: TrainingRecord

    def text(self, plan: SavePlan | None) -> str:
        """(rank 0) ``training_state.json``, naming ``plan``'s files."""
        record = replace(self.record, files=plan.files if plan is not None else ())
        return json.dumps(record.as_json(), separators=(",", ":"), allow_nan=False) + "\n"


def _kept(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    training_state: dict[str, Any] | None,
    options: dict[str, Any],
) -> _Kept:
    """(all ranks) Describe the optimizer's state on every rank and agree on it; then rank 0 makes the
    record (a new save id, the JSON of everything but the tensors), or every rank raises its error."""
    options = {**options, "dtype": None}  # optimizer states are saved as they are held

    def describe_state() -> tuple[
        tuple[dict[str, torch.Tensor], OptimizerRecord | None], _distribute.Proposal
    ]:
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise SaveError(f"optimizer={type(optimizer).__name__}: pass a torch.optim.Optimizer")
        if training_state is not None and not isinstance(training_state, dict):
            raise SaveError(f"training_state={type(training_state).__name__}: pass a dict")
        if optimizer is None:
            return ({}, None), _distribute.Proposal((), options, ())
        tensors, described = describe_optimizer(model, optimizer, _NAMES)
        flags = _flags(tensors)
        fingerprint = tuple(
            (k, tuple(t.shape), str(t.dtype), False, isinstance(t, DTensor)) for k, t in tensors.items()
        )
        return (tensors, described), _distribute.Proposal((fingerprint,), options, flags)

    (tensors, described), flags = _distribute.agree(_distribute.attempt(describe_state))

    def make_record() -> TrainingRecord:  # rank 0
        try:
            state = encode(training_state or {})
            optimizer_json = encode(described.as_json(), "the optimizer") if described else None
        except TypeError as exc:
            raise SaveError(f"the training state cannot be saved as JSON: {exc}") from None
        step = (training_state or {}).get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            steps = [t for k, t in tensors.items() if k.endswith(".step") and not isinstance(t, DTensor)]
            step = int(max(float(t) for t in steps)) if steps else None
        assert optimizer_json is None or isinstance(optimizer_json, dict)  # encode keeps a dict a dict
        return TrainingRecord(".", secrets.token_hex(8), step, optimizer_json, (), state)

    record = _distribute.from_rank0(make_record, _planning_failed)
    return _Kept(tensors, flags, options, record)


def _planning_failed(exc: Exception) -> SaveError:
    return SaveError(f"planning the checkpoint failed on rank 0: {type(exc).__name__}: {exc}")


def _flags(tensors: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """(all ranks) layout_flags of each contiguous local shard, so that each part of a chunk is a
    range of it; 0 for anything else."""
    return tuple(
        layout_flags(t, t.device_mesh) if isinstance(t, DTensor) and local_tensor(t).is_contiguous() else 0
        for t in tensors.values()
    )


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
    return tensors, _distribute.Proposal(layout.fingerprint(), options, _flags(tensors))


def _reversal(model: nn.Module, original_format: bool) -> Revert | None:
    """(rank 0) With original_format, the model's conversions reverted (see ``save_sharded``)."""
    if not original_format:
        return None
    adapters = frozenset(strip_wrappers(k) for k in _peft.adapter_parameters(model))
    return original_format_reversal(model, adapters)
