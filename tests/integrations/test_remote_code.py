"""load_pretrained(..., trust_remote_code=True): a checkpoint's own code, read on rank 0 and installed on
every rank as transformers' dynamic-module loader installs it, on 2 and 3 gloo ranks.

The remote code is tests/remote_code/ split as real remote code is (``configuration_tiny_moe.py``,
``modeling_tiny_moe.py`` importing it relatively; ``hf.remote_code_checkpoint``), with config.json's
``auto_map`` naming both classes. The checkpoints (a folder, the same files as an offline Hub snapshot,
a copy without its modeling file) are hidden from ranks other than 0 (``_dist.run_jobs``, as root), and
each rank's ``HF_MODULES_CACHE`` is an empty folder of its own, so no rank sees another's copy of the
code. Against transformers in the test process:

- ``load_pretrained(AutoModelForCausalLM, ckpt, dtype=bf16, trust_remote_code=True)`` from the folder
  and by repo id from the offline cache: every parameter's ``full_tensor()`` and every buffer bit for
  bit equal to ``AutoModelForCausalLM.from_pretrained(ckpt, dtype=bf16, trust_remote_code=True)``; the
  classes' modules named as ``from_pretrained`` names them (folder and hash, or ``org/name/<commit>``),
  on every rank, written into each rank's own cache; the config and model classes pickle;
- its fp32 router bias, a trainable Parameter beside the bf16 experts, loads replicated (no shard_fn);
- ``save_sharded`` of that model: its code files and ``auto_map``, read back by ``from_pretrained(out,
  trust_remote_code=True)``, equal (the replicated bias: rank 0's copy);
- a model class passed as it is, with the flag: as without it;
- without the flag: a ModelMismatchError naming ``trust_remote_code=True`` on every rank; an unknown
  keyword argument: a LoadError naming load_pretrained and the argument (before any collective: also
  without a process group); a modeling file auto_map names but the checkpoint lacks: a LoadError on
  every rank naming the file.

Run with transformers 5 and 4.57 (CI's two legs): the module names differ between them (5 adds a hash
of the files), and each is checked against its own ``from_pretrained``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests import _dist, hf
from tests.fakes import MAIN, add_snapshot
from tests.models import assert_same, gather, reference

pytestmark = pytest.mark.transformers

BF16 = torch.bfloat16
REPO = "org/tiny-moe"
CODE = ("configuration_tiny_moe.py", "modeling_tiny_moe.py")


@dataclass(frozen=True)
class Job:
    ckpt: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    concrete: bool = False  # tests/remote_code/'s TinyMoeForCausalLM, not AutoModelForCausalLM
    save: str | None = None  # save_sharded(model) here (outside the hidden root)
    hub_reference: bool = False  # rank 0 also runs from_pretrained on the repo id, for its module names
    error: bool = False  # must raise the same LoadError on every rank


# --- every rank -------------------------------------------------------------------------------------


def _own_class(model) -> type:
    """The model's class, not the FSDP... class fully_shard made of it."""
    return next(c for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))


def _run_job(job: Job) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import rank0load
    from tests.remote_code.modeling_tiny_moe import TinyMoeForCausalLM

    model = rank0load.load_pretrained(
        TinyMoeForCausalLM if job.concrete else AutoModelForCausalLM, job.ckpt, **job.kwargs
    )
    own = _own_class(model)
    config = pickle.loads(pickle.dumps(model.config))
    out = {
        "tensors": gather(model),
        "modules": (own.__module__, type(model.config).__module__),
        "files": tuple(
            os.path.realpath(sys.modules[c.__module__].__file__ or "") for c in (own, type(config))
        ),
        "pickles": type(config) is type(model.config) and pickle.loads(pickle.dumps(own)) is own,
        "config": model.config.to_dict(),
        "replicated": model.rank0load_report.replicated,
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
    }
    if job.save:
        rank0load.save_sharded(model, job.save)
    if job.hub_reference and dist.get_rank() == 0:
        ref = AutoModelForCausalLM.from_pretrained(job.ckpt, dtype=BF16, trust_remote_code=True)
        out["reference_modules"] = (type(ref).__module__, type(ref.config).__module__)
    return out


