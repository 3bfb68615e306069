"""diffusers as first-class: tiny Wan, Flux and SD3 transformers (diffusers' own classes) saved with
diffusers' ``save_pretrained`` in several shards, loaded on 2 and 3 gloo ranks with the checkpoints
hidden from ranks other than 0 (when the tests run as root), each compared bit for bit (every
parameter's full tensor and every buffer) and by a forward (``torch.equal``) with diffusers' own
``from_pretrained(torch_dtype=...)`` in one process, one thread:

- Wan in bf16 (its ``_keep_in_fp32_modules``: ``scale_shift_table``, ``time_embedder``, ``norm2`` in
  float32, the rotary ``freqs_cos``/``freqs_sin`` float32 as built; fp32 islands at three depths:
  the root's own fp32 parameter, a bf16 ``condition_embedder`` holding the fp32 ``time_embedder``, fp32
  blocks holding bf16 attention) and with ``dtype=None``; Flux and SD3 in bf16 (SD3's persistent
  ``pos_embed`` buffer);
- ``load_pretrained(WanTransformer3DModel, pipeline_root, subfolder="transformer")`` in bf16 and with
  ``dtype=None`` from the component folder, and a transformers text encoder with ``subfolder=``;
- ``save_sharded`` of a diffusers model: diffusers' file names (several shards and the index, or one
  file), its ``config.json`` as diffusers' ``save_config`` writes it, read back by ``from_pretrained``
  equal to the saved model; a second save into the same folder removes the first one's files and
  leaves another stem's (``model.safetensors``) alone;
- a pipeline root passed as the checkpoint: the same CheckpointNotFoundError on every rank, naming
  the component folders with weights and ``subfolder=``.

One spawn per world size runs every job (importing diffusers and transformers dominates a spawn).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from tests import _dist
from tests.models import assert_same, gather, reference

pytestmark = [pytest.mark.slow, pytest.mark.torch_range, pytest.mark.diffusers]

BF16 = torch.bfloat16

# Tiny configs: every first dimension uneven over 2 or 3 ranks somewhere; several files at 20KB.
CONFIGS: dict[str, tuple[str, dict]] = {
    "wan": (
        "WanTransformer3DModel",
        dict(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=4,
            out_channels=4,
            text_dim=16,
            freq_dim=16,
            ffn_dim=36,
            num_layers=2,
            rope_max_seq_len=32,
        ),
    ),
    "flux": (
        "FluxTransformer2DModel",
        dict(
            patch_size=1,
            in_channels=8,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            pooled_projection_dim=16,
            axes_dims_rope=(2, 2, 4),
        ),
    ),
    "sd3": (
        "SD3Transformer2DModel",
        dict(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            caption_projection_dim=16,
            pooled_projection_dim=16,
            out_channels=4,
            pos_embed_max_size=8,
        ),
    ),
}
SHARD = "20KB"


def _cls(family: str):
    if family == "t5":
        from transformers import T5EncoderModel

        return T5EncoderModel
    import diffusers

    return getattr(diffusers, CONFIGS[family][0])


def _t5_config():
    from transformers import T5Config

    return T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=36, num_layers=2, num_heads=2)


def _build(family: str):
    """model_fn: the model from its config, as a user's own code builds it."""
    return _cls(family)(**CONFIGS[family][1])


