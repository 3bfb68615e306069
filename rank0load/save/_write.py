"""Moving a model's bytes into rank 0's files (save side; all ranks): each rank sends its rows and
blocks to rank 0 point to point, in pieces of at most ``piece_bytes``; a writer thread ``pwrite``s
them. Failures are settled at each round's end as the same :class:`SaveError` on every rank."""

from __future__ import annotations

import collections
import functools
import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..checkpoint._format import DTYPES
from ..common import _distribute
from ..common._blocks import Chunk, Part
from ..common._memory import reserve
from ..common._staging import SLOTS, AllOf, InFlight, block_half
from ..errors import SaveError
from ..integrations._compat import host_bytes, local_tensor
from ._outputs import Outputs, pwrite_all
from ._saveplan import Piece, SaveItem, SaveKind, SavePlan

TODO = "The previous checkpoint in out_dir is unchanged; fix the cause and save again."


@dataclass
class Staging:
    """A rank's staging slots (host on rank 0, the mesh device elsewhere); on rank 0 of an
    accelerator mesh, device slots that receive before the copy to the host."""

    slots: list[torch.Tensor]
    device_slots: list[torch.Tensor]


def allocate_staging(piece_bytes: int, mesh_device: torch.device, max_staging_bytes: int) -> Staging:
    """(all ranks) Reserve the staging (``_memory.reserve``); raises SaveError when it cannot be had."""

    def slots(device: torch.device) -> list[torch.Tensor]:
        return reserve(SLOTS, piece_bytes, device, max_staging_bytes, error=SaveError)

    if dist.get_rank() != 0:
        return Staging(slots(mesh_device), [])
    return Staging(slots(torch.device("cpu")), [] if mesh_device.type == "cpu" else slots(mesh_device))


def stream(
    plan: SavePlan,
    tensors: dict[str, torch.Tensor],
    outputs: Outputs | None,
    staging: Staging,
    on_bytes: Callable[[int], None],
) -> None:
    """(all ranks) Move every item's bytes into rank 0's files (``outputs``, rank 0 only), GATHER
    items' by ``full_tensor()`` on every rank. Raises the same SaveError on every rank if any rank
    failed."""
    faults = _distribute.Faults()

    with _distribute.settled(faults, plan.rounds, "writing the checkpoint", TODO, SaveError, TODO) as rounds:
        if dist.get_rank() == 0:
            assert outputs is not None
            _Collector(plan, outputs, staging, faults).run(rounds, tensors, on_bytes)
        else:
            _sender(plan, rounds, tensors, staging, faults)


def _source(item: SaveItem, tensor: torch.Tensor, pending: InFlight) -> torch.Tensor:
    """(all ranks) The tensor a rank's pieces of ``item`` come from, flat; GATHER: ``pending``
    completed, then a collective."""
    if item.kind is SaveKind.GATHER:
        assert isinstance(tensor, DTensor)
        pending.drain()
        with torch.no_grad():
            return tensor.full_tensor().reshape(-1)
    return local_tensor(tensor).detach().reshape(-1)


