"""Reading and validating safetensors headers, without the safetensors runtime (rank 0, before any
data moves; no collectives). :data:`DTYPES` and :class:`TensorHeader` are plain data all ranks read."""

from __future__ import annotations

import json
import operator
import os
import struct
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..errors import CheckpointFormatError
from ._files import OpenFile, read_exact

# safetensors dtype string -> torch dtype. "F4" is float4_e2m1fn_x2:
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
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
}

# the safetensors format's own limit (MAX_HEADER_SIZE in safetensors/src/tensor.rs)
MAX_HEADER_BYTES = 100_000_000


class TensorHeader(NamedTuple):
    """Where one tensor lives: ``nbytes`` bytes at absolute ``offset`` of ``file``."""

    file: str  # path as given to read_header (or OpenFile.path)
    key: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]  # torch shape (F4: last dim already halved)
    offset: int
    nbytes: int


def short_repr(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RepeatedKeys(dict[str, object]):
    """A JSON object in which some key occurs more than once (``twice`` lists them, in order)."""

    twice: tuple[str, ...] = ()


def _mark_repeated_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json.loads``' ``object_pairs_hook``: the object, a :class:`RepeatedKeys` when a key repeats."""
    obj = dict(pairs)  # once per JSON object: the common case in C
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    twice = [key for key, _ in pairs if key in seen or seen.add(key)]  # type: ignore[func-returns-value]
    marked = RepeatedKeys(obj)
    marked.twice = tuple(twice)
    return marked


def parse_json(raw: bytes, what: str, fail: Callable[[str], Exception]) -> object:
    """Decode untrusted JSON; objects with a repeated key come back as :class:`RepeatedKeys`.

    Invalid UTF-8 or JSON, a number too long to convert, or nesting too deep for the parser raise
    ``fail(problem)``, where ``problem`` starts with ``what`` ("header", "index")."""
    try:
        text = raw.decode("utf-8")
        del raw  # the caller's reference may be the last other one (see _source._read_map)
        found = json.loads(text)
        # Each key is followed by one ':', as is each ':' in a string: if the keys of an object and
        # of the objects among its values equal the colons, no key repeats; else parse with the hook.
        keys = (
            len(found) + sum(len(v) for v in found.values() if type(v) is dict) if type(found) is dict else -1
        )
        if keys != text.count(":"):
            found = json.loads(text, object_pairs_hook=_mark_repeated_keys)
        return found
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        problem = f"{what} is not valid JSON ({exc})"
    except ValueError as exc:  # int("9" * 5000): Python's integer-string conversion limit
        problem = f"{what} holds a number too long to parse ({short_repr(str(exc), 90)})"
    except RecursionError:
        problem = f"{what} is nested too deeply to parse"
    raise fail(problem)


def _fail(path: str, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{path}: corrupt safetensors file: {what}. "
        "Re-download or re-save the checkpoint (the file may be truncated or not safetensors)."
    )


def read_header(file: str | os.PathLike[str] | OpenFile) -> dict[str, TensorHeader]:
    """(rank 0) :func:`read_header_and_metadata`'s tensors: ``__metadata__`` checked and dropped."""
    return read_header_and_metadata(file)[0]


def read_header_and_metadata(
    file: str | os.PathLike[str] | OpenFile,
) -> tuple[dict[str, TensorHeader], dict[str, str]]:
    """(rank 0) Parse and validate one file's header: its tensors (dtypes, shapes, byte ranges that
    tile the data section) and its ``__metadata__`` (an object of strings; empty when absent).

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
            return read_header_and_metadata(opened)
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
    header = parse_json(raw, "header", lambda problem: _fail(path, problem))
    if not isinstance(header, dict):
        raise _fail(path, "header is not a JSON object")
    if isinstance(header, RepeatedKeys):
        raise CheckpointFormatError(
            f"key {header.twice[0]!r} is stored twice in the header of {path}: a JSON reader keeps "
            "only one of the two entries, so which tensor is meant is ambiguous. Re-save the "
            "checkpoint (safetensors.torch.save_file and save_pretrained write each key once)."
        )
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail(path, f"'__metadata__' is {short_repr(metadata)}: expected an object of strings")
    if isinstance(metadata, RepeatedKeys):
        raise _fail(path, f"'__metadata__' holds key {metadata.twice[0]!r} twice")
    parsed = {key: _parse_entry(path, key, entry, data_start, data_size) for key, entry in header.items()}
    _check_coverage(path, parsed, data_start, data_size)
    return parsed, metadata


def _parse_entry(path: str, key: str, entry: object, data_start: int, data_size: int) -> TensorHeader:
    if not isinstance(entry, dict):
        raise _fail(path, f"entry for key {key!r} is not an object")
    if isinstance(entry, RepeatedKeys):
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
    """``prod(shape) * itemsize``, or None once it exceeds ``limit`` (so a hostile header stays cheap)."""
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
