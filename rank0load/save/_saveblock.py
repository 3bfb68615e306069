"""The block path of a save: tensor-parallel DTensors reach rank 0 in chunks of whole rows.

A DTensor whose placements mix ``Shard(d)``, ``_StridedShard`` and ``Replicate`` (tensor parallel,
and FSDP2 on top of it: ``(Shard(0), Shard(1))`` for a rowwise weight, ``(_StridedShard(0), Shard(0))``
for a colwise one) leaves on each rank the cross product of index runs, one list per dimension
(``_layout.runs_at``: DTensor's own split, checked by every rank against its real shard at agreement).

(rank 0) :func:`blocks_of` names the senders: one replica per ``Replicate`` mesh dimension, as the
row path does, each with its runs.
(all ranks) :func:`block_chunks` cuts the saved tensor into chunks of whole rows of one dimension
``k`` (``k = 0`` unless a dimension-0 row is wider than half a staging slot). The part of a chunk a
sender holds is a contiguous range of its local shard, sent as it is (or cast into a staging slot).
Every rank derives the same chunks and parts, so nothing more is exchanged.
(rank 0) receives the parts into the second half of one staging slot and :func:`place`s them into
the first, laid out as the chunk's rows, which it writes as one byte range. No collectives here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..errors import SaveError
from ..model._layout import Runs, rank_coordinates, runs_at

__all__ = ["Blocks", "Chunk", "Part", "block_chunks", "blocks_of", "place", "senders"]

Blocks = tuple[tuple[int, Runs], ...]  # (global rank, the global indices it holds per dimension, as runs)


@dataclass(frozen=True)
class Chunk:
    """Bytes [start, start + nbytes) of the saved tensor: whole rows of one dimension."""

    start: int
    nbytes: int
    shape: tuple[int, ...]  # (rows, extents of the later dimensions): its layout in the slot


@dataclass(frozen=True)
class Part:
    """One sender's block of a chunk: one message."""

    src: int  # the sender's global rank (0: rank 0 copies its own)
    local: int  # element offset in the sender's local shard; the block is contiguous there
    nbytes: int
    rows: tuple[int, int]  # [first, end) rows of the chunk it covers
    inner: Runs  # the sender's global index runs on each dimension after the chunk's
    at: int  # byte offset in the chunk's receive area (the second half of its staging slot)

    @property
    def shape(self) -> tuple[int, ...]:
        """The block's shape as the sender holds it: its local width on the later dimensions."""
        return (self.rows[1] - self.rows[0], *(sum(b - a for a, b in r) for r in self.inner))


def senders(t: DTensor) -> Iterator[tuple[int, tuple[int, ...]]]:
    """(rank 0) The ranks that send ``t``'s bytes, with their mesh coordinates: the replica at
    coordinate 0 of every ``Replicate`` mesh dimension. On a sub-mesh (``mesh["dp"]``) the ranks of
    rank 0's slice send; the other slices are replicas."""
    replicated = [d for d, p in enumerate(t.placements) if type(p) is Replicate]
    for rank, coord in rank_coordinates(t.device_mesh):
        if all(coord[d] == 0 for d in replicated):
            yield rank, coord


def blocks_of(t: DTensor) -> Blocks:
    """(rank 0) Who sends which block of ``t`` (:func:`senders`), with the cross product of index
    runs it holds; ranks holding nothing left out."""
    mesh, placements = t.device_mesh, t.placements
    out = []
    for rank, coord in senders(t):
        runs = runs_at(placements, tuple(mesh.shape), coord, tuple(t.shape))
        if runs is None:  # every rank reported RUNS_OK for it: a bug, not a user error
            raise SaveError(f"no block layout for placements {placements} of shape {tuple(t.shape)}")
        if all(runs):
            out.append((rank, runs))
    return tuple(out)


def block_chunks(
    shape: tuple[int, ...], itemsize: int, blocks: Blocks, half: int, src: int | None = None
) -> Iterator[tuple[Chunk, tuple[Part, ...]]]:
    """(all ranks) The chunks of a tensor of ``shape`` held as ``blocks``, in byte order, each with
    the senders' parts by first row, then sender. A chunk holds at most ``half`` bytes (at least one
    element). ``src``: only that sender's parts (a sender needs no more; ``Part.at`` is then
    meaningless), in the same order as among all parts.

    ``k``: the first dimension whose rows fit in ``half``; a chunk is rows of ``k`` under one index
    of each dimension before it (a wide 2-D row is cut into column ranges; one expert of a 3-D
    tensor into its rows). The senders' runs are swept along the chunks, so a chunk costs only the
    senders holding part of it, not the world."""
    if math.prod(shape) == 0:
        return
    k = next(k for k in range(len(shape)) if math.prod(shape[k + 1 :]) * itemsize <= half)
    row = math.prod(shape[k + 1 :]) * itemsize  # bytes of one row of dimension k
    step = half // row
    senders = [(rank, runs) for rank, runs in blocks if src is None or rank == src]
    for number, outer in enumerate(itertools.product(*(range(n) for n in shape[:k]))):
        held = sorted(_held(senders, outer), key=lambda h: h[0])  # stable: by first row, then sender
        j, active = 0, []
        for first in range(0, shape[k], step):
            stop = min(first + step, shape[k])
            while j < len(held) and held[j][0] < stop:
                active.append(held[j])
                j += 1
            active = [h for h in active if h[1] > first]
            parts, at = [], 0
            for a, b, rank, local, width, inner in active:
                lo, hi = max(a, first), min(b, stop)
                nbytes = (hi - lo) * width * itemsize
                parts.append(
                    Part(rank, local + (lo - a) * width, nbytes, (lo - first, hi - first), inner, at)
                )
                at += nbytes
            shape_k = (stop - first, *shape[k + 1 :])
            yield Chunk((number * shape[k] + first) * row, (stop - first) * row, shape_k), tuple(parts)


def _held(
    senders: list[tuple[int, Runs]], outer: tuple[int, ...]
) -> Iterator[tuple[int, int, int, int, int, Runs]]:
    """The runs of dimension ``k = len(outer)`` the senders hold under the indices ``outer`` of the
    dimensions before it: (first row, end row, rank, element offset of the first row in its local
    shard, elements per local row, its runs on the later dimensions); nothing from a sender that
    lacks one of ``outer``."""
    k = len(outer)
    for rank, runs in senders:
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


def place(rows: torch.Tensor, block: torch.Tensor, part: Part) -> None:
    """(rank 0) Copy a sender's ``block`` (``part.shape``) into ``rows``, a chunk laid out as full rows
    (``Chunk.shape``): rows ``part.rows``, on each later dimension the sender's index runs (one copy
    per combination of runs: one for a plain ``Shard``, a few for ``_StridedShard``). Casts when the
    dtypes differ."""
    target = rows[part.rows[0] : part.rows[1]]
    spans = []  # per later dimension: (global start, local start, length) of each run
    for runs in part.inner:
        local, dim_spans = 0, []
        for a, b in runs:
            dim_spans.append((a, local, b - a))
            local += b - a
        spans.append(dim_spans)
    for combination in itertools.product(*spans):
        into, values = target, block
        for dim, (start, local, length) in enumerate(combination, start=1):
            into, values = into.narrow(dim, start, length), values.narrow(dim, local, length)
        into.copy_(values)
