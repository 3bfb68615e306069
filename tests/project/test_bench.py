"""Smoke test of ``python -m benchmarks.bench``: a tiny checkpoint, 2 gloo ranks, every method, 1 round.

Checks that every figure is there and sane — the cold first load and the warm second one of each
process — that verification ran on every loading method (both loads), and that it fails when the
loaded data is wrong (one tensor of a copied checkpoint corrupted on disk). The same for ``--model
moe`` (a per-expert Qwen3-MoE checkpoint into transformers' fused experts), and that its checkpoint
is exactly what ``save_pretrained`` writes; and for ``--model minimax`` at 2 layers x 4 experts (a
MiniMax-M2-shaped FP8 checkpoint: its layout is the one tests/moe_models.py ``save_fp8`` writes for a
real tiny MiniMax-M2, its digests are what transformers loads, and every method — the floor
included — verifies, and fails on a damaged expert).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from dataclasses import asdict

import pytest

from benchmarks import bench
from benchmarks.bench import moe
from benchmarks.bench.methods import METHODS
from benchmarks.bench.model import config_for_size, tensor_digest, tensor_specs
from tests import hf

SIZE = "0.005"  # GB: hidden 256, 2 layers, vocab 4000, 3 shards


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    readme = out / "README.md"
    readme.write_text("# title\n\n<!-- bench:results:start -->\nSTALE\n<!-- bench:results:end -->\n\ntail\n")
    rc = bench.main(["--size-gb", SIZE, "--rounds", "1", "--out", str(out), "--update-readme", str(readme)])
    with open(out / "bench.json") as f:
        return rc, json.load(f), out, readme


@pytest.mark.slow
def test_every_method_reports_and_verifies(smoke):
    rc, doc, _, _ = smoke
    assert rc == 0
    (res,) = doc["results"]
    n_tensors = len(tensor_specs(config_for_size(float(SIZE))))
    assert res["checkpoint"]["tensors"] == n_tensors and res["checkpoint"]["shards"] >= 2
    by_method = {s["method"]: s for s in res["summary"]}
    assert list(by_method) == list(METHODS)
    for method, s in by_method.items():
        assert s["ok"], (method, s)
        assert s["seconds"] > 0
        assert len(s["per_rank"]) == 2
        for r in s["per_rank"]:
            assert r["rss_before"] > 0 and r["resident"] > 0
            assert r["peak_rss"] >= r["rss_before"]
            assert r["transient"] == r["peak_rss"] - r["rss_before"] - r["resident"]
            assert r["cpu_seconds"] > 0  # getrusage around the method: every load costs some CPU
            # the warm second load of the same process, measured the same way
            assert r["warm_seconds"] > 0 and r["warm_rss_before"] > 0 and r["warm_resident"] == r["resident"]
            assert r["warm_transient"] == r["warm_peak_rss"] - r["warm_rss_before"] - r["warm_resident"]
        assert s["warm_seconds"] == max(r["warm_seconds"] for r in s["per_rank"])
        assert s["node_cpu_seconds"] == pytest.approx(sum(r["cpu_seconds"] for r in s["per_rank"]))
        assert s["node_transient"] == sum(r["transient"] for r in s["per_rank"])
        assert s["node_peak"] == sum(r["peak_rss"] for r in s["per_rank"])
        raw = res["raw"][method][0]
        assert all(r["peak_reset"] and r["warm"]["peak_reset"] for r in raw)
        if method == "build-only":
            assert s["verified"] is None
        else:
            assert s["verified"] is True
            # every checkpoint tensor was compared, plus the tied head
            assert s["tensors_checked"] == n_tensors
            assert all(r["verified"] and r["problem_count"] == 0 for r in raw)
            assert all(
                r["warm"]["verified"] and r["warm"]["tensors_checked"] in (n_tensors, None) for r in raw
            )
    assert by_method["rank0load"]["tie_kept"] is True
    assert by_method["rank0load"]["stream_gbps"] > 0 and by_method["rank0load"]["stream_seconds"] > 0
    # node-local reads: rank 1 read its own bytes, unless told not to
    assert by_method["rank0load"]["local_readers"] == 1
    assert by_method["rank0load-stream"]["local_readers"] == 0


@pytest.mark.slow
def test_readme_section_rewritten(smoke):
    _, _, _, readme = smoke
    text = readme.read_text()
    assert "STALE" not in text and text.startswith("# title") and text.rstrip().endswith("tail")
    assert "| rank0load |" in text and "torch" in text
    assert "| method | cold load s | warm load s |" in text
    # every round of each pair, not only the best rounds the table shows: once each
    for a, b in (("rank0load", "dcp-hf"), ("rank0load", "floor"), ("dcp-hf", "floor")):
        assert text.count(f"Round by round ({a}'s round i over {b}'s round i): ") == 1, (a, b)


def _corrupt(path: str, key: str) -> None:
    """Flip one byte in the middle of ``key``'s data, keeping the file's size and header."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        start, stop = header[key]["data_offsets"]
        pos = 8 + n + (start + stop) // 2
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x40]))


