"""How each manifest entry travels: which rank gets which bytes (all ranks; no collectives).

Every rank derives the same sequence of :class:`Piece` from the manifest and the mesh, so sender
and receivers agree on every message without exchanging anything. A piece is a contiguous byte
range of the checkpoint (wire dtype) and its place in the destination's local tensor.

* ``SHARDED`` entries (a DTensor whose placements are only ``Shard(0)`` and ``Replicate``): each
  rank's local tensor is a contiguous range of rows, so its bytes are one contiguous range of
  the file. Rank 0 sends each rank exactly its rows, point to point, in pieces of at most
  ``piece_bytes``; the rows it keeps itself are read straight into its local shard.
* ``PLAIN`` entries (buffers, unsharded parameters): read on rank 0 and broadcast, in pieces.
* ``BLOCK`` entries (any mix of ``Shard(d)``, ``_StridedShard`` and ``Replicate``, e.g. tensor
  parallel ``Shard(1)``, or the ``_StridedShard`` FSDP2 puts on top of a colwise TP shard): each
  rank's local tensor is the cross product of index runs, one list per dimension (:func:`block_runs`,
  computed by DTensor's own split on every rank and gathered by rank 0 when the ranks agree). Rank 0
  reads the tensor in chunks of whole rows (at most half a staging slot), cuts each rank's block
  out of the chunk and sends it point to point (:class:`Delivery`); a block is exactly a run of the
  rank's local rows, so it lands straight in the local shard. No rank ever holds the full tensor.
* ``GENERIC`` entries (placements DTensor may add that are none of the above, a non-contiguous
  local shard, or rows wider than half a staging slot): one piece; rank 0 reads the full tensor and
  broadcasts it, and every rank cuts its own shard locally (see ``_distribute._generic``).

A DTensor may live on a sub-mesh of the load mesh (``fully_shard(m, mesh=mesh["dp"])`` on a
("dp", "tp") mesh leaves embeddings and norms on the "dp" sub-mesh). :func:`placements_on` lifts its
placements to the load mesh, with ``Replicate`` on the dimensions the sub-mesh lacks: each tp group
member holds the same shard. Without lifting, a collective on the sub-mesh would only reach the
sub-mesh instance that contains rank 0, and the others would receive nothing.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from ._compat import local_tensor
from ._manifest import Entry
from .errors import LoadError

__all__ = [
    "BLOCK",
    "BROADCAST",
    "FAN_OUT",
    "Delivery",
    "GENERIC",
    "PLAIN",
    "SHARDED",
    "Piece",
    "block_chunk_rows",
    "block_half",
    "block_runs",
    "cut",
    "deliveries",
    "entry_kind",
    "entry_layout",
    "pieces",
    "placements_on",
    "row_bytes",
    "rows_of",
]

SHARDED, PLAIN, BLOCK, GENERIC = "sharded", "plain", "block", "generic"
BROADCAST = -1  # Piece.dst for a broadcast to every rank
FAN_OUT = -2  # Piece.dst for a BLOCK chunk on rank 0: read once, cut into Deliveries

Runs = tuple[tuple[tuple[int, int], ...], ...]  # per tensor dimension: [start, stop) runs of global indices
ALIGN = 64  # piece boundaries stay multiples of every element size


@dataclass(frozen=True)
class Piece:
    index: int  # manifest entry index
    dst: int  # global rank, or BROADCAST
    file_offset: int  # absolute offset in the entry's file
    nbytes: int
    local_offset: int  # byte offset in the destination's local (wire-dtype) flat tensor
    kind: str


def _chunk(start: int, stop: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk semantics (what DTensor's Shard and FSDP2 use): ceil-sized chunks, trailing empty."""
    n = stop - start
    if n == 0:
        return start, start
    size = math.ceil(n / parts)
    lo = min(start + index * size, stop)
    return lo, min(lo + size, stop)


def rows_of(
    mesh: DeviceMesh, placements: Sequence[object], nrows: int, coord: Sequence[int]
) -> tuple[int, int]:
    """The row range [lo, hi) that the rank at mesh coordinate ``coord`` holds."""
    lo, hi = 0, nrows
    for dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            lo, hi = _chunk(lo, hi, mesh.size(dim), coord[dim])
    return lo, hi


def _fast_placements(placements: Sequence[object]) -> bool:
    return all(type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in placements)


