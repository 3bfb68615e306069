"""A rank on rank 0's host reads its own bytes through rank 0's descriptors (no collectives); with
``readers="host"``, a rank on another host through its host reader's, or its host reader's own files.

(a local reader: a rank other than 0 that ``_handover.hand_over`` gave rank 0's descriptors, a host
reader's, or a host reader's own open files)
:class:`LocalReader` reads, instead of receiving, its rows of SHARDED entries and the rows of BLOCK
chunks that hold its parts; broadcast pieces too when every rank but 0 reads locally
(``_handover.LocalReads.everyone``), and then, with CPU shards, rank 0 reads its own share through one as
well (its own open files). A failure is the sink's local failure, settled like any other; the files
read in a round are checked at its end against the identities recorded when they were opened, and
every file after the last round.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace

import torch
import torch.distributed as dist

from ..checkpoint._files import OpenFile, opened
from ..common._staging import block_half
from ..errors import CheckpointChangedError, InternalError
from ._plan import Message, Piece, Route
from ._readahead import read_into, runs
from ._sink import Arrival, Sink, Staging

_THROUGH_RANK0 = " (it reads through rank 0's descriptor; local_reads=False has rank 0 send its bytes)"


class LentFile(OpenFile):
    """(a local reader) One of rank 0's descriptors, lent with the identity rank 0 recorded when it
    opened the file; checked by its descriptor alone (the path may be hidden on this rank)."""

    __slots__ = ()

    def check(self) -> None:
        """Raise CheckpointChangedError if the file behind the descriptor changed."""
        changes = self.identity.rewritten(self.fd)
        if changes:
            raise CheckpointChangedError(
                f"{self.path} changed ({'; '.join(changes)}) while rank {dist.get_rank()} read it: the "
                "checkpoint changed during the load; wait until whatever writes it has finished, then load again."
            )


class LocalReader:
    """(a local reader) A source of bytes: reads the pieces it is handed synchronously, one at a time."""

    def __init__(
        self, staging: Staging, sink: Sink, files: Mapping[str, OpenFile], host: torch.Tensor | None
    ) -> None:
        self.plan, self.sink, self.files = sink.plan, sink, files
        self.me = dist.get_rank()
        self.slot = staging.slots[0]  # reads are synchronous: one slot, free again once delivered
        self.host = host if host is not None else self.slot  # ``host``: a pinned buffer, shards off the CPU
        self.touched: set[str] = set()

    def arrivals(self, piece: Piece | Message) -> Iterator[Arrival]:
        """``piece`` read straight into this rank's tensor where it can (on the CPU, of the wire dtype),
        else into the staging slot (free again once delivered); a message (``Sink.runs``) into the slot.
        After a local failure, or for another rank's piece, nothing: no message depends on it."""
        if self.sink.faults.error is not None:
            return
        if not isinstance(piece, Message) and piece.dst not in (-1, self.me):
            return
        try:
            arrival = self._message(piece) if isinstance(piece, Message) else self._arrival(piece)
        except Exception as exc:
            self.sink.faults.note(exc)
            return
        if arrival is not None:
            yield arrival

    def _message(self, message: Message) -> Arrival:
        if self.host is not self.slot:
            raise InternalError("internal error: a message of pieces for a reader that stages on a device")
        for piece, at in message.parts():
            self._read(piece, self.slot[at : at + piece.nbytes])
        return Arrival(message, self.slot[: message.nbytes])

    def _arrival(self, piece: Piece) -> Arrival | None:
        message = Message.of(piece)
        if piece.route is Route.FAN_OUT:  # the chunk's rows that hold this rank's parts (its own alone)
            chunk, mine = piece.chunk, piece.parts
            if chunk is None or not mine:
                return None
            row = chunk.nbytes // chunk.shape[0]
            lo, hi = min(p.rows[0] for p in mine), max(p.rows[1] for p in mine)
            rows = replace(piece, start=piece.start + lo * row, nbytes=(hi - lo) * row)
            pack_buffer = self.slot[block_half(self.plan.piece_bytes) :]
            return Arrival(message, self._staged(rows), pack_buffer=pack_buffer, first_row=lo)
        into = self.sink.direct_view(piece)
        if into is not None and into.device.type == "cpu":
            self._read(piece, into)
            return Arrival(message, into, in_target=True)
        return Arrival(message, self._staged(piece))

    def round_end(self) -> None:
        """Check every file read since the last round's end (its descriptor's fstat)."""
        touched, self.touched = self.touched, set()
        for path in sorted(touched):
            self.sink.faults.run(self.files[path].check)

    def finish(self) -> None:
        """Check every file once more after the last read: one replaced after its round fails the load."""
        self.touched = set(self.files)
        self.round_end()

    def _staged(self, piece: Piece) -> torch.Tensor:
        """``piece``'s bytes in the staging slot (through the pinned host buffer, on an accelerator)."""
        host = self.host[: piece.nbytes]
        self._read(piece, host)
        return host if self.host is self.slot else self.slot[: piece.nbytes].copy_(host)

    def _read(self, piece: Piece, data: torch.Tensor) -> None:
        entry = self.plan.entries[piece.index]
        extents = entry.extents(piece.start, piece.nbytes, piece.route is Route.SCALES)
        for path, offset, views in runs(extents, data):
            hint = "" if self.me == 0 else _THROUGH_RANK0
            read_into(opened(self.files, path).fd, views, offset, path, f"rank {self.me}", hint)
            self.touched.add(path)  # one of ``files``, read (a failed read stops all checks: faults.run)