@pytest.mark.slow
def test_workers_run_the_drivers_rank0load_whatever_the_working_directory(tmp_path, monkeypatch):
    """Started inside another tree (comparing two checkouts), the workers still import the driver's
    rank0load, not the working directory's."""
    decoy = tmp_path / "cwd" / "rank0load"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy rank0load in the working directory')\n")
    monkeypatch.chdir(decoy.parent)
    out = tmp_path / "out"
    rc = bench.main(
        ["--size-gb", SIZE, "--rounds", "1", "--cold-only", "--methods", "build-only", "--out", str(out)]
    )
    assert rc == 0
    with open(out / "bench.json") as f:
        (res,) = json.load(f)["results"]
    assert all(r.get("error") is None for r in res["raw"]["build-only"][0]), res["raw"]


@pytest.mark.slow
def test_verification_catches_wrong_data(smoke, tmp_path):
    _, doc, _, _ = smoke
    src = doc["results"][0]["checkpoint"]["dir"]
    out = tmp_path / "corrupt"
    dst = out / os.path.basename(src)
    shutil.copytree(src, dst)
    with open(dst / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    key = "model.layers.1.mlp.up_proj.weight"
    _corrupt(str(dst / weight_map[key]), key)

    rc = bench.main(["--size-gb", SIZE, "--rounds", "1", "--out", str(out), "--methods", "rank0load"])
    assert rc == 1
    with open(out / "bench.json") as f:
        (res,) = json.load(f)["results"]
    assert res["checkpoint"]["dir"] == str(dst)  # the corrupted copy was loaded, not regenerated
    for s in res["summary"]:
        assert s["ok"] is False, s
        assert key in s["failure"]


# --- the MoE checkpoint: ``--model moe`` ---------------------------------------------------------------

MOE_SIZE = "0.005"  # GB: Qwen3-MoE, hidden 128, 3 layers of 16 experts, vocab 4000, 5 shards
# The methods with MoE code of their own: the floor's and dcp-hf's views of a rank's own experts,
# every-rank's fused state dict (broadcast-rank0 builds the same one), rank0load's conversion. The
# others run the llama smoke above; each method spends seconds starting its two fresh processes.
MOE_METHODS = ("floor", "rank0load", "every-rank", "dcp-hf")


@pytest.fixture(scope="module")
def moe_smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-moe")
    readme = out / "README.md"
    readme.write_text("# title\n\n<!-- bench:results:start -->\nllama\n<!-- bench:results:end -->\n\ntail\n")
    argv = ["--model", "moe", "--size-gb", MOE_SIZE, "--rounds", "1", "--out", str(out)]
    rc = bench.main(
        [*argv, "--methods", ",".join(MOE_METHODS), "--cold-only", "--update-readme", str(readme)]
    )
    with open(out / "bench.json") as f:
        return rc, json.load(f), out, readme


@pytest.mark.slow
@hf.needs_transformers_5("conversion mapping for fused MoE experts")
def test_moe_every_method_reports_and_verifies(moe_smoke):
    rc, doc, _, _ = moe_smoke
    assert rc == 0
    (res,) = doc["results"]
    assert doc["model"] == res["model"] == "moe"
    cfg = moe.config_for_size(float(MOE_SIZE))
    assert res["checkpoint"]["config"] == asdict(cfg)
    specs = moe.tensor_specs(cfg)
    assert res["checkpoint"]["tensors"] == len(specs) and res["checkpoint"]["shards"] >= 2
    # every model parameter compared: the non-expert tensors, and two fused tensors per layer
    n_params = sum(1 for key, _ in specs if ".mlp.experts." not in key) + 2 * cfg.layers
    by_method = {s["method"]: s for s in res["summary"]}
    assert list(by_method) == list(MOE_METHODS)
    for method, s in by_method.items():
        assert s["ok"], (method, s)
        assert s["seconds"] > 0 and len(s["per_rank"]) == 2
        assert s["tie_kept"] is None  # the MoE model's head is not tied
        for r in s["per_rank"]:
            assert r["rss_before"] > 0 and r["resident"] > 0
            assert r["transient"] == r["peak_rss"] - r["rss_before"] - r["resident"]
        # bit-exact: every full parameter's SHA-256 against the one recorded while writing
        assert s["verified"] is True and s["tensors_checked"] == n_params
        assert all(r["verified"] and r["problem_count"] == 0 for r in res["raw"][method][0])
    assert by_method["rank0load"]["stream_gbps"] > 0


@pytest.mark.slow
def test_moe_readme_section_added(moe_smoke):
    _, _, _, readme = moe_smoke
    text = readme.read_text()
    llama, moe_part = text.split("## MoE checkpoint")
    assert "llama" in llama and "tail" in llama  # the Llama section is left as it was
    assert "<!-- bench:results-moe:start -->" in moe_part and "<!-- bench:results-moe:end -->" in moe_part
    assert "| rank0load |" in moe_part and "| every-rank |" in moe_part and "--model moe" in moe_part


@pytest.mark.slow
@hf.needs_transformers_5("conversion mapping for fused MoE experts")
def test_moe_checkpoint_is_what_save_pretrained_writes(tmp_path):
    """The writer's keys, dtypes and shapes are save_pretrained's for the same config (per-expert
    layout), and transformers' own from_pretrained of it matches every recorded digest (fused
    experts included): the reference verification compares with is transformers', not the bench's."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = moe.config_for_size(float(MOE_SIZE))
    meta = moe.write_checkpoint(cfg, str(tmp_path / "ckpt"), log=lambda s: None)
    moe.build_model(cfg).save_pretrained(tmp_path / "ref", max_shard_size="1MB")

    def headers(path):
        out = {}
        for name in os.listdir(path):
            if name.endswith(".safetensors"):
                with open(path / name, "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(n))
                header.pop("__metadata__", None)
                out.update({k: (v["dtype"], v["shape"]) for k, v in header.items()})
        return out

    ours, theirs = headers(tmp_path / "ckpt"), headers(tmp_path / "ref")
    assert ours == theirs and any(".mlp.experts.15.down_proj." in k for k in ours)
    with open(tmp_path / "ref" / "config.json") as f, open(tmp_path / "ckpt" / "config.json") as g:
        assert json.load(f) == json.load(g)

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    params = dict(loaded.named_parameters())
    assert set(params) == set(meta["digests"])
    for name, p in params.items():
        assert tensor_digest(p) == meta["digests"][name], name


@pytest.mark.slow
@hf.needs_transformers_5("conversion mapping for fused MoE experts")
def test_moe_verification_catches_a_wrong_expert(moe_smoke, tmp_path):
    """One expert's up_proj damaged on disk: the fused gate_up_proj it lands in fails verification."""
    _, doc, _, _ = moe_smoke
    src = doc["results"][0]["checkpoint"]["dir"]
    out = tmp_path / "corrupt"
    dst = out / os.path.basename(src)
    shutil.copytree(src, dst)
    with open(dst / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    _corrupt(
        str(dst / weight_map["model.layers.1.mlp.experts.5.up_proj.weight"]),
        "model.layers.1.mlp.experts.5.up_proj.weight",
    )

    argv = ["--model", "moe", "--size-gb", MOE_SIZE, "--rounds", "1", "--out", str(out)]
    assert bench.main([*argv, "--methods", "rank0load"]) == 1
    with open(out / "bench.json") as f:
        (res,) = json.load(f)["results"]
    assert res["checkpoint"]["dir"] == str(dst)  # the corrupted copy was loaded, not regenerated
    (s,) = res["summary"]
    assert s["ok"] is False and "model.layers.1.mlp.experts.gate_up_proj" in s["failure"], s


# --- the save methods: ``--save`` ----------------------------------------------------------------------


@pytest.mark.slow
def test_save_methods_report_and_verify(tmp_path):
    from benchmarks.bench.methods import SAVE_METHODS

    readme = tmp_path / "README.md"
    loads = "<!-- bench:results:start -->\nloads\n<!-- bench:results:end -->"
    readme.write_text(f"# title\n\n{loads}\n\ntail\n")
    argv = [
        "--save",
        "--size-gb",
        SIZE,
        "--rounds",
        "1",
        "--out",
        str(tmp_path),
        "--update-readme",
        str(readme),
    ]
    assert bench.main(argv) == 0
    with open(tmp_path / "bench-save.json") as f:
        doc = json.load(f)
    (res,) = doc["results"]
    assert doc["save"] is True and res["save"] is True
    n_tensors = len(tensor_specs(config_for_size(float(SIZE))))
    by_method = {s["method"]: s for s in res["summary"]}
    assert list(by_method) == list(SAVE_METHODS)
    for method, s in by_method.items():
        assert s["ok"] and s["verified"] is True, (method, s)
        assert s["tensors_checked"] == n_tensors  # every source tensor saved once (the tie once)
        assert s["written_bytes"] > 0 and s["written_files"]
        for r in s["per_rank"]:
            assert r["peak_rss"] >= r["rss_before"] > 0 and r["resident"] > 0
            assert r["transient"] == r["peak_rss"] - r["rss_before"]  # the model is resident throughout
        assert all(r["peak_reset"] for r in res["raw"][method][0])
    assert not (tmp_path / "bench.json").exists()  # the loads' latest record is not overwritten
    text = readme.read_text()
    assert loads in text and "## Save" in text and "<!-- bench:save:start -->" in text
    assert "| save-rank0load |" in text and "--save" in text


def test_save_flag_parsing():
    from benchmarks.bench.methods import SAVE_METHODS

    assert bench.parse_args([]).methods == list(METHODS)  # the default run is unchanged
    assert bench.parse_args(["--save"]).methods == list(SAVE_METHODS)
    with pytest.raises(SystemExit):
        bench.parse_args(["--save", "--methods", "rank0load"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--save", "--model", "moe"])


def test_cold_warm_and_minimax_flags():
    from benchmarks.bench.minimax_methods import MINIMAX_METHODS

    default = bench.parse_args([])
    assert default.warm is True and default.warm_up is True  # cold first, then warm, by default
    assert bench.parse_args(["--cold-only"]).warm is False
    assert bench.parse_args(["--no-warm-up"]).warm is True  # still accepted: --save's warm-up only
    args = bench.parse_args(["--model", "minimax"])
    assert (
        args.methods
        == list(MINIMAX_METHODS)
        == ["build-only", "rank0load", "rank0load-host", "floor", "transformers"]
    )
    assert args.minimax_shape is None
    assert bench.parse_args(["--model", "minimax", "--minimax-shape", "2x4"]).minimax_shape == (2, 4)
    for bad in (
        ["--minimax-shape", "2x4"],  # llama
        ["--model", "minimax", "--minimax-shape", "2"],
        ["--model", "minimax", "--sweep", "0.2,0.8"],
        ["--model", "minimax", "--methods", "dcp-hf"],
        ["--model", "minimax", "--save"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.slow
def test_two_node_bench_counts_what_crosses_the_link(tmp_path):
    """``python -m benchmarks.bench.nodes`` (1 + 1 ranks, no rate limit): rank0load sends node 1 its
    shard once (half the checkpoint), the broadcast sends it all; both verified on both ranks."""
    import shutil as sh

    if os.geteuid() != 0 or sh.which("ip") is None or sh.which("unshare") is None:
        pytest.skip("network namespaces need root, iproute2 and unshare")
    from benchmarks.bench import nodes

    argv = ["--size-gb", SIZE, "--rounds", "1", "--rate", "none", "--out", str(tmp_path)]
    argv += ["--methods", "rank0load,broadcast-rank0"]
    assert nodes.main(argv) == 0
    with open(tmp_path / f"nodes-{float(SIZE):g}gb-2ranks.json") as f:
        rows = {r["summary"]["method"]: r for r in json.load(f)["rows"]}
    total_bytes = 2 * sum(math.prod(shape) for _, shape in tensor_specs(config_for_size(float(SIZE))))  # bf16
    sent = {m: rows[m]["link"][0][0] / total_bytes for m in rows}
    assert 0.45 < sent["rank0load"] < 0.6, sent  # node 1's half, and the protocol's few KB
    assert 0.95 < sent["broadcast-rank0"] < 1.1, sent  # every byte
    assert all(r["summary"]["verified"] for r in rows.values())


# --- the MiniMax-M2 shape: ``--model minimax`` ---------------------------------------------------------


def _tiny_minimax():
    """The writer's config for tests/moe_models.py's tiny MiniMax-M2 (2 layers, 5 experts, hidden 32,
    expert width 24: partial 128-blocks, uneven experts over 2 ranks)."""
    from benchmarks.bench.minimax import MiniMaxConfig

    return MiniMaxConfig(
        layers=2, experts=5, hidden=32, intermediate=24, heads=4, kv_heads=2, head_dim=8, vocab=64
    )


@pytest.mark.slow
@hf.needs_transformers_5("MiniMax-M2 (nor its conversion mapping)")
def test_minimax_checkpoint_is_the_hub_fp8_layout(tmp_path):
    """The writer's keys, shapes and dtypes are those of transformers' own tiny MiniMax-M2 saved with
    save_pretrained and FP8-quantised in the Hub's layout (tests/moe_models.save_fp8), config.json says
    the same model and quantisation, and transformers' from_pretrained of the checkpoint (which
    dequantises FP8 on the CPU) matches every recorded parameter and buffer digest: the reference is
    transformers', not the bench's."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.bench import minimax
    from tests import moe_models

    meta = minimax.write_checkpoint(_tiny_minimax(), str(tmp_path / "ckpt"), log=lambda s: None)
    moe_models.save_fp8("minimax_m2", tmp_path / "ref")
    ours, theirs = moe_models.headers(tmp_path / "ckpt"), moe_models.headers(tmp_path / "ref")
    assert ours == theirs
    assert ours["model.layers.1.block_sparse_moe.experts.4.w2.weight_scale_inv"] == ("F32", (1, 1))
    assert meta["checkpoint_tensors"] == len(ours)
    with open(tmp_path / "ckpt" / "config.json") as f, open(tmp_path / "ref" / "config.json") as g:
        mine, ref = json.load(f), json.load(g)
    for key in (
        "model_type",
        "architectures",
        "hidden_size",
        "num_local_experts",
        "head_dim",
        "quantization_config",
    ):
        assert mine[key] == ref[key], key
    assert mine["dtype"] == "bfloat16" and mine["tie_word_embeddings"] is False

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    params = dict(loaded.named_parameters())
    assert set(params) == set(meta["digests"])
    assert params["model.layers.0.mlp.experts.gate_up_proj"].shape == (5, 48, 32)
    for name, p in params.items():
        assert tensor_digest(p) == meta["digests"][name], name
    buffers = dict(loaded.named_buffers())
    assert set(meta["buffer_digests"]) == {f"model.layers.{la}.mlp.e_score_correction_bias" for la in (0, 1)}
    for name, digest in meta["buffer_digests"].items():
        assert tensor_digest(buffers[name]) == digest, name


MINIMAX_ARGV = ["--model", "minimax", "--minimax-shape", "2x4", "--rounds", "1"]


@pytest.fixture(scope="module")
def minimax_smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-minimax")
    readme = out / "README.md"
    readme.write_text("# title\n\n<!-- bench:results:start -->\nllama\n<!-- bench:results:end -->\n")
    rc = bench.main([*MINIMAX_ARGV, "--out", str(out), "--update-readme", str(readme)])
    with open(out / "bench.json") as f:
        return rc, json.load(f), readme


@pytest.mark.slow
@hf.needs_transformers_5("MiniMax-M2 (nor its conversion mapping)")
def test_minimax_every_method_reports_and_verifies(minimax_smoke):
    from benchmarks.bench.minimax_methods import MINIMAX_METHODS

    rc, doc, readme = minimax_smoke
    assert rc == 0
    (res,) = doc["results"]
    assert res["model"] == "minimax" and res["checkpoint"]["config"]["layers"] == 2
    assert res["checkpoint"]["shards"] == 3  # one file per layer, one for embed / norm / head
    # 2 layers x (8 attention + 4 norms + router + bias + 4 experts x 6) + embed, norm, head
    assert res["checkpoint"]["tensors"] == 2 * (8 + 4 + 2 + 4 * 6) + 3
    # per layer: 4 attention, 4 norms, router, 2 fused experts; embed, norm, head; the 2 biases
    n_checked = 2 * 11 + 3 + 2
    by_method = {s["method"]: s for s in res["summary"]}
    assert list(by_method) == list(MINIMAX_METHODS)
    for method, s in by_method.items():
        assert s["ok"], (method, s)
        assert s["processes"] == (1 if method == "transformers" else 2)
        assert s["seconds"] > 0 and s["warm_seconds"] > 0
        for r in s["per_rank"]:
            assert r["transient"] == r["peak_rss"] - r["rss_before"] - r["resident"]
            assert r["warm_transient"] == r["warm_peak_rss"] - r["warm_rss_before"] - r["warm_resident"]
        if method == "build-only":
            assert s["verified"] is None
            continue
        assert s["verified"] is True and s["tensors_checked"] == n_checked, (method, s)
        for r in res["raw"][method][0]:
            assert r["verified"] and r["warm"]["verified"], (method, r)
    assert set(by_method["rank0load"]["phases"][0]) >= {"build", "stream"}
    assert by_method["rank0load"]["warm_phases"][1]
    assert by_method["floor"]["per_rank"][0]["resident"] > 0
    text = readme.read_text()
    assert (
        "llama" in text and "## MiniMax-M2 shape" in text and "<!-- bench:results-minimax:start -->" in text
    )
    assert "| floor | 2 |" in text and "| transformers | 1 |" in text and "1.00x" in text
    assert "Target: rank0load's cold load <= 1.15x floor's" in text
    # the targets round by round too, not only for the best rounds the tables show
    assert text.count("Round by round (rank0load's round i over the floor's round i): ") == 1
    assert "over floor's round i" not in text  # the dense lines are not repeated here
    assert "Transient target: rank0load's worst rank <= build-only's + 48 MiB" in text


@pytest.mark.slow
@hf.needs_transformers_5("MiniMax-M2 (nor its conversion mapping)")
def test_minimax_verification_catches_a_wrong_expert(minimax_smoke, tmp_path):
    """One float8 byte of expert 3's w3 (owned by rank 1) damaged on disk: rank0load and the floor
    both fail verification on the fused gate_up_proj it lands in: a fast wrong floor never counts."""
    _, doc, _ = minimax_smoke
    src = doc["results"][0]["checkpoint"]["dir"]
    dst = tmp_path / "corrupt" / os.path.basename(src)
    shutil.copytree(src, dst)
    key = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    with open(dst / "model.safetensors.index.json") as f:
        _corrupt(str(dst / json.load(f)["weight_map"][key]), key)
    argv = [*MINIMAX_ARGV, "--out", str(tmp_path / "corrupt"), "--methods", "rank0load,floor", "--cold-only"]
    assert bench.main(argv) == 1
    with open(tmp_path / "corrupt" / "bench.json") as f:
        (res,) = json.load(f)["results"]
    assert res["checkpoint"]["dir"] == str(dst)  # the damaged copy was loaded, not regenerated
    for s in res["summary"]:
        assert s["ok"] is False and "model.layers.1.mlp.experts.gate_up_proj" in s["failure"], s


# --- the training state: ``--resume`` ------------------------------------------------------------------


@pytest.mark.slow
def test_resume_methods_report_and_verify(tmp_path):
    """Every resume method saves (in fresh processes that trained an AdamW) and restores (in others),
    and each restore is verified bit for bit: every parameter and optimizer state, the param groups,
    the training state."""
    from benchmarks.bench.resume import RESUME_METHODS

    readme = tmp_path / "README.md"
    loads = "<!-- bench:results:start -->\nloads\n<!-- bench:results:end -->"
    readme.write_text(f"# title\n\n{loads}\n\ntail\n")
    argv = [
        "--resume",
        "--size-gb",
        SIZE,
        "--rounds",
        "1",
        "--out",
        str(tmp_path),
        "--update-readme",
        str(readme),
    ]
    assert bench.main(argv) == 0
    with open(tmp_path / "bench-resume.json") as f:
        doc = json.load(f)
    (res,) = doc["results"]
    assert doc["resume"] is True and res["resume"] is True
    cfg = config_for_size(float(SIZE))
    n_params = len(tensor_specs(cfg))  # the tied head is one parameter, stored once
    by_method = {s["method"]: s for s in res["summary"]}
    assert list(by_method) == list(RESUME_METHODS)
    for method, s in by_method.items():
        assert s["ok"], (method, s)
        for r in s["per_rank"]:
            assert r["restore_seconds"] > 0 and r["restore_cpu_seconds"] > 0
            assert r["transient"] == r["peak_rss"] - r["rss_before"] - r["resident"]
        if method == "resume-build-only":
            assert s["verified"] is None and all(r.get("save_seconds") is None for r in s["per_rank"])
            continue
        # every parameter, and its step, exp_avg and exp_avg_sq
        assert s["verified"] is True and s["tensors_checked"] == 4 * n_params, (method, s)
        assert s["written_bytes"] > 0
        for r in s["per_rank"]:
            assert r["save_seconds"] > 0 and r["save_transient"] >= 0
            assert r["save_seconds"] + r["restore_seconds"] == pytest.approx(
                next(x for x in res["raw"][method][0] if x["rank"] == r["rank"])["seconds"]
            )
    text = readme.read_text()
    assert loads in text and "## Save and restore a training state" in text
    assert "<!-- bench:resume:start -->" in text and "| resume-rank0load |" in text and "--resume" in text
    assert "Time target: resume-rank0load's save + restore" in text and "Transient target:" in text


def test_resume_flag_parsing():
    from benchmarks.bench.resume import RESUME_METHODS

    assert bench.parse_args(["--resume"]).methods == list(RESUME_METHODS)
    assert bench.parse_args(["--resume", "--methods", "resume-dcp"]).methods == ["resume-dcp"]
    for bad in (
        ["--resume", "--methods", "rank0load"],
        ["--resume", "--save"],
        ["--resume", "--model", "moe"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def _verify_after_damage(rank: int, world: int) -> list[dict]:
    """(each rank) A tiny model trained one step, verified against its own record: as it is, then with
    one byte's worth of one rank's exp_avg_sq shard changed, then with another training state."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.bench import resume
    from benchmarks.bench.methods import build_sharded
    from benchmarks.bench.model import BenchConfig

    cfg = BenchConfig(hidden=64, layers=2, vocab=128, heads=4, kv_heads=2, intermediate=96)
    model = build_sharded(cfg, init_device_mesh("cpu", (world,)))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(generator=torch.Generator().manual_seed(0))
    optimizer = resume.make_optimizer(model)
    resume.train(model, optimizer, cfg, steps=1)
    expected = resume.expected_digests(model, optimizer, {"step": 1})
    verdicts = [resume.verify(model, optimizer, {"step": 1}, expected if rank == 0 else None)]
    param = model.get_parameter("model.layers.1.mlp.up_proj.weight")
    if rank == 1:
        with torch.no_grad():
            optimizer.state[param]["exp_avg_sq"].to_local()[0, 0] += 1
    verdicts.append(resume.verify(model, optimizer, {"step": 1}, expected if rank == 0 else None))
    verdicts.append(resume.verify(model, optimizer, {"step": 2}, expected if rank == 0 else None))
    return verdicts


@pytest.mark.slow
def test_resume_verification_catches_a_wrong_state():
    from tests import _dist

    for intact, damaged, stepped in _dist.run(_verify_after_damage, 2):
        assert intact["verified"] is True, intact
        assert damaged["verified"] is False
        assert damaged["problems"] == [
            "state.model.layers.1.mlp.up_proj.weight.exp_avg_sq: differs from the saved tensor"
        ]
        assert stepped["verified"] is False and "training state" in stepped["problems"][0]