def placements_on(target: DTensor, mesh: DeviceMesh) -> tuple[Placement, ...]:
    """(all ranks) ``target``'s placements expressed on the load ``mesh``.

    A DTensor on ``mesh`` itself keeps its placements. One on a sub-mesh made by slicing named
    dimensions of ``mesh`` (``mesh["dp"]``) gets ``Replicate`` on the dimensions it lacks. Any other
    mesh (a flattened dimension, dimensions reordered, an unrelated mesh) raises :class:`LoadError`:
    rank 0 could not reach every rank's shard through it.
    """
    sub = target.device_mesh
    if sub == mesh:
        return tuple(target.placements)
    names, sub_names = mesh.mesh_dim_names, sub.mesh_dim_names
    dims = (
        [names.index(n) for n in sub_names] if names and sub_names and set(sub_names) <= set(names) else None
    )
    coord = mesh.get_coordinate()
    if (
        dims is not None
        and dims == sorted(dims)
        and coord is not None
        and sub.device_type == mesh.device_type
    ):
        index = tuple(slice(None) if d in dims else coord[d] for d in range(mesh.ndim))
        if torch.equal(mesh.mesh[index], sub.mesh):
            lifted: list[Placement] = [Replicate()] * mesh.ndim
            for i, d in enumerate(dims):
                lifted[d] = target.placements[i]
            return tuple(lifted)
    raise LoadError(
        f"a parameter lives on device mesh {sub} (dims {sub_names}), which is neither the load mesh "
        f"{mesh} (dims {names}) nor a slice of its named dimensions (mesh['dp']). Pass load_sharded "
        "the root mesh your shard_fn slices, with mesh_dim_names."
    )


def entry_layout(target: torch.Tensor, mesh: DeviceMesh) -> tuple[str, Runs | None]:
    """(all ranks) How ``target`` travels, and for BLOCK this rank's :func:`block_runs`: SHARDED when
    every rank's local piece is a row range we can compute, BLOCK when it is a cross product of index
    runs, else GENERIC (PLAIN for a plain tensor).

    Raises LoadError (see :func:`placements_on`) for a DTensor on a mesh rank 0 cannot reach through.
    """
    if not isinstance(target, DTensor):
        return PLAIN, None
    placements = placements_on(target, mesh)
    if target.ndim == 0:
        return GENERIC, None
    if _fast_placements(placements):
        coord = mesh.get_coordinate()
        if coord is not None:
            lo, hi = rows_of(mesh, placements, target.shape[0], coord)
            if tuple(local_tensor(target).shape) == (hi - lo, *target.shape[1:]):
                return SHARDED, None
    runs = block_runs(target)
    return (BLOCK, runs) if runs is not None else (GENERIC, None)


def entry_kind(target: torch.Tensor, mesh: DeviceMesh) -> str:
    """(all ranks) The kind alone of :func:`entry_layout`."""
    return entry_layout(target, mesh)[0]


def _one_dim(placement: object, dim: int) -> Placement | None:
    """``placement`` as it acts on tensor dimension ``dim`` alone, as a placement of a 1-D tensor."""
    if type(placement) is Replicate:
        return Replicate()
    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=placement.split_factor) if placement.dim == dim else Replicate()
    if type(placement) is Shard:
        return Shard(0) if placement.dim == dim else Replicate()
    return None  # Partial, or a placement this module does not know


