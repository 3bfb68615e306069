"""The transformers range: the same loads against whichever transformers is installed (the newest in
CI's main leg, 4.57 in its second leg), each compared bit for bit with that version's own
``from_pretrained``, every parameter's full tensor and every buffer, on 2 and 3 gloo ranks with the
checkpoints hidden from ranks other than 0 (when the tests run as root).

- Llama tied (bf16) and untied (dtype=None);
- Mixtral per-expert (4.57 keeps per-expert modules; 5.x fuses them), in bf16;
- an FP8 block-quantised per-expert checkpoint into a bf16 Mixtral (dequantised on load);
- DeepSeek-V3 in bf16 with its fp32 router (5.24 keeps ``gate.weight`` fp32 inside each bf16 layer):
  a forward and a backward step, each rank its own batch, against the single-process model over every
  rank's batch (each rank's logits and loss exactly; the gradient of their mean);
- a remote-code class (``tests/remote_model.py``: a PreTrainedModel defined outside transformers, an
  fp32 module inside each bf16 block and an fp32 head on top), built in ``model_fn`` and through
  ``load_pretrained`` with and without ``dtype=``, with a forward and a backward step (as above);
- ``save_sharded`` of the bf16 Mixtral, read back by that version's ``from_pretrained``.

One spawn per world size runs every job (transformers' import dominates a spawn).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import pytest
import torch

from tests import _dist, hf
from tests import moe_models as mm
from tests import remote_model as rm
from tests.models import assert_same, gather, reference

pytestmark = [pytest.mark.slow, pytest.mark.transformers]

BF16 = torch.bfloat16
IDS = torch.tensor([[1, 5, 9, 2, 7, 3, 60, 33], [4, 4, 8, 1, 0, 6, 57, 17]])


@dataclass(frozen=True)
class Job:
    how: str  # "model_fn": load_sharded(model_fn); "pretrained": load_pretrained(model_cls)
    family: str  # hf / moe_models name, or "remote"
    path: str  # the checkpoint
    dtype: torch.dtype | None
    reference: str | None = None  # what from_pretrained reads for the expectation; None: path
    train: bool = False  # a forward and a backward step: loss and gradients compared too
    save_to: str | None = None  # save_sharded here after loading (rank 0 writes it)
    extra: dict = field(default_factory=dict)


def _model_cls(family: str):
    if family == "remote":
        return rm.TinyRemoteForCausalLM
    if family in mm.FAMILIES:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM
    return hf.model_class(family)


def _config(family: str):
    if family == "remote":
        return rm.TinyRemoteConfig()
    return mm.config(family) if family in mm.FAMILIES else hf.config(family)


def _build(family: str):
    """model_fn: the model from its config, as a user's own code builds it."""
    cfg = _config(family)
    if family == "remote":
        return rm.TinyRemoteForCausalLM(cfg)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(cfg)


def rank_ids(rank: int) -> torch.Tensor:
    """Rank ``rank``'s own training batch (data parallelism: every rank a different one)."""
    return torch.randint(3, 60, (2, 8), generator=torch.Generator().manual_seed(100 + rank))


