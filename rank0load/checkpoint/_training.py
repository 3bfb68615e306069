"""A training checkpoint's files beside the model's, and their JSON (no collectives).

``out_dir/training_state/``: the optimizer's tensors as safetensors (``optimizer.safetensors``, or
``optimizer-0000i-of-0000n.safetensors`` and its index: never in ``out_dir`` itself, where a reader
that loads every ``*.safetensors`` would take them for weights) and ``training_state.json``: the
optimizer's class, param groups and non-tensor state, the caller's ``training_state``, and the save's
id, which every safetensors file of that save also carries in its ``__metadata__``: weights and
optimizer state of one save are one checkpoint.

(rank 0) :func:`read_training_record`, :func:`save_of`; (any rank) :func:`encode`, :func:`decode`.
"""

from __future__ import annotations

import base64
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointFormatError, CheckpointNotFoundError
from ._format import DTYPES, read_header_and_metadata

FOLDER = "training_state"  # in out_dir
RECORD = "training_state.json"
OPTIMIZER_STEM = "optimizer"
SAVE_ID = "rank0load_save"  # the __metadata__ key of every file of a training save: its id
SAVE_STEP = "rank0load_step"  # and its step, where known (for messages)
FORMAT = "rank0load.training_state"
VERSION = 1
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def encode(value: object, where: str = "training_state") -> object:
    """``value`` as JSON holds it: dicts with string keys, lists (tuples become lists), str, int,
    float (non-finite as ``{"__float__": "NaN"}``, as transformers writes configs), bool, None, and
    torch tensors (``{"__tensor__": ...}``: dtype, shape, the bytes in base64; small ones, such as
    ``torch.get_rng_state()``). Raises TypeError naming the first value JSON cannot hold."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"__float__": "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        if t.dtype not in _NAMES:
            raise TypeError(f"{where} is a tensor of dtype {t.dtype}, which safetensors cannot name")
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor__": [_NAMES[t.dtype], list(t.shape), base64.b64encode(data).decode()]}
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where} has key {k!r}, not a string: JSON objects have string keys")
            out[k] = encode(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(
        f"{where} is a {type(value).__name__}, which JSON cannot hold: pass dicts, lists, str, int, "
        "float, bool, None and small torch tensors (state_dict() of an lr scheduler, a step, an RNG state)"
    )


def decode(value: Any) -> Any:
    """:func:`encode` undone (tuples stay lists)."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if value.keys() == {"__float__"}:
        return float(value["__float__"])  # float() reads "NaN", "Infinity", "-Infinity"
    if value.keys() == {"__tensor__"}:
        dtype, shape, data = value["__tensor__"]
        raw = bytearray(base64.b64decode(data))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(DTYPES[dtype]).reshape(shape).clone()
    return {k: decode(v) for k, v in value.items()}


@dataclass(frozen=True)
class TrainingRecord:
    """``training_state.json``, read by rank 0 and shared with every rank."""

    folder: str  # out_dir/training_state, as rank 0 sees it
    save_id: str
    step: int | None  # the optimizer's step (or training_state["step"]) at the save, for messages
    optimizer: dict[str, Any] | None  # _optim.OptimizerRecord.as_json(); None: saved without one
    files: tuple[str, ...]  # the optimizer's safetensors files, in the folder
    training_state: Any  # encoded

    def as_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "save_id": self.save_id,
            "step": self.step,
            "optimizer": self.optimizer,
            "files": list(self.files),
            "training_state": self.training_state,
        }


