"""Many small tensors, few messages: the stream (``local_reads=False``) coalesces consecutive pieces
bound for the same place into one read and one message (``_plan.messages``), bit-exact.

A model of 240 small parameters of uneven shapes (row-sharded: SHARDED entries, some ranks holding
no row of some) and 240 small buffers (broadcast: PLAIN entries), spread over two files, loads on 2
and 3 gloo ranks: every parameter's ``full_tensor()`` and every buffer equal the checkpoint's, and
the point-to-point calls (rank 0's ``isend``, the others' ``irecv``) and the broadcasts number a
handful, not one per tensor per rank (on 3 ranks: 341 isends and 240 data broadcasts before, 2 and 1 now). With 512-byte staging slots (many messages, several rounds) it stays bit-exact;
and a file rewritten under rank 0 mid-stream is the same CheckpointChangedError on every rank.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests import _dist
from tests.models import assert_same, gather, reference

COUNT = 240


class Many(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.empty(1 + i % 7, 3 + i % 5)) for i in range(COUNT))
        for i in range(COUNT):
            self.register_buffer(f"stat{i}", torch.empty(1 + i % 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def many() -> Many:
    return Many()


def trained_many() -> Many:
    torch.manual_seed(0)
    m = Many()
    with torch.no_grad():
        for t in [*m.parameters(), *m.buffers()]:
            t.uniform_(-1, 1)
    return m


def _root_only(model: nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh)


def save_many(directory: str) -> None:
    """Two files and an index: the parameters in one, the buffers in the other."""
    import json

    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in reference(trained_many()).items()}
    halves = {
        "a.safetensors": {k: v for k, v in state.items() if k.startswith("weights.")},
        "b.safetensors": {k: v for k, v in state.items() if k.startswith("stat")},
    }
    for name, part in halves.items():
        save_file(part, os.path.join(directory, name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: n for n, part in halves.items() for k in part}}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


def _counted() -> dict[str, int]:
    """Counts this process's point-to-point sends and receives and its broadcasts (of the data, and
    the few of the manifest and agreements)."""
    import torch.distributed as dist

    calls = {"isend": 0, "irecv": 0, "broadcast": 0}
    for name in calls:
        original = getattr(dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return calls


def _loads(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    import rank0load
    from tests.load.test_protocol import _attempt, _changer

    calls = _counted()
    out: dict = {}

    def loads(*names: str) -> None:  # "<name>" with the default staging, "<name>-small" with 2 KiB
        for name in names:
            kwargs = {"max_staging_bytes": 2048} if name.endswith("small") else {}
            model = rank0load.load_sharded(many, root, shard_fn=_root_only, local_reads=False, **kwargs)
            out[name] = {**calls, "tensors": gather(model)}
            calls.update(dict.fromkeys(calls, 0))

    def rewritten(name: str, file: str) -> None:  # the file rewritten in place before rank 0's 3rd read
        if rank == 0:
            modules, original, patched = _changer(os.path.join(root, file), "rewritten")
            for m in modules:
                m.read_vectored = patched
        dist.barrier()
        try:
            out[name] = _attempt(
                lambda: rank0load.load_sharded(
                    many, root, shard_fn=_root_only, max_staging_bytes=2048, local_reads=False
                )
            )
        finally:
            if rank == 0:
                for m in modules:
                    m.read_vectored = original

    loads("default", "small")
    # Rank 0's reader with 4 threads, the messages' runs cut into parts of at most 64 bytes, every
    # free slot's read at once (as on an accelerator mesh); with the default staging, and with 2 KiB
    from rank0load.load import _readahead, _transfer

    threads, size = _transfer.read_threads, _readahead._PART_BYTES
    _transfer.read_threads, _readahead._PART_BYTES = (lambda device: 4), 64
    try:
        loads("parallel", "parallel-small")
        # ... and rank 0's own consecutive pieces grouped into messages, read into its staging and
        # copied into its shards (as on an accelerator mesh, where they go through pinned memory)
        own_together, _transfer.own_together = _transfer.own_together, (lambda device: True)
        try:
            loads("own-together", "own-together-small")
        finally:
            _transfer.own_together = own_together
        rewritten("rewritten-parallel", "b.safetensors")  # the file's bytes change: loads come before
    finally:
        _transfer.read_threads, _readahead._PART_BYTES = threads, size
    rewritten("rewritten", "a.safetensors")
    return out


@pytest.mark.slow  # one spawn of 8 loads per world size: about 30 s each
@pytest.mark.parametrize("world", [2, 3])
def test_many_small_tensors_few_messages_bit_exact(tmp_path, world):
    save_many(str(tmp_path))
    want = reference(trained_many())
    results = _dist.ok(_dist.run(_loads, world, str(tmp_path), timeout=300))
    for rank, res in enumerate(results):
        for name in ("default", "small", "parallel", "parallel-small", "own-together", "own-together-small"):
            assert_same(res[name]["tensors"], want)
        # Before coalescing: one isend per parameter per rank holding rows of it (~240 x (world - 1)).
        calls = res["default"]["isend" if rank == 0 else "irecv"]
        assert 0 < calls <= world - 1, (rank, res["default"])
        small = res["small"]["isend" if rank == 0 else "irecv"]
        assert calls < small < COUNT * (world - 1) // 4, (rank, res["small"])
        # Before: one broadcast per buffer (240) and a few for the manifest and agreements.
        assert res["default"]["broadcast"] < 20, (rank, res["default"])
    for case, path in (("rewritten", "a.safetensors"), ("rewritten-parallel", "b.safetensors")):
        outcomes = [res[case] for res in results]
        assert len({(o[0], o[2]) for o in outcomes}) == 1, outcomes  # one error, the same everywhere
        name, bases, message, _ = outcomes[0]
        assert name == "CheckpointChangedError" and path in message, outcomes[0]


def test_nearby_extents_are_one_read(tmp_path):
    """``_reads.runs``: extents of one file at most ``_GAP`` bytes apart are one run (the bytes
    between read into scratch), farther ones and other files start their own; reading the runs
    fills ``data`` exactly as reading each extent by itself does."""
    from rank0load.load import _readahead as _reads

    blob = os.urandom(3 * _reads._GAP)
    a, b = str(tmp_path / "a.bin"), str(tmp_path / "b.bin")
    for path in (a, b):
        with open(path, "wb") as f:
            f.write(blob)
    gap = _reads._GAP
    # (file, file offset, bytes, offset in data): out of order, a gap of 10, one of exactly _GAP,
    # one of _GAP + 1, adjacent extents, and another file in between
    extents = [
        (a, 100, 50, 0),
        (b, 7, 9, 50),
        (a, 160, 20, 59),
        (a, 180, 5, 79),
        (a, 185 + gap, 30, 84),
        (a, 215 + 2 * gap + 1, 40, 114),
    ]
    data = torch.zeros(154, dtype=torch.uint8)
    found = _reads.runs(extents, data)
    assert [(p, o) for p, o, _ in found] == [(a, 100), (a, 215 + 2 * gap + 1), (b, 7)]
    assert sum(map(len, found[0][2])) == 185 + gap + 30 - 100  # the gaps read, not skipped
    fds = {p: os.open(p, os.O_RDONLY) for p in (a, b)}
    try:
        for path, offset, views in found:
            _reads.read_vectored(fds[path], views, offset, path)
    finally:
        for fd in fds.values():
            os.close(fd)
    want = torch.zeros(154, dtype=torch.uint8)
    for _, offset, nbytes, at in extents:  # both files hold the same bytes
        want[at : at + nbytes] = torch.frombuffer(
            bytearray(blob[offset : offset + nbytes]), dtype=torch.uint8
        )
    assert torch.equal(data, want)


@pytest.mark.parametrize("size", [16, 100, 333, 5000])
def test_runs_split_between_threads_read_the_same_bytes(tmp_path, size):
    """``_reads.split_runs``: the runs cut into reads of at most ``size`` bytes, each one run of
    file bytes, fill ``data`` exactly as the uncut runs do."""
    from rank0load.load import _readahead as _reads

    blob = os.urandom(4096)
    a, b = str(tmp_path / "a.bin"), str(tmp_path / "b.bin")
    for path in (a, b):
        with open(path, "wb") as f:
            f.write(blob)
    extents = [(a, 0, 100, 0), (a, 100, 7, 100), (a, 300, 1000, 107), (b, 11, 333, 1107), (a, 2000, 3, 1440)]
    fds = {p: os.open(p, os.O_RDONLY) for p in (a, b)}
    try:
        got = []
        for cut in (False, True):
            data = torch.zeros(1443, dtype=torch.uint8)
            found = _reads.runs(extents, data)
            if cut:
                whole = found
                found = _reads.split_runs(found, size)
                assert all(sum(map(len, views)) <= size for _, _, views in found), found
                # as many parts as each run needs, and no fewer: each part but a run's last is full
                assert len(found) == sum(-(-sum(map(len, v)) // size) for _, _, v in whole)
            for path, offset, views in found:
                _reads.read_vectored(fds[path], views, offset, path)
            got.append(data)
    finally:
        for fd in fds.values():
            os.close(fd)
    assert torch.equal(got[0], got[1])
    want = torch.cat(
        [torch.frombuffer(bytearray(blob[o : o + n]), dtype=torch.uint8) for _, o, n, _ in extents]
    )
    assert torch.equal(got[1], want)


@pytest.mark.parametrize("seed", range(3))
def test_ring_staging_hands_out_disjoint_bytes(seed):
    """``_readahead._Ring`` (rank 0's pinned staging on an accelerator, one ring): messages of any size
    up to a slot's, released in any order, each get bytes inside the ring, aligned, that no message
    still holding bytes shares; a message waits only for bytes not yet released."""
    import random

    from rank0load.load import _readahead

    rng = random.Random(seed)
    slot = 16 << 10
    ring = _readahead._Ring(torch.empty(4 * slot, dtype=torch.uint8))
    held: dict[int, tuple[int, int]] = {}  # token -> (start, end), not released yet
    released: list[tuple[int, None]] = []  # what the sender handed back, in its order

    def next_release() -> tuple[int, None] | None:
        if not released:  # the sender hands back a random held message (out of order)
            token = rng.choice(sorted(held))
            released.append((token, None))
            del held[token]
        return released.pop(0)

    for _ in range(2000):
        nbytes = rng.choice([0, 1, 100, 4096, 5000, slot // 2, slot - 64, slot, rng.randrange(1, slot + 1)])
        token, data = ring.take(nbytes, next_release)  # type: ignore[misc]
        start = data.storage_offset()
        assert data.numel() == nbytes and start % _readahead._RING_ALIGN == 0
        assert 0 <= start and start + nbytes <= 4 * slot
        for other, (lo, hi) in held.items():
            assert start + nbytes <= lo or hi <= start or nbytes == 0 or lo == hi, (token, other)
        held[token] = (start, start + nbytes)
        while len(held) > rng.randrange(1, 12):
            released.append((token := rng.choice(sorted(held)), None))
            del held[token]
