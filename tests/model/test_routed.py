"""Which modules may run on some ranks and not others (``model._shard.routed_modules``), decided on the
model's structure alone: the experts of a per-expert MoE are routed; a block's ``[Linear, Dropout]``
output list, PEFT's one-adapter ``ModuleDict``s and the model's list of layers are not. Built on meta, no
process group. The multi-rank consequences (one group per MoE layer, a shard_fn that gives an expert a
group refused on every rank) are tests/model/test_policy.py's and tests/train/test_train_dp.py's.
"""

from __future__ import annotations

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
