"""Conversions for models that are not transformers models (rank0load.StackExperts), the block path
for stacked experts, conversions rank0load cannot do, and ``inspect`` showing the plan.

A torchtitan-style MoE holds stacked experts (``moe.experts.w13`` [E, 2I, H], ``moe.experts.w2``
[E, H, I]); its checkpoint is in the Hub's per-expert layout. 5 experts over 2 and 3 ranks: uneven.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests import _dist
from tests.models import assert_same, gather

E, H, I = 5, 12, 6  # noqa: E741  (dimension 1 divides 2 and 3 ranks: FSDP2 shards it evenly only)


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.randn(E, 2 * I, H))
        self.w2 = nn.Parameter(torch.randn(E, H, I))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.moe = nn.Module()
        self.moe.experts = Experts()


class TitanMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, H)
        self.layers = nn.ModuleList(Layer() for _ in range(2))


def titan() -> TitanMoE:
    return TitanMoE()


RULES = [
    (
        "layers.*.moe.experts.w13",
        ("layers.*.feed_forward.experts.{e}.w1.weight", "layers.*.feed_forward.experts.{e}.w3.weight"),
    ),
    ("layers.*.moe.experts.w2", ("layers.*.feed_forward.experts.{e}.w2.weight",)),
]


def rules():
    import rank0load

    return [rank0load.StackExperts(target=t, sources=s) for t, s in RULES]


def hub_layout(model: TitanMoE) -> dict[str, torch.Tensor]:
    """The per-expert checkpoint a Hub repo would hold for ``model``."""
    sd: dict[str, torch.Tensor] = {"embed.weight": model.embed.weight.detach().clone()}
    for i, layer in enumerate(model.layers):
        sd[f"layers.{i}.router.weight"] = layer.router.weight.detach().clone()
        for e in range(E):
            w13 = layer.moe.experts.w13[e].detach()
            sd[f"layers.{i}.feed_forward.experts.{e}.w1.weight"] = w13[:I].clone()
            sd[f"layers.{i}.feed_forward.experts.{e}.w3.weight"] = w13[I:].clone()
            sd[f"layers.{i}.feed_forward.experts.{e}.w2.weight"] = layer.moe.experts.w2[e].detach().clone()
    return sd


def expert_cols(model: nn.Module, mesh) -> None:
    """FSDP2 with the stacked experts sharded on dimension 1 (E does not divide the world)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 3 else Shard(0))


def _load(rank: int, world: int, path: str, placement: str) -> dict:
    import rank0load

    shard_fn = expert_cols if placement == "shard1" else None
    model = rank0load.load_sharded(
        titan, path, shard_fn=shard_fn, conversions=rules(), max_staging_bytes=4096
    )
    report = model.rank0load_report
    return {"tensors": gather(model), "kinds": report.kinds, "assembled": report.assembled}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = titan()
    path = str(tmp_path_factory.mktemp("titan") / "model.safetensors")
    save_file(hub_layout(model), path)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    return path, want


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("placement", ["shard0", "shard1"])
def test_stack_experts_for_a_model_that_is_not_a_transformers_model(checkpoint, world, placement):
    path, want = checkpoint
    for r in _dist.ok(_dist.run(_load, world, path, placement)):
        assert_same(r["tensors"], want)
        assert r["assembled"] == (2 * 3 * E, 4)  # 30 per-expert tensors into 4 stacked parameters
        kind = "block" if placement == "shard1" else "sharded"  # shard1: cut by rank 0, never whole
        assert {r["kinds"][f"layers.{i}.moe.experts.{w}"] for i in (0, 1) for w in ("w13", "w2")} == {kind}


BLOCK = (4, 4)  # partial blocks: I = 6 and H = 12 rows are no multiples of 4 everywhere


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """The per-expert checkpoint with every expert weight in float8 plus its ``weight_scale_inv``
    (the Hub's FP8 layout, block size in config.json); what a load must give: each expert weight
    dequantised (``moe_models.dequantize``, transformers' formula) and stacked."""
    import json

    from safetensors.torch import save_file

    from tests import moe_models as mm

    torch.manual_seed(1)
    model = titan()
    sd, want = {}, {n: p.detach().clone() for n, p in model.named_parameters()}
    for key, value in hub_layout(model).items():
        if ".experts." not in key:
            sd[key] = value
            continue
        q, scale = mm.quantize(value, BLOCK)
        sd[key], sd[key + "_scale_inv"] = q, scale
    for i in range(2):
        w13 = want[f"layers.{i}.moe.experts.w13"]
        w2 = want[f"layers.{i}.moe.experts.w2"]
        for e in range(E):
            for rows, name in ((slice(0, I), "w1"), (slice(I, 2 * I), "w3")):
                k = f"layers.{i}.feed_forward.experts.{e}.{name}.weight"
                w13[e, rows] = mm.dequantize(sd[k], sd[k + "_scale_inv"], BLOCK)
            k = f"layers.{i}.feed_forward.experts.{e}.w2.weight"
            w2[e] = mm.dequantize(sd[k], sd[k + "_scale_inv"], BLOCK)
    root = tmp_path_factory.mktemp("titan-fp8")
    save_file(sd, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"quantization_config": mm.fp8_config(BLOCK)}))
    return str(root), want


