"""BLOCK entries' geometry: chunks of whole rows, each rank's block of a chunk (all ranks; no collectives).

A BLOCK entry (any mix of ``Shard(d)``, ``_StridedShard`` and ``Replicate``) travels as chunks of
whole rows filling at most half a staging slot (:func:`block_chunks`; dimension-1 rows of one
dimension-0 index when a whole row is wider), and each rank's block of a chunk is a
:class:`Delivery` (:func:`deliveries`). Rank 0 cuts every rank's blocks (``_sink.fan_out``), a
local reader cuts its own, and a receiver derives the pieces it receives from the same
deliveries, so they agree without exchanging anything.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from ..checkpoint._entries import Entry
from ..common._staging import block_half
from ..model._layout import Runs
from ._pieces import Kind, Piece, Route

__all__ = [
    "Delivery",
    "block_chunk_rows",
    "block_chunks",
    "cut",
    "deliveries",
    "fits_block",
    "inner_entry",
    "row_bytes",
]


@dataclass(frozen=True)
class Delivery:
    """One rank's block of a BLOCK chunk: rows ``[row_lo, row_hi)`` of the chunk (chunk-relative),
    cut to the rank's indices on the other dimensions, landing at ``local_offset`` (bytes, wire dtype)."""

    dst: int
    row_lo: int
    row_hi: int
    local_offset: int
    nbytes: int
    inner: tuple[tuple[tuple[int, int], ...], ...]  # runs on dimensions 1..n-1


def row_bytes(entry: Entry) -> int:
    """Bytes of one row (everything but dimension 0) of ``entry``; 0 when it has no rows."""
    return entry.nbytes // entry.shape[0] if entry.shape and entry.shape[0] else 0


def block_chunk_rows(entry: Entry, piece_bytes: int) -> int:
    """Rows per BLOCK chunk: whole rows filling at most half a staging slot (the other half holds
    the cut blocks); 0 when a single row is wider than that (see :func:`inner_entry`)."""
    size = row_bytes(entry)
    return block_half(piece_bytes) // size if size else 0


def inner_entry(entry: Entry) -> Entry | None:
    """``entry`` seen from inside one index of dimension 0 (one expert of [E, 2I, H]), for chunks
    of dimension-1 rows when a whole dimension-0 slice is too wide; None below 3 dimensions."""
    if len(entry.shape) < 3 or not entry.shape[0]:
        return None
    return Entry(
        entry.key, entry.file, entry.ckpt_key, entry.dtype, entry.shape[1:], 0, entry.nbytes // entry.shape[0]
    )


def _position(runs: tuple[tuple[int, int], ...], index: int) -> int | None:
    """Where global ``index`` sits among the indices ``runs`` hold, or None."""
    position = 0
    for start, stop in runs:
        if start <= index < stop:
            return position + index - start
        position += stop - start
    return None


def cut(chunk: torch.Tensor, d: Delivery) -> torch.Tensor:
    """``d``'s block of ``chunk`` (the chunk's rows, full shape otherwise): a view where the rank's
    indices on each dimension are one run, a copy (``torch.cat``) where they are several."""
    block = chunk[d.row_lo : d.row_hi]
    for dim, dim_runs in enumerate(d.inner, start=1):
        if dim_runs == ((0, chunk.shape[dim]),):
            continue
        parts = [block.narrow(dim, a, b - a) for a, b in dim_runs]
        block = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
    return block


def deliveries(piece: Piece, entry: Entry, runs_by_rank: dict[int, Runs]) -> Iterator[Delivery]:
    """(all ranks) The blocks of the BLOCK chunk ``piece`` for the ranks in ``runs_by_rank``, in
    rank order, then row order: rank 0 sends them in this order and each rank receives its own
    in this order."""
    if piece.outer >= 0:  # dimension-1 rows of one dimension-0 index: the same, one level down
        sub = inner_entry(entry)
        assert sub is not None  # such chunks are only made for 3-D and wider entries
        size = entry.nbytes // max(1, math.prod(entry.shape))
        for rank in sorted(runs_by_rank):
            rank_runs = runs_by_rank[rank]
            at = _position(rank_runs[0], piece.outer)
            if at is None:
                continue
            base = at * math.prod(sum(b - a for a, b in r) for r in rank_runs[1:]) * size
            for d in deliveries(replace(piece, outer=-1), sub, {rank: rank_runs[1:]}):
                yield replace(d, local_offset=d.local_offset + base)
        return
    itemsize = entry.nbytes // math.prod(entry.shape)
    first = piece.local_offset  # a FAN_OUT chunk's first row (see block_chunks)
    last = first + piece.nbytes // row_bytes(entry)
    for rank in sorted(runs_by_rank):
        runs = runs_by_rank[rank]
        inner = runs[1:]
        row_elems = math.prod(sum(b - a for a, b in r) for r in inner)
        position = 0  # the local row where the current run starts
        for start, stop in runs[0]:
            lo, hi = max(start, first), min(stop, last)
            if lo < hi and row_elems:
                yield Delivery(
                    rank,
                    lo - first,
                    hi - first,
                    (position + lo - start) * row_elems * itemsize,
                    (hi - lo) * row_elems * itemsize,
                    inner,
                )
            position += stop - start


def block_chunks(index: int, entry: Entry, step: int) -> Iterator[Piece]:
    """A BLOCK entry's chunks, in file order: whole dimension-0 rows, or, when one is wider than half
    a slot, dimension-1 rows of each dimension-0 index in turn."""
    rows, size = block_chunk_rows(entry, step), row_bytes(entry)
    if rows:
        for first in range(0, entry.shape[0], rows):
            n = min(rows, entry.shape[0] - first)
            yield Piece(index, Route.FAN_OUT, -1, first * size, n * size, first, Kind.BLOCK)
        return
    inner = inner_entry(entry)
    assert inner is not None  # build_plan made it GENERIC otherwise
    sub_rows, sub = block_chunk_rows(inner, step), row_bytes(inner)
    for outer in range(entry.shape[0]):
        for first in range(0, inner.shape[0], sub_rows):
            n = min(sub_rows, inner.shape[0] - first)
            yield Piece(
                index, Route.FAN_OUT, -1, outer * size + first * sub, n * sub, first, Kind.BLOCK, outer
            )


def fits_block(entry: Entry, piece_bytes: int) -> bool:
    """Whole rows, or dimension-1 rows of one dimension-0 index, fit half a staging slot."""
    if block_chunk_rows(entry, piece_bytes):
        return True
    inner = inner_entry(entry)
    return inner is not None and block_chunk_rows(inner, piece_bytes) > 0
