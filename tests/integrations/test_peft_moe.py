"""PEFT LoRA over transformers 5 MoE models (fused experts), on 2 and 3 gloo ranks, the checkpoints and the
saves' out_dir hidden from ranks other than 0, compared bit for bit with single-process transformers and PEFT:

- a Hub per-expert checkpoint (``block_sparse_moe.experts.{e}.w1/w2/w3``, as 5.24's own ``save_pretrained``
  writes it) into ``get_peft_model(model, LoraConfig)`` built in ``model_fn``, with the conversions the bare
  model gets: LoRA on attention alone, and on the fused experts too (``target_parameters``: PEFT's
  ParamWrapper, ``mlp.experts.base_layer.base_layer.gate_up_proj``), fp32 and bf16, Mixtral and
  Qwen3-MoE; equal to ``get_peft_model(AutoModelForCausalLM.from_pretrained(ckpt), same config)`` with
  rank 0's seed, every parameter's ``full_tensor()`` and every buffer, logits too;
- the base checkpoint with an adapter PEFT's own ``save_pretrained`` wrote (``adapter=``), equal to
  ``PeftModel.from_pretrained``;
- ``save_sharded`` of that model: the full model (the per-expert Hub key set, config.json, plus the
  adapters under the PeftModel's names), which ``AutoModelForCausalLM.from_pretrained`` reads, and the
  adapter (``adapter="default"``), which ``PeftModel.from_pretrained`` reads; and the full save loaded
  back into the PeftModel;
- an adapter whose ``target_parameters`` differ from the model's: the same ModelMismatchError on every rank.

transformers 4.57 keeps per-expert modules (no fused experts, no ``target_parameters`` to aim at): the
module is skipped there; tests/integrations/test_peft.py covers PEFT on 4.57.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import pytest
import torch

from tests import _dist
from tests import moe_models as mm
from tests.models import assert_same, gather, reference

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip(
        f"transformers {transformers.__version__} has no fused MoE experts (per-expert modules load a Hub "
        "checkpoint as they are): nothing here to convert",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.transformers, pytest.mark.peft]

BF16 = torch.bfloat16
SEED = 1234
TARGETS = ("attention", "experts")


def lora_config(targets: str = "experts"):
    """LoRA on q_proj / v_proj; with ``"experts"`` on the fused expert parameters too (ParamWrapper)."""
    from peft import LoraConfig

    extra = {"target_parameters": ["gate_up_proj", "down_proj"]} if targets == "experts" else {}
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, **extra)


def peft_model(family: str, targets: str):
    """model_fn: the model from its config, as a user's own code builds it, wrapped by get_peft_model."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    return get_peft_model(AutoModelForCausalLM.from_config(mm.config(family)), lora_config(targets))


@dataclass(frozen=True)
class Job:
    family: str
    ckpt: str
    targets: str = "experts"
    dtype: torch.dtype | None = None
    adapter: str | None = None  # load_sharded(adapter=...)
    save_full: str | None = None  # save_sharded(model) here
    save_adapter: str | None = None  # save_sharded(model, adapter="default") here
    error: bool = False  # must raise the same LoadError on every rank


# --- every rank -----------------------------------------------------------------------------------------


def _run_job(job: Job) -> dict:
    import torch.distributed as dist

    import rank0load

    torch.manual_seed(SEED + dist.get_rank())  # rank 0's state decides the adapters on every rank
    model = rank0load.load_sharded(
        functools.partial(peft_model, job.family, job.targets), job.ckpt, dtype=job.dtype, adapter=job.adapter
    )
    report = model.rank0load_report
    out: dict = {
        "kept": report.kept,
        "missing": report.missing,
        "grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "tensors": gather(model),
    }
    with torch.no_grad():
        out["logits"] = model.eval()(**mm.sample_inputs()).logits
    if job.save_full is not None:
        rank0load.save_sharded(model, job.save_full, max_shard_size=mm.SHARD)
    if job.save_adapter is not None:
        rank0load.save_sharded(model, job.save_adapter, adapter="default")
    return out


