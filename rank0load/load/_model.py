"""The model around the stream: build and shard it, allocate its shards, initialise what the
checkpoint lacks, and put it back together afterwards (all ranks; no collectives). In load order:
:func:`build_sharded`, :func:`materialise`, :func:`init_missing`, :func:`apply_built`; then :func:`finish`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from ..common._failure import UserCodeFailure, user_code
from ..common._memory import FaultIn
from ..errors import LoadError, ModelMismatchError, RankMismatchError, format_keys
from ..integrations._compat import (
    clear_hf_initialized,
    diffusers_keep_in_fp32,
    hf_init_weights,
    hf_keep_in_fp32,
    is_diffusers_class,
    is_transformers_model,
    local_tensor,
    peft_base_model,
)
from ..integrations._convert import conversions_for
from ..integrations._peft import tuner_layers_without_values
from ..model._layout import layout_flags_of
from ..model._meta import ModelLayout, build_on_meta, describe, resolve_module
from ..model._shard import prepare_groups, refuse_integer_parameters, routed_modules, shard_default


@dataclass
class Built:
    """One rank's model after building and sharding, before any data moves."""

    model: nn.Module
    layout: ModelLayout
    flags: dict[str, int]  # canonical key -> _layout.layout_flags on this rank
    conversions: list[Any]  # _convert: for rank 0's manifest
    # canonical key -> the value model_fn built it with (PEFT adapters), full size, on the CPU
    real_values: dict[str, torch.Tensor]


def build_sharded(
    model_fn: Callable[[], nn.Module],
    mesh: DeviceMesh,
    shard_fn: Callable[[nn.Module, DeviceMesh], object] | None,
    dtype: torch.dtype | None,
    conversions: Sequence[Any],
    rng_state: torch.Tensor | None,
) -> Built:
    """(all ranks) ``model_fn()`` on meta (PEFT adapters built for real from ``rng_state``), cast
    to ``dtype``, sharded by ``shard_fn`` (or the default policy), described with each tensor's
    layout flags; conversions are looked up before sharding renames the classes. Raises
    ModelMismatchError for PEFT adapters built without values, and whatever the caller's code raises."""
    model, values = build_on_meta(model_fn, dtype, rng_state)
    unbuilt = tuner_layers_without_values(model, set(values))
    if unbuilt:
        raise ModelMismatchError(
            f"PEFT adapter parameters {format_keys(unbuilt)} were not built with values: import peft "
            "before calling load_sharded (not inside model_fn), and use an adapter initialisation that "
            "does not read the base weights (init_lora_weights=True or 'gaussian'; not PiSSA, OLoRA, "
            "LoftQ, EVA, CorDA or DoRA, whose base weights are not loaded yet), or pass adapter= to load "
            "a trained adapter."
        )
    if dtype is not None:
        cast(model, dtype, built=frozenset(id(model.get_parameter(k)) for k in values))
    keys = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    found_conversions = conversions_for(model, keys, conversions)
    routed = routed_modules(model)  # before sharding renames the classes blocks are found by
    if shard_fn is None:
        shard_default(model, mesh, routed)
    else:
        try:
            user_code("shard_fn", shard_fn, model, mesh)
        except UserCodeFailure as exc:
            refuse_integer_parameters(model, exc)  # torch < 2.12 says why, and what to do
            raise
    prepare_groups(model, routed)
    layout = describe(model, values)
    flags = layout_flags_of(targets(model, layout), mesh)
    real_values = {layout.canonical(k) or k: v for k, v in values.items()}
    return Built(model, layout, flags, found_conversions, real_values)


