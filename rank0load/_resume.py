"""``load_training_state``: an optimizer's state (and the caller's) restored from a training save,
through the load's own stream, one step per line.

rank 0     read training_state.json; check it and the weights are one save  -> _training, _manifest
all ranks  rank 0's record, or its error                                    -> _distribute.from_rank0
all ranks  check the optimizer against it; allocate each state like its parameter -> _optim.state_targets
rank 0     open the optimizer's files while the others allocate             -> _manifest.open_checkpoint
all ranks  agree: same state, same options, or all raise                    -> _distribute.agree
all ranks  rank 0 matches the headers; each rank receives its own shards    -> _api.stream_checkpoint
all ranks  optimizer.load_state_dict, or every rank raises                  -> _distribute.run
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ._api import ACCELERATOR_STAGING_BYTES, stream_checkpoint
from .checkpoint._format import DTYPES
from .checkpoint._manifest import Checkpoint, open_checkpoint, read_manifest, unforeseen
from .checkpoint._training import (
    OPTIMIZER_STEM,
    SAVE_ID,
    TrainingRecord,
    decode,
    read_training_record,
    save_of,
)
from .common import _distribute
from .common._report import Clock
from .common._staging import DEFAULT_STAGING_BYTES
from .errors import LoadError, ModelMismatchError
from .model._layout import layout_flags_of
from .model._meta import ModelLayout, TensorInfo
from .model._optim import OptimizerRecord, optimizer_state_dict, state_targets

logger = logging.getLogger(__name__)

_UNCHANGED = "The optimizer was not changed; fix the cause and call load_training_state again."


def load_training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ckpt_path: str | os.PathLike[str],
    *,
    mesh: DeviceMesh | None = None,
    max_staging_bytes: int | None = None,
    local_reads: bool = True,
) -> dict[str, Any]:
    """Restore ``optimizer``'s state and return the ``training_state`` that
    ``save_sharded(model, ckpt_path, optimizer=..., training_state=...)`` saved.

    (all ranks) Every rank calls this with the same arguments, after ``model`` was loaded from the
    same save (:func:`load_sharded` or :func:`load_pretrained` of ``ckpt_path``) and ``optimizer``
    was built over its parameters as in the run that saved (same class and param groups; the
    hyperparameters are restored). Only rank 0 reads ``ckpt_path``; each rank receives only its own
    shards of each state, which is sharded like its parameter: the files hold full tensors, so any
    mesh and world size restores them. Host RAM is bounded as for the load.

    Args:
        model: the model the optimizer trains, as rank0load loaded it.
        optimizer: the optimizer to restore, or None to read back ``training_state`` alone.
        ckpt_path: the directory ``save_sharded`` wrote (read on rank 0 only).
        mesh: the device mesh the model was loaded on. ``None``: that of the model's first
            DTensor parameter.
        max_staging_bytes: host RAM for staging on each rank, as in :func:`load_sharded`.
        local_reads: as in :func:`load_sharded`.

    Returns:
        The saved ``training_state`` (the same on every rank; tuples come back as lists).

    Raises:
        LoadError: on every rank, with the same message, before the optimizer changes:
            ``CheckpointNotFoundError`` when ``ckpt_path`` holds no training state,
            ``ModelMismatchError`` for an optimizer whose class, param groups, parameters or shapes
            differ from the saved one, for a missing state, and for weights that come from another
            save than the training state; ``CheckpointFormatError`` for damaged files.
    """
    _distribute.require_process_group()
    clock, rank = Clock(), dist.get_rank()
    mesh = mesh if mesh is not None else _mesh_of(model)
    if max_staging_bytes is None:
        max_staging_bytes = DEFAULT_STAGING_BYTES if mesh.device_type == "cpu" else ACCELERATOR_STAGING_BYTES
    record = _distribute.from_rank0(
        lambda: _read_record(ckpt_path, model, optimizer), lambda exc: unforeseen(ckpt_path, exc)
    )
    saved = OptimizerRecord.from_json(decode(record.optimizer)) if record.optimizer is not None else None
    options: dict[str, object] = {
        "max_staging_bytes": max_staging_bytes,
        "local_reads": local_reads,
        "optimizer": saved is not None,
    }
    device = _distribute.mesh_device(mesh.device_type)
    building = _distribute.attempt(lambda: _allocate(model, optimizer, saved, device, mesh, options))
    loaded: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as opened:
        checkpoint = _distribute.Outcome[Checkpoint]()
        files = os.path.join(record.folder, _index_or_file(record))
        if rank == 0 and building.error is None and record.files:
            checkpoint = _distribute.attempt(lambda: open_checkpoint(files, None, opened, lambda: ()))
        (layout, targets), flags = _distribute.agree(building)
        clock("agree")
        if record.files:
            agreed = dict(zip(targets, flags))

            def entries_of(manifest: Any) -> tuple[list[torch.Tensor], list[int]]:
                return [targets[e.key] for e in manifest.entries], [agreed[e.key] for e in manifest.entries]

            stream_checkpoint(
                opened,
                checkpoint,
                files,
                lambda c: read_manifest(c, layout, True, None, ()),
                entries_of,
                mesh,
                max_staging_bytes,
                local_reads,
                clock,
            )
            loaded = targets
    if optimizer is not None and saved is not None:
        _distribute.run(
            lambda: optimizer.load_state_dict(optimizer_state_dict(optimizer, saved, loaded)),
            "restoring the optimizer's state",
            _UNCHANGED,
            ModelMismatchError,
        )
    clock("restore")
    if rank == 0:
        logger.info(
            "rank0load: restored the training state of save %s (step %s): %d optimizer tensors in %.2f s",
            record.save_id,
            record.step,
            len(loaded),
            sum(clock.phases.values()),
        )
    result = decode(record.training_state)
    return result if isinstance(result, dict) else {}


def _mesh_of(model: nn.Module) -> DeviceMesh:
    """The mesh of the model's first DTensor parameter; else a 1-D mesh over the world."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    return init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))