def _run_all(rank: int, world: int, root: str, jobs: dict[str, Job]) -> dict:
    mm._quiet()
    return _dist.run_jobs(rank, root, jobs, _run_job, expects_error=lambda job: job.error)


# --- the checkpoints and the references -----------------------------------------------------------------


def _one_thread(fn):
    """The ranks run on one thread each: so does the reference, for bit-equal logits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def _pretrained(family: str, path: str, dtype: torch.dtype | None = None, **kwargs):
    from transformers import AutoModelForCausalLM

    mm._quiet()
    return AutoModelForCausalLM.from_pretrained(path, **({"dtype": dtype} if dtype else {}), **kwargs)


@functools.cache
def _expect(family: str, base: str, targets: str, dtype: torch.dtype | None, adapter: str | None) -> dict:
    """Single-process transformers and PEFT: ``get_peft_model(from_pretrained(base))`` with rank 0's seed,
    or ``PeftModel.from_pretrained(from_pretrained(base), adapter)``."""
    from peft import PeftModel, get_peft_model

    def run() -> dict:
        torch.manual_seed(SEED)
        model = _pretrained(family, base, dtype)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
        else:
            model = get_peft_model(model, lora_config(targets))
        out = {"tensors": reference(model), "grad": {n: p.requires_grad for n, p in model.named_parameters()}}
        with torch.no_grad():
            out["logits"] = model.eval()(**mm.sample_inputs()).logits
            out["base_logits"] = _pretrained(family, base, dtype).eval()(**mm.sample_inputs()).logits
        return out

    return _one_thread(run)


def _peft_adapter(base: str, path: str) -> None:
    """An adapter as a user's earlier run left it: non-zero LoRA weights on attention and on the fused
    experts, written by PEFT's own ``save_pretrained``."""
    from peft import get_peft_model

    model = get_peft_model(_pretrained("mixtral", base), lora_config("experts"))
    torch.manual_seed(99)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = str(tmp_path_factory.mktemp("peft-moe"))  # hidden from ranks other than 0
    bases = {family: os.path.join(root, family) for family in ("mixtral", "qwen3_moe")}
    for family, path in bases.items():
        mm.save(family, path, seed=3)  # the Hub's per-expert layout, as 5.x's save_pretrained writes it
    _peft_adapter(bases["mixtral"], os.path.join(root, "peft-adapter"))
    # the saves too: ranks other than 0 neither see nor touch out_dir, and reload the full save unseen
    return {"root": root, "bases": bases, "outs": os.path.join(root, "out")}


def _jobs(setup: dict, world: int) -> dict[str, Job]:
    mixtral, qwen = setup["bases"]["mixtral"], setup["bases"]["qwen3_moe"]
    adapter = os.path.join(setup["root"], "peft-adapter")
    outs = os.path.join(setup["outs"], f"{world}ranks")
    return {
        "attention": Job("mixtral", mixtral, "attention"),
        "experts": Job("mixtral", mixtral, "experts"),
        "experts-bf16": Job("mixtral", mixtral, "experts", BF16),
        "qwen3-experts": Job("qwen3_moe", qwen, "experts"),
        "resume": Job(
            "mixtral", mixtral, adapter=adapter, save_full=f"{outs}/full", save_adapter=f"{outs}/adapter"
        ),
        "resume-full-save": Job("mixtral", f"{outs}/full"),
        "wrong-targets": Job("mixtral", mixtral, "attention", adapter=adapter, error=True),
    }


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ran(request: pytest.FixtureRequest, setup: dict) -> dict:
    jobs = _jobs(setup, request.param)
    results = _dist.run(_run_all, request.param, setup["root"], jobs, timeout=600, pg_timeout=120)
    for r, res in enumerate(results):
        if isinstance(res, _dist.Raised):
            pytest.fail(f"rank {r} failed outside the jobs: {res.message}\n{res.tb}")
        assert res["touched"] == [], f"rank {r} touched the checkpoint: {res['touched'][:5]}"
    out = {name: [res["jobs"].get(name) for res in results] for name in jobs}
    return {"results": out, "jobs": jobs}


