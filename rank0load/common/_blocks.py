"""The geometry of a tensor-parallel (BLOCK) tensor in transit, for the load and the save alike (all
ranks; no collectives).

A DTensor whose placements mix ``Shard(d)``, ``_StridedShard`` and ``Replicate`` leaves on each
rank the cross product of index runs, one list per dimension (:data:`Runs`): its *block*. Such a
tensor passes through rank 0 in :class:`Chunk`\\ s of whole rows filling at most half a staging
slot; each rank's share of a chunk is one :class:`Part` per run of its indices: a contiguous range
of its local shard, one message. Every rank derives the same chunks and parts from the same blocks,
so nothing is exchanged to agree."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

Runs = tuple[tuple[tuple[int, int], ...], ...]  # per tensor dimension: [start, stop) runs of global indices
# (global rank, its block: the global index runs it holds per dimension)
Blocks = tuple[tuple[int, Runs], ...]


@dataclass(frozen=True)
class Chunk:
    """Whole rows of one dimension of a tensor (under one index of each dimension before it): bytes
    ``[start, start + nbytes)`` of the tensor, row-major."""

    start: int  # byte offset in the tensor (row-major)
    nbytes: int
    shape: tuple[int, ...]  # (rows, extents of the later dimensions): its layout in a staging slot


@dataclass(frozen=True)
class Part:
    """One rank's block of a chunk: rows ``rows`` of the chunk, cut to the rank's indices on the later
    dimensions; a contiguous range of the rank's local shard."""

    rank: int  # global rank: the receiver of a load's part, the sender of a save's
    rows: tuple[int, int]  # [first, end) rows of the chunk (counted from the chunk's first row)
    inner: Runs  # the rank's global index runs on each dimension after the chunk's rows
    local_offset: int  # byte offset in the rank's flat local shard, in the wire dtype
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The block's shape as the rank holds it: its local width on the later dimensions."""
        return (self.rows[1] - self.rows[0], *(sum(b - a for a, b in r) for r in self.inner))


def chunk_dim(shape: tuple[int, ...], itemsize: int, half: int) -> int | None:
    """The dimension whose rows a chunk of ``shape`` holds: the first whose rows (everything after
    it) fit in ``half`` bytes; None when no element fits, or ``shape`` has no dimension."""
    return next((k for k in range(len(shape)) if math.prod(shape[k + 1 :]) * itemsize <= half), None)


def block_chunks(
    shape: tuple[int, ...], itemsize: int, blocks: Iterable[tuple[int, Runs]], half: int
) -> Iterator[tuple[Chunk, tuple[Part, ...]]]:
    """(all ranks) The chunks of a tensor of ``shape`` (``itemsize`` bytes an element), in byte
    order, each with the parts of the ranks in ``blocks``: by first row, then in ``blocks``' order.
    A chunk holds at most ``half`` bytes (at least one element; ValueError if one does not fit); a
    tensor without elements has none. Passing one rank's block alone gives its parts, in the same
    order as among all."""
    if math.prod(shape) == 0:
        return
    k = chunk_dim(shape, itemsize, half)
    if k is None:
        raise ValueError(f"half a staging slot ({half} bytes) holds no element of {itemsize} bytes")
    row = math.prod(shape[k + 1 :]) * itemsize  # bytes of one row of dimension k
    step = half // row
    holders = list(blocks)
    for number, outer in enumerate(itertools.product(*(range(n) for n in shape[:k]))):
        held = sorted(_held(holders, outer), key=lambda h: h[0])  # stable: by first row, then rank
        j, active = 0, []
        for first in range(0, shape[k], step):
            stop = min(first + step, shape[k])
            while j < len(held) and held[j][0] < stop:
                active.append(held[j])
                j += 1
            active = [h for h in active if h[1] > first]
            parts = []
            for a, b, rank, local, width, inner in active:
                lo, hi = max(a, first), min(b, stop)
                offset = (local + (lo - a) * width) * itemsize
                parts.append(
                    Part(rank, (lo - first, hi - first), inner, offset, (hi - lo) * width * itemsize)
                )
            chunk = Chunk(
                (number * shape[k] + first) * row, (stop - first) * row, (stop - first, *shape[k + 1 :])
            )
            yield chunk, tuple(parts)


def _held(
    holders: list[tuple[int, Runs]], outer: tuple[int, ...]
) -> Iterator[tuple[int, int, int, int, int, Runs]]:
    """The runs of dimension ``k = len(outer)`` the ranks hold under ``outer``: (first row, end row,
    rank, element offset of the first row in its local shard, elements per local row, its runs on
    the later dimensions); nothing from a rank lacking ``outer`` or holding nothing later."""
    k = len(outer)
    for rank, runs in holders:
        counts = [sum(b - a for a, b in r) for r in runs]
        position = 0  # the local index of ``outer``, flattened over dimensions 0 .. k-1
        for dim, wanted in enumerate(outer):
            seen = 0
            for a, b in runs[dim]:
                if a <= wanted < b:
                    position = position * counts[dim] + seen + wanted - a
                    break
                seen += b - a
            else:
                break
        else:
            width = math.prod(counts[k + 1 :])  # elements of one local row of dimension k
            seen = 0
            for a, b in runs[k]:
                if width:
                    yield a, b, rank, (position * counts[k] + seen) * width, width, runs[k + 1 :]
                seen += b - a