def read_training_record(ckpt_dir: str | os.PathLike[str]) -> TrainingRecord:
    """(rank 0) ``ckpt_dir``'s ``training_state/training_state.json``, checked, and every optimizer
    file it names carrying its save id. Raises CheckpointNotFoundError / CheckpointFormatError."""
    folder = os.path.join(os.fspath(ckpt_dir), FOLDER)
    path = os.path.join(folder, RECORD)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{path} does not exist: {os.fspath(ckpt_dir)!r} holds no training state. Save one with "
            "rank0load.save_sharded(model, out_dir, optimizer=optimizer, training_state={...})"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointFormatError(f"{path} is not a rank0load training state (no format {FORMAT!r})")
    if data.get("version") != VERSION:
        raise CheckpointFormatError(
            f"{path} is version {data.get('version')!r} of the training state format; this rank0load "
            f"reads version {VERSION}: upgrade rank0load"
        )
    try:
        record = TrainingRecord(
            folder=folder,
            save_id=str(data["save_id"]),
            step=data["step"],
            optimizer=data["optimizer"],
            files=tuple(str(f) for f in data["files"]),
            training_state=data["training_state"],
        )
    except (KeyError, TypeError) as exc:
        raise CheckpointFormatError(f"{path} lacks a field or has one of the wrong type: {exc}") from None
    stored: dict[str, tuple[str, list[int]]] = {}  # the optimizer files' tensors: dtype, shape
    for name in record.files:
        if os.path.basename(name) != name or name in (".", ".."):
            raise CheckpointFormatError(f"{path} names optimizer file {name!r}, outside its folder")
        try:
            tensors, metadata = read_header_and_metadata(os.path.join(folder, name))
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{os.path.join(folder, name)} does not exist or cannot be opened, but {RECORD} lists it: "
                f"the training state is incomplete; resume from another checkpoint ({exc})"
            ) from None
        found = metadata.get(SAVE_ID)
        if found != record.save_id:
            raise CheckpointFormatError(
                f"{os.path.join(folder, name)} belongs to save {found or 'none'}, but {RECORD} to save "
                f"{record.save_id}: the training state folder mixes two saves (one was interrupted). "
                "Resume from another checkpoint, or from the weights alone"
            )
        stored.update({k: (t.dtype, list(t.shape)) for k, t in tensors.items()})
    listed = {f"state.{fqn}.{key}": (dtype, list(shape)) for fqn, key, shape, dtype in _tensors(record, path)}
    differ = sorted(k for k in listed.keys() & stored.keys() if listed[k] != stored[k])
    if listed.keys() != stored.keys() or differ:
        missing, extra = sorted(listed.keys() - stored.keys()), sorted(stored.keys() - listed.keys())
        what = (
            f"{missing[0]!r} is missing"
            if missing
            else f"{extra[0]!r} is not listed"
            if extra
            else f"{differ[0]!r} is {stored[differ[0]]} (dtype, shape) but {RECORD} lists {listed[differ[0]]}"
        )
        raise CheckpointFormatError(
            f"the optimizer files in {folder} do not hold the tensors {RECORD} lists: {what} "
            f"({len(missing)} missing, {len(extra)} not listed, {len(differ)} different). The folder was "
            "changed after the save: resume from another checkpoint, or from the weights alone"
        )
    return record


def save_metadata(save_id: str, step: int | None) -> dict[str, str]:
    """The ``__metadata__`` entries of every safetensors file of a training save."""
    return {SAVE_ID: save_id, **({SAVE_STEP: str(step)} if step is not None else {})}


def _tensors(record: TrainingRecord, path: str) -> list[tuple[str, str, list[int], str]]:
    """The tensor states the record lists: (parameter name, key, shape, dtype)."""
    if record.optimizer is None:
        return []
    try:
        return [(str(f), str(k), list(s), str(d)) for f, k, s, d in record.optimizer["tensors"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointFormatError(f"{path}: its optimizer's tensor list is malformed: {exc}") from None


def save_of(path: str) -> tuple[str | None, str | None]:
    """(rank 0) The save id and step in a safetensors file's ``__metadata__`` (None: it has none).
    Raises CheckpointNotFoundError / CheckpointFormatError."""
    metadata = read_header_and_metadata(path)[1]
    return metadata.get(SAVE_ID), metadata.get(SAVE_STEP)
