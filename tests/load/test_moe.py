"""MoE checkpoints as save_pretrained and the Hub store them, loaded into transformers 5's fused experts.

``rank0load.load_sharded(lambda: AutoModelForCausalLM.from_config(cfg), ckpt, dtype=...)`` on 2 and 3
gloo ranks, for Mixtral, Qwen3-MoE, MiniMax-M2 and DeepSeek-V3 (5 experts: no even split):

- the per-expert layout (``experts.{e}.w1/w3/w2`` or ``gate_proj/up_proj/down_proj``), fp32 and bf16;
- transformers' own fused layout (``save_original_format=False``);
- the FP8 block-quantised Hub layout (MiniMax-M2, DeepSeek-V3), 128x128 and 16x16 blocks (partial
  blocks: 24 and 40 are no multiples of 16), dequantised into fp32 and bf16; and streamed
  (``local_reads=False``: each rank gets its rows and only the scale grid rows they need);
- errors, the same ModelMismatchError on every rank: a missing expert, half an expert, a missing or
  mis-shaped ``weight_scale_inv``.

Each load must give every parameter's full tensor and every buffer bit for bit as transformers'
``from_pretrained`` gives them, and the sharded model's logits equal (``torch.equal``) to
``from_pretrained``'s. Ranks other than 0 do not see the checkpoints (a tmpfs hides them, as in
test_core) when the tests run as root.

One spawn per world size runs every load in sequence (transformers' import dominates a spawn).
"""

from __future__ import annotations

import functools
import os
import re
import traceback
from dataclasses import dataclass

import pytest
import torch

from tests import _dist, hf
from tests import moe_models as mm
from tests.fakes import hide
from tests.models import assert_same, gather, reference

# two spawns (2 and 3 ranks) of 27 loads each: about a minute
pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_range,
    hf.needs_transformers_5("fused MoE experts (nor MiniMax-M2)"),
]

