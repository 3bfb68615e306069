"""prefault: local shards resident before data lands, padding zeroed, shard bytes never rewritten
where the kernel can fault pages in (MADV_POPULATE_WRITE)."""

from __future__ import annotations

import torch

from rank0load import _memory


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
