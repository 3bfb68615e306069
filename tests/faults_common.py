"""Machinery of the fault corpus, shared by tests/checkpoint/test_faults_format.py and tests/load/test_faults_{model,ranks}.py.

Each family file lists its cases; a ``Case`` builds a broken checkpoint (or names a broken model_fn /
shard_fn / key_map) from a good toy checkpoint in its own directory. ``run_corpus`` runs all of a
family's cases in ONE pair of gloo ranks, one after the other in the same process group, then a good
load that must be bit-exact: so every case also proves that the process group is still usable after
the failure, and a family costs one 2-rank spawn however many cases it has. The parametrised test in
each family file reports each case on its own (``check_fault``).

While loading, an audit hook on every rank records any attempt to open a checkpoint file for
writing or to rename / remove / truncate / chmod anything under the checkpoint tree; afterwards
every file's bytes and mtime are compared with a snapshot taken before (``check_never_written``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests import _dist
from tests.models import assert_same, gather, save_state, toy, toy_state, trained_toy

PG_TIMEOUT = 30.0  # seconds; every failing case must finish well within it
CASE_LIMIT = 10.0  # seconds one failing case may take on a rank (they take well under one)
REDO = ("Re-download", "re-save", "Re-save", "re-download")  # what a message about a broken file says


# --------------------------------------------------------------------------------------------
# Building broken checkpoints.


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_st(path: str) -> tuple[dict, bytes]:
    raw = read_bytes(path)
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_st(
    path: str,
    header: dict | list | None,
    data: bytes,
    *,
    header_bytes: bytes | None = None,
    length: int | None = None,
) -> None:
    hb = header_bytes if header_bytes is not None else json.dumps(header, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb) if length is None else length) + hb + data)


def good_state() -> dict[str, torch.Tensor]:
    """The trained toy's state dict as save_model stores it (head.weight is an alias of emb.weight)."""
    return toy_state()


def single(d: str, sd: dict | None = None) -> str:
    """``d``/model.safetensors holding ``sd`` (default: the good state); returns its path."""
    path = os.path.join(d, "model.safetensors")
    save_file(sd if sd is not None else good_state(), path)
    return path


def without(key: str) -> Callable[[str], str]:
    """A builder: the good checkpoint less ``key``."""

    def build(d: str) -> str:
        sd = good_state()
        del sd[key]
        return single(d, sd)

    return build


# --------------------------------------------------------------------------------------------
# The corpus.


@dataclass
class Case:
    id: str
    build: Callable[[str], str]  # case directory -> ckpt_path
    error: str  # the LoadError subclass every rank must raise
    names: tuple[str, ...]  # the message must name these (file, key, expected / found)
    todo: tuple[str, ...]  # ... and say what to do: one of these
    kwargs: dict = field(default_factory=dict)
    fault: str | None = None  # a failure injected after validation (see _inject)


@contextlib.contextmanager
def _inject(fault: str | None, rank: int):
    """Failures that cannot be validated up front: a read error while rank 0 streams, or the
    allocation's fault-in failing on one rank."""
    if fault is None:
        yield
        return
    if fault == "eio_on_rank0":
        import rank0load.load._readahead as reads_mod

        original = reads_mod.read_vectored
        calls = [0]

        def failing_read_vectored(fd, buf, offset, path):
            calls[0] += 1
            if calls[0] == 3:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return original(fd, buf, offset, path)

        if rank == 0:  # its reader thread, or its own reads when every rank reads locally
            reads_mod.read_vectored = failing_read_vectored
        try:
            yield
        finally:
            reads_mod.read_vectored = original
        return
    if fault == "fault_in_fails_on_rank1":  # the shards' pages, faulted in behind the manifest
        import rank0load.common._memory as memory_mod

        fill = memory_mod._fill

        def failing_fill(pages, t) -> None:
            raise MemoryError("faulting a shard in failed on purpose on rank 1")

        if rank == 1:
            memory_mod._fill = failing_fill
        try:
            yield
        finally:
            memory_mod._fill = fill
        return
    raise ValueError(fault)


# --------------------------------------------------------------------------------------------
# What the ranks run.


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_MUTATING_EVENTS = {
    "os.rename",
    "os.remove",
    "os.rmdir",
    "os.truncate",
    "os.chmod",
    "os.chown",
    "os.utime",
    "os.link",
    "os.symlink",
    "os.mkdir",
    "shutil.rmtree",
    "shutil.move",
    "shutil.copyfile",
}


def _watch(roots: list[str], never_open: list[str]) -> list[tuple]:
    """Install an audit hook recording writes and metadata changes under ``roots``, and any open at
    all under ``never_open`` (files an index points to outside its directory)."""
    seen: list[tuple] = []
    roots = [os.path.realpath(r) for r in roots]
    never_open = [os.path.realpath(r) for r in never_open]

    def under(p: object, dirs: list[str] = roots) -> bool:
        if isinstance(p, bytes):
            p = os.fsdecode(p)
        if not isinstance(p, (str, os.PathLike)):
            return False
        full = os.path.realpath(os.fspath(p))
        return any(full == r or full.startswith(r + os.sep) for r in dirs)

    def hook(event: str, args: tuple) -> None:
        try:
            if event == "open" and args and under(args[0], never_open):
                seen.append(("open-outside", os.fspath(args[0])))
            if event == "open" and len(args) >= 3 and isinstance(args[2], int) and args[2] & _WRITE_FLAGS:
                if under(args[0]):
                    seen.append((event, os.fspath(args[0]), args[2]))
            elif event in _MUTATING_EVENTS and any(under(a) for a in args):
                seen.append((event, *[os.fspath(a) for a in args if isinstance(a, (str, os.PathLike))]))
        except Exception:
            pass

    sys.addaudithook(hook)
    return seen


