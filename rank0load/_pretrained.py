"""``load_pretrained``: a transformers or diffusers model built from its checkpoint's own config, then
``load_sharded`` with the path rank 0 resolved (``_source.Resolved``: the Hub and the index are read
once). Rank 0 alone reads the configs (and remote code), sent with ``_distribute.from_rank0``; every
rank then configures the model under ``_distribute.run`` (a failure on any rank raised everywhere):
the only collectives before ``load_sharded``. Other ranks never read the checkpoint, the Hugging Face
cache or the network. A diffusers ``ModelMixin`` subclass is configured and built here, without
importing diffusers; ``load_sharded(dtype=...)`` keeps its ``_keep_in_fp32_modules`` in float32."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from . import _transformers
from ._api import load_sharded
from .checkpoint._files import OpenFile, read_exact
from .checkpoint._fit import FLOAT_WIRE
from .checkpoint._format import read_header
from .checkpoint._source import Resolved, resolve
from .common import _distribute, _failure
from .errors import CheckpointFormatError, CheckpointNotFoundError, LoadError, ModelMismatchError
from .integrations import _compat, _remote_code

logger = logging.getLogger(__name__)

_MAX_CONFIG_BYTES = 64 << 20  # config.json files are kilobytes; anything far bigger is not one

# load_sharded's keyword arguments that load_pretrained passes on (dtype and revision are its own)
_LOAD_SHARDED_OPTIONS = tuple(
    name
    for name, p in inspect.signature(load_sharded).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("dtype", "revision")
)


@dataclass(frozen=True)
class _Checkpoint:
    """What rank 0 read, sent to every rank (pickled: plain data only)."""

    name: str  # ckpt_path as the caller gave it: the config's name_or_path, as from_pretrained sets it
    where: str  # the config.json rank 0 read, for messages
    config: dict[str, Any]  # config.json
    generation: dict[str, Any] | None  # generation_config.json, None when the checkpoint has none
    overrides: dict[str, Any]  # rank 0's config_overrides
    stored_dtype: str | None  # safetensors dtype of the first floating tensor, read only for dtype="auto"
    code: _remote_code.RemoteCode | None = None  # an Auto class's trusted code; None: not trusted


def load_pretrained(
    model_cls: Any,
    ckpt_path: str | os.PathLike[str],
    mesh: DeviceMesh | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    revision: str | None = None,
    config_overrides: dict[str, Any] | None = None,
    subfolder: str | None = None,
    peft_config: Any = None,
    trust_remote_code: bool = False,
    **load_sharded_kwargs: Any,
) -> nn.Module:
    """``from_pretrained`` for FSDP2: build a transformers or diffusers model from the checkpoint's
    ``config.json`` and load it with :func:`~rank0load.load_sharded`.

    Every rank calls this with the same arguments; only rank 0 reads the checkpoint.

    Args:
        model_cls: a transformers Auto class (``AutoModelForCausalLM``, ...; the config's
            ``model_type`` picks the model), a ``PreTrainedModel`` subclass (its ``config_class``
            reads the config), or a diffusers ``ModelMixin`` subclass (built with ``from_config``).
        ckpt_path: as for ``load_sharded``: a directory saved with ``save_pretrained``, a
            ``.safetensors`` file or an index beside a ``config.json``, or a Hub repo id. Read on rank 0.
        mesh: as for ``load_sharded``.
        dtype: ``None``: as ``from_pretrained`` without ``dtype`` (transformers 5: the config's
            ``dtype`` or ``torch_dtype``, else torch's default; 4.57: torch's default). ``"auto"``: the
            config's dtype, else the checkpoint's first floating tensor's. A floating ``torch.dtype``
            (or its name, ``"bfloat16"``): that dtype. The model is built in it, float32-kept modules
            as ``from_pretrained`` keeps them. A diffusers model: ``None`` is torch's default dtype, a
            floating dtype keeps ``_keep_in_fp32_modules`` in float32; no ``"auto"``.
        revision: the Hub revision when ``ckpt_path`` is a repo id; with a local path, an error.
        config_overrides: config attributes to set, as ``from_pretrained(path, **kwargs)`` sets them
            (``{"num_labels": 3}``); for a diffusers model, ``from_config``'s keyword arguments.
            Rank 0's are used.
        subfolder: the folder of ``ckpt_path`` that holds the model's config and weights, as for
            ``from_pretrained``: a pipeline's component (``"transformer"``, ``"text_encoder"``).
        peft_config: a PEFT config (``LoraConfig(...)``): the model is ``get_peft_model(model,
            peft_config)``, its adapters drawn from rank 0's random state, the base weights loaded
            into it; with ``adapter=`` a trained adapter is loaded too.
        trust_remote_code: as for ``from_pretrained``: with an Auto class, use the classes
            ``auto_map`` names for ``AutoConfig`` and the Auto class. Rank 0 reads their code and
            sends it; every rank installs it under its ``HF_MODULES_CACHE`` and imports it, so it runs
            on every rank: only for code you trust. ``save_sharded`` then writes the code and
            ``auto_map``. A class passed as ``model_cls`` (or a diffusers class) is used as it is.
        **load_sharded_kwargs: ``shard_fn``, ``strict``, ``key_map``, ``max_staging_bytes``, ``local_reads``,
            ``readers``, ``conversions``, ``adapter``, passed to ``load_sharded``.

    Returns:
        The sharded model, in eval mode as ``from_pretrained`` returns it. ``model.config`` lacks
        ``quantization_config`` (FP8 blocks are dequantised into ``dtype``); ``model.generation_config``
        comes from ``generation_config.json`` when present and the model can generate.
        ``model.rank0load_report`` holds a ``LoadReport``.

    Raises:
        LoadError: on every rank, with the same message: everything ``load_sharded`` raises, and a
            missing or malformed ``config.json`` (``CheckpointNotFoundError``,
            ``CheckpointFormatError``), an unknown ``model_type`` (``ModelMismatchError``), a missing
            (``CheckpointNotFoundError``) or failing ``auto_map`` code file, a quantisation other than
            FP8 blocks, an Auto class without a model for this config, ``config_overrides`` naming no
            config attribute, or an unknown keyword argument (before any collective).
    """
    _check_arguments(trust_remote_code, load_sharded_kwargs)
    _distribute.require_process_group()
    diffusers = _compat.is_diffusers_class(model_cls)  # the same answer on every rank
    # the auto_map entries whose code rank 0 reads: an Auto class's and its config's
    auto = hasattr(model_cls, "from_config") and hasattr(model_cls, "_model_mapping")
    code = ("AutoConfig", model_cls.__name__) if trust_remote_code and auto and not diffusers else None
    path: str | os.PathLike[str] = ckpt_path  # rank 0 resolves it; the other ranks never look at it

    def read() -> _Checkpoint:  # rank 0
        nonlocal path
        checkpoint, path = _read(ckpt_path, revision, dtype, config_overrides, subfolder, not diffusers, code)
        return checkpoint

    checkpoint = _distribute.from_rank0(
        read,
        lambda exc: LoadError(
            f"rank 0 could not read the config of {os.fspath(ckpt_path)!r}: {type(exc).__name__}: {exc}"
        ),
    )

    # all ranks, from rank 0's checkpoint: (model_fn, dtype for load_sharded, generation config)
    if diffusers:
        step: Any = functools.partial(_diffusers_configure, model_cls, checkpoint, dtype)
    else:
        step = functools.partial(_transformers.configure, model_cls, checkpoint, dtype, peft_config)
    model_fn, built_dtype, generation = _distribute.run(
        step, "building the model's config", _distribute.NO_DATA_MOVED, wrap=LoadError
    )
    model = load_sharded(model_fn, path, mesh, dtype=built_dtype, **load_sharded_kwargs)
    base: Any = _compat.peft_base_model(model)
    if generation is not None and base.can_generate():
        base.generation_config = generation
    return model.eval()


def _check_arguments(trust_remote_code: object, load_sharded_kwargs: dict[str, Any]) -> None:
    """(all ranks, each from its own arguments; no collective) Raise LoadError for a keyword argument
    that neither ``load_pretrained`` nor ``load_sharded`` takes, or a non-bool ``trust_remote_code``."""
    unknown = sorted(set(load_sharded_kwargs) - set(_LOAD_SHARDED_OPTIONS))
    if unknown:
        names = ", ".join(repr(n) for n in unknown)
        raise LoadError(
            f"load_pretrained got an unexpected keyword argument {names}: it takes dtype, revision, "
            "config_overrides, subfolder, peft_config and trust_remote_code, and passes "
            f"{', '.join(_LOAD_SHARDED_OPTIONS)} on to load_sharded. Check the spelling."
        )
    if not isinstance(trust_remote_code, bool):
        raise LoadError(f"trust_remote_code={trust_remote_code!r}: expected True or False")


def _read(
    ckpt_path: str | os.PathLike[str],
    revision: str | None,
    dtype: object,
    overrides: dict[str, Any] | None,
    subfolder: str | None,
    generation: bool,
    code: tuple[str, ...] | None,
) -> tuple[_Checkpoint, str | os.PathLike[str]]:
    """(rank 0) Resolve ``ckpt_path`` as ``load_sharded`` does and read ``config.json``; with
    ``generation``, ``generation_config.json``; with ``dtype="auto"`` and no config dtype, the first
    floating tensor's dtype; with ``code``, those ``auto_map`` entries' code. Returns the
    :class:`_Checkpoint` and the path for ``load_sharded``, with its ``Resolved`` source (resolved
    once). Raises LoadError."""
    if overrides is not None and (
        not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides)
    ):
        raise LoadError(
            f"config_overrides={overrides!r}: expected a dict of config attribute names to values"
        )
    source = resolve(ckpt_path, revision, subfolder)
    hub = not os.path.exists(ckpt_path)  # resolve() tries the Hub only for a path that is not here
    where = os.path.join(source.root, "config.json")
    config = _json(where)
    stored = None
    if dtype == "auto" and config.get("dtype") is None and config.get("torch_dtype") is None:
        headers = read_header(source.files[0])
        stored = next((headers[k].dtype for k in sorted(headers) if headers[k].dtype in FLOAT_WIRE), None)
    generation_json = os.path.join(source.root, "generation_config.json")
    read = _Checkpoint(
        name=os.fspath(ckpt_path),
        where=where,
        config=config,
        generation=_json(generation_json) if generation and os.path.lexists(generation_json) else None,
        overrides=dict(overrides or {}),
        stored_dtype=stored,
        code=None
        if code is None
        else _remote_code.read(os.fspath(ckpt_path), hub, subfolder, config.get("auto_map", {}), code, where),
    )
    path = source.root if hub else ckpt_path if subfolder is None else os.path.join(ckpt_path, subfolder)
    return read, Resolved(path, source)  # load_sharded takes the source as it is


def _json(path: str) -> dict[str, Any]:
    """(rank 0) A JSON object from the regular file ``path``."""
    try:
        with OpenFile.open(path) as f:
            if f.identity.size > _MAX_CONFIG_BYTES:
                raise CheckpointFormatError(f"{path}: {f.identity.size} bytes is too large for a config file")
            raw = read_exact(f.fd, f.identity.size, 0, path)
    except CheckpointNotFoundError:
        if not os.path.lexists(path):
            raise CheckpointNotFoundError(
                f"no config.json beside the checkpoint's weights ({path} does not exist): load_pretrained "
                "builds the model from it. Pass the directory save_pretrained wrote, or build the model "
                "yourself with load_sharded(model_fn, ckpt_path)."
            ) from None
        raise
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise CheckpointFormatError(
            f"{path} is not valid JSON ({type(exc).__name__}: {exc}). Re-download or re-save the checkpoint."
        ) from None
    if not isinstance(value, dict):
        raise CheckpointFormatError(
            f"{path} holds a JSON {type(value).__name__}, not an object. Re-download or re-save the checkpoint."
        )
    return value


def _diffusers_configure(
    model_cls: Any, checkpoint: Any, dtype: object
) -> tuple[Any, torch.dtype | None, None]:
    """(all ranks, from the same :class:`_Checkpoint`) Check a diffusers model's config and overrides;
    ``load_sharded``'s ``model_fn`` (:func:`_diffusers_build`), its ``dtype`` (``from_pretrained``'s
    ``torch_dtype``: None as without it, or a floating torch.dtype or its name), no generation config."""
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
    return functools.partial(_diffusers_build, model_cls, checkpoint), chosen, None


def _diffusers_build(model_cls: Any, checkpoint: Any) -> nn.Module:
    """(all ranks, in the meta build) ``from_config`` with the config and overrides of rank 0's
    ``checkpoint``, recording ``_name_or_path`` as ``from_pretrained``."""
    model: Any = _failure.user_code(
        f"{model_cls.__name__}.from_config",
        model_cls.from_config,
        dict(checkpoint.config),
        **checkpoint.overrides,
    )
    model.register_to_config(_name_or_path=checkpoint.name)
    return model
