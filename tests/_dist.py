"""Run a function on N gloo ranks on the CPU, each in its own process, with a hard timeout.

``run(fn, world, *args)`` returns one result per rank: whatever ``fn(rank, world, *args)``
returned, or a :class:`Raised` describing the exception it raised. A rank that hangs or dies
fails the test (after ``timeout`` seconds) instead of hanging the suite. ``backend="nccl"`` (or
``"cpu:gloo,cuda:nccl"``) puts each rank on its own GPU, ``cuda:rank``, first (tests/api/test_cuda.py).
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

# What a launcher's log shows when torch 2.13 on the CPU aborts in interpreter shutdown after every
# rank's work is done (shared/DESIGN.md): the one failure the torchrun-launched tests forgive, and
# only once every rank has reported its work.
EXIT_ABORT = re.compile(r"SIGABRT|exitcode\s*:\s*-6|terminate called")


def exit_without_teardown(code: int) -> None:
    """End this rank's process as interpreter shutdown would, less its last step: wait for the threads
    that are not daemons and run the atexit handlers, then leave without tearing down every module.
    That teardown only frees memory, costs about a second of CPU per process once torch is imported,
    and on torch 2.13 on the CPU sometimes aborts or hangs after the ranks are done. (The benchmark's
    workers end the same way, with their own copy: the tests do not import the benchmark's
    internals.)"""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class Raised:
    type_name: str
    bases: tuple[str, ...]
    message: str
    tb: str


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    store: str,
    out: str,
    args: tuple,
    pg_timeout: float,
    env: dict,
    exit_at_once: bool,
    backend: str = "gloo",
) -> None:
    os.environ.update(env)
    # SIGUSR1 writes every thread's Python stack: what spawn shows of a rank that hangs
    stacks = open(out + ".stack", "w")  # open until the process ends
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    import torch
    import torch.distributed as dist

    import rank0load.checkpoint._manifest

    # Every file its own run (rank0load's runs hold 4096 tensors, more than most tests' whole
    # checkpoints): the suite's multi-file checkpoints test the merge of runs (tests/checkpoint/test_runs.py).
    rank0load.checkpoint._manifest.RUN_TENSORS = int(env.get("RANK0LOAD_TEST_RUN_TENSORS", "1"))

    torch.set_num_threads(1)
    result: Any
    try:
        if "nccl" in backend:  # NCCL takes the current device: one GPU per rank
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            store=dist.FileStore(store, world),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            result = fn(rank, world, *args)
        finally:
            if not exit_at_once:
                dist.destroy_process_group()
    except BaseException as exc:
        result = Raised(
            type(exc).__name__, tuple(c.__name__ for c in type(exc).__mro__), str(exc), traceback.format_exc()
        )
    with open(out, "wb") as f:
        pickle.dump(result, f)
    if exit_at_once:  # tearing down a group whose peer died only costs time
        os._exit(0)
    exit_without_teardown(0)  # the result is written: skip module teardown (~1 s of CPU a rank)


# What most ranks import anyway (tests/_preload.py), imported once: the ranks fork from a server
# that holds it (multiprocessing's forkserver) instead of each starting a fresh interpreter (on CI's
# 2 cores ``import torch`` costs ~4 s of CPU a rank, transformers' modeling ~5 more).
PRELOAD = ["tests._preload"]
_server: Any = None


def _context(fresh: bool) -> Any:
    """The forkserver context (once: ``PRELOAD`` imported in its server), or with ``fresh`` a spawn
    one: a rank that sets an environment variable some library reads at import (``HF_HOME``,
    ``HF_HUB_OFFLINE``, ``HF_MODULES_CACHE``) must import it itself."""
    global _server
    if fresh or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    if _server is None:
        _server = mp.get_context("forkserver")
        _server.set_forkserver_preload(PRELOAD)
    return _server


def spawn(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120,
    pg_timeout: float = 60,
    env: dict | None = None,
    exit_at_once: bool = False,
    backend: str = "gloo",
    fresh: bool = False,
) -> tuple[list[Any], list[int | None], float]:
    """Run ``fn`` on ``world`` ranks; a rank may die. Returns (result or None per rank, exit codes,
    seconds until the last rank ended). A rank still running after ``timeout`` fails the test.
    ``backend``: the process group's, as ``init_process_group`` takes it ("gloo", "nccl",
    "cpu:gloo,cuda:nccl"); with NCCL in it, rank r first sets ``cuda:r`` as its device."""
    ctx = _context(fresh)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world)]
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, r, world, store, outs[r], args, pg_timeout, env or {}, exit_at_once, backend),
                daemon=True,
            )
            for r in range(world)
        ]
        started = time.monotonic()
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(0.0, started + timeout - time.monotonic()))
        elapsed = time.monotonic() - started
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        stacks = _stacks(procs, hung, outs) if hung else ""
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            pytest.fail(f"ranks {hung} of {world} still running after {timeout} s: a hang\n\n{stacks}")
        results = []
        for path in outs:
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            else:
                results.append(None)
        return results, [p.exitcode for p in procs], elapsed


def _stacks(procs: list[Any], hung: list[int], outs: list[str]) -> str:
    """Where each of the ``hung`` ranks is: every thread's Python stack (SIGUSR1, see ``_entry``), and
    whether ``fn`` had returned (its result written)."""
    for r in hung:
        os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(2)  # faulthandler writes from its C signal handler: a rank blocked in C shows its caller
    report = []
    for r in hung:
        where = "after fn returned" if os.path.exists(outs[r]) else "inside fn"
        with open(outs[r] + ".stack") as f:
            report.append(f"rank {r}, {where}:\n{f.read() or '(nothing written)'}")
    return "\n".join(report)


def run(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120,
    pg_timeout: float = 60,
    env: dict | None = None,
    backend: str = "gloo",
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn`` on ``world`` ranks; every rank must end and leave a result (or a Raised).
    ``backend``: as for :func:`spawn`."""
    results, codes, _ = spawn(
        fn, world, *args, timeout=timeout, pg_timeout=pg_timeout, env=env, backend=backend, fresh=fresh
    )
    for r, res in enumerate(results):
        if res is None:
            pytest.fail(f"rank {r} died with exit code {codes[r]} and left no result")
    return results


