"""Hub repo ids resolve on rank 0 only, through huggingface_hub's cache, offline.

The cache is built by hand in the layout huggingface_hub uses (``models--org--name/{refs,snapshots,
blobs}``, snapshot files symlinked to blobs), under an ``HF_HOME`` of the test's own. Rank 0 gets
that ``HF_HOME`` and ``HF_HUB_OFFLINE=1``; the other ranks get an ``HF_HOME`` that does not exist and
an audit hook that records every file they open or list under the real cache: they must load anyway,
open nothing there, and never import huggingface_hub.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests import _dist
from tests.fakes import MAIN, SHARDED, V1, FakeTTY, add_snapshot
from tests.models import assert_same, gather, reference, save_sharded, save_state, toy, toy_state, trained_toy


def _weights(tmp, seed: int) -> bytes:
    path = str(tmp / f"w{seed}.safetensors")
    save_state(trained_toy(seed), path)
    with open(path, "rb") as f:
        return f.read()


def _sharded(tmp, seed: int) -> dict[str, bytes]:
    """Two shards and an index, as save_pretrained writes them (in the cache, the index is a blob too)."""
    directory = tmp / f"sharded{seed}"
    directory.mkdir()
    save_sharded(toy_state(seed), str(directory))
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _rank(rank: int, world: int, hf_home: str) -> dict:
    real_cache = os.path.realpath(hf_home)
    touched: list[str] = []
    if rank != 0:
        os.environ["HF_HOME"] = os.path.join(hf_home, "does-not-exist")

        def audit(event: str, args: tuple) -> None:
            if (
                event in ("open", "os.listdir", "os.scandir", "os.walk")
                and args
                and isinstance(args[0], (str, bytes))
            ):
                path = os.fsdecode(args[0])
                if path.startswith(real_cache) or "models--" in path:
                    touched.append(f"{event} {path}")

        sys.addaudithook(audit)
    else:
        os.environ["HF_HOME"] = hf_home
    os.environ["HF_HUB_OFFLINE"] = "1"
    hub_before = "huggingface_hub" in sys.modules

    import rank0load

    out: dict = {"hub_before": hub_before}
    real_stderr, sys.stderr = sys.stderr, FakeTTY()  # a terminal, but HF_HUB_DISABLE_PROGRESS_BARS=1
    try:
        model = rank0load.load_sharded(toy, "org/tiny")
        out["stderr"] = sys.stderr.getvalue()
    finally:
        sys.stderr = real_stderr
    out["main"] = gather(model)
    out["main_files"] = model.rank0load_report.files
    model = rank0load.load_sharded(toy, "org/tiny", revision="v1")
    out["v1"] = gather(model)
    model = rank0load.load_sharded(toy, "org/tiny", revision=SHARDED)  # a commit hash
    out["sharded"] = gather(model)
    out["sharded_files"] = model.rank0load_report.files
    try:
        rank0load.load_sharded(toy, "org/absent")
    except rank0load.LoadError as exc:
        out["absent"] = (type(exc).__name__, str(exc))
    out["hub_after"] = "huggingface_hub" in sys.modules
    out["touched"] = touched
    return out


@pytest.fixture(scope="module")
def hub_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hub")
    hf_home = tmp / "hf"
    repo = str(hf_home / "hub" / "models--org--tiny")
    config = b'{"model_type": "toy"}'
    add_snapshot(repo, MAIN, {"model.safetensors": _weights(tmp, 0), "config.json": config}, ("main",))
    add_snapshot(repo, V1, {"model.safetensors": _weights(tmp, 1), "config.json": config}, ("v1",))
    add_snapshot(repo, SHARDED, {**_sharded(tmp, 2), "config.json": config}, ())
    # `inspect` on the repo id, in a subprocess running alongside the spawn.
    cli = subprocess.Popen(
        [sys.executable, "-m", "rank0load", "inspect", "org/tiny", "--revision", "v1", "--json"],
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        env={**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    env = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # see test_progress_bar_disabled_by_environment
    results = _dist.ok(_dist.run(_rank, 2, str(hf_home), env=env, fresh=True))
    out, err = cli.communicate(timeout=120)
    return str(hf_home), results, (cli.returncode, out, err)


@pytest.mark.slow
def test_repo_id_from_offline_cache_on_rank0_only(hub_results):
    hf_home, results, _ = hub_results
    for rank, r in enumerate(results):
        assert_same(r["main"], reference(trained_toy(0)))
        assert r["main_files"] and all(f.startswith(os.path.realpath(hf_home)) for f in r["main_files"]), r[
            "main_files"
        ]  # resolved through the cache, the blob behind snapshots/<main>
        if rank:
            assert not r["hub_before"] and not r["hub_after"], "a rank other than 0 imported huggingface_hub"
            assert r["touched"] == [], r["touched"]


@pytest.mark.slow
def test_progress_bar_disabled_by_environment(hub_results):
    """HF_HUB_DISABLE_PROGRESS_BARS=1 turns rank 0's bar off although stderr is a terminal (this
    spawn sets it; tests/common/test_progress.py shows the bar appearing without it)."""
    _, results, _ = hub_results
    assert [r["stderr"] for r in results] == ["", ""]


@pytest.mark.slow
def test_revision_selects_the_snapshot(hub_results):
    _, results, _ = hub_results
    for r in results:
        assert_same(r["v1"], reference(trained_toy(1)))
        assert not torch.equal(r["v1"]["emb.weight"], r["main"]["emb.weight"])


@pytest.mark.slow
def test_sharded_snapshot_with_index_by_commit_hash(hub_results):
    _, results, _ = hub_results
    for r in results:
        assert len(r["sharded_files"]) == 2
        assert_same(r["sharded"], reference(trained_toy(2)))


@pytest.mark.slow
def test_absent_repo_offline_raises_everywhere(hub_results):
    _, results, _ = hub_results
    errors = {r["absent"] for r in results}
    assert len(errors) == 1, errors
    name, message = errors.pop()
    assert name == "CheckpointNotFoundError"
    assert "'org/absent'" in message and "HF_HUB_OFFLINE" in message


def test_only_weights_index_and_configs_are_fetched(toy_checkpoint, monkeypatch):
    """Weights, their index, config.json and generation_config.json (load_pretrained reads both)."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from rank0load.checkpoint import _source

    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, **kwargs):
        calls.append((repo_id, revision, allow_patterns, kwargs))
        return os.path.dirname(toy_checkpoint)  # a snapshot holding model.safetensors alone

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    source = _source.resolve("org/name", "v2")
    assert source.files == (os.path.realpath(toy_checkpoint),)
    [(repo_id, revision, patterns, kwargs)] = calls
    assert (repo_id, revision, kwargs) == ("org/name", "v2", {})
    repo_files = [
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "config.json",
        "sub/model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "pytorch_model.bin",
        "model.gguf",
        "README.md",
        "generation_config.json",
    ]
    assert sorted(filter_repo_objects(repo_files, allow_patterns=patterns)) == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "sub/model.safetensors",
    ]


