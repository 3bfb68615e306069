"""load_pretrained on gloo ranks, checkpoints visible to rank 0 only, against transformers' own
from_pretrained: every parameter's full tensor and every buffer bit for bit, the config, the
generation config, dtype=None / "auto" / explicit (float32 modules kept as from_pretrained keeps
them), a new sequence-classification head, an FP8 block checkpoint dequantised, a Hub repo id from
an offline cache, and the errors (remote code, no config.json, bad JSON, a misspelt override, an Auto
class without a model for the config, another quantisation, a revision with a local path), each the
same on every rank.

Rank 1 runs in its own mount namespace with an empty tmpfs over the directory holding every
checkpoint and the Hugging Face cache (as tests/load/test_nodes.py hides node 0's disk; needs root), and
an audit hook records every file it opens or lists there: it must see nothing and open nothing, and
still end with the same tensors as rank 0.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import pytest
import torch

from tests import _dist, hf
from tests import moe_models as mm
from tests.fakes import MAIN, add_snapshot
from tests.models import assert_same, gather, reference

# Slow: two spawns of 2-3 ranks that import transformers and load about twenty tiny models.
pytestmark = [pytest.mark.slow, pytest.mark.torch_range, pytest.mark.transformers]

BLOCK = (16, 16)  # FP8 blocks: partial blocks on every tiny Llama weight (24, 12, 37 rows)
CLONE_NEWNS, MS_REC, MS_PRIVATE = 0x00020000, 0x4000, 0x40000


def _hide(path: str) -> bool:
    """(ranks other than 0) A private mount namespace for this process, an empty tmpfs over ``path``:
    what a node without the checkpoint sees. False where that is not allowed (not root)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        return False
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:  # nothing propagates back
        return False
    return libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", 0, None) == 0


def _loaded(model) -> dict:
    generation = getattr(model, "generation_config", None)
    return {
        "tensors": gather(model),
        "config": model.config.to_dict(),
        "attn": model.config._attn_implementation,
        "generation": generation.to_dict() if generation is not None else None,
        "training": model.training,
        "report": model.rank0load_report,
    }


def _rank(rank: int, world: int, root: str, jobs: dict) -> dict:
    touched: list[str] = []
    indexes: list[str] = []  # rank 0: the index files it opened
    hidden = False
    if rank == 0:

        def audit_indexes(event: str, args: tuple) -> None:
            if event == "open" and args and isinstance(args[0], (str, bytes)):
                if os.fsdecode(args[0]).endswith(".safetensors.index.json"):
                    indexes.append(os.fsdecode(args[0]))

        sys.addaudithook(audit_indexes)
    if rank:
        os.environ["HF_HOME"] = os.path.join(root, "nowhere")
        hidden = _hide(root)

        def audit(event: str, args: tuple) -> None:
            if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes)):
                path = os.path.abspath(os.fsdecode(args[0]))
                if path.startswith(root):
                    touched.append(f"{event} {path}")

        sys.addaudithook(audit)
    else:
        os.environ["HF_HOME"] = os.path.join(root, "hf")
    os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is imported: below

    import transformers

    import rank0load

    hf._quiet()
    out: dict = {"hidden": hidden, "sees": os.path.exists(os.path.join(root, "llama", "config.json"))}
    out["index_reads"] = {}
    for name, (cls_name, path, kwargs) in jobs.items():
        del indexes[:]
        try:
            out[name] = _loaded(rank0load.load_pretrained(getattr(transformers, cls_name), path, **kwargs))
        except rank0load.LoadError as exc:
            out[name] = (type(exc).__name__, str(exc))
        out["index_reads"][name] = len(indexes)
    out["touched"] = touched
    return out


