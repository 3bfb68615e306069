"""Every causal-LM architecture of the installed transformers (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: 4.57's
own on the 4.57 leg) loaded by ``load_pretrained`` as transformers' ``from_pretrained`` loads it.

For each ``model_type``: a tiny config shrunk from its class's defaults (tests/tiny_configs.py), the model
built by transformers with seeded random weights, written by its own ``save_pretrained`` in several files,
then reloaded by ``AutoModelForCausalLM.from_pretrained(dtype=float32)``: the reference. What transformers
itself cannot build, save, or reload to the weights it saved is skipped, with transformers' error as the
reason. Then ONE spawn of 2 gloo ranks, the checkpoints hidden from rank 1, loads every architecture in turn
with ``load_pretrained(AutoModelForCausalLM, ckpt, dtype=torch.float32)``: every parameter's
``full_tensor()`` and every buffer must equal the reference's bit for bit, and the logits of a short input
to float32's tolerance (``torch.testing.assert_close``'s defaults, rtol 1.3e-6, atol 1e-5). Not exactly:
the ranks and this process run the same float32 kernels on one thread each, and all but one architecture
give the same bits, but FSDP's gathered parameters are views into one flat buffer, laid out unlike the
reference's, and a CPU kernel may then block a reduction differently (Zaya: 1.2e-7). The parameters are
already compared bit for bit; the logits catch what the weights alone do not (a buffer, a tie, a config
value), and those differ by far more than rounding. Each architecture is its own test id.

The count the README quotes is printed at the end of the session (``pytest_terminal_summary`` in
tests/conftest.py) and written to ``$RANK0LOAD_SWEEP_SUMMARY`` when that names a file.
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from dataclasses import dataclass, field
from importlib.metadata import version

import pytest
import torch

from tests import _dist
from tests.conftest import SUMMARIES
from tests.models import assert_same, gather, reference

# Slow: about 180 tiny models built, saved and reloaded here, then one spawn of 2 ranks that loads them all.
# Not torch_range: the torch-range legs already run test_pretrained's load_pretrained against transformers.
pytestmark = [pytest.mark.slow, pytest.mark.transformers]

_auto = pytest.importorskip("transformers.models.auto.modeling_auto")
MODEL_TYPES = sorted(_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
TRANSFORMERS = version("transformers")
IDS = torch.tensor([[11, 25, 39, 42, 57, 63], [70, 99, 120, 31, 44, 18]])  # below every tiny vocabulary

# What rank0load refuses, with a piece of the refusal each must show: conversions that move single
# elements rather than ranges of bytes (README, MoE checkpoints). An entry that loads makes its test
# fail: remove the entry then.
REFUSED: dict[str, str] = {
    "ergo": "which needs Transpose",  # feed_forward.gate_kernel into mlp.gate.linear.weight
}


@dataclass
class Prepared:
    """One architecture as transformers itself builds and reloads it (in the test process)."""

    path: str
    skip: str | None = None  # why transformers itself could not: the step and its error
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # the reference's, tied names included
    logits: torch.Tensor | None = None
    no_logits: str | None = None  # why the reference has no logits (its own forward failed)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _prepare(model_type: str, path: str) -> Prepared:
    from transformers import AutoModelForCausalLM

    from tests import tiny_configs

    out = Prepared(path)
    step = "make its tiny config"
    try:
        config = tiny_configs.tiny_config(model_type)
        step = "build it"
        model = tiny_configs.random_model(config)
        step = "save it"
        model.save_pretrained(path, max_shard_size=tiny_configs.SHARD)
        step = "reload it"
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    except Exception as exc:
        out.skip = f"transformers {TRANSFORMERS} cannot {step} tiny: {_first_line(exc)}"
        return out
    saved, out.tensors = reference(model), reference(ref)
    differ = sorted(k for k in saved if k not in out.tensors or not torch.equal(saved[k], out.tensors[k]))
    if differ:
        out.skip = (
            f"transformers {TRANSFORMERS}'s from_pretrained does not give back the {len(differ)} tensors it "
            f"saved ({', '.join(differ[:3])}, ...): no reference"
        )
        return out
    try:
        with torch.no_grad():
            logits = ref(input_ids=IDS).logits
    except Exception as exc:
        out.no_logits = f"transformers' own forward fails: {_first_line(exc)}"
    else:
        if torch.isfinite(logits).all():
            out.logits = logits
        else:
            out.no_logits = "transformers' own logits are not finite"
    return out


def _rank(rank: int, world: int, root: str, jobs: dict[str, str]) -> dict:
    """(each rank) ``load_pretrained`` every checkpoint in ``jobs`` in order, the folder ``root`` hidden from
    ranks other than 0. A job's error is kept and the next job runs when every rank raised the same
    message (rank0load's refusals come before any data moves); otherwise the ranks may be out of step and
    the remaining jobs are not run."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import rank0load
    from tests.fakes import hide

    touched = hide(root) if rank != 0 and os.geteuid() == 0 else []
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    out: dict = {}
    for name, path in jobs.items():
        started = time.monotonic()
        try:
            model = rank0load.load_pretrained(AutoModelForCausalLM, path, dtype=torch.float32)
            got: dict = {"tensors": gather(model)}
            try:
                with torch.no_grad():
                    got["logits"] = model(input_ids=IDS).logits
            except Exception as exc:
                got["logits"] = _dist.Raised(type(exc).__name__, (), str(exc), traceback.format_exc())
            del model
        except Exception as exc:
            bases = tuple(c.__name__ for c in type(exc).__mro__)
            got = {"error": _dist.Raised(type(exc).__name__, bases, str(exc), traceback.format_exc())}
        gc.collect()
        got["seconds"] = time.monotonic() - started
        out[name] = got
        error = got.get("error")
        everyone: list = [None] * world
        dist.all_gather_object(everyone, error.message if error else None)
        if len(set(everyone)) != 1:
            out["stopped"] = (
                f"after {name!r} the ranks disagree ({everyone}): the remaining jobs were not run"
            )
            break
    return {"jobs": out, "touched": list(touched)}


@pytest.fixture(scope="module")
def swept(tmp_path_factory, request):
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    tmp = tmp_path_factory.mktemp("sweep")
    root = os.path.realpath(tmp / "root")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks: the same kernels, the same bits
    started = time.monotonic()
    try:
        prepared = {t: _prepare(t, os.path.join(root, t)) for t in MODEL_TYPES}
    finally:
        torch.set_num_threads(threads)
    prepare_s = time.monotonic() - started
    jobs = {t: p.path for t, p in prepared.items() if p.skip is None}
    started = time.monotonic()
    results = _dist.run(_rank, 2, root, jobs, timeout=3600, pg_timeout=300)
    results = _dist.ok(results)
    spawn_s = time.monotonic() - started
    summary = _summary(prepared, results[0]["jobs"], prepare_s, spawn_s)
    request.config.stash.setdefault(SUMMARIES, []).append(summary)
    if os.environ.get("RANK0LOAD_SWEEP_SUMMARY"):
        with open(os.environ["RANK0LOAD_SWEEP_SUMMARY"], "w") as f:
            f.write(summary + "\n")
    return prepared, results


def _verdict(p: Prepared, got: dict | None) -> str | None:
    """None when the load equals the reference, else the first line of what differs."""
    if got is None:
        return "not run"
    if "error" in got:
        return _first_line_of(got["error"])
    want = dict(p.tensors)
    try:
        assert_same(got["tensors"], want)
    except AssertionError as exc:
        return f"tensors differ: {str(exc).splitlines()[0]}"
    if p.logits is not None:
        if isinstance(got["logits"], _dist.Raised):
            return f"forward fails: {_first_line_of(got['logits'])}"
        try:
            torch.testing.assert_close(got["logits"], p.logits)
        except AssertionError:
            return f"logits differ by {(got['logits'] - p.logits).abs().max().item():.3g}"
    return None


def _rounding(p: Prepared, got: dict | None) -> float:
    """How far the load's logits are from the reference's when they are close but not equal, else 0."""
    if p.logits is None or got is None or not isinstance(got.get("logits"), torch.Tensor):
        return 0.0
    return (got["logits"] - p.logits).abs().max().item()


def _first_line_of(raised: _dist.Raised) -> str:
    text = raised.message.strip()
    return f"{raised.type_name}: {text.splitlines()[0] if text else ''}"


def _summary(prepared: dict[str, Prepared], jobs: dict, prepare_s: float, spawn_s: float) -> str:
    built = [t for t, p in prepared.items() if p.skip is None]
    failed = {t: v for t in built if (v := _verdict(prepared[t], jobs.get(t))) is not None}
    lines = [
        f"{len(built) - len(failed)} of {len(built)} causal-LM architectures of transformers {TRANSFORMERS} "
        f"load bit for bit ({len(prepared)} in its MODEL_FOR_CAUSAL_LM_MAPPING_NAMES; {len(prepared) - len(built)}"
        f" it cannot build and reload tiny itself; references {prepare_s:.0f} s, the 2-rank spawn {spawn_s:.0f} s)",
        "not built tiny by transformers itself:",
        *(f"  {t}: {p.skip}" for t, p in prepared.items() if p.skip),
        "compared without logits (transformers' own forward fails or is not finite):",
        *(f"  {t}: {p.no_logits}" for t, p in prepared.items() if p.skip is None and p.no_logits),
        "logits equal to float32 rounding, not bit for bit:",
        *(
            f"  {t}: {d:.3g}"
            for t in built
            if t not in failed and (d := _rounding(prepared[t], jobs.get(t))) > 0
        ),
        "failures:",
        *(f"  {t}: {v}" for t, v in failed.items()),
    ]
    return "\n".join(lines)


def test_rank1_never_sees_the_checkpoints(swept):
    _, results = swept
    assert results[1]["touched"] == [], results[1]["touched"][:10]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_loads_as_from_pretrained(swept, model_type):
    prepared, results = swept
    p = prepared[model_type]
    if p.skip:
        pytest.skip(p.skip)
    verdicts = [_verdict(p, r["jobs"].get(model_type)) for r in results]
    if model_type not in results[0]["jobs"]:
        pytest.fail(f"not run: {results[0]['jobs'].get('stopped')}")
    known = REFUSED.get(model_type)
    if known is not None:
        if verdicts == [None, None]:
            pytest.fail(f"{model_type} now loads bit for bit: remove it from REFUSED")
        assert all(v is not None and known in v for v in verdicts), verdicts
        pytest.xfail(f"refused, as documented: {verdicts[0]}")
    for rank, verdict in enumerate(verdicts):
        error = results[rank]["jobs"][model_type].get("error")
        assert verdict is None, f"rank {rank}: {verdict}" + (f"\n{error.tb}" if error else "")
