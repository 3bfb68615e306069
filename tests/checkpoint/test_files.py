"""Files on rank 0: header and index edge cases, non-regular files, precedence, OpenFile identity.

Single process, tiny files written into tmp_path. Every test that meets a FIFO runs the call in a
thread with a deadline (:func:`no_hang`): a regression that blocks in open() fails in seconds
instead of hanging the suite.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from rank0load.checkpoint import _files, _source
from rank0load.checkpoint._files import FileIdentity, OpenFile, open_files
from rank0load.checkpoint._format import MAX_HEADER_BYTES, read_header
from rank0load.errors import (
    CheckpointChangedError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    LoadError,
)

REDO = "Re-download or re-save the checkpoint"
CHANGED = "the checkpoint changed during the load; wait until whatever writes it has finished"
REGULAR = "write the data to a regular file first"


# --- helpers -------------------------------------------------------------------------------------


def no_hang(fn: Callable[[], object], fifos: tuple[Path, ...] = ()) -> BaseException | None:
    """Run ``fn`` in a thread; fail if it is still running after 10 s (then open each FIFO for
    writing, which releases a reader blocked in open(), so the thread ends). Returns what it raised."""
    box: dict[str, BaseException | None] = {"exc": None}

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # handed back to the test
            box["exc"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=10)
    if thread.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        pytest.fail(f"{fn} blocked for 10 s (opening a FIFO without O_NONBLOCK?)")
    assert time.monotonic() - start < 2, "took seconds: something waited on the FIFO"
    return box["exc"]


def raises_fast(
    fn: Callable[[], object], kind: type[BaseException], fifos: tuple[Path, ...] = ()
) -> BaseException:
    exc = no_hang(fn, fifos)
    assert isinstance(exc, kind), f"expected {kind.__name__}, got {exc!r}"
    return exc


def save(path: Path, **tensors: torch.Tensor) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def small(path: Path, fill: float = 1.0) -> Path:
    return save(path, a=torch.full((4,), fill), b=torch.arange(6, dtype=torch.int32))


def raw_st(path: Path, header: str | bytes, data: bytes = b"") -> Path:
    """A safetensors file with exactly this header text."""
    h = header.encode() if isinstance(header, str) else header
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


def write_index(d: Path, weight_map: object, name: str = "model.safetensors.index.json") -> Path:
    path = d / name
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def sharded(d: Path) -> Path:
    """Two shards and model.safetensors.index.json; returns the index."""
    d.mkdir(exist_ok=True)
    save(d / "model-00001-of-00002.safetensors", x=torch.ones(3))
    save(d / "model-00002-of-00002.safetensors", y=torch.zeros(2))
    return write_index(d, {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"})


def entry(shape: str = "[1]", offsets: str = "[0, 4]") -> str:
    """One header entry as JSON text (so numbers too long for json.dumps can go in)."""
    return '{"dtype": "F32", "shape": ' + shape + ', "data_offsets": ' + offsets + "}"


ENTRY = entry()


# --- 1. header edge cases --------------------------------------------------------------------------


def test_max_header_bytes_is_the_safetensors_limit(tmp_path: Path) -> None:
    assert MAX_HEADER_BYTES == 100_000_000
    over = tmp_path / "over.safetensors"
    over.write_bytes(struct.pack("<Q", 100_000_001) + b"{}")
    with pytest.raises(CheckpointFormatError) as e:
        read_header(str(over))
    assert all(w in str(e.value) for w in ("over.safetensors", "100000001", "100000000-byte limit", REDO))
    at = tmp_path / "at.safetensors"  # exactly the limit is allowed: this one fails for its size
    at.write_bytes(struct.pack("<Q", 100_000_000) + b"{}")
    with pytest.raises(CheckpointFormatError, match="runs past the end") as e:
        read_header(str(at))
    assert "limit" not in str(e.value)


@pytest.mark.parametrize("where", ["shape", "offsets", "metadata"])
def test_number_too_long_to_parse(tmp_path: Path, where: str) -> None:
    big = "9" * 5000  # json.loads raises ValueError (the 4300-digit limit), not JSONDecodeError
    header = {
        "shape": '{"a": ' + entry(shape=f"[{big}]") + "}",
        "offsets": '{"a": ' + entry(offsets=f"[0, {big}]") + "}",
        "metadata": '{"__metadata__": {"n": ' + big + '}, "a": ' + ENTRY + "}",
    }[where]
    path = raw_st(tmp_path / "big.safetensors", header, b"\0" * 4)
    with pytest.raises(CheckpointFormatError) as e:
        read_header(str(path))
    msg = str(e.value)
    assert all(w in msg for w in ("big.safetensors", "header holds a number too long to parse", REDO)), msg


def test_deeply_nested_header(tmp_path: Path) -> None:
    n = 100_000
    path = raw_st(tmp_path / "deep.safetensors", '{"a": ' + "[" * n + "]" * n + "}")
    with pytest.raises(CheckpointFormatError) as e:
        read_header(str(path))
    assert all(w in str(e.value) for w in ("deep.safetensors", "nested too deeply", REDO))


def test_key_stored_twice_in_one_header(tmp_path: Path) -> None:
    # Two entries for 'a' over the same bytes: json.loads would keep the second, and the coverage
    # check would then blame a gap. The real problem is the repeated key.
    header = '{"a": ' + ENTRY + ', "a": ' + entry(offsets="[4, 8]") + "}"
    path = raw_st(tmp_path / "twice.safetensors", header, b"\0" * 8)
    with pytest.raises(CheckpointFormatError) as e:
        read_header(str(path))
    msg = str(e.value)
    assert f"key 'a' is stored twice in the header of {path}" in msg
    assert "Re-save the checkpoint" in msg
    assert "belong to no tensor" not in msg


def test_field_twice_in_one_entry(tmp_path: Path) -> None:
    header = '{"a": {"dtype": "F32", "dtype": "F16", "shape": [1], "data_offsets": [0, 4]}}'
    path = raw_st(tmp_path / "field.safetensors", header, b"\0" * 4)
    with pytest.raises(CheckpointFormatError) as e:
        read_header(str(path))
    assert all(w in str(e.value) for w in ("field.safetensors", "'a'", "field 'dtype' twice", REDO))


def test_metadata_key_twice(tmp_path: Path) -> None:
    header = '{"__metadata__": {"format": "pt", "format": "np"}, "a": ' + ENTRY + "}"
    path = raw_st(tmp_path / "meta.safetensors", header, b"\0" * 4)
    with pytest.raises(CheckpointFormatError) as e:
        read_header(str(path))
    assert all(w in str(e.value) for w in ("meta.safetensors", "'__metadata__'", "'format' twice", REDO))


def test_huge_shape_is_refused_quickly(tmp_path: Path) -> None:
    """A million 4000-digit dimensions: the byte count is not multiplied out (that takes minutes)."""
    dims = ",".join(["9" * 4000] * 1000)
    path = raw_st(
        tmp_path / "dims.safetensors",
        '{"a": ' + entry(shape=f"[{dims}]") + "}",
        b"\0" * 4,
    )
    start = time.monotonic()
    with pytest.raises(CheckpointFormatError) as e:
        read_header(str(path))
    assert time.monotonic() - start < 5
    msg = str(e.value)
    assert all(w in msg for w in ("dims.safetensors", "'a'", "more than the 4 data bytes", "span 4")), msg
    assert len(msg) < 1000  # the shape is abbreviated, not printed


def test_header_errors_are_format_errors_not_bare(tmp_path: Path) -> None:
    """Every malformed header above raises CheckpointFormatError, a LoadError and a ValueError."""
    path = raw_st(tmp_path / "x.safetensors", "[" * 50_000)
    with pytest.raises(CheckpointFormatError) as e:
        read_header(str(path))
    assert isinstance(e.value, LoadError) and isinstance(e.value, ValueError)


# --- 2. index edge cases ---------------------------------------------------------------------------


def _bad_index(kind: str) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        save(d / "s.safetensors", w=torch.ones(2))
        path = d / "model.safetensors.index.json"
        texts: dict[str, str | bytes] = {
            "value_list": '{"weight_map": {"w": ["s.safetensors"]}}',
            "value_int": '{"weight_map": {"w": 3}}',
            "value_null": '{"weight_map": {"w": null}}',
            "value_object": '{"weight_map": {"w": {"file": "s.safetensors"}}}',
            "value_empty": '{"weight_map": {"w": ""}}',
            "key_twice": '{"weight_map": {"w": "s.safetensors", "w": "t.safetensors"}}',
            "huge_number": '{"metadata": {"total_size": ' + "1" * 5000 + '}, "weight_map": {}}',
            "deep": '{"metadata": ' + "[" * 100_000 + "]" * 100_000 + ', "weight_map": {}}',
            "not_json": '{"weight_map": {',
            "not_utf8": b'{"weight_map": {"\xff": "s.safetensors"}}',
            "not_object": '["s.safetensors"]',
            "no_weight_map": '{"metadata": {}}',
            "weight_map_list": '{"weight_map": ["s.safetensors"]}',
            "empty": '{"weight_map": {}}',
            "absolute": '{"weight_map": {"w": "/etc/passwd"}}',
            "dotdot": '{"weight_map": {"w": "../s.safetensors"}}',
        }
        text = texts[kind]
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        return path

    return build


INDEX_CASES = {
    "value_list": ("'w'", "['s.safetensors']", "expected a file name"),
    "value_int": ("'w'", "3", "expected a file name"),
    "value_null": ("'w'", "None", "expected a file name"),
    "value_object": ("'w'", "expected a file name"),
    "value_empty": ("''", "not a non-empty string"),
    "key_twice": ("'w'", "listed twice in 'weight_map'"),
    "huge_number": ("index holds a number too long to parse",),
    "deep": ("index is nested too deeply",),
    "not_json": ("not valid JSON",),
    "not_utf8": ("not valid JSON",),
    "not_object": ("no 'weight_map' object",),
    "no_weight_map": ("no 'weight_map' object",),
    "weight_map_list": ("no 'weight_map' object",),
    "empty": ("'weight_map' is empty",),
    "absolute": ("refusing", "/etc/passwd", "relative paths inside"),
    "dotdot": ("refusing", "../s.safetensors", "relative paths inside"),
}


@pytest.mark.parametrize("kind", sorted(INDEX_CASES))
@pytest.mark.parametrize("via", ["dir", "index"])
def test_bad_index(tmp_path: Path, kind: str, via: str) -> None:
    index = _bad_index(kind)(tmp_path)
    with pytest.raises(CheckpointFormatError) as e:
        _source.resolve(tmp_path if via == "dir" else index)
    msg = str(e.value)
    assert str(index) in msg, msg  # every index error names the index file
    for word in INDEX_CASES[kind]:
        assert word in msg, (word, msg)
    if kind not in ("absolute", "dotdot"):
        assert "Re-download or re-save" in msg, msg


def test_index_entries_resolve(tmp_path: Path) -> None:
    index = sharded(tmp_path / "ck")
    source = _source.resolve(index)
    root = os.path.realpath(tmp_path / "ck")
    assert source.files == (
        os.path.join(root, "model-00001-of-00002.safetensors"),
        os.path.join(root, "model-00002-of-00002.safetensors"),
    )
    assert source.listing is not None and source.listing.read_map() == {
        "x": source.files[0],
        "y": source.files[1],
    }
    assert source.listing.agrees(source.files[0], ["x"]) and not source.listing.agrees(source.files[0], ["y"])
    assert source.description == str(index) and source.root == root


# --- 3. non-regular files --------------------------------------------------------------------------


def _is_fifo_error(exc: BaseException, path: Path, target: object = None) -> None:
    """The error names the FIFO, and what a symlink resolves to (``target``)."""
    msg = str(exc)
    assert isinstance(exc, CheckpointFormatError), repr(exc)
    kind = f"a FIFO, a symlink to {target}" if target is not None else "a FIFO"
    assert f"{path} is not a regular file ({kind})" in msg, msg
    assert REGULAR in msg, msg


@pytest.mark.parametrize("name", ["model.safetensors", "weights", "model.safetensors.index.json"])
def test_fifo_as_ckpt_path(tmp_path: Path, name: str) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    _is_fifo_error(raises_fast(lambda: _source.resolve(fifo), LoadError, (fifo,)), fifo)


def test_fifo_named_like_a_hub_id_is_not_downloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    os.mkfifo(tmp_path / "org" / "name")

    def no_hub(*args: object) -> str:
        raise AssertionError("a local FIFO was taken for a Hub repo id")

    monkeypatch.setattr(_source, "_from_hub", no_hub)
    exc = raises_fast(lambda: _source.resolve("org/name"), LoadError, (tmp_path / "org" / "name",))
    _is_fifo_error(exc, Path("org/name"))


def test_fifo_as_shard_in_directory(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    exc = raises_fast(lambda: _source.resolve(tmp_path), LoadError, (fifo,))
    _is_fifo_error(exc, Path(os.path.realpath(tmp_path)) / "model.safetensors")


def test_fifo_among_shards_without_index(tmp_path: Path) -> None:
    save(tmp_path / "a.safetensors", w=torch.ones(1))
    fifo = tmp_path / "b.safetensors"
    os.mkfifo(fifo)
    exc = raises_fast(lambda: _source.resolve(tmp_path), LoadError, (fifo,))
    _is_fifo_error(exc, Path(os.path.realpath(tmp_path)) / "b.safetensors")


def test_fifo_as_shard_named_by_index(tmp_path: Path) -> None:
    index = sharded(tmp_path)
    fifo = tmp_path / "model-00002-of-00002.safetensors"
    fifo.unlink()
    os.mkfifo(fifo)
    exc = raises_fast(lambda: _source.resolve(tmp_path), LoadError, (fifo,))
    _is_fifo_error(exc, Path(os.path.realpath(tmp_path)) / fifo.name)
    assert str(index) in str(exc)  # which index named it


def test_fifo_as_index_in_directory(tmp_path: Path) -> None:
    save(tmp_path / "s.safetensors", w=torch.ones(1))
    fifo = tmp_path / "model.safetensors.index.json"
    os.mkfifo(fifo)
    exc = raises_fast(lambda: _source.resolve(tmp_path), LoadError, (fifo,))
    _is_fifo_error(exc, fifo)


def test_symlink_to_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "model.safetensors"
    link.symlink_to(fifo)
    _is_fifo_error(raises_fast(lambda: _source.resolve(link), LoadError, (fifo,)), link, fifo)
    _is_fifo_error(raises_fast(lambda: read_header(str(link)), LoadError, (fifo,)), link, fifo)
    _is_fifo_error(raises_fast(lambda: OpenFile.open(str(link)), LoadError, (fifo,)), link, fifo)


def test_read_header_and_open_refuse_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    _is_fifo_error(raises_fast(lambda: read_header(str(fifo)), LoadError, (fifo,)), fifo)
    _is_fifo_error(raises_fast(lambda: OpenFile.open(fifo), LoadError, (fifo,)), fifo)
    _is_fifo_error(raises_fast(lambda: open_files([str(fifo)]), LoadError, (fifo,)), fifo)


def test_swapped_for_fifo_after_stat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path passes os.stat as a regular file, then is a FIFO when opened: O_NONBLOCK keeps
    open() from blocking, and fstat on the descriptor catches it."""
    regular = small(tmp_path / "real.safetensors")
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    real_stat = os.stat

    def stale_stat(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> os.stat_result:
        return real_stat(regular if os.fspath(path) == str(fifo) else path, *args, **kwargs)

    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    monkeypatch.setattr(_files.os, "stat", stale_stat)  # os.stat itself, for this test only
    _is_fifo_error(raises_fast(lambda: OpenFile.open(str(fifo)), LoadError, (fifo,)), fifo)
    monkeypatch.undo()
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds  # the FIFO's descriptor was closed


def test_directory_where_a_file_is_expected(tmp_path: Path) -> None:
    index = sharded(tmp_path)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.unlink()
    shard.mkdir()
    with pytest.raises(CheckpointFormatError) as e:
        _source.resolve(tmp_path)
    msg = str(e.value)
    assert all(w in msg for w in (str(index), shard.name, "is not a regular file (a directory)")), msg
    assert "name a .safetensors file" in msg
    with pytest.raises(CheckpointFormatError, match=r"is not a regular file \(a directory\)"):
        OpenFile.open(shard)
    with pytest.raises(CheckpointFormatError, match=r"is not a regular file \(a directory\)"):
        read_header(str(shard))


def test_directory_named_like_an_index(tmp_path: Path) -> None:
    save(tmp_path / "s.safetensors", w=torch.ones(1))
    (tmp_path / "model.safetensors.index.json").mkdir()
    with pytest.raises(CheckpointFormatError) as e:
        _source.resolve(tmp_path)
    assert "model.safetensors.index.json is not a regular file (a directory)" in str(e.value)


def test_socket_as_ckpt_path(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    if len(str(path)) > 100:
        pytest.skip("tmp_path too long for an AF_UNIX socket")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        for call in (lambda: _source.resolve(path), lambda: read_header(str(path))):
            exc = raises_fast(call, CheckpointFormatError)
            assert f"{path} is not a regular file (a socket)" in str(exc) and REGULAR in str(exc)


def test_device_as_ckpt_path(tmp_path: Path) -> None:
    if not os.path.exists("/dev/null") or not stat.S_ISCHR(os.stat("/dev/null").st_mode):
        pytest.skip("no /dev/null character device")
    link = tmp_path / "model.safetensors"
    link.symlink_to("/dev/null")
    for call in (lambda: _source.resolve(link), lambda: read_header(str(link))):
        exc = raises_fast(call, CheckpointFormatError)
        expected = f"{link} is not a regular file (a character device, a symlink to /dev/null)"
        assert expected in str(exc) and REGULAR in str(exc), str(exc)


def test_dangling_symlink_is_not_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").symlink_to(tmp_path / "gone")
    monkeypatch.setattr(_source, "_from_hub", lambda *a: pytest.fail("took a dangling link for a Hub id"))
    with pytest.raises(CheckpointNotFoundError) as e:
        _source.resolve("org/name")
    assert all(w in str(e.value) for w in ("'org/name'", "symlink", "gone", "Fix the link"))


# --- 4. precedence: model.safetensors over the index ------------------------------------------------


def test_single_file_wins_over_index(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    index = sharded(tmp_path)  # keys x, y in two shards
    save(tmp_path / "model.safetensors", other=torch.full((5,), 7.0))  # different contents
    with caplog.at_level(logging.INFO, logger="rank0load.checkpoint._source"):
        source = _source.resolve(tmp_path)
    root = os.path.realpath(tmp_path)
    assert source.files == (os.path.join(root, "model.safetensors"),)
    assert source.listing is None
    assert source.description == str(tmp_path) and source.root == root
    assert set(_source.read_headers(source)) == {"other"}
    records = [r for r in caplog.records if r.name == "rank0load.checkpoint._source"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    text = records[0].getMessage()
    assert all(w in text for w in ("loading model.safetensors", "ignoring the index", index.name)), text


def test_index_used_without_single_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sharded(tmp_path)
    with caplog.at_level(logging.INFO, logger="rank0load.checkpoint._source"):
        source = _source.resolve(tmp_path)
    assert source.listing is not None and len(source.files) == 2
    assert not [r for r in caplog.records if r.name == "rank0load.checkpoint._source"]


def test_single_file_alone_logs_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    small(tmp_path / "model.safetensors")
    save(tmp_path / "extra.safetensors", z=torch.ones(1))  # model.safetensors wins, as before
    with caplog.at_level(logging.INFO, logger="rank0load.checkpoint._source"):
        source = _source.resolve(tmp_path)
    assert [os.path.basename(f) for f in source.files] == ["model.safetensors"]
    assert not [r for r in caplog.records if r.name == "rank0load.checkpoint._source"]


# --- 5. OpenFile: open once, notice changes ---------------------------------------------------------


def test_open_file_identity_and_close(tmp_path: Path) -> None:
    path = small(tmp_path / "model.safetensors")
    with OpenFile.open(path) as f:
        st = os.stat(path)
        assert f.path == str(path)
        assert f.identity == FileIdentity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        flags = os.get_blocking(f.fd), os.get_inheritable(f.fd)
        assert flags == (False, False)  # O_NONBLOCK, O_CLOEXEC
        tensors = read_header(f)  # read through the descriptor, which stays open
        assert set(tensors) == {"a", "b"} and tensors["a"].file == str(path)
        f.check()
        f.check()  # no false positive: nothing changed
        fd = f.fd
    assert f.fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)
    f.close()  # idempotent


def test_open_file_missing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError) as e:
        OpenFile.open(tmp_path / "nope.safetensors")
    assert all(w in str(e.value) for w in ("nope.safetensors", "cannot open", "No such file", "Check that"))


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_open_file_unreadable(tmp_path: Path) -> None:
    path = small(tmp_path / "model.safetensors")
    path.chmod(0)
    with pytest.raises(CheckpointNotFoundError) as e:
        OpenFile.open(path)
    assert all(w in str(e.value) for w in ("model.safetensors", "Permission denied", "readable"))


def _rewrite_in_place(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        old = f.read(4)
        f.seek(-4, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in old))


def _changed(f: OpenFile, *words: str) -> str:
    with pytest.raises(CheckpointChangedError) as e:
        f.check()
    msg = str(e.value)
    assert isinstance(e.value, LoadError)
    assert all(w in msg for w in (f.path, CHANGED, *words)), msg
    return msg


def test_check_rewrite_same_size_with_utime(tmp_path: Path) -> None:
    path = small(tmp_path / "model.safetensors")
    with OpenFile.open(path) as f:
        _rewrite_in_place(path)
        ns = f.identity.mtime_ns + 5_000_000_000  # robust to coarse timestamps
        os.utime(path, ns=(ns, ns))
        msg = _changed(f, "rewritten: mtime changed")
        assert f"size {f.identity.size} ->" not in msg and "replaced:" not in msg


def test_check_rewrite_same_size_by_mtime_alone(tmp_path: Path) -> None:
    path = small(tmp_path / "model.safetensors")
    with OpenFile.open(path) as f:
        before = os.stat(path).st_mtime_ns
        _rewrite_in_place(path)
        if os.stat(path).st_mtime_ns == before:
            pytest.skip("this filesystem's mtime did not move on a write within one clock tick")
        _changed(f, "rewritten: mtime changed")


def test_check_truncation(tmp_path: Path) -> None:
    path = small(tmp_path / "model.safetensors")
    with OpenFile.open(path) as f:
        size = f.identity.size
        os.truncate(path, size - 10)
        _changed(f, f"size {size} -> {size - 10}")
        with pytest.raises(CheckpointChangedError):
            read_header(f)  # the header is not read from a file that changed since open


def test_check_replaced_by_rename(tmp_path: Path) -> None:
    path = small(tmp_path / "model.safetensors")
    with OpenFile.open(path) as f:
        new = small(tmp_path / "new.safetensors", fill=2.0)  # same size, new inode
        new_ino = os.stat(new).st_ino
        os.replace(new, path)
        msg = _changed(f, f"replaced: inode {f.identity.ino} -> {new_ino}")
        assert f"size {f.identity.size} ->" not in msg  # the descriptor still sees the old file


def test_check_removed(tmp_path: Path) -> None:
    path = small(tmp_path / "model.safetensors")
    with OpenFile.open(path) as f:
        path.unlink()
        _changed(f, "removed")


def test_check_after_close_is_a_bug() -> None:
    f = OpenFile("x", -1, FileIdentity(0, 0, 0, 0))
    with pytest.raises(ValueError, match="closed"):
        f.check()


def test_open_files_opens_each_once_and_closes_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = str(small(tmp_path / "a.safetensors")), str(small(tmp_path / "b.safetensors"))
    files = open_files([a, b, a])
    try:
        assert list(files) == [a, b] and all(f.fd >= 0 for f in files.values())
    finally:
        for f in files.values():
            f.close()

    opened: list[OpenFile] = []
    real_open = OpenFile.open.__func__  # type: ignore[attr-defined]

    def recording(cls: type[OpenFile], path: str) -> OpenFile:
        f = real_open(cls, path)
        opened.append(f)
        return f

    monkeypatch.setattr(OpenFile, "open", classmethod(recording))
    with pytest.raises(CheckpointNotFoundError, match="missing.safetensors"):
        open_files([a, b, str(tmp_path / "missing.safetensors")])
    assert len(opened) == 2 and all(f.fd == -1 for f in opened)


def test_headers_read_through_open_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """_source.read_headers(source, files) reads by descriptor and never opens by path."""
    sharded(tmp_path)
    source = _source.resolve(tmp_path)
    files = open_files(source.files)
    try:

        def refuse(*args: object) -> None:
            raise AssertionError("re-opened a checkpoint file by path")

        monkeypatch.setattr(OpenFile, "open", refuse)
        found = _source.read_headers(source, files)
        assert set(found) == {"x", "y"}
        assert found["x"].file == source.files[0] and found["y"].file == source.files[1]
    finally:
        for f in files.values():
            f.close()
    monkeypatch.undo()
    assert set(_source.read_headers(source, None)) == {"x", "y"}  # the listing is not used up
    assert set(_source.read_headers(_source.resolve(tmp_path))) == {"x", "y"}  # by path, as before


def test_index_listing_a_missing_key(tmp_path: Path) -> None:
    """The index kept as counts and hash sums still names the key it lists that no file holds, read
    from the index again; and if the index no longer lists it by then, says the index changed."""
    from rank0load.errors import CheckpointChangedError

    sharded(tmp_path)
    names = {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}
    write_index(tmp_path, {**names, "z": "model-00002-of-00002.safetensors"})
    source = _source.resolve(tmp_path)
    with pytest.raises(
        CheckpointFormatError, match=r"index lists key 'z' in model-00002-of-00002.safetensors, but no file"
    ):
        _source.read_headers(source)
    write_index(tmp_path, names)  # rewritten after it was resolved
    with pytest.raises(CheckpointChangedError, match="the index changed while the checkpoint was loaded"):
        _source.read_headers(source)


# --- content_digest: what a host compares its own copy with (readers="host") --------------------------------


def _digest(path: Path) -> bytes:
    with OpenFile.open(path) as f:
        return _files.content_digest(f.fd, f.identity.size, f.path)


@pytest.mark.parametrize("mib", [0, 1])  # data read whole; data sampled (16 blocks of 4 KiB)
def test_content_digest_tells_copies_from_other_files(tmp_path: Path, mib: int) -> None:
    from safetensors.torch import save_file

    n = max(64, (mib << 20) // 4)
    save_file(
        {"a": torch.arange(n, dtype=torch.float32), "b": torch.ones(3)}, str(tmp_path / "x.safetensors")
    )
    x = tmp_path / "x.safetensors"
    raw = x.read_bytes()
    (tmp_path / "copy.safetensors").write_bytes(raw)
    assert _digest(tmp_path / "copy.safetensors") == _digest(x)  # another inode, mtime: the same file
    header = 8 + int.from_bytes(raw[:8], "little")
    other = bytearray(raw)
    other[header:] = bytes((b + 1) % 256 for b in raw[header:])  # other values, the same header and size
    (tmp_path / "other.safetensors").write_bytes(bytes(other))
    renamed = raw.replace(b'"b"', b'"c"')  # another tensor name: the header differs
    (tmp_path / "renamed.safetensors").write_bytes(renamed)
    (tmp_path / "short.safetensors").write_bytes(raw[: len(raw) // 2])
    digests = {_digest(tmp_path / f"{name}.safetensors") for name in ("other", "renamed", "short")}
    assert len(digests) == 3 and _digest(x) not in digests


def test_content_digest_of_a_file_that_ends_early(tmp_path: Path) -> None:
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x03")
    assert len(_digest(path)) == 16  # shorter than a header's length: what there is
    with OpenFile.open(path) as f, pytest.raises(CheckpointChangedError, match="ended after 1 bytes"):
        _files.content_digest(f.fd, 100, f.path)  # it shrank since its size was taken
