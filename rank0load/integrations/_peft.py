"""What rank0load knows about PEFT: adapters built for real while the base model stays on meta (all
ranks, inside ``_meta.build_on_meta``), a PeftModel's names (any rank), PEFT's files (rank 0).
peft is imported only for a model that uses it; no collectives.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import CheckpointFormatError, CheckpointNotFoundError, ModelMismatchError
from ._compat import parse_to

_ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# What a PEFT model adds to its base model's names: a prefix, and (possibly nested) segments inside.
_PEFT_PREFIX = "base_model.model."
_PEFT_SEGMENTS = frozenset(("base_layer", "original_module"))

_state = threading.local()  # .depth: how many inject_adapter calls of this thread are running


def building_adapters() -> bool:
    """Whether a PEFT tuner is injecting adapters on this thread (parameters are then registered real)."""
    return getattr(_state, "depth", 0) > 0


class _KeepOffMeta(TorchFunctionMode):
    """``tensor.to(<meta>, dtype)`` of a real tensor becomes ``tensor.to(dtype)``: PEFT moves a new
    adapter to its base layer's device (meta here); the cast is kept, the values too."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor) and not args[0].is_meta:
            device, dtype = parse_to(*args[1:], **kwargs)
            if device is not None and torch.device(device).type == "meta":
                return args[0].to(dtype=dtype) if dtype is not None else args[0]
        return func(*args, **kwargs)


# BaseTuner's methods that create or replace adapter parameters (injecting, and upcasting to float32)
_BUILDERS = ("inject_adapter", "_cast_adapter_dtype")


def _injecting(original: Callable[..., Any], outer_dtype: torch.dtype) -> Callable[..., Any]:
    @functools.wraps(original)
    def builder(self: Any, *args: Any, **kwargs: Any) -> Any:
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(outer_dtype)  # get_peft_model runs outside from_pretrained's dtype
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            with _KeepOffMeta():
                return original(self, *args, **kwargs)
        finally:
            _state.depth -= 1
            torch.set_default_dtype(dtype)

    builder.__rank0load_wrapped__ = original  # type: ignore[attr-defined]
    return builder


def _subclasses(cls: type) -> Iterator[type]:
    yield cls
    subs: list[type] = cls.__subclasses__()
    for sub in subs:
        yield from _subclasses(sub)


@contextlib.contextmanager
def adapters_built_real(outer_dtype: torch.dtype) -> Iterator[None]:
    """(all ranks, around ``model_fn``; the caller holds ``_compat._patch_lock``) Every PEFT tuner
    builds and upcasts its adapters for real, with ``outer_dtype`` as torch's default dtype. A no-op
    when peft is not imported yet (:func:`tuner_layers_without_values` catches that case)."""
    if "peft" not in sys.modules:
        yield
        return
    from peft.tuners.tuners_utils import BaseTuner

    patched: list[tuple[type, str, Callable[..., Any]]] = []
    for cls in set(_subclasses(BaseTuner)):
        for method in _BUILDERS:
            own = cls.__dict__.get(method)
            if own is not None and not hasattr(own, "__rank0load_wrapped__"):
                patched.append((cls, method, own))
                setattr(cls, method, _injecting(own, outer_dtype))
    try:
        yield
    finally:
        for cls, method, own in patched:
            setattr(cls, method, own)


def base_key(key: str) -> str:
    """A PeftModel's key as its base model and the base model's checkpoints spell it:
    ``"base_model.model.model.layers.0.q_proj.base_layer.weight"`` -> ``"model.layers.0.q_proj.weight"``;
    any other key as it is."""
    if not key.startswith(_PEFT_PREFIX):
        return key
    return ".".join(p for p in key.removeprefix(_PEFT_PREFIX).split(".") if p not in _PEFT_SEGMENTS)


