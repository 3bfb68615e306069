"""What each rank holds of each tensor (all ranks; no collectives): :func:`layout_flags` says which
fast paths a rank's shard allows, :func:`placements_on` lifts a sub-mesh DTensor's placements to the
load mesh.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from ..common._blocks import Runs
from ..errors import RankMismatchError
from ..integrations._compat import local_tensor, one_dim_placement, split_chunks

# Bits of layout_flags, AND-ed over the ranks at agreement.
ROWS_OK = 1  # this rank's shard is the row range rows_of() computes
RUNS_OK = 2  # this rank's shard is the block runs_at() computes (so rank 0 can compute it itself)


def rows_of(
    mesh_shape: Sequence[int], placements: Sequence[object], nrows: int, coord: Sequence[int]
) -> tuple[int, int]:
    """The row range [lo, hi) that the rank at mesh coordinate ``coord`` holds."""
    lo, hi = 0, nrows
    for dim, placement in enumerate(placements):
        if isinstance(placement, Shard):  # torch.chunk's split, as DTensor's and FSDP2's: ceil-sized chunks
            size = math.ceil((hi - lo) / mesh_shape[dim])
            lo = min(lo + coord[dim] * size, hi)
            hi = min(lo + size, hi)
    return lo, hi


def placements_on(target: DTensor, mesh: DeviceMesh) -> tuple[Placement, ...]:
    """(all ranks) ``target``'s placements on the load ``mesh``: ``Replicate`` on the dimensions a
    sub-mesh sliced from named dimensions (``mesh["dp"]``) lacks; any other mesh: RankMismatchError."""
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
    raise RankMismatchError(
        f"a parameter lives on device mesh {sub} (dims {sub_names}), which is neither the load mesh "
        f"{mesh} (dims {names}) nor a slice of its named dimensions (mesh['dp']). Pass load_sharded "
        "the root mesh your shard_fn slices, with mesh_dim_names (load_training_state: mesh=, the same)."
    )


def layout_flags_of(targets: dict[str, torch.Tensor], mesh: DeviceMesh) -> dict[str, int]:
    """(all ranks) :func:`layout_flags` of every target, computed once per distinct layout."""
    known: dict[tuple, int] = {}
    out = {}
    for key, target in targets.items():
        if not isinstance(target, DTensor):
            out[key] = 0
            continue
        local = local_tensor(target)
        kind = (
            target.device_mesh,
            tuple(target.placements),
            tuple(target.shape),
            tuple(local.shape),
            local.is_contiguous(),
        )
        flags = known.get(kind)
        if flags is None:
            flags = known[kind] = layout_flags(target, mesh)
        out[key] = flags
    return out


def layout_flags(target: DTensor, mesh: DeviceMesh) -> int:
    """(all ranks) Which fast paths this rank's shard of ``target`` allows (``ROWS_OK | RUNS_OK``),
    0 for none. Raises RankMismatchError as :func:`placements_on`."""
    if target.ndim == 0:
        return 0
    placements = placements_on(target, mesh)
    coord = mesh.get_coordinate()
    local = local_tensor(target)
    if coord is None:
        return 0
    flags = 0
    if all(type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in placements):
        lo, hi = rows_of(mesh.shape, placements, target.shape[0], coord)
        if tuple(local.shape) == (hi - lo, *target.shape[1:]):
            flags |= ROWS_OK
    mine = block_runs(target)
    simulated = runs_at(placements, tuple(mesh.shape), tuple(coord), tuple(target.shape))
    if mine is not None and mine == simulated:
        flags |= RUNS_OK
    return flags


def _runs(indices: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """Maximal runs of consecutive values in a 1-D integer tensor, as (start, stop) pairs."""
    if indices.numel() == 0:
        return ()
    indices = indices.to(torch.int64)
    breaks = torch.nonzero(indices[1:] != indices[:-1] + 1).flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    stops = torch.cat([breaks, torch.tensor([indices.numel()], dtype=torch.int64)])
    return tuple(zip(indices[starts].tolist(), (indices[stops - 1] + 1).tolist(), strict=True))


@functools.lru_cache(maxsize=1024)  # layers repeat: one split per distinct (mesh, size, placements)
def _dim_runs(
    mesh: DeviceMesh, coord: tuple[int, ...] | None, size: int, one: tuple[Placement, ...]
) -> tuple[tuple[int, int], ...]:
    """This rank's indices along one dimension of ``size`` under ``one``, by ``distribute_tensor``
    itself. ``coord`` is only a cache key (a later process group may move this rank in an equal mesh)."""
    if all(type(p) is Replicate for p in one):
        return ((0, size),) if size else ()
    index = torch.arange(size)  # moved to the mesh device by distribute_tensor
    mine = distribute_tensor(index, mesh, one, src_data_rank=None)
    return _runs(local_tensor(mine).cpu())


def block_runs(target: DTensor) -> Runs | None:
    """(all ranks) The global indices this rank's local shard holds, per dimension, as runs (the shard
    is their cross product); None for an unknown placement, a non-contiguous shard or a mismatch."""
    local = local_tensor(target)
    if target.ndim == 0 or not local.is_contiguous():
        return None
    coord = target.device_mesh.get_coordinate()
    per_dim: list[tuple[tuple[int, int], ...]] = []
    for dim, size in enumerate(target.shape):
        one = [one_dim_placement(p, dim) for p in target.placements]
        if any(p is None for p in one):
            return None
        per_dim.append(_dim_runs(target.device_mesh, tuple(coord) if coord else None, size, tuple(one)))  # type: ignore[arg-type]
    if tuple(sum(stop - start for start, stop in runs) for runs in per_dim) != tuple(local.shape):
        return None
    return tuple(per_dim)


@functools.lru_cache(maxsize=65536)
def _dim_runs_at(
    mesh_shape: tuple[int, ...], coord: tuple[int, ...], size: int, one: tuple[Placement, ...]
) -> tuple[tuple[int, int], ...]:
    index = torch.arange(size)
    for mesh_dim, placement in enumerate(one):
        if type(placement) is not Replicate:  # distribute_tensor's order: mesh dimension by dimension
            index = split_chunks(placement, index, mesh_shape[mesh_dim])[coord[mesh_dim]]
    return _runs(index)


def runs_at(
    placements: Sequence[Placement],
    mesh_shape: tuple[int, ...],
    coord: tuple[int, ...],
    shape: tuple[int, ...],
) -> Runs | None:
    """The block runs of the rank at ``coord`` of a mesh of ``mesh_shape``, computed as
    ``distribute_tensor`` splits; None for a placement that is not Shard/_StridedShard/Replicate."""
    per_dim = []
    for dim, size in enumerate(shape):
        one = tuple(one_dim_placement(p, dim) for p in placements)
        if any(p is None for p in one):
            return None
        per_dim.append(_dim_runs_at(mesh_shape, coord, size, one))  # type: ignore[arg-type]
    return tuple(per_dim)


def rank_coordinates(mesh: DeviceMesh) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(global rank, its coordinate in the mesh), sorted by rank."""
    grid = mesh.mesh
    coords = itertools.product(*(range(n) for n in grid.shape))
    return tuple(sorted((int(grid[idx]), tuple(idx)) for idx in coords))


def held_indices(runs: Runs) -> list[torch.Tensor]:
    """Per dimension, the global indices a block holds, in order (int64)."""
    return [
        torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in dim_runs])
        if dim_runs
        else torch.empty(0, dtype=torch.int64)
        for dim_runs in runs
    ]


def global_indices(
    held: Sequence[torch.Tensor], shape: Sequence[int], first: int, count: int
) -> torch.Tensor:
    """Flat indices in a tensor of ``shape`` of the elements ``[first, first + count)`` of the local
    block whose indices per dimension are ``held`` (:func:`held_indices`; row-major in the block)."""
    local = torch.arange(first, first + count, dtype=torch.int64)
    flat = torch.zeros(count, dtype=torch.int64)
    stride = 1
    for dim in reversed(range(len(shape))):
        size = max(1, held[dim].numel())
        local, at = local // size, local % size
        flat += held[dim][at] * stride
        stride *= shape[dim]
    return flat