def _load_fp8(rank: int, world: int, path: str, staging: int) -> dict:
    import rank0load

    model = rank0load.load_sharded(
        titan, path, shard_fn=expert_cols, conversions=rules(), max_staging_bytes=staging
    )
    report = model.rank0load_report
    return {"tensors": gather(model), "kinds": report.kinds, "dequantised": report.dequantised}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("staging", [4096, 1024], ids=["rows", "expert-rows"])
def test_fp8_experts_under_shard1_are_cut_by_rank0_and_dequantised_by_their_owner(
    fp8_checkpoint, world, staging
):
    """FP8 per-expert sources stacked into experts sharded on dimension 1: each rank receives its
    float8 block (never the whole tensor) and dequantises it with the scales of the rows and columns
    it holds. 4096 bytes of staging: chunks of whole experts; 1024: rows of one expert at a time."""
    path, want = fp8_checkpoint
    for r in _dist.ok(_dist.run(_load_fp8, world, path, staging)):
        assert_same(r["tensors"], want)
        assert r["dequantised"] == 4
        assert {r["kinds"][f"layers.{i}.moe.experts.{w}"] for i in (0, 1) for w in ("w13", "w2")} == {"block"}


class NeedsTranspose:
    """A conversion rank0load cannot assemble: it must say so, naming the rule."""

    def match(self, key: str):
        from rank0load.integrations._convert import ConversionMatch

        if key.endswith(".w2.weight") and ".experts.0." in key:
            layer = key.split(".")[1]
            return ConversionMatch(
                f"layers.{layer}.moe.experts.w2", None, 0, 1, "NeedsTranspose(w2)", "needs Transpose(dim=1)"
            )
        return None


def _unsupported(rank: int, world: int, path: str) -> None:
    import rank0load

    rank0load.load_sharded(titan, path, conversions=[NeedsTranspose(), *rules()[:1]])


def test_a_conversion_rank0load_cannot_do_is_an_error_naming_it(checkpoint):
    path, _ = checkpoint
    error = _dist.same_error(_dist.run(_unsupported, 2, path), "ModelMismatchError")
    assert "NeedsTranspose(w2)" in error.message and "needs Transpose(dim=1)" in error.message, error.message
    assert "layers.0.moe.experts.w2" in error.message


def _missing_expert(rank: int, world: int, path: str) -> None:
    import rank0load

    rank0load.load_sharded(titan, path, conversions=rules())


def test_a_missing_expert_names_the_key(tmp_path, checkpoint):
    from safetensors.torch import load_file, save_file

    path, _ = checkpoint
    sd = load_file(path)
    del sd["layers.1.feed_forward.experts.3.w3.weight"]
    broken = str(tmp_path / "model.safetensors")
    save_file(sd, broken)
    error = _dist.same_error(_dist.run(_missing_expert, 2, broken), "ModelMismatchError")
    assert "layers.1.moe.experts.w13" in error.message and "no expert 3" in error.message, error.message
    assert "layers.1.feed_forward.experts.3.w3.weight" in error.message, error.message


def test_stack_experts_checks_its_patterns():
    import rank0load

    with pytest.raises(ValueError, match="exactly one"):
        rank0load.StackExperts(target="a.w", sources=("a.experts.w1",))
    with pytest.raises(ValueError, match="as many"):
        rank0load.StackExperts(target="layers.*.w", sources=("experts.{e}.w1",))


def test_inspect_shows_the_conversions(checkpoint):
    from rank0load.checkpoint._inspect import inspect_checkpoint

    path, _ = checkpoint
    plain = inspect_checkpoint(path, model_fn=titan)
    assert not plain.fits and "layers.0.moe.experts.w13" in plain.missing
    result = inspect_checkpoint(path, model_fn=titan, conversions=rules())
    assert result.fits, (result.missing, result.unexpected, result.mismatched)
    assert len(result.converted) == 4
    assert any(line.startswith("layers.0.moe.experts.w13 <- 10 tensors") for line in result.converted)


@pytest.mark.transformers
def test_inspect_shows_transformers_conversions(tmp_path):
    """A transformers MoE saved per expert: inspect --model lists the fused targets (5.x fuses the
    experts; 4.57's Mixtral keeps them per expert, so nothing is converted), and it fits."""
    import sys

    import transformers

    from rank0load.__main__ import main
    from tests import moe_models

    directory = tmp_path / "mixtral"
    moe_models.save("mixtral", directory)
    out = tmp_path / "out.txt"
    stdout = sys.stdout
    try:
        with open(out, "w") as sys.stdout:
            code = main(["inspect", str(directory), "--model", "tests.integrations.test_convert:mixtral"])
    finally:
        sys.stdout = stdout
    text = out.read_text()
    assert code == 0 and "fits the model" in text, text
    fused = int(transformers.__version__.split(".")[0]) >= 5
    assert ("assembled or dequantised (conversions)" in text) == fused, text
    assert ("mlp.experts.gate_up_proj <- 10 tensors" in text) == fused, text


def mixtral():
    from transformers import AutoModelForCausalLM

    from tests import moe_models

    return AutoModelForCausalLM.from_config(moe_models.config("mixtral"))
