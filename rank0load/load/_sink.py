"""Where the tensor data lands on this rank (all ranks; no collectives): ``_transfer`` and
``_localread`` both deliver here, so neither imports the other."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from ..checkpoint._format import DTYPES
from ..checkpoint._fp8 import dequantize, dequantize_at, dequantize_stacked
from ..common import _distribute
from ..common._blocks import Part
from ..common._memory import reserve
from ..common._staging import SLOTS, AllOf, aligned
from ..errors import InternalError
from ..integrations._compat import local_tensor
from ..model._layout import global_indices, held_indices
from ._plan import Kind, Message, Piece, Plan, Route

_DEQUANTISE_STEP = 1 << 18  # float8 elements dequantised at once: 1 MiB of float32
_BLOCK_DEQUANTISE_STEP = 1 << 16  # ... in a block: about ten int64 index temporaries, 5 MiB in all
# on an accelerator (device temporaries, a dozen kernel launches a step): steps 64 times as large
_DEVICE_STEP_SHIFT = 6


@dataclass
class Arrival:
    """A message whose bytes are in memory on this rank, from whichever source (``_transfer``)."""

    message: Message
    data: torch.Tensor  # its bytes: uint8, message.nbytes (a BLOCK chunk's: its rows from ``first_row``)
    slot: int | None = None  # the staging slot (or ring token) to give back; None: nothing to give back
    in_target: bool = False  # the bytes were read or received straight into their target
    pack_buffer: torch.Tensor | None = None  # a FAN_OUT chunk's: where its non-contiguous blocks are packed
    first_row: int = 0  # a FAN_OUT chunk read from this row of it on (a local reader: its own rows)


@dataclass
class Staging:
    """Every staging buffer of one rank, allocated before the stream."""

    slots: list[torch.Tensor]  # host (rank 0) or mesh-device (other ranks) buffers
    device_buffer: torch.Tensor | None  # rank 0, accelerator mesh: its one device buffer
    host: torch.Tensor | None = None  # rank 0, accelerator mesh: the pinned ring ``slots`` are views of


def allocate_staging(piece_bytes: int, mesh_device: torch.device, max_staging_bytes: int) -> Staging:
    """(all ranks, before the last agreement, so that no allocation inside the stream can leave a rank
    unable to take part) Reserve every staging buffer (no page touched: RSS grows only with use)."""
    if dist.get_rank() != 0 or mesh_device.type == "cpu":
        return Staging(reserve(SLOTS, piece_bytes, mesh_device, max_staging_bytes), None)
    # rank 0 of an accelerator mesh: one pinned ring (_readahead._Ring) and the device buffer
    host = reserve(1, SLOTS * piece_bytes, torch.device("cpu"), max_staging_bytes, pin=True)[0]
    device = reserve(1, piece_bytes, mesh_device, max_staging_bytes)[0]
    return Staging(list(host.split(piece_bytes)), device, host)


class _Assembly:
    """A full-size buffer filled piece by piece, one entry at a time (GENERIC bytes, float8 scale grids)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = -1
        self.buffer: torch.Tensor | None = None

    def land(self, piece: Piece, nbytes: int) -> torch.Tensor:
        if piece.index != self.index:
            self.index, self.buffer = piece.index, None
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        assert self.buffer is not None
        return self.buffer[piece.start : piece.start + piece.nbytes]


