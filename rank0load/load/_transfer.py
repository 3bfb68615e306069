"""Moving the tensor data (all ranks): :func:`stream` hands each round's messages from this rank's
source into its sink: :class:`FileSource` on rank 0, :class:`ReceiveSource` on the others,
:class:`OwnSource` on every rank when each reads its own bytes into CPU shards.

The messages are fixed by the plan: after a *local* failure (a read, cast or copy error, a changed
file; a source's failures are the sink's) a rank keeps sending and receiving the round's remaining
messages, from and into scratch, and does no more local work. At every round's end the ranks
compare notes; if any failed, all raise its error there and the process group stays usable. Only a
failing collective (a peer gone) raises at once.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
import torch.distributed as dist

from ..common._distribute import settled
from ..common._staging import InFlight, block_half
from ..errors import LoadError
from ._localread import LocalReader
from ._plan import Message, Piece, Route, messages
from ._readahead import Reader, read_threads
from ._sink import Arrival, Sink, Staging, fan_out

if TYPE_CHECKING:
    from ._handover import LocalReads

T = TypeVar("T")
_CPU = torch.device("cpu")


def stream(
    sink: Sink,
    staging: Staging,
    files: Mapping[str, Any],
    on_bytes: Callable[[int], None],
    local: LocalReads,
) -> None:
    """(all ranks) Move every piece of ``sink.plan`` into ``sink``; rank 0 reads from ``files``. ``local``:
    the ranks that read their own bytes (rank 0 sends them only the broadcasts, none when all do).
    Raises the same error on every rank if any rank failed."""
    plan = sink.plan
    own = local.everyone and sink.device.type == "cpu"  # each rank reads its own bytes into CPU shards
    with settled(
        sink.faults,
        plan.rounds[-1:] if own else plan.rounds,  # no message between the ranks: one check, at the end
        "moving tensor data",
        "No model was returned; the process group is still usable: fix the cause and load again.",
        LoadError,
        "No model was returned; fix the cause and load again.",
    ) as rounds:
        source: FileSource | ReceiveSource | OwnSource
        if own:
            own_files = local.files if dist.get_rank() else files
            assert own_files is not None  # every rank but 0 holds rank 0's descriptors
            source = OwnSource(sink, LocalReader(staging, sink, own_files, local.host), on_bytes)
        elif dist.get_rank() == 0:  # it sends to the others
            source = FileSource(staging, files, sink, local, on_bytes)
        else:
            source = ReceiveSource(staging, sink, local)
        try:
            for _, stop in rounds:
                for arrival in source.until(stop):
                    source.take(arrival)
                source.round_end(stop)
        finally:
            if isinstance(source, FileSource):  # rank 0's reader thread
                source.reader.close()


class ByRound(Generic[T]):
    """Splits an ordered stream of items by entry index into the plan's rounds."""

    def __init__(self, items: Iterator[T], index_of: Callable[[T], int]) -> None:
        self._items, self._index_of = items, index_of
        self._next: T | None = None  # the next item, once looked at

    def until(self, stop: int) -> Iterator[T]:
        while True:
            if self._next is None:  # an exhausted iterator keeps answering None
                self._next = next(self._items, None)
            if self._next is None or self._index_of(self._next) >= stop:
                return
            item, self._next = self._next, None
            yield item


def own_together(device: torch.device) -> bool:
    """Whether rank 0 groups its own consecutive pieces into messages: on an accelerator (staged anyway)."""
    return device.type != "cpu"


