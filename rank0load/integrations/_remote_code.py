"""A checkpoint's own Python code (``trust_remote_code=True``), as transformers' dynamic-module loader
installs it: read on rank 0 (:func:`read`, :func:`save_code`), installed on every rank at rank 0's paths
with ``from_pretrained``'s module names, so classes pickle (:func:`install`, :func:`import_class`).
No collectives; transformers is imported inside the functions.
"""

from __future__ import annotations

import importlib
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import CheckpointFormatError, CheckpointNotFoundError, LoadError, ModelMismatchError
from . import _compat

_MAX_CODE_BYTES = 64 << 20  # a modeling file is ~100 kB; anything far bigger is not one


@dataclass(frozen=True)
class CodeClass:
    """A class an ``auto_map`` entry names, and where its module is."""

    auto: str  # the auto_map key: "AutoConfig", "AutoModelForCausalLM", ...
    reference: str  # the entry as config.json spells it: "modeling_x.XForCausalLM"
    module: str  # its module file relative to HF_MODULES_CACHE (get_class_in_module's module_path)
    name: str  # the class's name in that module


@dataclass(frozen=True)
class RemoteCode:
    """What rank 0 read for ``trust_remote_code=True``: the classes and every file their modules need."""

    classes: dict[str, CodeClass]  # by auto_map key
    files: dict[str, bytes]  # path under HF_MODULES_CACHE -> the file rank 0 installed; in path order


def read(
    ckpt_path: str,
    hub: bool,
    subfolder: str | None,
    auto_map: object,
    wanted: Sequence[str],
    where: str,
) -> RemoteCode:
    """(rank 0) The code of the ``wanted`` entries of ``auto_map`` (those it has), for the checkpoint
    ``ckpt_path`` whose ``config.json`` is ``where`` (with ``hub``, in a snapshot: the code at its
    commit; ``where`` also names it in messages).

    Raises:
        CheckpointFormatError: an ``auto_map`` that is not an object, an entry not ``module.Class``.
        CheckpointNotFoundError: a module file (or one it imports relatively) that cannot be read.
        ModelMismatchError: the code imports a package that is not installed.
    """
    if not isinstance(auto_map, dict):
        raise CheckpointFormatError(
            f"{where}: auto_map is a JSON {type(auto_map).__name__}, expected an object of Auto class "
            "names and 'module.Class' entries. Re-download or re-save the checkpoint."
        )
    from transformers import dynamic_module_utils as modules
    from transformers.utils import extract_commit_hash

    if hub:  # the repo id, at the commit the weights come from; a subfolder's code is in its folder
        location: str = ckpt_path
        revision = extract_commit_hash(where, None)
        prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    else:  # the folder holding config.json, as the user spelt it: from_pretrained names modules after it
        location = ckpt_path if os.path.isdir(ckpt_path) else os.path.dirname(os.path.abspath(ckpt_path))
        location = os.path.join(location, subfolder) if subfolder else location
        revision, prefix = None, ""
    classes: dict[str, CodeClass] = {}
    files: dict[str, bytes] = {}
    for auto in wanted:
        if auto not in auto_map:
            continue
        reference = auto_map[auto]
        repo, module, name = _parse(auto, reference, where)
        source, module_file = (repo, f"{module}.py") if repo else (location, f"{prefix}{module}.py")
        try:
            path = modules.get_cached_module_file(source, module_file, revision=None if repo else revision)
            cache = modules.HF_MODULES_CACHE
            main = os.path.join(cache, path)
            for file in [main, *modules.get_relative_import_files(main)]:
                relative = _relative(cache, file, where)
                if relative not in files:
                    files[relative] = _read(file)
        except LoadError:
            raise
        except ImportError as exc:  # check_imports: a package the code imports is not installed
            raise ModelMismatchError(
                f"{where}: the checkpoint's code for {auto} ({reference!r}) cannot run here: {exc}"
            ) from None
        except Exception as exc:  # cached_file's OSError for a missing file, a FileNotFoundError, ...
            raise CheckpointNotFoundError(
                f"{where}: auto_map[{auto!r}] = {reference!r} needs {module_file} from {source!r}, which "
                f"could not be read ({type(exc).__name__}: {exc}). The checkpoint's code files must be "
                "beside its config.json; re-download or re-save the checkpoint."
            ) from None
        classes[auto] = CodeClass(auto, str(reference), path, name)
    return RemoteCode(classes, dict(sorted(files.items())))


