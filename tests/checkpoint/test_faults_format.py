"""Fault corpus, checkpoint format: paths that do not exist, broken index files, index entries that
escape the checkpoint directory, truncated files, malformed headers and byte ranges, unknown dtypes.

Every bad input raises the same LoadError on every rank, never a hang; all cases run in one pair of
gloo ranks (see tests/faults_common.py), and none of them may write to the checkpoint or open a file
an index points to outside its directory.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from typing import Any

import pytest
from safetensors.torch import save_file

from tests.faults_common import (
    REDO,
    Case,
    check_fault,
    check_good_load,
    check_never_written,
    good_state,
    read_bytes,
    read_st,
    run_corpus,
    single,
    write_st,
)
from tests.models import save_sharded

# --------------------------------------------------------------------------------------------
# Building broken checkpoints.


def _mutate_header(d: str, fn: Callable[[dict, bytes], tuple[dict, bytes]]) -> str:
    path = single(d)
    header, data = read_st(path)
    header, data = fn(header, data)
    write_st(path, header, data)
    return path


def _set(key: str, field_: str, value: Any) -> Callable[[dict, bytes], tuple[dict, bytes]]:
    def fn(h: dict, data: bytes) -> tuple[dict, bytes]:
        h[key][field_] = value
        return h, data

    return fn


def _overlap(h: dict, data: bytes) -> tuple[dict, bytes]:
    h["blocks.1.fc.bias"]["data_offsets"] = list(h["blocks.0.fc.bias"]["data_offsets"])
    return h, data


def _gap_in_middle(h: dict, data: bytes) -> tuple[dict, bytes]:
    first = min((v for k, v in h.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][0])
    cut = first["data_offsets"][1]
    for k, v in h.items():
        if k != "__metadata__" and v["data_offsets"][0] >= cut:
            v["data_offsets"] = [o + 4 for o in v["data_offsets"]]
    return h, data[:cut] + b"\0" * 4 + data[cut:]


def _raw_file(d: str, edit: Callable[[bytes], bytes]) -> str:
    path = single(d)
    raw = read_bytes(path)
    with open(path, "wb") as f:
        f.write(edit(raw))
    return path


def _header_len(raw: bytes) -> int:
    return struct.unpack("<Q", raw[:8])[0]


def _garbage_header(raw: bytes) -> bytes:
    n = _header_len(raw)
    return raw[:8] + b"{" + b"#" * (n - 1) + raw[8 + n :]


def _non_utf8_header(raw: bytes) -> bytes:
    n = _header_len(raw)
    return raw[:8] + b"{\xff\xfe" + raw[11 : 8 + n] + raw[8 + n :]


def _index_with(d: str, edit: Callable[[dict, str], None]) -> str:
    save_sharded(good_state(), d)
    ipath = os.path.join(d, "model.safetensors.index.json")
    index = json.loads(read_bytes(ipath))
    edit(index, d)
    with open(ipath, "w") as f:
        json.dump(index, f)
    return d


def _outside_file(d: str) -> str:
    """A valid safetensors file next to (not inside) the checkpoint directory ``d``."""
    outside = os.path.join(os.path.dirname(d), os.path.basename(d) + "-outside")
    os.makedirs(outside, exist_ok=True)
    return single(outside)


def _escape_absolute(index: dict, d: str) -> None:
    index["weight_map"]["bn.bias"] = _outside_file(d)


def _escape_dotdot(index: dict, d: str) -> None:
    path = _outside_file(d)
    index["weight_map"]["bn.bias"] = os.path.join(
        "..", os.path.basename(os.path.dirname(path)), "model.safetensors"
    )


def _escape_symlink(index: dict, d: str) -> None:
    os.symlink(_outside_file(d), os.path.join(d, "model-00003-of-00003.safetensors"))
    index["weight_map"]["bn.bias"] = "model-00003-of-00003.safetensors"


def _index_names_missing_file(index: dict, d: str) -> None:
    index["weight_map"]["bn.bias"] = "model-00003-of-00003.safetensors"


def _index_wrong_file(index: dict, d: str) -> None:
    wm = index["weight_map"]
    key = next(k for k, v in sorted(wm.items()) if v.startswith("model-00001"))
    wm[key] = "model-00002-of-00002.safetensors"
    index["_key"] = key


def _index_lists_phantom(index: dict, d: str) -> None:
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"


def _index_omits_key(index: dict, d: str) -> None:
    del index["weight_map"]["bn.bias"]


def _stored_twice(d: str) -> str:
    sd = good_state()
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[:8]}, os.path.join(d, "a.safetensors"))
    save_file({k: sd[k] for k in keys[7:]}, os.path.join(d, "b.safetensors"))
    return d


def _write_text(name: str, text: str) -> Callable[[str], str]:
    def build(d: str) -> str:
        save_sharded(good_state(), d)
        with open(os.path.join(d, name), "w") as f:
            f.write(text)
        return d

    return build


# --------------------------------------------------------------------------------------------
# The corpus.


CASES = [
    Case(
        "path_missing",
        lambda d: os.path.join(d, "nope"),
        "CheckpointNotFoundError",
        ("nope", "does not exist"),
        ("Pass a directory",),
    ),
    Case(
        "dir_without_safetensors",
        lambda d: (open(os.path.join(d, "README.md"), "w").close(), d)[1],
        "CheckpointNotFoundError",
        ("holds no *.safetensors",),
        ("save_file", "save_pretrained"),
    ),
    Case(
        "index_not_json",
        _write_text("model.safetensors.index.json", '{"weight_map": {'),
        "CheckpointFormatError",
        ("model.safetensors.index.json", "not valid JSON"),
        REDO,
    ),
    Case(
        "index_without_weight_map",
        _write_text("model.safetensors.index.json", '{"metadata": {}}'),
        "CheckpointFormatError",
        ("model.safetensors.index.json", "weight_map"),
        REDO,
    ),
    Case(
        "index_names_missing_file",
        lambda d: _index_with(d, _index_names_missing_file),
        "CheckpointNotFoundError",
        ("model-00003-of-00003.safetensors", "does not exist"),
        REDO,
    ),
    Case(
        "index_absolute_path",
        lambda d: _index_with(d, _escape_absolute),
        "CheckpointFormatError",
        ("refusing", "-outside"),
        ("relative paths inside the checkpoint directory",),
    ),
    Case(
        "index_dotdot",
        lambda d: _index_with(d, _escape_dotdot),
        "CheckpointFormatError",
        ("refusing", "..", "-outside"),
        ("relative paths inside the checkpoint directory",),
    ),
    Case(
        "index_symlink_escapes",
        lambda d: _index_with(d, _escape_symlink),
        "CheckpointFormatError",
        ("refusing", "model-00003-of-00003.safetensors", "outside the checkpoint directory"),
        ("symlink",),
    ),
    Case(
        "index_key_in_other_file",
        lambda d: _index_with(d, _index_wrong_file),
        "CheckpointFormatError",
        ("model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors", "stored in"),
        REDO,
    ),
    Case(
        "index_lists_unstored_key",
        lambda d: _index_with(d, _index_lists_phantom),
        "CheckpointFormatError",
        ("'ghost.weight'", "model-00001-of-00002.safetensors", "no file stores it"),
        REDO,
    ),
    Case(
        "index_omits_stored_key",
        lambda d: _index_with(d, _index_omits_key),
        "CheckpointFormatError",
        ("'bn.bias'", "does not list"),
        REDO,
    ),
    Case(
        "key_stored_twice",
        _stored_twice,
        "CheckpointFormatError",
        ("stored twice", "a.safetensors", "b.safetensors"),
        ("Remove one copy",),
    ),
    Case(
        "file_tiny",
        lambda d: _raw_file(d, lambda raw: raw[:5]),
        "CheckpointFormatError",
        ("model.safetensors", "5 bytes"),
        REDO,
    ),
    Case(
        "file_truncated_in_header",
        lambda d: _raw_file(d, lambda raw: raw[:40]),
        "CheckpointFormatError",
        ("model.safetensors", "runs past the end"),
        REDO,
    ),
    Case(
        "file_truncated_in_data",
        lambda d: _raw_file(d, lambda raw: raw[:-10]),
        "CheckpointFormatError",
        ("model.safetensors", "truncated"),
        REDO,
    ),
    Case(
        "header_length_past_end",
        lambda d: _raw_file(d, lambda raw: struct.pack("<Q", len(raw)) + raw[8:]),
        "CheckpointFormatError",
        ("model.safetensors", "runs past the end"),
        REDO,
    ),
    Case(
        "header_length_huge",
        lambda d: _raw_file(d, lambda raw: struct.pack("<Q", 2**63 + 5) + raw[8:]),
        "CheckpointFormatError",
        ("model.safetensors", "exceeds"),
        REDO,
    ),
    Case(
        "header_not_json",
        lambda d: _raw_file(d, _garbage_header),
        "CheckpointFormatError",
        ("model.safetensors", "not valid JSON"),
        REDO,
    ),
    Case(
        "header_not_utf8",
        lambda d: _raw_file(d, _non_utf8_header),
        "CheckpointFormatError",
        ("model.safetensors", "not valid JSON"),
        REDO,
    ),
    Case(
        "header_not_object",
        lambda d: (
            write_st(os.path.join(d, "model.safetensors"), [], b""),
            os.path.join(d, "model.safetensors"),
        )[1],
        "CheckpointFormatError",
        ("model.safetensors", "not a JSON object"),
        REDO,
    ),
    Case(
        "offsets_out_of_range",
        lambda d: _mutate_header(d, _set("bn.bias", "data_offsets", [0, 10**6])),
        "CheckpointFormatError",
        ("model.safetensors", "'bn.bias'", "1000000"),
        REDO,
    ),
    Case(
        "offsets_reversed",
        lambda d: _mutate_header(d, _set("bn.bias", "data_offsets", [20, 0])),
        "CheckpointFormatError",
        ("model.safetensors", "'bn.bias'", "[20, 0]"),
        REDO,
    ),
    Case(
        "offsets_size_mismatch",
        lambda d: _mutate_header(d, _set("bn.bias", "shape", [6])),
        "CheckpointFormatError",
        ("model.safetensors", "'bn.bias'", "24 bytes", "span 20"),
        REDO,
    ),
    Case(
        "offsets_overlap",
        lambda d: _mutate_header(d, _overlap),
        "CheckpointFormatError",
        ("model.safetensors", "overlaps"),
        REDO,
    ),
    Case(
        "offsets_gap",
        lambda d: _mutate_header(d, _gap_in_middle),
        "CheckpointFormatError",
        ("model.safetensors", "4 bytes before key", "belong to no tensor"),
        REDO,
    ),
    Case(
        "offsets_trailing_bytes",
        lambda d: _mutate_header(d, lambda h, data: (h, data + b"\0" * 8)),
        "CheckpointFormatError",
        ("model.safetensors", "8 bytes after the last tensor"),
        REDO,
    ),
    Case(
        "dtype_unknown",
        lambda d: _mutate_header(d, _set("bn.bias", "dtype", "F7")),
        "CheckpointFormatError",
        ("model.safetensors", "'bn.bias'", "'F7'", "known: "),
        REDO,
    ),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return run_corpus(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(corpus, case):
    """Every rank raises the same LoadError subclass, fast, naming what is wrong and what to do."""
    check_fault(corpus, case)


def test_checkpoint_never_written(corpus):
    check_never_written(corpus)


def test_escaping_index_entries_never_followed(corpus):
    """Files an index names outside its directory (absolute, '..', an escaping symlink) are refused
    without ever being opened."""
    assert any(p.endswith("-outside") for p in corpus["before"]), "no case points outside its directory"
    opened = [w for r in corpus["results"] for w in r["writes"] if w[0] == "open-outside"]
    assert sum("probe" in w[1] for w in opened) >= 2, f"the audit hook did not see the probe reads: {opened}"
    opened = [w for w in opened if "probe" not in w[1]]
    assert opened == [], f"the loader opened files outside the checkpoint directory: {opened}"


def test_good_load_after_failures(corpus, toy_reference):
    """After every failing case, in the same process group, a good load is bit-exact."""
    check_good_load(corpus, toy_reference)
