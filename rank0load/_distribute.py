"""Every collective rank0load issues lives here.

Order of calls, identical on every rank (see ``_api.load_sharded``):

1. (all ranks) :func:`agree` — all-gather each rank's build/shard outcome and model fingerprint;
   any failure or disagreement raises the same :class:`RankMismatchError` everywhere.
2. (all ranks) :func:`share` — rank 0 broadcasts the manifest or the LoadError it hit; every rank
   returns the manifest or raises that error. Nothing moves tensor data before this returns.
3. (all ranks) :func:`stream` — rank 0 sends, the others receive, piece by piece in manifest order;
   then rank 0 broadcasts whether every read succeeded (a read error raises on every rank).
"""

from __future__ import annotations

import collections
import logging
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from ._compat import host_bytes
from ._format import DTYPES
from ._manifest import Entry
from ._plan import BLOCK, BROADCAST, FAN_OUT, GENERIC, Piece, Runs, block_half, cut, deliveries, row_bytes
from ._stream import Reader
from .errors import LoadError, RankMismatchError

__all__ = ["agree", "agree_outcome", "share", "stream", "Target"]

logger = logging.getLogger(__name__)


def peer_failure(what: str, exc: BaseException) -> LoadError:
    """The LoadError for a collective that failed: a peer died (connection reset) or stalled (timeout)."""
    return LoadError(
        f"rank {dist.get_rank()}: {what} failed ({type(exc).__name__}: {exc}). Another rank probably "
        "died or stalled (see its log); the wait is bounded by the process-group timeout "
        "(dist.init_process_group(timeout=...)). No model was returned; fix the cause and load again."
    )


# Python objects travel pickled in uint8 tensors. torch's all_gather_object / broadcast_object_list
# decode with tensor.numpy(), and neither torch nor rank0load requires numpy.