class FileSource:
    """(rank 0) Its pieces (not ``local``'s readers') read by its reader thread, one arrival per message,
    in order (``until``: a round's; on an accelerator mesh each must be sent before the next is asked
    for, the ring); :meth:`take` hands each on to the ranks it serves (not the local readers, nor
    broadcasts when they are all the other ranks), then into its own sink. On an accelerator mesh the
    copies out of the pinned staging are non-blocking on the current stream (later reads of the shards
    are ordered after them); the reader waits for them (:meth:`_done_with`); the last round
    synchronises the stream."""

    def __init__(
        self,
        staging: Staging,
        files: Mapping[str, Any],
        sink: Sink,
        local: LocalReads,
        on_bytes: Callable[[int], None],
    ) -> None:
        self.plan, self.staging, self.sink, self.on_bytes = sink.plan, staging, sink, on_bytes
        self.on_cpu = sink.device.type == "cpu"
        self.sends_nothing = local.everyone
        self.local = local  # its network_bytes counted here: what goes to ranks off this host
        self.pending = InFlight()  # sends, each handing its slot back to the reader once done
        self.reader = Reader(
            messages(sink.plan, self._pieces(local.readers), own_together=own_together(sink.device)),
            sink.plan.entries,
            files,
            self._direct,
            staging,
            read_threads(sink.device),
        )
        self.until = ByRound(iter(self.reader), lambda a: a.message.index).until

    def _pieces(self, readers: frozenset[int]) -> Iterator[Piece]:
        """Its pieces less those the ``readers`` read themselves (BLOCK chunks cut for the other ranks
        only); the skipped bytes counted on ``on_bytes`` as they are passed over."""
        for piece in self.plan.pieces(0, cut_for=[r for r, _ in self.plan.coords if r not in readers]):
            if piece.dst in readers:  # its rows, and the scale grid rows they need
                if piece.route is Route.TO_RANK:
                    self.on_bytes(piece.nbytes)
                continue
            yield piece

    def _direct(self, message: Message) -> torch.Tensor | None:
        """Where rank 0's own rows are read in place: its shard, when on the CPU."""
        piece = message.first
        if len(message.pieces) > 1 or piece.route is not Route.TO_RANK or piece.dst != 0:
            return None
        return self.sink.direct_view(piece, on=_CPU)

    def take(self, arrival: Arrival) -> None:
        message, data, slot_to_free = arrival.message, arrival.data, arrival.slot
        piece, own = message.first, message.dst == 0
        if not self.on_cpu and (not own or self.sink.converts(message)):
            data, slot_to_free = self._on_device(arrival), None
        if piece.route is Route.FAN_OUT:  # cut into the parts: its own written, the others sent
            pack_buffer = (
                self.staging.device_buffer if slot_to_free is None else self.staging.slots[slot_to_free]
            )
            assert pack_buffer is not None  # in the buffer ``data`` is in, after the chunk
            half = block_half(self.plan.piece_bytes)
            self._sent(fan_out(piece, data, pack_buffer[half:], self.sink), slot_to_free)
            self.local.network_bytes += sum(p.nbytes for p in piece.parts if p.rank in self.local.off_host)
        elif own:
            if not arrival.in_target:
                self.sink.take(message, data, non_blocking=not self.on_cpu)
            self._done_with(slot_to_free)
        elif message.dst > 0:
            self._sent(dist.isend(data, dst=message.dst), slot_to_free)
            if message.dst in self.local.off_host:
                self.local.network_bytes += message.nbytes
        else:  # BROADCAST, SCALES
            if not self.sends_nothing:
                dist.broadcast(data, src=0)
                if self.local.off_host:
                    self.local.network_bytes += message.nbytes
            self.sink.take(message, data)
            self._done_with(slot_to_free)
        self.pending.drain(keep=max(1, len(self.staging.slots) - 1))
        self.on_bytes(sum(p.nbytes for p in message.pieces if p.route is not Route.SCALES))

    def _on_device(self, arrival: Arrival) -> torch.Tensor:
        """The message's bytes copied into the one device buffer once earlier sends from it are done
        (rank 0's own pieces too when cast or dequantised: on the device, not the host). Later work
        reads the buffer on the same stream: the slot is free once this copy is."""
        self.pending.drain()
        assert self.staging.device_buffer is not None
        data = self.staging.device_buffer[: arrival.message.nbytes]
        data.copy_(arrival.data, non_blocking=True)
        self._done_with(arrival.slot)
        return data

    def _sent(self, work: Any, slot: int | None) -> None:
        self.pending.add(work, functools.partial(self.reader.release, slot))

    def _done_with(self, slot: int | None) -> None:
        """``slot``'s bytes are used: handed back (on an accelerator, whose copies are only queued,
        with an event recorded now). On an accelerator every message's slot comes back here before the
        next message is asked for, as the ring needs: sends go from the device buffer, not the slot."""
        if self.on_cpu or slot is None:
            self.reader.release(slot)
            return
        copies = torch.Event(device=self.sink.device)
        copies.record()
        self.reader.release(slot, copies)

    def round_end(self, stop: int) -> None:
        """Wait for the round's sends; after the last round, for the queued copies and the reader's last
        file checks too. The reader's first failure noted as this rank's."""
        self.pending.drain()
        if stop == len(self.plan.entries):
            if not self.on_cpu:
                self.sink.faults.run(torch.accelerator.current_stream(self.sink.device).synchronize)
            for _ in self.until(stop + 1):  # the reader's last checks come with its end
                pass
        if self.sink.faults.error is None and self.reader.failed is not None:
            self.sink.faults.note(self.reader.failed)


