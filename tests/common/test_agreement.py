"""Agreement costs O(model) bytes per rank, independent of the world size.

Each rank counts the payload bytes it receives through torch.distributed while
``_distribute.agree`` runs (all-reduce: the tensor; broadcast: the tensor, on the receivers;
all-gather and gather: every other rank's tensor; point to point: the tensor), for a model of
1,000 parameters on 2, 3 and 6 gloo ranks. The counts must not grow with the world: every rank of
every world must receive the same bytes, so a cost of one message per peer (linear) or per tree level
(logarithmic: 1 level at 2 ranks, 2 at 3, 3 at 6) shows. Six ranks, not eight: the test runs on two
cores, where each extra rank costs its start-up and its share of every collective.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests import _dist
from tests.models import save_state

pytestmark = pytest.mark.slow


class Wide(nn.Module):
    """1,000 parameters: 500 small linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 3) for _ in range(500))


def wide() -> Wide:
    return Wide()


def _count(rank: int, world: int, path: str) -> dict:
    import torch.distributed as dist

    import rank0load
    import rank0load.common._distribute as d

    counting = [False]
    received = [0]

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def wrap(name, bytes_of):
        original = getattr(dist, name)

        def counted(*args, **kwargs):
            if counting[0]:
                received[0] += bytes_of(*args, **kwargs)
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    def src_of(args, kwargs):
        return kwargs.get("src", args[1] if len(args) > 1 else 0)

    wrap("all_reduce", lambda t, *a, **k: size(t))
    wrap("broadcast", lambda t, *a, **k: 0 if src_of((t, *a), k) == rank else size(t))
    wrap("all_gather", lambda out, t, *a, **k: (world - 1) * size(t))
    wrap("all_gather_into_tensor", lambda out, t, *a, **k: (world - 1) * size(t))
    wrap("gather", lambda t, *a, **k: (world - 1) * size(t) if k.get("dst", 0) == rank else 0)
    wrap("recv", lambda t, *a, **k: size(t))
    wrap("irecv", lambda t, *a, **k: size(t))
    wrap("all_gather_object", lambda out, obj, *a, **k: 1 << 30)  # must not be used
    real_agree = d.agree

    def agree(*args, **kwargs):
        counting[0] = True
        try:
            return real_agree(*args, **kwargs)
        finally:
            counting[0] = False

    d.agree = agree
    model = rank0load.load_sharded(wide, path)
    params = sum(1 for _ in model.parameters())
    dist.barrier()
    return {"received": received[0], "params": params}


def test_agreement_bytes_do_not_grow_with_the_world(tmp_path):
    path = str(tmp_path / "wide.safetensors")
    save_state(wide(), path)
    per_world = {}
    for world in (2, 3, 6):
        results = _dist.ok(_dist.run(_count, world, path, timeout=400, pg_timeout=120))
        assert all(r["params"] == 1000 for r in results)
        per_world[world] = [r["received"] for r in results]
    print("bytes received at agreement per rank:", per_world)
    counts = {c for cs in per_world.values() for c in cs}
    # Every rank of every world receives the same, in two all-reduces: 17 x 8 B (the first failing rank,
    # the digest's 8 words and their negations: its MIN and MAX), 2 B per tensor (layout flags).
    assert counts == {17 * 8 + 2 * 1000}, per_world
