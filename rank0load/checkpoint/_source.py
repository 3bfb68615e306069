"""Where the checkpoint is and what its headers hold (rank 0 only: on a multi-node job it may not
exist on other nodes; or ``inspect`` in one process; no collectives). Files that leave the
checkpoint are refused; the index is checked (every key listed once, every file name a regular file
within the checkpoint), and the headers against each other and the index."""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..errors import CheckpointChangedError, CheckpointFormatError, CheckpointNotFoundError, format_keys
from ._files import OpenFile, not_regular, read_exact
from ._format import RepeatedKeys, TensorHeader, parse_json, read_header, short_repr

logger = logging.getLogger(__name__)

_SAFE = ".safetensors"
_INDEX = ".safetensors.index.json"
_SINGLE = "model" + _SAFE
_PIPELINE = "model_index.json"  # a diffusers pipeline's root: one folder per component
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
# a few MB for the largest models: anything far bigger is not an index
_MAX_INDEX_BYTES = 256 << 20


@dataclass(frozen=True)
class Listing:
    """What an index lists, enough to check headers: each file's key count and hash sum. Not the
    map, whose strings would stay resident on rank 0 once freed; :meth:`read_map` reads it again."""

    path: str  # the index file
    boundary: str | None
    counts: dict[str, tuple[int, int]]  # absolute file path -> (keys, sum of hash(key) mod 2**64)
    total: int  # keys listed

    def agrees(self, path: str, keys: Iterable[str]) -> bool:
        """Whether ``keys`` (a header's) are exactly those the index lists for file ``path``
        (two different sets of names with equal counts and equal hash sums: chance 2**-64)."""
        keys = list(keys)
        return self.counts.get(path) == (len(keys), _hash_sum(keys))

    def read_map(self) -> dict[str, str]:
        """The index's map again, checked: checkpoint key -> absolute file path."""
        return _read_map(self.path, self.boundary)[1]


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
        self.source: Source | None = source

    def __fspath__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return repr(self.path)


def resolve(
    ckpt_path: str | os.PathLike[str], revision: str | None = None, subfolder: str | None = None
) -> Source:
    """(rank 0) Find the files of the checkpoint (a directory, a ``.safetensors`` file, an index
    ``.json`` or a Hub repo id; in its folder ``subfolder``, if given). Raises
    CheckpointNotFoundError / CheckpointFormatError; a ``revision`` with a path that exists locally
    is a CheckpointNotFoundError (never ignored). A :class:`Resolved` path gives its Source (once)."""
    if isinstance(ckpt_path, Resolved) and revision is None and subfolder is None:
        source, ckpt_path.source = ckpt_path.source, None
        if source is not None:
            return source
    path = os.fspath(ckpt_path)
    if subfolder is not None and (
        not isinstance(subfolder, str) or not subfolder.strip("/") or escapes(subfolder)
    ):
        raise CheckpointNotFoundError(
            f"subfolder={subfolder!r} for checkpoint {path!r}: expected the name of a folder inside it, "
            "such as 'transformer' (no absolute path, drive or '..')"
        )
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
            return _from_dir(_from_hub(path, revision, subfolder), subfolder)
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
        return _from_dir(path, subfolder)
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


def _from_dir(path: str, subfolder: str | None) -> Source:
    """The checkpoint in directory ``path``, or in its folder ``subfolder`` (a pipeline's component).
    Precedence as transformers' ``from_pretrained``: ``model.safetensors``, then
    ``model.safetensors.index.json``, then a single other index, then every ``*.safetensors`` file.
    In a Hub cache snapshot, files may link anywhere inside the repo's cache folder."""
    boundary = _cache_repo(path)
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
    if not files and _PIPELINE in names:  # a diffusers pipeline's root: its weights are in component folders
        held = _weight_folders(path)
        if not held:
            raise CheckpointNotFoundError(
                f"{path!r} is a diffusers pipeline ({_PIPELINE}), and none of its folders holds *.safetensors "
                "weights. Save the pipeline with save_pretrained(safe_serialization=True)."
            )
        example = next((n for n in ("transformer", "unet") if n in held), held[0])  # the denoiser, if any
        raise CheckpointNotFoundError(
            f"{path!r} is a diffusers pipeline ({_PIPELINE}), not one model's checkpoint: its weights are in "
            f"the component folders {', '.join(f'{n}/' for n in held)}. Pass subfolder={example!r} (or another "
            f"component) to load_pretrained, or the component folder ({os.path.join(path, example)!r}) as the "
            "checkpoint path."
        )
    if not files:
        raise CheckpointNotFoundError(
            f"checkpoint directory {path!r} holds no *.safetensors file and no "
            "*.safetensors.index.json. Save the model with save_pretrained(..., safe_serialization=True) "
            "or safetensors.torch.save_file."
        )
    checked = tuple(inside(root, n, path, boundary) for n in files)
    return Source(root, checked, None, path)


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


# what a load needs from a Hub repo: weights, their index, and the configs load_pretrained builds from
HUB_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json")


def _from_hub(repo_id: str, revision: str | None, subfolder: str | None) -> str:
    """(rank 0) The local snapshot folder of a Hub repo, downloading what the cache lacks (honours
    ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``). Only :data:`HUB_PATTERNS` are
    fetched (within ``subfolder``, if given); every error starts with how ``repo_id`` failed as a
    local path."""
    first, _, rest = repo_id.partition("/")
    where = f"in {os.getcwd()!r}"
    if os.path.isdir(first):
        where = f"{where}: the directory {first!r} exists there but holds no {rest!r}"
    not_local = f"checkpoint {repo_id!r} does not exist as a local path ({where}), so it was tried as a Hugging Face Hub repo id"
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


