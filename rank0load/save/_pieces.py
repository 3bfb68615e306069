"""The messages of a save: which rank sends which bytes of which item (all ranks; no collectives).
Every rank derives them identically, in one order, from the shared plan alone."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..checkpoint._format import DTYPES
from ..common._blocks import Chunk, Part, block_chunks
from ..common._staging import block_half
from ._saveplan import SaveKind, SavePlan

__all__ = ["Piece", "chunks", "pieces"]


@dataclass(frozen=True)
class Piece:
    """One message: bytes [start, start + nbytes) of an item, sent by rank ``src``; for a BLOCK
    item, the sender's block of the chunk that starts at ``start`` (see :func:`chunks`)."""

    src: int  # 0: rank 0 writes it from its own tensor
    start: int  # byte offset within the item
    nbytes: int
    local_offset: int  # byte offset (wire dtype) in the sender's flat local tensor; contiguous there


def pieces(plan: SavePlan, index: int, src: int | None = None) -> Iterator[Piece]:
    """(all ranks) Item ``index``'s messages, in the order every rank uses (``src``: that rank's only)."""
    item = plan.items[index]
    if item.kind is SaveKind.BLOCK:
        for chunk, parts in chunks(plan, index, src):
            yield from (Piece(p.rank, chunk.start, p.nbytes, p.local_offset) for p in parts)
        return
    if item.kind is SaveKind.ROWS:
        row = item.nbytes // item.shape[0] if item.shape[0] else 0
        ranges = [(r, lo * row, hi * row) for r, lo, hi in item.senders]
    else:
        ranges = [(0, 0, item.nbytes)]
    for rank, begin, end in ranges:
        if src is None or rank == src:
            for at in range(begin, end, plan.piece_bytes):
                yield Piece(rank, at, min(plan.piece_bytes, end - at), at - begin)


def chunks(plan: SavePlan, index: int, src: int | None = None) -> Iterator[tuple[Chunk, tuple[Part, ...]]]:
    """(all ranks) BLOCK item ``index``'s chunks and the senders' parts of each, by first row, then
    sender (``src``: only that rank's, in the same order), see ``common._blocks.block_chunks``."""
    item = plan.items[index]
    blocks = item.blocks if src is None else [b for b in item.blocks if b[0] == src]
    return block_chunks(item.shape, DTYPES[item.dtype].itemsize, blocks, block_half(plan.piece_bytes))
