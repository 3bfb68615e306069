"""The file plan of a save: what rank 0 decides (:func:`plan_save`) and broadcasts before any byte
moves; every rank derives the same messages from it (:meth:`SavePlan.pieces`). No collectives here."""

from __future__ import annotations

import contextlib
import enum
import itertools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..checkpoint._format import DTYPES
from ..common._blocks import Blocks, Chunk, Part, block_chunks
from ..common._distribute import round_ends
from ..common._staging import ROUND_PIECES, block_half, slot_bytes
from ..errors import SaveError
from ..model._layout import ROWS_OK, RUNS_OK, rank_coordinates, rows_of, runs_at
from ..model._meta import strip_wrappers

_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# a saved name and shape -> the names and shapes it is saved as (equal byte ranges, in order)
Revert = Callable[[str, tuple[int, ...]], list[tuple[str, tuple[int, ...]]]]
_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # huggingface_hub's parse_size_to_int


class SaveKind(enum.Enum):
    """How one saved tensor reaches rank 0's file."""

    ROWS = "rows"  # a DTensor of Shard(0)/Replicate: each row range sent once by the rank holding it
    BLOCK = "block"  # Shard(d)/_StridedShard/Replicate: chunks of rows, each rank sending its block
    PLAIN = "plain"  # a plain tensor (buffer, unsharded parameter): rank 0 writes its own copy
    GATHER = "gather"  # any other DTensor (Partial, a non-contiguous shard, 0-d): full_tensor() everywhere


_Senders = tuple[tuple[int, int, int], ...]  # ROWS: (rank, first byte, end byte), by first row
# one saved tensor before the split: (its item's index, name, shape, first byte in the item, nbytes)
_Unit = tuple[int, str, tuple[int, ...], int, int]


@dataclass(frozen=True)
class Saved:
    """One tensor of the saved files: bytes [start, start + nbytes) of its item, row-major."""

    name: str  # the saved name
    file: int  # index into SavePlan.files
    offset: int  # absolute offset of its first byte in that file
    start: int  # byte offset within the item
    nbytes: int


@dataclass(frozen=True)
class SaveItem:
    """One model tensor and the saved tensors its bytes become: one, or with ``original_format``
    a fused MoE parameter's per-expert tensors, each a contiguous byte range of it."""

    key: str  # the canonical model key every rank reads it from
    dtype: str  # the safetensors dtype it is saved in
    shape: tuple[int, ...]  # the model tensor's
    nbytes: int
    kind: SaveKind
    senders: _Senders  # ROWS: (rank, first byte, end byte) of each sender's rows, by first row
    saved: tuple[Saved, ...]  # by start; their byte ranges tile [0, nbytes)
    # BLOCK: (rank, its global index runs per dimension), one replica per Replicate mesh dimension
    blocks: Blocks


@dataclass(frozen=True)
class Piece:
    """One message: bytes [start, start + nbytes) of an item, sent by rank ``src``; for a BLOCK
    item, the sender's block of the chunk that starts at ``start`` (see :meth:`SavePlan.chunks`)."""

    src: int  # 0: rank 0 writes it from its own tensor
    start: int  # byte offset within the item
    nbytes: int
    local_offset: int  # byte offset (wire dtype) in the sender's flat local tensor; contiguous there


