"""What a newcomer trips over (the README's quick start: tests/project/test_readme.py): a missing
relative path that looks like ``org/name`` says it is not a local path and was tried as a Hub repo
id; ``revision=`` with a local path is an error on every rank, never ignored."""

from __future__ import annotations

import os
import re

import pytest

from rank0load.__main__ import main
from rank0load.checkpoint._source import resolve
from rank0load.errors import CheckpointNotFoundError
from tests import _dist
from tests.models import assert_same, gather, reference, toy, trained_toy


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """huggingface_hub offline with an empty cache (it read HF_HUB_OFFLINE when imported: patch it)."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_missing_relative_path_says_local_and_hub(offline_hub):
    (offline_hub / "ckpt").mkdir()
    with pytest.raises(CheckpointNotFoundError) as exc:
        resolve("ckpt/nope")
    message = str(exc.value)
    assert message.startswith(
        f"checkpoint 'ckpt/nope' does not exist as a local path (in {str(offline_hub)!r}: the directory "
        "'ckpt' exists there but holds no 'nope'), so it was tried as a Hugging Face Hub repo id, and "
        "the Hugging Face cache has no complete snapshot of it"
    ), message
    assert "If you meant a local path, check it" in message and "hf download ckpt/nope" in message
    with pytest.raises(CheckpointNotFoundError) as exc:
        resolve("elsewhere/nope", revision="v2")  # no ./elsewhere: no directory to name
    assert str(exc.value).startswith(
        f"checkpoint 'elsewhere/nope' does not exist as a local path (in {str(offline_hub)!r}), so it was "
        "tried as a Hugging Face Hub repo id at revision 'v2', and"
    ), str(exc.value)


def test_missing_relative_path_hub_unreachable(tmp_path, monkeypatch):
    import huggingface_hub

    def refused(repo_id, **kwargs):
        raise OSError("connection refused")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refused)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(CheckpointNotFoundError) as exc:
        resolve("ckpt/nope")
    assert re.fullmatch(
        r"checkpoint 'ckpt/nope' does not exist as a local path \(in '.*': the directory 'ckpt' exists "
        r"there but holds no 'nope'\), so it was tried as a Hugging Face Hub repo id, which could not be "
        r"fetched from the Hugging Face Hub: connection refused If you meant a local path, check it\.",
        str(exc.value),
    ), str(exc.value)


def test_revision_with_a_local_path_is_refused(toy_checkpoint, toy_sharded, capsys):
    for path in (toy_checkpoint, toy_sharded, os.path.join(toy_sharded, "model.safetensors.index.json")):
        with pytest.raises(CheckpointNotFoundError, match=r"revision='v1' names a Hugging Face Hub revision"):
            resolve(path, "v1")
        assert resolve(path).files  # without it, the same path resolves
    assert main(["inspect", toy_sharded, "--revision", "v1"]) == 2
    assert "a local checkpoint has no revisions" in capsys.readouterr().err


def _revision(rank: int, world: int, path: str) -> object:
    import rank0load

    error = None
    try:
        rank0load.load_sharded(toy, path, revision="main")
    except rank0load.LoadError as exc:
        error = (type(exc).__name__, str(exc))
    return error, gather(rank0load.load_sharded(toy, path))  # the group is still usable


@pytest.mark.slow
def test_revision_with_a_local_path_fails_on_every_rank(toy_sharded):
    results = _dist.ok(_dist.run(_revision, 2, toy_sharded))
    errors = {r[0] for r in results}
    assert len(errors) == 1, errors
    [(name, message)] = errors
    assert name == "CheckpointNotFoundError" and f"checkpoint {toy_sharded!r} is a local path" in message
    for _, tensors in results:
        assert_same(tensors, reference(trained_toy()))
