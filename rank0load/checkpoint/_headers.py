"""A checkpoint's headers, read and checked against each other and its index (rank 0, or
``inspect`` in one process; no collectives)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import CheckpointChangedError, CheckpointFormatError, format_keys
from ._files import OpenFile
from ._format import TensorHeader, read_header
from ._source import Source

__all__ = ["file_tensors", "read_headers"]


def read_headers(source: Source, files: dict[str, OpenFile] | None = None) -> dict[str, TensorHeader]:
    """(rank 0) All tensors of all files, each file's keys checked against the index if any.
    ``files``: the source's files already opened (else each is opened by path).

    Raises CheckpointFormatError (a key stored twice, a file and the index disagree, a listed key
    no file stores) or CheckpointChangedError (the index changed during the load)."""
    found: dict[str, TensorHeader] = {}
    for path in source.files:
        found.update(file_tensors(source, path, files[path] if files is not None else path, found))
    if source.listing is not None and source.listing.total != len(found):  # listed, in no header
        absent = next(((k, p) for k, p in source.listing.read_map().items() if k not in found), None)
        if absent is None:  # the index read again lists only keys that are there
            raise CheckpointChangedError(
                f"{source.description}: the index changed while the checkpoint was loaded "
                f"(it listed {source.listing.total} keys, the files hold {len(found)}). Load again "
                "once it is written."
            )
        key, path = absent
        raise CheckpointFormatError(
            f"{source.description}: index lists key {key!r} in {os.path.basename(path)}, "
            "but no file stores it. The index and the shards disagree: re-save the checkpoint."
        )
    return found


def file_tensors(
    source: Source, path: str, file: str | OpenFile, found: Mapping[str, TensorHeader]
) -> dict[str, TensorHeader]:
    """(rank 0) The tensors of file ``path``, read through ``file`` (opened, or its path), checked:
    no key among ``found`` (the files read before), exactly the keys the index lists for it. Raises
    CheckpointFormatError (and ``read_header``'s errors)."""
    tensors, _ = read_header(file)
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
    elsewhere = next(((k, listed[k]) for k in tensors if listed[k] != path), None)
    if elsewhere is not None:
        key, where = elsewhere
        raise CheckpointFormatError(
            f"{source.description}: index lists key {key!r} in {os.path.basename(where)}, "
            f"but it is stored in {os.path.basename(path)}. Re-save the checkpoint."
        )
    return tensors  # the index lists more keys in this file than it holds: raised once all are read
