"""Smoke test of ``python -m rank0load.bench``: a tiny checkpoint, 2 gloo ranks, every method, 1 round.

Checks that every figure is there and sane, that verification ran on every loading method, and that
it fails when the loaded data is wrong (one tensor of a copied checkpoint corrupted on disk).
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest

from rank0load import bench
from rank0load.bench.methods import METHODS
from rank0load.bench.model import config_for_size, tensor_specs

SIZE = "0.005"  # GB: hidden 256, 2 layers, vocab 4000, 3 shards


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    readme = out / "README.md"
    readme.write_text("# title\n\n<!-- bench:results:start -->\nold\n<!-- bench:results:end -->\n\ntail\n")
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
        assert s["node_cpu_seconds"] == pytest.approx(sum(r["cpu_seconds"] for r in s["per_rank"]))
        assert s["node_transient"] == sum(r["transient"] for r in s["per_rank"])
        assert s["node_peak"] == sum(r["peak_rss"] for r in s["per_rank"])
        raw = res["raw"][method][0]
        assert all(r["peak_reset"] for r in raw)
        if method == "build-only":
            assert s["verified"] is None
        else:
            assert s["verified"] is True
            # every checkpoint tensor was compared, plus the tied head
            assert s["tensors_checked"] == n_tensors
            assert all(r["verified"] and r["problem_count"] == 0 for r in raw)
    assert by_method["rank0load"]["tie_kept"] is True
    assert by_method["rank0load"]["stream_gbps"] > 0 and by_method["rank0load"]["stream_seconds"] > 0


@pytest.mark.slow
def test_readme_section_rewritten(smoke):
    _, _, _, readme = smoke
    text = readme.read_text()
    assert "old" not in text and text.startswith("# title") and text.rstrip().endswith("tail")
    assert "| rank0load |" in text and "torch" in text


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
