"""Moving the tensor data: rank 0 sends, the others receive, round by round (all ranks).

The staging (``_sink.allocate_staging``) is reserved before the last agreement, so that no
allocation inside the stream can leave a rank unable to take part; the local work on arriving bytes
is ``_sink.Sink``'s. (all ranks) :func:`stream` moves every :class:`~._plan.Piece` of the plan,
grouped into messages (``_messages``: consecutive pieces bound for the same place, one buffer each). The messages are fixed by
the plan: after a *local* failure (a read error or a changed file on rank 0, a cast or copy error
anywhere) a rank keeps sending and receiving the round's remaining messages, from and into scratch,
and does no more local work. At the end of every round the ranks compare notes (one 8-byte
all-reduce); if any rank failed, all stop there and raise that rank's error. The process group
stays usable. Only a collective that itself fails (a peer is gone) raises at once, as a peer
failure. The rounds, the sends and receives in flight and that settling are ``common._rounds``',
shared with the save (``save._write``).

When every rank reads its own bytes (``_localread``, one host, CPU shards) there are no messages:
:func:`_read_own` has each rank read its share in its own thread, and the notes are compared once.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
import torch.distributed as dist

from ..common import _distribute
from ..common._rounds import InFlight, Rounds, settled
from ..errors import LoadError
from ._messages import Message, messages
from ._plan import Plan, Route, block_half
from ._sink import Sink, Staging, Target, fan_out, landing
from ._stream import Reader, read_threads

if TYPE_CHECKING:
    from ._localread import LocalReader, LocalReads

__all__ = ["stream"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _ByRound(Generic[T]):
    """Splits an ordered stream of items by entry index into the plan's rounds."""

    def __init__(self, items: Iterator[T], index_of: Callable[[T], int]) -> None:
        self._items, self._index_of = items, index_of
        self._next: T | None = None
        self._done = False

    def until(self, stop: int) -> Iterator[T]:
        while True:
            if self._next is None and not self._done:
                self._next = next(self._items, None)
                self._done = self._next is None
            if self._next is None or self._index_of(self._next) >= stop:
                return
            item, self._next = self._next, None
            yield item


def stream(
    plan: Plan,
    targets: list[Target],
    staging: Staging,
    comm: torch.device,
    files: Mapping[str, Any] | None = None,
    on_bytes: Callable[[int], None] | None = None,
    local: LocalReads | None = None,
) -> None:
    """(all ranks) Move every piece of ``plan`` to its destination; rank 0 reads from ``files``
    (path -> ``_files.OpenFile``). ``local``: the ranks that read their own bytes through rank 0's
    descriptors (``_local``); rank 0 sends them nothing but the broadcasts, and not even those when
    every rank reads its own. Raises the same error on every rank if any rank failed."""
    sink = Sink(plan, targets, comm)
    with settled(
        sink.faults,
        "moving tensor data",
        "No model was returned; the process group is still usable: fix the cause and load again.",
        LoadError,
        "No model was returned; fix the cause and load again.",
    ) as outcome:
        own = local.reader(plan, staging, sink, files) if local is not None else None
        if own is not None and own.everything and comm.type == "cpu":  # the same on every rank
            outcome.first = _read_own(plan, sink, own, on_bytes)
        elif dist.get_rank() == 0:
            outcome.first = _send(plan, staging, files or {}, sink, on_bytes, local)
        else:
            outcome.first = _receive(plan, staging, sink, own)


def _read_own(plan: Plan, sink: Sink, reader: LocalReader, on_bytes: Callable[[int], None] | None) -> int:
    """(all ranks, when every rank but 0 reads its own bytes and the shards are on the CPU) No
    message at all: each rank, rank 0 too, reads its own pieces in order in its own thread, checks
    the files it read at each round's end and every file after its last read, and the ranks
    compare notes once, at the end. A failing rank stops reading; the others finish their own share
    (no one waits on it) before they learn of it. Returns the first failing rank (world: none)."""
    by_round = _ByRound(plan.pieces(dist.get_rank(), chunks=True), lambda p: p.index)
    for stop in plan.rounds:
        for piece in by_round.until(stop):
            reader.read(piece)
            if on_bytes is not None and piece.route is not Route.SCALES:
                on_bytes(piece.nbytes)
        reader.round_end()
    reader.finish()
    return _distribute.first_failure(sink.faults.error)


