"""How each manifest entry travels: which rank gets which bytes (all ranks; no collectives).

Every rank derives the same sequence of :class:`Piece` from the manifest, the agreed kinds and the
mesh (:func:`build_plan` -> :class:`Plan`), so sender and receivers agree on every message without
exchanging anything more. A piece is a contiguous byte range of the checkpoint (wire dtype) and its
place in the destination's local tensor.

* ``SHARDED`` (a DTensor whose placements are only ``Shard(0)`` and ``Replicate``): each rank's
  local tensor is a contiguous range of rows, one contiguous range of the file. Rank 0 sends each
  rank exactly its rows, point to point, in pieces of at most ``piece_bytes``; the rows it keeps
  itself are read straight into its local shard. A float8 entry's rank gets the rows of the scale
  grids its rows need (``_fp8.scale_span``) just before them; other kinds get the whole grids.
* ``PLAIN`` (buffers, unsharded parameters): read on rank 0 and broadcast, in pieces.
* ``BLOCK`` (any mix of ``Shard(d)``, ``_StridedShard`` and ``Replicate``: tensor-parallel
  ``Shard(1)``, the ``_StridedShard`` FSDP2 puts on top of a colwise TP shard): each rank's local
  tensor is the cross product of index runs, one list per dimension, which rank 0 computes for
  every rank itself (``_layout.runs_at``; see there why nothing per rank is exchanged). It reads the
  tensor in chunks of whole rows (at most half a staging slot), cuts each rank's block out of the
  chunk and sends it point to point (:class:`Delivery`). No rank ever holds the full tensor. A
  float8 block travels as float8 and its owner dequantises each element with the scale of the
  block of the tensor it came from (``_layout.global_indices``).
* ``GENERIC`` (placements that are none of the above, a non-contiguous local shard, rows wider than
  half a staging slot): broadcast in pieces into a full-size tensor on every rank, which then cuts
  its own shard locally (outside the staging budget; reported in ``LoadReport.broadcast_whole``).

The stream is cut into *rounds* of whole entries (at least :data:`ROUND_PIECES` staging pieces of
bytes each): at the end of each round every rank says whether it failed, so a failure reaches every
rank within one round and the ranks stop in step (``_transfer.stream``).
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from ..checkpoint._entries import Entry
from ..checkpoint._fp8 import scale_span
from ..common._distribute import round_ends
from ..model._layout import ROWS_OK, RUNS_OK, Runs, placements_on, rank_coordinates, rows_of, runs_at

__all__ = [
    "ALIGN",
    "Delivery",
    "Kind",
    "Piece",
    "Plan",
    "Route",
    "block_chunk_rows",
    "block_half",
    "build_plan",
    "cut",
    "deliveries",
    "kind_of",
    "row_bytes",
]

ALIGN = 64  # piece boundaries stay multiples of every element size
ROUND_PIECES = 64  # a round carries at least this many pieces' worth of bytes (256 MiB by default)


class Kind(enum.Enum):
    """How an entry travels (see the module docstring)."""

    SHARDED = "sharded"
    PLAIN = "plain"
    BLOCK = "block"
    GENERIC = "generic"


class Route(enum.Enum):
    """Where a piece goes."""

    TO_RANK = "to_rank"  # point to point to ``Piece.dst`` (rank 0 itself: read in place)
    BROADCAST = "broadcast"  # to every rank
    FAN_OUT = "fan_out"  # (rank 0 only) a BLOCK chunk, read once and cut into Deliveries
    SCALES = "scales"  # to every rank: a float8 entry's scale grids, before its data (see _fp8)


@dataclass(frozen=True)
class Piece:
    index: int  # manifest entry index
    route: Route
    dst: int  # global rank for Route.TO_RANK; -1 otherwise
    start: int  # offset in the entry's bytes (``Entry.extents`` says where they are in the files)
    nbytes: int
    local_offset: int  # byte offset in the destination's local (wire-dtype) flat tensor
    kind: Kind
    # A BLOCK chunk of rows of dimension 1 inside one index of dimension 0 (a 3-D tensor whose
    # dimension-0 slices are wider than half a staging slot, e.g. one expert): that index. -1:
    # a chunk of whole dimension-0 rows.
    outer: int = -1


def kind_of(target: torch.Tensor, flags: int) -> Kind:
    """The kind every rank takes for ``target`` given the flags AND-ed over all ranks."""
    if not isinstance(target, DTensor):
        return Kind.PLAIN
    if flags & ROWS_OK:
        return Kind.SHARDED
    if flags & RUNS_OK:
        return Kind.BLOCK
    return Kind.GENERIC


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


def block_half(piece_bytes: int) -> int:
    """Bytes of a staging slot a BLOCK chunk may fill; the blocks cut from it go after them."""
    return (piece_bytes // ALIGN * ALIGN) // 2 // ALIGN * ALIGN


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
    first = piece.local_offset  # a chunk's first row
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
        """Keys broadcast whole and cut on every rank (outside the staging budget); zero-size
        tensors move nothing and are not counted."""
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

    def pieces(self, me: int, chunks: bool = False) -> Iterator[Piece]:
        """(all ranks) The agreed messages as rank ``me`` sees them, in manifest order.

        Rank 0 gets a BLOCK entry as FAN_OUT chunks; another rank gets the pieces its own deliveries
        become (``dst`` = ``me``), so it receives them like row pieces. ``chunks``: FAN_OUT chunks
        for any ``me`` (a rank reading its own bytes cuts its own blocks from them, see _localread).
        """
        for index, kind in enumerate(self.kinds):
            yield from self._entry_pieces(index, kind, me, chunks)

    def _entry_pieces(self, index: int, kind: Kind, me: int, chunks: bool = False) -> Iterator[Piece]:
        entry = self.entries[index]
        if entry.nbytes == 0:  # zero-width: nothing to move
            return
        step = self.piece_bytes
        shared = entry.scale_nbytes if kind is not Kind.SHARDED else 0  # SHARDED: each rank its rows
        for start in range(0, shared, step):  # every rank needs the scales first
            yield Piece(index, Route.SCALES, -1, start, min(step, entry.scale_nbytes - start), start, kind)
        if kind is Kind.BLOCK:
            mine = None if me == 0 or chunks else self.block_layouts(index, [me])
            for chunk in _block_chunks(index, entry, step):
                if mine is None:
                    yield chunk
                    continue
                for d in deliveries(chunk, entry, mine):
                    yield Piece(index, Route.TO_RANK, me, chunk.start, d.nbytes, d.local_offset, kind)
            return
        if kind in (Kind.PLAIN, Kind.GENERIC):
            for start in range(0, entry.nbytes, step):
                n = min(step, entry.nbytes - start)
                yield Piece(index, Route.BROADCAST, -1, start, n, start, kind)
            return
        placements = self.placements[index]
        assert placements is not None  # SHARDED entries are DTensors
        row = row_bytes(entry)
        per_rank = []
        # Rank 0 sends every rank's pieces; another rank needs only its own.
        for rank, coord in self.coords if me == 0 else [(me, self.coord_of[me])]:
            lo, hi = rows_of(self.mesh_shape, placements, entry.shape[0], coord)
            size, (first, end) = (hi - lo) * row, _scale_rows(entry, lo, hi)
            scales = [  # the scale grid rows of its rows, before them
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
        # Round-robin over the destinations: while rank 0 reads its own rows straight into its
        # shard, the piece it read for another rank is already on the wire. Each receiver still
        # sees its own pieces in order.
        for round_ in itertools.zip_longest(*per_rank):
            yield from (p for p in round_ if p is not None)


def _scale_rows(entry: Entry, lo: int, hi: int) -> tuple[int, int]:
    """The bytes of ``entry``'s scale grids that its rows ``[lo, hi)`` need; (0, 0) if unquantised."""
    if not entry.scales:
        return 0, 0
    per_row = math.prod(entry.shape[1:])
    return scale_span(entry.part_rows, entry.shape[-1], entry.block, lo * per_row, hi * per_row)


def _block_chunks(index: int, entry: Entry, step: int) -> Iterator[Piece]:
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


def _fits_block(entry: Entry, piece_bytes: int) -> bool:
    """Whole rows, or dimension-1 rows of one dimension-0 index, fit half a staging slot."""
    if block_chunk_rows(entry, piece_bytes):
        return True
    inner = inner_entry(entry)
    return inner is not None and block_chunk_rows(inner, piece_bytes) > 0


def build_plan(
    entries: Sequence[Entry],
    targets: Sequence[torch.Tensor],
    flags: Sequence[int],
    mesh: DeviceMesh,
    piece_bytes: int,
) -> Plan:
    """(all ranks) The plan for ``entries`` (the manifest's), given each entry's target tensor and
    its layout flags AND-ed over the ranks. BLOCK entries whose rows are wider than half a staging
    slot go GENERIC."""
    piece_bytes = max(ALIGN, piece_bytes // ALIGN * ALIGN)
    kinds = []
    placements: list[tuple[Placement, ...] | None] = []
    for entry, target, f in zip(entries, targets, flags, strict=True):
        kind = kind_of(target, f)
        if kind is Kind.BLOCK and not _fits_block(entry, piece_bytes):
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