def run_jobs(
    rank: int,
    root: str,
    jobs: dict[str, Any],
    run_job: Callable[[Any], Any],
    expects_error: Callable[[Any], bool] = lambda job: False,
) -> dict:
    """(each rank) ``run_job(job)`` for each job in order, the checkpoints under ``root`` hidden from
    ranks other than 0 (``fakes.hide``, as root). A job that raises becomes a :class:`Raised` and,
    unless ``expects_error(job)`` (an error every rank raises alike), ends the list: a failed job may
    leave the ranks out of step. Returns the jobs' results by name and the paths a hidden rank touched."""
    from tests.fakes import hide

    touched = hide(root) if rank != 0 and os.geteuid() == 0 else []
    out: dict[str, Any] = {}
    for name, job in jobs.items():
        try:
            out[name] = run_job(job)
        except Exception as exc:
            bases = tuple(c.__name__ for c in type(exc).__mro__)
            out[name] = Raised(type(exc).__name__, bases, str(exc), traceback.format_exc())
            if not expects_error(job):
                break
    return {"jobs": out, "touched": list(touched)}


def ok(results: list[Any]) -> list[Any]:
    """Fail the test with the first rank's traceback if any rank raised."""
    raised = [(r, res) for r, res in enumerate(results) if isinstance(res, Raised)]
    if raised:
        # A rank's own failure usually makes its peers see "connection closed": show every rank.
        report = "\n\n".join(f"rank {r} raised {res.type_name}: {res.message}\n{res.tb}" for r, res in raised)
        pytest.fail(report, pytrace=False)
    return results


def same_error(results: list[Any], cls_name: str = "LoadError") -> Raised:
    """Every rank raised the same ``cls_name`` (or subclass) with the same message; return it."""
    for r, res in enumerate(results):
        if not isinstance(res, Raised):
            pytest.fail(f"rank {r} did not raise; it returned {res!r}")
        if cls_name not in res.bases:
            pytest.fail(f"rank {r} raised {res.type_name}, not a {cls_name}: {res.message}\n{res.tb}")
    messages = {res.message for res in results}
    assert len(messages) == 1, f"ranks raised different messages: {messages}"
    return results[0]
