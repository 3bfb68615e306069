"""Shared fixtures: checkpoints of ``trained_toy()`` (tests/models.py), written once per session.

The files are shared by every test that asks for them, so tests only read them: a test that needs
a changed copy, or files beside the checkpoint, writes its own into ``tmp_path``.

Markers: ``slow`` (registered in pyproject.toml) marks what ``python -m pytest -m "not slow"``, the
quick development loop, leaves out; plain ``python -m pytest`` (CI) runs everything.
"""

import os
import sys

import pytest


@pytest.fixture(scope="session")
def toy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of a ``model.safetensors`` holding ``trained_toy()``, saved like ``save_pretrained``
    (the tied head stored once), alone in its directory."""
    from tests.models import save_state, trained_toy

    path = str(tmp_path_factory.mktemp("toy") / "model.safetensors")
    save_state(trained_toy(), path)
    return path


@pytest.fixture(scope="session")
def toy_sharded(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory holding ``trained_toy()`` as two shards and ``model.safetensors.index.json``."""
    from tests.models import save_sharded, toy_state

    directory = tmp_path_factory.mktemp("toy-sharded")
    save_sharded(toy_state(), str(directory))
    return str(directory)


@pytest.fixture
def toy_reference() -> dict:
    """Every parameter and buffer of ``trained_toy()`` (tied names included), a fresh copy per test:
    what a load of ``toy_checkpoint`` or ``toy_sharded`` must give, bit for bit."""
    from tests.models import reference, trained_toy

    return reference(trained_toy())


@pytest.fixture(scope="session")
def hf_modules_cache(tmp_path_factory: pytest.TempPathFactory):
    """A modules cache of the session's own for transformers' remote code (``trust_remote_code=True``)
    in the test process, instead of ``~/.cache/huggingface/modules``: transformers'
    ``dynamic_module_utils.HF_MODULES_CACHE``, which its loader reads at each call. One for the whole
    session: the ``transformers_modules`` package, once imported, looks for its modules where it was
    first found."""
    dynamic = pytest.importorskip("transformers.dynamic_module_utils")
    path = str(tmp_path_factory.mktemp("hf-modules"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dynamic, "HF_MODULES_CACHE", path)
        package = sys.modules.get("transformers_modules")
        if package is not None:  # imported from another cache earlier in this process
            patch.setattr(
                package, "__path__", [os.path.join(path, "transformers_modules"), *package.__path__]
            )
        yield path


# Lines a test module leaves for the end of the session's report (the causal-LM sweep's count and lists):
# ``request.config.stash.setdefault(SUMMARIES, []).append(text)``.
SUMMARIES = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    for text in config.stash.get(SUMMARIES, []):
        terminalreporter.write_sep("=", "summary")
        terminalreporter.write_line(text)
