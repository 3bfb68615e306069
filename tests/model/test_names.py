"""Wrapper prefixes need no key_map: ``torch.compile`` (``_orig_mod.``) and activation checkpointing
(``_checkpoint_wrapped_module.``) on the model side, and a checkpoint saved from a compiled model
(``_orig_mod.`` in its keys) into a plain model. One 2-rank spawn runs every case; values are compared
bit for bit with the single-process model."""

from __future__ import annotations

import pytest
import torch

from rank0load.model._meta import strip_wrappers
from tests import _dist
from tests.models import assert_same, gather, reference, save_state, toy, trained_toy

IDS = torch.tensor([[1, 2, 3, 6], [0, 5, 4, 4]])


def compiled_toy():
    return torch.compile(toy())  # lazy: nothing is compiled until the first call


def checkpointed_toy():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = toy()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
    return model


def _cases(rank: int, world: int, plain_path: str, compiled_path: str) -> dict:
    import rank0load

    out: dict = {}
    model = rank0load.load_sharded(compiled_toy, plain_path)
    out["compiled"] = {
        "names": [n for n, _ in model.named_parameters()],
        "tensors": gather(model),
        "tied": model._orig_mod.head.weight is model._orig_mod.emb.weight,
    }
    model = rank0load.load_sharded(checkpointed_toy, plain_path)
    with torch.no_grad():
        logits = model.eval()(IDS)
    out["checkpointed"] = {
        "names": [n for n, _ in model.named_parameters()],
        "tensors": gather(model),
        "out": logits,
    }
    model = rank0load.load_sharded(toy, compiled_path)
    with torch.no_grad():
        logits = model.eval()(IDS)
    out["from_compiled"] = {"tensors": gather(model), "out": logits, "report": model.rank0load_report}
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, toy_checkpoint):
    tmp = tmp_path_factory.mktemp("names")
    ref = trained_toy()
    save_state(torch.compile(ref), str(tmp / "compiled.safetensors"))
    from safetensors import safe_open

    with safe_open(str(tmp / "compiled.safetensors"), "pt") as f:
        assert all(k.startswith("_orig_mod.") for k in f.keys())
    results = _dist.ok(_dist.run(_cases, 2, toy_checkpoint, str(tmp / "compiled.safetensors")))
    with torch.no_grad():
        out = ref(IDS)
    return reference(ref), out, results


def _unwrapped(tensors: dict) -> dict:
    return {strip_wrappers(k): v for k, v in tensors.items()}


def test_strip_wrappers():
    assert strip_wrappers("_orig_mod.blocks.0._checkpoint_wrapped_module.fc.weight") == "blocks.0.fc.weight"
    assert strip_wrappers("model.orig_mod_x.weight") == "model.orig_mod_x.weight"


def test_compiled_model_from_plain_checkpoint(loaded):
    want, _, results = loaded
    for r in results:
        case = r["compiled"]
        assert all(n.startswith("_orig_mod.") for n in case["names"])
        assert case["tied"]
        assert_same(_unwrapped(case["tensors"]), want)


def test_activation_checkpointed_blocks(loaded):
    want, out, results = loaded
    for r in results:
        case = r["checkpointed"]
        assert any("_checkpoint_wrapped_module." in n for n in case["names"])
        assert_same(_unwrapped(case["tensors"]), want)
        torch.testing.assert_close(case["out"], out, rtol=0, atol=1e-6)


def test_plain_model_from_compiled_checkpoint(loaded):
    want, out, results = loaded
    for r in results:
        case = r["from_compiled"]
        assert_same(case["tensors"], want)
        assert case["report"].unexpected == () and case["report"].missing == ()
        torch.testing.assert_close(case["out"], out, rtol=0, atol=1e-6)
