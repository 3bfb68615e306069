"""The rounds of a transfer and the settling of failures, once for the load and the save (all ranks).

A transfer (the load's stream, ``load._transfer``; the save's gathers and writes, ``save._write``)
moves its items round by round. Within a round each rank keeps its non-blocking sends and receives
in an :class:`InFlight` queue. After a *local* failure (``_distribute.Faults``) a rank does no more
local work but keeps the round's messages flowing, so every posted message is matched and the
process group stays usable. At the end of every round the ranks compare notes (:class:`Rounds`),
and all stop there if any rank failed; :func:`settled` then raises the same error on every rank.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import LoadError
from . import _distribute, _failure

__all__ = [
    "ALIGN",
    "DEFAULT_STAGING_BYTES",
    "MIN_STAGING_BYTES",
    "ROUND_PIECES",
    "SLOTS",
    "AllOf",
    "InFlight",
    "Outcome",
    "Rounds",
    "aligned",
    "block_half",
    "slot_bytes",
    "settled",
]

# The staging geometry the load and the save share.
DEFAULT_STAGING_BYTES = 16 << 20  # max_staging_bytes on a CPU mesh
SLOTS = 4  # staging slots of max_staging_bytes / SLOTS each, on every rank
ALIGN = 64  # piece sizes and boundaries stay multiples of every element size
ROUND_PIECES = 64  # a round (one failure check) carries at least this many pieces' worth of bytes
MIN_STAGING_BYTES = 2 * ALIGN * SLOTS  # two aligned halves per staging slot


def slot_bytes(max_staging_bytes: int) -> int:
    """One staging slot's bytes: a ``SLOTS``-th of ``max_staging_bytes``, a multiple of ``ALIGN``."""
    return max(ALIGN, max_staging_bytes // SLOTS // ALIGN * ALIGN)


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`: where the next piece of a message starts."""
    return -(-nbytes // ALIGN) * ALIGN


def block_half(piece_bytes: int) -> int:
    """Bytes of a staging slot a chunk of whole rows may fill (a multiple of :data:`ALIGN`); the blocks
    cut from it, or the parts received for it, go after them."""
    return (piece_bytes // ALIGN * ALIGN) // 2 // ALIGN * ALIGN


class AllOf:
    """(each rank) Several operations waited for together (and the tensors they send, kept alive
    until then)."""

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

    def add(self, work: Any, then: Callable[[], None] | None = None) -> None:
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


class Rounds:
    """(all ranks) ``for begin, stop in Rounds(ends, faults):`` the items of each round (``begin`` to
    ``stop``, the ends in ``ends``); after each round's body the ranks compare notes, and the loop
    ends after the round in which any rank failed (every rank must run every round's check: it is a
    collective). :attr:`first`: the first failing rank, or the world size when none did."""

    def __init__(self, ends: Sequence[int], faults: _distribute.Faults) -> None:
        self._ends, self._faults = ends, faults
        self.first = dist.get_world_size()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        begin = 0
        for stop in self._ends:
            yield begin, stop
            self.first = _distribute.first_failure(self._faults.error)
            if self.first < dist.get_world_size():
                return
            begin = stop


@dataclass
class Outcome:
    first: int  # the first failing rank of a transfer, or the world size


@contextlib.contextmanager
def settled(
    faults: _distribute.Faults, stage: str, todo: str, wrap: type[LoadError], peer_todo: str
) -> Iterator[Outcome]:
    """(all ranks) ``with settled(...) as outcome:`` run a transfer that sets ``outcome.first``; then
    raise that rank's error on every rank (``_distribute.raise_failure``, ``todo`` its advice), or,
    when a collective itself fails, this rank's peer failure (``peer_todo``)."""
    outcome = Outcome(dist.get_world_size())
    try:
        yield outcome
        if outcome.first < dist.get_world_size():
            _distribute.raise_failure(outcome.first, faults.error, stage, todo, wrap=wrap)
    except LoadError:
        raise
    except RuntimeError as exc:  # a collective failed: a rank died or stalled, or the network broke
        raise _failure.peer_failure(stage, exc, wrap, peer_todo) from exc
