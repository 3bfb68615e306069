"""Where the checkpoint is (rank 0 only).

(rank 0) :func:`resolve` turns ``ckpt_path`` into a :class:`Source`: the list of safetensors files
and, when an index names them, its ``weight_map``. It accepts a directory (holding
``model.safetensors``, ``*.safetensors.index.json`` or ``*.safetensors`` files), a single
``.safetensors`` file, an index ``.json``, or a Hugging Face Hub repo id; with ``subfolder``, that
folder of a directory or repo (a diffusers pipeline's ``transformer/``). Index entries are
refused, never followed, when they leave the checkpoint directory (absolute paths, ``..``, a
symlink pointing outside). A diffusers pipeline's root (``model_index.json``, its weights in one
folder per component) is refused with the folders to pass instead. Other ranks never call anything
here: on a multi-node job the checkpoint may not exist on their node.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import CheckpointFormatError, CheckpointNotFoundError
from ._files import OpenFile, not_regular, read_exact
from ._json import Twice, parse_json

__all__ = ["Resolved", "Source", "resolve"]

logger = logging.getLogger(__name__)

_SAFE = ".safetensors"
_INDEX = ".safetensors.index.json"
_SINGLE = "model" + _SAFE
_PIPELINE = "model_index.json"  # a diffusers pipeline's root: one folder per component
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
# An index maps names to files: a few MB for the largest models. Anything far bigger is not one.
_MAX_INDEX_BYTES = 256 << 20


@dataclass(frozen=True)
class Source:
    """Resolved checkpoint: absolute file paths in load order, and what its index lists (or None)."""

    root: str
    files: tuple[str, ...]
    listing: Listing | None  # None: no index
    description: str
    # Weight files the directory also held but precedence passed over (model.safetensors wins over
    # an index, as in transformers); logged at INFO when resolved.
    ignored: tuple[str, ...] = ()


@dataclass(frozen=True)
class Listing:
    """What an index lists, as much of it as checks the headers: each file's number of keys and
    the sum of their hashes. A MoE index names ~96,000 keys; held as a map from ``resolve`` (before
    ``load_pretrained`` builds the model) to the manifest, their strings stayed resident on rank 0
    after they were freed, in the allocator's arenas the build's objects kept alive (13 MiB). The
    map itself is read again (:meth:`read_map`) only to name the key where index and headers
    disagree, or for ``inspect``."""

    path: str  # the index file
    boundary: str | None
    counts: dict[str, tuple[int, int]]  # absolute file path -> (keys, sum of hash(key) mod 2**64)

    def agrees(self, path: str, keys: Iterable[str]) -> bool:
        """Whether ``keys`` (a header's) are exactly those the index lists for file ``path``
        (two different sets of names with equal counts and equal hash sums: chance 2**-64)."""
        keys = list(keys)
        return self.counts.get(path) == (len(keys), _hash_sum(keys))

    @property
    def total(self) -> int:
        return sum(n for n, _ in self.counts.values())

    def read_map(self) -> dict[str, str]:
        """The index's map again, checked as :func:`resolve` checked it: checkpoint key -> absolute
        file path."""
        return _read_map(self.path, self.boundary)[2]


def _hash_sum(keys: Iterable[str]) -> int:
    return sum(map(hash, keys)) & 0xFFFF_FFFF_FFFF_FFFF


class Resolved(os.PathLike[str]):
    """(rank 0) A checkpoint path resolved already, with its :class:`Source`: ``load_pretrained``
    resolves the checkpoint to read its config, then passes this as ``load_sharded``'s path, so
    that the index (~96,000 names for a MoE checkpoint, 0.15 s to parse) is read once, not twice.
    :func:`resolve` hands the Source out once; after that it resolves the path again. Anywhere else it is just the path."""

    def __init__(self, path: str | os.PathLike[str], source: Source) -> None:
        self.path = os.fspath(path)
        self._source: Source | None = source

    def __fspath__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return repr(self.path)

    def take(self) -> Source | None:
        source, self._source = self._source, None
        return source


def resolve(
    ckpt_path: str | os.PathLike[str], revision: str | None = None, subfolder: str | None = None
) -> Source:
    """(rank 0) Find the files of the checkpoint (in its folder ``subfolder``, if given). Raises
    CheckpointNotFoundError / CheckpointFormatError; a ``revision`` with a path that exists locally
    is a CheckpointNotFoundError (never ignored). A :class:`Resolved` path gives its Source (once)."""
    if isinstance(ckpt_path, Resolved) and revision is None and subfolder is None:
        source = ckpt_path.take()
        if source is not None:
            return source
    path = os.fspath(ckpt_path)
    if subfolder is not None:
        _check_subfolder(path, subfolder)
    try:
        mode: int | None = os.stat(path).st_mode  # follows symlinks: what open() would reach
    except (FileNotFoundError, NotADirectoryError):  # "org/name" may be a repo id while ./org is a file
        mode = None
    except OSError as exc:
        raise CheckpointNotFoundError(
            f"checkpoint {path!r} cannot be read: {exc.strerror}. Check its permissions and path."
        ) from None
    if mode is None:
        if os.path.islink(path):
            raise CheckpointNotFoundError(
                f"checkpoint {path!r} is a symlink to {os.readlink(path)!r}, which does not exist. "
                "Fix the link or pass the checkpoint's real location."
            )
        if _REPO_ID.match(path) and not path.startswith((".", "/")):
            snapshot = _from_hub(path, revision, _not_local(path), subfolder)
            # The Hub cache links snapshots/<commit>/<file> to blobs/<sha>: the repo's cache
            # folder, not the snapshot, is what files must stay inside.
            boundary = os.path.realpath(os.path.join(snapshot, "..", ".."))
            if subfolder is not None:
                return _component(snapshot, subfolder, boundary)
            return _from_dir(snapshot, boundary=boundary)
        raise CheckpointNotFoundError(
            f"checkpoint {path!r} does not exist. Pass a directory, a .safetensors file, a "
            "*.safetensors.index.json file, or a Hugging Face Hub repo id ('org/name')."
        )
    if revision is not None:  # a local checkpoint has no revisions: never ignore the argument silently
        raise CheckpointNotFoundError(
            f"revision={revision!r} names a Hugging Face Hub revision, but checkpoint {path!r} is a local "
            f"path ({os.path.abspath(path)!r} exists): a local checkpoint has no revisions. Drop revision=, "
            "or pass a Hub repo id ('org/name') that is not also a local path."
        )
    if stat.S_ISDIR(mode):
        if subfolder is not None:
            return _component(path, subfolder, _cache_repo(path))
        return _from_dir(path, boundary=_cache_repo(path))
    if subfolder is not None:
        raise CheckpointNotFoundError(
            f"subfolder={subfolder!r} names a folder of a checkpoint directory, but checkpoint {path!r} is "
            "a file. Pass the directory that holds the folder, or the file without subfolder=."
        )
    if not stat.S_ISREG(mode):  # a FIFO, socket or device: opening it could block rank 0
        raise not_regular(path, mode)
    if path.endswith(".json"):
        return _from_index(path, boundary=_cache_repo(os.path.dirname(os.path.abspath(path))))
    real = os.path.realpath(path)
    return Source(os.path.dirname(real), (real,), None, path)


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
    """Precedence, as transformers' ``from_pretrained`` on a local directory: ``model.safetensors``
    first, then ``model.safetensors.index.json`` (transformers 5.23 modeling_utils.py,
    ``_get_resolved_checkpoint_files``: ``os.path.isfile(SAFE_WEIGHTS_NAME)`` is tested before
    ``SAFE_WEIGHTS_INDEX_NAME``; its Hub branch also asks for SAFE_WEIGHTS_NAME first). Then a
    single other index, then every ``*.safetensors`` file."""
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise CheckpointNotFoundError(f"cannot list checkpoint directory {path!r}: {exc.strerror}") from None
    root = os.path.realpath(path)
    indexes = [n for n in names if n.endswith(_INDEX)]
    if _SINGLE in names:
        single = _inside(root, _SINGLE, path, boundary)
        if indexes:
            logger.info(
                "%s holds both %s and %s: loading %s and ignoring the index, as transformers' "
                "from_pretrained does",
                path,
                _SINGLE,
                ", ".join(indexes),
                _SINGLE,
            )
        return Source(root, (single,), None, path, tuple(os.path.join(root, n) for n in indexes))
    if "model" + _INDEX in indexes:
        indexes = ["model" + _INDEX]
    if len(indexes) > 1:
        raise CheckpointFormatError(
            f"{path}: several index files ({', '.join(indexes)}); pass the one to load as ckpt_path"
        )
    if indexes:
        return _from_index(os.path.join(path, indexes[0]), boundary)
    files = [n for n in names if n.endswith(_SAFE)]
    if not files and _PIPELINE in names:
        raise _pipeline_root(path)
    if not files:
        raise CheckpointNotFoundError(
            f"checkpoint directory {path!r} holds no *.safetensors file and no "
            "*.safetensors.index.json. Save the model with save_pretrained(..., safe_serialization=True) "
            "or safetensors.torch.save_file."
        )
    checked = tuple(_inside(root, n, path, boundary) for n in files)
    return Source(root, checked, None, path)


def _check_subfolder(path: str, subfolder: object) -> None:
    """``subfolder`` must name a folder inside the checkpoint: no absolute path, drive or ``..``."""
    parts = subfolder.replace("\\", "/").split("/") if isinstance(subfolder, str) else []
    if (
        not isinstance(subfolder, str)
        or not subfolder.strip("/")
        or os.path.isabs(subfolder)
        or re.match(r"^[A-Za-z]:", subfolder)
        or ".." in parts
    ):
        raise CheckpointNotFoundError(
            f"subfolder={subfolder!r} for checkpoint {path!r}: expected the name of a folder inside it, "
            "such as 'transformer' (no absolute path, drive or '..')"
        )


def _component(path: str, subfolder: str, boundary: str | None) -> Source:
    """The checkpoint in folder ``subfolder`` of directory ``path`` (a pipeline's component)."""
    folder = os.path.join(path, subfolder)
    if not os.path.isdir(folder):
        held = _weight_folders(path)
        listed = f"; its folders holding weights: {', '.join(f'{n}/' for n in held)}" if held else ""
        raise CheckpointNotFoundError(
            f"checkpoint {path!r} has no folder {subfolder!r} (subfolder=){listed}. Check the folder's name."
        )
    return _from_dir(folder, boundary=boundary)


def _weight_folders(path: str) -> list[str]:
    """The folders of directory ``path`` that hold ``*.safetensors`` files or an index, sorted."""
    out = []
    for name in sorted(os.listdir(path)):
        try:
            inner = os.listdir(os.path.join(path, name))
        except OSError:  # not a directory, or unreadable
            continue
        if any(n.endswith(_SAFE) or n.endswith(_INDEX) for n in inner):
            out.append(name)
    return out


def _pipeline_root(path: str) -> CheckpointNotFoundError:
    """A diffusers pipeline's root passed as the checkpoint: its weights are in component folders."""
    held = _weight_folders(path)
    if not held:
        return CheckpointNotFoundError(
            f"{path!r} is a diffusers pipeline ({_PIPELINE}), and none of its folders holds *.safetensors "
            "weights. Save the pipeline with save_pretrained(safe_serialization=True)."
        )
    example = next((n for n in ("transformer", "unet") if n in held), held[0])  # the denoiser, if any
    return CheckpointNotFoundError(
        f"{path!r} is a diffusers pipeline ({_PIPELINE}), not one model's checkpoint: its weights are in "
        f"the component folders {', '.join(f'{n}/' for n in held)}. Pass subfolder={example!r} (or another "
        f"component) to load_pretrained, or the component folder ({os.path.join(path, example)!r}) as the "
        "checkpoint path."
    )


def _inside(root: str, name: object, where: str, boundary: str | None = None) -> str:
    """Absolute path of ``name`` under ``root``, a regular file; refuse anything that escapes
    ``boundary`` (default ``root``; a Hub cache's repo folder, whose snapshots link into its blobs)."""
    if not isinstance(name, str) or not name:
        raise CheckpointFormatError(
            f"{where}: file name {name!r} is not a non-empty string. Re-download or re-save the checkpoint."
        )
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
    try:
        mode = os.stat(full).st_mode
    except OSError:
        raise CheckpointNotFoundError(
            f"{where}: names file {name!r}, which does not exist in {root!r}. "
            "Was the download interrupted? Re-download the missing shard."
        ) from None
    if not stat.S_ISREG(mode):
        raise not_regular(os.path.join(root, name), mode, where)
    return full


def _index_error(index_path: str, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{index_path}: {problem}. Re-download or re-save the checkpoint (save_pretrained writes the "
        "index last: an interrupted save leaves it incomplete), or pass a single .safetensors file "
        "as ckpt_path."
    )


def _read_index(index_path: str) -> object:
    """The index's JSON, read through one descriptor of a regular file (never blocks on a FIFO)."""
    with OpenFile.open(index_path) as f:
        size = f.identity.size
        if size > _MAX_INDEX_BYTES:
            raise _index_error(
                index_path, f"index is {size} bytes, more than the {_MAX_INDEX_BYTES} an index can need"
            )
        raw = [read_exact(f.fd, size, 0, index_path)]
        f.check()
    # popped, not named: parse_json then holds the only reference and frees the bytes once decoded
    # (a MoE index is ~10 MB, and rank 0's peak memory is made while it is parsed)
    return parse_json(raw.pop(), "index", lambda problem: _index_error(index_path, problem))


def _from_index(index_path: str, boundary: str | None = None) -> Source:
    root, files, mapped = _read_map(index_path, boundary)
    per_file: dict[str, list[str]] = {f: [] for f in files}
    for key, path in mapped.items():
        per_file[path].append(key)
    counts = {f: (len(keys), _hash_sum(keys)) for f, keys in per_file.items()}
    return Source(root, files, Listing(index_path, boundary, counts), index_path)


def _read_map(index_path: str, boundary: str | None) -> tuple[str, tuple[str, ...], dict[str, str]]:
    """(root, files, checkpoint key -> absolute file path) of an index, checked."""
    index = _read_index(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise _index_error(index_path, "index has no 'weight_map' object mapping tensor names to files")
    if isinstance(weight_map, Twice):
        raise _index_error(
            index_path,
            f"key {weight_map.twice[0]!r} is listed twice in 'weight_map' (a JSON reader keeps only the "
            "last, so which file holds it is ambiguous)",
        )
    # The index's own directory, not its symlink target's (a Hub cache links the index to a blob).
    root = os.path.realpath(os.path.dirname(os.path.abspath(index_path)))
    if set(map(type, weight_map.values())) - {str}:  # keys are strings: JSON's object keys are
        key, name = next((k, v) for k, v in weight_map.items() if not isinstance(v, str))
        raise _index_error(
            index_path, f"'weight_map' maps key {key!r} to {_short(name)}: expected a file name (a string)"
        )
    # ~96,000 keys in a MoE index and a few dozen files: each file resolved once, the map in C
    resolved = {
        name: _inside(root, name, index_path, boundary) for name in dict.fromkeys(weight_map.values())
    }
    mapped = dict(zip(weight_map, map(resolved.__getitem__, weight_map.values())))
    files = tuple(sorted(set(resolved.values())))
    if not files:
        raise _index_error(index_path, "'weight_map' is empty")
    return root, files, mapped


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# What a load needs from a Hub repo: weights, their index, and the model config and generation config
# (load_pretrained builds the model from them; so may callers' model_fn). Not tokenizers, not other
# weight formats (.bin, .gguf, .pt).
HUB_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json")


def _not_local(path: str) -> str:
    """How ``path``, tried as a Hub repo id, failed as a local path: the start of the Hub errors."""
    first, _, rest = path.partition("/")
    where = f"in {os.getcwd()!r}"
    if os.path.isdir(first):
        where = f"{where}: the directory {first!r} exists there but holds no {rest!r}"
    return f"checkpoint {path!r} does not exist as a local path ({where}), so it was tried as a Hugging Face Hub repo id"


def _from_hub(repo_id: str, revision: str | None, not_local: str, subfolder: str | None = None) -> str:
    """(rank 0) The local snapshot folder of a Hub repo: from the cache, downloading what is missing.

    ``huggingface_hub.snapshot_download`` honours ``HF_HOME`` / ``HF_HUB_CACHE`` (where the cache
    is), ``HF_HUB_OFFLINE=1`` (cache only, no network: the ``refs/<revision>`` file names the
    snapshot) and ``HF_TOKEN``. Only :data:`HUB_PATTERNS` are fetched (those in folder ``subfolder``,
    if given). ``not_local`` (from
    :func:`_not_local`) starts every error: the user may have meant a local path.
    """
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as exc:  # pragma: no cover - huggingface_hub is a runtime dependency
        raise CheckpointNotFoundError(f"{not_local}, but huggingface_hub is not importable ({exc})") from None
    where = f"{not_local}" + (f" at revision {revision!r}" if revision else "")
    try:
        patterns = [f"{subfolder.strip('/')}/{p}" for p in HUB_PATTERNS] if subfolder else list(HUB_PATTERNS)
        return snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except LocalEntryNotFoundError as exc:  # also IncompleteSnapshotError
        raise CheckpointNotFoundError(
            f"{where}, and the Hugging Face cache has no complete snapshot of it while the Hub is "
            f"unreachable or HF_HUB_OFFLINE is set: {exc} If you meant a local path, check it; for the "
            f"Hub repo, download it first (`hf download {repo_id}`), check HF_HOME, or pass a local directory."
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise CheckpointNotFoundError(
            f"{where}, which could not be fetched from the Hugging Face Hub: {exc} If you meant a local "
            "path, check it."
        ) from None