class Sink:
    """(all ranks) This rank's local work on arriving bytes: cast or dequantise them into the target,
    assemble float8 scale grids and GENERIC entries (cut with ``src_data_rank=None``: no communication).
    Failures are noted in :attr:`faults`, not raised; after the first it does nothing more."""

    def __init__(self, plan: Plan, params: list[torch.Tensor], device: torch.device) -> None:
        self.plan, self.entries, self.params = plan, plan.entries, params  # the model's, by entry
        # where each entry lands on this rank: a DTensor's local shard, or the plain tensor's data
        self.targets = [local_tensor(t) if isinstance(t, DTensor) else t.data for t in params]
        self.wires = [DTYPES[e.dtype] for e in plan.entries]
        self.device = device
        self.me = dist.get_rank()
        self._held: tuple[int, list[torch.Tensor]] = (-1, [])  # (entry, its held_indices on this rank)
        self.faults = _distribute.Faults()
        self.whole = _Assembly(device)
        self.scales = _Assembly(device)

    def converts(self, message: Message) -> bool:
        """Whether some piece of ``message`` is cast or dequantised on its way into its target."""
        return any(
            self.entries[p.index].scales or self.targets[p.index].dtype != self.wires[p.index]
            for p in message.pieces
            if p.route is not Route.SCALES
        )

    def take(
        self, message: Message, data: torch.Tensor, in_target: bool = False, non_blocking: bool = False
    ) -> None:
        """(all ranks) The local work of every piece of ``message``, its bytes in ``data`` (``in_target``:
        already in the target, so a point-to-point piece needs nothing; ``non_blocking``: :meth:`write`)."""
        parts = list(message.parts())
        i = 0
        while i < len(parts):
            pairs = 0 if in_target or len(parts) == 1 else self._same_pairs(parts, i)
            if pairs:
                self.faults.run(self._dequantize_pairs, parts[i : i + 2 * pairs], data)
                i += 2 * pairs
                continue
            piece, at = parts[i]
            if not (in_target and piece.route is Route.TO_RANK):
                self.broadcast(piece, data[at : at + piece.nbytes], in_target, non_blocking)
            i += 1

    def pair_key(self, scales: Piece, rows: Piece) -> tuple[object, ...] | None:
        """The key under which a float8 entry's scale grid rows and rows are dequantised together with
        other pairs (:meth:`runs`); None unless it is a 2-D one-part SHARDED entry of whole-block columns,
        ``rows`` this rank's whole CPU shard (floating dtype), ``scales`` exactly the grid rows they need."""
        if scales.route is not Route.SCALES or rows.route is not Route.TO_RANK or scales.index != rows.index:
            return None
        entry, target = self.entries[rows.index], self.targets[rows.index]
        if (
            rows.kind is not Kind.SHARDED
            or not entry.scales
            or len(entry.shape) != 2
            or len(entry.part_rows) != 1
        ):
            return None
        cols, (bm, bn), wire = entry.shape[1], entry.block, self.wires[rows.index]
        row = cols * wire.itemsize
        if cols % bn or target.device.type != "cpu" or not target.is_contiguous() or rows.local_offset:
            return None
        if (
            not target.is_floating_point()
            or rows.nbytes != target.numel() * wire.itemsize
            or rows.start % row
        ):
            return None
        lo, k = rows.start // row, rows.nbytes // row
        grid_row = cols // bn * 4  # float32 scales
        if scales.start != lo // bm * grid_row or scales.nbytes != (-(-(lo + k) // bm) - lo // bm) * grid_row:
            return None
        return entry.shape, entry.block, wire, target.dtype, lo, k

    def runs(self, pieces: Iterable[Piece], limit: int) -> Iterator[Piece | Message]:
        """``pieces`` (this rank's view, in order), consecutive float8 pairs of one :meth:`pair_key`
        joined into a :class:`Message` (``Message.packed``'s layout) of at most ``limit`` bytes, for
        :meth:`take` to dequantise at once (a lone pair: a message of two); other pieces as they come."""
        run: list[Piece] = []
        key: tuple[object, ...] | None = None
        size = 0
        held: Piece | None = None  # a SCALES piece, until the next piece says whether it pairs

        def flush() -> Iterator[Message]:
            nonlocal run, key, size
            if run:
                yield Message.packed(run)
            run, key, size = [], None, 0

        for piece in pieces:
            if piece.dst not in (-1, self.me):  # another rank's (rank 0 sees them all): read by no one here
                yield piece
                continue
            if held is not None:
                pair, held = (held, piece), None
                got = self.pair_key(*pair)
                if got is not None:
                    nbytes = aligned(pair[0].nbytes) + aligned(pair[1].nbytes)
                    if got != key or size + nbytes > limit:
                        yield from flush()
                    run.extend(pair)
                    key, size = got, size + nbytes
                    continue
                yield from flush()
                yield pair[0]
            if piece.route is Route.SCALES and self.entries[piece.index].scales:
                held = piece
                continue
            yield from flush()
            yield piece
        yield from flush()
        if held is not None:
            yield held

    def _same_pairs(self, parts: list[tuple[Piece, int]], i: int) -> int:
        """How many scales-and-rows pairs of one :meth:`pair_key`, equally spaced, start at ``parts[i]``
        (0: none, or one alone in a message of many pieces, which goes the usual way)."""
        if i + 1 >= len(parts):
            return 0
        key = self.pair_key(parts[i][0], parts[i + 1][0])
        if key is None:
            return 0
        step = parts[i + 2][1] - parts[i][1] if i + 3 < len(parts) else 0
        n = 1
        while i + 2 * n + 1 < len(parts):
            (s, at), (r, rat) = parts[i + 2 * n], parts[i + 2 * n + 1]
            if at - parts[i][1] != n * step or rat - at != parts[i + 1][1] - parts[i][1]:
                break
            if self.pair_key(s, r) != key:
                break
            n += 1
        return n if n > 1 or len(parts) == 2 else 0

    def _dequantize_pairs(self, parts: list[tuple[Piece, int]], data: torch.Tensor) -> None:
        """Equally spaced pairs of one :meth:`pair_key` in ``data``, dequantised together in steps of
        ``_DEQUANTISE_STEP`` elements, each cast once into its shard (the rounding it gets alone)."""
        (scales, s_at), (rows, r_at) = parts[0], parts[1]
        n = len(parts) // 2
        step = parts[2][1] - s_at if n > 1 else 0
        entry, wire = self.entries[rows.index], self.wires[rows.index]
        cols = entry.shape[1]
        k = rows.nbytes // (cols * wire.itemsize)
        values = data.as_strided((n, rows.nbytes), (step, 1), data.storage_offset() + r_at)
        values = values.view(wire).view(n, k, cols)
        grids = data.as_strided((n, scales.nbytes), (step, 1), data.storage_offset() + s_at)
        grids = grids.view(torch.float32).view(n, -1, cols // entry.block[1])
        lo = rows.start // (cols * wire.itemsize)
        per = max(1, _DEQUANTISE_STEP // (k * cols))
        for at in range(0, n, per):
            out = dequantize_stacked(values[at : at + per], grids[at : at + per], lo, entry.block)
            for j, (piece, _) in enumerate(parts[2 * at + 1 : 2 * (at + per) : 2]):
                self.targets[piece.index].view(k, cols).copy_(out[j])

    def direct_view(self, piece: Piece, on: torch.device | None = None) -> torch.Tensor | None:
        """Where ``piece`` can land without staging; None: stage it. Nothing after this rank's
        failure; a float8 scale grid or a GENERIC entry's piece into its full-size buffer; any other
        into its target's own bytes, if of the wire dtype, contiguous and on ``on`` (default: the
        mesh device)."""
        if self.faults.error is not None:
            return None
        entry, t = self.entries[piece.index], self.targets[piece.index]
        try:
            if piece.route is Route.SCALES:
                return self.scales.land(piece, entry.scales.nbytes)
            if piece.kind is Kind.GENERIC:
                return self.whole.land(piece, entry.nbytes)  # the full-size buffer may not fit
        except Exception as exc:
            self.faults.note(exc)
            return None
        if t.device != (on or self.device) or t.dtype != self.wires[piece.index] or not t.is_contiguous():
            return None
        return t.reshape(-1).view(torch.uint8)[piece.local_offset : piece.local_offset + piece.nbytes]

    def broadcast(self, piece: Piece, data: torch.Tensor, in_target: bool, non_blocking: bool) -> None:
        """(all ranks) The local work of a broadcast piece (``in_target``, ``non_blocking``: :meth:`take`)."""
        entry = self.entries[piece.index]
        if piece.route is Route.SCALES or piece.kind is Kind.GENERIC:
            into = self.scales if piece.route is Route.SCALES else self.whole
            size = entry.scales.nbytes if piece.route is Route.SCALES else entry.nbytes
            if not in_target:
                self.faults.run(lambda: into.land(piece, size).copy_(data, non_blocking=non_blocking))
            if piece.route is not Route.SCALES and piece.start + piece.nbytes == entry.nbytes:
                self.faults.run(self._cut_whole, piece.index)
            return
        self.faults.run(self.write, piece, data, piece.local_offset, non_blocking)

    def write(self, piece: Piece, data: torch.Tensor, local_offset: int, non_blocking: bool = False) -> None:
        """Wire bytes ``data`` (entry bytes from ``piece.start``) into the target at ``local_offset``.
        ``non_blocking`` (rank 0's pinned slots into device shards): a plain copy is only queued on the
        current stream; the caller keeps ``data`` unchanged until an event recorded after it completes.
        Raises; callers run it through :attr:`faults`."""
        wire, dst = self.wires[piece.index], self.targets[piece.index]
        if not dst.is_contiguous():
            raise InternalError("internal error: a write into a non-contiguous tensor")  # ensured by _model
        start, values = local_offset // wire.itemsize, data.view(wire)
        flat = dst.view(-1)
        if not self.entries[piece.index].scales:
            flat[start : start + values.numel()].copy_(values, non_blocking=non_blocking)
            return
        block = piece.kind is Kind.BLOCK  # this rank's block: not one run of the entry's elements
        first = start if block else piece.start // wire.itemsize  # _decode's: a block's is in the shard
        step = _BLOCK_DEQUANTISE_STEP if block else _DEQUANTISE_STEP
        if dst.device.type != "cpu":
            step <<= _DEVICE_STEP_SHIFT
        in_place = dst.device == values.device and not block  # the products written straight into the shard
        for at in range(0, values.numel(), step):  # float32 temporaries of one step at a time
            some = values[at : at + step]
            into = flat[start + at : start + at + some.numel()]
            decoded = self._decode(piece.index, some, first + at, into if in_place else None)
            if not in_place:
                into.copy_(decoded)

    def _decode(
        self, index: int, values: torch.Tensor, first: int, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Entry ``index``'s wire values of elements ``first ..``; float8 ones dequantised (into
        ``into``); a BLOCK entry's from element ``first`` of this rank's block on, by global position
        (never into ``into``)."""
        entry = self.entries[index]
        if not entry.scales:
            return values
        if self.scales.index != index or self.scales.buffer is None:
            raise InternalError(f"internal error: the scales of {entry.key!r} did not arrive first")
        grids = self.scales.buffer.view(torch.float32)
        if self.plan.kinds[index] is not Kind.BLOCK:
            return dequantize(values, first, list(entry.part_rows), entry.shape[-1], entry.block, grids, into)
        if self._held[0] != index:  # once per entry, not per step
            self._held = (index, held_indices(self.plan.block_of(index, self.me)))
        flat = global_indices(self._held[1], entry.shape, first, values.numel()).to(values.device)
        return dequantize_at(values, flat, list(entry.part_rows), entry.shape[-1], entry.block, grids)

    def _cut_whole(self, index: int) -> None:
        dt = self.params[index]
        if not isinstance(dt, DTensor) or self.whole.buffer is None:
            raise InternalError("internal error: GENERIC entry without a DTensor target")
        value = self._decode(index, self.whole.buffer.view(self.wires[index]), 0)
        value = value.reshape(dt.shape).to(dtype=dt.dtype)
        local = distribute_tensor(value, dt.device_mesh, dt.placements, src_data_rank=None).to_local()
        self.targets[index].copy_(local)
        self.whole.buffer = None


def cut(rows: torch.Tensor, part: Part, first_row: int = 0) -> torch.Tensor:
    """``part``'s block of a chunk whose rows from ``first_row`` on are ``rows``: a view where the
    rank's indices on each dimension are one run, a copy where they are several."""
    block = rows[part.rows[0] - first_row : part.rows[1] - first_row]
    for dim, dim_runs in enumerate(part.inner, start=1):
        if dim_runs == ((0, rows.shape[dim]),):
            continue
        pieces = [block.narrow(dim, a, b - a) for a, b in dim_runs]
        block = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
    return block


def fan_out(
    piece: Piece, data: torch.Tensor, pack_buffer: torch.Tensor, sink: Sink, first_row: int = 0
) -> AllOf:
    """(rank 0, or a local reader for its own parts) Cut the FAN_OUT ``piece``'s chunk (whole rows, in
    ``data`` from row ``first_row`` on) into ``piece.parts``, in order: its own written into its shard,
    the others sent (returned: the sends). Non-contiguous blocks are packed into ``pack_buffer``, one
    copy per distinct block, never more than the chunk. After a failure the parts still go out (scratch)."""
    wire, chunk = sink.wires[piece.index], piece.chunk
    assert chunk is not None  # every FAN_OUT piece has its chunk
    made: dict[tuple[Any, ...], torch.Tensor] = {}
    works: list[Any] = []
    keep: list[torch.Tensor] = []
    used = 0
    for part in piece.parts:
        payload: torch.Tensor | None = None
        if sink.faults.error is None:
            try:
                key = (part.rows, part.inner)
                block = made.get(key)
                if block is None:
                    block = cut(data.view(wire).view(-1, *chunk.shape[1:]), part, first_row)
                    if not block.is_contiguous():
                        packed = pack_buffer[used : used + part.nbytes].view(wire).view(block.shape)
                        packed.copy_(block)
                        used += part.nbytes
                        block = packed
                    made[key] = block
                payload = block.reshape(-1).view(torch.uint8)
            except Exception as exc:
                sink.faults.note(exc)
        if part.rank == sink.me:
            if payload is not None:
                sink.faults.run(sink.write, piece, payload, part.local_offset)
            continue
        if payload is None:
            payload = data[: part.nbytes]  # scratch: the receiver discards it
        works.append(dist.isend(payload, dst=part.rank))
        keep.append(payload)
    return AllOf(works, keep)
