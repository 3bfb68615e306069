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
each): at each round's end every rank says whether it failed, so the ranks stop in step (one
round when every rank reads its own bytes: no message passes between them).
:func:`messages` groups the pieces into messages, closing a group only on facts every rank knows
(:meth:`_Gaps.apart`), so messages to rank ``r`` and broadcasts come in the same order on rank 0
and on rank ``r``: no rank waits on a broadcast while its peer waits on a send.
"""

from __future__ import annotations

import bisect
import enum
import functools
import itertools
import math
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from ..checkpoint._entries import Entry
from ..checkpoint._format import DTYPES
from ..checkpoint._fp8 import scale_span
from ..common._blocks import Chunk, Part, Runs, block_chunks, chunk_dim
from ..common._distribute import round_ends
from ..common._staging import ROUND_PIECES, aligned, block_half
from ..model._layout import ROWS_OK, RUNS_OK, placements_on, rank_coordinates, rows_of, runs_at


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
    def broadcast_whole(self) -> dict[str, int]:
        """Key -> bytes of the entries broadcast whole and cut on every rank (outside the staging
        budget), zero-size ones aside."""
        return {e.key: e.nbytes for e, k in zip(self.entries, self.kinds) if k is Kind.GENERIC and e.nbytes}

    def block_of(self, index: int, rank: int) -> Runs:
        """Rank ``rank``'s block runs of BLOCK entry ``index``."""
        placements = self.placements[index]
        assert placements is not None  # BLOCK entries are DTensors
        runs = runs_at(placements, self.mesh_shape, self.coord_of[rank], self.entries[index].shape)
        assert runs is not None  # every rank checked runs_at at agreement (RUNS_OK)
        return runs

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
            shared = entry.scales.nbytes if kind is not Kind.SHARDED else 0  # SHARDED: each rank its rows
            for start in range(0, shared, step):  # every rank needs the scales first
                n = min(step, entry.scales.nbytes - start)
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
                size, first, end = (hi - lo) * row, 0, 0
                if entry.scales:  # the bytes of the scale grid rows its rows need
                    per_row = math.prod(entry.shape[1:])
                    first, end = scale_span(
                        entry.part_rows, entry.shape[-1], entry.block, lo * per_row, hi * per_row
                    )
                scales = [  # before its rows
                    Piece(index, Route.SCALES, rank, at, min(step, end - at), at, kind)
                    for at in range(first, end, step)
                ]
                rows = [
                    Piece(index, Route.TO_RANK, rank, lo * row + at, min(step, size - at), at, kind)
                    for at in range(0, size, step)
                ]
                per_rank.append(scales + rows)
            # round-robin over destinations, so rank 0 reads its own rows while another's are on the
            # wire; each receiver still sees its own pieces in order
            for round_ in itertools.zip_longest(*per_rank):
                yield from (p for p in round_ if p is not None)

    def _block_pieces(self, index: int, me: int, cut_for: Collection[int] | None) -> Iterator[Piece]:
        """BLOCK entry ``index``'s pieces (:meth:`pieces`), chunk by chunk in file order; parts by rank,
        then row: the order rank 0 sends them in and each rank receives its own in."""
        entry, kind = self.entries[index], Kind.BLOCK
        layouts = [
            (rank, self.block_of(index, rank)) for rank in ([me] if cut_for is None else sorted(cut_for))
        ]
        half = block_half(self.piece_bytes)
        for chunk, parts in block_chunks(entry.shape, DTYPES[entry.dtype].itemsize, layouts, half):
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


def build_plan(
    entries: Sequence[Entry],
    targets: Sequence[torch.Tensor],
    flags: Sequence[int],
    mesh: DeviceMesh,
    piece_bytes: int,
) -> Plan:
    """(all ranks) The plan for ``entries`` (the manifest's), given each entry's target tensor and
    its layout flags AND-ed over the ranks; ``piece_bytes``: one staging slot (``_staging.slot_bytes``)."""
    kinds = []
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
    rounds = round_ends([e.nbytes for e in entries], ROUND_PIECES * piece_bytes)
    return Plan(
        entries=tuple(entries),
        kinds=tuple(kinds),
        placements=tuple(placements_on(t, mesh) if isinstance(t, DTensor) else None for t in targets),
        mesh_shape=tuple(mesh.shape),
        coords=rank_coordinates(mesh),
        piece_bytes=piece_bytes,
        rounds=rounds,
    )


BROADCAST = -1  # the lane of broadcast pieces (scale grids broadcast to all included)
_ALONE = -2  # rank 0's own pieces (rows, scale grid rows): kept, never sent; separate nothing
_BLOCK = -3  # a BLOCK entry's chunk or block: a message of its own (``_sink.fan_out``)


