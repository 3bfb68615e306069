"""How each manifest entry travels: which rank gets which bytes (all ranks; no collectives).

Every rank derives the same sequence of :class:`Piece` from the manifest, the agreed kinds and the
mesh, so sender and receivers agree on every message without exchanging anything more. The kinds:

* ``SHARDED`` (only ``Shard(0)`` and ``Replicate``): rank 0 sends each rank exactly its rows, point
  to point, in pieces of at most ``piece_bytes``, and reads its own into its shard. A float8 entry's
  rank gets the scale grid rows its rows need just before them; other kinds get the whole grids.
* ``PLAIN`` (buffers, unsharded parameters): read on rank 0 and broadcast, in pieces.
* ``BLOCK`` (any mix of ``Shard(d)``, ``_StridedShard`` and ``Replicate``): rank 0 reads chunks of
  whole rows and sends each rank its part of each (``common._blocks``); no rank ever holds the full
  tensor. A float8 block travels as float8 and its owner dequantises it.
* ``GENERIC`` (anything else, or what :func:`fits_block` refuses): broadcast in pieces into a
  full-size tensor on every rank, which cuts its own shard (outside the staging budget).

The stream is cut into *rounds* of whole entries (at least :data:`ROUND_PIECES` pieces of bytes
each): at each round's end every rank says whether it failed, so the ranks stop in step.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from ..checkpoint._entries import Entry
from ..checkpoint._format import DTYPES
from ..checkpoint._fp8 import scale_span
from ..common._blocks import Chunk, Part, Runs, block_chunks, chunk_dim
from ..common._distribute import round_ends
from ..common._staging import ALIGN, ROUND_PIECES, block_half
from ..model._layout import ROWS_OK, RUNS_OK, placements_on, rank_coordinates, rows_of, runs_at

__all__ = ["Kind", "Piece", "Plan", "Route", "build_plan", "fits_block"]


class Kind(enum.Enum):
    """How an entry travels (the module docstring says each)."""

    SHARDED = "sharded"
    PLAIN = "plain"
    BLOCK = "block"
    GENERIC = "generic"


class Route(enum.Enum):
    """Where a piece goes."""

    TO_RANK = "to_rank"  # point to point to ``Piece.dst`` (rank 0 itself: read in place)
    BROADCAST = "broadcast"  # to every rank
    FAN_OUT = "fan_out"  # a BLOCK chunk, read once and cut into its parts (rank 0, or a local reader)
    SCALES = "scales"  # to every rank: a float8 entry's scale grids, before its data (see _fp8)


@dataclass(frozen=True)
class Piece:
    """A contiguous byte range of a checkpoint entry and its place in the destination's local tensor."""

    index: int  # manifest entry index
    route: Route
    dst: int  # global rank for Route.TO_RANK; -1 otherwise
    start: int  # offset in the entry's bytes (``Entry.extents`` says where they are in the files)
    nbytes: int
    local_offset: int  # byte offset in the destination's local (wire-dtype) flat tensor; FAN_OUT: 0
    kind: Kind
    chunk: Chunk | None = None  # FAN_OUT: the chunk it reads
    parts: tuple[Part, ...] = ()  # FAN_OUT: the parts this rank cuts from it, by rank, then row


