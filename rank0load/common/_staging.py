"""The staging the load's stream and the save's gathers share: its geometry (slots, alignment, a
round's size) and the queues of a round's non-blocking work. Local to each rank, no collectives."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import torch

DEFAULT_STAGING_BYTES = 16 << 20  # max_staging_bytes on a CPU mesh
"""``max_staging_bytes``' default on a CPU mesh (16 MiB): the host RAM each rank may use for staging."""
SLOTS = 4  # staging slots of max_staging_bytes / SLOTS each, on every rank
ALIGN = 64  # piece sizes and boundaries stay multiples of every element size
ROUND_PIECES = 64  # a round (one failure check) carries at least this many pieces' worth of bytes
MIN_STAGING_BYTES = 2 * ALIGN * SLOTS  # two aligned halves per staging slot


def slot_bytes(max_staging_bytes: int) -> int:
    """One staging slot's bytes, the largest message of the load and of the save: a ``SLOTS``-th of
    ``max_staging_bytes``, an ALIGN multiple."""
    return max(ALIGN, max_staging_bytes // SLOTS // ALIGN * ALIGN)


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`: where the next piece of a message starts."""
    return -(-nbytes // ALIGN) * ALIGN


def block_half(piece_bytes: int) -> int:
    """Bytes of a staging slot a chunk of whole rows may fill (an ALIGN multiple); its blocks go after."""
    return piece_bytes // 2 // ALIGN * ALIGN


class AllOf:
    """(each rank) Several operations waited for together, their sent tensors kept alive until then."""

    def __init__(self, works: Iterable[Any], keep: Iterable[torch.Tensor] = ()) -> None:
        self._works, self._keep = list(works), list(keep)

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._keep.clear()


class InFlight:
    """(each rank) Non-blocking operations in the order they were issued, each with what to do once it is done
    (hand a staging slot back, cast the bytes that arrived into place)."""

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[Any, Callable[[], None] | None]] = collections.deque()

    def add(self, work: Any, then: Callable[[], None] | None) -> None:
        """``work``: anything with ``wait()`` (a torch.distributed Work, :class:`AllOf`)."""
        self._queue.append((work, then))

    def drain(self, keep: int = 0) -> None:
        """Complete the oldest, each followed by its ``then``, until at most ``keep`` are left."""
        while len(self._queue) > keep:
            work, then = self._queue.popleft()
            work.wait()
            if then is not None:
                then()

    def complete_oldest(self) -> None:
        self.drain(keep=len(self._queue) - 1)

    def __len__(self) -> int:
        return len(self._queue)
