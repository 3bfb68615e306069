"""A layer's experts' float8 rows dequantised together (``Sink.runs``, ``_fp8.dequantize_stacked``),
bit for bit as each alone.

A per-expert model (the layout of transformers 4.57 and of MiniMax-M2's remote code: one 2-D
weight per expert) loads from an FP8 block checkpoint on 2 and 3 gloo ranks, the checkpoint hidden
from ranks other than 0: read by each rank through rank 0's descriptors (``local_reads=True``, no
message at all) and streamed by rank 0 (``local_reads=False``, the experts' rows and scale grid rows
several to a message). Rows split unevenly over 3 ranks, and a rank's rows start inside a block row.
Every parameter's ``full_tensor()`` equals the formula's values cast once to bfloat16, and every rank
dequantised its experts several at a time (entries whose columns are not whole blocks, and the bf16
norms between, go the usual way, one at a time).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from tests import _dist
from tests.models import gather
from tests.moe_models import dequantize, fp8_config, quantize

BLOCK = (16, 16)
EXPERTS, HIDDEN, WIDTH, ODD = 6, 32, 26, 20  # WIDTH rows: 13 + 13 on 2 ranks, 9 + 9 + 8 on 3


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.w1 = nn.ModuleList(nn.Linear(HIDDEN, WIDTH, bias=False) for _ in range(EXPERTS))  # [26, 32]
        self.w2 = nn.ModuleList(
            nn.Linear(ODD, HIDDEN, bias=False) for _ in range(EXPERTS)
        )  # [32, 20]: not whole blocks


class PerExpert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))


def _write(path: str) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint (expert weights float8 with ``weight_scale_inv``, the rest bf16) and what
    a bf16 load must give: the formula's float32 values, cast once."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = PerExpert()
    tensors, want = {}, {}
    for name, p in model.named_parameters():
        value = torch.randn(p.shape) * 10
        if ".w1." in name or ".w2." in name:
            q, s = quantize(value, BLOCK)
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = q, s
            want[name] = dequantize(q, s, BLOCK).to(torch.bfloat16)
        else:
            tensors[name] = value.to(torch.bfloat16)
            want[name] = tensors[name]
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"quantization_config": fp8_config(BLOCK)}, f)
    return want


def _rank(rank: int, world: int, root: str, local_reads: bool) -> dict:
    from rank0load.load import _sink

    stacked: list[int] = []
    alone = _sink.dequantize_stacked

    def counting(values, grids, first, block):  # type: ignore[no-untyped-def]
        stacked.append(values.shape[0])
        return alone(values, grids, first, block)

    _sink.dequantize_stacked = counting

    def job(_: object) -> dict:
        import rank0load

        model = rank0load.load_sharded(
            PerExpert, os.path.join(root, "ckpt"), dtype=torch.bfloat16, local_reads=local_reads
        )
        return {"tensors": gather(model), "stacked": list(stacked)}

    return _dist.run_jobs(rank, root, {"load": None}, job)


@pytest.mark.slow
@pytest.mark.parametrize("local_reads", [True, False], ids=["local-reads", "streamed"])
@pytest.mark.parametrize("world", [2, 3])
def test_experts_dequantised_together_bit_exact(tmp_path, world, local_reads):
    want = _write(str(tmp_path / "ckpt"))
    results = _dist.ok(_dist.run(_rank, world, str(tmp_path), local_reads, timeout=300))
    for rank, out in enumerate(results):
        assert not out["touched"], f"rank {rank} touched the hidden checkpoint: {out['touched']}"
        got = _dist.ok([out["jobs"]["load"]])[0]
        assert set(got["tensors"]) == set(want)
        for name, value in want.items():
            assert torch.equal(got["tensors"][name].view(torch.int16), value.view(torch.int16)), (rank, name)
        # Every rank but rank 0 when it streams (its own rows it reads one piece at a time) dequantised
        # its w1 experts several at a time; nothing else went that way.
        if local_reads or rank != 0:
            assert got["stacked"] and max(got["stacked"]) > 1, (rank, got["stacked"])
            assert sum(got["stacked"]) == 2 * EXPERTS, (rank, got["stacked"])
        else:
            assert not got["stacked"], got["stacked"]