def _forward(model, family: str, dtype: torch.dtype | None) -> torch.Tensor:
    """One denoising-style forward on fixed inputs in the model's dtype (the same on every rank)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype or torch.float32)

    if family == "t5":
        return model(input_ids=torch.tensor([[1, 5, 9, 2, 7, 3, 39, 33]])).last_hidden_state
    if family == "wan":
        x = dict(
            hidden_states=r(1, 4, 1, 4, 4), timestep=torch.tensor([3]), encoder_hidden_states=r(1, 3, 16)
        )
    elif family == "flux":
        ids = torch.tensor([[0.0, i // 2, i % 2] for i in range(4)])
        x = dict(
            hidden_states=r(1, 4, 8),
            encoder_hidden_states=r(1, 3, 16),
            pooled_projections=r(1, 16),
            timestep=torch.tensor([0.5]),
            img_ids=ids,
            txt_ids=torch.zeros(3, 3),
        )
    else:
        x = dict(
            hidden_states=r(1, 4, 8, 8),
            encoder_hidden_states=r(1, 3, 16),
            pooled_projections=r(1, 16),
            timestep=torch.tensor([3]),
        )
    return model(**x).sample


@dataclass(frozen=True)
class Job:
    how: str  # "model_fn": load_sharded(model_fn); "pretrained": load_pretrained(model_cls)
    family: str  # a CONFIGS key, or "t5" (a transformers text encoder)
    path: str
    dtype: torch.dtype | None
    subfolder: str | None = None
    saves: tuple[tuple[str, str], ...] = ()  # (out_dir, max_shard_size): save_sharded after loading, in order
    error: bool = False  # expected to raise, the same on every rank


# --- every rank -----------------------------------------------------------------------------------------


def _run_job(job: Job) -> dict:
    import rank0load

    if job.how == "pretrained":
        kwargs = {"subfolder": job.subfolder} if job.subfolder else {}
        model = rank0load.load_pretrained(_cls(job.family), job.path, dtype=job.dtype, **kwargs)
    else:
        model = rank0load.load_sharded(functools.partial(_build, job.family), job.path, dtype=job.dtype)
    out: dict = {"tensors": gather(model)}
    with torch.no_grad():
        out["sample"] = _forward(model.eval(), job.family, job.dtype)
    out["saved"] = []
    for where, size in job.saves:
        report = rank0load.save_sharded(model, where, max_shard_size=size)
        listed = sorted(os.listdir(where)) if report.rank == 0 else None
        out["saved"].append({"files": report.files, "listed": listed})
    return out


def _run_all(rank: int, world: int, root: str, jobs: dict[str, Job]) -> dict:
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    return _dist.run_jobs(rank, root, jobs, _run_job, expects_error=lambda job: job.error)


# --- the checkpoints and the references -----------------------------------------------------------------


def _save_pipeline(pipe: str) -> None:
    """A diffusers pipeline folder as ``DiffusionPipeline.save_pretrained`` lays it out: model_index.json,
    one folder per component (weights in transformer/, vae/, text_encoder/; none in scheduler/)."""
    import diffusers
    from transformers import T5EncoderModel

    torch.manual_seed(1)
    _build("wan").save_pretrained(f"{pipe}/transformer", max_shard_size=SHARD)
    diffusers.AutoencoderKL(
        block_out_channels=(8,), norm_num_groups=8, latent_channels=4, layers_per_block=1
    ).save_pretrained(f"{pipe}/vae")
    T5EncoderModel(_t5_config()).save_pretrained(f"{pipe}/text_encoder", max_shard_size=SHARD)
    diffusers.FlowMatchEulerDiscreteScheduler().save_pretrained(f"{pipe}/scheduler")
    index = {
        "_class_name": "WanPipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "T5EncoderModel"],
        "tokenizer": [None, None],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    with open(f"{pipe}/model_index.json", "w") as f:
        json.dump(index, f, indent=2)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    path = tmp_path_factory.mktemp("diffusers")
    for seed, family in enumerate(CONFIGS):
        torch.manual_seed(seed)
        _build(family).save_pretrained(path / family, max_shard_size=SHARD)
        assert len([n for n in os.listdir(path / family) if n.endswith(".safetensors")]) > 1
    _save_pipeline(str(path / "pipe"))
    return str(path)


def _jobs(root: str, saves: str) -> dict[str, Job]:
    pipe = f"{root}/pipe"
    return {
        "wan-bf16": Job("model_fn", "wan", f"{root}/wan", BF16),
        "wan-none": Job("model_fn", "wan", f"{root}/wan", None),
        "flux-bf16": Job("model_fn", "flux", f"{root}/flux", BF16),
        "sd3-bf16-save": Job("model_fn", "sd3", f"{root}/sd3", BF16, saves=((f"{saves}/sd3", "5GB"),)),
        "wan-pretrained-bf16-save": Job(
            "pretrained",
            "wan",
            pipe,
            BF16,
            subfolder="transformer",
            saves=((f"{saves}/wan", SHARD), (f"{saves}/wan-again", SHARD), (f"{saves}/wan-again", "5GB")),
        ),
        "wan-pretrained-none": Job("pretrained", "wan", f"{pipe}/transformer", None),
        "t5-pretrained-subfolder": Job("pretrained", "t5", pipe, None, subfolder="text_encoder"),
        "pipeline-root-pretrained": Job("pretrained", "wan", pipe, BF16, error=True),
        "pipeline-root-model_fn": Job("model_fn", "wan", pipe, BF16, error=True),
    }


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ran(request: pytest.FixtureRequest, root: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    saves = tmp_path_factory.mktemp(f"diffusers-saves-{request.param}")  # rank 0 writes here
    os.makedirs(saves / "wan-again")
    (saves / "wan-again" / "model.safetensors").write_bytes(b"another stem: never touched")
    jobs = _jobs(root, str(saves))
    results = _dist.run(_run_all, request.param, root, jobs, timeout=600, pg_timeout=120)
    for r, res in enumerate(results):
        if isinstance(res, _dist.Raised):
            pytest.fail(f"rank {r} failed outside the jobs: {res.message}\n{res.tb}")
        assert res["touched"] == [], f"rank {r} touched the checkpoint: {res['touched'][:5]}"
    return {"jobs": jobs, "results": {name: [res["jobs"].get(name) for res in results] for name in jobs}}


@functools.cache
def _expect(family: str, path: str, subfolder: str | None, dtype: torch.dtype | None) -> dict:
    """The library's own ``from_pretrained`` in one process, one thread (the ranks' kernels)."""
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    kwargs: dict = {"subfolder": subfolder} if subfolder else {}
    if dtype is not None:
        kwargs["dtype" if family == "t5" else "torch_dtype"] = dtype
    model = _cls(family).from_pretrained(path, **kwargs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return {
                "model": model,
                "tensors": reference(model),
                "sample": _forward(model.eval(), family, dtype),
            }
    finally:
        torch.set_num_threads(threads)


def _check(name: str, ran: dict) -> dict:
    job = ran["jobs"][name]
    want = _expect(job.family, job.path, job.subfolder, job.dtype)
    for r, got in enumerate(ran["results"][name]):
        assert got is not None, f"rank {r}: not run (an earlier job failed)"
        _dist.ok([got])
        assert_same(got["tensors"], want["tensors"])
        assert torch.equal(got["sample"], want["sample"]), f"rank {r}: forward outputs differ"
    return want


# --- the tests ----------------------------------------------------------------------------------------------


def test_wan_bf16_keeps_diffusers_fp32_modules(ran):
    want = _check("wan-bf16", ran)["tensors"]
    fp32 = sorted(k for k, v in want.items() if v.dtype == torch.float32)
    for key in (
        "scale_shift_table",
        "blocks.1.scale_shift_table",
        "blocks.0.norm2.weight",
        "condition_embedder.time_embedder.linear_1.weight",
        "rope.freqs_cos",  # non-persistent, float32 as built
    ):
        assert key in fp32, fp32
    assert want["blocks.0.attn1.to_q.weight"].dtype == BF16
    assert want["condition_embedder.text_embedder.linear_1.weight"].dtype == BF16


def test_wan_without_dtype(ran):
    want = _check("wan-none", ran)["tensors"]
    assert {v.dtype for v in want.values() if v.is_floating_point()} == {torch.float32}


@pytest.mark.parametrize("name", ["flux-bf16", "sd3-bf16-save"])
def test_flux_and_sd3_bf16(ran, name):
    want = _check(name, ran)["tensors"]
    if name.startswith("sd3"):  # a persistent buffer, built float32, loaded bf16 as from_pretrained loads it
        assert want["pos_embed.pos_embed"].dtype == BF16


def test_load_pretrained_pipeline_subfolder(ran):
    _check("wan-pretrained-bf16-save", ran)


def test_load_pretrained_without_dtype_from_the_component_folder(ran):
    want = _check("wan-pretrained-none", ran)["tensors"]
    assert want["scale_shift_table"].dtype == torch.float32


def test_load_pretrained_transformers_text_encoder_subfolder(ran):
    _check("t5-pretrained-subfolder", ran)


def _config_json(model, folder) -> dict:
    """What diffusers' own ``save_config`` writes for ``model``."""
    model.save_config(str(folder))
    with open(folder / "config.json") as f:
        return json.load(f)


