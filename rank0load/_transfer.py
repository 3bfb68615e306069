"""Moving the tensor data: rank 0 sends, the others receive, round by round (all ranks).

(all ranks) :func:`allocate_staging` reserves every staging buffer the stream will use, before the
last agreement, so that no allocation inside the stream can leave a rank unable to take part.
(all ranks) :func:`stream` moves every :class:`~._plan.Piece` of the plan. The messages are fixed by
the plan: after a *local* failure (a read error or a changed file on rank 0, a cast or copy error
anywhere) a rank keeps sending and receiving the round's remaining messages, from and into scratch,
and does no more local work. At the end of every round the ranks compare notes
(``_distribute.first_failure``, one 8-byte all-reduce); if any rank failed, all stop there and raise
that rank's error (``_distribute.raise_failure``). The process group stays usable. Only a
collective that itself fails (a peer is gone) raises at once, as a ``peer_failure``.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from . import _distribute
from ._compat import local_tensor
from ._format import DTYPES
from ._manifest import Entry
from ._plan import Kind, Piece, Plan, Route, block_half, cut, deliveries, row_bytes
from ._stream import Reader
from .errors import LoadError

__all__ = ["Staging", "Target", "allocate_staging", "stream", "target_of"]

logger = logging.getLogger(__name__)

SLOTS = 4  # staging slots of max_staging_bytes / SLOTS each


@dataclass
class Target:
    """Where one entry lands on this rank."""

    tensor: torch.Tensor  # the local tensor (DTensor's local shard, or the plain tensor)
    dtensor: DTensor | None  # the parameter, for GENERIC entries


def target_of(t: torch.Tensor) -> Target:
    return Target(local_tensor(t), t) if isinstance(t, DTensor) else Target(t.data, None)


@dataclass
class Staging:
    """Every staging buffer of one rank, allocated before the stream: ``slots`` host (rank 0) or
    mesh-device (others) buffers, and on rank 0 of an accelerator mesh one device buffer."""

    slots: list[torch.Tensor]
    device: torch.Tensor | None


def allocate_staging(rank: int, piece_bytes: int, comm: torch.device) -> Staging:
    """(all ranks) Reserve the staging. ``torch.empty`` touches no page: RSS grows only with use."""
    on_cpu = comm.type == "cpu"
    where = torch.device("cpu") if rank == 0 else comm
    pin = rank == 0 and not on_cpu
    slots = [torch.empty(piece_bytes, dtype=torch.uint8, device=where, pin_memory=pin) for _ in range(SLOTS)]
    device = None if rank != 0 or on_cpu else torch.empty(piece_bytes, dtype=torch.uint8, device=comm)
    return Staging(slots, device)


class _Faults:
    """This rank's first local failure; after it, local work is skipped and only messages flow."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def run(self, fn: Callable[..., object], *args: Any) -> None:
        if self.error is not None:
            return
        try:
            fn(*args)
        except Exception as exc:
            self.note(exc)

    def note(self, exc: BaseException) -> None:
        if self.error is None:
            logger.debug("rank %d: local failure during the stream", dist.get_rank(), exc_info=exc)
            self.error = exc


def _cast_into(dst: torch.Tensor, local_offset: int, data: torch.Tensor, wire: torch.dtype) -> None:
    """Copy wire bytes ``data`` into ``dst``'s elements from byte ``local_offset`` (wire dtype)."""
    if not dst.is_contiguous():
        raise LoadError("internal error: cast into a non-contiguous tensor")  # ensured by _model
    start = local_offset // wire.itemsize
    values = data.view(wire)
    dst.view(-1)[start : start + values.numel()].copy_(values)


def _landing(target: Target, piece: Piece, wire: torch.dtype) -> torch.Tensor | None:
    """Where a piece can land without staging: the target's own bytes (same dtype, contiguous)."""
    t = target.tensor
    if t.dtype != wire or not t.is_contiguous():
        return None
    return t.reshape(-1).view(torch.uint8)[piece.local_offset : piece.local_offset + piece.nbytes]


