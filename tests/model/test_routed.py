"""Which modules may run on some ranks and not others (``model._shard.routed_modules``), decided on the
model's structure alone: the experts of a per-expert MoE are routed; a block's ``[Linear, Dropout]``
output list, PEFT's one-adapter ``ModuleDict``s and the model's list of layers are not. Built on meta, no
process group; the default policy's plan for the seed team's shape (what it replicates) in a one-rank gloo
world of this process. The multi-rank consequences (one group per MoE layer, a shard_fn that gives an
expert a group refused on every rank, replicated parameters trained in step) are tests/model/test_policy.py's
and tests/train/test_train_dp.py's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rank0load.model._shard import _owners, find_blocks, routed_modules
from tests.remote_code.configuration_tiny_moe import TinyMoeConfig
from tests.remote_code.modeling_tiny_moe import TinyMoeForCausalLM


def _names(model: nn.Module, ids: frozenset[int]) -> set[str]:
    return {n for n, m in model.named_modules() if id(m) in ids}


def _moe(experts: int = 256) -> nn.Module:
    with torch.device("meta"):
        return TinyMoeForCausalLM(TinyMoeConfig(num_local_experts=experts))


def test_the_experts_of_a_per_expert_moe_are_routed_and_nothing_else():
    model = _moe()
    routed = _names(model, routed_modules(model))
    for layer in (0, 1):
        moe = f"model.layers.{layer}.block_sparse_moe"
        assert {f"{moe}.experts", f"{moe}.experts.0", f"{moe}.experts.255.w2"} <= routed
        assert not {f"{moe}", f"{moe}.gate", f"model.layers.{layer}.self_attn"} & routed
    assert not [n for n in routed if ".experts" not in n], sorted(routed)[:5]
    assert "model.layers" not in routed


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = nn.Linear(4, 4)
        self.to_out = nn.ModuleList([nn.Linear(4, 4), nn.Dropout(0.0)])  # diffusers' output list


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.adapters = nn.ModuleDict({"default": nn.Linear(4, 2)})  # one per adapter name, as PEFT's lora_A
        self.heads = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])  # replicas: may be picked per input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])  # the blocks: every one runs
        self.experts = nn.ModuleList([nn.Linear(4, 4)])  # outside any block: routed by its name


def test_lists_that_run_whole_are_not_routed():
    model = Net()
    routed = _names(model, routed_modules(model))
    assert "layers" not in routed and "layers.0" not in routed
    assert not [n for n in routed if "to_out" in n or "adapters" in n], sorted(routed)
    assert {"layers.0.heads", "layers.0.heads.1", "experts", "experts.0"} <= routed


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 4)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([Expert(), Expert(), Expert()])


class ExpertsNamedAsBlocks(nn.Module):
    _no_split_modules = ["Layer", "Expert"]  # as some remote code lists its expert class

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])


def test_an_expert_class_in_no_split_modules_is_no_block():
    model = ExpertsNamedAsBlocks()
    assert [type(b).__name__ for b in find_blocks(model, routed_modules(model), _owners(model))] == [
        "Layer",
        "Layer",
    ]


@pytest.fixture
def one_rank():
    """A one-rank gloo world in this process (``fully_shard`` on meta issues no collectives)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _seed_moe(bias_trainable: bool, expert_scale: bool = False) -> nn.Module:
    """The remote MoE on meta in bf16, its router bias fp32 (as ``dtype=bfloat16`` keeps it), trainable
    or not; with ``expert_scale``, an fp32 trainable ``scale`` on every expert (inside the routed list)."""
    model = _moe(experts=4).to(torch.bfloat16)
    for layer in model.model.layers:
        moe = layer.block_sparse_moe
        moe.e_score_correction_bias.data = moe.e_score_correction_bias.data.float()
        moe.e_score_correction_bias.requires_grad_(bias_trainable)
        if expert_scale:
            for expert in moe.experts:
                expert.scale = nn.Parameter(torch.ones(8, device="meta"))
    return model


@pytest.mark.parametrize(
    "bias_trainable, expert_scale", [(True, False), (False, False), (True, True), (False, True)]
)
def test_what_no_group_can_take_is_replicated_and_the_experts_stay_in_their_layer(
    one_rank, bias_trainable, expert_scale
):
    """The seed team's shape: a trainable fp32 router bias on the MoE block beside bf16 experts goes out
    of FSDP (replicated), and so does a trainable fp32 parameter inside the expert list; the groups stay
    one per decoder layer and the root, nothing at or below the experts; a frozen bias stays in its
    layer's group (FSDP2 checks only trainable parameters' dtypes)."""
    from torch.distributed.tensor import DTensor

    from rank0load.common._report import fsdp_plan
    from rank0load.model._shard import check_dtype_groups, default_shard_fn, replicated_parameters

    model = _seed_moe(bias_trainable, expert_scale)
    default_shard_fn(model, one_rank)
    check_dtype_groups(model)
    want = [
        f"model.layers.{i}.block_sparse_moe.{leaf}"
        for i in (0, 1)
        for leaf in (
            ["e_score_correction_bias"] * bias_trainable
            + [f"experts.{e}.scale" for e in range(4)] * expert_scale
        )
    ]
    got = [n for n, _ in replicated_parameters(model)]
    assert sorted(got) == sorted(want), got
    assert all(not isinstance(model.get_parameter(n), DTensor) for n in want)
    plan = fsdp_plan(model)
    assert [g.module for g in plan] == ["", "model.layers.0", "model.layers.1"], plan
    for g in plan:
        assert g.trainable_dtypes == (torch.bfloat16,), g
        held = [n for n in want if g.module and n.startswith(g.module + ".")]  # the root holds none
        assert sorted(g.replicated) == sorted(held), g
    assert sum(len(g.replicated) for g in plan) == len(want)
