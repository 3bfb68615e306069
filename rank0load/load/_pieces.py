"""The plan's vocabulary: how an entry travels, where a piece goes, and the piece itself (all ranks;
pure data, no collectives)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..common._blocks import Chunk, Part

__all__ = ["Kind", "Piece", "Route"]


class Kind(enum.Enum):
    """How an entry travels (``_plan``'s module docstring says each)."""

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