def _hash_sum(keys: Iterable[str]) -> int:
    return sum(map(hash, keys)) & 0xFFFF_FFFF_FFFF_FFFF


def escapes(name: str) -> bool:
    """Whether a relative name could leave its folder: an absolute path, a drive or a ``..`` part."""
    return (
        os.path.isabs(name)
        or bool(re.match(r"^[A-Za-z]:", name))
        or ".." in name.replace("\\", "/").split("/")
    )


def inside(root: str, name: object, where: str, boundary: str | None) -> str:
    """Absolute path of ``name`` under ``root``, a regular file; refuse anything that escapes
    ``boundary`` (None: ``root``; a Hub cache's repo folder, whose snapshots link into its blobs)."""
    if not isinstance(name, str) or not name:
        raise CheckpointFormatError(
            f"{where}: file name {name!r} is not a non-empty string. Re-download or re-save the checkpoint."
        )
    if escapes(name):
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


def _read_map(index_path: str, boundary: str | None) -> tuple[str, dict[str, str]]:
    """(root, checkpoint key -> absolute file path) of an index, checked; the index is read
    through one descriptor of a regular file (never blocks on a FIFO)."""
    with OpenFile.open(index_path) as f:
        size = f.identity.size
        if size > _MAX_INDEX_BYTES:
            raise _index_error(
                index_path, f"index is {size} bytes, more than the {_MAX_INDEX_BYTES} an index can need"
            )
        raw = [read_exact(f.fd, size, 0, index_path)]
        f.check()
    # popped, not named: parse_json holds the only reference and frees the bytes (rank 0's peak)
    index = parse_json(raw.pop(), "index", lambda problem: _index_error(index_path, problem))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise _index_error(index_path, "index has no 'weight_map' object mapping tensor names to files")
    if isinstance(weight_map, RepeatedKeys):
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
            index_path,
            f"'weight_map' maps key {key!r} to {short_repr(name)}: expected a file name (a string)",
        )
    resolved = {name: inside(root, name, index_path, boundary) for name in dict.fromkeys(weight_map.values())}
    if not resolved:
        raise _index_error(index_path, "'weight_map' is empty")
    return root, dict(zip(weight_map, map(resolved.__getitem__, weight_map.values())))


def _from_index(index_path: str, boundary: str | None) -> Source:
    """(rank 0) The checkpoint an index lists: its directory, its files (absolute paths, sorted) and
    what it lists for each of them, checked: each file name stays inside ``boundary`` (None: that
    directory)."""
    root, mapped = _read_map(index_path, boundary)
    per_file: dict[str, list[str]] = {f: [] for f in sorted(set(mapped.values()))}
    for key, path in mapped.items():
        per_file[path].append(key)
    counts = {f: (len(keys), _hash_sum(keys)) for f, keys in per_file.items()}
    return Source(root, tuple(counts), Listing(index_path, boundary, counts, len(mapped)), index_path)


def read_headers(source: Source, files: dict[str, OpenFile] | None = None) -> dict[str, TensorHeader]:
    """(rank 0) All tensors of all files, each file's keys checked against the index if any.
    ``files``: the source's files already opened (else each is opened by path).

    Raises CheckpointFormatError (a key stored twice, a file and the index disagree, a listed key
    no file stores) or CheckpointChangedError (the index changed during the load)."""
    found: dict[str, TensorHeader] = {}
    for path in source.files:
        found.update(file_tensors(source, path, files[path] if files is not None else path, found))
    if source.listing is not None and source.listing.total != len(found):  # listed, in no header
        for key, path in source.listing.read_map().items():
            if key not in found:
                raise CheckpointFormatError(
                    f"{source.description}: index lists key {key!r} in {os.path.basename(path)}, "
                    "but no file stores it. The index and the shards disagree: re-save the checkpoint."
                )
        raise CheckpointChangedError(  # the index read again lists only keys that are there
            f"{source.description}: the index changed while the checkpoint was loaded "
            f"(it listed {source.listing.total} keys, the files hold {len(found)}). Load again "
            "once it is written."
        )
    return found


def file_tensors(
    source: Source, path: str, file: str | OpenFile, found: Mapping[str, TensorHeader]
) -> dict[str, TensorHeader]:
    """(rank 0) The tensors of file ``path``, read through ``file`` (opened, or its path), checked:
    no key among ``found`` (the files read before), exactly the keys the index lists for it. Raises
    CheckpointFormatError (and ``read_header``'s errors)."""
    tensors = read_header(file)
    twice = found.keys() & tensors.keys()  # checked in C
    if twice:
        key = next(k for k in tensors if k in twice)
        raise CheckpointFormatError(
            f"key {key!r} is stored twice: in {os.path.basename(found[key].file)} and in "
            f"{os.path.basename(path)}. Remove one copy or re-save the checkpoint."
        )
    if source.listing is None or source.listing.agrees(path, tensors):
        return tensors
    listed = source.listing.read_map()  # the error names a key the index lacks or puts elsewhere
    unlisted = [k for k in tensors if k not in listed]
    if unlisted:
        raise CheckpointFormatError(
            f"{source.description}: {os.path.basename(path)} stores keys the index does not list: "
            f"{format_keys(unlisted)}. The index and the shards disagree: re-save the checkpoint."
        )
    for key in tensors:
        if listed[key] != path:
            raise CheckpointFormatError(
                f"{source.description}: index lists key {key!r} in {os.path.basename(listed[key])}, "
                f"but it is stored in {os.path.basename(path)}. Re-save the checkpoint."
            )
    return tensors  # the index lists more keys in this file than it holds: raised once all are read