def cast(
    model: nn.Module, dtype: torch.dtype, built: frozenset[int] = frozenset(), as_built: bool = False
) -> None:
    """(all ranks, after ``model_fn`` ran with ``dtype`` as torch's default dtype) The model as its
    library's ``from_pretrained(dtype=...)`` makes it: a transformers model's floating parameters and
    persistent buffers in ``dtype`` (float8 as they are, ``_keep_in_fp32_modules`` in float32; with
    ``as_built``, in the dtype they were built with but those: transformers 4.57's ``from_pretrained``
    loads each tensor in its meta model's dtype, so a parameter made with an explicit dtype keeps it,
    as Apertus' XIELU alpha in bf16); a
    diffusers model's likewise, float8 included; any other model as ``model.to(dtype)``. The
    caller's config object is left alone. Under a PEFT model the base model is cast so; ``built``
    (ids of PEFT's adapters, built with real values) keep the dtype PEFT gave them."""
    base = peft_base_model(model)
    transformers = is_transformers_model(base)
    library = transformers or is_diffusers_class(type(base))  # else: every tensor, as model.to(dtype)
    keep_in_fp32 = hf_keep_in_fp32 if transformers else diffusers_keep_in_fp32
    keep = keep_in_fp32(base, dtype) if library else None
    as_built = as_built and transformers
    for module_name, module in (base if library else model).named_modules():
        prefix = f"{module_name}." if module_name else ""
        for leaf, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is None or id(t) in built or not t.is_floating_point():
                continue
            if transformers and t.element_size() == 1:
                continue
            if library and leaf in module._non_persistent_buffers_set:
                continue
            want = (
                torch.float32 if keep is not None and keep(prefix + leaf) else t.dtype if as_built else dtype
            )
            if t.dtype != want and leaf in module._parameters:
                t.data = t.data.to(want)
            elif t.dtype != want:
                module._buffers[leaf] = t.to(want)


def set_config_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """``config.dtype`` (and its sub-configs'), as ``from_pretrained(dtype=...)`` records it."""
    config = getattr(model, "config", None)
    if config is None:
        return
    config.dtype = dtype
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "dtype"):
            sub.dtype = dtype


def targets(model: nn.Module, layout: ModelLayout) -> dict[str, torch.Tensor]:
    """Canonical key -> the model's tensor (DTensor parameter, plain parameter or buffer)."""
    out: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    for key, info in layout.tensors.items():
        prefix, _, leaf = key.rpartition(".")
        module = modules[prefix]
        out[key] = module._parameters[leaf] if info.is_param else module._buffers[leaf]  # type: ignore[assignment]
    return out


def materialise(model: nn.Module, device: torch.device) -> FaultIn:
    """(all ranks) Allocate every local shard on ``device`` (``to_empty``), keeping the real buffers
    model_fn built, made contiguous. The shards are faulted in by a background thread: wait on what
    this returns before anything is written to a parameter. Raises LoadError if a plain parameter
    is not contiguous."""
    saved = [(m, name, buf) for m in model.modules() for name, buf in m._buffers.items() if buf is not None]
    model.to_empty(device=device)
    faulting = FaultIn(local_tensor(p) for p in model.parameters())
    moved: dict[int, torch.Tensor] = {}
    for module, name, buf in saved:
        new = moved.get(id(buf))
        if new is None:
            new = moved[id(buf)] = buf.to(device).contiguous()
        module._buffers[name] = new
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) and not p.is_contiguous():
            faulting.wait()
            raise LoadError(f"parameter {name!r} is not contiguous after allocation")
    return faulting


def apply_built(model: nn.Module, values: dict[str, torch.Tensor], keys: Sequence[str]) -> None:
    """(all ranks, after :func:`materialise`) Put the values model_fn built (PEFT adapters; the same
    on every rank) into the allocated shards of ``keys``, each rank its own part, no communication."""
    with torch.no_grad():
        for key in keys:
            param = model.get_parameter(key)
            value = values[key].to(param.dtype)
            if isinstance(param, DTensor):
                part = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
                local_tensor(param).copy_(local_tensor(part))
            else:
                param.copy_(value)