def _corpus(
    rank: int, world: int, cases: list[tuple], good: str, ckpt_root: str, probe_root: str, progress: str
) -> dict:
    import rank0load

    outside = [os.path.join(ckpt_root, n) for n in os.listdir(ckpt_root) if n.endswith("-outside")]
    seen = _watch([ckpt_root, probe_root], [*outside, probe_root])
    with open(os.path.join(probe_root, f"probe{rank}"), "w") as f:  # proves the hook sees writes
        f.write("x")
    read_bytes(os.path.join(probe_root, f"probe{rank}"))  # ... and reads where nothing may be read
    out: dict[str, Any] = {"cases": {}}
    for cid, path, kwargs, fault in cases:
        with open(progress + f".rank{rank}", "a") as f:
            f.write(cid + "\n")
        kwargs = dict(kwargs)
        model_fn = kwargs.pop("model_fn", toy)
        started = time.monotonic()
        try:
            with _inject(fault, rank):
                rank0load.load_sharded(model_fn, path, **kwargs)
            out["cases"][cid] = ("returned", (), "", time.monotonic() - started)
        except Exception as exc:
            names = tuple(c.__name__ for c in type(exc).__mro__)
            out["cases"][cid] = (type(exc).__name__, names, str(exc), time.monotonic() - started)
    with open(progress + f".rank{rank}", "a") as f:
        f.write("good load\n")
    try:
        out["good"] = gather(rank0load.load_sharded(toy, good))
    except Exception as exc:
        out["good"] = f"{type(exc).__name__}: {exc}"
    out["writes"] = list(seen)
    return out


def _snapshot(root: str) -> dict[str, tuple]:
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        snap[dirpath] = ("dir", os.lstat(dirpath).st_mtime_ns, tuple(sorted(dirnames + filenames)))
        for name in filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if os.path.islink(p):
                snap[p] = ("link", os.readlink(p), st.st_mtime_ns)
            else:
                snap[p] = ("file", hashlib.sha256(read_bytes(p)).hexdigest(), st.st_mtime_ns, st.st_mode)
    return snap


def run_corpus(tmp_path_factory: pytest.TempPathFactory, cases: list[Case]) -> dict:
    """Build every case's checkpoint, run them all on 2 ranks in one process group, then a good load.

    Returns ``results`` (one dict per rank: each case's outcome, the good load, the audited writes)
    and snapshots of the checkpoint tree ``before`` and ``after``."""
    base = tmp_path_factory.mktemp("faults")
    ckpt_root, probe_root = base / "ckpts", base / "probe"
    ckpt_root.mkdir()
    probe_root.mkdir()
    runs = []
    for i, case in enumerate(cases):
        d = ckpt_root / f"c{i:02d}"  # a neutral name: a message must not pass by quoting the case id
        d.mkdir()
        runs.append((case.id, case.build(str(d)), case.kwargs, case.fault))
    good_dir = ckpt_root / "good"  # inside the audited tree: the good load must not write either
    good_dir.mkdir()
    good = str(good_dir / "model.safetensors")
    save_state(trained_toy(), good)
    before = _snapshot(str(ckpt_root))
    progress = str(base / "progress")
    try:
        results = _dist.run(
            _corpus,
            2,
            runs,
            good,
            str(ckpt_root),
            str(probe_root),
            progress,
            timeout=180,
            pg_timeout=PG_TIMEOUT,
        )
    except pytest.fail.Exception as exc:
        last = {}
        for r in range(2):
            p = f"{progress}.rank{r}"
            last[r] = read_bytes(p).decode().split()[-1:] if os.path.exists(p) else []
        pytest.fail(f"{exc}; last case started per rank: {last}")
    return {"results": _dist.ok(results), "before": before, "after": _snapshot(str(ckpt_root))}


# --------------------------------------------------------------------------------------------
# What every family checks.


def check_fault(corpus: dict, case: Case) -> None:
    """Every rank raised the same LoadError subclass, fast, naming what is wrong and what to do."""
    outcomes = [r["cases"][case.id] for r in corpus["results"]]
    for rank, (type_name, bases, message, seconds) in enumerate(outcomes):
        assert type_name != "returned", f"rank {rank} loaded without error"
        assert "LoadError" in bases, f"rank {rank} raised {type_name}, not a LoadError: {message}"
        assert case.error in bases, f"rank {rank} raised {type_name}, expected {case.error}: {message}"
        assert seconds < CASE_LIMIT, f"rank {rank} took {seconds:.1f} s to fail"
    messages = {o[2] for o in outcomes}
    assert len(messages) == 1, f"ranks raised different messages: {messages}"
    (message,) = messages
    for needle in case.names:
        assert needle in message, f"message does not name {needle!r}: {message}"
    assert any(t in message for t in case.todo), f"message does not say what to do ({case.todo}): {message}"


def check_never_written(corpus: dict) -> None:
    """No rank opened a checkpoint file for writing or changed anything under the checkpoint tree."""
    writes = [w for r in corpus["results"] for w in r["writes"]]
    probes = [w for w in writes if w[0] == "open" and "probe" in w[1]]
    assert len(probes) == 2, f"the audit hook did not see the probe writes: {writes}"
    assert [w for w in writes if w not in probes and w[0] != "open-outside"] == [], (
        "the loader wrote to the checkpoint"
    )
    assert corpus["after"] == corpus["before"], "checkpoint files, links or mtimes changed"


def check_good_load(corpus: dict, want: dict[str, torch.Tensor]) -> None:
    """After every failing case, in the same process group, a good load is bit-exact."""
    for rank, r in enumerate(corpus["results"]):
        assert isinstance(r["good"], dict), f"rank {rank}: the good load failed: {r['good']}"
        assert_same(r["good"], want)