FP8_FAMILIES = ("minimax_m2", "deepseek_v3")
BLOCKS = {"b128": (128, 128), "b16": (16, 16)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FUSED = ("mixtral", "deepseek_v3")  # saved in transformers' own layout too


@dataclass(frozen=True)
class Job:
    """One load_sharded call, made on every rank."""

    family: str  # a key of moe_models.FAMILIES: which config model_fn builds
    path: str  # the checkpoint directory
    dtype: torch.dtype  # load_sharded's dtype= argument
    reference: str | None = None  # the directory from_pretrained reads for the expected state; None: path
    local_reads: bool = True  # False: rank 0 streams every rank its bytes (the ranks share one host here)
    own_together: bool = False  # rank 0 groups its own pieces into messages, as on an accelerator mesh


# --- the checkpoints, written once for the module ------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    """What the ModelMismatchError of a broken checkpoint must say (regular expressions)."""

    target: str  # the model parameter, or the checkpoint key, at fault
    detail: str  # what is missing or wrong: the expert, the scale's shape found
    expected: str | None = None  # the shape that was due, for a mis-shaped tensor
    absent: str = ""  # text the message must not contain: a layer that is fine


def _drop(path: str, pattern: str) -> list[str]:
    """Delete every key matching ``pattern`` from its shard and from the index; return them."""
    dropped: list[str] = []

    def edit(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if re.search(pattern, key):
            dropped.append(key)
            return {}
        return {key: t}

    mm.rewrite(path, edit)
    return sorted(dropped)


def _reshape(path: str, key: str, shape: tuple[int, int]) -> None:
    mm.rewrite(path, lambda k, t: {k: torch.ones(shape) if k == key else t})


def _broken(root) -> dict[str, tuple[Job, Mismatch]]:
    """Checkpoints that must fail: each a copy of a good one with one thing missing or mis-shaped."""
    out = {}

    # Mixtral without expert 3 of layer 1: w1, w3 and w2, each in its own shard.
    path = str(root / "mixtral-no-expert")
    mm.save("mixtral", path)
    assert len(_drop(path, r"^model\.layers\.1\.block_sparse_moe\.experts\.3\.")) == 3
    out["mixtral-no-expert"] = (
        Job("mixtral", path, torch.float32),
        Mismatch(
            r"model\.layers\.1\.mlp\.experts\.(gate_up_proj|down_proj)",
            r"experts\.3\b|expert 3\b",
            None,
            "layers.0.",
        ),
    )
    # Qwen3-MoE without half of expert 3 of layer 0: up_proj, the second half of gate_up_proj[3].
    path = str(root / "qwen3-no-up-proj")
    mm.save("qwen3_moe", path)
    assert _drop(path, r"^model\.layers\.0\.mlp\.experts\.3\.up_proj\.") == [
        "model.layers.0.mlp.experts.3.up_proj.weight"
    ]
    out["qwen3-no-up-proj"] = (
        Job("qwen3_moe", path, torch.float32),
        Mismatch(
            r"model\.layers\.0\.mlp\.experts\.gate_up_proj",
            r"(experts\.3\.|expert 3\b).*up_proj",
            None,
            "layers.1.",
        ),
    )
    # DeepSeek-V3 FP8 without one expert's weight_scale_inv.
    path = str(root / "deepseek-no-scale")
    mm.save_fp8("deepseek_v3", path, (16, 16))
    scale = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"
    assert _drop(path, "^" + re.escape(scale) + "$") == [scale]
    out["deepseek-no-scale"] = (
        Job("deepseek_v3", path, torch.bfloat16),
        Mismatch(r"experts\.2\.down_proj", "weight_scale_inv", None, "layers.0."),
    )
    # MiniMax-M2 FP8, an expert's scale [3, 2] where [ceil(24/16), ceil(32/16)] = [2, 2] is due.
    path = str(root / "minimax-bad-scale")
    mm.save_fp8("minimax_m2", path, (16, 16))
    scale = "model.layers.0.block_sparse_moe.experts.4.w1.weight_scale_inv"
    _reshape(path, scale, (3, 2))
    out["minimax-bad-scale"] = (
        Job("minimax_m2", path, torch.bfloat16),
        Mismatch(re.escape(scale), r"[(\[]3, 2[)\]]", r"[(\[]2, 2[)\]]", "layers.1."),
    )
    # DeepSeek-V3 FP8, a dense attention weight of 24 rows with floor(24/16) = 1 scale row, not ceil = 2.
    path = str(root / "deepseek-floor-scale")
    mm.save_fp8("deepseek_v3", path, (16, 16))
    scale = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
    _reshape(path, scale, (1, 2))
    out["deepseek-floor-scale"] = (
        Job("deepseek_v3", path, torch.float32),
        Mismatch(re.escape(scale), r"[(\[]1, 2[)\]]", r"[(\[]2, 2[)\]]", "layers.1."),
    )
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every checkpoint under one root (hidden from ranks other than 0), the references beside it.
    ``jobs``: name -> Job; ``errors``: name -> Mismatch, for the jobs that must fail."""
    root = tmp_path_factory.mktemp("moe")
    refs = tmp_path_factory.mktemp("moe-ref")
    jobs: dict[str, Job] = {}
    for family in mm.FAMILIES:
        path = str(root / f"{family}-per-expert")
        mm.save(family, path)
        for d, dtype in DTYPES.items():
            jobs[f"{family}-per-expert-{d}"] = Job(family, path, dtype)
    for family in FUSED:
        path = str(root / f"{family}-fused")
        mm.save(family, path, fused=True)
        jobs[f"{family}-fused-fp32"] = Job(family, path, torch.float32)
    for family in FP8_FAMILIES:
        for b, block in BLOCKS.items():
            path, ref = str(root / f"{family}-fp8-{b}"), str(refs / f"{family}-fp8-{b}")
            mm.save_fp8(family, path, block)
            mm.save_dequantized(path, ref)
            for d, dtype in DTYPES.items():
                jobs[f"{family}-fp8-{b}-{d}"] = Job(family, path, dtype, ref)
            jobs[f"{family}-fp8-{b}-fp32-stream"] = Job(family, path, torch.float32, ref, local_reads=False)
            jobs[f"{family}-fp8-{b}-bf16-own"] = Job(
                family, path, torch.bfloat16, ref, False, own_together=True
            )
    broken = _broken(root)
    jobs.update({name: job for name, (job, _) in broken.items()})
    return {"root": str(root), "jobs": jobs, "errors": {name: m for name, (_, m) in broken.items()}}


# --- every rank: load, gather, forward -------------------------------------------------------------------


def _raised(exc: BaseException) -> _dist.Raised:
    return _dist.Raised(
        type(exc).__name__, tuple(c.__name__ for c in type(exc).__mro__), str(exc), traceback.format_exc()
    )


def _load_one(job: Job) -> dict:
    from transformers import AutoModelForCausalLM

    import rank0load
    from rank0load.load import _transfer

    cfg = mm.config(job.family)
    own_together = _transfer.own_together
    if job.own_together:
        _transfer.own_together = lambda device: True
    try:
        model = rank0load.load_sharded(
            lambda: AutoModelForCausalLM.from_config(cfg),
            job.path,
            dtype=job.dtype,
            local_reads=job.local_reads,
        )
    finally:
        _transfer.own_together = own_together
    return _summarise(model.eval())


def _summarise(model: torch.nn.Module) -> dict:
    """What the test compares: every full tensor (collective), the logits of the sharded model."""
    tensors = gather(model)
    with torch.no_grad():
        logits = model(**mm.sample_inputs()).logits
    return {"tensors": tensors, "logits": logits}


def _in_step(result: object) -> bool:
    """(all ranks) Whether every rank ended the last job alike: all returned, or all raised the same
    LoadError. If not (a rank raised something else, or the group broke), the later jobs would only
    time out one after the other: the caller stops there."""
    import torch.distributed as dist

    if isinstance(result, _dist.Raised):
        mine = result.message if "LoadError" in result.bases else None
    else:
        mine = "returned"
    outcomes: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(outcomes, mine)
    except Exception:
        return False
    return None not in outcomes and len(set(outcomes)) == 1


def _load_all(rank: int, world: int, root: str, jobs: dict[str, Job]) -> dict:
    """Every job in order, each one's result or error; the checkpoints hidden from ranks other than 0."""
    touched: list[str] = []
    hidden = rank != 0 and os.geteuid() == 0
    if hidden:
        touched = hide(root)
    mm._quiet()
    out: dict = {}
    broken = None
    for name, job in jobs.items():
        if broken is not None:
            out[name] = _dist.Raised(
                "NotRun", ("NotRun",), f"not run: the ranks fell out of step in {broken}", ""
            )
            continue
        try:
            out[name] = _load_one(job)
        except Exception as exc:  # a LoadError is raised on every rank alike: go on with the next job
            out[name] = _raised(exc)
        if not _in_step(out[name]):
            broken = name
    return {"jobs": out, "touched": list(touched), "hidden": hidden}


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def loaded(request: pytest.FixtureRequest, ckpts: dict) -> dict[str, list]:
    """job name -> one result (or Raised) per rank."""
    results = _dist.run(_load_all, request.param, ckpts["root"], ckpts["jobs"], timeout=600, pg_timeout=120)
    for r, res in enumerate(results):
        if isinstance(res, _dist.Raised):
            pytest.fail(f"rank {r} failed outside the loads: {res.message}\n{res.tb}")
        assert res["touched"] == [], f"rank {r} touched the checkpoint: {res['touched'][:5]}"
    return {name: [res["jobs"][name] for res in results] for name in ckpts["jobs"]}


# --- the test process: what from_pretrained gives ---------------------------------------------------------


@functools.cache
def _expect(path: str, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """transformers' ``from_pretrained(path, dtype=dtype)``: every parameter and buffer, and its logits.

    ``load_sharded(dtype=)`` means what ``from_pretrained(dtype=)`` means, buffers included: rotary
    ``inv_freq`` stays float32, ``_keep_in_fp32_modules(_strict)`` stay float32 (DeepSeek-V3's
    ``e_score_correction_bias``, and in transformers 5.24 its router ``gate.weight``).
    """
    from transformers import AutoModelForCausalLM

    mm._quiet()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks: the same kernels, the same bits
    try:
        with torch.no_grad():
            logits = ref(**mm.sample_inputs()).logits
    finally:
        torch.set_num_threads(threads)
    return reference(ref), logits


def _check(job: Job, per_rank: list) -> None:
    want, logits = _expect(job.reference or job.path, job.dtype)
    for r, res in enumerate(_dist.ok(per_rank)):
        assert_same(res["tensors"], want)
        assert torch.equal(res["logits"], logits), (
            f"rank {r}: logits differ, max |diff| {(res['logits'].float() - logits.float()).abs().max()}"
        )


# --- the tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", mm.FAMILIES)
def test_per_expert_checkpoint(loaded, ckpts, family, dtype):
    """save_pretrained's default (per-expert) layout fills the fused experts; fp32 and dtype=bf16."""
    name = f"{family}-per-expert-{dtype}"
    _check(ckpts["jobs"][name], loaded[name])


@pytest.mark.parametrize("family", FUSED)
def test_fused_checkpoint(loaded, ckpts, family):
    """transformers' own layout (save_original_format=False) loads as it is: no conversion."""
    name = f"{family}-fused-fp32"
    _check(ckpts["jobs"][name], loaded[name])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_fp8_checkpoint(loaded, ckpts, family, block, dtype):
    """The FP8 Hub layout, dequantised per block (weight.float() * weight_scale_inv, then cast) into
    the model's dtype. The reference is from_pretrained of the same checkpoint dequantised by
    moe_models.dequantize (test_dequantize_matches_transformers pins that formula)."""
    name = f"{family}-fp8-{block}-{dtype}"
    _check(ckpts["jobs"][name], loaded[name])


@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_fp8_checkpoint_streamed(loaded, ckpts, family, block):
    """The same, streamed (``local_reads=False``): rank 0 sends each rank its rows of each fused
    expert tensor and only the scale grid rows they need, point to point, coalesced with the rows."""
    name = f"{family}-fp8-{block}-fp32-stream"
    _check(ckpts["jobs"][name], loaded[name])


@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_fp8_streamed_with_rank0s_own_pieces_grouped(loaded, ckpts, family, block):
    """Streamed into bf16 with rank 0's own consecutive pieces grouped into messages, as on an
    accelerator mesh (``_transfer.own_together``): its own rows and the scale grid rows they need
    share messages, dequantised and cast from its staging."""
    name = f"{family}-fp8-{block}-bf16-own"
    _check(ckpts["jobs"][name], loaded[name])


def test_keep_in_fp32(loaded, ckpts):
    """DeepSeek-V3's _keep_in_fp32_modules_strict: e_score_correction_bias stays fp32 under dtype=bf16,
    from a bf16 (per-expert) and an FP8 checkpoint alike; everything else floating is bf16."""
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    for name in ("deepseek_v3-per-expert-bf16", "deepseek_v3-fp8-b16-bf16"):
        job = ckpts["jobs"][name]
        want = _expect(job.reference or job.path, job.dtype)[0]
        # what this transformers keeps: the bias (5.23 and 4.57), and the router's gate.weight too (5.24)
        kept = {k for k, t in want.items() if t.dtype == torch.float32 and "inv_freq" not in k}
        assert key in kept, kept
        for res in _dist.ok(loaded[name]):
            fp32 = {k for k, t in res["tensors"].items() if t.dtype == torch.float32 and "inv_freq" not in k}
            assert fp32 == kept, (name, fp32 ^ kept)
            others = {t.dtype for k, t in res["tensors"].items() if k not in kept and "inv_freq" not in k}
            assert others == {torch.bfloat16}, (name, others)


@pytest.mark.parametrize(
    "name",
    [
        "mixtral-no-expert",
        "qwen3-no-up-proj",
        "deepseek-no-scale",
        "minimax-bad-scale",
        "deepseek-floor-scale",
    ],
)
def test_mismatch_is_one_error_on_every_rank(loaded, ckpts, name):
    """A ModelMismatchError, the same on every rank, naming the target and what is missing or wrong
    (and the shape due, for a mis-shaped scale), and no layer that is fine."""
    err = _dist.same_error(loaded[name], "ModelMismatchError")
    want: Mismatch = ckpts["errors"][name]
    assert re.search(want.target, err.message), err.message
    assert re.search(want.detail, err.message), err.message
    if want.expected is not None:
        assert re.search(want.expected, err.message), err.message
    assert want.absent not in err.message, err.message


# --- the fixtures themselves (no spawn) -----------------------------------------------------------------


def test_fixtures(ckpts):
    """The checkpoints hold what the tests claim: per-expert keys, fused keys, FP8 with scales."""
    jobs = ckpts["jobs"]
    per_expert = {
        "mixtral": r"\.block_sparse_moe\.experts\.4\.w[123]\.weight$",
        "minimax_m2": r"\.block_sparse_moe\.experts\.4\.w[123]\.weight$",
        "qwen3_moe": r"\.mlp\.experts\.4\.(gate|up|down)_proj\.weight$",
        "deepseek_v3": r"\.mlp\.experts\.4\.(gate|up|down)_proj\.weight$",
    }
    for family, pattern in per_expert.items():
        path = jobs[f"{family}-per-expert-fp32"].path
        keys = mm.headers(path)
        moe_layers = 1 if family == "deepseek_v3" else 2
        assert len([k for k in keys if re.search(pattern, k)]) == 3 * moe_layers, family
        assert not [k for k in keys if "gate_up_proj" in k or k.endswith("experts.down_proj")], family
        assert len(set(mm.weight_map(path).values())) > 2, "several shards"
    for family in FUSED:
        keys = mm.headers(jobs[f"{family}-fused-fp32"].path)
        assert keys["model.layers.1.mlp.experts.gate_up_proj"] == ("F32", (mm.EXPERTS, 48, 32))
        assert keys["model.layers.1.mlp.experts.down_proj"] == ("F32", (mm.EXPERTS, 32, 24))
        assert not [k for k in keys if re.search(r"experts\.\d", k)], family
    for family in FP8_FAMILIES:
        for b, block in BLOCKS.items():
            path = jobs[f"{family}-fp8-{b}-fp32"].path
            keys = mm.headers(path)
            fp8 = [k for k, (dt, _) in keys.items() if dt == "F8_E4M3"]
            assert fp8 and all(mm.is_fp8_key(family, k) for k in fp8)
            for k in fp8:
                rows, cols = keys[k][1]
                scale = keys[k.removesuffix("weight") + "weight_scale_inv"]
                assert scale == ("F32", (-(-rows // block[0]), -(-cols // block[1]))), k
            fp32 = [k for k, (dt, _) in keys.items() if dt == "F32" and not k.endswith("_scale_inv")]
            assert fp32 and all(mm.FP32_KEYS.search(k) for k in fp32), fp32


def test_dequantize_matches_transformers():
    """moe_models.dequantize is transformers' own block formula (integrations/finegrained_fp8.py,
    _dequantize_fp8_weight), partial blocks included. Some transformers 5 releases (5.17) have no
    such function, and their Fp8Dequantize cannot do partial blocks: nothing to compare with there."""
    import transformers
    from transformers.integrations import finegrained_fp8

    _dequantize_fp8_weight = getattr(finegrained_fp8, "_dequantize_fp8_weight", None)
    if _dequantize_fp8_weight is None:
        pytest.skip(f"transformers {transformers.__version__} has no _dequantize_fp8_weight to compare with")

    torch.manual_seed(0)
    for shape, block in [
        ((24, 32), (16, 16)),
        ((40, 24), (16, 16)),
        ((32, 24), (128, 128)),
        ((48, 48), (16, 16)),
    ]:
        q, s = mm.quantize(torch.randn(shape), block)
        want = _dequantize_fp8_weight(q, s, list(block), torch.float32)
        assert torch.equal(mm.dequantize(q, s, block), want), (shape, block)


def test_fp8_reference_matches_transformers_fp8_loader(ckpts):
    """Where transformers' FP8 loader is right, it agrees with the reference: from_pretrained with
    FineGrainedFP8Config(dequantize=True) (needs accelerate; works on CPU) on the 128x128 checkpoints.
    Not the reference itself: its Fp8Dequantize derives the block from the scale grid (rows // scale
    rows), which is wrong for partial blocks (24 rows, 2 scales: it uses 12-row blocks) and raises when
    the rows do not divide (40 rows, 3 scales); and it leaves unquantised tensors in the checkpoint's
    dtype whatever dtype= says. Values are compared after casting to the reference's dtype."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    for family in FP8_FAMILIES:
        job = ckpts["jobs"][f"{family}-fp8-b128-bf16"]
        got = AutoModelForCausalLM.from_pretrained(
            job.path, dtype=torch.bfloat16, quantization_config=FineGrainedFP8Config(dequantize=True)
        ).state_dict()
        want, _ = _expect(job.reference, torch.bfloat16)
        for k, v in got.items():
            assert torch.equal(v.to(want[k].dtype), want[k]), (family, k)