def _index_or_file(record: TrainingRecord) -> str:
    """The optimizer's files as the loader resolves them: the index of several, else the one file."""
    if len(record.files) > 1:
        return f"{OPTIMIZER_STEM}.safetensors.index.json"
    return record.files[0] if record.files else ""


def _read_record(
    ckpt_path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> TrainingRecord:
    """(rank 0) The training save's record, checked against the save the model's weights came from
    (LoadReport.files' save id); a warning where the model was not loaded by rank0load."""
    record = read_training_record(ckpt_path)
    if optimizer is not None and record.optimizer is None:
        raise ModelMismatchError(
            f"{os.fspath(ckpt_path)!r} was saved without an optimizer: pass optimizer=None to read its "
            "training_state alone, or resume from a save made with save_sharded(..., optimizer=...)"
        )
    report = getattr(model, "rank0load_report", None)
    weights = getattr(report, "files", ())
    if not weights:
        logger.warning(
            "the model was not loaded by rank0load: cannot check that its weights come from the save of "
            "%s (save %s)",
            ckpt_path,
            record.save_id,
        )
        return record
    found, step = save_of(weights[0])
    if found != record.save_id:
        saved_as = f"save {found}, step {step}" if found else "not a training save"
        raise ModelMismatchError(
            f"the model's weights ({weights[0]}: {saved_as}) and the "
            f"training state in {os.fspath(ckpt_path)!r} (save {record.save_id}, step {record.step}) come "
            f"from different saves: load the model from {os.fspath(ckpt_path)!r} too, so that weights "
            f"and optimizer state are of one step ({SAVE_ID} in the files' metadata)"
        )
    return record


def _allocate(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    saved: OptimizerRecord | None,
    device: torch.device,
    mesh: DeviceMesh,
    options: dict[str, object],
) -> tuple[tuple[ModelLayout, dict[str, torch.Tensor]], _distribute.Proposal]:
    """(all ranks) Check the optimizer and allocate its states (:func:`_optim.state_targets`), described
    as a layout the manifest is matched against; this rank's proposal."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise LoadError(f"optimizer={type(optimizer).__name__}: pass a torch.optim.Optimizer, or None")
    if optimizer is None or saved is None:
        targets: dict[str, torch.Tensor] = {}
    else:
        targets = state_targets(model, optimizer, saved, DTYPES, device)
    layout = ModelLayout(
        tensors={
            k: TensorInfo(tuple(t.shape), t.dtype, True, isinstance(t, DTensor)) for k, t in targets.items()
        },
        aliases={},
        tie_groups=(),
        non_persistent=frozenset(),
        initialisable=frozenset(),
        built=frozenset(),
    )
    flags = layout_flags_of(targets, mesh)
    return (layout, targets), _distribute.Proposal(layout.fingerprint(), options, tuple(flags.values()))
