"""transformers' own model code, saved with save_pretrained into several shards, loaded on 2 and 3
gloo ranks and compared bit for bit with the single-process model (every parameter's full tensor,
every buffer) and by forward output."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests import _dist, hf
from tests.models import assert_same, gather, reference

# Slow: 15 spawns of 2-3 ranks that each import transformers, about 2 minutes in all.
pytestmark = [pytest.mark.slow, pytest.mark.transformers]

MODELS = ["llama", "qwen2", "gemma", "gpt2", "t5", "bert"]


def _load(rank: int, world: int, name: str, path: str, kwargs: dict, model_dtype) -> dict:
    import rank0load

    hf._quiet()
    model = rank0load.load_sharded(hf.Factory(name, model_dtype), path, **kwargs)
    got = gather(model)
    with torch.no_grad():
        out = model(**hf.sample_inputs(name)).logits
    sd_keys = set(model.state_dict())
    nonpersistent = {
        f"{mn}.{b}" if mn else b for mn, m in model.named_modules() for b in m._non_persistent_buffers_set
    }
    devices = {b.device.type for b in model.buffers()} | {p.device.type for p in model.parameters()}
    ties = [
        (a, b)
        for a, pa in model.named_parameters(remove_duplicate=False)
        for b, pb in model.named_parameters(remove_duplicate=False)
        if a < b and pa is pb
    ]
    return {
        "tensors": got,
        "out": out,
        "nonpersistent_in_sd": sorted(nonpersistent & sd_keys),
        "devices": devices,
        "ties": ties,
        "nparams": len(list(model.parameters())),
        "report": model.rank0load_report,
    }


def _expect(ref, name) -> tuple[dict, torch.Tensor, list]:
    with torch.no_grad():
        out = ref(**hf.sample_inputs(name)).logits
    ties = [
        (a, b)
        for a, pa in ref.named_parameters(remove_duplicate=False)
        for b, pb in ref.named_parameters(remove_duplicate=False)
        if a < b and pa is pb
    ]
    return reference(ref), out, ties


def _check(results, ref, name):
    want, out_ref, ties = _expect(ref, name)
    for r in results:
        assert_same(r["tensors"], want)
        assert r["nonpersistent_in_sd"] == []
        assert r["devices"] == {"cpu"}
        assert r["ties"] == ties
        assert r["nparams"] == len(list(ref.parameters()))
        torch.testing.assert_close(r["out"], out_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", MODELS)
def test_save_pretrained_sharded(tmp_path, name, world):
    ref = hf.pretrained(name)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    results = _dist.ok(_dist.run(_load, world, name, str(tmp_path), {}, None))
    _check(results, ref, name)
    if name in ("llama", "gpt2", "t5"):
        assert results[0]["ties"], "the tied model must keep its ties"


def test_bf16_checkpoint_into_fp32_model(tmp_path):
    """Qwen2 saved in bf16, loaded into an fp32 model: the wire dtype is bf16, each rank casts."""
    saved = hf.pretrained("qwen2").to(torch.bfloat16)
    saved.save_pretrained(tmp_path, max_shard_size="20KB")
    ref = hf.Factory("qwen2")()  # fp32, with its own fp32 inv_freq
    ref.load_state_dict({k: v.float() for k, v in saved.state_dict().items()})
    results = _dist.ok(_dist.run(_load, 2, "qwen2", str(tmp_path), {}, None))
    _check(results, ref, "qwen2")
    assert results[0]["tensors"]["model.embed_tokens.weight"].dtype == torch.float32


@pytest.mark.parametrize(("name", "world"), [("llama", 2), ("llama_untied", 3), ("qwen2", 2)])
def test_dtype_means_what_from_pretrained_means(tmp_path, name, world):
    """``load_sharded(dtype=bf16)`` equals ``from_pretrained(dtype=bf16)`` bit for bit, buffers included:
    the rotary ``inv_freq`` stays float32 (``model.to(bf16)`` would cast it, and the logits would then
    differ by about 0.03), and the logits are equal."""
    hf.pretrained(name).save_pretrained(tmp_path, max_shard_size="20KB")
    ref = hf.model_class(name).from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert ref.model.rotary_emb.inv_freq.dtype == torch.float32  # what makes model.to(bf16) differ
    results = _dist.ok(_dist.run(_load, world, name, str(tmp_path), {"dtype": torch.bfloat16}, None))
    want = reference(ref)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks: the same kernels, the same bits
    try:
        with torch.no_grad():
            logits = ref(**hf.sample_inputs(name)).logits
    finally:
        torch.set_num_threads(threads)
    for r in results:
        assert_same(r["tensors"], want)
        assert r["tensors"]["model.rotary_emb.inv_freq"].dtype == torch.float32
        assert torch.equal(r["out"], logits), (r["out"].float() - logits.float()).abs().max()


def test_bert_checkpoint_with_position_ids(tmp_path):
    """Old BERT checkpoints store embeddings.position_ids, which the model now keeps as a
    non-persistent buffer: not an error, and the model's own value wins."""
    from safetensors.torch import save_file

    ref = hf.pretrained("bert")
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    bogus = torch.arange(40).unsqueeze(0) * 0 + 7  # a different value: must not be loaded
    save_file({"bert.embeddings.position_ids": bogus}, str(tmp_path / "extra.safetensors"))
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["bert.embeddings.position_ids"] = "extra.safetensors"
    index_path.write_text(json.dumps(index))
    results = _dist.ok(_dist.run(_load, 2, "bert", str(tmp_path), {}, None))
    _check(results, ref, "bert")
    assert results[0]["report"].ignored == ("bert.embeddings.position_ids",)