def _rank(rank: int, world: int, root: str, caches: str, jobs: dict[str, Job]) -> dict:
    assert "transformers" not in sys.modules, "transformers imported before HF_MODULES_CACHE was set"
    # spawn hands each rank the test process's sys.path, to which transformers' init_hf_modules added
    # the test process's own modules cache: without this, ``transformers_modules`` would resolve there
    # (the code found only if the test process had loaded it too) instead of in this rank's own cache.
    sys.path[:] = [p for p in sys.path if not os.path.isdir(os.path.join(p, "transformers_modules"))]
    cache = os.path.join(caches, f"rank{rank}")  # empty, this rank's own: read when transformers is imported
    os.environ["HF_MODULES_CACHE"] = cache
    os.environ["HF_HOME"] = os.path.join(root, "hf") if rank == 0 else os.path.join(caches, "nowhere")
    os.environ["HF_HUB_OFFLINE"] = "1"
    hf._quiet()
    out = _dist.run_jobs(rank, root, jobs, _run_job, expects_error=lambda job: job.error)
    out["cache"] = sorted(
        os.path.relpath(os.path.join(d, n), cache) for d, _, names in os.walk(cache) for n in names
    )
    out["own_cache"] = cache
    return out


# --- the test process ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str, str]:
    """(root: every checkpoint, hidden from ranks other than 0; the folder; the copy without its
    modeling file). The Hub cache (``root/hf``) holds the folder's files as ``org/tiny-moe`` at MAIN."""
    pytest.importorskip("transformers")
    root = os.path.realpath(tmp_path_factory.mktemp("remote-code"))
    ckpt, missing = os.path.join(root, "tiny-moe"), os.path.join(root, "missing")
    hf.remote_code_checkpoint(ckpt)
    shutil.copytree(ckpt, missing)
    os.remove(os.path.join(missing, "modeling_tiny_moe.py"))
    files = {}
    for name in sorted(os.listdir(ckpt)):
        with open(os.path.join(ckpt, name), "rb") as f:
            files[name] = f.read()
    add_snapshot(os.path.join(root, "hf", "hub", "models--org--tiny-moe"), MAIN, files, ("main",))
    return root, ckpt, missing


@pytest.fixture(scope="module")
def expected(checkpoints, hf_modules_cache) -> dict:
    """transformers' own loads of the folder, in this process."""
    from transformers import AutoModelForCausalLM

    from tests.remote_code.modeling_tiny_moe import TinyMoeForCausalLM

    _, ckpt, _ = checkpoints
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=BF16, trust_remote_code=True)
    concrete = TinyMoeForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    return {
        "tensors": reference(model),
        "modules": (type(model).__module__, type(model.config).__module__),
        "config": model.config.to_dict(),
        "concrete": reference(concrete),
    }


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def loaded(request, checkpoints, tmp_path_factory) -> tuple[int, str, list[dict]]:
    world = request.param
    root, ckpt, missing = checkpoints
    caches = str(tmp_path_factory.mktemp(f"modules-{world}"))
    out = str(tmp_path_factory.mktemp(f"saved-{world}"))
    trusted = {"dtype": BF16, "trust_remote_code": True}
    jobs = {
        "folder": Job(ckpt, trusted, save=out),
        "hub": Job(REPO, trusted, hub_reference=True),
        "concrete": Job(ckpt, {"dtype": torch.float32, "trust_remote_code": True}, concrete=True),
        "untrusted": Job(ckpt, {"dtype": BF16}, error=True),
        "unknown": Job(ckpt, {**trusted, "code_revision": "main"}, error=True),
        "missing": Job(missing, trusted, error=True),
    }
    results = _dist.ok(_dist.run(_rank, world, root, caches, jobs, timeout=600, fresh=True))
    return world, out, results


def _job(results: list[dict], name: str) -> list[Any]:
    return [r["jobs"][name] for r in results]


@pytest.mark.slow
def test_folder_load_is_from_pretrained_bit_for_bit(loaded, expected):
    _, _, results = loaded
    for got in _dist.ok(_job(results, "folder")):
        assert_same(got["tensors"], expected["tensors"])
        assert got["config"] == expected["config"]


@pytest.mark.slow
def test_the_trainable_router_bias_is_replicated_and_saved_by_rank_0(loaded, expected):
    """The remote code declares its fp32 router bias a trainable Parameter beside the bf16 experts (as
    public MiniMax-M2 ports do): it loads with no shard_fn, kept out of FSDP (replicated), trainable;
    ``save_sharded`` writes rank 0's copy (test_save_sharded_writes_the_code_and_auto_map reads it back)."""
    _, _, results = loaded
    biases = tuple(f"model.layers.{i}.block_sparse_moe.e_score_correction_bias" for i in (0, 1))
    for got in _dist.ok(_job(results, "folder")):
        assert got["replicated"] == biases and set(biases) <= set(got["trainable"]), got["replicated"]
        assert all(got["tensors"][n].dtype == torch.float32 for n in biases)
        assert any(expected["tensors"][n].any() for n in biases)  # random values, so the save is checked