@dataclass(frozen=True)
class Plan:
    """(all ranks, identical everywhere) What moves where, in manifest order."""

    entries: tuple[Entry, ...]
    kinds: tuple[Kind, ...]
    placements: tuple[tuple[Placement, ...] | None, ...]  # lifted to the load mesh; None: plain tensor
    mesh_shape: tuple[int, ...]
    coords: tuple[tuple[int, tuple[int, ...]], ...]  # (global rank, mesh coordinate), by rank
    piece_bytes: int
    rounds: tuple[int, ...]  # the entry index just past each round's last entry

    @functools.cached_property
    def coord_of(self) -> dict[int, tuple[int, ...]]:
        return dict(self.coords)

    @property
    def broadcast_whole(self) -> tuple[str, ...]:
        """Keys broadcast whole and cut on every rank (outside the staging budget), zero-size ones aside."""
        return tuple(e.key for e, k in zip(self.entries, self.kinds) if k is Kind.GENERIC and e.nbytes)

    def block_layouts(self, index: int, ranks: Sequence[int]) -> dict[int, Runs]:
        """Rank -> block runs of BLOCK entry ``index``, for ``ranks`` (rank 0: all; others: itself)."""
        placements = self.placements[index]
        assert placements is not None  # BLOCK entries are DTensors
        coord = self.coord_of
        shape = self.entries[index].shape
        out = {}
        for r in ranks:
            runs = runs_at(placements, self.mesh_shape, coord[r], shape)
            assert runs is not None  # every rank checked runs_at at agreement (RUNS_OK)
            out[r] = runs
        return out

    def pieces(self, me: int, cut_for: Collection[int] | None = None) -> Iterator[Piece]:
        """(all ranks) The agreed messages as rank ``me`` sees them, in manifest order.

        A BLOCK entry comes as FAN_OUT chunks with the parts of the ranks in ``cut_for`` (on rank 0
        by default every rank's; a rank reading its own bytes: ``(me,)``). Another rank without
        ``cut_for`` gets its own parts as TO_RANK pieces, received like row pieces."""
        if cut_for is None and me == 0:
            cut_for = [rank for rank, _ in self.coords]
        step = self.piece_bytes
        for index, (entry, kind) in enumerate(zip(self.entries, self.kinds)):
            if entry.nbytes == 0:
                continue
            shared = entry.scale_nbytes if kind is not Kind.SHARDED else 0  # SHARDED: each rank its rows
            for start in range(0, shared, step):  # every rank needs the scales first
                n = min(step, entry.scale_nbytes - start)
                yield Piece(index, Route.SCALES, -1, start, n, start, kind)
            if kind is Kind.BLOCK:
                yield from self._block_pieces(index, me, cut_for)
                continue
            if kind in (Kind.PLAIN, Kind.GENERIC):
                for start in range(0, entry.nbytes, step):
                    n = min(step, entry.nbytes - start)
                    yield Piece(index, Route.BROADCAST, -1, start, n, start, kind)
                continue
            placements = self.placements[index]
            assert placements is not None  # SHARDED entries are DTensors
            row = entry.nbytes // entry.shape[0]
            per_rank = []
            for rank, coord in self.coords if me == 0 else [(me, self.coord_of[me])]:
                lo, hi = rows_of(self.mesh_shape, placements, entry.shape[0], coord)
                size, (first, end) = (hi - lo) * row, _scale_rows(entry, lo, hi)
                scales = [  # before its rows
                    Piece(index, Route.SCALES, rank, at, min(step, end - at), at, kind)
                    for at in range(first, end, step)
                ]
                per_rank.append(
                    scales
                    + [
                        Piece(index, Route.TO_RANK, rank, lo * row + at, min(step, size - at), at, kind)
                        for at in range(0, size, step)
                    ]
                )
            # round-robin over destinations, so rank 0 reads its own rows while another's are on the
            # wire; each receiver still sees its own pieces in order
            for round_ in itertools.zip_longest(*per_rank):
                yield from (p for p in round_ if p is not None)

    def _block_pieces(self, index: int, me: int, cut_for: Collection[int] | None) -> Iterator[Piece]:
        """BLOCK entry ``index``'s chunks, in file order: FAN_OUT pieces with the parts of the ranks
        in ``cut_for`` (by rank, then row: the order rank 0 sends them in and each rank receives its
        own in), or, without ``cut_for``, ``me``'s parts as its TO_RANK pieces."""
        entry, kind = self.entries[index], Kind.BLOCK
        layouts = self.block_layouts(index, [me] if cut_for is None else sorted(cut_for))
        half = block_half(self.piece_bytes)
        for chunk, parts in block_chunks(entry.shape, DTYPES[entry.dtype].itemsize, layouts.items(), half):
            parts = tuple(sorted(parts, key=lambda p: (p.rank, p.local_offset)))
            if cut_for is not None:
                yield Piece(index, Route.FAN_OUT, -1, chunk.start, chunk.nbytes, 0, kind, chunk, parts)
                continue
            for part in parts:
                yield Piece(index, Route.TO_RANK, me, chunk.start, part.nbytes, part.local_offset, kind)


def fits_block(entry: Entry, piece_bytes: int) -> bool:
    """Whether BLOCK ``entry`` can move in chunks of at most half a staging slot of whole dimension-0
    rows, or of dimension-1 rows under one dimension-0 index (one expert of [E, 2I, H]). Otherwise
    (or without bytes) it goes GENERIC."""
    if not entry.nbytes:
        return False
    dim = chunk_dim(entry.shape, DTYPES[entry.dtype].itemsize, block_half(piece_bytes))
    return dim == 0 or dim == 1 and len(entry.shape) >= 3


def _scale_rows(entry: Entry, lo: int, hi: int) -> tuple[int, int]:
    """The bytes of ``entry``'s scale grids that its rows ``[lo, hi)`` need; (0, 0) if unquantised."""
    if not entry.scales:
        return 0, 0
    per_row = math.prod(entry.shape[1:])
    return scale_span(entry.part_rows, entry.shape[-1], entry.block, lo * per_row, hi * per_row)


def build_plan(
    entries: Sequence[Entry],
    targets: Sequence[torch.Tensor],
    flags: Sequence[int],
    mesh: DeviceMesh,
    piece_bytes: int,
) -> Plan:
    """(all ranks) The plan for ``entries`` (the manifest's), given each entry's target tensor and
    its layout flags AND-ed over the ranks."""
    piece_bytes = max(ALIGN, piece_bytes // ALIGN * ALIGN)
    kinds = []
    placements: list[tuple[Placement, ...] | None] = []
    for entry, target, f in zip(entries, targets, flags, strict=True):
        if not isinstance(target, DTensor):
            kind = Kind.PLAIN
        elif f & ROWS_OK:
            kind = Kind.SHARDED
        elif f & RUNS_OK and fits_block(entry, piece_bytes):
            kind = Kind.BLOCK
        else:
            kind = Kind.GENERIC
        kinds.append(kind)
        placements.append(placements_on(target, mesh) if isinstance(target, DTensor) else None)
    rounds = round_ends([e.nbytes for e in entries], ROUND_PIECES * piece_bytes)
    return Plan(
        entries=tuple(entries),
        kinds=tuple(kinds),
        placements=tuple(placements),
        mesh_shape=tuple(mesh.shape),
        coords=rank_coordinates(mesh),
        piece_bytes=piece_bytes,
        rounds=rounds,
    )