def test_save_sharded_writes_what_diffusers_reads(ran, tmp_path):
    want = _check("wan-pretrained-bf16-save", ran)
    job = ran["jobs"]["wan-pretrained-bf16-save"]
    (out, _), (again, _), _ = job.saves
    saved = ran["results"]["wan-pretrained-bf16-save"][0]["saved"]
    files = saved[0]["files"]
    n = len(files)
    assert n > 1 and files == tuple(
        f"diffusion_pytorch_model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    )
    assert saved[0]["listed"] == sorted(
        [*files, "config.json", "diffusion_pytorch_model.safetensors.index.json"]
    )
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f) == _config_json(want["model"], tmp_path)  # _class_name: not FSDP...
    cls = _cls("wan")
    for where in (out, again):
        back = cls.from_pretrained(where, torch_dtype=BF16)
        assert_same(reference(back), ran["results"]["wan-pretrained-bf16-save"][0]["tensors"])
    # The second save into wan-again (one file) removed the first one's shards and index, and left
    # another stem's file alone.
    assert saved[1]["listed"] == sorted(
        [
            *saved[1]["files"],
            "config.json",
            "diffusion_pytorch_model.safetensors.index.json",
            "model.safetensors",
        ]
    )
    assert saved[2]["files"] == ("diffusion_pytorch_model.safetensors",)
    assert saved[2]["listed"] == ["config.json", "diffusion_pytorch_model.safetensors", "model.safetensors"]
    with open(os.path.join(again, "model.safetensors"), "rb") as f:
        assert f.read() == b"another stem: never touched"


