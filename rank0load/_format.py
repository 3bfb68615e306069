"""Reading and validating safetensors headers, without the safetensors runtime.

(rank 0 only) Parsing the header ourselves lets us validate everything the streaming phase relies
on (dtype, shape, byte ranges inside the file, no overlap, no gaps) before any data moves, and
then read each tensor's bytes at its file offset into a small reusable buffer instead of mapping
whole files (mapped pages count in RSS).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from .errors import CheckpointFormatError

__all__ = ["DTYPES", "TensorHeader", "read_header", "torch_dtype", "MAX_HEADER_BYTES"]

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

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the safetensors reference implementation enforces


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


@dataclass(frozen=True)
class TensorHeader:
    """Where one tensor lives: ``nbytes`` bytes at absolute ``offset`` of ``file``."""

    file: str  # path as given to read_header
    key: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]  # torch shape (F4: last dim already halved)
    offset: int
    nbytes: int


def _fail(path: str, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{path}: corrupt safetensors file: {what}. "
        "Re-download or re-save the checkpoint (the file may be truncated or not safetensors)."
    )


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_header(path: str) -> tuple[dict[str, TensorHeader], dict[str, str]]:
    """(rank 0) Parse and validate one file's header. Returns (tensors, ``__metadata__``)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        from .errors import CheckpointNotFoundError

        raise CheckpointNotFoundError(f"{path}: cannot open: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise _fail(path, f"file is {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if n > MAX_HEADER_BYTES:
            raise _fail(path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
        if 8 + n > size:
            raise _fail(path, f"header length {n} runs past the end of the {size}-byte file")
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(path, f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _fail(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail(path, f"'__metadata__' is {_short(metadata)}: expected an object of strings")
    data_start = 8 + n
    data_size = size - data_start
    tensors: dict[str, TensorHeader] = {}
    for key, entry in header.items():
        tensors[key] = _parse_entry(path, key, entry, data_start, data_size)
    _check_coverage(path, tensors, data_start, data_size)
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def _parse_entry(path: str, key: str, entry: object, data_start: int, data_size: int) -> TensorHeader:
    if not isinstance(entry, dict):
        raise _fail(path, f"entry for key {key!r} is not an object")
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
        raise _fail(path, f"key {key!r} has shape {shape!r}: expected a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise _fail(path, f"key {key!r} has data_offsets {offsets!r}: expected [begin, end]")
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
            raise _fail(path, f"key {key!r}: F4 shape {shape} needs an even last dimension")
        tshape = (*tshape[:-1], tshape[-1] // 2)
    nbytes = math.prod(tshape) * DTYPES[dtype].itemsize
    if end - begin != nbytes:
        raise _fail(
            path,
            f"key {key!r} ({dtype}, shape {shape}) needs {nbytes} bytes but data_offsets "
            f"[{begin}, {end}] span {end - begin}",
        )
    return TensorHeader(path, key, dtype, tshape, data_start + begin, nbytes)


def _check_coverage(path: str, tensors: dict[str, TensorHeader], data_start: int, data_size: int) -> None:
    """The byte ranges must tile the data section exactly: no overlap, no gap, no trailing bytes."""
    pos = data_start
    for t in sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes)):
        if t.offset < pos:
            raise _fail(path, f"key {t.key!r} overlaps the tensor stored before it")
        if t.offset > pos:
            raise _fail(path, f"{t.offset - pos} bytes before key {t.key!r} belong to no tensor")
        pos = t.offset + t.nbytes
    if pos != data_start + data_size:
        raise _fail(path, f"{data_start + data_size - pos} bytes after the last tensor belong to no tensor")