@pytest.mark.slow
def test_every_rank_imports_the_code_under_from_pretrained_module_names(loaded, expected, checkpoints):
    world, _, results = loaded
    _, ckpt, _ = checkpoints
    for rank, r in enumerate(results):
        got = r["jobs"]["folder"]
        assert got["modules"] == expected["modules"], rank
        assert got["pickles"], rank
        for module in got["modules"]:  # written into this rank's own, empty, cache
            assert module.replace(".", os.sep) + ".py" in r["cache"], (rank, r["cache"])
        for file in got["files"]:  # and imported from there
            assert file.startswith(os.path.realpath(r["own_cache"]) + os.sep), (rank, file)
        assert r["touched"] == [], (rank, r["touched"])  # ranks other than 0: nothing under the root
    installed = {p for p in results[1]["cache"] if p.endswith(".py") and not p.endswith("__init__.py")}
    assert {os.path.basename(p) for p in installed} == set(CODE)


@pytest.mark.slow
def test_hub_repo_id_from_the_offline_cache(loaded, expected):
    _, _, results = loaded
    hub = _dist.ok(_job(results, "hub"))
    reference_modules = hub[0]["reference_modules"]  # rank 0's from_pretrained(REPO, trust_remote_code=True)
    assert reference_modules[0].startswith(f"transformers_modules.org.tiny_hyphen_moe.{MAIN}."), (
        reference_modules
    )
    for got in hub:
        assert_same(got["tensors"], expected["tensors"])
        assert got["modules"] == reference_modules and got["pickles"]


@pytest.mark.slow
def test_save_sharded_writes_the_code_and_auto_map(loaded, expected, checkpoints):
    from transformers import AutoModelForCausalLM

    _, out, _ = loaded
    _, ckpt, _ = checkpoints
    for name in CODE:
        with open(os.path.join(out, name), "rb") as a, open(os.path.join(ckpt, name), "rb") as b:
            assert a.read() == b.read(), name
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["auto_map"] == hf.REMOTE_AUTO_MAP
    back = AutoModelForCausalLM.from_pretrained(out, dtype=BF16, trust_remote_code=True)
    assert_same(reference(back), expected["tensors"])


@pytest.mark.slow
def test_a_model_class_loads_as_it_did(loaded, expected):
    _, _, results = loaded
    for got in _dist.ok(_job(results, "concrete")):
        assert_same(got["tensors"], expected["concrete"])
        assert got["modules"] == (
            "tests.remote_code.modeling_tiny_moe",
            "tests.remote_code.configuration_tiny_moe",
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "cls", "patterns"),
    [
        (
            "untrusted",
            "ModelMismatchError",
            [
                r"model_type 'tiny_moe' needs the checkpoint's own code",
                r"load_pretrained runs only with",
                r"Pass trust_remote_code=True",
            ],
        ),
        ("unknown", "LoadError", [r"load_pretrained got an unexpected keyword argument 'code_revision'"]),
        (
            "missing",
            "CheckpointNotFoundError",
            [
                r"auto_map\['AutoModelForCausalLM'\] = 'modeling_tiny_moe\.TinyMoeForCausalLM' needs "
                r"modeling_tiny_moe\.py",
                r"missing",
            ],
        ),
    ],
)
def test_errors_are_the_same_on_every_rank(loaded, name, cls, patterns):
    import re

    _, _, results = loaded
    raised = _dist.same_error(_job(results, name), cls)
    for pattern in patterns:
        assert re.search(pattern, raised.message), (pattern, raised.message)


def test_unknown_keyword_is_refused_before_any_collective():
    """No process group at all: the argument check comes first, on each rank alone."""
    import rank0load

    with pytest.raises(
        rank0load.LoadError, match=r"load_pretrained got an unexpected keyword argument 'code_rev'"
    ):
        rank0load.load_pretrained(object, "nowhere", code_rev="main")
    with pytest.raises(rank0load.LoadError, match=r"trust_remote_code='yes': expected True or False"):
        rank0load.load_pretrained(object, "nowhere", trust_remote_code="yes")
