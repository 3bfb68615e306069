"""An optimizer's state as named tensors, as torch's flattened optimizer state dict names them
(``state.<fqn>.<key>``, ``flatten_optimizer_state_dict``), and back (all ranks; no collectives).

:func:`describe_optimizer` (save) lists every tensor state by name and keeps the rest (param groups,
non-tensor state) as :class:`OptimizerRecord`, which the save writes as JSON. :func:`state_targets`
(restore) checks a live optimizer against a saved record and allocates the tensors the load fills,
each sharded like its parameter; :func:`optimizer_state_dict` then makes what
``optimizer.load_state_dict`` takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import ModelMismatchError, format_keys
from ._meta import strip_wrappers

STATE = "state."  # every saved optimizer tensor's name starts so


@dataclass(frozen=True)
class StateSpec:
    """One saved tensor state: its parameter's name, its key in the parameter's state, its shape."""

    fqn: str
    key: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' dtype name (F32, BF16, ...)

    @property
    def name(self) -> str:
        return f"{STATE}{self.fqn}.{self.key}"


@dataclass(frozen=True)
class OptimizerRecord:
    """What a save keeps of an optimizer besides its tensors (JSON-able once encoded)."""

    cls: str  # the optimizer's class, module-qualified
    groups: tuple[dict[str, Any], ...]  # hyperparameters, "params": the parameters' names
    shapes: dict[str, tuple[int, ...]]  # each parameter's (global) shape, by name
    tensors: tuple[StateSpec, ...]  # the tensor states, in save order
    values: dict[str, dict[str, Any]]  # non-tensor states, by parameter name then key

    def as_json(self) -> dict[str, Any]:
        return {
            "class": self.cls,
            "param_groups": list(self.groups),
            "shapes": {k: list(v) for k, v in self.shapes.items()},
            "tensors": [[s.fqn, s.key, list(s.shape), s.dtype] for s in self.tensors],
            "values": self.values,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OptimizerRecord:
        return cls(
            cls=data["class"],
            groups=tuple(data["param_groups"]),
            shapes={k: tuple(v) for k, v in data["shapes"].items()},
            tensors=tuple(StateSpec(f, k, tuple(s), d) for f, k, s, d in data["tensors"]),
            values=dict(data["values"]),
        )

    @property
    def step(self) -> int | None:
        """The largest ``step`` state among the non-tensor values (tensor steps: see the save)."""
        steps = [v["step"] for v in self.values.values() if isinstance(v.get("step"), (int, float))]
        return int(max(steps)) if steps else None


def class_name(optimizer: object) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in ``model``, wrapper segments removed (as the model is saved)."""
    return {id(p): strip_wrappers(n) for n, p in model.named_parameters()}


def _names_of(model: nn.Module, optimizer: torch.optim.Optimizer, error: type[Exception]) -> list[list[str]]:
    """Each param group's parameter names; ``error`` for a parameter that is not the model's."""
    names = parameter_names(model)
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise error(
                f"param group {i} of the {type(optimizer).__name__} holds {len(missing)} parameters that are "
                f"not the model's (shapes {missing[:3]}): build the optimizer over model.parameters() of the "
                "model rank0load returned"
            )
        groups.append([names[id(p)] for p in group["params"]])
    return groups


