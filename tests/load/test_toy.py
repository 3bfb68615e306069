"""End-to-end loads of a small hand-written model on 2 and 3 gloo ranks, bit-exact."""

from __future__ import annotations

import pytest
import torch

from tests import _dist
from tests.models import assert_same, gather, toy, trained_toy


def _load(rank: int, world: int, path: str, kwargs: dict) -> dict:
    import rank0load

    model = rank0load.load_sharded(toy, path, **kwargs)
    got = gather(model)
    ids = torch.tensor([[1, 2, 3, 6], [0, 5, 4, 4]])
    model.eval()
    out = model(ids).detach()
    if isinstance(out, torch.distributed.tensor.DTensor):
        out = out.full_tensor()
    return {
        "tensors": got,
        "out": out,
        "tied": model.head.weight is model.emb.weight,
        "nparams": len(list(model.parameters())),
        "nonpersistent": "scale" in model._non_persistent_buffers_set and "scale" not in model.state_dict(),
    }


# 3 ranks (uneven shards) stay in the quick loop; 2 ranks, in CI, cover little more.
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_toy_bit_exact(toy_checkpoint, toy_reference, world):
    ref = trained_toy()
    results = _dist.ok(_dist.run(_load, world, toy_checkpoint, {}))
    with torch.no_grad():
        out_ref = ref(torch.tensor([[1, 2, 3, 6], [0, 5, 4, 4]]))
    for r in results:
        assert_same(r["tensors"], toy_reference)
        assert r["tied"] and r["nonpersistent"]
        assert r["nparams"] == len(list(ref.parameters()))
        torch.testing.assert_close(r["out"], out_ref, rtol=0, atol=1e-6)
