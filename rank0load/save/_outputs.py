"""A save's files. (all ranks) :func:`layout_of`: their names and config files, as the model's
library reads them back. (rank 0) Create them (``_write`` writes into them), commit them with the
config files, or remove them. No collectives. Temporary names never end in ``.safetensors``."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
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

# (rank 0) writes the model's config files into an empty temporary folder (folder, plan);
# every file it leaves there is committed into out_dir with the weights
ConfigWriter = Callable[[str, SavePlan], None]


def layout_of(
    model: nn.Module, original_format: bool, adapter: str | None
) -> tuple[str, ConfigWriter | None]:
    """(all ranks) The files' stem (``<stem>.safetensors``, or ``<stem>-0000i-of-0000n.safetensors``
    and ``<stem>.safetensors.index.json``) and the writer of the config files (None: none), as
    ``from_pretrained`` of the model's library reads them: PEFT's ``adapter_model.safetensors`` and
    ``adapter_config.json`` for ``adapter``; for a ``PeftModel``, its base model's with
    ``original_format``, else plain files under its own names, no config files."""
    if adapter is not None:
        return "adapter_model", functools.partial(_adapter_config, model, adapter)
    base = peft_base_model(model)
    if base is not model and not original_format:
        return "model", None
    if is_transformers_model(base):
        return "model", functools.partial(_hf_configs, model)
    if is_diffusers_class(type(base)):
        return "diffusion_pytorch_model", functools.partial(_diffusers_config, model)
    return "model", None


@dataclass
class Outputs:
    """(rank 0) The temporary files being written, one per planned file."""

    directory: str
    token: str = field(default_factory=functools.partial(secrets.token_hex, 4))
    temps: list[str] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)

    def open(self, plan: SavePlan) -> None:
        """Create the directory if needed, then each file under a temporary name, its header written;
        on failure, what was created is left for :meth:`discard`."""
        os.makedirs(self.directory, exist_ok=True)
        for name, header in zip(plan.files, plan.headers):
            path = os.path.join(self.directory, f".{name}.tmp-{self.token}")
            self.fds.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            self.temps.append(path)
            pwrite_all(self.fds[-1], memoryview(header), 0)

    def discard(self) -> None:
        """Close and remove every temporary file (errors ignored: this runs while failing)."""
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        for path in self.temps:
            with contextlib.suppress(OSError):
                if os.path.isdir(path):  # the folder of config files
                    shutil.rmtree(path)
                else:
                    os.unlink(path)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def commit(
    outputs: Outputs,
    plan: SavePlan,
    stem: str,
    write_configs: ConfigWriter | None,
) -> None:
    """(rank 0) Make the checkpoint visible: ``write_configs`` (:data:`ConfigWriter`) writes the config
    files into a temporary folder of out_dir; fsync and rename the files and them, write the index
    last, then remove what an earlier save left under ``stem`` that the new checkpoint lacks."""
    directory, index_file = outputs.directory, f"{stem}.safetensors.index.json"
    folder = os.path.join(directory, f".rank0load-config.tmp-{outputs.token}")  # the config files'
    if write_configs is not None:
        os.makedirs(folder)
        outputs.temps.append(folder)
        write_configs(folder, plan)
    for fd in outputs.fds:
        os.fsync(fd)
    while outputs.fds:
        os.close(outputs.fds.pop())
    for name in sorted(os.listdir(folder)) if write_configs is not None else ():
        os.replace(os.path.join(folder, name), os.path.join(directory, name))
    old_index = os.path.join(directory, index_file)
    replaced = [n for n in plan.files if os.path.exists(os.path.join(directory, n))]
    if (
        replaced
        and os.path.exists(old_index)
        and not _keep_earlier(directory, index_file, replaced, outputs.token)
    ):
        # Where the earlier save cannot be kept aside: retire its index, so that a crash during the
        # renames leaves a directory that looks incomplete, never new shards behind an old index.
        os.unlink(old_index)
        _fsync_dir(directory)
    for temp, name in zip(list(outputs.temps), plan.files):
        os.replace(temp, os.path.join(directory, name))
        outputs.temps.remove(temp)
    keep = set(plan.files)
    if len(plan.files) > 1:
        index = {
            "metadata": {"total_size": plan.total_size},
            "weight_map": dict(sorted((s.name, plan.files[s.file]) for i in plan.items for s in i.saved)),
        }
        temp = os.path.join(directory, f".{index_file}.tmp-{outputs.token}")
        outputs.temps.append(temp)
        with open(temp, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, os.path.join(directory, index_file))
        outputs.temps.remove(temp)
        keep.add(index_file)
    remove_stale(directory, stem, keep)


def remove_stale(directory: str, stem: str, keep: set[str]) -> None:
    """(rank 0) Remove what an earlier save left under ``stem`` in ``directory`` but ``keep``: the
    names this save writes or keeps the earlier save's files under (_keep_earlier); never another
    stem's. The directory is fsynced."""
    saved = re.compile(re.escape(stem) + r"(-\d{5}-of-\d{5})?(\.old-[0-9a-f]+)?\.safetensors(\.index\.json)?")
    for name in sorted(os.listdir(directory)):
        if saved.fullmatch(name) and name not in keep:
            os.unlink(os.path.join(directory, name))
    _fsync_dir(directory)


def write_temp(outputs: Outputs, name: str, text: str) -> str:
    """(rank 0) ``text`` written and fsynced under a temporary name for ``name`` in the outputs'
    directory (created if needed), removed by :meth:`Outputs.discard` unless renamed; its path."""
    os.makedirs(outputs.directory, exist_ok=True)
    temp = os.path.join(outputs.directory, f".{name}.tmp-{outputs.token}")
    outputs.temps.append(temp)
    with open(temp, "x", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return temp


def rename_last(outputs: Outputs, temp: str, name: str) -> None:
    """(rank 0) The temporary file ``temp`` of :func:`write_temp` made ``name``; the directory fsynced."""
    os.replace(temp, os.path.join(outputs.directory, name))
    outputs.temps.remove(temp)
    _fsync_dir(outputs.directory)


def _keep_earlier(directory: str, index_file: str, replaced: list[str], token: str) -> bool:
    """(rank 0) Hard-link the earlier save's files that the new ones will be renamed over to other
    names and point its index at them, atomically: it stays loadable until the new index replaces it.
    False (nothing changed) where the index cannot be read or the filesystem has no hard links."""
    path = os.path.join(directory, index_file)
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
        weight_map = index["weight_map"]
        files = set(weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    aside: dict[str, str] = {}
    try:
        for name in sorted(files & set(replaced)):
            aside[name] = name.removesuffix(".safetensors") + f".old-{token}.safetensors"
            os.link(os.path.join(directory, name), os.path.join(directory, aside[name]))
    except OSError:
        for name in aside.values():
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
        return False
    index["weight_map"] = {k: aside.get(v, v) for k, v in weight_map.items()}
    temp = os.path.join(directory, f".{index_file}.old-{token}")
    with open(temp, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    _fsync_dir(directory)
    return True


def _fsync_dir(directory: str) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _adapter_config(model: nn.Module, adapter: str, folder: str, plan: SavePlan) -> None:
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
