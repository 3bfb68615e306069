"""Moving a model's bytes into rank 0's files: the saved layout, the files, the stream (save side).

(all ranks) The plan (``_saveplan.SavePlan``, rank 0's, shared) fixes every saved tensor's file and
offset and every message (``_saveplan.pieces``).
(rank 0) :func:`open_outputs` creates the temporary files (names that never end in ``.safetensors``)
and writes their headers; :func:`commit` fsyncs and renames them, writes the index last and only
then removes a previous save's files; :meth:`Outputs.discard` removes the temporary files.
(all ranks) :func:`stream` moves the bytes: each rank sends its own rows to rank 0 point to point,
in pieces of at most ``piece_bytes``; rank 0 receives ahead into its staging slots while a writer
thread ``pwrite``s each piece at its file offset. The messages are fixed by the plan: after a local
failure (rank 0's disk full, a cast error) a rank keeps the messages flowing, and at the end of each
round every rank learns the first failure (``_distribute.first_failure``) and raises it as the same
:class:`SaveError`. A collective that fails (a peer died) raises at once.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import re
import secrets
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import _distribute
from ._compat import host_bytes, local_tensor
from ._format import DTYPES
from ._saveplan import SLOTS, Piece, SaveItem, SaveKind, SavePlan, pieces
from .errors import LoadError, SaveError

__all__ = [
    "INDEX_NAME",
    "Outputs",
    "Staging",
    "allocate_staging",
    "commit",
    "open_outputs",
    "settle",
    "stream",
]

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
_SAVED = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
_TODO = "The previous checkpoint in out_dir is unchanged; fix the cause and save again."


def settle(error: BaseException | None, stage: str) -> None:
    """(all ranks) If any rank's ``error`` is set, every rank raises the first failing rank's, as a
    :class:`SaveError` (or that rank's own LoadError class)."""
    _distribute.settle(error, stage, _TODO, wrap=SaveError)


def _peer_failure(stage: str, exc: BaseException) -> LoadError:
    return _distribute.peer_failure(stage, exc, SaveError, _TODO)


@dataclass
class Outputs:
    """(rank 0) The temporary files being written, one per planned file."""

    directory: str
    token: str
    temps: list[str] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)

    def discard(self) -> None:
        """Close and remove every temporary file (errors ignored: this runs while failing)."""
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
        for path in self.temps:
            try:
                if os.path.isdir(path):  # the folder of config files
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except OSError:
                pass


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def open_outputs(out_dir: str, plan: SavePlan) -> Outputs:
    """(rank 0) Create ``out_dir`` if needed, then each file under a temporary name, its header written."""
    os.makedirs(out_dir, exist_ok=True)
    outputs = Outputs(out_dir, secrets.token_hex(4))
    try:
        for name, header in zip(plan.files, plan.headers):
            path = os.path.join(out_dir, f".{name}.tmp-{outputs.token}")
            outputs.fds.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            outputs.temps.append(path)
            _pwrite_all(outputs.fds[-1], memoryview(header), 0)
    except BaseException:
        outputs.discard()
        raise
    return outputs


def commit(outputs: Outputs, plan: SavePlan, extras: list[tuple[str, str]]) -> None:
    """(rank 0) Make the checkpoint visible: fsync and rename the files (``extras``: further
    (temporary path, final name) pairs, config files), write the index last, then remove what an
    earlier save left that the new checkpoint does not have."""
    for fd in outputs.fds:
        os.fsync(fd)
    for fd in list(outputs.fds):
        os.close(fd)
        outputs.fds.remove(fd)
    directory = outputs.directory
    for temp, name in extras:
        os.replace(temp, os.path.join(directory, name))
    for temp, name in zip(list(outputs.temps), plan.files):
        os.replace(temp, os.path.join(directory, name))
        outputs.temps.remove(temp)
    keep = set(plan.files)
    if len(plan.files) > 1:
        index = {
            "metadata": {"total_size": plan.total_size},
            "weight_map": dict(sorted((s.name, plan.files[s.file]) for i in plan.items for s in i.saved)),
        }
        temp = os.path.join(directory, f".{INDEX_NAME}.tmp-{outputs.token}")
        outputs.temps.append(temp)
        with open(temp, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, os.path.join(directory, INDEX_NAME))
        outputs.temps.remove(temp)
        keep.add(INDEX_NAME)
    for name in sorted(os.listdir(directory)):
        if _SAVED.fullmatch(name) and name not in keep:
            os.unlink(os.path.join(directory, name))
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@dataclass
class Staging:
    """A rank's staging slots (host on rank 0, the comm device elsewhere); on rank 0 of an
    accelerator mesh, device slots that receive before the copy to the host."""

    slots: list[torch.Tensor]
    device: list[torch.Tensor]


