"""transformers' conversions that split or join tensors along rows, both ways, on real model code: a
checkpoint written by the model's own ``save_pretrained`` (transformers reverts its conversions there:
Sarvam-MoE's ``query_key_value`` and LaRA-mini's ``in_proj`` fused, OLMo-Hybrid's conv1d cut into
``q_conv1d``/``k_conv1d``/``v_conv1d``) loads on 2 and 3 ranks, the checkpoint hidden from ranks other
than 0, bit for bit as ``from_pretrained`` loads it; ``save_sharded`` (``original_format=True``) writes
back what ``save_pretrained`` wrote, every tensor bit for bit. Only transformers 5 converts."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from tests import _dist, hf
from tests.models import assert_same, gather, reference

pytestmark = [pytest.mark.slow, pytest.mark.transformers, pytest.mark.torch_range]

# model_type -> a checkpoint key its conversion takes, and the config fields that make it tiny
ARCHITECTURES = {
    "sarvam_moe": "model.layers.0.attention.query_key_value.weight",
    "lara_mini": "model.layers.0.linear_attn.in_proj.weight",
    "olmo_hybrid": "model.layers.0.linear_attn.q_conv1d.weight",
}
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped: q, k and v rows differ in number
    "head_dim": 16,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 0,
    "vocab_size": 96,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,  # value rows differ from key rows
}


def _transformers5() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def _config(model_type: str):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    for name, value in TINY.items():
        if hasattr(config, name):
            setattr(config, name, value)
    kinds = list(dict.fromkeys(getattr(config, "layer_types", None) or []))
    if kinds:  # one layer of each kind
        config.layer_types = kinds
        config.num_hidden_layers = len(kinds)
    return config


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    if not _transformers5():
        pytest.skip("transformers 4.57 has no conversion mapping: nothing is split or joined")
    from transformers import AutoModelForCausalLM

    hf._quiet()
    path = tmp_path_factory.mktemp("row_conversions")
    for model_type in ARCHITECTURES:
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(_config(model_type))
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.1)
        model.save_pretrained(path / model_type, max_shard_size="40KB")
    return str(path)


def _ranks(rank: int, world: int, root: str) -> dict:
    from transformers import AutoModelForCausalLM

    import rank0load

    def job(model_type: str) -> dict:
        model = rank0load.load_pretrained(
            AutoModelForCausalLM, os.path.join(root, model_type), dtype=torch.float32
        )
        out_dir = os.path.join(root, "saved", f"{model_type}-{world}")
        rank0load.save_sharded(model, out_dir, max_shard_size="40KB")
        return {"loaded": gather(model), "saved": out_dir}

    hf._quiet()
    return _dist.run_jobs(rank, root, {m: m for m in ARCHITECTURES}, job)


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ran(request, root) -> list[dict]:
    return _dist.ok(_dist.run(_ranks, request.param, root, timeout=600))


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(path))
    return out


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_loads_as_from_pretrained_and_saves_as_save_pretrained(ran, root, model_type):
    from transformers import AutoModelForCausalLM

    for r in ran:
        assert r["touched"] == []  # ranks other than 0 never saw the checkpoint
    checkpoint = os.path.join(root, model_type)
    written = _tensors(checkpoint)
    assert ARCHITECTURES[model_type] in written  # the checkpoint holds the converted layout
    want = reference(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32))
    for r in ran:
        assert_same(r["jobs"][model_type]["loaded"], want)
    saved = _tensors(ran[0]["jobs"][model_type]["saved"])
    assert sorted(saved) == sorted(written)
    assert [k for k in written if not torch.equal(saved[k], written[k])] == []