def _send(
    plan: Plan,
    staging: Staging,
    files: Mapping[str, Any],
    sink: Sink,
    on_bytes: Callable[[int], None] | None,
    local: LocalReads | None = None,
) -> int:
    """(rank 0) Read and send round by round, nothing to ``local.readers`` but the broadcasts (they
    read their own bytes; when they are all the other ranks, their broadcast pieces too); returns
    the first failing rank (world: none). On an accelerator mesh the copies out of the pinned slots
    are non-blocking, on the device's current stream (what reads the shards later is ordered after
    them): the sender never waits for one; the reader waits, before filling a slot again, for an
    event recorded after that slot's copies, and the last round ends with the stream synchronised."""
    on_cpu = sink.device.type == "cpu"
    readers = local.readers if local is not None else frozenset()
    alone = len(readers) == dist.get_world_size() - 1  # no one to send anything to

    def direct(message: Message) -> torch.Tensor | None:  # rank 0's own rows, read in place
        piece, target = message.first, sink.targets[message.index]
        if piece.route is Route.TO_RANK and piece.dst == 0 and target.tensor.device.type == "cpu":
            return landing(target, piece, sink.wires[piece.index])  # rank 0's own: one piece each
        return None

    pieces = local.rank0_pieces(plan, on_bytes) if local is not None else plan.pieces(0)
    reader = Reader(
        messages(plan, pieces),
        plan.entries,
        files,
        direct,
        staging.slots,
        read_threads(sink.device),
        staging.host,
    )
    pending = InFlight()  # sends, each handing its slot back to the reader once done
    fan_to = [r for r, _ in plan.coords if r not in readers]
    layouts = functools.lru_cache(maxsize=1)(lambda i: plan.block_layouts(i, fan_to))

    def sent(work: Any, slot: int | None) -> None:
        pending.add(work, functools.partial(reader.release, slot))

    def done_with(slot: int | None) -> None:
        """``slot``'s bytes are used: on the CPU, hand it back; on an accelerator its copies to the
        device are only queued, so the reader fills it again once an event recorded now has
        completed, while the sender goes on to queue the next ones. On an accelerator every
        message's slot (a ring token there: ``_stream._Ring``) is handed back here before the next
        message is asked for, as the ring needs: sends go from the device buffer, not the slot."""
        if on_cpu or slot is None:
            reader.release(slot)
            return
        copies = torch.Event(device=sink.device)
        copies.record()
        reader.release(slot, copies)

    try:
        by_round = _ByRound(iter(reader), lambda s: s.message.index)
        rounds = Rounds(plan.rounds, sink.faults)
        for _, stop in rounds:
            for staged in by_round.until(stop):
                message, data, slot = staged.message, staged.data, staged.slot
                piece, own = message.first, message.dst == 0
                held = slot  # the slot this message's bytes still need, handed back once they are sent
                if not on_cpu and (not own or sink.converts(message)):
                    # through the one device buffer, once earlier sends are done (rank 0's own
                    # pieces too when they are cast or dequantised: on the device, not the host).
                    # Everything after reads the device buffer on the same stream: the slot is
                    # free once this copy is.
                    pending.drain()
                    assert staging.device is not None
                    data = staging.device[: message.nbytes]
                    data.copy_(staged.data, non_blocking=True)
                    done_with(held)
                    held = None
                if piece.route is Route.FAN_OUT:
                    spare = staging.slots[slot] if on_cpu and slot is not None else staging.device
                    assert spare is not None
                    blocks = fan_out(
                        piece, data, spare[block_half(plan.piece_bytes) :], layouts(piece.index), sink
                    )
                    sent(blocks, held)
                elif own:
                    if slot is not None:  # read into a slot, not in place: pinned, on an accelerator
                        _scatter(sink, message, data, non_blocking=not on_cpu)
                    done_with(held)
                elif message.dst > 0:
                    sent(dist.isend(data, dst=message.dst), held)
                else:  # BROADCAST, SCALES
                    if not alone:
                        _distribute.broadcast(data, 0)
                    _scatter(sink, message, data)
                    done_with(held)
                pending.drain(keep=max(1, len(staging.slots) - 1))
                if on_bytes is not None:
                    on_bytes(sum(p.nbytes for p in message.pieces if p.route is not Route.SCALES))
            pending.drain()
            if stop == len(plan.entries):
                for _ in by_round.until(stop + 1):  # the reader's last checks come with its end
                    pass
                if not on_cpu:  # the queued copies done before the load is reported (or fails)
                    sink.faults.run(torch.accelerator.current_stream(sink.device).synchronize)
            if sink.faults.error is None and reader.failed is not None:
                sink.faults.note(reader.failed)
        return rounds.first
    finally:
        reader.close()