def _adapter_holders(model: nn.Module, wrappers: bool) -> Iterator[tuple[str, nn.Module]]:
    """(qualified name, module) of every module holding a PEFT tuner layer's adapter tensors, and with
    ``wrappers`` an ``AuxiliaryTrainingWrapper``'s (``modules_to_save``, trainable tokens)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    kinds = (BaseTunerLayer, AuxiliaryTrainingWrapper) if wrappers else (BaseTunerLayer,)
    for name, module in model.named_modules():
        if not isinstance(module, kinds):
            continue
        for attr in (*module.adapter_layer_names, *getattr(module, "other_param_names", ())):
            holder: Any = module
            for part in attr.split("."):  # "token_adapter.trainable_tokens_delta"
                holder = getattr(holder, part, None)
            if isinstance(holder, nn.Module):  # not "r", "scaling": plain dicts
                yield (f"{name}.{attr}" if name else attr), holder


def adapter_parameters(model: nn.Module) -> frozenset[str]:
    """Names of every adapter parameter and buffer of a PeftModel (what its base lacks); else empty."""
    if "peft" not in sys.modules:
        return frozenset()
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return frozenset()
    out: set[str] = set()
    for prefix, holder in _adapter_holders(model, wrappers=True):
        out.update(f"{prefix}.{leaf}" for leaf, _ in holder.named_parameters())
        out.update(f"{prefix}.{leaf}" for leaf, _ in holder.named_buffers())
    return frozenset(out)


def tuner_layers_without_values(model: nn.Module, built: set[str]) -> list[str]:
    """(all ranks) Adapter parameters of PEFT tuner layers not built for real (peft imported late, or
    an initialisation that needs the meta base weights: PiSSA, OLoRA, LoftQ, EVA, DoRA's magnitude)."""
    if "peft" not in sys.modules:
        return []
    holders = _adapter_holders(model, wrappers=False)
    keys = (f"{prefix}.{leaf}" for prefix, holder in holders for leaf, _ in holder.named_parameters())
    return [key for key in keys if key not in built]


def peft_config(model: nn.Module, adapter_name: str) -> Any:
    """The model's config of ``adapter_name`` (a PeftModel's ``peft_config``)."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or adapter_name not in configs:
        have = sorted(configs) if isinstance(configs, dict) else []
        raise ModelMismatchError(
            f"the model has no PEFT adapter named {adapter_name!r} (it has {have or 'none'}): build the "
            "PeftModel in model_fn (get_peft_model(base, config, adapter_name=...)) with that adapter."
        )
    return configs[adapter_name]


def adapter_names(model: nn.Module, adapter_name: str) -> dict[str, str]:
    """(rank 0, for an adapter :func:`peft_config` found) Model key -> its name in PEFT's adapter file
    for ``adapter_name`` (``get_peft_model_state_dict`` on placeholders: no tensor is read or copied)."""
    from peft.utils import get_peft_model_state_dict

    placeholders = {k: torch.empty(0, device="meta") for k in model.state_dict(keep_vars=True)}
    by_id = {id(v): k for k, v in placeholders.items()}
    saved = get_peft_model_state_dict(
        model, state_dict=placeholders, adapter_name=adapter_name, save_embedding_layers=False
    )
    names: dict[str, str] = {}
    for name, value in saved.items():
        key = by_id.get(id(value))
        if key is None:
            raise ModelMismatchError(
                f"PEFT names the adapter tensor {name!r}, which is not one of the model's tensors as it "
                "is: this PEFT method transforms its state dict, which rank0load cannot read or write "
                "in PEFT's layout. Save the full model with save_sharded instead."
            )
        names[key] = name
    return names


# What decides the adapter's tensors and its output: differences here are not a loadable adapter.
_COMPARED = (
    "peft_type",
    "r",
    "lora_alpha",
    "target_modules",
    "target_parameters",  # LoRA on fused MoE experts (PEFT's ParamWrapper)
    "use_rslora",
    "use_dora",
    "bias",
    "modules_to_save",
)


def check_adapter_config(model: nn.Module, adapter_name: str, root: str, folder: str) -> None:
    """(rank 0) ``adapter_config.json`` of the PEFT adapter folder ``root`` (``folder``: as the caller
    named it) must describe the model's adapter ``adapter_name``: CheckpointNotFoundError without one,
    CheckpointFormatError for one that is not a JSON object, ModelMismatchError for another adapter."""
    path = os.path.join(root, _ADAPTER_CONFIG)
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"adapter {root!r} has no {_ADAPTER_CONFIG}: pass the folder PEFT's save_pretrained (or "
            "rank0load.save_sharded(model, out_dir, adapter=...)) wrote."
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"{path}: cannot be read as JSON ({exc}); re-save the adapter.") from None
    if not isinstance(found, dict):
        raise CheckpointFormatError(f"{path}: holds {type(found).__name__}, not a JSON object")
    want = peft_config(model, adapter_name).to_dict()
    differ = []
    for field in _COMPARED:
        if field not in want or field not in found:
            continue
        a, b = _comparable(want[field]), _comparable(found[field])
        if a != b:
            differ.append(f"{field}: the model has {_shown(a)}, the adapter {_shown(b)}")
    if differ:
        raise ModelMismatchError(
            f"adapter {folder!r} does not fit the model's adapter {adapter_name!r}: "
            + "; ".join(differ)
            + ". "
            "Build the PeftModel in model_fn from the adapter's own config "
            f"(PeftConfig.from_pretrained({folder!r}))."
        )


def _comparable(value: Any) -> Any:
    """A config field as it compares: collections sorted, an empty one None (PEFT writes ``null`` for
    the ``target_parameters`` a model's config holds as ``set()``), an enum (PeftType) its value."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return sorted(str(v) for v in value) or None
    if hasattr(value, "value"):
        return value.value
    return value


def _shown(value: Any) -> str:
    return "none" if value is None else repr(value)