def _runs(indices: list[int]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return tuple(out)


@functools.lru_cache(maxsize=1024)  # layers repeat: one split per distinct (mesh, size, placements)
def _dim_runs(
    mesh: DeviceMesh, coord: tuple[int, ...] | None, size: int, one: tuple[Placement, ...]
) -> tuple[tuple[int, int], ...]:
    """This rank's indices along one dimension of ``size`` under ``one`` (see :func:`block_runs`).
    ``coord``, this rank's place in ``mesh``, is part of the cache key only: a later process group
    may give this process another place in an equal mesh."""
    if all(type(p) is Replicate for p in one):
        return ((0, size),) if size else ()
    index = torch.arange(size)  # moved to the mesh device by distribute_tensor
    mine = distribute_tensor(index, mesh, one, src_data_rank=None)
    return _runs(local_tensor(mine).cpu().tolist())


def block_runs(target: DTensor) -> Runs | None:
    """(all ranks) The global indices this rank's local shard holds, per dimension, as runs; or None.

    DTensor's own split computes them: for each dimension, an ``arange`` over it is distributed with
    the placements that act on that dimension (``src_data_rank=None``: no communication) and the
    local piece read back. Sharding acts on each dimension separately, so the local shard is the
    cross product of these index lists (checked against its shape; None if it does not match, if a
    placement is neither ``Shard``, ``_StridedShard`` nor ``Replicate``, or if the shard is not
    contiguous).
    """
    local = local_tensor(target)
    if target.ndim == 0 or not local.is_contiguous():
        return None
    coord = target.device_mesh.get_coordinate()
    per_dim: list[tuple[tuple[int, int], ...]] = []
    for dim, size in enumerate(target.shape):
        one = [_one_dim(p, dim) for p in target.placements]
        if any(p is None for p in one):
            return None
        per_dim.append(_dim_runs(target.device_mesh, tuple(coord) if coord else None, size, tuple(one)))  # type: ignore[arg-type]
    runs = tuple(per_dim)
    if tuple(_count(r) for r in runs) != tuple(local.shape):
        return None
    return runs


def _count(runs: Sequence[tuple[int, int]]) -> int:
    return sum(stop - start for start, stop in runs)


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
    the cut blocks); 0 when a single row is wider than that (the entry then goes GENERIC)."""
    size = row_bytes(entry)
    return block_half(piece_bytes) // size if size else 0


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
    itemsize = entry.nbytes // math.prod(entry.shape)
    first = piece.local_offset  # a chunk's first row
    last = first + piece.nbytes // row_bytes(entry)
    for rank in sorted(runs_by_rank):
        runs = runs_by_rank[rank]
        inner = runs[1:]
        row_elems = math.prod(_count(r) for r in inner)
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


def rank_coordinates(mesh: DeviceMesh) -> dict[int, tuple[int, ...]]:
    """Global rank -> its coordinate in the mesh."""
    grid = mesh.mesh
    return {int(grid[idx]): tuple(int(i) for i in idx) for idx in _indices(tuple(grid.shape))}


def _indices(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (i, *rest)


def pieces(
    entries: Sequence[Entry],
    kinds: Sequence[str],
    placements: Sequence[Sequence[object] | None],
    mesh: DeviceMesh,
    piece_bytes: int,
    runs: Sequence[dict[int, Runs] | None] = (),
    me: int = 0,
) -> Iterator[Piece]:
    """(all ranks) The agreed sequence of messages, in manifest order.

    ``runs[i]``, for a BLOCK entry: rank -> :func:`block_runs` (every rank's on rank 0; on other
    ranks their own). Rank ``me`` = 0 gets a BLOCK entry as FAN_OUT chunks; another rank gets the
    pieces its own deliveries become (``dst`` = ``me``), so it receives them like row pieces.
    """
    piece_bytes = max(ALIGN, piece_bytes // ALIGN * ALIGN)
    coords: list[tuple[int, tuple[int, ...]]] | None = None  # SHARDED entries only
    for index, (entry, kind) in enumerate(zip(entries, kinds, strict=True)):
        if kind == BLOCK:
            block_layouts = runs[index]
            assert block_layouts is not None  # set for every BLOCK entry by the caller
            rows = block_chunk_rows(entry, piece_bytes)
            size = row_bytes(entry)
            for first in range(0, entry.shape[0], rows):
                n = min(rows, entry.shape[0] - first)
                chunk = Piece(index, FAN_OUT, entry.offset + first * size, n * size, first, kind)
                if me == 0:
                    yield chunk
                    continue
                for d in deliveries(chunk, entry, {me: block_layouts[me]}):
                    yield Piece(index, me, chunk.file_offset, d.nbytes, d.local_offset, kind)
            continue
        if kind == GENERIC:
            yield Piece(index, BROADCAST, entry.offset, entry.nbytes, 0, kind)
            continue
        if kind == PLAIN:
            for start in range(0, entry.nbytes, piece_bytes):
                n = min(piece_bytes, entry.nbytes - start)
                yield Piece(index, BROADCAST, entry.offset + start, n, start, kind)
            continue
        nrows = entry.shape[0]
        row = row_bytes(entry)
        per_rank = []
        if coords is None:
            coords = sorted(rank_coordinates(mesh).items())
        for rank, coord in coords:
            lo, hi = rows_of(mesh, placements[index], nrows, coord)  # type: ignore[arg-type]
            size = (hi - lo) * row
            per_rank.append(
                [
                    Piece(
                        index,
                        rank,
                        entry.offset + lo * row + start,
                        min(piece_bytes, size - start),
                        start,
                        kind,
                    )
                    for start in range(0, size, piece_bytes)
                ]
            )
        # Round-robin over the destinations: while rank 0 reads its own rows straight into its
        # shard, the piece it read for another rank is already on the wire. Each receiver still
        # sees its own pieces in order.
        for round_ in itertools.zip_longest(*per_rank):
            yield from (p for p in round_ if p is not None)
