"""What a saved checkpoint holds beside its tensors, as the model's library reads it back.

(all ranks) :func:`layout_of`, :func:`adapter_layout`: the files' names and config files. (rank 0)
:data:`Layout.write_configs` writes the config files (``_outputs.commit``). No collectives here."""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..checkpoint._format import DTYPES
from ..integrations import _peft
from ..integrations._compat import (
    diffusers_config_json,
    is_diffusers_class,
    is_transformers_model,
    peft_base_model,
)
from ..integrations._remote_code import save_code
from ._saveplan import SavePlan

__all__ = ["Layout", "adapter_layout", "layout_of"]


@dataclass(frozen=True)
class Layout:
    """What a saved checkpoint looks like beside its tensors: its files' names and its config files."""

    # file names: <stem>.safetensors, or <stem>-0000i-of-0000n.safetensors + <stem>.safetensors.index.json
    stem: str
    # (rank 0) writes the config files into an empty temporary folder (model, folder, plan); every file
    # it leaves there is committed into out_dir with the weights. None: no config files.
    write_configs: Callable[[nn.Module, str, SavePlan], None] | None


def layout_of(model: nn.Module, original_format: bool) -> Layout:
    """(all ranks) The layout ``from_pretrained`` of the model's library reads; for a ``PeftModel``,
    its base model's with ``original_format``, else plain files under its own names, no config files."""
    base = peft_base_model(model)
    if base is not model and not original_format:
        return Layout("model", None)
    if is_transformers_model(base):
        return Layout("model", _hf_configs)
    if is_diffusers_class(type(base)):
        return Layout("diffusion_pytorch_model", _diffusers_config)
    return Layout("model", None)


def adapter_layout(adapter: str) -> Layout:
    """(all ranks) PEFT's layout: one ``adapter_model.safetensors`` and its ``adapter_config.json``."""
    return Layout("adapter_model", functools.partial(_adapter_config, adapter))


def _adapter_config(adapter: str, model: nn.Module, folder: str, plan: SavePlan) -> None:
    """(rank 0) ``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it."""
    config: Any = copy.deepcopy(_peft.peft_config(model, adapter))
    if getattr(config, "base_model_name_or_path", None) is None:
        config.base_model_name_or_path = getattr(peft_base_model(model), "name_or_path", None) or None
    config.inference_mode = True
    config.save_pretrained(folder)


def _hf_configs(model: nn.Module, folder: str, plan: SavePlan) -> None:
    """(rank 0) A transformers model's ``config.json`` (its dtype the saved floating tensors') and
    ``generation_config.json``, and a remote-code model's code files with its ``auto_map`` (as
    ``save_pretrained`` writes them); a PeftModel's, its base model's."""
    model = peft_base_model(model)
    floats: dict[str, int] = {}
    for item in plan.items:
        if DTYPES[item.dtype].is_floating_point and DTYPES[item.dtype].itemsize > 1:
            floats[item.dtype] = floats.get(item.dtype, 0) + item.nbytes
    config: Any = copy.deepcopy(model.config)
    if floats:
        config.dtype = str(DTYPES[max(floats, key=lambda d: floats[d])]).removeprefix("torch.")
    save_code(model, folder, config)  # a remote-code model's files and auto_map, as save_pretrained
    config.save_pretrained(folder)
    generation: Any = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(folder)


def _diffusers_config(model: nn.Module, folder: str, plan: SavePlan) -> None:
    """(rank 0) A diffusers model's (or a PeftModel's base model's) ``config.json``, as ``save_config``."""
    name, text = diffusers_config_json(peft_base_model(model))
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
        f.write(text)
