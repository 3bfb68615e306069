"""``load_sharded``'s arguments checked before anything is built, and the staging it defaults to (all
ranks; no collectives: the agreement compares what each rank was given)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..common._staging import DEFAULT_STAGING_BYTES, MIN_STAGING_BYTES
from ..errors import LoadError
from ..model._layout import rank_coordinates

# max_staging_bytes' default on an accelerator mesh (DEFAULT_STAGING_BYTES on a CPU one): rank 0
# stages in pinned host memory and copies to the device, and more staging keeps its readers ahead
ACCELERATOR_STAGING_BYTES = 256 << 20


def check_options(dtype: object, max_staging_bytes: object, local_reads: object) -> None:
    """(all ranks) Arguments that would fail later, checked before anything is built; raises LoadError."""
    if not isinstance(local_reads, bool):
        raise LoadError(
            f"local_reads={local_reads!r} is not a bool (True: ranks on rank 0's host read their own bytes)"
        )
    if isinstance(max_staging_bytes, bool) or not isinstance(max_staging_bytes, int):
        raise LoadError(f"max_staging_bytes={max_staging_bytes!r} is not an int (bytes)")
    if max_staging_bytes < MIN_STAGING_BYTES:
        raise LoadError(
            f"max_staging_bytes={max_staging_bytes} is too small: use at least {MIN_STAGING_BYTES} bytes "
            f"(the default, {DEFAULT_STAGING_BYTES >> 20} MiB, keeps the stream fast)"
        )
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise LoadError(f"dtype={dtype} is not a floating torch.dtype; integer tensors are never cast")


def check_mesh(mesh: DeviceMesh, world_size: int) -> None:
    """(all ranks) The mesh must span every rank, with global rank 0 at its origin; raises LoadError."""
    ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    if ranks != list(range(world_size)):
        raise LoadError(
            f"the mesh spans ranks {ranks[:8]}{'...' if len(ranks) > 8 else ''} but the world has "
            f"{world_size} ranks: load_sharded needs a mesh over every rank"
        )
    coord = dict(rank_coordinates(mesh))[0]
    if any(coord):
        raise LoadError(f"global rank 0 sits at mesh coordinate {coord}; rank0load needs it at the origin")
