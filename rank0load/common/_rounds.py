"""The rounds of a transfer and the settling of failures, once for the load and the save (all ranks).

A transfer (the load's stream, ``load._transfer``; the save's gathers and writes, ``save._write``)
moves its items round by round. Within a round each rank keeps its non-blocking sends and receives
in an :class:`InFlight` queue, each completed in the order it was issued, with what to do once its
bytes are there. After a *local* failure (``_distribute.Faults``) a rank does no more local work but
keeps the round's messages flowing. At the end of every round the ranks compare notes
(:func:`rounds`: one 8-byte all-reduce), and all stop there if any rank failed; :func:`settled`
then raises that rank's error on every rank, worded once, or a peer failure when a collective
itself failed (a rank died or stalled). The process group stays usable after a local failure.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import LoadError
from . import _distribute

__all__ = ["AllOf", "InFlight", "rounds", "settled"]


class AllOf:
    """Several operations waited for together (and the tensors they send, kept alive until then)."""

    def __init__(self, works: Iterable[Any], keep: Iterable[torch.Tensor] = ()) -> None:
        self._works, self._keep = list(works), list(keep)

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._keep.clear()


class InFlight:
    """Non-blocking operations in the order they were issued, each with what to do once it is done
    (hand a staging slot back, cast the bytes that arrived into place)."""

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[Any, Callable[[], None] | None]] = collections.deque()

    def add(self, work: Any, then: Callable[[], None] | None = None) -> None:
        """``work``: anything with ``wait()`` (a torch.distributed Work, :class:`AllOf`)."""
        self._queue.append((work, then))

    def complete_oldest(self) -> None:
        work, then = self._queue.popleft()
        work.wait()
        if then is not None:
            then()

    def drain(self, keep: int = 0) -> None:
        """Complete the oldest until at most ``keep`` are left."""
        while len(self._queue) > keep:
            self.complete_oldest()

    def __len__(self) -> int:
        return len(self._queue)


def rounds(ends: Sequence[int], faults: _distribute.Faults, one_round: Callable[[int, int], None]) -> int:
    """(all ranks) ``one_round(begin, stop)`` for each round (items ``begin`` to ``stop``, the ends
    in ``ends``), each followed by the ranks comparing notes. Returns the first failing rank, at the
    end of the round in which it failed, or the world size when none did."""
    begin = 0
    for stop in ends:
        one_round(begin, stop)
        first = _distribute.first_failure(faults.error)
        if first < dist.get_world_size():
            return first
        begin = stop
    return dist.get_world_size()


def settled(
    move: Callable[[], int],
    faults: _distribute.Faults,
    stage: str,
    todo: str,
    wrap: type[LoadError],
    peer_todo: str,
) -> None:
    """(all ranks) Run the transfer ``move`` (it returns the first failing rank, or the world size);
    raise that rank's error on every rank (``_distribute.raise_failure``, ``todo`` its advice), or,
    when a collective itself fails, this rank's peer failure (``peer_todo``)."""
    try:
        first = move()
        if first < dist.get_world_size():
            _distribute.raise_failure(first, faults.error, stage, todo, wrap=wrap)
    except LoadError:
        raise
    except RuntimeError as exc:  # a collective failed: a rank died or stalled, or the network broke
        raise _distribute.peer_failure(stage, exc, wrap, peer_todo) from exc
