"""The block path of a save, over the geometry the load shares (``common._blocks``): who sends a
tensor-parallel DTensor's blocks, and how rank 0 puts the parts of a chunk together (rank 0; no
collectives). Rank 0 receives a chunk's parts into the second half of a staging slot and
:func:`place`\\ s them into the first, laid out as the chunk's rows."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..common._blocks import Blocks, Part
from ..errors import SaveError
from ..model._layout import rank_coordinates, runs_at

__all__ = ["blocks_of", "place", "senders"]


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


def place(rows: torch.Tensor, block: torch.Tensor, part: Part) -> None:
    """(rank 0) Copy a sender's ``block`` (``part.shape``) into ``rows``, a chunk laid out as full rows
    (``Chunk.shape``): rows ``part.rows``, on each later dimension the sender's runs, cast if needed."""
    target = rows[part.rows[0] : part.rows[1]]
    spans = []  # per later dimension: (global start, local start, length) of each run
    for runs in part.inner:
        local_starts = itertools.accumulate((b - a for a, b in runs), initial=0)
        spans.append([(a, local, b - a) for (a, b), local in zip(runs, local_starts)])
    for combination in itertools.product(*spans):
        into, values = target, block
        for dim, (start, local, length) in enumerate(combination, start=1):
            into, values = into.narrow(dim, start, length), values.narrow(dim, local, length)
        into.copy_(values)