@dataclass(frozen=True)
class SavePlan:
    """Rank 0's decision, broadcast to every rank: files, headers and items in write order."""

    files: tuple[str, ...]  # final file names in out_dir
    headers: tuple[bytes, ...]  # each file's first bytes: 8-byte length + JSON padded to 8
    items: tuple[SaveItem, ...]  # by their first saved tensor's file and offset
    rounds: tuple[int, ...]  # item index where each round ends (the failure check points)
    piece_bytes: int  # the largest message
    skipped: tuple[str, ...]  # model keys key_map dropped
    total_size: int  # the items' bytes

    def pieces(self, index: int, src: int | None = None) -> Iterator[Piece]:
        """(all ranks) Item ``index``'s messages in the order every rank uses (``src``: that rank's)."""
        item = self.items[index]
        if item.kind is SaveKind.BLOCK:
            for chunk, parts in self.chunks(index, src):
                yield from (Piece(p.rank, chunk.start, p.nbytes, p.local_offset) for p in parts)
            return
        ranges = item.senders if item.kind is SaveKind.ROWS else ((0, 0, item.nbytes),)
        for rank, begin, end in ranges:
            if src is None or rank == src:
                for at in range(begin, end, self.piece_bytes):
                    yield Piece(rank, at, min(self.piece_bytes, end - at), at - begin)

    def chunks(self, index: int, src: int | None = None) -> Iterator[tuple[Chunk, tuple[Part, ...]]]:
        """(all ranks) BLOCK item ``index``'s chunks and the senders' parts of each, by first row,
        then sender (``src``: only that rank's, in the same order), see ``common._blocks.block_chunks``."""
        item = self.items[index]
        blocks = item.blocks if src is None else [b for b in item.blocks if b[0] == src]
        return block_chunks(item.shape, DTYPES[item.dtype].itemsize, blocks, block_half(self.piece_bytes))


