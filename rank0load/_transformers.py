"""``load_pretrained`` for a transformers Auto class or ``PreTrainedModel`` subclass (all ranks). No
collectives; transformers is imported inside the functions that need it."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint._format import DTYPES
from .common import _failure
from .errors import LoadError, ModelMismatchError
from .integrations import _compat, _remote_code
from .load._model import cast, set_config_dtype

logger = logging.getLogger(__name__)


def configure(model_cls: Any, checkpoint: Any, dtype: object, peft_config: Any) -> tuple[Any, None, Any]:
    """(all ranks, from the same ``checkpoint``: ``_pretrained._Checkpoint``) ``load_sharded``'s
    ``model_fn`` (:func:`build`), its ``dtype`` (None: built in it) and the generation config (or None).
    Any quantisation but FP8 blocks (loaded dequantised, without ``quantization_config``) is refused."""
    from transformers import GenerationConfig

    raw = dict(checkpoint.config)
    quant = raw.pop("quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if quant is not None and method != "fp8":
        raise ModelMismatchError(
            f"{checkpoint.where}: quantization_config has quant_method {method!r}; rank0load loads FP8 block "
            "checkpoints (quant_method 'fp8', weight_block_size), dequantised into dtype, and no other "
            "quantisation. Load a dequantised copy of the checkpoint."
        )
    code = checkpoint.code  # None: trust_remote_code=False, or not an Auto class
    if code is not None and code.files:
        _remote_code.install(code)
    config_class = _config_class(model_cls, raw, checkpoint.where, code)
    config, unused = _failure.user_code(
        f"{config_class.__name__}.from_dict({checkpoint.where})",
        config_class.from_dict,
        _compat.hf_config_dict(config_class, raw),
        name_or_path=checkpoint.name,
        return_unused_kwargs=True,
        **checkpoint.overrides,
    )
    if unused:
        raise LoadError(
            f"config_overrides {sorted(unused)} name no attribute of {type(config).__name__} "
            f"(from {checkpoint.where}); check their spelling."
        )
    remote = _remote_model_class(model_cls, config, code, checkpoint.where)
    mapping = getattr(model_cls, "_model_mapping", None)  # an Auto class: what its from_config checks
    if remote is None and mapping is not None and type(config) not in mapping:
        raise ModelMismatchError(
            f"{model_cls.__name__} has no model for {type(config).__name__} (model_type "
            f"{raw.get('model_type')!r} in {checkpoint.where}; its architectures: "
            f"{raw.get('architectures')}). Pass the Auto class or model class for this architecture."
        )
    generation = (
        GenerationConfig.from_dict(checkpoint.generation) if checkpoint.generation is not None else None
    )
    config_dtype = _compat.transformers_5()
    chosen = _dtype(dtype, config.dtype if config_dtype else None, checkpoint.stored_dtype)
    if dist.get_rank() == 0:
        name = getattr(model_cls, "__name__", repr(model_cls))
        if config.model_type != raw.get("model_type"):  # as transformers' from_pretrained warns
            logger.warning(
                "%s has model_type %r, but %s reads it as %r: not every configuration loads this way",
                checkpoint.where,
                raw.get("model_type"),
                name,
                config.model_type,
            )
        dequantised = ", FP8 blocks dequantised" if "quantization_config" in checkpoint.config else ""
        logger.info("load_pretrained: %s from %s in %s%s", name, checkpoint.where, chosen, dequantised)
    record = config_dtype or checkpoint.stored_dtype is None  # 4.57 records no dtype read off the weights
    model_fn = functools.partial(build, remote or model_cls, config, chosen, record, peft_config)
    return model_fn, None, generation


def _config_class(model_cls: Any, raw: dict[str, Any], where: str, code: Any = None) -> Any:
    """The config class: ``model_cls.config_class`` for a model class; for an Auto class, with
    ``code``, the registered ``auto_map`` ``AutoConfig`` class, else the one ``model_type`` names."""
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(model_cls, type) and issubclass(model_cls, PreTrainedModel):
        if model_cls.config_class is None:
            raise LoadError(f"{model_cls.__name__} has no config_class to read {where} with; set one")
        return model_cls.config_class
    if not (hasattr(model_cls, "from_config") and hasattr(model_cls, "_model_mapping")):
        raise LoadError(
            f"model_cls={model_cls!r}: expected a transformers Auto class (AutoModelForCausalLM, ...), "
            "a PreTrainedModel subclass or a diffusers ModelMixin subclass. For any other model, use "
            "load_sharded(model_fn, ckpt_path)."
        )
    model_type = raw.get("model_type")
    local = (
        CONFIG_MAPPING[model_type] if isinstance(model_type, str) and model_type in CONFIG_MAPPING else None
    )
    remote = code.classes.get("AutoConfig") if code is not None else None
    if remote is not None and not _compat.hf_registered_class_wins(local):
        config_class = _remote_code.import_class(remote, PretrainedConfig, where)
        config_class.register_for_auto_class()
        return config_class
    # AutoConfig.from_pretrained's rule (transformers 5.23)
    if model_type == "mistral" and "layer_types" in raw:
        model_type = raw["model_type"] = "ministral"
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    how = (
        " Or import the model's classes yourself on every rank and pass the model class as model_cls "
        "(load_pretrained(MyModelForCausalLM, ckpt_path) reads config.json with its config_class)."
    )
    if "auto_map" in raw and code is None:
        raise ModelMismatchError(
            f"{where}: model_type {model_type!r} needs the checkpoint's own code (auto_map: "
            f"{raw['auto_map']}), which load_pretrained runs only with trust_remote_code=True, as "
            "from_pretrained does. Pass trust_remote_code=True if you trust that code (it runs on every "
            "rank; rank 0 reads it and sends it to the others)." + how
        )
    if "auto_map" in raw:
        raise ModelMismatchError(
            f"{where}: model_type {model_type!r} is not an architecture transformers knows, and "
            f"auto_map ({raw['auto_map']}) has no AutoConfig entry to read it with. Pass the model class "
            "as model_cls, or add the config class to auto_map."
        )
    import transformers

    raise ModelMismatchError(
        f"{where}: model_type {model_type!r} is not an architecture transformers {transformers.__version__} "
        "knows. Upgrade transformers if the model is new." + how
    )


def _remote_model_class(model_cls: Any, config: Any, code: Any, where: str) -> Any:
    """The remote class ``code`` names for the Auto class ``model_cls``, registered and given
    ``GenerationMixin`` as ``from_pretrained(trust_remote_code=True)`` does; None when there is none
    or a caller-registered class wins (``_compat.hf_registered_class_wins``)."""
    from transformers import PreTrainedModel

    remote = code.classes.get(model_cls.__name__) if code is not None else None
    if remote is None or not hasattr(model_cls, "_model_mapping"):
        return None
    mapping = model_cls._model_mapping
    local = type(config) in mapping
    registered = mapping[type(config)] if local else None
    if isinstance(registered, (tuple, list)):  # several classes for one config: transformers' own
        registered = registered[0]
    if _compat.hf_registered_class_wins(registered):
        return None
    found = _remote_code.import_class(remote, PreTrainedModel, where)
    if not local:
        model_cls.register(type(config), found, exist_ok=True)
    if _compat.transformers_5() or not local:  # 4.57 registers it only where transformers has no model
        found.register_for_auto_class(auto_class=model_cls)
    return _compat.hf_with_generation_mixin(found)


def _dtype(dtype: object, configured: object, stored: str | None) -> torch.dtype:
    """The dtype to build in: see ``load_pretrained``'s ``dtype``."""
    chosen = configured if dtype in (None, "auto") else dtype
    if dtype == "auto" and chosen is None and stored is not None:
        chosen = DTYPES[stored]
    if isinstance(chosen, str):
        chosen = getattr(torch, chosen, chosen)
    if chosen is None:
        chosen = torch.get_default_dtype()
    if not isinstance(chosen, torch.dtype) or not chosen.is_floating_point:
        raise LoadError(
            f"dtype={dtype!r} resolves to {chosen!r}: expected None, 'auto' or a floating torch.dtype "
            "(e.g. torch.bfloat16)"
        )
    return chosen


