"""The rank protocol under failure: every failure is the same clear error on every rank, promptly,
and the process group stays usable (a good load follows each case in the same group).

One 2-rank process group runs every case in turn: a file rewritten, replaced or truncated while
rank 0 streams it; a local exception inside the stream on a receiver (a cast) and on rank 0 (a
copy into its own shard); staging that cannot be allocated on one rank; arguments that differ
between ranks; FIFOs where files should be. A separate 3-rank test loads zero-width parameters.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

from tests import _dist
from tests.models import assert_same, gather, reference, save_state, toy, trained_toy

pytestmark = pytest.mark.torch_range  # its slow tests run on the torch-range CI legs too

CASE_LIMIT = 15.0  # seconds; the process-group timeout is 60 s, so a hang cannot pass


def _changer(path: str, how: str):
    """A read_vectored for rank 0 that changes ``path`` (as another writer would) before its 3rd read,
    for its reader thread (``_readahead``) and for its own reads when every rank reads locally
    (``_localread``)."""
    import rank0load.load._readahead as reads_mod

    original = reads_mod.read_vectored
    calls = [0]

    def read_vectored(fd, buf, offset, where):
        calls[0] += 1
        if calls[0] == 3:
            if how == "rewritten":  # same size, other bytes, in place
                with open(path, "r+b") as f:
                    f.seek(-16, os.SEEK_END)
                    f.write(b"\x7f" * 16)
                st = os.stat(path)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
            elif how == "replaced":  # a new file renamed over the old one
                save_state(trained_toy(seed=9), path + ".new")
                os.replace(path + ".new", path)
            elif how == "truncated":
                os.truncate(path, os.path.getsize(path) // 2)
        return original(fd, buf, offset, where)

    return (reads_mod,), original, read_vectored


def _attempt(fn) -> tuple:
    started = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return (
            type(exc).__name__,
            tuple(c.__name__ for c in type(exc).__mro__),
            str(exc),
            time.monotonic() - started,
        )
    return ("returned", (), "", time.monotonic() - started)


def _cases(rank: int, world: int, root: str, good: str) -> dict:
    import rank0load
    import rank0load.load._sink as transfer

    out: dict = {}

    def good_load() -> dict:
        return gather(rank0load.load_sharded(toy, good))

    # A file changing under the load, seen by rank 0 alone; the other ranks learn it at once. Rank 0
    # streams (local_reads=False), or reads its own share while rank 1 reads its own (the default).
    for how in ("rewritten", "replaced", "truncated"):
        for local_reads, case in ((False, how), (True, how + "/local")):
            path = os.path.join(root, f"{how}.safetensors")
            mods: tuple = ()
            if rank == 0:
                save_state(trained_toy(), path)  # whole again, for the second way
                mods, original, changer = _changer(path, how)
                for mod in mods:
                    mod.read_vectored = changer
            torch.distributed.barrier()
            try:
                out[case] = _attempt(
                    lambda: rank0load.load_sharded(toy, path, max_staging_bytes=4096, local_reads=local_reads)
                )
            finally:
                for mod in mods:
                    mod.read_vectored = original
            out[case + ":good"] = good_load()

    # Local exceptions inside the stream: a receiver's cast, rank 0's copy into its own shard.
    bf16 = os.path.join(root, "bf16.safetensors")
    for victim in (1, 0):
        original_cast = transfer.Sink.write  # casting or dequantising into the target
        calls = [0]

        def failing_cast(*args, _original=original_cast):
            calls[0] += 1
            if calls[0] == 4:
                raise RuntimeError("injected cast failure")
            return _original(*args)

        if rank == victim:
            transfer.Sink.write = failing_cast
        try:
            out[f"cast_fails_on_rank{victim}"] = _attempt(
                lambda: rank0load.load_sharded(toy, bf16, max_staging_bytes=4096)
            )
        finally:
            transfer.Sink.write = original_cast
        out[f"cast_fails_on_rank{victim}:good"] = good_load()

    # Staging that cannot be allocated on one rank.
    original_alloc = transfer.allocate_staging

    def no_staging(*args):
        raise RuntimeError("injected allocation failure")

    if rank == 1:
        transfer.allocate_staging = no_staging
    try:
        out["staging_fails_on_rank1"] = _attempt(lambda: rank0load.load_sharded(toy, good))
    finally:
        transfer.allocate_staging = original_alloc
    out["staging_fails_on_rank1:good"] = good_load()

    # Arguments that differ between ranks, or are bad on one rank only.
    arguments = {
        "strict_differs": {"strict": rank == 0},
        "staging_too_small_on_rank1": {"max_staging_bytes": 100 if rank == 1 else 1 << 20},
        "staging_not_int_on_rank1": {"max_staging_bytes": "16MiB" if rank == 1 else 1 << 20},
        "staging_differs": {"max_staging_bytes": (1 << 20) * (rank + 1)},
        "dtype_not_floating_on_rank0": {"dtype": torch.int32 if rank == 0 else None},
        "dtype_differs": {"dtype": torch.bfloat16 if rank == 1 else None},
    }
    for name, kwargs in arguments.items():
        out[name] = _attempt(lambda: rank0load.load_sharded(toy, good, **kwargs))
        out[name + ":good"] = good_load()

    # Non-regular files: rank 0 must not block in open().
    for name in ("fifo_path", "fifo_dir", "fifo_shard"):
        out[name] = _attempt(lambda: rank0load.load_sharded(toy, os.path.join(root, name)))
    out["fifo:good"] = good_load()

    # Header and index edge cases: format errors, worded as such, on every rank.
    for name in HEADER_CASES:
        out[name] = _attempt(lambda: rank0load.load_sharded(toy, os.path.join(root, name)))
    out["header:good"] = good_load()

    # model.safetensors beside an index of stale shards: the single file wins, as in transformers.
    out["precedence"] = gather(rank0load.load_sharded(toy, os.path.join(root, "both")))
    return out


def _write_fifos(root: str) -> None:
    os.mkfifo(os.path.join(root, "fifo_path"))
    os.makedirs(os.path.join(root, "fifo_dir"))
    os.mkfifo(os.path.join(root, "fifo_dir", "model.safetensors"))
    shard = os.path.join(root, "fifo_shard")
    os.makedirs(shard)
    save_state(trained_toy(), os.path.join(shard, "model-00001-of-00002.safetensors"))
    os.mkfifo(os.path.join(shard, "model-00002-of-00002.safetensors"))
    import json

    from safetensors import safe_open

    with safe_open(os.path.join(shard, "model-00001-of-00002.safetensors"), "pt") as f:
        keys = list(f.keys())
    weight_map = {k: "model-00001-of-00002.safetensors" for k in keys[1:]}
    weight_map[keys[0]] = "model-00002-of-00002.safetensors"
    with open(os.path.join(shard, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _raw(path: str, header: str, data: bytes = b"") -> None:
    import struct

    raw = header.encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


HEADER_CASES = {
    "huge_number": ("number too long to parse",),
    "deep_header": ("nested too deeply",),
    "key_twice": ("'w' is stored twice",),
    "index_lists": ("model.safetensors.index.json", "weight_map"),
}


def _write_headers(root: str) -> None:
    import json

    _raw(
        os.path.join(root, "huge_number"),
        '{"w": {"dtype": "F32", "shape": [' + "1" * 5000 + '], "data_offsets": [0, 4]}}',
    )
    _raw(os.path.join(root, "deep_header"), '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    _raw(os.path.join(root, "key_twice"), '{"w": ' + entry + ', "w": ' + entry + "}", b"\0" * 4)
    d = os.path.join(root, "index_lists")
    os.makedirs(d)
    save_state(trained_toy(), os.path.join(d, "model-00001-of-00001.safetensors"))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"emb.weight": ["model-00001-of-00001.safetensors"]}}, f)
    both = os.path.join(root, "both")
    os.makedirs(both)
    save_state(trained_toy(), os.path.join(both, "model.safetensors"))
    save_state(trained_toy(seed=5), os.path.join(both, "model-00001-of-00001.safetensors"))
    from safetensors import safe_open

    with safe_open(os.path.join(both, "model-00001-of-00001.safetensors"), "pt") as f:
        keys = list(f.keys())
    with open(os.path.join(both, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": dict.fromkeys(keys, "model-00001-of-00001.safetensors")}, f)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("protocol"))
    good = os.path.join(root, "good.safetensors")
    save_state(trained_toy(), good)
    for how in ("rewritten", "replaced", "truncated"):
        save_state(trained_toy(), os.path.join(root, f"{how}.safetensors"))
    save_state(trained_toy(), os.path.join(root, "bf16.safetensors"), dtype=torch.bfloat16)
    _write_fifos(root)
    _write_headers(root)
    results = _dist.ok(_dist.run(_cases, 2, root, good, timeout=600, pg_timeout=60))
    return results


def _same_everywhere(results: list[dict], case: str, cls: str) -> str:
    got = [r[case] for r in results]
    for rank, (name, bases, message, seconds) in enumerate(got):
        assert name != "returned", f"{case}: rank {rank} loaded without error"
        assert cls in bases, f"{case}: rank {rank} raised {name}, not {cls}: {message}"
        assert seconds < CASE_LIMIT, f"{case}: rank {rank} took {seconds:.1f} s to fail"
    messages = {g[2] for g in got}
    assert len(messages) == 1, f"{case}: ranks raised different messages: {messages}"
    assert len({g[0] for g in got}) == 1
    message = messages.pop()
    assert "died or stalled" not in message, f"{case}: worded as a peer death: {message}"
    assert not any(good is None for good in [r.get(case + ":good", {}) for r in results])
    return message


def _good_after(results: list[dict], case: str) -> None:
    want = reference(trained_toy())
    for r in results:
        assert_same(r[case + ":good"], want)


@pytest.mark.parametrize("local", ["", "/local"])
@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("rewritten", ("rewritten.safetensors", "changed during the load", "load again")),
        ("replaced", ("replaced.safetensors", "replaced", "load again")),
        ("truncated", ("truncated.safetensors",)),
    ],
)
def test_file_changed_while_streaming_fails_every_rank(outcomes, case, words, local):
    case += local
    message = _same_everywhere(outcomes, case, "LoadError")
    for w in words:
        assert w in message, f"{case}: message lacks {w!r}: {message}"
    _good_after(outcomes, case)


def test_file_rewritten_or_replaced_is_a_checkpoint_changed_error(outcomes):
    for case in ("rewritten", "replaced", "rewritten/local", "replaced/local"):
        assert outcomes[0][case][0] == "CheckpointChangedError", outcomes[0][case]


@pytest.mark.parametrize("victim", [1, 0])
def test_local_exception_in_the_stream_reaches_every_rank_with_its_cause(outcomes, victim):
    """Not "another rank probably died": the failing rank, the exception's type and message."""
    case = f"cast_fails_on_rank{victim}"
    message = _same_everywhere(outcomes, case, "LoadError")
    assert f"rank {victim}" in message and "RuntimeError: injected cast failure" in message, message
    assert "process group is still usable" in message, message
    _good_after(outcomes, case)