class ReceiveSource:
    """(ranks other than 0) Receives posted up to ``slots`` ahead, into the shard where they can, else
    a staging slot; broadcasts in order, once the receives before them are done; where ``local`` gave
    this rank rank 0's descriptors, its own pieces read through them instead."""

    def __init__(self, staging: Staging, sink: Sink, local: LocalReads) -> None:
        self.sink, self.slots = sink, staging.slots
        self.local = None if local.files is None else LocalReader(staging, sink, local.files, local.host)
        self.everything = local.everyone  # a local reader reads the broadcast pieces too
        self.me = dist.get_rank()
        self._free = collections.deque(range(len(staging.slots)))
        self._pending = InFlight()  # receives, each adding its arrival to _done once complete
        self._done: collections.deque[Arrival] = collections.deque()
        cut_for = (self.me,) if self.local is not None else None  # a local reader cuts its own parts
        self._by_round = ByRound(messages(sink.plan, sink.plan.pieces(self.me, cut_for)), lambda m: m.index)

    def until(self, stop: int) -> Iterator[Arrival]:
        """The arrivals of the round that ends before entry ``stop``, in the order of its messages;
        each one taken before the next is asked for."""
        local = self.local
        for message in self._by_round.until(stop):
            piece = message.first
            if local is not None and (
                self.everything or message.dst == self.me or piece.route is Route.FAN_OUT
            ):
                for p in message.pieces:
                    yield from local.arrivals(p)
            elif message.dst < 0:  # BROADCAST, SCALES: once the receives before are done
                yield from self._completed(keep=0)
                arrival = yield from self._landing(message, direct=len(message.pieces) == 1)
                dist.broadcast(arrival.data, src=0)
                yield arrival
            else:  # a point-to-point receive, posted
                one = len(message.pieces) == 1 and piece.route is Route.TO_RANK
                arrival = yield from self._landing(message, direct=one)
                self._pending.add(
                    dist.irecv(arrival.data, src=0), functools.partial(self._done.append, arrival)
                )
                yield from self._completed(keep=len(self.slots))
        yield from self._completed(keep=0)

    def _landing(self, message: Message, direct: bool) -> Generator[Arrival, None, Arrival]:
        """Where ``message`` arrives: its target (when ``direct`` and the sink has a view), else a free
        slot, the oldest receives handed on (yielded) until one is free."""
        view = self.sink.direct_view(message.first) if direct else None
        if view is not None:
            return Arrival(message, view, in_target=True)
        while not self._free:
            if not self._done:
                self._pending.complete_oldest()
            yield self._done.popleft()
        slot = self._free.popleft()
        return Arrival(message, self.slots[slot][: message.nbytes], slot)

    def _completed(self, keep: int) -> Iterator[Arrival]:
        """Complete the oldest receives until at most ``keep`` are in flight; their arrivals."""
        self._pending.drain(keep)
        while self._done:
            yield self._done.popleft()

    def take(self, arrival: Arrival) -> None:
        _into_sink(self.sink, arrival)
        if arrival.slot is not None:
            self._free.append(arrival.slot)

    def round_end(self, stop: int) -> None:
        """The identity checks of the files this rank read itself in the round; after the last, of
        every file it holds."""
        if self.local is not None:
            self.local.round_end()
            if stop == len(self.sink.plan.entries):
                self.local.finish()


class OwnSource:
    """(every rank, when each reads its own bytes into CPU shards) No message: this rank's pieces read
    in order by ``reader`` (float8 pairs joined by ``Sink.runs``); the files read in a round checked at
    its end, every file after the last. A failing rank stops reading."""

    def __init__(self, sink: Sink, reader: LocalReader, on_bytes: Callable[[int], None]) -> None:
        self.plan, self.sink, self.reader, self.on_bytes = sink.plan, sink, reader, on_bytes
        self._by_round = ByRound(self.plan.pieces(sink.me, cut_for=(sink.me,)), lambda p: p.index)

    def until(self, stop: int) -> Iterator[Arrival]:
        """The arrivals of the round that ends before entry ``stop`` (rank 0's view has every
        rank's pieces: the others' are counted on ``on_bytes``, not read)."""
        for item in self.sink.runs(self._by_round.until(stop), self.plan.piece_bytes):
            yield from self.reader.arrivals(item)
            pieces = item.pieces if isinstance(item, Message) else (item,)
            self.on_bytes(sum(p.nbytes for p in pieces if p.route is not Route.SCALES))

    def take(self, arrival: Arrival) -> None:
        _into_sink(self.sink, arrival)  # reads are synchronous: the reader's one slot is then free

    def round_end(self, stop: int) -> None:
        self.reader.round_end()
        if stop == len(self.plan.entries):
            self.reader.finish()


def _into_sink(sink: Sink, arrival: Arrival) -> None:
    """(ranks but a sending rank 0) An arrival into this rank's sink: a BLOCK chunk through
    :func:`fan_out`, its sends waited for, anything else through :meth:`Sink.take`."""
    piece = arrival.message.first
    if piece.route is Route.FAN_OUT:
        assert arrival.pack_buffer is not None
        fan_out(piece, arrival.data, arrival.pack_buffer, sink, arrival.first_row).wait()
    else:
        sink.take(arrival.message, arrival.data, arrival.in_target)