@contextlib.contextmanager
def _building_in(config: Any, dtype: torch.dtype) -> Iterator[None]:
    """transformers 4.57 builds a model in ``config.dtype`` (and its sub-configs'), whatever ``dtype=``
    says; its ``from_pretrained`` sets them to the dtype asked for first: so here, for the build only
    (transformers 5 builds in ``dtype=``)."""
    if _compat.transformers_5():
        yield
        return
    configs = [config, *(getattr(config, k, None) for k in getattr(config, "sub_configs", None) or {})]
    configs = [c for c in configs if c is not None and hasattr(c, "dtype")]
    before = [c.dtype for c in configs]
    for c in configs:
        c.dtype = dtype
    try:
        yield
    finally:
        for c, was in zip(configs, before):
            c.dtype = was


def build(model_cls: Any, config: Any, dtype: torch.dtype, record: bool, peft_config: Any) -> nn.Module:
    """(all ranks, inside ``load_sharded``'s meta build) ``model_cls`` from ``config`` in ``dtype`` as
    ``from_pretrained(dtype=...)`` builds it (``record``: with ``config.dtype`` set); with a
    ``peft_config``, ``get_peft_model`` of it."""
    make = model_cls.from_config if hasattr(model_cls, "_model_mapping") else model_cls._from_config
    name = getattr(model_cls, "__name__", repr(model_cls))
    with _building_in(config, dtype):
        model: nn.Module = _failure.user_code(f"{name}.from_config", make, config, dtype=dtype)
    cast(model, dtype, as_built=not _compat.transformers_5())  # as each from_pretrained casts
    if record:  # transformers 4.57's _from_config leaves it unset; from_pretrained records it
        set_config_dtype(model, dtype)
    if peft_config is None:
        return model
    from peft import get_peft_model

    wrapped: nn.Module = _failure.user_code("get_peft_model", get_peft_model, model, peft_config)
    return wrapped
