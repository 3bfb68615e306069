"""``from_rank0``'s value reaches every rank intact, and a large one crosses the wire compressed.

With ``readers="host"`` no tensor data leaves rank 0's host; what does is the protocol, and its one
part that grows with the tensor count is the manifest rank 0 broadcasts (2 MB pickled for
MiniMax-M2's 96,000 tensors). Each rank counts the bytes its broadcasts carry."""

from __future__ import annotations

import pickle

import torch

from tests import _dist


def _names(n: int) -> list[tuple[str, tuple[int, int], int]]:
    """A manifest's shape: repetitive names, shapes and offsets."""
    return [
        (
            f"model.layers.{i // 768}.block_sparse_moe.experts.{i % 256}.w{i % 3 + 1}.weight",
            (64, 32),
            i * 4096,
        )
        for i in range(n)
    ]


def _receive(rank: int, world: int, n: int) -> dict:
    import torch.distributed as dist

    from rank0load.common import _distribute

    carried = [0]
    original = dist.broadcast

    def counted(t: torch.Tensor, *args, **kwargs):
        carried[0] += t.numel() * t.element_size()
        return original(t, *args, **kwargs)

    dist.broadcast = counted
    value = _distribute.from_rank0(lambda: _names(n), lambda exc: RuntimeError(str(exc)))
    return {"same": value == _names(n), "carried": carried[0]}


def test_a_large_value_arrives_whole_and_compressed():
    n = 20_000
    pickled = len(pickle.dumps(_names(n), protocol=pickle.HIGHEST_PROTOCOL))
    assert pickled > 1 << 20  # above the threshold
    results = _dist.ok(_dist.run(_receive, 3, n))
    assert all(r["same"] for r in results)
    carried = {r["carried"] for r in results}
    assert len(carried) == 1, results  # every rank saw the same two broadcasts
    assert 16 < carried.pop() - 16 < pickled / 4, (pickled, results)  # 16 B: the header


def test_a_small_value_travels_as_pickled():
    n = 100
    pickled = len(pickle.dumps(_names(n), protocol=pickle.HIGHEST_PROTOCOL))
    results = _dist.ok(_dist.run(_receive, 2, n))
    assert all(r["same"] for r in results)
    assert [r["carried"] for r in results] == [16 + pickled] * 2