class _Whole:
    """(all ranks) A GENERIC entry assembled from its broadcast pieces into a full-size buffer, then
    cut to this rank's shard with DTensor's own split (``src_data_rank=None``: no communication).
    Exact for every placement DTensor supports; the price is the full tensor on every rank."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = -1
        self.buffer: torch.Tensor | None = None

    def land(self, piece: Piece, entry: Entry) -> torch.Tensor:
        if piece.index != self.index:
            self.index, self.buffer = piece.index, None
            self.buffer = torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device)
        assert self.buffer is not None
        return self.buffer[piece.local_offset : piece.local_offset + piece.nbytes]

    def complete(self, piece: Piece, entry: Entry, target: Target, wire: torch.dtype) -> None:
        if piece.local_offset + piece.nbytes < entry.nbytes or self.buffer is None:
            return
        dt = target.dtensor
        if dt is None:
            raise LoadError("internal error: GENERIC entry without a DTensor target")
        value = self.buffer.view(wire).reshape(dt.shape).to(dtype=dt.dtype)
        local = distribute_tensor(value, dt.device_mesh, dt.placements, src_data_rank=None).to_local()
        target.tensor.copy_(local)
        self.buffer = None


T = TypeVar("T")


class _Rounds(Generic[T]):
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


class _All:
    """Several sends, waited for together (and the tensors they send, kept alive until then)."""

    def __init__(self, works: list[Any], keep: list[torch.Tensor]) -> None:
        self._works, self._keep = works, keep

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._keep.clear()


def stream(
    plan: Plan,
    targets: list[Target],
    staging: Staging,
    comm: torch.device,
    files: Mapping[str, Any] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """(all ranks) Move every piece of ``plan`` to its destination; rank 0 reads from ``files``
    (path -> ``_format.OpenFile``). Raises the same error on every rank if any rank failed."""
    faults = _Faults()
    try:
        if dist.get_rank() == 0:
            first = _send(plan, targets, staging, comm, files or {}, faults, on_bytes)
        else:
            first = _receive(plan, targets, staging, comm, faults)
        if first < dist.get_world_size():
            _distribute.raise_failure(
                first,
                faults.error,
                "moving tensor data",
                "No model was returned; the process group is still usable: fix the cause and load again.",
                wrap=LoadError,
            )
    except LoadError:
        raise
    except RuntimeError as exc:  # a collective failed: a rank died or stalled, or the network broke
        raise _distribute.peer_failure("moving tensor data", exc) from exc


def _send(
    plan: Plan,
    targets: list[Target],
    staging: Staging,
    comm: torch.device,
    files: Mapping[str, Any],
    faults: _Faults,
    on_bytes: Callable[[int], None] | None,
) -> int:
    """(rank 0) Read and send round by round; returns the first failing rank (world: none)."""
    on_cpu = comm.type == "cpu"
    entries, wires = plan.entries, [DTYPES[e.dtype] for e in plan.entries]

    def direct(piece: Piece) -> torch.Tensor | None:  # rank 0's own rows, read in place
        target = targets[piece.index]
        if piece.route is Route.TO_RANK and piece.dst == 0 and target.tensor.device.type == "cpu":
            return _landing(target, piece, wires[piece.index])
        return None

    reader = Reader(plan.pieces(0), entries, files, direct, staging.slots)
    pending: collections.deque[tuple[Any, int | None]] = collections.deque()
    whole = _Whole(comm)
    layouts = functools.lru_cache(maxsize=1)(lambda i: plan.block_layouts(i, [r for r, _ in plan.coords]))

    def drain(keep: int = 0) -> None:
        while len(pending) > keep:
            work, slot = pending.popleft()
            work.wait()
            reader.release(slot)

    try:
        rounds = _Rounds(iter(reader), lambda s: s.piece.index)
        for stop in plan.rounds:
            for staged in rounds.until(stop):
                piece, data, slot = staged.piece, staged.data, staged.slot
                i = piece.index
                own = piece.route is Route.TO_RANK and piece.dst == 0
                if not on_cpu and not own:  # through the one device buffer, once earlier sends are done
                    drain()
                    assert staging.device is not None
                    data = staging.device[: piece.nbytes]
                    data.copy_(staged.data)
                if piece.route is Route.FAN_OUT:
                    spare = staging.slots[slot] if on_cpu and slot is not None else staging.device
                    assert spare is not None
                    spare = spare[block_half(plan.piece_bytes) :]
                    runs = layouts(i)
                    pending.append(
                        (_fan_out(piece, data, spare, entries[i], runs, targets[i], wires[i], faults), slot)
                    )
                elif own:
                    if slot is not None:
                        faults.run(_cast_into, targets[i].tensor, piece.local_offset, data, wires[i])
                    reader.release(slot)
                elif piece.route is Route.TO_RANK:
                    pending.append((dist.isend(data, dst=piece.dst), slot))
                else:  # BROADCAST
                    _distribute._broadcast(data, 0)
                    _after_broadcast(piece, data, False, entries[i], targets[i], wires[i], whole, faults)
                    reader.release(slot)
                drain(keep=max(1, len(staging.slots) - 1))
                if on_bytes is not None:
                    on_bytes(piece.nbytes)
            drain()
            if stop == len(entries):
                for _ in rounds.until(stop + 1):  # the reader's last checks come with its end
                    pass
            first = _distribute.first_failure(faults.error or reader.failed)
            if first < dist.get_world_size():
                if faults.error is None:
                    faults.error = reader.failed
                return first
        return dist.get_world_size()
    finally:
        reader.close()


def _after_broadcast(
    piece: Piece,
    data: torch.Tensor,
    in_whole: bool,
    entry: Entry,
    target: Target,
    wire: torch.dtype,
    whole: _Whole,
    faults: _Faults,
) -> None:
    """(all ranks) A broadcast piece's local work: cast into a plain tensor, or assemble a GENERIC
    one (``in_whole``: the piece was received straight into the full-size buffer)."""
    if piece.kind is Kind.GENERIC:
        if not in_whole:
            faults.run(lambda: whole.land(piece, entry).copy_(data))
        faults.run(whole.complete, piece, entry, target, wire)
    else:
        faults.run(_cast_into, target.tensor, piece.local_offset, data, wire)


def _fan_out(
    piece: Piece,
    data: torch.Tensor,
    spare: torch.Tensor,
    entry: Entry,
    per_rank: dict[int, Any],
    target: Target,
    wire: torch.dtype,
    faults: _Faults,
) -> _All:
    """(rank 0) Cut a BLOCK chunk (whole rows, in ``data``) into every rank's block: rank 0's own is
    copied into its shard, the others are sent. A block that is not a contiguous part of the chunk is
    packed into ``spare`` (the rest of the staging slot); ranks holding the same block (replicas)
    share one copy, so the packed blocks never exceed the chunk. After a local failure the blocks
    still go out, as scratch bytes of the right size."""
    made: dict[tuple[Any, ...], torch.Tensor] = {}
    works: list[Any] = []
    keep: list[torch.Tensor] = []
    used = 0
    for d in deliveries(piece, entry, per_rank):
        payload: torch.Tensor | None = None
        if faults.error is None:
            try:
                key = (d.row_lo, d.row_hi, d.inner)
                block = made.get(key)
                if block is None:
                    chunk = data.view(wire).view(piece.nbytes // row_bytes(entry), *entry.shape[1:])
                    block = cut(chunk, d)
                    if not block.is_contiguous():
                        packed = spare[used : used + d.nbytes].view(wire).view(block.shape)
                        packed.copy_(block)
                        used += d.nbytes
                        block = packed
                    made[key] = block
                payload = block.reshape(-1).view(torch.uint8)
                if d.dst == 0:
                    _cast_into(target.tensor, d.local_offset, payload, wire)
            except Exception as exc:
                faults.note(exc)
                payload = None
        if d.dst == 0:
            continue
        if payload is None:
            payload = data[: d.nbytes]  # scratch: the receiver discards it
        works.append(dist.isend(payload, dst=d.dst))
        keep.append(payload)
    return _All(works, keep)


def _receive(plan: Plan, targets: list[Target], staging: Staging, comm: torch.device, faults: _Faults) -> int:
    """(ranks other than 0) Post up to ``slots`` receives ahead, straight into the local shard when
    the wire dtype is the target's, else into a staging slot, then cast. Returns the first failing rank."""
    me = dist.get_rank()
    entries, wires = plan.entries, [DTYPES[e.dtype] for e in plan.entries]
    free = collections.deque(range(len(staging.slots)))
    pending: collections.deque[tuple[Any, Piece, int | None]] = collections.deque()
    whole = _Whole(comm)

    def complete_oldest() -> None:
        work, piece, slot = pending.popleft()
        work.wait()
        if slot is not None:
            data = staging.slots[slot][: piece.nbytes]
            faults.run(_cast_into, targets[piece.index].tensor, piece.local_offset, data, wires[piece.index])
            free.append(slot)

    def stage(piece: Piece) -> tuple[torch.Tensor, int]:
        while not free:
            complete_oldest()
        slot = free.popleft()
        return staging.slots[slot][: piece.nbytes], slot

    rounds = _Rounds(plan.pieces(me), lambda p: p.index)
    for stop in plan.rounds:
        for piece in rounds.until(stop):
            if piece.route is Route.TO_RANK and piece.dst != me:
                continue
            target, wire = targets[piece.index], wires[piece.index]
            if piece.route is Route.BROADCAST:
                while pending:
                    complete_oldest()
                into = _broadcast_landing(piece, entries[piece.index], target, wire, whole, comm, faults)
                slot = None
                if into is None:
                    into, slot = stage(piece)
                _distribute._broadcast(into, 0)
                in_whole = slot is None and piece.kind is Kind.GENERIC
                _after_broadcast(piece, into, in_whole, entries[piece.index], target, wire, whole, faults)
                if slot is not None:
                    free.append(slot)
                continue
            view = (
                _landing(target, piece, wire)
                if faults.error is None and target.tensor.device == comm
                else None
            )
            if view is not None:
                pending.append((dist.irecv(view, src=0), piece, None))
            else:
                into, slot = stage(piece)
                pending.append((dist.irecv(into, src=0), piece, slot))
            while len(pending) > len(staging.slots):
                complete_oldest()
        while pending:
            complete_oldest()
        first = _distribute.first_failure(faults.error)
        if first < dist.get_world_size():
            return first
    return dist.get_world_size()


def _broadcast_landing(
    piece: Piece,
    entry: Entry,
    target: Target,
    wire: torch.dtype,
    whole: _Whole,
    comm: torch.device,
    faults: _Faults,
) -> torch.Tensor | None:
    """(receivers) Where a broadcast piece can land without staging: a GENERIC entry's full-size
    buffer, or a plain tensor's own bytes; None after a local failure (then: a staging slot)."""
    if faults.error is not None:
        return None
    if piece.kind is Kind.GENERIC:
        try:
            return whole.land(piece, entry)
        except Exception as exc:  # the full-size buffer could not be allocated
            faults.note(exc)
            return None
    return _landing(target, piece, wire) if target.tensor.device == comm else None
