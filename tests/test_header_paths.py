"""The two ways rank 0 reads a header give one answer.

``read_header`` reads a header in the layout safetensors writes with one regular-expression pass
(``_format._as_written``) and anything else with ``json.loads`` (``parse_json`` + ``_parse_entries``).
Differential tests: for files safetensors writes and for headers edited character by character,
``read_header`` must return exactly what the JSON path returns, or raise exactly its error. Single
process, files in tmp_path.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from rank0load.checkpoint import _format
from rank0load.checkpoint._files import OpenFile
from rank0load.errors import CheckpointFormatError

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _outcome(path: str) -> tuple[str, object]:
    try:
        tensors, metadata = _format.read_header(path)
    except CheckpointFormatError as exc:
        return "error", str(exc)
    return "ok", (list(tensors.items()), metadata)


def _both(path: str, monkeypatch: pytest.MonkeyPatch) -> tuple[tuple[str, object], tuple[str, object]]:
    """(read_header's outcome, the JSON path's outcome) for the file at ``path``."""
    fast = _outcome(path)
    with monkeypatch.context() as m:
        m.setattr(_format, "_as_written", lambda *a: None)
        slow = _outcome(path)
    return fast, slow


def _written(path: str) -> bool:
    """Whether the file's header takes the regular-expression path."""
    with OpenFile.open(path) as f:
        (n,) = struct.unpack("<Q", os.pread(f.fd, 8, 0))
        return _format._as_written(path, os.pread(f.fd, n, 8), 8 + n, f.identity.size - 8 - n) is not None


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8, torch.bool]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)

keys = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12).filter(
    lambda k: k != "__metadata__"
)
tensors = st.dictionaries(
    keys,
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 3), max_size=4)),
    min_size=1,
    max_size=8,
)


@SETTINGS
@given(found=tensors, metadata=st.none() | st.dictionaries(keys, st.text(max_size=6), max_size=3))
def test_what_safetensors_writes_reads_the_same_both_ways(found, metadata, tmp_path, monkeypatch):
    path = str(tmp_path / "x.safetensors")
    save_file({k: torch.zeros(shape, dtype=d) for k, (d, shape) in found.items()}, path, metadata=metadata)
    fast, slow = _both(path, monkeypatch)
    assert fast == slow
    assert fast[0] == "ok"


def test_a_save_file_header_takes_the_fast_path(tmp_path):
    """Without this, the differential tests would pass with the fast path never taken."""
    path = str(tmp_path / "x.safetensors")
    save_file(
        {"a.weight": torch.ones(3, 2), "b": torch.zeros(0, dtype=torch.int8)}, path, metadata={"format": "pt"}
    )
    assert _written(path)


def _file(tmp_path, header_text: str, data: bytes) -> str:
    path = str(tmp_path / "edited.safetensors")
    raw = header_text.encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    return path


BASE = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b.c": torch.ones(2, dtype=torch.int16)}


def _base(tmp_path) -> tuple[str, bytes]:
    path = str(tmp_path / "base.safetensors")
    save_file(BASE, path, metadata={"format": "pt"})
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    return blob[8 : 8 + n].decode(), blob[8 + n :]


def _edits(text: str) -> Iterator[tuple[str, str]]:
    """Headers that json reads differently, or refuses, or reads the same but spelled otherwise."""
    header = json.loads(text)
    meta = header.pop("__metadata__")
    entries = ",".join(f"{json.dumps(k)}:{json.dumps(v, separators=(',', ':'))}" for k, v in header.items())
    yield "metadata last", "{" + entries + ',"__metadata__":' + json.dumps(meta, separators=(",", ":")) + "}"
    yield "no metadata", "{" + entries + "}"
    yield "spaces", json.dumps({"__metadata__": meta, **header})
    yield "leading zero", text.replace('"data_offsets":[0,', '"data_offsets":[00,')
    yield "leading zero in shape", text.replace('"shape":[2,3]', '"shape":[02,3]')
    yield "key twice", text.replace('"b.c"', '"a"')
    yield "field twice", text.replace('"dtype":"I16"', '"dtype":"I16","dtype":"I16"')
    yield "unknown dtype", text.replace('"I16"', '"I17"')
    yield "escaped key", text.replace('"b.c"', '"b\\u002ec"')
    yield "missing comma", text.replace('},"b.c"', '}"b.c"')
    yield "extra comma", text.replace('},"b.c"', '},,"b.c"')
    yield "closed early", text.replace('},"b.c"', '}},"b.c"')
    yield "trailing garbage", text.rstrip() + "x"
    yield "offsets past the end", text.replace("[24,28]", "[24,2800]")
    yield "gap", text.replace("[24,28]", "[26,30]")
    yield "overlap", text.replace("[24,28]", "[20,24]")
    yield "metadata number", text.replace('"format":"pt"', '"format":1')
    yield "metadata twice", text.replace('"format":"pt"', '"format":"pt","format":"np"')
    yield "metadata key", text.replace('"b.c"', '"__metadata__"')
    yield "control character", text.replace('"b.c"', '"b\tc"')
    yield "newline padding", text.rstrip() + "\n"
    yield "reordered fields", text.replace('"dtype":"I16","shape":[2]', '"shape":[2],"dtype":"I16"')
    yield "colon in key", text.replace('"b.c"', '"b:c"')


def test_edited_headers_read_the_same_both_ways(tmp_path, monkeypatch):
    text, data = _base(tmp_path)
    assert '"data_offsets":[0,' in text and "[24,28]" in text and '"shape":[2,3]' in text  # the edits apply
    outcomes = set()
    for name, edited in _edits(text):
        assert edited != text, name
        fast, slow = _both(_file(tmp_path, edited, data), monkeypatch)
        assert fast == slow, name
        outcomes.add(fast[0])
    assert outcomes == {"ok", "error"}


@SETTINGS
@given(
    edits=st.lists(
        st.tuples(st.integers(0, 10**6), st.integers(0, 3), st.sampled_from('{}[],:"0123 aF_.\\')), max_size=4
    )
)
def test_headers_edited_at_random_read_the_same_both_ways(edits, tmp_path, monkeypatch):
    text, data = _base(tmp_path)
    chars = list(text.rstrip())
    for at, how, c in edits:
        i = at % (len(chars) + 1)
        if how == 0:
            chars.insert(i, c)
        elif chars and how == 1:
            del chars[min(i, len(chars) - 1)]
        elif chars:
            chars[min(i, len(chars) - 1)] = c
    fast, slow = _both(_file(tmp_path, "".join(chars), data), monkeypatch)
    assert fast == slow