def _step(model, family: str, ids: torch.Tensor = IDS) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, loss) of one forward on ``ids``; the loss is what backward() runs on."""
    if family == "remote":
        logits, value = model(ids)
        return logits, logits.float().mean() + value.float().mean()
    out = model(input_ids=ids, labels=ids)
    return out.logits, out.loss


# --- every rank -----------------------------------------------------------------------------------------


def _run_job(job: Job) -> dict:
    import rank0load

    if job.how == "pretrained":
        model = rank0load.load_pretrained(_model_cls(job.family), job.path, dtype=job.dtype, **job.extra)
    else:
        model = rank0load.load_sharded(functools.partial(_build, job.family), job.path, dtype=job.dtype)
    tensors = gather(model)
    out: dict = {"tensors": tensors, "config_dtype": str(model.config.dtype)}
    if job.train:
        import torch.distributed as dist

        model.train()
        logits, loss = _step(model, job.family, rank_ids(dist.get_rank()))
        loss.backward()
        out["logits"], out["loss"] = logits.detach(), loss.detach()
        out["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    else:
        with torch.no_grad():
            out["logits"] = _step(model.eval(), job.family)[0]
    if job.save_to is not None:
        rank0load.save_sharded(model, job.save_to)
    return out


def _run_all(rank: int, world: int, root: str, jobs: dict[str, Job]) -> dict:
    mm._quiet()
    return _dist.run_jobs(rank, root, jobs, _run_job)


# --- the checkpoints and the references -----------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("range")
    refs = tmp_path_factory.mktemp("range-refs")  # read by the test process only
    saves = tmp_path_factory.mktemp("range-saves")
    hf.pretrained("llama").save_pretrained(root / "llama", max_shard_size="20KB")
    hf.pretrained("llama_untied", seed=1).save_pretrained(root / "llama_untied", max_shard_size="20KB")
    mm.save("mixtral", root / "mixtral")
    mm.save_fp8("mixtral", root / "mixtral-fp8", (16, 16))
    mm.save_dequantized(root / "mixtral-fp8", refs / "mixtral-fp8")
    mm.save("deepseek_v3", root / "deepseek_v3")
    rm.save(str(root / "remote"))
    r = str(root)
    jobs = {
        "llama-tied-bf16": Job("model_fn", "llama", f"{r}/llama", BF16),
        "llama-untied-none": Job("model_fn", "llama_untied", f"{r}/llama_untied", None),
        "mixtral-bf16-save": Job("model_fn", "mixtral", f"{r}/mixtral", BF16, save_to=str(saves / "mixtral")),
        "mixtral-fp8-bf16": Job("model_fn", "mixtral", f"{r}/mixtral-fp8", BF16, str(refs / "mixtral-fp8")),
        "deepseek-bf16-train": Job("model_fn", "deepseek_v3", f"{r}/deepseek_v3", BF16, train=True),
        "remote-model_fn-bf16-train": Job("model_fn", "remote", f"{r}/remote", BF16, train=True),
        "remote-pretrained-bf16": Job("pretrained", "remote", f"{r}/remote", BF16),
        "remote-pretrained-none": Job("pretrained", "remote", f"{r}/remote", None),
        "llama-pretrained-bf16": Job("pretrained", "llama", f"{r}/llama", BF16),
    }
    return {"root": r, "jobs": jobs}


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ran(request: pytest.FixtureRequest, setup: dict) -> dict:
    results = _dist.run(_run_all, request.param, setup["root"], setup["jobs"], timeout=600, pg_timeout=120)
    for r, res in enumerate(results):
        if isinstance(res, _dist.Raised):
            pytest.fail(f"rank {r} failed outside the jobs: {res.message}\n{res.tb}")
        assert res["touched"] == [], f"rank {r} touched the checkpoint: {res['touched'][:5]}"
    return {name: [res["jobs"].get(name) for res in results] for name in setup["jobs"]}


@functools.cache
def _expect(family: str, path: str, dtype: torch.dtype | None, train: bool, world: int) -> dict:
    """The installed transformers' own ``from_pretrained`` in one process, one thread (the ranks' kernels).
    Training: every rank's batch, each one's logits and loss, and the gradient of their mean (each
    batch's backward summed, then divided by the world size, as FSDP2's reduce-scatter averages)."""
    mm._quiet()
    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = _model_cls(family).from_pretrained(path, **kwargs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out: dict = {"tensors": reference(model), "config_dtype": str(model.config.dtype)}
        if train:
            model.train()
            out["logits"], out["loss"] = [], []
            for r in range(world):
                logits, loss = _step(model, family, rank_ids(r))
                loss.backward()
                out["logits"].append(logits.detach())
                out["loss"].append(loss.detach())
            out["grads"] = {n: p.grad / world for n, p in model.named_parameters() if p.grad is not None}
        else:
            with torch.no_grad():
                out["logits"] = _step(model.eval(), family)[0]
    finally:
        torch.set_num_threads(threads)
    return out


def _check(name: str, setup: dict, ran: dict) -> dict:
    job = setup["jobs"][name]
    world = len(ran[name])
    want = _expect(job.family, job.reference or job.path, job.dtype, job.train, world)
    for r, got in enumerate(ran[name]):
        assert got is not None, f"rank {r}: not run (an earlier job failed)"
        _dist.ok([got])
        assert_same(got["tensors"], want["tensors"])
        logits = want["logits"][r] if job.train else want["logits"]
        assert torch.equal(got["logits"], logits), f"rank {r}: logits differ"
        if job.train:  # each rank its own batch: its logits and loss exactly, the averaged gradients
            assert torch.equal(got["loss"], want["loss"][r]), (got["loss"], want["loss"][r])
            # An expert no rank's batch reached: FSDP2 reduce-scatters zeros for it (the group holds
            # routed experts), where the reference leaves its gradient None.
            unreached = set(got["grads"]) - set(want["grads"])
            assert set(want["grads"]) <= set(got["grads"]), sorted(set(want["grads"]) - set(got["grads"]))
            assert all(".experts." in k and not got["grads"][k].any() for k in unreached), sorted(unreached)
            for k, g in got["grads"].items():  # FSDP averages the ranks' gradients in their dtype
                if k in unreached:
                    continue
                # Sums of gradients of either sign, rounded in their dtype in another order: an error of
                # a few units of the dtype's rounding at the tensor's largest magnitude.
                scale = 4 * torch.finfo(g.dtype).eps * want["grads"][k].abs().max().item()
                torch.testing.assert_close(
                    g, want["grads"][k], rtol=2e-2, atol=max(scale, 1e-6), msg=lambda m, k=k: f"{k}: {m}"
                )
    return want


# --- the tests ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama-tied-bf16", "llama-untied-none"])
def test_llama_tied_and_untied(setup, ran, name):
    _check(name, setup, ran)
    if name == "llama-tied-bf16":  # from_pretrained keeps the rotary inv_freq float32 in a bf16 model
        assert ran[name][0]["tensors"]["model.rotary_emb.inv_freq"].dtype == torch.float32


def test_mixtral_per_expert(setup, ran):
    _check("mixtral-bf16-save", setup, ran)


def test_fp8_per_expert_into_bf16_mixtral(setup, ran):
    _check("mixtral-fp8-bf16", setup, ran)


def test_deepseek_v3_fp32_router_forward_and_backward(setup, ran):
    want = _check("deepseek-bf16-train", setup, ran)
    import transformers

    fp32 = {k for k, v in want["tensors"].items() if v.dtype == torch.float32 and "rotary" not in k}
    if int(transformers.__version__.split(".")[0]) >= 5:  # 4.57 keeps nothing of DeepSeek-V3 in fp32
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in fp32, fp32


def test_remote_code_class_with_fp32_modules_in_and_on_a_bf16_body(setup, ran):
    want = _check("remote-model_fn-bf16-train", setup, ran)
    assert want["tensors"]["model.layers.0.router.weight"].dtype == torch.float32
    assert want["tensors"]["value_head.weight"].dtype == torch.float32
    assert want["tensors"]["model.layers.0.up.weight"].dtype == BF16


@pytest.mark.parametrize(
    "name", ["remote-pretrained-bf16", "remote-pretrained-none", "llama-pretrained-bf16"]
)
def test_load_pretrained_with_and_without_dtype(setup, ran, name):
    want = _check(name, setup, ran)
    for got in ran[name]:
        assert got["config_dtype"] == want["config_dtype"]


def test_save_sharded_read_back_by_from_pretrained(setup, ran, tmp_path):
    """The bf16 Mixtral saved by save_sharded loads with this transformers' from_pretrained as it was."""
    _check("mixtral-bf16-save", setup, ran)
    job = setup["jobs"]["mixtral-bf16-save"]
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(job.save_to, dtype=BF16)
    assert_same(reference(back), ran["mixtral-bf16-save"][0]["tensors"])


def mixtral_model():
    """For ``inspect --model``: the tiny Mixtral, as this transformers builds it (per-expert in 4.57)."""
    return _build("mixtral")


def test_inspect_model_on_this_transformers(setup):
    """``python -m rank0load inspect CKPT --model MOD:FN`` matches a Mixtral checkpoint to the model
    this transformers builds: per-expert modules on 4.57, fused experts (converted) on 5.x."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rank0load",
            "inspect",
            f"{setup['root']}/mixtral",
            "--model",
            "tests.integrations.test_hf_range:mixtral_model",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fits the model" in done.stdout, done.stdout