def _edit_config(path, edit) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    edit(config)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def _fp8(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    if key.endswith("_proj.weight"):
        q, scale = mm.quantize(t, BLOCK)
        return {key: q, key.removesuffix("weight") + "weight_scale_inv": scale}
    return {key: t}


def _checkpoints(tmp) -> tuple[str, dict]:
    """Every checkpoint under ``root`` (hidden from rank 1), and the loads to run: name -> (class
    name, path, kwargs)."""
    root = os.path.realpath(tmp / "root")
    os.makedirs(root)
    at = lambda name: os.path.join(root, name)

    llama = hf.pretrained("llama").to(torch.bfloat16)  # config.json's dtype: bfloat16
    llama.generation_config.update(do_sample=True, temperature=0.6, top_k=7)
    llama.save_pretrained(at("llama"), max_shard_size="20KB")
    shutil.copytree(at("llama"), at("llama-nodtype"))
    _edit_config(at("llama-nodtype"), lambda c: c.pop("dtype"))
    hf.pretrained("qwen2").save_pretrained(at("qwen2"), max_shard_size="20KB")  # float32, untied head
    hf.pretrained("t5").save_pretrained(at("t5"), max_shard_size="20KB")  # keeps "wo" in fp32 under fp16

    hf.pretrained("llama", seed=1).save_pretrained(at("fp8"), max_shard_size="20KB")
    mm.rewrite(at("fp8"), _fp8, quantization_config=mm.fp8_config(BLOCK))
    mm.save_dequantized(at("fp8"), tmp / "fp8-reference")  # outside root: the reference only

    repo = os.path.join(root, "hf", "hub", "models--org--tiny-llama")
    files = {p.name: p.read_bytes() for p in sorted((tmp / "root" / "llama").iterdir())}
    add_snapshot(repo, MAIN, files, ("main",))

    for name, edit in {
        "remote": lambda c: c.update(
            model_type="tiny_custom",
            auto_map={
                "AutoConfig": "modeling_tiny.TinyConfig",
                "AutoModelForCausalLM": "modeling_tiny.TinyLM",
            },
        ),
        "gptq": lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}),
        "badjson": None,
        "noconfig": None,
    }.items():
        shutil.copytree(at("llama"), at(name))
        if name == "badjson":
            with open(os.path.join(at(name), "config.json"), "w") as f:
                f.write('{"model_type": "llama",')
        elif name == "noconfig":
            os.remove(os.path.join(at(name), "config.json"))
        else:
            _edit_config(at(name), edit)

    causal, seq = "AutoModelForCausalLM", "AutoModelForSequenceClassification"
    new_head = {"strict": False, "config_overrides": {"num_labels": 3}}
    jobs = {
        "auto": (causal, at("llama"), {}),
        "concrete_fp32": ("LlamaForCausalLM", at("llama"), {"dtype": torch.float32}),
        "nodtype_auto": (causal, at("llama-nodtype"), {"dtype": "auto"}),
        "nodtype_none": (causal, at("llama-nodtype"), {}),
        "qwen2_bf16": (
            causal,
            at("qwen2"),
            {"dtype": "bfloat16", "config_overrides": {"attn_implementation": "eager"}},
        ),
        "t5_fp16": ("AutoModelForSeq2SeqLM", at("t5"), {"dtype": torch.float16}),
        "seq_llama": (seq, at("llama"), new_head),
        "seq_qwen2": (seq, at("qwen2"), new_head),
        "fp8": (causal, at("fp8"), {"dtype": torch.bfloat16}),
        "hub": (causal, "org/tiny-llama", {}),
        "remote": (causal, at("remote"), {}),
        "gptq": (causal, at("gptq"), {}),
        "badjson": (causal, at("badjson"), {}),
        "noconfig": (causal, at("noconfig"), {}),
        "typo": (causal, at("llama"), {"config_overrides": {"num_label": 3}}),
        "wrong_auto": ("AutoModelForSeq2SeqLM", at("llama"), {}),
        "revision_local": (causal, at("llama"), {"revision": "main"}),
    }
    return root, jobs


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pretrained")
    root, jobs = _checkpoints(tmp)
    results = _dist.ok(_dist.run(_rank, 2, root, jobs, timeout=900, fresh=True))
    return tmp, root, jobs, results


def _reference(cls_name: str, path, **kwargs):
    import transformers

    hf._quiet()
    return getattr(transformers, cls_name).from_pretrained(path, **kwargs)


def _same_everywhere(results, name: str) -> list[dict]:
    got = [r[name] for r in results]
    assert all(isinstance(g, dict) for g in got), got
    assert got[0]["config"] == got[1]["config"]  # the config rank 0 sent, the same on every rank
    return got


def test_rank1_never_sees_the_checkpoint(loaded):
    _, _, _, results = loaded
    assert results[0]["sees"] and results[1]["touched"] == [], results[1]["touched"]
    if not results[1]["hidden"]:
        pytest.skip("a private mount namespace needs root: only the audit hook checked rank 1")
    assert not results[1]["sees"]