def _object_device() -> torch.device:
    """Where the default group's collectives take tensors: the host for gloo (also when gloo serves
    CPU tensors beside NCCL), else this rank's current accelerator."""
    if "gloo" in str(dist.get_backend()):
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _encode(obj: object, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _decode(t: torch.Tensor, nbytes: int) -> Any:
    return pickle.loads(host_bytes(t[:nbytes].cpu().contiguous()))


def _all_gather_objects(obj: object) -> list[Any]:
    device = _object_device()
    payload = _encode(obj, device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    counts = [int(n.item()) for n in sizes]
    padded = torch.zeros(max(counts), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    received = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(received, padded)
    return [_decode(t, n) for t, n in zip(received, counts)]


def _broadcast_object(obj: object) -> Any:
    device = _object_device()
    payload = _encode(obj, device) if dist.get_rank() == 0 else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=0)
    return _decode(payload, payload.numel())


def _gather(obj: object) -> list[Any]:
    try:
        return _all_gather_objects(obj)
    except RuntimeError as exc:
        raise peer_failure("agreeing with the other ranks", exc) from exc


def agree(status: tuple[Any, ...], stage: str = "building or sharding the model") -> list[tuple[Any, ...]]:
    """(all ranks) All-gather ``("ok", fingerprint, extra)`` or ``("error", message)``; raise on any
    error or if the fingerprints differ (``extra`` is returned for the caller to reconcile)."""
    gathered = _gather(status)
    failed = [(rank, s[1]) for rank, s in enumerate(gathered) if s[0] != "ok"]
    if failed:
        detail = "; ".join(f"rank {rank}: {msg}" for rank, msg in failed[:4])
        more = f" and {len(failed) - 4} more ranks" if len(failed) > 4 else ""
        raise RankMismatchError(
            f"{stage} failed on {len(failed)} of {len(gathered)} ranks: "
            f"{detail}{more}. No data was moved; fix model_fn / shard_fn and retry."
        )
    reference = gathered[0][1]
    differ = [rank for rank, s in enumerate(gathered) if s[1] != reference]
    if differ:
        raise RankMismatchError(
            f"ranks {differ} built a different model from rank 0 (parameter names, shapes, dtypes "
            "or sharding differ). model_fn must build the same model on every rank."
        )
    return gathered


def agree_outcome(error: BaseException | None, stage: str) -> None:
    """(all ranks) All-gather each rank's error (or None); if any rank failed, every rank raises the
    same error: the first failing rank's, keeping its LoadError subclass (RankMismatchError otherwise)."""
    mine = None
    if error is not None:
        cls = type(error) if isinstance(error, LoadError) else RankMismatchError
        what = str(error) if isinstance(error, LoadError) else f"{type(error).__name__}: {error}"
        mine = (cls, what)
    gathered = _gather(mine)
    failed = [(rank, g) for rank, g in enumerate(gathered) if g is not None]
    if failed:
        first_rank, (cls, what) = failed[0]
        ranks = [rank for rank, _ in failed]
        raise cls(
            f"{stage} failed on {len(ranks)} of {len(gathered)} ranks {ranks[:8]}; rank {first_rank}: {what}. "
            "No data was moved; fix the cause and load again."
        )


def share(result: object | LoadError | None) -> Any:
    """(all ranks) Rank 0 passes the manifest or its LoadError; every rank gets it or raises it."""
    try:
        value = _broadcast_object(result if dist.get_rank() == 0 else None)
    except RuntimeError as exc:
        raise peer_failure("receiving rank 0's manifest or result", exc) from exc
    if isinstance(value, LoadError):
        raise type(value)(*value.args)
    return value


@dataclass
class Target:
    """Where one entry lands on this rank."""

    tensor: torch.Tensor  # the local tensor (DTensor's local shard, or the plain tensor)
    dtensor: DTensor | None  # the parameter, for GENERIC entries


def _flat_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """A uint8 view of a contiguous tensor's storage, or None if it is not contiguous."""
    if not t.is_contiguous():
        return None
    return t.reshape(-1).view(torch.uint8)


def _cast_into(dst: torch.Tensor, piece: Piece, data: torch.Tensor, wire: torch.dtype) -> None:
    """Copy wire bytes ``data`` (piece of a flat tensor) into ``dst``'s matching elements."""
    size = wire.itemsize
    start = piece.local_offset // size
    values = data.view(wire)
    flat = dst.view(-1) if dst.is_contiguous() else None
    if flat is None:
        raise LoadError("internal error: cast into a non-contiguous tensor")  # contiguity is ensured in _api
    flat[start : start + values.numel()].copy_(values)


def stream(
    entries: Sequence[Entry],
    runs: Sequence[dict[int, Runs] | None],
    pieces: Callable[[], Any],
    targets: Sequence[Target],
    mesh: DeviceMesh,
    *,
    piece_bytes: int,
    slots: int,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """(all ranks) Move every piece to its destination. Rank 0 reads and sends; others receive."""
    wires = [DTYPES[e.dtype] for e in entries]
    failed: LoadError | None = None
    if dist.get_rank() == 0:
        failed = _send(
            entries,
            runs,
            pieces(),
            targets,
            wires,
            mesh,
            piece_bytes=piece_bytes,
            slots=slots,
            on_bytes=on_bytes,
        )
    else:
        _receive(pieces(), targets, wires, mesh, piece_bytes=piece_bytes, slots=slots)
    # Rank 0's read error (I/O error, file changed under us) reaches every rank; the ranks stayed
    # in step because the reader kept sending unread bytes after the error.
    share(failed)


def _comm_device(mesh: DeviceMesh) -> torch.device:
    """Where the collectives' buffers live: the mesh's device (this rank's current accelerator)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())


def _landing(target: Target, piece: Piece, wire: torch.dtype) -> torch.Tensor | None:
    """Where a piece can land without staging: the target's own bytes (same dtype, contiguous)."""
    t = target.tensor
    if t.dtype != wire:
        return None
    flat = _flat_bytes(t)
    if flat is None:
        return None
    return flat[piece.local_offset : piece.local_offset + piece.nbytes]


def _generic(target: Target, full: torch.Tensor | None, mesh: DeviceMesh, wire: torch.dtype) -> None:
    """(all ranks) A GENERIC entry: rank 0 broadcasts the full tensor (wire bytes), then every rank
    cuts its own shard with DTensor's own split (``distribute_tensor(..., src_data_rank=None)``: no
    communication) on the parameter's own mesh and placements.

    ``distribute_tensor(..., src_data_rank=0)`` would scatter instead, but it refuses uneven
    ``_StridedShard`` (FSDP2 on top of colwise TP) and, on a sub-mesh, reaches only the sub-mesh
    instance holding rank 0. Cutting locally is exact for every placement DTensor supports; the
    price is the full tensor on every rank, for this one tensor.
    """
    dt = target.dtensor
    if dt is None:
        raise LoadError("internal error: GENERIC entry without a DTensor target")
    device = _comm_device(mesh)
    nbytes = dt.numel() * wire.itemsize
    if full is None:
        full = torch.empty(nbytes, dtype=torch.uint8, device=device)
    elif full.device != device:
        full = full.to(device)
    dist.broadcast(full, src=0)
    value = full.view(wire).reshape(dt.shape).to(dtype=dt.dtype)
    local = distribute_tensor(value, dt.device_mesh, dt.placements, src_data_rank=None).to_local()
    target.tensor.copy_(local)


class _All:
    """Several sends, waited for together (and the tensors they send, kept alive until then)."""

    def __init__(self, works: list[Any], keep: list[torch.Tensor]) -> None:
        self._works, self._keep = works, keep

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._keep.clear()


def _fan_out(
    piece: Piece,
    data: torch.Tensor,
    spare: torch.Tensor,
    entry: Entry,
    per_rank: dict[int, Runs],
    target: Target,
    wire: torch.dtype,
) -> _All:
    """(rank 0) Cut a BLOCK chunk (whole rows, in ``data``) into every rank's block: rank 0's own is
    copied into its shard, the others are sent. A block that is not a contiguous part of the chunk is
    packed into ``spare`` (the rest of the staging slot); ranks holding the same block (replicas)
    share one copy, so the packed blocks never exceed the chunk."""
    me = dist.get_rank()
    chunk = data.view(wire).view(piece.nbytes // row_bytes(entry), *entry.shape[1:])
    made: dict[tuple[Any, ...], torch.Tensor] = {}
    works: list[Any] = []
    keep: list[torch.Tensor] = []
    used = 0
    for d in deliveries(piece, entry, per_rank):
        key = (d.row_lo, d.row_hi, d.inner)
        block = made.get(key)
        if block is None:
            block = cut(chunk, d)
            if not block.is_contiguous():
                packed = spare[used : used + d.nbytes].view(wire).view(block.shape)
                packed.copy_(block)
                used += d.nbytes
                block = packed
            made[key] = block
        payload = block.reshape(-1).view(torch.uint8)
        if d.dst == me:
            _cast_into(
                target.tensor, Piece(piece.index, me, 0, d.nbytes, d.local_offset, BLOCK), payload, wire
            )
        else:
            works.append(dist.isend(payload, dst=d.dst))
            keep.append(payload)
    return _All(works, keep)


def _send(entries, runs, pieces, targets, wires, mesh, *, piece_bytes, slots, on_bytes) -> LoadError | None:
    me = dist.get_rank()
    comm = _comm_device(mesh)
    on_cpu = comm.type == "cpu"
    files = [e.file for e in entries]

    def direct(piece: Piece) -> torch.Tensor | None:
        if piece.kind == GENERIC:
            return torch.empty(piece.nbytes, dtype=torch.uint8)
        device = targets[piece.index].tensor.device
        # Straight from the file into a host tensor: rank 0's own rows (CPU-offloaded ones too), or
        # a broadcast's source when the collectives run on the host.
        if device.type == "cpu" and (piece.dst == me or (piece.dst == BROADCAST and on_cpu)):
            return _landing(targets[piece.index], piece, wires[piece.index])
        return None

    reader = Reader(pieces, files, direct, slots=max(2, slots), piece_bytes=piece_bytes, pin=not on_cpu)
    pending: collections.deque[tuple[Any, int | None]] = collections.deque()
    device_staging: torch.Tensor | None = None
    try:
        for staged in reader:
            piece, data = staged.piece, staged.data
            target = targets[piece.index]
            wire = wires[piece.index]
            if piece.kind == GENERIC:
                _generic(target, data, mesh, wire)
            elif piece.dst == FAN_OUT:
                assert staged.slot is not None  # a chunk is always read into a staging slot
                if on_cpu:  # cut into the rest of the slot
                    spare = reader.buffer(staged.slot)[block_half(piece_bytes) :]
                else:  # cut on the device, where the collectives run (the blocks never exceed the chunk)
                    data = data.to(comm)
                    spare = torch.empty_like(data)
                blocks = _fan_out(piece, data, spare, entries[piece.index], runs[piece.index], target, wire)
                pending.append((blocks, staged.slot))
                staged = None  # type: ignore[assignment]
            elif piece.dst == me:
                if staged.slot is not None:
                    _cast_into(target.tensor, piece, data.to(target.tensor.device), wire)
            elif piece.dst == BROADCAST:
                if staged.slot is None:
                    dist.broadcast(data, src=me)
                else:
                    payload = data if on_cpu else data.to(comm)
                    dist.broadcast(payload, src=me)
                    _cast_into(target.tensor, piece, payload, wire)
            else:
                payload = data
                if not on_cpu:
                    if device_staging is None:
                        device_staging = torch.empty(piece_bytes, dtype=torch.uint8, device=comm)
                    payload = device_staging[: piece.nbytes]
                    payload.copy_(data)
                    dist.send(payload, dst=piece.dst)  # the device buffer is reused: send synchronously
                else:
                    pending.append((dist.isend(payload, dst=piece.dst), staged.slot))
                    staged = None  # type: ignore[assignment]
            if staged is not None:
                reader.release(staged.slot)
            while len(pending) >= max(1, slots - 1):
                work, slot = pending.popleft()
                work.wait()
                reader.release(slot)
            if on_bytes is not None:
                on_bytes(piece.nbytes)
        while pending:
            work, slot = pending.popleft()
            work.wait()
            reader.release(slot)
        return reader.failed
    finally:
        reader.close()


def _receive(pieces, targets, wires, mesh, *, piece_bytes, slots) -> None:
    """(ranks other than 0) Post up to ``slots`` receives ahead, straight into the local shard
    when the wire dtype is the target's; otherwise into a staging slot, then cast."""
    me = dist.get_rank()
    comm = _comm_device(mesh)
    buffers: dict[int, torch.Tensor] = {}
    free = collections.deque(range(max(1, slots)))
    pending: collections.deque[tuple[Any, Piece, int | None, torch.Tensor | None]] = collections.deque()

    def complete_oldest() -> None:
        work, piece, slot, stage = pending.popleft()
        work.wait()
        if stage is not None and slot is not None:
            _cast_into(targets[piece.index].tensor, piece, stage, wires[piece.index])
            free.append(slot)

    for piece in pieces:
        if piece.dst not in (me, BROADCAST):
            continue
        target, wire = targets[piece.index], wires[piece.index]
        if piece.dst == BROADCAST:
            while pending:
                complete_oldest()
            if piece.kind == GENERIC:
                _generic(target, None, mesh, wire)
                continue
        # Straight into the target only where the collectives run (not into CPU-offloaded shards of a
        # CUDA mesh: those are staged on the device, then copied).
        view = _landing(target, piece, wire) if target.tensor.device == comm else None
        slot: int | None = None
        stage: torch.Tensor | None = None
        if view is None:
            while not free:
                complete_oldest()
            slot = free.popleft()
            if slot not in buffers:
                buffers[slot] = torch.empty(piece_bytes, dtype=torch.uint8, device=comm)
            stage = buffers[slot][: piece.nbytes]
        into = view if view is not None else stage
        assert into is not None  # one of the two is set just above
        if piece.dst == BROADCAST:
            dist.broadcast(into, src=0)
            if stage is not None and slot is not None:
                _cast_into(target.tensor, piece, stage, wire)
                free.append(slot)
            continue
        pending.append((dist.irecv(into, src=0), piece, slot, stage))
        while len(pending) > max(1, slots):
            complete_oldest()
    while pending:
        complete_oldest()
