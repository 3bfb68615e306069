"""PEFT LoRA through load_sharded, on 2 and 3 gloo ranks, the checkpoints hidden from ranks other than 0,
compared bit for bit with single-process PEFT on the installed transformers and peft:

- the base checkpoint into ``get_peft_model(base, LoraConfig)`` built in ``model_fn``, no key_map, strict
  (fp32 and bf16): equal to ``get_peft_model(from_pretrained(base))`` with the same seed, every parameter
  and buffer (lora_B zeros, lora_A as PEFT draws it), the adapters listed apart (``LoadReport.kept``),
  logits equal to the base model's, ``requires_grad`` as PEFT set it;
- two training steps (SGD, ``rank0load.clip_grad_norm_``), each rank its own batch, equal to float32
  rounding to the same steps on the reference over every rank's batch;
- the adapter saved in PEFT's layout (``save_sharded(..., adapter="default")``), read by
  ``PeftModel.from_pretrained``;
- resume: base checkpoint + an adapter PEFT's own ``save_pretrained`` wrote, in one load, equal to
  ``PeftModel.from_pretrained``; a full save_sharded of the PeftModel loads back as it was;
- a LoHa adapter (another tuner with ``base_layer``) from the base checkpoint;
- a load in which nothing matched raises on every rank whatever strict is; get_peft_model after
  loading is caught at the first forward on every rank.

One spawn per world size runs every job (transformers' and peft's imports dominate a spawn).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import pytest
import torch

from tests import _dist, hf
from tests.models import assert_same, gather, reference

pytestmark = [pytest.mark.slow, pytest.mark.torch_range, pytest.mark.peft]

BF16 = torch.bfloat16
IDS = torch.tensor([[1, 5, 9, 2, 7, 3, 60, 33], [4, 4, 8, 1, 0, 6, 57, 17]])
SEED = 1234
STEPS = 2
LR = 0.5
# Large enough that neither rank0load's nor torch's clipping scales (both multiply by exactly 1.0):
# tests/train/test_clip.py checks the clipping itself.
MAX_NORM = 1e6


def lora_config(kind: str = "lora"):
    from peft import LoHaConfig, LoraConfig

    if kind == "loha":
        return LoHaConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"], init_weights=True)
    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def base_model():
    """model_fn's base: the model from its config, as a user's own code builds it."""
    return hf.model_class("llama_untied")(hf.config("llama_untied"))


def peft_model(kind: str = "lora"):
    from peft import get_peft_model

    return get_peft_model(base_model(), lora_config(kind))


@dataclass
class Job:
    ckpt: str
    dtype: torch.dtype | None = None
    kind: str = "lora"
    adapter: str | None = None  # load_sharded(adapter=...)
    train: bool = False  # STEPS training steps after loading
    save_adapter: str | None = None  # save_sharded(adapter="default") here after training
    save_full: str | None = None  # save_sharded(model) here after training
    extra: dict = field(default_factory=dict)
    how: str = "load"  # "trap": get_peft_model after loading; "nomatch": a wrapper no key matches


class Wrapped(torch.nn.Module):
    """A user's wrapper around the base model: every name gains "inner.", none matches the checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = base_model()


