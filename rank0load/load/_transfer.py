"""Moving the tensor data: each rank takes its messages' bytes from its source, round by round (all ranks).

(all ranks) :func:`stream`: each rank hands every arrival into its sink (rank 0 first to the ranks it
serves, :class:`_Sender`) and gives its buffer back.

The messages are fixed by the plan: after a *local* failure (a read, cast or copy error, a changed
file) a rank keeps sending and receiving the round's remaining messages, from and into scratch, and
does no more local work. At every round's end the ranks compare notes; if any failed, all raise its
error there and the process group stays usable. Only a failing collective (a peer gone) raises at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..common._distribute import settled
from ..common._staging import InFlight, block_half
from ..errors import LoadError
from ._pieces import Route
from ._plan import Plan
from ._sink import Arrival, Sink, Staging, fan_out
from ._sources import FileSource, OwnSource, ReceiveSource

if TYPE_CHECKING:
    from ._localread import LocalReads

__all__ = ["stream"]


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
    with settled(
        sink.faults,
        plan.rounds,
        "moving tensor data",
        "No model was returned; the process group is still usable: fix the cause and load again.",
        LoadError,
        "No model was returned; fix the cause and load again.",
    ) as rounds:
        # the same on every rank: each reads its own bytes into CPU shards, or rank 0 sends to the others
        own = local.reader(plan, staging, sink, files)
        source: FileSource | ReceiveSource | OwnSource
        sender: _Sender | None = None
        if own is not None and own.everything and sink.device.type == "cpu":
            source = OwnSource(plan, sink, own, on_bytes)
        elif dist.get_rank() == 0:
            source = FileSource(plan, staging, files, sink, local.rank0_pieces(plan, on_bytes))
            sender = _Sender(plan, staging, sink, source, local.everyone, on_bytes)
        else:
            source = ReceiveSource(plan, staging, sink, own)
        try:
            for _, stop in rounds:
                for arrival in source.until(stop):
                    if sender is not None:
                        sender(arrival)
                    else:
                        _into_sink(sink, source, arrival)
                if sender is not None:
                    sender.round_end(last=stop == len(plan.entries))
                source.round_end(stop)
        finally:
            if sender is not None:  # rank 0's reader thread
                sender.source.close()


def _into_sink(sink: Sink, source: FileSource | ReceiveSource | OwnSource, arrival: Arrival) -> None:
    """(ranks but a sending rank 0) An arrival into this rank's sink (a BLOCK chunk through
    :func:`fan_out`, its sends waited for, anything else through :meth:`Sink.take`); its slot back."""
    piece = arrival.message.first
    if piece.route is Route.FAN_OUT:
        assert arrival.pack_buffer is not None
        fan_out(piece, arrival.data, arrival.pack_buffer, sink, arrival.first_row).wait()
    else:
        sink.take(arrival.message, arrival.data, arrival.in_target)
    source.release(arrival.slot)


class _Sender:
    """(rank 0) Hands each arrival on to the ranks it serves (not the local readers, nor broadcasts
    when ``sends_nothing``: they are all the other ranks), then into its own sink. On an accelerator
    mesh the copies out of the pinned staging are non-blocking on the current stream (later reads of
    the shards are ordered after them); the reader waits for them (:meth:`_done_with`); the last
    round synchronises the stream."""

    def __init__(
        self,
        plan: Plan,
        staging: Staging,
        sink: Sink,
        source: FileSource,
        sends_nothing: bool,
        on_bytes: Callable[[int], None],
    ) -> None:
        self.plan, self.staging, self.sink, self.source, self.on_bytes = plan, staging, sink, source, on_bytes
        self.on_cpu = sink.device.type == "cpu"
        self.sends_nothing = sends_nothing
        self.pending = InFlight()  # sends, each handing its slot back to the reader once done

    def __call__(self, arrival: Arrival) -> None:
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
        elif own:
            if not arrival.in_target:
                self.sink.take(message, data, non_blocking=not self.on_cpu)
            self._done_with(slot_to_free)
        elif message.dst > 0:
            self._sent(dist.isend(data, dst=message.dst), slot_to_free)
        else:  # BROADCAST, SCALES
            if not self.sends_nothing:
                dist.broadcast(data, src=0)
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
        self.pending.add(work, functools.partial(self.source.release, slot))

    def _done_with(self, slot: int | None) -> None:
        """``slot``'s bytes are used: handed back (on an accelerator, whose copies are only queued,
        with an event recorded now). On an accelerator every message's slot comes back here before the
        next message is asked for, as the ring needs: sends go from the device buffer, not the slot."""
        if self.on_cpu or slot is None:
            self.source.release(slot)
            return
        copies = torch.Event(device=self.sink.device)
        copies.record()
        self.source.release(slot, copies)

    def round_end(self, last: bool) -> None:
        """Wait for the round's sends; after the last round, for the queued copies too."""
        self.pending.drain()
        if last and not self.on_cpu:
            self.sink.faults.run(torch.accelerator.current_stream(self.sink.device).synchronize)