def allocate_staging(piece_bytes: int, comm: torch.device) -> Staging:
    """(all ranks) Reserve the staging. ``torch.empty`` touches no page: RSS grows only with use."""
    rank0, on_cpu = dist.get_rank() == 0, comm.type == "cpu"
    where = torch.device("cpu") if rank0 else comm
    slots = [torch.empty(piece_bytes, dtype=torch.uint8, device=where) for _ in range(SLOTS)]
    device = [] if on_cpu or not rank0 else [torch.empty_like(s, device=comm) for s in slots]
    return Staging(slots, device)


class _Writer:
    """(rank 0) A thread that ``pwrite``s queued pieces at their offsets and hands their slots back.
    After the first failure it writes nothing more but still hands slots back."""

    def __init__(self, fds: list[int], slots: int, faults: _distribute.Faults) -> None:
        self.fds, self.faults = fds, faults
        self.jobs: queue.Queue[tuple[list[tuple[int, memoryview, int]], int | None, Any] | None] = (
            queue.Queue()
        )
        self.free: queue.Queue[int] = queue.Queue()
        for slot in range(slots):
            self.free.put(slot)
        self.thread = threading.Thread(target=self._run, name="rank0load-writer", daemon=True)
        self.thread.start()

    def put(self, item: SaveItem, start: int, data: memoryview, slot: int | None, keep: Any = None) -> None:
        """Write bytes [start, start + len(data)) of ``item`` into its saved tensors (one or more)."""
        writes = [(self.fds[f], data[lo:hi], at) for f, at, lo, hi in item.writes(start, len(data))]
        self.jobs.put((writes, slot, keep))

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                writes, slot, _keep = job
                for fd, data, offset in writes:
                    self.faults.run(_pwrite_all, fd, data, offset)
                if slot is not None:
                    self.free.put(slot)
            finally:
                self.jobs.task_done()

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


def stream(
    plan: SavePlan,
    tensors: dict[str, torch.Tensor],
    outputs: Outputs | None,
    staging: Staging,
    on_bytes: Callable[[int], None] | None = None,
) -> tuple[str, ...]:
    """(all ranks) Move every item's bytes into rank 0's files (``outputs``, rank 0 only). Returns the
    keys gathered whole. Raises the same SaveError on every rank if any rank failed."""
    faults = _distribute.Faults()
    gathered: list[str] = []
    try:
        if dist.get_rank() == 0:
            assert outputs is not None
            first = _rank0(plan, tensors, outputs, staging, faults, gathered, on_bytes)
        else:
            first = _sender(plan, tensors, staging, faults, gathered)
        if first < dist.get_world_size():
            _distribute.raise_failure(first, faults.error, "writing the checkpoint", _TODO, wrap=SaveError)
    except LoadError:
        raise
    except RuntimeError as exc:  # a collective failed: a rank died or stalled, or the network broke
        raise _peer_failure("writing the checkpoint", exc) from exc
    return tuple(gathered)


def _source(item: SaveItem, tensor: torch.Tensor, gathered: list[str]) -> torch.Tensor:
    """(all ranks) The tensor a rank's pieces of ``item`` come from, flat; GATHER: a collective."""
    if item.kind is SaveKind.GATHER:
        assert isinstance(tensor, DTensor)
        gathered.append(item.key)
        with torch.no_grad():
            return tensor.full_tensor().reshape(-1)
    return local_tensor(tensor).detach().reshape(-1)


