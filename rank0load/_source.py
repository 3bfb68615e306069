"""Where the checkpoint is (rank 0 only).

(rank 0) :func:`resolve` turns ``ckpt_path`` into a :class:`Source`: the list of safetensors files
and, when an index names them, its ``weight_map``. It accepts a directory (holding
``model.safetensors``, ``*.safetensors.index.json`` or ``*.safetensors`` files), a single
``.safetensors`` file, an index ``.json``, or a Hugging Face Hub repo id. Index entries are
refused, never followed, when they leave the checkpoint directory (absolute paths, ``..``, a
symlink pointing outside). Other ranks never call anything here: on a multi-node job the
checkpoint may not exist on their node.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from .errors import CheckpointFormatError, CheckpointNotFoundError

__all__ = ["Source", "resolve"]

_SAFE = ".safetensors"
_INDEX = ".safetensors.index.json"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass(frozen=True)
class Source:
    """Resolved checkpoint: absolute file paths in load order, and the index's map (or None)."""

    root: str
    files: tuple[str, ...]
    weight_map: dict[str, str] | None  # checkpoint key -> absolute file path
    description: str


def resolve(ckpt_path: str | os.PathLike[str], revision: str | None = None) -> Source:
    """(rank 0) Find the files of the checkpoint. Raises CheckpointNotFoundError / CheckpointFormatError."""
    path = os.fspath(ckpt_path)
    if not os.path.exists(path):
        if _REPO_ID.match(path) and not path.startswith((".", "/")):
            return resolve(_from_hub(path, revision), None)
        raise CheckpointNotFoundError(
            f"checkpoint {path!r} does not exist. Pass a directory, a .safetensors file, a "
            "*.safetensors.index.json file, or a Hugging Face Hub repo id ('org/name')."
        )
    if os.path.isdir(path):
        return _from_dir(path)
    if path.endswith(".json"):
        return _from_index(path)
    if path.endswith(_SAFE) or os.path.isfile(path):
        real = os.path.realpath(path)
        return Source(os.path.dirname(real), (real,), None, path)
    raise CheckpointNotFoundError(f"checkpoint {path!r} is neither a file nor a directory")


def _from_dir(path: str) -> Source:
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise CheckpointNotFoundError(f"cannot list checkpoint directory {path!r}: {exc.strerror}") from None
    indexes = [n for n in names if n.endswith(_INDEX)]
    if "model" + _INDEX in indexes:
        indexes = ["model" + _INDEX]
    if len(indexes) > 1:
        raise CheckpointFormatError(
            f"{path}: several index files ({', '.join(indexes)}); pass the one to load as ckpt_path"
        )
    if indexes:
        return _from_index(os.path.join(path, indexes[0]))
    files = [n for n in names if n.endswith(_SAFE) and os.path.isfile(os.path.join(path, n))]
    if "model" + _SAFE in files:
        files = ["model" + _SAFE]
    if not files:
        raise CheckpointNotFoundError(
            f"checkpoint directory {path!r} holds no *.safetensors file and no "
            "*.safetensors.index.json. Save the model with save_pretrained(..., safe_serialization=True) "
            "or safetensors.torch.save_file."
        )
    root = os.path.realpath(path)
    checked = tuple(_inside(root, n, path) for n in files)
    return Source(root, checked, None, path)


def _inside(root: str, name: object, where: str) -> str:
    """Absolute path of ``name`` under ``root``; refuse anything that escapes it."""
    if not isinstance(name, str) or not name:
        raise CheckpointFormatError(f"{where}: file name {name!r} is not a non-empty string")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or re.match(r"^[A-Za-z]:", name) or ".." in parts:
        raise CheckpointFormatError(
            f"{where}: refusing file {name!r}: index entries must be relative paths inside the "
            "checkpoint directory (no absolute paths, drives or '..')"
        )
    full = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, full]) != root:
        raise CheckpointFormatError(
            f"{where}: refusing file {name!r}: it resolves to {full!r}, outside the checkpoint "
            f"directory {root!r} (a symlink that escapes?)"
        )
    if not os.path.isfile(full):
        raise CheckpointNotFoundError(
            f"{where}: names file {name!r}, which does not exist in {root!r}. "
            "Was the download interrupted? Re-download the missing shard."
        )
    return full


def _from_index(index_path: str) -> Source:
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except OSError as exc:
        raise CheckpointNotFoundError(f"cannot read index {index_path!r}: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFormatError(f"{index_path}: index is not valid JSON ({exc})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointFormatError(
            f"{index_path}: index has no 'weight_map' object mapping tensor names to files"
        )
    root = os.path.dirname(os.path.realpath(index_path))
    resolved: dict[str, str] = {}
    mapped: dict[str, str] = {}
    for key, name in weight_map.items():
        if name not in resolved:
            resolved[name] = _inside(root, name, index_path)
        mapped[key] = resolved[name]
    files = tuple(sorted(set(resolved.values())))
    if not files:
        raise CheckpointFormatError(f"{index_path}: 'weight_map' is empty")
    return Source(root, files, mapped, index_path)


def _from_hub(repo_id: str, revision: str | None) -> str:
    """(rank 0) Download (or find in the cache) the safetensors, index and config files of a repo."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as exc:  # pragma: no cover - huggingface_hub is a runtime dependency
        raise CheckpointNotFoundError(f"{repo_id!r}: huggingface_hub is not importable ({exc})") from None
    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=["*.safetensors", "*.safetensors.index.json", "*.json"],
        )
    except LocalEntryNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"{repo_id!r} is not a local path and is not in the Hugging Face cache "
            f"(offline or unreachable): {exc}. Download it first or pass a local directory."
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise CheckpointNotFoundError(f"could not fetch {repo_id!r} from the Hugging Face Hub: {exc}") from None