# --- every rank -----------------------------------------------------------------------------------------


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s own training batch at ``step`` (data parallelism: a different one on every rank)."""
    return torch.randint(0, 67, (2, 8), generator=torch.Generator().manual_seed(50 + 1000 * step + rank))


def _train(model, rank: int) -> torch.Tensor:
    """STEPS SGD steps, each on this rank's own batch; FSDP2 averages the ranks' gradients."""
    import rank0load

    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    norms = []
    for step in range(STEPS):
        ids = batch(step, rank)
        model(input_ids=ids, labels=ids).loss.backward()
        norms.append(rank0load.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], MAX_NORM))
        opt.step()
        opt.zero_grad()
    return torch.stack(norms)


def _error_job(job: Job) -> dict:
    """A job that must raise the same error on every rank: (class name, message)."""
    import rank0load

    try:
        if job.how == "nomatch":
            errors = {}
            for strict in (True, False):
                try:
                    rank0load.load_sharded(Wrapped, job.ckpt, strict=strict)
                except rank0load.LoadError as exc:
                    errors[f"error-{strict}"] = (type(exc).__name__, str(exc))
            return {"errors": errors}
        from peft import get_peft_model

        model = get_peft_model(rank0load.load_sharded(base_model, job.ckpt), lora_config())
        model(input_ids=IDS)
        return {"errors": {}}
    except rank0load.LoadError as exc:
        return {"errors": {"trap": (type(exc).__name__, str(exc))}}


def _run_job(job: Job) -> dict:
    import torch.distributed as dist

    import rank0load

    if job.how != "load":
        return _error_job(job)

    torch.manual_seed(SEED + dist.get_rank())  # rank 0's state decides the adapters on every rank
    model = rank0load.load_sharded(
        functools.partial(peft_model, job.kind), job.ckpt, dtype=job.dtype, adapter=job.adapter, **job.extra
    )
    report = model.rank0load_report
    out: dict = {
        "kept": report.kept,
        "missing": report.missing,
        "grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "tensors": gather(model),
    }
    with torch.no_grad():
        out["logits"] = model.eval()(input_ids=IDS).logits
    if job.train:
        out["norms"] = _train(model, dist.get_rank())
        out["trained"] = gather(model)
    if job.save_adapter is not None:
        rank0load.save_sharded(model, job.save_adapter, adapter="default")
    if job.save_full is not None:
        rank0load.save_sharded(model, job.save_full)
    return out


def _run_all(rank: int, world: int, root: str, jobs: dict[str, Job]) -> dict:
    hf._quiet()
    return _dist.run_jobs(rank, root, jobs, _run_job)


# --- the checkpoints and the references -----------------------------------------------------------------


@functools.cache
def _base_path(root: str) -> str:
    path = os.path.join(root, "base")
    hf.pretrained("llama_untied", seed=3).save_pretrained(path, max_shard_size="20KB")
    return path


def _reference(base: str, dtype: torch.dtype | None, kind: str = "lora", adapter: str | None = None):
    """Single-process PEFT: get_peft_model(from_pretrained(base)) with rank 0's seed, or
    PeftModel.from_pretrained(from_pretrained(base), adapter)."""
    from peft import PeftModel, get_peft_model

    torch.manual_seed(SEED)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = hf.model_class("llama_untied").from_pretrained(base, **kwargs)
    if adapter is not None:
        return PeftModel.from_pretrained(model, adapter, is_trainable=True)
    return get_peft_model(model, lora_config(kind))


def _one_thread(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _expect(
    base: str, dtype: torch.dtype | None, kind: str, train: bool, adapter: str | None = None, world: int = 1
) -> dict:
    """The reference; ``train``: STEPS SGD steps over ``world`` ranks' batches (each batch's backward,
    summed and divided by ``world``: the mean gradient FSDP2 gives every rank)."""

    def run() -> dict:
        model = _reference(base, dtype, kind, adapter)
        out: dict = {
            "tensors": reference(model),
            "grad": {n: p.requires_grad for n, p in model.named_parameters()},
        }
        with torch.no_grad():
            out["logits"] = model.eval()(input_ids=IDS).logits
            kwargs = {"dtype": dtype} if dtype is not None else {}
            plain = hf.model_class("llama_untied").from_pretrained(base, **kwargs).eval()
            out["base_logits"] = plain(input_ids=IDS).logits
        if train:
            model.train()
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
            norms = []
            trainable = [p for p in model.parameters() if p.requires_grad]
            for step in range(STEPS):
                for rank in range(world):
                    ids = batch(step, rank)
                    model(input_ids=ids, labels=ids).loss.backward()
                for p in trainable:
                    p.grad /= world
                norms.append(torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM))
                opt.step()
                opt.zero_grad()
            out["norms"] = torch.stack(norms)
            out["trained"] = reference(model)
            out["model"] = model
        return out

    hf._quiet()
    return _one_thread(run)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = str(tmp_path_factory.mktemp("peft"))  # hidden from ranks other than 0
    base = _base_path(root)
    # An adapter as a user's earlier run left it: PEFT's own save_pretrained after training.
    trained = _expect(base, None, "lora", True)["model"]
    trained.save_pretrained(os.path.join(root, "peft-adapter"))
    outs = str(tmp_path_factory.mktemp("peft-out"))
    jobs = {
        "lora-fp32-train": Job(base, train=True, save_adapter=f"{outs}/adapter", save_full=f"{outs}/full"),
        "lora-bf16": Job(base, BF16),
        "resume-peft-adapter": Job(base, adapter=os.path.join(root, "peft-adapter")),
        "resume-full-save": Job(f"{outs}/full"),
        "loha": Job(base, kind="loha"),
        "nomatch": Job(base, how="nomatch"),
        "trap": Job(base, how="trap"),
    }
    return {"root": root, "base": base, "outs": outs, "jobs": jobs}


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ran(request: pytest.FixtureRequest, setup: dict) -> dict:
    results = _dist.run(_run_all, request.param, setup["root"], setup["jobs"], timeout=600, pg_timeout=120)
    for r, res in enumerate(results):
        if isinstance(res, _dist.Raised):
            pytest.fail(f"rank {r} failed outside the jobs: {res.message}\n{res.tb}")
        assert res["touched"] == [], f"rank {r} touched the checkpoint: {res['touched'][:5]}"
    return {name: [res["jobs"].get(name) for res in results] for name in setup["jobs"]}


def _got(ran: dict, name: str) -> list[dict]:
    for r, got in enumerate(ran[name]):
        assert got is not None, f"rank {r}: not run (an earlier job failed)"
    return _dist.ok(ran[name])


def _lora_keys(tensors: dict) -> list[str]:
    return sorted(k for k in tensors if ".lora_" in k or ".hada_" in k)


# --- the tests ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype", [("lora-fp32-train", None), ("lora-bf16", BF16)])
def test_base_checkpoint_into_a_peft_model(setup, ran, name, dtype):
    want = _expect(setup["base"], dtype, "lora", False)
    for got in _got(ran, name):
        assert_same(got["tensors"], want["tensors"])
        lora = _lora_keys(want["tensors"])
        assert lora and sorted(got["kept"]) == sorted(k for k in lora if k in got["tensors"]), got["kept"]
        assert got["missing"] == ()
        assert all(not want["tensors"][k].any() for k in lora if ".lora_B." in k)  # PEFT: B starts at zero
        assert all(want["tensors"][k].std() > 0 for k in lora if ".lora_A." in k)
        assert got["grad"] == want["grad"]  # base frozen, adapters trainable, as PEFT set them
        assert torch.equal(got["logits"], want["logits"])
        assert torch.equal(got["logits"], want["base_logits"])  # lora_B = 0: the base model's output
    if dtype == BF16:  # get_peft_model keeps adapters in fp32 on a bf16 base
        t = want["tensors"]
        assert (
            t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"].dtype == torch.float32
        )
        assert t["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"].dtype == BF16


def test_two_training_steps_equal_the_reference(setup, ran):
    """Each rank its own batch: the averaged gradients, summed in another order than the reference's,
    agree to float32 rounding, and so do the SGD steps and the norms."""
    got_all = _got(ran, "lora-fp32-train")
    want = _expect(setup["base"], None, "lora", True, world=len(got_all))
    for got in got_all:
        assert sorted(got["trained"]) == sorted(want["trained"])
        for k, v in want["trained"].items():
            torch.testing.assert_close(
                got["trained"][k], v, rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}"
            )
        torch.testing.assert_close(got["norms"], want["norms"], rtol=1e-5, atol=1e-7)
        moved = [
            k for k in _lora_keys(want["trained"]) if not torch.equal(want["trained"][k], want["tensors"][k])
        ]
        assert moved, "training did not change the adapters"


def test_adapter_saved_in_peft_layout_reads_with_peft(setup, ran):
    _got(ran, "lora-fp32-train")
    out = os.path.join(setup["outs"], "adapter")
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    back = _reference(setup["base"], None, adapter=out)
    assert_same(reference(back), ran["lora-fp32-train"][0]["trained"])


def test_full_save_loads_back_into_the_peft_model(setup, ran):
    """save_sharded of the whole PeftModel writes its base model as save_pretrained writes it (base
    names, config.json: from_pretrained reads it, leaving the adapters aside) and the adapters under
    the PeftModel's names; load_sharded into the same model_fn restores base and adapters as trained
    (nothing kept, nothing missing)."""
    from safetensors.torch import load_file

    _got(ran, "lora-fp32-train")
    trained = ran["lora-fp32-train"][0]["trained"]
    full = os.path.join(setup["outs"], "full")
    saved = {}
    for name in os.listdir(full):
        if name.endswith(".safetensors"):
            saved.update(load_file(os.path.join(full, name)))
    lora = _lora_keys(trained)
    base = {
        k.removeprefix("base_model.model.").replace(".base_layer.", "."): k for k in trained if k not in lora
    }
    assert sorted(saved) == sorted([*(b for b in base if "inv_freq" not in b), *lora])  # non-persistent
    assert_same(saved, {k: trained[base.get(k, k)] for k in saved})
    plain = _one_thread(lambda: hf.model_class("llama_untied").from_pretrained(full))
    assert_same(reference(plain), {b: trained[k] for b, k in base.items()})
    for got in _got(ran, "resume-full-save"):
        assert_same(got["tensors"], trained)
        assert got["kept"] == () and got["missing"] == ()


def test_resume_from_a_peft_adapter(setup, ran):
    want = _expect(setup["base"], None, "lora", False, os.path.join(setup["root"], "peft-adapter"))
    for got in _got(ran, "resume-peft-adapter"):
        assert_same(got["tensors"], want["tensors"])
        assert got["kept"] == () and got["missing"] == ()
        assert torch.equal(got["logits"], want["logits"])


def test_loha_adapter_from_the_base_checkpoint(setup, ran):
    want = _expect(setup["base"], None, "loha", False)
    for got in _got(ran, "loha"):
        assert_same(got["tensors"], want["tensors"])
        assert got["kept"] and got["missing"] == ()
        assert torch.equal(got["logits"], want["logits"])


def test_nothing_matched_raises_on_every_rank_whatever_strict(setup, ran):
    results = _got(ran, "nomatch")
    for strict in (True, False):
        errors = [got["errors"].get(f"error-{strict}") for got in results]
        assert errors[0] is not None, f"strict={strict}: the load succeeded"
        assert all(e == errors[0] for e in errors), errors  # the same error on every rank
        cls, message = errors[0]
        assert cls == "ModelMismatchError", errors[0]
        assert "no checkpoint key matched any model key" in message, message
        assert "'model.embed_tokens.weight'" in message and "'inner.model.embed_tokens.weight'" in message
        assert "key_map=lambda k: 'inner.' + k" in message, message


def test_get_peft_model_after_loading_is_caught_at_the_first_forward(setup, ran):
    errors = [got["errors"].get("trap") for got in _got(ran, "trap")]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert errors[0][0] == "LoadError"
    assert "were added after load_sharded returned" in errors[0][1]
    assert "lora_A.default.weight" in errors[0][1] and "Build the PeftModel in model_fn" in errors[0][1]


def test_most_of_the_model_initialised_is_said_loudly(caplog):
    from rank0load.common._report import LoadReport, log_summary

    report = LoadReport(missing=("a.weight", "b.weight"), initialised_fraction=0.9)
    with caplog.at_level("WARNING", logger="rank0load"):
        log_summary(report, {})
    assert "MOST OF THE MODEL WAS NOT LOADED: 90%" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rank0load"):
        log_summary(LoadReport(missing=("a.weight",), initialised_fraction=0.1), {})
    assert "MOST OF THE MODEL" not in caplog.text and "initialised 1 tensors" in caplog.text