def _scatter(sink: Sink, message: Message, data: torch.Tensor, non_blocking: bool = False) -> None:
    """(all ranks) The local work of each piece of ``message``, whose bytes arrived in ``data``
    (``non_blocking``: rank 0's pinned slot, kept until an event after these copies completes)."""
    for piece, at in message.parts():
        sink.broadcast(piece, data[at : at + piece.nbytes], landed=False, non_blocking=non_blocking)


def _in_place(sink: Sink, message: Message) -> torch.Tensor | None:
    """(receivers) Where a message can land with no staging: one piece of rows, into its target's
    own bytes (same dtype, contiguous, on the mesh device), unless this rank has failed."""
    piece, target = message.first, sink.targets[message.index]
    if len(message.pieces) > 1 or piece.route is not Route.TO_RANK or sink.faults.error is not None:
        return None
    return landing(target, piece, sink.wires[piece.index]) if target.tensor.device == sink.device else None


def _receive(plan: Plan, staging: Staging, sink: Sink, local: LocalReader | None = None) -> int:
    """(ranks other than 0) Post up to ``slots`` receives ahead: a one-piece message straight into
    the local shard when the wire dtype is the target's, else into a staging slot, from which each
    piece is cast or dequantised into place; or, with ``local``, read this rank's own pieces instead
    (synchronously: it needs no slot of its own). Returns the first failing rank (world: none)."""
    me = dist.get_rank()
    free = collections.deque(range(len(staging.slots)))
    pending = InFlight()  # receives, each with its message and slot (None: straight into place)

    def landed(message: Message, slot: int | None) -> None:
        if slot is not None:
            _scatter(sink, message, staging.slots[slot])
            free.append(slot)

    def stage(message: Message) -> tuple[torch.Tensor, int]:
        while not free:
            pending.complete_oldest()
        slot = free.popleft()
        return staging.slots[slot][: message.nbytes], slot

    by_round = _ByRound(messages(plan, plan.pieces(me, chunks=local is not None)), lambda m: m.index)

    rounds = Rounds(plan.rounds, sink.faults)
    for _, stop in rounds:
        for message in by_round.until(stop):
            piece, single = message.first, len(message.pieces) == 1
            if local is not None and (local.everything or message.dst == me or piece.route is Route.FAN_OUT):
                for p in message.pieces:
                    local.read(p)
                continue
            if message.dst < 0:  # BROADCAST, SCALES
                pending.drain()
                into, slot = sink.landing(piece) if single else None, None
                if into is None:
                    into, slot = stage(message)
                _distribute.broadcast(into, 0)
                if slot is None:
                    sink.broadcast(piece, into, landed=True)
                else:
                    _scatter(sink, message, into)
                    free.append(slot)
                continue
            view = _in_place(sink, message)
            if view is not None:
                pending.add(dist.irecv(view, src=0), functools.partial(landed, message, None))
            else:
                into, slot = stage(message)
                pending.add(dist.irecv(into, src=0), functools.partial(landed, message, slot))
            pending.drain(keep=len(staging.slots))
        pending.drain()
        if local is not None:
            local.round_end()
    return rounds.first
