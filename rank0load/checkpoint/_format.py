"""Reading and validating safetensors headers, without the safetensors runtime.

(rank 0 only) :func:`read_header` reads a file's header through the descriptor ``_files`` opened
and validates everything the streaming phase relies on (dtype, shape, byte ranges inside the file,
no overlap, no gaps) before any data moves, so that rank 0 can read tensors at their offsets
instead of mapping whole files (mapped pages count in RSS). The JSON is decoded by ``_json``.
(all ranks) :data:`DTYPES` and :class:`TensorHeader` are plain data; no collectives here.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import os
import re
import struct
from typing import Any, NamedTuple

import torch

from ..errors import CheckpointFormatError
from ._files import OpenFile, read_exact
from ._json import Twice, mark_twice, parse_json, short_repr

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "TensorHeader",
    "read_header",
]

# safetensors dtype string -> torch dtype (what torch 2.13 can hold). "F4" is float4_e2m1fn_x2:
# safetensors counts 4-bit elements in the shape, torch packs two per byte in the last dimension.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}
for _name, _attr in (
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("F8_E8M0", "float8_e8m0fnu"),
    ("F4", "float4_e2m1fn_x2"),
):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)

# The safetensors format's own limit (MAX_HEADER_SIZE = 100_000_000 in safetensors/src/tensor.rs):
# a header the reference implementation refuses is refused here too.
MAX_HEADER_BYTES = 100_000_000


class TensorHeader(NamedTuple):
    """Where one tensor lives: ``nbytes`` bytes at absolute ``offset`` of ``file``. (A named tuple,
    not a dataclass: one is made per checkpoint tensor.)"""

    file: str  # path as given to read_header (or OpenFile.path)
    key: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]  # torch shape (F4: last dim already halved)
    offset: int
    nbytes: int


# --- parsing -----------------------------------------------------------------------------------


def _fail(path: str, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{path}: corrupt safetensors file: {what}. "
        "Re-download or re-save the checkpoint (the file may be truncated or not safetensors)."
    )


def read_header(file: str | os.PathLike[str] | OpenFile) -> tuple[dict[str, TensorHeader], dict[str, str]]:
    """(rank 0) Parse and validate one file's header. Returns (tensors, ``__metadata__``).

    Args:
        file: an :class:`OpenFile` (read through its descriptor, left open), or a path (opened,
            read and closed here).

    Raises:
        CheckpointNotFoundError: a path that cannot be opened.
        CheckpointFormatError: not a regular file, or the header is malformed.
        CheckpointChangedError: the file changed since it was opened.
    """
    if not isinstance(file, OpenFile):
        with OpenFile.open(file) as opened:
            return read_header(opened)
    path, fd, size = file.path, file.fd, file.identity.size
    if size < 8:
        raise _fail(path, f"file is {size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", read_exact(fd, 8, 0, path))
    if n > MAX_HEADER_BYTES:
        raise _fail(path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > size:
        raise _fail(path, f"header length {n} runs past the end of the {size}-byte file")
    raw = read_exact(fd, n, 8, path)
    file.check()  # a header read from a file being rewritten is not evidence of corruption
    data_start = 8 + n
    data_size = size - data_start
    written = _as_written(path, raw, data_start, data_size)
    if written is not None:
        tensors, metadata, tiled = written
        if not tiled:
            _check_coverage(path, tensors, data_start, data_size)
        return tensors, metadata
    header = parse_json(raw, "header", lambda problem: _fail(path, problem))
    if not isinstance(header, dict):
        raise _fail(path, "header is not a JSON object")
    if isinstance(header, Twice):
        raise CheckpointFormatError(
            f"key {header.twice[0]!r} is stored twice in the header of {path}: a JSON reader keeps "
            "only one of the two entries, so which tensor is meant is ambiguous. Re-save the "
            "checkpoint (safetensors.torch.save_file and save_pretrained write each key once)."
        )
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail(path, f"'__metadata__' is {short_repr(metadata)}: expected an object of strings")
    if isinstance(metadata, Twice):
        raise _fail(path, f"'__metadata__' holds key {metadata.twice[0]!r} twice")
    parsed = _parse_entries(path, header, data_start, data_size)
    if parsed is None:  # something is wrong: entry by entry, the first bad one named
        parsed = {key: _parse_entry(path, key, entry, data_start, data_size) for key, entry in header.items()}
    _check_coverage(path, parsed, data_start, data_size)
    return parsed, {str(k): str(v) for k, v in metadata.items()}


_ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items() if name != "F4"}
_DTYPE_NAMES = {name: name for name in _ITEMSIZE}

# The header as safetensors writes it (what save_pretrained and save_file produce): compact JSON,
# "__metadata__" first, each entry's fields in this order, no escapes, then spaces up to a multiple
# of 8 bytes. Read with one regular-expression pass over the text instead of json.loads building a
# dict and two lists per entry; any other layout goes through json (see read_header).
_ENTRY = re.compile(
    r'"([^"]*)":\{"dtype":"([A-Z0-9_]{1,16})","shape":\[([0-9,]{0,400})\],'
    r'"data_offsets":\[([0-9]{1,18}),([0-9]{1,18})\]\}([,}])'
)
_ENTRY_TEXT = len('"":{"dtype":"","shape":[],"data_offsets":[,]},')  # an entry's fixed characters
_METADATA = re.compile(r'\{"__metadata__":(\{(?:"[^"]*":"[^"]*"(?:,"[^"]*":"[^"]*")*)?\}),')
_SHAPE = re.compile(r"(?:(?:0|[1-9][0-9]*)(?:,(?:0|[1-9][0-9]*))*)?")  # JSON integers: no leading 0
_NOT_WRITTEN = bytes(range(32)) + b"\\"  # control characters and escapes: json.loads's business


def _as_written(
    path: str, raw: bytes, data_start: int, data_size: int
) -> tuple[dict[str, TensorHeader], dict[str, str], bool] | None:
    """(tensors, metadata, tiled) of a header in the layout safetensors writes whose every entry
    passes :func:`_parse_entries`'s checks (tiled: the entries, in the header's order, fill the data
    section end to end, so :func:`_check_coverage` has nothing to find); None for anything else
    (read_header then parses it as JSON and names the problem). The entries must tile the text
    after the metadata exactly: matches found in order whose lengths add up to the text's cannot
    leave a character unread."""
    body = raw.rstrip(b" ")
    if len(body.translate(None, _NOT_WRITTEN)) != len(body):
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return None
    opened = _written_metadata(text)
    if opened is None:
        return None
    metadata, at = opened
    rows = _ENTRY.findall(text, at)
    if not rows:
        return None
    keys, dtypes, shapes, begins, ends, ends_with = zip(*rows)
    written = sum(map(len, itertools.chain(keys, dtypes, shapes, begins, ends))) + _ENTRY_TEXT * len(rows)
    if written != len(text) - at or ends_with.count("}") != 1 or ends_with[-1] != "}":
        return None
    if len(set(keys)) != len(keys) or "__metadata__" in keys or not set(dtypes) <= _ITEMSIZE.keys():
        return None
    distinct = set(shapes)
    if not all(map(_SHAPE.fullmatch, distinct)):
        return None
    dims = {s: tuple(map(int, s.split(","))) if s else () for s in distinct}
    if max(map(len, dims.values())) > 16:
        return None
    nbytes = {(s, d): math.prod(dims[s]) * _ITEMSIZE[d] for s, d in set(zip(shapes, dtypes))}
    sizes = list(map(nbytes.__getitem__, zip(shapes, dtypes)))
    stops = list(map(int, ends))
    tiled = begins[0] == "0" and begins[1:] == ends[:-1]  # each stored right after the one before
    starts = [0, *stops[:-1]] if tiled else list(map(int, begins))
    if max(stops) > data_size or any(map(operator.ne, map(operator.sub, stops, starts), sizes)):
        return None
    digits = sum(map(len, ends)) + (0 if tiled else sum(map(len, begins)))
    if digits != sum(map(len, map(str, stops))) + (0 if tiled else sum(map(len, map(str, starts)))):
        return None  # a number written with a leading zero, which JSON does not allow
    columns = zip(
        itertools.repeat(path),
        keys,
        map(_DTYPE_NAMES.__getitem__, dtypes),
        map(dims.__getitem__, shapes),
        map(data_start.__add__, starts),
        sizes,
    )
    # tuple.__new__ straight from the columns: the named tuple's own __new__ is a Python function
    tensors = dict(zip(keys, map(tuple.__new__, itertools.repeat(TensorHeader), columns)))
    return tensors, metadata, tiled and stops[-1] == data_size


def _written_metadata(text: str) -> tuple[dict[str, str], int] | None:
    """(metadata, where the entries start) of a header as safetensors writes it: ``{``, then its
    ``__metadata__`` object of strings, if any, written first; None for anything else."""
    if not text.startswith('{"__metadata__":'):
        return ({}, 1) if text.startswith("{") else None
    found = _METADATA.match(text)
    if found is None:
        return None
    metadata = json.loads(found.group(1), object_pairs_hook=mark_twice)
    if isinstance(metadata, Twice):
        return None
    return metadata, found.end()


def _parse_entries(
    path: str, header: dict[str, object], data_start: int, data_size: int
) -> dict[str, TensorHeader] | None:
    """Every entry at once, each check made over columns rather than entry by entry; None when any
    check fails or the header holds what only :func:`_parse_entry` handles (F4, very many
    dimensions), which then names the first problem."""
    entries = list(header.values())
    if set(map(type, entries)) - {dict}:  # Twice (a field stored twice) too
        return None
    fields = [(e.get("dtype"), e.get("shape"), e.get("data_offsets")) for e in entries]  # type: ignore[attr-defined]
    dtypes, shapes, offsets = (list(c) for c in zip(*fields)) if fields else ([], [], [])
    if not set(dtypes) <= _ITEMSIZE.keys() or set(map(type, shapes)) - {list}:
        return None
    if set(map(type, offsets)) - {list} or set(map(len, offsets)) - {2}:
        return None
    dims = list(itertools.chain.from_iterable(shapes))
    flat = list(itertools.chain.from_iterable(offsets))
    if len(dims) > 16 * len(entries) or set(map(type, dims)) - {int} or set(map(type, flat)) - {int}:
        return None
    if (dims and min(dims) < 0) or (flat and (min(flat) < 0 or max(flat) > data_size)):
        return None
    begins, ends = flat[0::2], flat[1::2]
    sizes = [math.prod(shape) * _ITEMSIZE[d] for shape, d in zip(shapes, dtypes)]
    if any(map(operator.ne, map(operator.sub, ends, begins), sizes)):
        return None
    # One string per dtype and one tuple per distinct shape, shared by every entry (json makes a
    # new string and list for each).
    shared: dict[Any, Any] = dict(_DTYPE_NAMES)
    return {
        key: TensorHeader(path, key, shared[d], shared.setdefault(s, s), data_start + b, n)
        for key, d, s, b, n in zip(header, dtypes, map(tuple, shapes), begins, sizes)
    }


def _parse_entry(path: str, key: str, entry: object, data_start: int, data_size: int) -> TensorHeader:
    if not isinstance(entry, dict):
        raise _fail(path, f"entry for key {key!r} is not an object")
    if isinstance(entry, Twice):
        raise _fail(path, f"entry for key {key!r} holds field {entry.twice[0]!r} twice")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _fail(
            path,
            f"key {key!r} has dtype {dtype!r}, which torch {torch.__version__} cannot hold "
            f"(known: {', '.join(sorted(DTYPES))})",
        )
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _fail(
            path, f"key {key!r} has shape {short_repr(shape)}: expected a list of non-negative integers"
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise _fail(path, f"key {key!r} has data_offsets {short_repr(offsets)}: expected [begin, end]")
    begin, end = offsets
    if end > data_size:
        raise _fail(
            path,
            f"key {key!r} data_offsets [{begin}, {end}] run past the {data_size} data bytes "
            "(file truncated?)",
        )
    tshape = tuple(shape)
    if dtype == "F4":
        if not tshape or tshape[-1] % 2:
            raise _fail(path, f"key {key!r}: F4 shape {short_repr(shape)} needs an even last dimension")
        tshape = (*tshape[:-1], tshape[-1] // 2)
    nbytes = _nbytes(tshape, DTYPES[dtype].itemsize, data_size)
    if nbytes is None or end - begin != nbytes:
        needs = f"more than the {data_size} data bytes" if nbytes is None else f"{nbytes} bytes"
        raise _fail(
            path,
            f"key {key!r} ({dtype}, shape {short_repr(shape)}) needs {needs} but data_offsets "
            f"[{begin}, {end}] span {end - begin}",
        )
    return TensorHeader(path, key, dtype, tshape, data_start + begin, nbytes)


def _nbytes(shape: tuple[int, ...], itemsize: int, limit: int) -> int | None:
    """``prod(shape) * itemsize``, or None once it exceeds ``limit``: a header may hold millions of
    huge dimensions, whose full product would take minutes to compute for nothing."""
    if 0 in shape:
        return 0
    n = itemsize
    for d in shape:
        n *= d
        if n > limit:
            return None
    return n


def _check_coverage(path: str, tensors: dict[str, TensorHeader], data_start: int, data_size: int) -> None:
    """The byte ranges must tile the data section exactly: no overlap, no gap, no trailing bytes."""
    pos = data_start
    for t in sorted(tensors.values(), key=operator.attrgetter("offset", "nbytes")):
        if t.offset < pos:
            raise _fail(path, f"key {t.key!r} overlaps the tensor stored before it")
        if t.offset > pos:
            raise _fail(path, f"{t.offset - pos} bytes before key {t.key!r} belong to no tensor")
        pos = t.offset + t.nbytes
    if pos != data_start + data_size:
        raise _fail(path, f"{data_start + data_size - pos} bytes after the last tensor belong to no tensor")