def _has_nan(t: torch.Tensor) -> bool:
    return t.is_floating_point() and bool(torch.isnan(local_tensor(t)).any())


def init_missing(model: nn.Module, layout: ModelLayout, missing: tuple[str, ...]) -> None:
    """(all ranks, strict=False) Give parameters absent from the checkpoint the model's own init:
    the nearest ancestor's ``_init_weights(module)``, else the owning module's ``reset_parameters()``.
    Floating parameters are first filled with NaN, so one neither wrote raises ModelMismatchError.
    Runs before streaming: loaded values win."""
    owners: dict[str, tuple[nn.Module, list[torch.Tensor]]] = {}
    for key in missing:
        if layout.tensors[key].is_param:
            module, leaf = resolve_module(model, key)
            owners.setdefault(key.rpartition(".")[0], (module, []))[1].append(getattr(module, leaf))
    left: list[str] = []
    with torch.no_grad():
        for module_name, (module, params) in owners.items():
            clear_hf_initialized(module, params)
            for t in params:
                if t.is_floating_point():
                    local_tensor(t).fill_(float("nan"))
            init = hf_init_weights(model, module_name)
            if init is not None:
                user_code(f"the model's _init_weights({module_name})", init, module)
            reset = getattr(module, "reset_parameters", None)
            if callable(reset) and (init is None or any(_has_nan(t) for t in params)):
                user_code(f"{module_name}.reset_parameters()", reset)
            left += [
                f"{module_name}.{n}" for n, t in module._parameters.items() if t is not None and _has_nan(t)
            ]
    if left:  # load_sharded's agreement step raises this on every rank
        raise ModelMismatchError(
            "strict=False: parameters absent from the checkpoint were not initialised by the model's "
            f"_init_weights() or reset_parameters(): {left[:10]}. Give their "
            "module a reset_parameters() or add them to the checkpoint."
        )


def finish(model: nn.Module, layout: ModelLayout) -> None:
    """(all ranks) Re-tie every name of a tied parameter to one object (``to_empty`` and FSDP2 can
    split them); raises RankMismatchError if anything is left on meta. Then, at the model's first
    forward, raise LoadError if trainable parameters were added after the load as plain tensors
    (``get_peft_model`` on the loaded model: unsharded, drawn differently per rank). Every rank finds
    the same names, so every rank raises; the hook then goes."""
    for first, *rest in layout.tie_groups:
        module, leaf = resolve_module(model, first)
        store = "_parameters" if layout.tensors[first].is_param else "_buffers"
        primary = getattr(module, store)[leaf]
        for name in rest:
            module, leaf = resolve_module(model, name)
            getattr(module, store)[leaf] = primary
    left = [n for n, p in model.named_parameters() if p.is_meta or local_tensor(p).is_meta]
    left += [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise RankMismatchError(f"tensors left on meta after loading: {format_keys(left)}")
    known = set(layout.tensors) | set(layout.aliases)
    handles: list[Any] = []

    def check(module: nn.Module, args: object) -> None:
        added = [
            name
            for name, p in model.named_parameters()
            if name not in known and p.requires_grad and not isinstance(p, DTensor)
        ]
        if added:
            raise LoadError(
                f"trainable parameters {format_keys(added)} were added after load_sharded returned, as "
                "plain tensors: they are not sharded, their gradients are not synchronised and each rank "
                "drew its own values, so the ranks would drift apart (get_peft_model on a loaded model "
                "does this). Build the PeftModel in model_fn: load_sharded(lambda: "
                "get_peft_model(base(), config), ckpt_path, mesh); the base checkpoint loads into it as it is."
            )
        for handle in handles:
            handle.remove()

    # On every FSDP unit, not only the root: a PEFT wrapper calls the root's forward() directly,
    # which runs no hook of the root's, while each block's still runs.
    for module in model.modules():
        if module is model or isinstance(module, FSDPModule):
            handles.append(module.register_forward_pre_hook(check))