@dataclass(frozen=True)
class Message:
    """Pieces moved as one buffer: piece ``i``'s bytes at ``offsets[i]`` (multiples of ALIGN, so
    each slice views as its dtype), ``nbytes`` in all (at most ``Plan.piece_bytes``)."""

    pieces: tuple[Piece, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @property
    def first(self) -> Piece:
        return self.pieces[0]

    @property
    def index(self) -> int:
        """The entry of its first piece (a message never crosses a round's end)."""
        return self.pieces[0].index

    @property
    def dst(self) -> int:
        """Its destination rank, or -1: every rank (a broadcast) or a FAN_OUT chunk."""
        return self.pieces[0].dst

    def parts(self) -> Iterator[tuple[Piece, int]]:
        return zip(self.pieces, self.offsets)

    @classmethod
    def of(cls, piece: Piece) -> Message:
        return cls((piece,), (0,), piece.nbytes)

    @classmethod
    def packed(cls, pieces: list[Piece]) -> Message:
        """A message of ``pieces``, in order, each from the ALIGN boundary after the one before."""
        offsets = [0]
        for p in pieces[:-1]:
            offsets.append(aligned(offsets[-1] + p.nbytes))
        return cls(tuple(pieces), tuple(offsets), offsets[-1] + pieces[-1].nbytes)


class _Gaps:
    """Prefix counts over the plan's entries, so that any two pieces' separation is O(1)."""

    def __init__(self, plan: Plan) -> None:
        moving = [e.nbytes > 0 for e in plan.entries]
        sends = [m and k in (Kind.SHARDED, Kind.BLOCK) for m, k in zip(moving, plan.kinds)]
        shares = [m and k is not Kind.SHARDED for m, k in zip(moving, plan.kinds)]
        self.sends = tuple(itertools.accumulate(sends, initial=0))  # entries [0, i) that send point to point
        self.shares = tuple(itertools.accumulate(shares, initial=0))  # ... that broadcast or fan out
        self.round_of = tuple(bisect.bisect_right(plan.rounds, i) for i in range(len(plan.entries)))

    def apart(self, last: Piece, lane: int, piece: Piece, piece_lane: int) -> bool:
        """Whether an open group of ``lane`` ending with ``last`` must close before ``piece``: at a
        round's end; a broadcast group before an entry in between that sends point to point; a group
        to rank ``r`` before one that broadcasts or fans out a BLOCK entry."""
        a, b = last.index, piece.index
        if self.round_of[a] != self.round_of[b]:
            return True
        if piece_lane == _ALONE:
            return False
        if lane == BROADCAST:  # an entry's own point-to-point pieces follow its broadcast ones
            return piece_lane != BROADCAST or self.sends[b] > self.sends[a]
        if piece_lane in (BROADCAST, _BLOCK):  # an entry's broadcast pieces precede its own
            return True
        return piece_lane == lane and self.shares[b + 1] > self.shares[a + 1]


def messages(plan: Plan, pieces: Iterable[Piece], own_together: bool = False) -> Iterator[Message]:
    """(all ranks) ``pieces`` (one rank's view of ``plan``, in plan order) grouped by lane (the rank
    they go to, or :data:`BROADCAST`) into messages, in the order they move. BLOCK pieces are
    messages of one piece each; so are rank 0's own pieces, unless ``own_together``: then
    consecutive own pieces are grouped too, and any other piece closes their group first, so that
    nothing another rank sees moves in another order."""
    gaps = _Gaps(plan)
    open_: dict[int, list[Piece]] = {}  # lane -> its open group
    ends: dict[int, int] = {}  # lane -> where its open group's bytes end, laid out as Message.packed does

    round_ = -1
    for piece in pieces:
        if piece.route is Route.FAN_OUT or piece.kind is Kind.BLOCK and piece.route is Route.TO_RANK:
            lane = _BLOCK
        elif piece.dst < 0:
            lane = BROADCAST
        else:
            lane = _ALONE if piece.dst == 0 else piece.dst
        if lane != _ALONE and _ALONE in open_:  # rank 0's own pieces never wait behind another's
            yield Message.packed(open_.pop(_ALONE))
        # the open groups this piece may separate (_Gaps.apart)
        if gaps.round_of[piece.index] != round_ or lane in (BROADCAST, _BLOCK):
            round_, suspects = gaps.round_of[piece.index], sorted(open_)
        else:
            suspects = [other for other in (BROADCAST, lane) if other in open_]
        for other in suspects:
            if gaps.apart(open_[other][-1], other, piece, lane):
                yield Message.packed(open_.pop(other))
        if lane == _BLOCK or lane == _ALONE and not own_together:
            yield Message.of(piece)
            continue
        at = aligned(ends[lane]) if lane in open_ else 0
        if lane in open_ and at + piece.nbytes > plan.piece_bytes:
            yield Message.packed(open_.pop(lane))
            at = 0
        open_.setdefault(lane, []).append(piece)
        ends[lane] = at + piece.nbytes
    for lane in sorted(open_):
        yield Message.packed(open_.pop(lane))