def test_staging_allocation_failing_on_one_rank_fails_every_rank(outcomes):
    message = _same_everywhere(
        outcomes, "staging_fails_on_rank1", "InternalError"
    )  # ours, not a disagreement
    assert "rank 1" in message and "RuntimeError: injected allocation failure" in message, message
    _good_after(outcomes, "staging_fails_on_rank1")


@pytest.mark.parametrize(
    ("case", "cls", "words"),
    [
        ("strict_differs", "RankMismatchError", ("strict=False here but True on rank 0", "ranks [1]")),
        ("staging_too_small_on_rank1", "LoadError", ("max_staging_bytes=100", "rank 1", "at least 512")),
        ("staging_not_int_on_rank1", "LoadError", ("'16MiB'", "not an int", "rank 1")),
        ("staging_differs", "RankMismatchError", ("max_staging_bytes=2097152 here but 1048576 on rank 0",)),
        ("dtype_not_floating_on_rank0", "LoadError", ("torch.int32", "not a floating", "rank 0")),
        ("dtype_differs", "RankMismatchError", ("dtype=torch.bfloat16 here but None on rank 0",)),
    ],
)
def test_arguments_that_differ_between_ranks(outcomes, case, cls, words):
    message = _same_everywhere(outcomes, case, cls)
    for w in words:
        assert w in message, f"{case}: message lacks {w!r}: {message}"
    _good_after(outcomes, case)


