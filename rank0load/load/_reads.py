"""Reading checkpoint bytes into memory at their file offsets (rank 0 and local readers; no collectives).

Every read goes through :func:`read_vectored`, so a test patches it once for rank 0 and local
readers. No file is mapped: page-cache pages never count in a rank's RSS."""

from __future__ import annotations

import operator
import os

import torch

from ..errors import CheckpointFormatError, LoadError
from ..integrations._compat import host_bytes

__all__ = ["read_into", "read_vectored", "runs", "split_runs"]

_IOV_MAX = 1024  # buffers one preadv takes (Linux's IOV_MAX)


def read_into(
    fd: int, views: list[memoryview], offset: int, path: str, reader: str = "rank 0", hint: str = ""
) -> None:
    """:func:`read_vectored`, its OSError a LoadError naming ``reader`` (``hint``: another way)."""
    try:
        read_vectored(fd, views, offset, path)
    except OSError as exc:
        raise LoadError(
            f"{reader} could not read {path} at byte {offset}: {exc.strerror or exc}. Check the disk "
            f"and the file (was it moved or changed during the load?) and retry{hint}."
        ) from None


def read_vectored(fd: int, views: list[memoryview], offset: int, path: str) -> None:
    """Fill ``views`` one after the other from the file bytes at ``offset`` on: one ``preadv`` for
    them all unless the kernel returns less (short reads retried). Raises CheckpointFormatError at
    end of file, OSError as the kernel gives it."""
    at, i = offset, 0
    views = list(views)
    while i < len(views):
        n = os.preadv(fd, views[i : i + _IOV_MAX], at)
        if n <= 0:
            raise CheckpointFormatError(
                f"{path}: unexpected end of file at byte {at} while reading "
                "(was the file changed during the load?). Load again; if it repeats, re-download the file."
            )
        at += n
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]


def runs(
    extents: list[tuple[str, int, int, int]], data: torch.Tensor
) -> list[tuple[str, int, list[memoryview]]]:
    """A piece's extents (``Entry.extents``) as runs of nearby file bytes, each read with one
    ``preadv`` scattering into ``data``: ``(file, offset, buffers)``, the files in the order the
    extents first name them, each file's runs by offset; extents at most ``_GAP`` apart share a run."""
    view = host_bytes(data)
    if len(extents) == 1:
        path, offset, nbytes, at = extents[0]
        return [(path, offset, [view[at : at + nbytes]])]
    order = dict.fromkeys(map(_PATH, extents))
    if len(order) == 1:  # the usual case: sorted by offset with a C-level key
        ordered = sorted(extents, key=_OFFSET)
    else:
        rank = {path: i for i, path in enumerate(order)}
        ordered = sorted(extents, key=lambda e: (rank[e[0]], e[1]))
    out: list[tuple[str, int, list[memoryview]]] = []
    end = -1
    for path, offset, nbytes, at in ordered:
        if out and out[-1][0] == path and end <= offset <= end + _GAP:
            if offset > end:  # bytes no one asked for: read into the scratch buffer, not another call
                out[-1][2].append(_SCRATCH[: offset - end])
            out[-1][2].append(view[at : at + nbytes])
        else:
            out.append((path, offset, [view[at : at + nbytes]]))
        end = offset + nbytes
    return out


_PATH, _OFFSET = operator.itemgetter(0), operator.itemgetter(1)


def split_runs(
    reads: list[tuple[str, int, list[memoryview]]], size: int
) -> list[tuple[str, int, list[memoryview]]]:
    """``reads`` (:func:`runs`) cut into reads of at most ``size`` bytes, each still one run of file
    bytes (a buffer is cut where a read ends), so that threads can read them side by side."""
    out: list[tuple[str, int, list[memoryview]]] = []
    for path, offset, views in reads:
        if sum(map(len, views)) <= size:
            out.append((path, offset, views))
            continue
        cur: list[memoryview] = []
        start, filled = offset, 0
        for view in views:
            while len(view):
                take = min(len(view), size - filled)
                cur.append(view[:take])
                view, filled = view[take:], filled + take
                if filled == size:
                    out.append((path, start, cur))
                    start, cur, filled = start + size, [], 0
        if cur:
            out.append((path, start, cur))
    return out


# gaps of at most _GAP bytes are read too, into _SCRATCH (never read, so threads may share it): one
# preadv for a rank's rows of stacked experts, whose parts sit between other tensors'
_GAP = 64 << 10
_SCRATCH = memoryview(bytearray(_GAP))