@pytest.mark.slow
def test_inspect_repo_id_offline(hub_results):
    hf_home, _, (code, out, err) = hub_results
    assert code == 0, err
    got = json.loads(out)
    assert [f["name"] for f in got["files"]] == ["model.safetensors"]  # the snapshot's name, not the blob's
    assert got["files"][0]["path"].startswith(
        os.path.join(os.path.realpath(hf_home), "hub", "models--org--tiny")
    )
    assert got["tensors"] == len(trained_toy(1).state_dict()) - 1  # the tied head is stored once


def _snapshot_paths(rank: int, world: int, paths: list[str]) -> list:
    import rank0load

    out = []
    for path in paths:
        try:
            out.append(gather(rank0load.load_sharded(toy, path)))
        except rank0load.LoadError as exc:
            out.append((type(exc).__name__, str(exc)))
    return out


@pytest.mark.slow
def test_snapshot_directory_passed_as_a_path(tmp_path):
    """A cache snapshot passed as a local path (as users copy it from `huggingface-cli scan-cache`):
    its files link into the repo's blobs/, which is allowed; a link leaving the repo is still refused."""
    repo = str(tmp_path / "hub" / "models--org--tiny")
    add_snapshot(repo, MAIN, {"model.safetensors": _weights(tmp_path, 0)}, ("main",))
    add_snapshot(repo, SHARDED, _sharded(tmp_path, 2), ())
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(_weights(tmp_path, 3))
    escaping = os.path.join(repo, "snapshots", V1)
    os.makedirs(escaping)
    os.symlink(str(outside), os.path.join(escaping, "model.safetensors"))
    snap = os.path.join(repo, "snapshots")
    paths = [
        os.path.join(snap, MAIN),
        os.path.join(snap, SHARDED),
        os.path.join(snap, SHARDED, "model.safetensors.index.json"),
        escaping,
    ]
    results = _dist.ok(_dist.run(_snapshot_paths, 2, paths))
    for r in results:
        assert_same(r[0], reference(trained_toy(0)))
        assert_same(r[1], reference(trained_toy(2)))
        assert_same(r[2], reference(trained_toy(2)))
        name, message = r[3]
        assert name == "CheckpointFormatError" and "outside the checkpoint directory" in message