def test_save_sharded_single_file(ran, tmp_path):
    want = _check("sd3-bf16-save", ran)
    job = ran["jobs"]["sd3-bf16-save"]
    ((out, _),) = job.saves
    saved = ran["results"]["sd3-bf16-save"][0]["saved"][0]
    assert saved["listed"] == ["config.json", "diffusion_pytorch_model.safetensors"]
    expected = _config_json(want["model"], tmp_path)
    with open(os.path.join(out, "config.json")) as f:
        got = json.load(f)
    assert got.pop("_name_or_path", None) is None  # built by model_fn: no checkpoint path recorded
    expected.pop("_name_or_path")
    assert got == expected
    back = _cls("sd3").from_pretrained(out, torch_dtype=BF16)
    assert_same(reference(back), ran["results"]["sd3-bf16-save"][0]["tensors"])


@pytest.mark.parametrize("name", ["pipeline-root-pretrained", "pipeline-root-model_fn"])
def test_a_pipeline_root_names_its_component_folders(ran, name):
    job = ran["jobs"][name]
    err = _dist.same_error(ran["results"][name], "CheckpointNotFoundError")
    assert "FileNotFoundError" in err.bases
    assert f"{job.path!r} is a diffusers pipeline (model_index.json)" in err.message, err.message
    assert "component folders text_encoder/, transformer/, vae/." in err.message, err.message
    assert "Pass subfolder='transformer' (or another component) to load_pretrained" in err.message, (
        err.message
    )
    assert f"or the component folder ({os.path.join(job.path, 'transformer')!r})" in err.message, err.message


# --- subfolder=, on rank 0's side (no ranks needed) -----------------------------------------------------


def test_subfolder_errors_name_the_folders(root):
    from rank0load.checkpoint._source import resolve
    from rank0load.errors import CheckpointNotFoundError

    pipe = f"{root}/pipe"
    with pytest.raises(CheckpointNotFoundError) as caught:
        resolve(pipe, subfolder="unet")
    assert str(caught.value) == (
        f"checkpoint {pipe!r} has no folder 'unet' (subfolder=); its folders holding weights: "
        "text_encoder/, transformer/, vae/. Check the folder's name."
    )
    for bad in ("../wan", "/transformer", "", "a/../../b"):
        with pytest.raises(CheckpointNotFoundError, match="expected the name of a folder inside it"):
            resolve(pipe, subfolder=bad)
    index = f"{root}/wan/diffusion_pytorch_model.safetensors.index.json"
    with pytest.raises(CheckpointNotFoundError, match="is a file"):
        resolve(index, subfolder="transformer")
    source = resolve(pipe, subfolder="transformer")
    assert source.root == os.path.realpath(f"{pipe}/transformer") and len(source.files) > 1


def test_subfolder_of_a_hub_repo_fetches_that_folder_only(root, monkeypatch):
    """A Hub repo id with subfolder=: only that folder's weights, index and configs are fetched."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from rank0load.checkpoint import _source

    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, **kwargs):
        calls.append(allow_patterns)
        return f"{root}/pipe"  # the snapshot: a whole pipeline

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    source = _source.resolve("org/pipeline", subfolder="transformer")
    assert source.root == os.path.realpath(f"{root}/pipe/transformer") and len(source.files) > 1
    [patterns] = calls
    repo_files = [
        "model_index.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/model.safetensors",
    ]
    assert sorted(filter_repo_objects(repo_files, allow_patterns=patterns)) == repo_files[1:4]


def test_config_overrides_and_dtype_are_checked_before_anything_is_built():
    """config_overrides name arguments of the class's __init__ (from_config's keyword arguments);
    dtype is None or a floating dtype (diffusers' from_pretrained has no "auto")."""
    from rank0load._pretrained import _diffusers_configure
    from rank0load.errors import LoadError

    def checkpoint(config, overrides):
        return SimpleNamespace(config=config, overrides=overrides, where="/ckpt/config.json")

    cls = _cls("wan")
    config = dict(CONFIGS["wan"][1], _class_name="WanTransformer3DModel")
    with pytest.raises(LoadError) as caught:
        _diffusers_configure(cls, checkpoint(config, {"num_layer": 1}), None)
    assert str(caught.value) == (
        "config_overrides ['num_layer'] name no argument of WanTransformer3DModel.__init__ (from "
        "/ckpt/config.json); check their spelling."
    )
    for bad in ("auto", torch.int8, "int8", "bfloat"):
        with pytest.raises(LoadError, match="diffusers' from_pretrained has no 'auto'"):
            _diffusers_configure(cls, checkpoint(config, {}), bad)
    with pytest.raises(LoadError, match="quant_method 'bitsandbytes'"):
        quantized = dict(config, quantization_config={"quant_method": "bitsandbytes"})
        _diffusers_configure(cls, checkpoint(quantized, {}), None)