def _elements(piece: Piece, wire: torch.dtype) -> slice:
    return slice(piece.local, piece.local + piece.nbytes // wire.itemsize)


def _rank0(
    plan: SavePlan,
    tensors: dict[str, torch.Tensor],
    outputs: Outputs,
    staging: Staging,
    faults: _distribute.Faults,
    gathered: list[str],
    on_bytes: Callable[[int], None] | None,
) -> int:
    """(rank 0) Receive ahead into the slots, write its own pieces from its tensors, round by round;
    returns the first failing rank (world: none)."""
    writer = _Writer(outputs.fds, len(staging.slots), faults)
    pending: collections.deque[tuple[Any, Piece, int]] = collections.deque()

    def complete_oldest() -> None:
        work, piece, slot = pending.popleft()
        work.wait()
        item, host = plan.items[piece.index], staging.slots[slot][: piece.nbytes]
        if staging.device:
            faults.run(host.copy_, staging.device[slot][: piece.nbytes])
        writer.put(item, piece.start, host_bytes(host), slot)

    def take() -> int:
        while writer.free.empty() and pending:
            complete_oldest()
        return writer.free.get()

    def own(piece: Piece, source: torch.Tensor, item: SaveItem) -> None:
        wire = DTYPES[item.dtype]
        values = source[_elements(piece, wire)]
        if values.dtype == wire and values.device.type == "cpu" and values.is_contiguous():
            data = host_bytes(values.view(torch.uint8))
            writer.put(item, piece.start, data, None, keep=values)
            return
        slot = take()
        buffer = staging.slots[slot][: piece.nbytes]
        faults.run(buffer.view(wire).copy_, values)
        writer.put(item, piece.start, host_bytes(buffer), slot)

    try:
        begin = 0
        for stop in plan.rounds:
            for index in range(begin, stop):
                item = plan.items[index]
                if item.kind is SaveKind.GATHER:
                    while pending:
                        complete_oldest()
                source = _source(item, tensors[item.key], gathered)
                for piece in pieces(plan, index):
                    if piece.src == 0:
                        own(piece, source, item)
                    else:
                        slot = take()
                        into = (staging.device or staging.slots)[slot][: piece.nbytes]
                        pending.append((dist.irecv(into, src=piece.src), piece, slot))
                    if on_bytes is not None:
                        on_bytes(piece.nbytes)
            begin = stop
            while pending:
                complete_oldest()
            writer.jobs.join()
            first = _distribute.first_failure(faults.error)
            if first < dist.get_world_size():
                return first
        return dist.get_world_size()
    finally:
        writer.close()


def _sender(
    plan: SavePlan,
    tensors: dict[str, torch.Tensor],
    staging: Staging,
    faults: _distribute.Faults,
    gathered: list[str],
) -> int:
    """(ranks other than 0) Send this rank's pieces, cast into a staging slot when the saved dtype
    differs, with up to ``SLOTS`` sends in flight; returns the first failing rank (world: none)."""
    me = dist.get_rank()
    free = collections.deque(range(len(staging.slots)))
    pending: collections.deque[tuple[Any, int | None]] = collections.deque()

    def complete_oldest() -> None:
        work, slot = pending.popleft()
        work.wait()
        if slot is not None:
            free.append(slot)

    begin = 0
    for stop in plan.rounds:
        for index in range(begin, stop):
            item = plan.items[index]
            if item.kind is SaveKind.GATHER:
                while pending:
                    complete_oldest()
            elif all(rank != me for rank, _, _ in item.senders):
                continue
            source = _source(item, tensors[item.key], gathered)
            wire = DTYPES[item.dtype]
            for piece in pieces(plan, index):
                if piece.src != me:
                    continue
                values = source[_elements(piece, wire)]
                slot: int | None = None
                if faults.error is None and values.dtype == wire and values.device == staging.slots[0].device:
                    data = values.view(torch.uint8)
                else:
                    while not free:
                        complete_oldest()
                    slot = free.popleft()
                    data = staging.slots[slot][: piece.nbytes]
                    faults.run(data.view(wire).copy_, values)
                pending.append((dist.isend(data, dst=0), slot))
                while len(pending) > len(staging.slots):
                    complete_oldest()
        begin = stop
        while pending:
            complete_oldest()
        first = _distribute.first_failure(faults.error)
        if first < dist.get_world_size():
            return first
    return dist.get_world_size()
