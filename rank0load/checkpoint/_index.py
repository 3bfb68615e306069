"""The index of a sharded checkpoint, read and checked (rank 0 only; no collectives): every key
listed once, every file name resolved by :func:`inside` to a regular file within the checkpoint."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import CheckpointFormatError, CheckpointNotFoundError
from ._files import OpenFile, not_regular, read_exact
from ._json import RepeatedKeys, parse_json, short_repr

__all__ = ["Listing", "inside", "read_index"]

# a few MB for the largest models: anything far bigger is not an index
_MAX_INDEX_BYTES = 256 << 20


@dataclass(frozen=True)
class Listing:
    """What an index lists, enough to check headers: each file's key count and hash sum. Not the
    map, whose strings would stay resident on rank 0 once freed; :meth:`read_map` reads it again."""

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
        """The index's map again, checked: checkpoint key -> absolute file path."""
        return _read_map(self.path, self.boundary)[2]


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


def _read_map(index_path: str, boundary: str | None) -> tuple[str, tuple[str, ...], dict[str, str]]:
    """(root, files, checkpoint key -> absolute file path) of an index, checked; the index is read
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
    mapped = dict(zip(weight_map, map(resolved.__getitem__, weight_map.values())))
    files = tuple(sorted(set(resolved.values())))
    if not files:
        raise _index_error(index_path, "'weight_map' is empty")
    return root, files, mapped


def read_index(index_path: str, boundary: str | None) -> tuple[str, tuple[str, ...], Listing]:
    """(rank 0) The index's directory, its files (absolute paths, sorted) and what it lists for
    each of them, checked: each file name stays inside ``boundary`` (None: that directory)."""
    root, files, mapped = _read_map(index_path, boundary)
    per_file: dict[str, list[str]] = {f: [] for f in files}
    for key, path in mapped.items():
        per_file[path].append(key)
    counts = {f: (len(keys), _hash_sum(keys)) for f, keys in per_file.items()}
    return root, files, Listing(index_path, boundary, counts)