@pytest.mark.parametrize("case", ["fifo_path", "fifo_dir", "fifo_shard"])
def test_fifo_never_blocks_rank0(outcomes, case):
    message = _same_everywhere(outcomes, case, "CheckpointFormatError")
    assert "not a regular file" in message and "FIFO" in message, message


def test_good_load_after_fifos(outcomes):
    _good_after(outcomes, "fifo")


# ---------------------------------------------------------------------------------------------
# Zero-width parameters.


class Thin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.empty_in = nn.Linear(0, 5)  # weight [5, 0]
        self.empty_out = nn.Linear(4, 0)  # weight [0, 4], bias [0]
        self.fc = nn.Linear(4, 7)
        self.nothing = nn.Parameter(torch.empty(3, 0, 2))


def thin() -> Thin:
    return Thin()


def _thin(rank: int, world: int, path: str) -> dict:
    import rank0load

    model = rank0load.load_sharded(thin, path)
    # torch 2.13's full_tensor() fails on a zero-size dimension sharded 3 ways (its unpad check):
    # a tensor with no elements is checked by its shape and dtype alone.
    empty = {n: torch.empty(p.shape, dtype=p.dtype) for n, p in model.named_parameters() if p.numel() == 0}
    for name in empty:
        module, _, leaf = name.rpartition(".")
        delattr(model.get_submodule(module) if module else model, leaf)
    out = gather(model)
    out.update(empty)
    return {"tensors": out, "whole": model.rank0load_report.broadcast_whole}


@pytest.mark.parametrize("world", [2, 3])
def test_zero_width_parameters_load(tmp_path, world):
    torch.manual_seed(0)
    ref = thin()
    with torch.no_grad():
        for p in ref.parameters():
            p.uniform_(-1, 1)
    path = str(tmp_path / "thin.safetensors")
    save_state(ref, path)
    for got in _dist.ok(_dist.run(_thin, world, path)):
        assert_same(got["tensors"], reference(ref))
        assert got["whole"] == ()


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_header_and_index_edge_cases_are_format_errors(outcomes, case):
    message = _same_everywhere(outcomes, case, "CheckpointFormatError")
    for w in HEADER_CASES[case]:
        assert w in message, f"{case}: message lacks {w!r}: {message}"


def test_good_load_after_header_errors(outcomes):
    _good_after(outcomes, "header")


def test_single_file_wins_over_a_stale_index(outcomes):
    """transformers' precedence: model.safetensors, not the index's (older) shards."""
    want = reference(trained_toy())
    for r in outcomes:
        assert_same(r["precedence"], want)
