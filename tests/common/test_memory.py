"""prefault: local shards resident before data lands, padding zeroed, shard bytes never rewritten
where the kernel can fault pages in (MADV_POPULATE_WRITE); FaultIn: the same for many tensors, in a
background thread and the caller's, and the thread's failure raised to the caller."""

from __future__ import annotations

import pytest
import torch

from rank0load.common import _memory


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS")


def test_fresh_shard_becomes_resident():
    n = 64 << 20
    t = torch.empty(n, dtype=torch.uint8)  # glibc maps a block this large fresh: nothing resident yet
    before = _rss()
    _memory.prefault(t)
    assert _rss() - before > n * 0.9


def test_bytes_outside_the_shard_are_zeroed_and_the_shard_is_left_alone():
    storage = torch.full((3 * 4096 + 100,), 7, dtype=torch.int32)  # a padded storage holding stale bytes
    shard = storage[1000 : 1000 + 9000]
    _memory.prefault(shard)
    assert torch.count_nonzero(storage[:1000]) == 0
    assert torch.count_nonzero(storage[1000 + 9000 :]) == 0
    if _memory._madvise:  # populated by the kernel: the shard's own bytes were not written
        assert torch.all(shard == 7)
    else:  # zero-filled instead
        assert torch.count_nonzero(shard) == 0


def test_without_madvise_it_zero_fills(monkeypatch):
    monkeypatch.setattr(_memory, "_madvise", False)
    t = torch.full((50000,), 3.0)
    _memory.prefault(t)
    assert torch.count_nonzero(t) == 0


def _padded(n: int, lo: int, hi: int, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    storage = torch.full((n,), fill, dtype=torch.int32)
    return storage, storage[lo:hi]


def test_fault_in_does_what_prefault_does_for_every_tensor():
    # blocks above glibc's largest mmap threshold (32 MiB): mapped fresh, whatever the process freed
    fresh = [torch.empty(n, dtype=torch.uint8) for n in (48 << 20, 40 << 20)]
    small = [torch.full((n,), 5, dtype=torch.uint8) for n in (100, 5000)]  # whole storages under _SMALL
    storages, shards = zip(*[_padded(3 * 4096 + 100, 1000 + i, 10000 + i, 7) for i in range(40)])
    before = _rss()
    pending = _memory.FaultIn([*fresh, *small, *shards])
    pending.wait()
    assert _rss() - before > (88 << 20) * 0.9
    for storage, shard in zip(storages, shards):
        start = shard.storage_offset()
        assert torch.count_nonzero(storage[:start]) == 0
        assert torch.count_nonzero(storage[start + shard.numel() :]) == 0
        if _memory._madvise:
            assert torch.all(shard == 7)
    # left to fault in where they are written: nothing outside them to zero, nothing done to them
    assert all(torch.all(t == 5) for t in small)
    storage, shard = _padded(4096, 0, 100, 7)  # a small shard whose storage is padded: the padding zeroed
    _memory.FaultIn([shard]).wait()
    assert torch.count_nonzero(storage[100:]) == 0


def test_fault_in_thread_failure_is_raised_by_wait(monkeypatch):
    def failing(pages: tuple[int, int] | None, t: torch.Tensor) -> None:
        raise MemoryError("no pages, on purpose")

    monkeypatch.setattr(_memory, "_fill", failing)
    pending = _memory.FaultIn([torch.empty(n, dtype=torch.uint8) for n in (1 << 20, 2 << 20, 3 << 20)])
    with pytest.raises(MemoryError, match="on purpose"):
        pending.wait()
    pending.close()  # after a failure: returns, raising nothing


def test_fault_in_without_madvise_zero_fills(monkeypatch):
    monkeypatch.setattr(_memory, "_madvise", False)
    tensors = [torch.full(((1 << 18) + i,), 3.0) for i in range(5)]  # over _SMALL
    _memory.FaultIn(tensors).wait()
    assert all(torch.count_nonzero(t) == 0 for t in tensors)


def test_fault_in_parameters_that_require_grad():
    """The thread zero-fills a parameter (under a page) as prefault does: no in-place-on-a-leaf error."""
    padded = torch.full((20,), 2.0)[:10]  # under a page, its storage padded (FSDP2's shards are)
    params = [torch.nn.Parameter(padded), torch.nn.Parameter(torch.full((1 << 20,), 2.0))]
    _memory.FaultIn(params).wait()
    assert torch.count_nonzero(params[0].detach()) == 0 and params[1].requires_grad