def test_the_index_is_read_once(loaded):
    """load_pretrained resolves the checkpoint for its config and hands that to load_sharded
    (``_source.Resolved``): a MoE index (~96,000 names) is parsed once, not once for the config and
    again for the manifest."""
    _, _, _, results = loaded
    reads = results[0]["index_reads"]
    loads = ["auto", "concrete_fp32", "nodtype_auto", "seq_llama", "fp8", "hub"]
    assert all(isinstance(results[0][name], dict) for name in loads)
    assert {name: reads[name] for name in loads} == dict.fromkeys(loads, 1)
    assert results[1]["index_reads"] == dict.fromkeys(results[1]["index_reads"], 0)


@pytest.mark.parametrize(
    ("name", "cls_name", "checkpoint", "kwargs"),
    [
        ("auto", "AutoModelForCausalLM", "llama", {}),  # from_pretrained's default: the config's bf16
        ("concrete_fp32", "LlamaForCausalLM", "llama", {"dtype": torch.float32}),
        ("nodtype_auto", "AutoModelForCausalLM", "llama-nodtype", {"dtype": "auto"}),  # the weights' bf16
        ("nodtype_none", "AutoModelForCausalLM", "llama-nodtype", {"dtype": torch.float32}),
        (
            "qwen2_bf16",
            "AutoModelForCausalLM",
            "qwen2",
            {"dtype": torch.bfloat16, "attn_implementation": "eager"},
        ),
        ("t5_fp16", "AutoModelForSeq2SeqLM", "t5", {"dtype": torch.float16}),
    ],
)
def test_matches_from_pretrained(loaded, name, cls_name, checkpoint, kwargs):
    _, root, _, results = loaded
    ref = _reference(cls_name, os.path.join(root, checkpoint), **kwargs)
    for got in _same_everywhere(results, name):
        assert_same(got["tensors"], reference(ref))
        assert got["config"] == ref.config.to_dict()
        assert got["attn"] == ref.config._attn_implementation
        assert got["generation"] == ref.generation_config.to_dict()
        assert got["training"] is False  # eval mode, as from_pretrained returns it


