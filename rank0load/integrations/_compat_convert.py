"""transformers' private checkpoint-conversion machinery, one function per use, per version:
transformers 5's ``conversion_mapping`` and ``core_model_loading``, 4.57's
``_fix_state_dict_key_on_load``. ``_convert`` reaches them only through here.

(all ranks read the conversions before sharding; rank 0 alone reverts them when saving; no collectives)
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = [
    "hf_conversions",
    "hf_has_conversion_mapping",
    "hf_legacy_rename",
    "hf_rename",
    "hf_reverse_conversions",
    "hf_revert_key",
    "hf_revert_tensor",
]


def hf_has_conversion_mapping() -> bool:
    """Whether transformers has checkpoint conversions (transformers 5); 4.57 only renames keys.
    For a transformers model only (transformers is then imported)."""
    import importlib.util

    return importlib.util.find_spec("transformers.conversion_mapping") is not None


def hf_legacy_rename(model: nn.Module, key: str) -> str:
    """transformers 4.57's ``PreTrainedModel._fix_state_dict_key_on_load`` (a staticmethod)."""
    renamed, _ = type(model)._fix_state_dict_key_on_load(key)  # type: ignore[attr-defined]
    return str(renamed)


def hf_conversions(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """transformers' checkpoint conversions for ``model`` (``get_model_conversion_mapping``): its
    ``WeightRenaming`` and ``WeightConverter`` objects. Some are looked up by class name: call this
    before ``fully_shard`` renames the classes."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    return (
        [t for t in transforms if isinstance(t, WeightRenaming)],
        [t for t in transforms if isinstance(t, WeightConverter)],
    )


def hf_reverse_conversions(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """(renamings, converters): transformers' conversions for ``model`` reversed, last first, as
    ``save_pretrained``'s ``revert_weight_conversion`` builds them (the model's
    ``_weight_conversions``, else the mapping without ``PrefixChange``, found through
    ``config.model_type`` after ``fully_shard``)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming

    transforms = getattr(model, "_weight_conversions", None)
    if transforms is None:
        transforms = get_model_conversion_mapping(model, add_legacy=False)  # type: ignore[arg-type]
        transforms = [t for t in transforms if not isinstance(t, PrefixChange)]
    reverse = [t.reverse_transform() for t in transforms[::-1]]
    return (
        [t for t in reverse if isinstance(t, WeightRenaming)],
        [t for t in reverse if isinstance(t, WeightConverter)],
    )


def hf_revert_key(
    key: str, renamings: list[Any], converters: list[Any]
) -> tuple[str, Any | None, str | None]:
    """``revert_weight_conversion`` for one key: (the key renamed, None, None) when no reverse
    converter applies, else (the converter's intermediate name, the converter, its pattern). From
    transformers 5.24 a converted key is renamed after the conversion; before, together with it."""
    import transformers.core_model_loading as core

    if not hasattr(core, "apply_converters"):
        renamed, pattern = core.rename_source_key(key, renamings, converters, reverse=True)
    else:
        renamed, pattern = core.apply_converters(key, converters)
        if pattern is None:
            renamed = core.apply_renamings(key, renamings)
    if pattern is None:
        return renamed, None, None
    return renamed, next(c for c in converters if pattern in c.source_patterns), pattern


def hf_revert_tensor(
    converter: Any,
    renamed: str,
    key: str,
    pattern: str,
    tensor: torch.Tensor,
    model: nn.Module,
    renamings: list[Any],
) -> dict[str, torch.Tensor]:
    """A reverse converter applied to one tensor as ``revert_weight_conversion`` applies it, then (from
    transformers 5.24, see :func:`hf_revert_key`) the renamings to the names it produces."""
    import transformers.core_model_loading as core

    converter = copy.deepcopy(converter)
    converter.add_tensor(renamed, key, pattern, tensor)
    out = converter.convert(renamed, model=model, config=getattr(model, "config", None))
    after = core.apply_renamings if hasattr(core, "apply_converters") else lambda name, _: name
    return {after(n, renamings): v[0] if isinstance(v, list) else v for n, v in out.items()}


def hf_rename(
    key: str,
    renamings: list[Any],
    converters: list[Any],
    prefix: str | None,
    model_keys: dict[str, Any] | None,
) -> tuple[str, str | None]:
    """transformers' ``rename_source_key``: the key after the renamings and at most one converter,
    and the converter's source pattern that matched (None if none)."""
    from transformers.core_model_loading import rename_source_key

    return rename_source_key(key, renamings, converters, prefix, model_keys)