def _got(ran: dict, name: str) -> list[dict]:
    for r, got in enumerate(ran["results"][name]):
        assert got is not None, f"rank {r}: not run (an earlier job failed)"
    return _dist.ok(ran["results"][name])


def _lora(tensors: dict) -> list[str]:
    return sorted(k for k in tensors if ".lora_" in k)


# --- the tests ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["attention", "experts", "experts-bf16", "qwen3-experts"])
def test_hub_checkpoint_into_a_peft_model(setup, ran, name):
    job = ran["jobs"][name]
    want = _expect(job.family, job.ckpt, job.targets, job.dtype, None)
    lora = _lora(want["tensors"])
    fused = [k for k in lora if ".mlp.experts." in k]
    assert bool(fused) == (job.targets == "experts"), fused  # lora_A/B of gate_up_proj and down_proj
    for got in _got(ran, name):
        assert_same(got["tensors"], want["tensors"])
        assert sorted(got["kept"]) == lora and got["missing"] == ()  # adapters as PEFT drew them
        assert got["grad"] == want["grad"]
        assert torch.equal(got["logits"], want["logits"])
        assert torch.equal(got["logits"], want["base_logits"])  # lora_B = 0: the base model's output
    if job.dtype == BF16:
        t = want["tensors"]
        assert (
            t["base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj"].dtype == BF16
        )
        assert all(t[k].dtype == torch.float32 for k in lora)  # get_peft_model keeps adapters in fp32


@pytest.mark.slow
def test_resume_from_a_peft_adapter_on_the_experts(setup, ran):
    want = _expect(
        "mixtral", setup["bases"]["mixtral"], "experts", None, os.path.join(setup["root"], "peft-adapter")
    )
    assert any(
        want["tensors"][k].any() for k in _lora(want["tensors"]) if ".mlp.experts." in k and "lora_B" in k
    )
    for got in _got(ran, "resume"):
        assert_same(got["tensors"], want["tensors"])
        assert got["kept"] == () and got["missing"] == ()
        assert torch.equal(got["logits"], want["logits"])
        assert not torch.equal(got["logits"], want["base_logits"])  # the adapter acts


def _saved_keys(path: str) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                out.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return out


@pytest.mark.slow
def test_full_save_reads_with_from_pretrained(setup, ran):
    """The full save holds the base model as the Hub stores it (per-expert, config.json) and the adapters
    under the PeftModel's names: from_pretrained reads the base, leaving the adapters aside."""
    loaded = _got(ran, "resume")[0]["tensors"]
    full = os.path.join(setup["outs"], f"{len(ran['results']['resume'])}ranks", "full")
    hub = mm.headers(setup["bases"]["mixtral"])
    lora = _lora(loaded)
    assert sorted(_saved_keys(full)) == sorted([*hub, *lora])
    assert {k: s for k, s in _saved_keys(full).items() if k in hub} == {k: v[1] for k, v in hub.items()}
    assert os.path.exists(os.path.join(full, "config.json"))

    def read() -> tuple:
        model, info = _pretrained("mixtral", full, output_loading_info=True)
        return reference(model), info

    back, info = _one_thread(read)
    assert info["missing_keys"] == set() or not info["missing_keys"], info["missing_keys"]
    assert sorted(info["unexpected_keys"]) == lora, info["unexpected_keys"]
    assert_same(back, reference(_pretrained("mixtral", setup["bases"]["mixtral"])))


