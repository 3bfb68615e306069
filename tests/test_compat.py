"""What rank0load assumes of torch's DTensor / FSDP2 (see rank0load/_compat.py): fail loudly when a
torch release changes it."""

from __future__ import annotations

import torch

from tests import _dist


def _check(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rank0load._compat import local_tensor

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = torch.nn.Linear(4, 5)  # 5 rows over 2 ranks: uneven, FSDP2 pads rank 1's shard
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    local = local_tensor(model.weight)
    local.copy_(torch.full_like(local, float(rank + 1)))  # writing the local tensor loads the parameter
    full = model.weight.full_tensor()
    return {
        "full": full,
        "is_view_of_param": local.untyped_storage().data_ptr()
        == model.weight.to_local().untyped_storage().data_ptr(),
        "contiguous": local.is_contiguous(),
        "rows": local.shape[0],
    }


def test_local_tensor_is_the_parameters_storage():
    results = _dist.ok(_dist.run(_check, 2))
    want = torch.tensor([1.0] * 3 + [2.0] * 2).unsqueeze(1).expand(5, 4)
    for r in results:
        assert r["is_view_of_param"] and r["contiguous"]
        assert torch.equal(r["full"], want)
    assert [r["rows"] for r in results] == [3, 2]  # torch.chunk semantics, as _plan.rows_of assumes
