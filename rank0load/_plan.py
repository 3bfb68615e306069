"""How each manifest entry travels: which rank gets which bytes (all ranks; no collectives).

Every rank derives the same sequence of :class:`Piece` from the manifest and the mesh, so sender
and receivers agree on every message without exchanging anything. A piece is a contiguous byte
range of the checkpoint (wire dtype) and its place in the destination's local tensor.

* ``SHARDED`` entries (a DTensor whose placements are only ``Shard(0)`` and ``Replicate``): each
  rank's local tensor is a contiguous range of rows, so its bytes are one contiguous range of
  the file. Rank 0 sends each rank exactly its rows, point to point, in pieces of at most
  ``piece_bytes``; the rows it keeps itself are read straight into its local shard.
* ``PLAIN`` entries (buffers, unsharded parameters): read on rank 0 and broadcast, in pieces.
* ``GENERIC`` entries (any other placement, e.g. tensor parallel ``Shard(1)`` or the
  ``_StridedShard`` FSDP2 puts on top of a colwise TP shard): one piece; rank 0 reads the full
  tensor and broadcasts it, and every rank cuts its own shard locally (see ``_distribute._generic``).

A DTensor may live on a sub-mesh of the load mesh (``fully_shard(m, mesh=mesh["dp"])`` on a
("dp", "tp") mesh leaves embeddings and norms on the "dp" sub-mesh). :func:`placements_on` lifts its
placements to the load mesh, with ``Replicate`` on the dimensions the sub-mesh lacks: each tp group
member holds the same shard. Without lifting, a collective on the sub-mesh would only reach the
sub-mesh instance that contains rank 0, and the others would receive nothing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ._compat import local_tensor
from ._manifest import Entry
from .errors import LoadError

__all__ = [
    "BROADCAST",
    "GENERIC",
    "PLAIN",
    "SHARDED",
    "Piece",
    "entry_kind",
    "pieces",
    "placements_on",
    "rows_of",
]

SHARDED, PLAIN, GENERIC = "sharded", "plain", "generic"
BROADCAST = -1  # Piece.dst for a broadcast to every rank
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


def entry_kind(target: torch.Tensor, mesh: DeviceMesh) -> str:
    """(all ranks) SHARDED when every rank's local piece is a row range we can compute, else GENERIC.

    Raises LoadError (see :func:`placements_on`) for a DTensor on a mesh rank 0 cannot reach through.
    """
    if not isinstance(target, DTensor):
        return PLAIN
    placements = placements_on(target, mesh)
    if target.ndim == 0 or not _fast_placements(placements):
        return GENERIC
    coord = mesh.get_coordinate()
    if coord is None:
        return GENERIC
    lo, hi = rows_of(mesh, placements, target.shape[0], coord)
    expected = (hi - lo, *target.shape[1:])
    return SHARDED if tuple(local_tensor(target).shape) == expected else GENERIC


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
) -> Iterator[Piece]:
    """(all ranks) The agreed sequence of messages, in manifest order."""
    piece_bytes = max(ALIGN, piece_bytes // ALIGN * ALIGN)
    coords = sorted(rank_coordinates(mesh).items())
    for index, (entry, kind) in enumerate(zip(entries, kinds, strict=True)):
        if kind == GENERIC:
            yield Piece(index, BROADCAST, entry.offset, entry.nbytes, 0, kind)
            continue
        if kind == PLAIN:
            for start in range(0, entry.nbytes, piece_bytes):
                n = min(piece_bytes, entry.nbytes - start)
                yield Piece(index, BROADCAST, entry.offset + start, n, start, kind)
            continue
        nrows = entry.shape[0]
        row_bytes = entry.nbytes // nrows if nrows else 0
        per_rank = []
        for rank, coord in coords:
            lo, hi = rows_of(mesh, placements[index], nrows, coord)  # type: ignore[arg-type]
            size = (hi - lo) * row_bytes
            per_rank.append(
                [
                    Piece(
                        index,
                        rank,
                        entry.offset + lo * row_bytes + start,
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