@pytest.mark.slow
def test_adapter_save_reads_with_peft(setup, ran):
    """``PeftModel.from_pretrained(from_pretrained(full save), adapter save)`` is the loaded model."""
    from peft import PeftModel

    loaded = _got(ran, "resume")[0]["tensors"]
    out = os.path.join(setup["outs"], f"{len(ran['results']['resume'])}ranks")
    assert sorted(os.listdir(f"{out}/adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    with open(f"{out}/adapter/adapter_config.json") as f:
        assert sorted(json.load(f)["target_parameters"]) == ["down_proj", "gate_up_proj"]
    back = PeftModel.from_pretrained(_pretrained("mixtral", f"{out}/full"), f"{out}/adapter")
    assert_same(reference(back), loaded)


@pytest.mark.slow
def test_full_save_loads_back_into_the_peft_model(setup, ran):
    loaded = _got(ran, "resume")[0]["tensors"]
    for got in _got(ran, "resume-full-save"):
        assert_same(got["tensors"], loaded)
        assert got["kept"] == () and got["missing"] == ()


@pytest.mark.slow
def test_adapter_with_other_target_parameters_raises_on_every_rank(setup, ran):
    error = _dist.same_error(ran["results"]["wrong-targets"], "ModelMismatchError")
    assert (
        "target_parameters: the model has none, the adapter ['down_proj', 'gate_up_proj']" in error.message
    ), error.message
    assert "PeftConfig.from_pretrained(" in error.message


# --- one process: the names -----------------------------------------------------------------------------


def test_hub_keys_resolve_to_the_peft_models_fused_tensors(tmp_path):
    """Every per-expert key of a Hub checkpoint finds its PeftModel tensor through transformers'
    conversions on the base model's names, nested ``base_layer``s and all."""
    from rank0load.integrations._convert import conversions_for
    from rank0load.integrations._resolve import KeyResolver
    from rank0load.model._meta import describe

    mm.save("mixtral", tmp_path)
    torch.manual_seed(0)
    model = peft_model("mixtral", "experts")
    keys = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    layout = describe(model)
    resolver = KeyResolver(layout.canonical, conversions_for(model, keys), layout.canonical_all)
    hub = sorted(mm.headers(tmp_path))
    resolved = dict(zip(hub, list(zip(*resolver.resolve_columns(hub)))))
    assert [k for k, (target, _) in resolved.items() if target is None] == []
    target, match = resolved["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    assert target == "base_model.model.model.layers.1.mlp.experts.base_layer.base_layer.gate_up_proj"
    assert match is not None and (match.expert, match.source, match.sources) == (3, 1, 2)
    target, match = resolved["model.layers.0.block_sparse_moe.experts.4.w2.weight"]
    assert target == "base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.down_proj"
    assert resolved["model.layers.0.block_sparse_moe.gate.weight"][0] == (
        "base_model.model.model.layers.0.mlp.gate.weight"
    )
    assert resolved["model.layers.0.self_attn.q_proj.weight"][0] == (
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    )


def test_saved_names_are_the_hub_names_and_the_adapters_own():
    """original_format for a PeftModel: base tensors reverted to the per-expert Hub names, adapters as
    they are; the adapter names are the LoRA tensors' (attention and fused experts), nothing else."""
    from rank0load.integrations import _peft
    from rank0load.integrations._convert import Reverted, original_format_reversal

    model = peft_model("mixtral", "experts")
    adapters = _peft.adapter_parameters(model)
    assert sorted(adapters) == _lora(dict(model.named_parameters()))
    assert "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.default.weight" in adapters
    revert = original_format_reversal(model, adapters)
    assert revert is not None
    fused = "base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj"
    parts = revert(fused, (mm.EXPERTS, 48, 32))
    assert [p.name for p in parts[:3]] == [
        "model.layers.0.block_sparse_moe.experts.0.w1.weight",
        "model.layers.0.block_sparse_moe.experts.0.w3.weight",
        "model.layers.0.block_sparse_moe.experts.1.w1.weight",
    ]
    assert len(parts) == 2 * mm.EXPERTS and {p.shape for p in parts} == {(24, 32)}
    lora = "base_model.model.model.layers.0.mlp.experts.lora_B.default.weight"
    assert revert(lora, (32, 20)) == [Reverted(lora, (32, 20))]
    assert revert("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", (32, 32)) == [
        Reverted("model.layers.0.self_attn.q_proj.weight", (32, 32))
    ]
    assert _peft.base_key(fused) == "model.layers.0.mlp.experts.gate_up_proj"