def _parse(auto: str, reference: object, where: str) -> tuple[str | None, str, str]:
    """``[org/name--]module.Class`` -> (repo or None, module, class), as transformers splits it."""
    repo, _, local = reference.rpartition("--") if isinstance(reference, str) else (None, "", "")
    module, _, name = local.partition(".")
    if not module or not name.isidentifier() or not all(p and p != ".." for p in module.split("/")):
        raise CheckpointFormatError(
            f"{where}: auto_map[{auto!r}] = {reference!r}: expected 'module.Class' (or "
            "'org/name--module.Class'). Re-download or re-save the checkpoint."
        )
    return repo or None, module, name


def _relative(cache: str, file: str, where: str) -> str:
    """``file``'s path inside the modules cache, or a LoadError for one outside it."""
    relative = os.path.relpath(os.path.normpath(file), os.path.normpath(cache))
    if os.path.isabs(relative) or relative.split(os.sep)[0] == "..":
        raise CheckpointFormatError(f"{where}: the checkpoint's code imports {file}, outside {cache}")
    return relative


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read(_MAX_CODE_BYTES + 1)
    if len(data) > _MAX_CODE_BYTES:
        raise CheckpointFormatError(f"{path}: over {_MAX_CODE_BYTES} bytes is too large for a code file")
    return data


def install(code: RemoteCode) -> None:
    """(all ranks) Write ``code``'s files under this rank's ``HF_MODULES_CACHE`` at rank 0's paths
    (inside the cache: :func:`read` checked them), each replaced atomically unless it already holds
    the bytes: ranks sharing a cache never see half a file."""
    from transformers import dynamic_module_utils as modules

    cache = modules.HF_MODULES_CACHE
    for path, data in code.files.items():
        target = os.path.join(cache, path)
        modules.create_dynamic_module(os.path.dirname(path))
        try:
            with open(target, "rb") as f:
                if f.read(len(data) + 1) == data:
                    continue
        except OSError:
            pass
        temp = f"{target}.tmp-{os.getpid()}-{secrets.token_hex(4)}"  # never a module name
        try:
            with open(temp, "wb") as f:
                f.write(data)
            os.replace(temp, target)
        finally:
            if os.path.lexists(temp):
                os.unlink(temp)
    importlib.invalidate_caches()


def import_class(code: CodeClass, base: type, where: str) -> Any:
    """(all ranks, after :func:`install`) The class, imported with transformers'
    ``get_class_in_module``: this runs the checkpoint's code. Whatever it raises, or a class that is
    not a ``base`` subclass, is a LoadError naming the entry (``where``: config.json)."""
    from transformers import dynamic_module_utils as modules

    try:
        found = modules.get_class_in_module(code.name, code.module)
    except Exception as exc:
        raise LoadError(
            f"{where}: the checkpoint's code for {code.auto} ({code.reference!r}, "
            f"{os.path.basename(code.module)}) failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(found, type) and issubclass(found, base)):
        raise ModelMismatchError(
            f"{where}: auto_map[{code.auto!r}] = {code.reference!r} is {found!r}, not a {base.__name__} "
            "subclass. Check the checkpoint's auto_map."
        )
    return found


def save_code(model: nn.Module, folder: str, config: Any) -> None:
    """(rank 0) For a model whose class came from remote code, what ``save_pretrained`` writes before
    the config (``custom_object_save``): its module files into ``folder``, its ``auto_map`` entry
    into ``config``. Any other model: nothing."""
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    auto = _compat.hf_auto_class(cls)
    if auto is None:
        return
    from transformers.dynamic_module_utils import custom_object_save

    # what custom_object_save reads of the model: its module, class name and Auto class
    stand_in = type(cls.__name__, (), {"__module__": cls.__module__, "_auto_class": auto})()
    custom_object_save(stand_in, folder, config=config)
