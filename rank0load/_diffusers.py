"""``load_pretrained`` for a diffusers ``ModelMixin`` subclass (Flux, SD3, Wan, ...): all ranks, from
rank 0's ``config.json``; ``load_sharded(dtype=...)`` keeps ``_keep_in_fp32_modules`` in float32. No
collectives; nothing here imports diffusers."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .common._failure import user_code
from .errors import LoadError, ModelMismatchError

logger = logging.getLogger(__name__)


def configure(model_cls: Any, checkpoint: Any, dtype: object) -> torch.dtype | None:
    """(all ranks, from the same ``checkpoint``: ``_pretrained._Checkpoint``) Check the config and the
    overrides; the dtype for ``load_sharded``: ``from_pretrained``'s ``torch_dtype``, None (as without
    it) or a floating torch.dtype (or its name)."""
    quant = checkpoint.config.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        raise ModelMismatchError(
            f"{checkpoint.where}: quantization_config (quant_method {method!r}): rank0load loads diffusers "
            "models unquantised only. Load an unquantised copy of the checkpoint."
        )
    accepted = set(inspect.signature(model_cls.__init__).parameters) - {"self", "args", "kwargs"}
    unknown = sorted(set(checkpoint.overrides) - accepted)
    if unknown:
        raise LoadError(
            f"config_overrides {unknown} name no argument of {model_cls.__name__}.__init__ "
            f"(from {checkpoint.where}); check their spelling."
        )
    chosen = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(chosen, torch.dtype) or not chosen.is_floating_point:
        if dtype is not None:
            raise LoadError(
                f"dtype={dtype!r}: a diffusers model takes None (torch's default dtype, as from_pretrained "
                "without torch_dtype builds it) or a floating torch.dtype (e.g. torch.bfloat16); diffusers' "
                "from_pretrained has no 'auto'"
            )
        chosen = None
    if dist.get_rank() == 0:
        shown = chosen if chosen is not None else f"{torch.get_default_dtype()} (torch's default)"
        logger.info("load_pretrained: %s from %s in %s", model_cls.__name__, checkpoint.where, shown)
    return chosen


def build(model_cls: Any, checkpoint: Any) -> nn.Module:
    """(all ranks, in the meta build) ``from_config`` with the config and overrides of rank 0's
    ``checkpoint`` (``_pretrained._Checkpoint``), recording ``_name_or_path`` as ``from_pretrained``."""
    model: Any = user_code(
        f"{model_cls.__name__}.from_config",
        model_cls.from_config,
        dict(checkpoint.config),
        **checkpoint.overrides,
    )
    model.register_to_config(_name_or_path=checkpoint.name)
    return model