def test_dtypes_none_auto_and_kept_in_float32(loaded):
    """The dtypes the comparisons above rely on, spelt out: None follows config.json (bf16, else
    fp32), "auto" falls back to the weights, inv_freq stays fp32, T5's "wo" stays fp32 under fp16."""
    import transformers

    _, _, _, results = loaded
    r = results[1]
    inv_freq = "model.rotary_emb.inv_freq"
    # None: transformers 5's from_pretrained follows config.json; 4.57's builds in torch's default
    none = torch.bfloat16 if int(transformers.__version__.split(".")[0]) >= 5 else torch.float32
    assert r["auto"]["tensors"]["model.embed_tokens.weight"].dtype == none
    assert r["auto"]["tensors"][inv_freq].dtype == torch.float32
    assert r["nodtype_auto"]["tensors"]["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert r["nodtype_none"]["tensors"]["model.embed_tokens.weight"].dtype == torch.float32
    assert r["qwen2_bf16"]["attn"] == "eager"
    t5 = r["t5_fp16"]["tensors"]
    assert t5["encoder.block.0.layer.1.DenseReluDense.wo.weight"].dtype == torch.float32
    assert t5["encoder.block.0.layer.1.DenseReluDense.wi.weight"].dtype == torch.float16


def test_generation_config_from_the_checkpoint(loaded):
    _, _, _, results = loaded
    for r in results:
        generation = r["auto"]["generation"]
        assert (generation["temperature"], generation["top_k"], generation["do_sample"]) == (0.6, 7, True)
        assert r["seq_llama"]["generation"] is None  # a classifier cannot generate


@pytest.mark.parametrize(
    ("name", "checkpoint", "unexpected"),
    [("seq_llama", "llama", ()), ("seq_qwen2", "qwen2", ("lm_head.weight",))],
)
def test_new_classification_head(loaded, name, checkpoint, unexpected):
    """strict=False with num_labels=3: the body bit for bit as from_pretrained loads it, the new
    score head initialised (transformers' _init_weights: normal, std 0.02), the same on every rank.
    A tied head is not stored, so nothing is unexpected for the tied Llama."""
    _, root, _, results = loaded
    ref = _reference("AutoModelForSequenceClassification", os.path.join(root, checkpoint), num_labels=3)
    want = {k: v for k, v in reference(ref).items() if k != "score.weight"}
    heads = []
    for got in _same_everywhere(results, name):
        assert got["report"].missing == ("score.weight",)
        assert got["report"].unexpected == unexpected
        head = got["tensors"].pop("score.weight")
        assert_same(got["tensors"], want)
        assert got["config"] == ref.config.to_dict() and got["config"]["id2label"] == {
            0: "LABEL_0",
            1: "LABEL_1",
            2: "LABEL_2",
        }
        assert head.shape == ref.score.weight.shape == (3, ref.config.hidden_size)
        assert torch.isfinite(head).all() and 0.01 < head.float().std() < 0.04, head
        heads.append(head)
    assert torch.equal(heads[0], heads[1])


def test_fp8_block_checkpoint_dequantised(loaded):
    """quantization_config fp8 with weight_block_size: every *_proj weight dequantised into bf16,
    equal to from_pretrained of the dequantised float32 copy cast to bf16; the config the model
    carries has no quantization_config (the weights are not quantised any more)."""
    tmp, _, _, results = loaded
    ref = _reference("AutoModelForCausalLM", tmp / "fp8-reference", dtype=torch.bfloat16)
    fp8 = [k for k, (dtype, _) in mm.headers(os.path.join(tmp, "root", "fp8")).items() if dtype == "F8_E4M3"]
    for got in _same_everywhere(results, "fp8"):
        assert_same(got["tensors"], reference(ref))
        assert got["report"].dequantised == len(fp8) == 7 * 3  # q k v o gate up down, 3 layers
        assert "quantization_config" not in got["config"] and got["config"]["dtype"] == "bfloat16"


def test_hub_repo_id_resolved_on_rank0(loaded):
    """``org/tiny-llama`` from rank 0's offline cache (rank 1's HF_HOME does not exist), resolved
    once: load_sharded gets the snapshot, whose files are the cache's blobs."""
    _, root, _, results = loaded
    ref = _reference("AutoModelForCausalLM", os.path.join(root, "llama"))
    blobs = os.path.join(root, "hf", "hub", "models--org--tiny-llama", "blobs") + os.sep
    for got in _same_everywhere(results, "hub"):
        assert_same(got["tensors"], reference(ref))
        assert got["config"]["_name_or_path"] == "org/tiny-llama"
        assert got["generation"] == ref.generation_config.to_dict()
        assert got["report"].files and all(f.startswith(blobs) for f in got["report"].files)


@pytest.mark.parametrize(
    ("name", "cls", "patterns"),
    [
        (
            "remote",
            "ModelMismatchError",
            [
                r"model_type 'tiny_custom' needs the checkpoint's own code",
                r"load_pretrained runs only with trust_remote_code=True",
                r"Pass trust_remote_code=True if you trust that code",
                r"pass the model class as model_cls",
            ],
        ),
        ("gptq", "ModelMismatchError", ["quant_method 'gptq'", "FP8 block"]),
        ("badjson", "CheckpointFormatError", [r"badjson/config\.json is not valid JSON"]),
        (
            "noconfig",
            "CheckpointNotFoundError",
            [r"no config\.json beside the checkpoint's weights", "load_sharded"],
        ),
        ("typo", "LoadError", [r"config_overrides \['num_label'\] name no attribute of LlamaConfig"]),
        (
            "wrong_auto",
            "ModelMismatchError",
            ["AutoModelForSeq2SeqLM has no model for LlamaConfig", "LlamaForCausalLM"],
        ),
        (
            "revision_local",
            "CheckpointNotFoundError",
            [r"revision='main' names a Hugging Face Hub revision", "local path"],
        ),
    ],
)
def test_errors_the_same_on_every_rank(loaded, name, cls, patterns):
    _, _, _, results = loaded
    got = {tuple(r[name]) for r in results}
    assert len(got) == 1, got
    [(raised, message)] = got
    assert raised == cls, message
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, message)


def _three(rank: int, world: int, path: str) -> dict:
    import transformers

    import rank0load

    hf._quiet()
    return _loaded(rank0load.load_pretrained(transformers.AutoModelForCausalLM, path, dtype=torch.float32))


def test_three_ranks(tmp_path):
    """Uneven shards (vocab 61, hidden 32, intermediate 45 over 3 ranks), bit for bit."""
    hf.pretrained("qwen2").save_pretrained(tmp_path, max_shard_size="20KB")
    ref = _reference("AutoModelForCausalLM", tmp_path, dtype=torch.float32)
    for got in _dist.ok(_dist.run(_three, 3, str(tmp_path), timeout=600)):
        assert_same(got["tensors"], reference(ref))
        assert got["config"] == ref.config.to_dict()
