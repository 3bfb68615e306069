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
            snapshot = _from_hub(path, revision)
            # The Hub cache links snapshots/<commit>/<file> to blobs/<sha>: the repo's cache
            # folder, not the snapshot, is what files must stay inside.
            return _from_dir(snapshot, boundary=os.path.realpath(os.path.join(snapshot, "..", "..")))
        raise CheckpointNotFoundError(
            f"checkpoint {path!r} does not exist. Pass a directory, a .safetensors file, a "
            "*.safetensors.index.json file, or a Hugging Face Hub repo id ('org/name')."
        )
    if os.path.isdir(path):
        return _from_dir(path, boundary=_cache_repo(path))
    if path.endswith(".json"):
        return _from_index(path, boundary=_cache_repo(os.path.dirname(os.path.abspath(path))))
    if path.endswith(_SAFE) or os.path.isfile(path):
        real = os.path.realpath(path)
        return Source(os.path.dirname(real), (real,), None, path)
    raise CheckpointNotFoundError(f"checkpoint {path!r} is neither a file nor a directory")


def _cache_repo(directory: str) -> str | None:
    """The repo folder when ``directory`` is a Hugging Face cache snapshot
    (``.../models--org--name/snapshots/<commit>``), else None.

    A snapshot's files are symlinks to ``../../blobs/<sha>``: they stay inside the repo's cache
    folder, which is then the boundary files must not escape (as for a repo id), so a user may
    pass the snapshot's path directly. Anything pointing elsewhere is still refused.
    """
    real = os.path.realpath(directory)
    parent = os.path.dirname(real)
    repo = os.path.dirname(parent)
    if os.path.basename(parent) == "snapshots" and os.path.basename(repo).startswith(
        ("models--", "datasets--")
    ):
        return repo
    return None


def _from_dir(path: str, boundary: str | None = None) -> Source:
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
        return _from_index(os.path.join(path, indexes[0]), boundary)
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
    checked = tuple(_inside(root, n, path, boundary) for n in files)
    return Source(root, checked, None, path)


def _inside(root: str, name: object, where: str, boundary: str | None = None) -> str:
    """Absolute path of ``name`` under ``root``; refuse anything that escapes ``boundary`` (default
    ``root``; a Hub cache's repo folder, whose snapshots link into its blobs)."""
    if not isinstance(name, str) or not name:
        raise CheckpointFormatError(f"{where}: file name {name!r} is not a non-empty string")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or re.match(r"^[A-Za-z]:", name) or ".." in parts:
        raise CheckpointFormatError(
            f"{where}: refusing file {name!r}: index entries must be relative paths inside the "
            "checkpoint directory (no absolute paths, drives or '..')"
        )
    full = os.path.realpath(os.path.join(root, name))
    boundary = boundary or root
    if os.path.commonpath([boundary, full]) != boundary:
        raise CheckpointFormatError(
            f"{where}: refusing file {name!r}: it resolves to {full!r}, outside the checkpoint "
            f"directory {boundary!r} (a symlink that escapes?)"
        )
    if not os.path.isfile(full):
        raise CheckpointNotFoundError(
            f"{where}: names file {name!r}, which does not exist in {root!r}. "
            "Was the download interrupted? Re-download the missing shard."
        )
    return full


def _from_index(index_path: str, boundary: str | None = None) -> Source:
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except OSError as exc:
        raise CheckpointNotFoundError(f"cannot read index {index_path!r}: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFormatError(
            f"{index_path}: index is not valid JSON ({exc}). Re-download or re-save the checkpoint "
            "(save_pretrained writes the index last: an interrupted save leaves it incomplete)."
        ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointFormatError(
            f"{index_path}: index has no 'weight_map' object mapping tensor names to files. "
            "Re-download or re-save the checkpoint, or pass a single .safetensors file as ckpt_path."
        )
    # The index's own directory, not its symlink target's (a Hub cache links the index to a blob).
    root = os.path.realpath(os.path.dirname(os.path.abspath(index_path)))
    resolved: dict[str, str] = {}
    mapped: dict[str, str] = {}
    for key, name in weight_map.items():
        if name not in resolved:
            resolved[name] = _inside(root, name, index_path, boundary)
        mapped[key] = resolved[name]
    files = tuple(sorted(set(resolved.values())))
    if not files:
        raise CheckpointFormatError(
            f"{index_path}: 'weight_map' is empty. Re-download or re-save the checkpoint."
        )
    return Source(root, files, mapped, index_path)


# What a load needs from a Hub repo: weights, their index, and the model config (for callers that
# build model_fn from it). Not tokenizers, not other weight formats (.bin, .gguf, .pt).
HUB_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "config.json")


def _from_hub(repo_id: str, revision: str | None) -> str:
    """(rank 0) The local snapshot folder of a Hub repo: from the cache, downloading what is missing.

    ``huggingface_hub.snapshot_download`` honours ``HF_HOME`` / ``HF_HUB_CACHE`` (where the cache
    is), ``HF_HUB_OFFLINE=1`` (cache only, no network: the ``refs/<revision>`` file names the
    snapshot) and ``HF_TOKEN``. Only :data:`HUB_PATTERNS` are fetched.
    """
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as exc:  # pragma: no cover - huggingface_hub is a runtime dependency
        raise CheckpointNotFoundError(f"{repo_id!r}: huggingface_hub is not importable ({exc})") from None
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_PATTERNS))
    except LocalEntryNotFoundError as exc:  # also IncompleteSnapshotError
        raise CheckpointNotFoundError(
            f"{where} is not a local path, and the Hugging Face cache has no complete snapshot of it while "
            f"the Hub is unreachable or HF_HUB_OFFLINE is set: {exc} Download it first "
            f"(`hf download {repo_id}`), check HF_HOME, or pass a local directory."
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise CheckpointNotFoundError(f"could not fetch {where} from the Hugging Face Hub: {exc}") from None