def _elements(piece: Piece | Part, wire: torch.dtype) -> slice:
    first = piece.local_offset // wire.itemsize
    return slice(first, first + piece.nbytes // wire.itemsize)


class _Collector:
    """(rank 0) Every piece received ahead into a staging slot, or taken from rank 0's own tensor,
    then queued for the writer thread, which ``pwrite``s it at its offsets and frees the slot; after
    the first failure the thread writes nothing more but still frees the slots."""

    def __init__(
        self, plan: SavePlan, outputs: Outputs, staging: Staging, faults: _distribute.Faults
    ) -> None:
        self.pending = InFlight()
        self.plan, self.fds, self.staging, self.faults = plan, outputs.fds, staging, faults
        self.half = block_half(plan.piece_bytes)
        self.jobs: queue.Queue[tuple[list[tuple[int, memoryview, int]], int | None] | None] = queue.Queue()
        self.free: queue.Queue[int] = queue.Queue()
        for slot in range(len(staging.slots)):
            self.free.put(slot)
        self.thread = threading.Thread(target=self.write, name="rank0load-writer", daemon=True)
        self.thread.start()

    def run(
        self,
        rounds: Iterator[tuple[int, int]],
        tensors: dict[str, torch.Tensor],
        on_bytes: Callable[[int], None],
    ) -> None:
        """Receive ahead into the slots, write rank 0's own pieces from its tensors, round by round."""
        plan = self.plan
        try:
            for begin, stop in rounds:
                for index in range(begin, stop):
                    item = plan.items[index]
                    source = _source(item, tensors[item.key], self.pending)
                    if item.kind is SaveKind.BLOCK:
                        for chunk, parts in plan.chunks(index):
                            self.chunk(item, source, chunk, parts)
                            on_bytes(chunk.nbytes)
                        continue
                    for piece in plan.pieces(index):
                        if piece.src == 0:
                            self.own(piece, source, item)
                        else:
                            self.receive(item, piece)
                        on_bytes(piece.nbytes)
                self.pending.drain()
                self.jobs.join()
        finally:
            self.jobs.put(None)
            self.thread.join()

    def put(self, item: SaveItem, start: int, data: memoryview, slot: int | None) -> None:
        """Queue bytes [start, start + len(data)) of ``item`` for each saved tensor they touch;
        ``slot`` is freed once written."""
        end, writes = start + len(data), []
        for s in item.saved:
            lo, hi = max(start, s.start), min(end, s.start + s.nbytes)
            if lo < hi:
                writes.append((self.fds[s.file], data[lo - start : hi - start], s.offset + lo - s.start))
        self.jobs.put((writes, slot))

    def write(self) -> None:
        """(the writer thread) Write the queued pieces until the ``None`` that ends the stream."""
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                writes, slot = job
                for fd, data, offset in writes:
                    self.faults.run(pwrite_all, fd, data, offset)
                if slot is not None:
                    self.free.put(slot)
            finally:
                self.jobs.task_done()

    def take(self) -> int:
        """A free slot, completing the oldest receives until the writer frees one."""
        while self.free.empty() and len(self.pending):
            self.pending.complete_oldest()
        return self.free.get()

    def receive(self, item: SaveItem, piece: Piece) -> None:
        """Post the receive of another rank's ``piece`` into a slot; written once it is in (copied to
        the host first from a device slot)."""
        slot = self.take()
        host = self.staging.slots[slot][: piece.nbytes]
        into = self.staging.device_slots[slot][: piece.nbytes] if self.staging.device_slots else host

        def then() -> None:
            if into is not host:
                self.faults.run(host.copy_, into)
            self.put(item, piece.start, host_bytes(host), slot)

        self.pending.add(dist.irecv(into, src=piece.src), then)

    def own(self, piece: Piece, source: torch.Tensor, item: SaveItem) -> None:
        """Rank 0's own ``piece``: written from the tensor as it is, or cast into a slot first."""
        wire = DTYPES[item.dtype]
        values = source[_elements(piece, wire)]
        if values.dtype == wire and values.device.type == "cpu" and values.is_contiguous():
            self.put(item, piece.start, host_bytes(values.view(torch.uint8)), None)
            return
        slot = self.take()
        buffer = self.staging.slots[slot][: piece.nbytes]
        self.faults.run(buffer.view(wire).copy_, values)
        self.put(item, piece.start, host_bytes(buffer), slot)

    def chunk(self, item: SaveItem, source: torch.Tensor, chunk: Chunk, parts: tuple[Part, ...]) -> None:
        """A BLOCK chunk: rank 0's own parts placed at once, the others' received into the slot's
        second half and placed once in; then the chunk's rows written as one byte range."""
        staging, faults, half = self.staging, self.faults, self.half
        wire, slot = DTYPES[item.dtype], self.take()
        host = staging.slots[slot]
        rows = host[: chunk.nbytes].view(wire).view(chunk.shape)
        received = []  # (part, where it lands in the slot)
        works = []
        # the parts land one after another in the slot's second half, rank 0's own counted too
        for part, offset in zip(parts, itertools.accumulate((p.nbytes for p in parts), initial=0)):
            if part.rank == 0:
                mine = source[_elements(part, wire)].view(part.shape)
                faults.run(place, rows, mine, part)
            else:
                at = half + offset
                into = (staging.device_slots or staging.slots)[slot][at : at + part.nbytes]
                works.append(dist.irecv(into, src=part.rank))
                received.append((part, at))

        def then() -> None:
            if staging.device_slots and received:
                last, at = received[-1]
                end = at + last.nbytes
                faults.run(host[half:end].copy_, staging.device_slots[slot][half:end])
            for part, at in received:
                block = host[at : at + part.nbytes].view(wire).view(part.shape)
                faults.run(place, rows, block, part)
            self.put(item, chunk.start, host_bytes(host[: chunk.nbytes]), slot)

        self.pending.add(AllOf(works), then)


def place(rows: torch.Tensor, block: torch.Tensor, part: Part) -> None:
    """(rank 0) Copy a sender's ``block`` (``part.shape``) into ``rows``, a chunk laid out as full rows
    (``Chunk.shape``): rows ``part.rows``, on each later dimension the sender's runs, cast if needed."""
    target = rows[part.rows[0] : part.rows[1]]
    spans = []  # per later dimension: (global start, local start, length) of each run
    for runs in part.inner:
        local_starts = itertools.accumulate((b - a for a, b in runs), initial=0)
        spans.append([(a, local, b - a) for (a, b), local in zip(runs, local_starts)])
    for combination in itertools.product(*spans):
        into, values = target, block
        for dim, (start, local, length) in enumerate(combination, start=1):
            into, values = into.narrow(dim, start, length), values.narrow(dim, local, length)
        into.copy_(values)


def _sender(
    plan: SavePlan,
    rounds: Iterator[tuple[int, int]],
    tensors: dict[str, torch.Tensor],
    staging: Staging,
    faults: _distribute.Faults,
) -> None:
    """(ranks other than 0) Send this rank's pieces, round by round, cast into a staging slot when the
    saved dtype differs, with up to ``SLOTS`` sends in flight."""
    me = dist.get_rank()
    free = collections.deque(range(len(staging.slots)))
    pending = InFlight()  # sends, each freeing its slot (if it used one) once done

    for begin, stop in rounds:
        for index in range(begin, stop):
            item = plan.items[index]
            sends = any(r == me for r, _, _ in item.senders) or any(r == me for r, _ in item.blocks)
            if item.kind is not SaveKind.GATHER and not sends:
                continue
            source = _source(item, tensors[item.key], pending)
            wire = DTYPES[item.dtype]
            for piece in plan.pieces(index, me):
                values = source[_elements(piece, wire)]
                slot: int | None = None
                if faults.error is None and values.dtype == wire and values.device == staging.slots[0].device:
                    data = values.view(torch.uint8)
                else:
                    while not free:
                        pending.complete_oldest()
                    slot = free.popleft()
                    data = staging.slots[slot][: piece.nbytes]
                    faults.run(data.view(wire).copy_, values)
                pending.add(
                    dist.isend(data, dst=0), None if slot is None else functools.partial(free.append, slot)
                )
                pending.drain(keep=len(staging.slots))
        pending.drain()
