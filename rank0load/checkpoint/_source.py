"""Where the checkpoint is (rank 0 only: on a multi-node job it may not exist on other nodes).

(rank 0) :func:`resolve` accepts a directory, a ``.safetensors`` file, an index ``.json`` or a Hub
repo id (with ``subfolder``, that folder of it); files that leave the checkpoint are refused.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass

from ..errors import CheckpointFormatError, CheckpointNotFoundError
from ._files import not_regular
from ._index import Listing, escapes, inside, read_index

__all__ = ["Resolved", "Source", "resolve"]

logger = logging.getLogger(__name__)

_SAFE = ".safetensors"
_INDEX = ".safetensors.index.json"
_SINGLE = "model" + _SAFE
_PIPELINE = "model_index.json"  # a diffusers pipeline's root: one folder per component
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass(frozen=True)
class Source:
    """Resolved checkpoint: absolute file paths in load order, and what its index lists (or None)."""

    root: str
    files: tuple[str, ...]
    listing: Listing | None  # None: no index
    description: str


class Resolved(os.PathLike[str]):
    """(rank 0) A checkpoint path resolved already, so the index is read once: :func:`resolve` takes
    its :class:`Source` once, then resolves the path again. Anywhere else it is just the path."""

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
        if _REPO_ID.match(path):
            snapshot = _from_hub(path, revision, _not_local(path), subfolder)
            # snapshots link into blobs/: files must stay inside the repo's cache folder
            boundary = os.path.realpath(os.path.join(snapshot, "..", ".."))
            return _from_dir(snapshot, subfolder, boundary)
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
        return _from_dir(path, subfolder, _cache_repo(path))
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
    (``.../models--org--name/snapshots/<commit>``): the boundary its files must stay inside; else None."""
    real = os.path.realpath(directory)
    parent = os.path.dirname(real)
    repo = os.path.dirname(parent)
    if os.path.basename(parent) == "snapshots" and os.path.basename(repo).startswith(
        ("models--", "datasets--")
    ):
        return repo
    return None


def _from_dir(path: str, subfolder: str | None, boundary: str | None) -> Source:
    """The checkpoint in directory ``path``, or in its folder ``subfolder`` (a pipeline's component).
    Precedence as transformers' ``from_pretrained``: ``model.safetensors``, then
    ``model.safetensors.index.json``, then a single other index, then every ``*.safetensors`` file."""
    if subfolder is not None:
        if not os.path.isdir(os.path.join(path, subfolder)):
            held = _weight_folders(path)
            listed = f"; its folders holding weights: {', '.join(f'{n}/' for n in held)}" if held else ""
            raise CheckpointNotFoundError(
                f"checkpoint {path!r} has no folder {subfolder!r} (subfolder=){listed}. "
                "Check the folder's name."
            )
        path = os.path.join(path, subfolder)
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise CheckpointNotFoundError(f"cannot list checkpoint directory {path!r}: {exc.strerror}") from None
    root = os.path.realpath(path)
    indexes = [n for n in names if n.endswith(_INDEX)]
    if _SINGLE in names:
        single = inside(root, _SINGLE, path, boundary)
        if indexes:
            logger.info(
                "%s holds both %s and %s: loading %s and ignoring the index, as transformers' "
                "from_pretrained does",
                path,
                _SINGLE,
                ", ".join(indexes),
                _SINGLE,
            )
        return Source(root, (single,), None, path)
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
    checked = tuple(inside(root, n, path, boundary) for n in files)
    return Source(root, checked, None, path)


def _check_subfolder(path: str, subfolder: object) -> None:
    """``subfolder`` must name a folder inside the checkpoint: no absolute path, drive or ``..``."""
    if not isinstance(subfolder, str) or not subfolder.strip("/") or escapes(subfolder):
        raise CheckpointNotFoundError(
            f"subfolder={subfolder!r} for checkpoint {path!r}: expected the name of a folder inside it, "
            "such as 'transformer' (no absolute path, drive or '..')"
        )


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


def _from_index(index_path: str, boundary: str | None) -> Source:
    root, files, listing = read_index(index_path, boundary)
    return Source(root, files, listing, index_path)


# what a load needs from a Hub repo: weights, their index, and the configs load_pretrained builds from
HUB_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json")


def _not_local(path: str) -> str:
    """How ``path``, tried as a Hub repo id, failed as a local path: the start of the Hub errors."""
    first, _, rest = path.partition("/")
    where = f"in {os.getcwd()!r}"
    if os.path.isdir(first):
        where = f"{where}: the directory {first!r} exists there but holds no {rest!r}"
    return f"checkpoint {path!r} does not exist as a local path ({where}), so it was tried as a Hugging Face Hub repo id"


def _from_hub(repo_id: str, revision: str | None, not_local: str, subfolder: str | None) -> str:
    """(rank 0) The local snapshot folder of a Hub repo, downloading what the cache lacks (honours
    ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``). Only :data:`HUB_PATTERNS` are
    fetched (within ``subfolder``, if given); ``not_local`` starts every error."""
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