def describe_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, dtype_name: Mapping[torch.dtype, str]
) -> tuple[dict[str, torch.Tensor], OptimizerRecord]:
    """(all ranks, at a save) Every tensor state by its flattened name (``state.<fqn>.<key>``), in
    param group order, and the rest. ``dtype_name``: torch dtype -> safetensors' name. Raises
    ModelMismatchError for a parameter that is not the model's, or one held by two groups."""
    names = _names_of(model, optimizer, ModelMismatchError)
    tensors: dict[str, torch.Tensor] = {}
    specs: list[StateSpec] = []
    values: dict[str, dict[str, Any]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    groups: list[dict[str, Any]] = []
    for group, fqns in zip(optimizer.param_groups, names):
        for p, fqn in zip(group["params"], fqns):
            if fqn in shapes:
                raise ModelMismatchError(f"parameter {fqn!r} is in two param groups of the optimizer")
            shapes[fqn] = tuple(p.shape)
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    spec = StateSpec(fqn, str(key), tuple(value.shape), dtype_name.get(value.dtype, "?"))
                    tensors[spec.name] = value
                    specs.append(spec)
                else:
                    values.setdefault(fqn, {})[str(key)] = value
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    record = OptimizerRecord(class_name(optimizer), tuple(groups), shapes, tuple(specs), values)
    return tensors, record


def state_targets(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    record: OptimizerRecord,
    dtypes: Mapping[str, torch.dtype],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """(all ranks, at a restore) Check ``optimizer`` against the saved ``record`` (class, groups,
    parameter names and shapes), then allocate each saved tensor state: one shaped like its parameter
    is sharded like it (a DTensor if the parameter is one), any other (a ``step``) is a plain tensor
    on ``device``. Raises ModelMismatchError, naming what differs and what to do; changes nothing."""
    where = "the saved training state"
    if class_name(optimizer) != record.cls:
        raise ModelMismatchError(
            f"the optimizer is a {class_name(optimizer)} but {where} holds a {record.cls}'s: build the "
            "same optimizer class as the run that saved it"
        )
    names = _names_of(model, optimizer, ModelMismatchError)
    if len(names) != len(record.groups):
        raise ModelMismatchError(
            f"the optimizer has {len(names)} param groups but {where} has {len(record.groups)}: build "
            "the optimizer with the same param groups as the run that saved it"
        )
    params: dict[str, torch.Tensor] = {}
    for i, (group, fqns, saved) in enumerate(zip(optimizer.param_groups, names, record.groups)):
        if fqns != list(saved["params"]):
            ours, theirs = set(fqns), set(saved["params"])
            detail = (
                f"only here: {format_keys(ours - theirs)}; only saved: {format_keys(theirs - ours)}"
                if ours != theirs
                else "the same parameters in another order"
            )
            raise ModelMismatchError(
                f"param group {i} of the optimizer does not hold the parameters {where} has ({detail}): "
                "build the optimizer over the same parameters, in the same groups and order"
            )
        params.update(zip(fqns, group["params"]))
    shapes = {f: tuple(p.shape) for f, p in params.items() if tuple(p.shape) != record.shapes[f]}
    if shapes:
        first = sorted(shapes)[0]
        raise ModelMismatchError(
            f"{len(shapes)} parameters have other shapes than in {where}: {first!r} is "
            f"{shapes[first]} here but was saved as {record.shapes[first]}. Load the model from the "
            "same checkpoint as the training state"
        )
    targets: dict[str, torch.Tensor] = {}
    for spec in record.tensors:
        param, dtype = params[spec.fqn], dtypes[spec.dtype]
        if spec.shape == tuple(param.shape) and spec.shape:
            targets[spec.name] = torch.zeros_like(param, dtype=dtype, requires_grad=False)
        else:
            targets[spec.name] = torch.zeros(spec.shape, dtype=dtype, device=device)
    return targets


def _like(current: object, saved: object) -> object:
    """A saved hyperparameter given the kind of the live optimizer's value (JSON made tuples lists)."""
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    if isinstance(current, torch.Tensor) and not isinstance(saved, torch.Tensor):
        return torch.tensor(saved, dtype=current.dtype, device=current.device)
    return saved


def optimizer_state_dict(
    optimizer: torch.optim.Optimizer, record: OptimizerRecord, loaded: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """(all ranks) What ``optimizer.load_state_dict`` takes: the saved groups' hyperparameters and
    every state (``loaded``: the tensors by name, a non-capturable ``step`` back on the CPU, where the
    optimizer keeps it), by position in the optimizer's own order."""
    state: dict[int, dict[str, Any]] = {}
    index: dict[str, int] = {}
    groups = []
    for group, saved in zip(optimizer.param_groups, record.groups):
        positions = []
        for fqn in saved["params"]:
            index[fqn] = len(index)
            positions.append(index[fqn])
        groups.append({k: _like(group.get(k), v) for k, v in saved.items() if k != "params"})
        groups[-1]["params"] = positions
    for fqn, values in record.values.items():
        state.setdefault(index[fqn], {}).update(values)
    for spec in record.tensors:
        value = loaded[spec.name]
        if not isinstance(value, DTensor) and value.ndim == 0 and value.device.type != "cpu":
            value = value.cpu()  # load_state_dict moves it back for fused / capturable optimizers
        state.setdefault(index[spec.fqn], {})[spec.key] = value
    return {"state": state, "param_groups": groups}