def parse_size(size: int | str) -> int:
    """``max_shard_size`` in bytes, parsed as huggingface_hub's ``parse_size_to_int`` does."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    text = size.strip() if isinstance(size, str) else ""
    if text[-2:].upper() in _UNITS:
        with contextlib.suppress(ValueError):  # not a number: the SaveError below
            value = int(float(text[:-2].strip()) * _UNITS[text[-2:].upper()])
            if value > 0:
                return value
    raise SaveError(f"max_shard_size={size!r} is not a positive number of bytes nor a size like '5GB'")


def plan_save(
    tensors: dict[str, torch.Tensor],
    flags: tuple[int, ...],
    key_map: Callable[[str], str | None] | None,
    options: dict[str, Any],
    revert: Revert | None,
    stem: str,
    metadata: dict[str, str] | None = None,
) -> SavePlan:
    """(rank 0) Names, dtypes, the split into files, the headers and the senders of every tensor.
    ``revert``: see :data:`Revert`. ``stem``: what the files' names start with. ``metadata``: more
    ``__metadata__`` entries for every file's header."""
    dtype: torch.dtype | None = options["dtype"]
    items: list[SaveItem] = []
    units: list[_Unit] = []
    skipped, seen = [], dict[str, str]()
    for (key, t), flag in zip(tensors.items(), flags):
        plain = strip_wrappers(key)
        name = key_map(plain) if key_map is not None else plain
        if name is None:
            skipped.append(plain)
            continue
        if not isinstance(name, str) or not name:
            raise SaveError(f"key_map({plain!r}) returned {name!r}; return a saved name or None")
        parts = revert(name, tuple(t.shape)) if revert is not None else [(name, tuple(t.shape))]
        for part, _ in parts:
            if part in seen:
                raise SaveError(f"{seen[part]!r} and {plain!r} would both be saved as {part!r}; fix key_map")
            seen[part] = plain
        wire = dtype if dtype is not None and t.dtype.is_floating_point and t.dtype.itemsize > 1 else t.dtype
        if wire not in _NAMES or wire == DTYPES.get("F4"):
            raise SaveError(f"{plain!r}: dtype {t.dtype} cannot be saved in safetensors")
        kind, senders, blocks = SaveKind.PLAIN, _Senders(), Blocks()
        if isinstance(t, DTensor):  # how it travels, by its layout flags AND-ed over the ranks
            kind = SaveKind.ROWS if flag & ROWS_OK else SaveKind.BLOCK if flag & RUNS_OK else SaveKind.GATHER
            if kind is not SaveKind.GATHER:
                senders, blocks = _senders(t, kind, wire.itemsize)
        nbytes = t.numel() * wire.itemsize
        each = nbytes // len(parts)
        units += [(len(items), part, shape, j * each, each) for j, (part, shape) in enumerate(parts)]
        items.append(SaveItem(key, _NAMES[wire], tuple(t.shape), nbytes, kind, senders, (), blocks))
    if not items:
        raise SaveError("nothing to save: the model has no tensors, or key_map skipped them all")
    piece_bytes = slot_bytes(options["max_staging_bytes"])
    headers, laid = _lay_out(items, units, parse_size(options["max_shard_size"]), metadata or {})
    rounds = round_ends([item.nbytes for item in laid], ROUND_PIECES * piece_bytes)
    count = len(headers)  # named as huggingface_hub and diffusers name them
    names = [f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    files = tuple(names) if count > 1 else (f"{stem}.safetensors",)
    total = sum(i.nbytes for i in items)
    return SavePlan(files, headers, laid, rounds, piece_bytes, tuple(skipped), total)


def _senders(t: DTensor, kind: SaveKind, itemsize: int) -> tuple[_Senders, Blocks]:
    """(rank 0) Who sends a ROWS or BLOCK DTensor's bytes: the replica at coordinate 0 of every
    ``Replicate`` mesh dimension (on a sub-mesh, ``mesh["dp"]``, the ranks of rank 0's slice; the
    other slices are replicas), ranks holding nothing left out. ROWS: each sender's row range, as
    bytes (``itemsize`` an element on the wire), by first row; BLOCK: each sender's block, the cross
    product of the index runs it holds."""
    mesh_shape, placements, shape = tuple(t.device_mesh.shape), t.placements, tuple(t.shape)
    replicated = [d for d, p in enumerate(placements) if type(p) is Replicate]
    row, senders, blocks = math.prod(shape[1:]) * itemsize, [], []
    for rank, coord in rank_coordinates(t.device_mesh):
        if any(coord[d] for d in replicated):
            continue
        if kind is SaveKind.ROWS:
            lo, hi = rows_of(mesh_shape, placements, shape[0], coord)
            if hi > lo:
                senders.append((rank, lo * row, hi * row))
            continue
        runs = runs_at(placements, mesh_shape, coord, shape)
        if runs is None:  # every rank reported RUNS_OK for it: a bug, not a user error
            raise SaveError(f"no block layout for placements {placements} of shape {shape}")
        if all(runs):
            blocks.append((rank, runs))
    return tuple(sorted(senders, key=lambda s: s[1])), tuple(blocks)


def _split(sizes: list[int], limit: int) -> list[list[int]]:
    """huggingface_hub's split: in order, a new file when the next tensor would tip over the limit;
    a tensor larger than the limit alone in its own file."""
    files: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, size in enumerate(sizes):
        if size > limit:
            files.append([i])
            continue
        if used + size > limit and current:
            files.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        files.append(current)
    return files


def _lay_out(
    items: list[SaveItem], units: list[_Unit], limit: int, metadata: dict[str, str]
) -> tuple[tuple[bytes, ...], tuple[SaveItem, ...]]:
    """(rank 0) The files' headers, and the items in write order with their saved tensors: in each
    file tensors by element size, largest first, then name (as safetensors orders them), so each is
    aligned; the JSON header padded with spaces to 8."""
    saved: list[list[Saved]] = [[] for _ in items]
    headers: list[bytes] = []
    for file, group in enumerate(_split([u[4] for u in units], limit)):
        order = sorted((units[u] for u in group), key=lambda u: (-DTYPES[items[u[0]].dtype].itemsize, u[1]))
        starts = list(itertools.accumulate((u[4] for u in order), initial=0))  # data offsets in the file
        header: dict[str, Any] = {"__metadata__": {"format": "pt", **metadata}}
        for (i, name, shape, _, nbytes), at in zip(order, starts):
            header[name] = {"dtype": items[i].dtype, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        headers.append(len(text).to_bytes(8, "little") + text)
        for (i, name, _, start, nbytes), at in zip(order, starts):
            saved[i].append(Saved(name, file, len(headers[-1]) + at, start, nbytes))
    laid = [
        replace(item, saved=tuple(sorted(spans, key=lambda x: x.start))) for item, spans in zip(items, saved)
    ]
    laid.sort(key=lambda i: min((s.file, s.offset) for s in i.saved))
    return tuple(headers), tuple(laid)
