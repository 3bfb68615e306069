"""``python -m benchmarks.bench``: host RAM and time of loading one checkpoint into an FSDP2 model.

Writes (or reuses) a Llama-style bf16 checkpoint with tied embeddings, then, for each round and
each method, launches ``--ranks`` fresh gloo processes on the CPU (``benchmarks.bench.worker``)
that build the sharded model and load the checkpoint; each rank reports its load seconds, RSS
before, peak RSS (``VmHWM``), resident shard bytes and transient = peak - before - resident, and
verifies the result bit-exact. A method's figures are its fastest round whose result verified.

    python -m benchmarks.bench                                   # 0.8 GB, 2 ranks, all methods, 2 rounds
    python -m benchmarks.bench --sweep 0.2,0.8,3.2 --plot --update-readme
    python -m benchmarks.bench --model moe                       # a Qwen3-MoE per-expert checkpoint instead
    python -m benchmarks.bench --save --sweep 0.2,0.8            # the save methods instead of the loads

``--model moe`` writes a Qwen3-MoE checkpoint in the per-expert Hub layout and loads it into
transformers' ``Qwen3MoeForCausalLM`` (fused experts) built with ``AutoModelForCausalLM.from_config``
(see :mod:`benchmarks.bench.moe`); it needs transformers.

``--save`` runs the save methods instead (``save-rank0load``, ``save-full-sd``, ``save-dcp-hf``): each
rank loads the model with rank0load outside the measurement, then the save is measured the same
way (transient = peak - before, the model being resident throughout) and the written files are
verified against the source checkpoint's digests (Llama model only).

``--resume`` measures saving and restoring a training state instead (``resume-rank0load``,
``resume-dcp``, ``resume-full-sd``, and ``resume-build-only`` as the floor; see
:mod:`benchmarks.bench.resume`): each round and method, fresh processes load the model, train an AdamW
a few steps and save model and optimizer state (measured), then other fresh processes restore both
(measured) and check every parameter and optimizer state bit for bit against the saving processes'
record (Llama model only).

This is a script: it prints progress to stdout (the library itself only logs).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from . import minimax, moe
from . import model as llama
from .methods import METHOD_NOTES, METHODS, SAVE_METHOD_NOTES, SAVE_METHODS
from .minimax_methods import MINIMAX_METHOD_NOTES, MINIMAX_METHODS, SINGLE_PROCESS
from .model import BenchConfig, cached_checkpoint
from .resume import RESUME_METHOD_NOTES, RESUME_METHODS

MODELS = ("llama", "moe", "minimax")
Config = BenchConfig | moe.MoeConfig | minimax.MiniMaxConfig
FLOOR_TARGET = 1.15  # rank0load's cold load within 1.15x the floor's
TRANSIENT_TARGET_MIB = 48  # rank0load's transient at most this above build-only's, every rank

__all__ = ["main", "parse_args", "run_size"]

MiB = 1 << 20


def _markers(ranks: int, model: str = "llama", save: bool = False, resume: bool = False) -> tuple[str, str]:
    """The README section each model and rank count rewrites: the 2-rank Llama default, and one per
    other model or count; ``save``: the save methods' own ("save", "save-4ranks", ...); ``resume``:
    the training-state methods' ("resume", "resume-4ranks")."""
    name = ("resume" if resume else "save" if save else "results") + ("" if model == "llama" else f"-{model}")
    name += "" if ranks == 2 else f"-{ranks}ranks"
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def config_for(model: str, size_gb: float, shape: tuple[int, int] | None = None) -> Config:
    """The checkpoint shape of ``model`` ("llama" or "moe") for ``size_gb``; "minimax" has one shape
    whatever the size: MiniMax-M2's tensor count, or ``shape`` = (layers, experts)."""
    if model == "minimax":
        if shape is None:
            return minimax.MiniMaxConfig()
        return minimax.MiniMaxConfig(layers=shape[0], experts=shape[1])
    if model == "moe":
        return moe.config_for_size(size_gb)
    if model == "llama":
        return llama.config_for_size(size_gb)
    raise ValueError(f"unknown model {model!r}; choose from {MODELS}")


# ------------------------------------------------------------------------------------------ running


def ensure_checkpoint(cfg: Config, out: str) -> tuple[str, dict]:
    """The checkpoint directory for ``cfg`` under ``out``, written unless a complete one is there."""
    directory = os.path.join(out, f"ckpt-{cfg.tag}")
    meta = cached_checkpoint(cfg, directory)
    if meta is not None:
        print(
            f"checkpoint: reusing {directory} ({meta['total_bytes'] / 1e9:.3f} GB, {len(meta['files'])} shards)"
        )
        return directory, meta
    print(f"checkpoint: writing {directory} ({cfg.tag})", flush=True)
    started = time.perf_counter()
    log = lambda s: print(s, flush=True)  # noqa: E731
    if isinstance(cfg, minimax.MiniMaxConfig):
        meta = minimax.write_checkpoint(cfg, directory, log=log)
    elif isinstance(cfg, moe.MoeConfig):
        meta = moe.write_checkpoint(cfg, directory, log=log)
    else:
        meta = llama.write_checkpoint(cfg, directory, log=log)
    print(
        f"checkpoint: {meta['total_bytes'] / 1e9:.3f} GB in {len(meta['files'])} shards, "
        f"{time.perf_counter() - started:.1f} s"
    )
    return directory, meta


def model_name(cfg: Config) -> str:
    """The ``--model`` name of ``cfg``'s model."""
    if isinstance(cfg, minimax.MiniMaxConfig):
        return "minimax"
    return "moe" if isinstance(cfg, moe.MoeConfig) else "llama"


def methods_for(model: str, save: bool = False, resume: bool = False) -> dict[str, str]:
    """The methods ``--methods`` may name for ``model`` (or the save or resume methods), with their notes."""
    if resume:
        return RESUME_METHOD_NOTES
    if save:
        return SAVE_METHOD_NOTES
    return MINIMAX_METHOD_NOTES if model == "minimax" else METHOD_NOTES


def warm_page_cache(directory: str, meta: dict) -> None:
    """Read every shard once so that no method pays for cold reads the others do not."""
    for name in meta["files"]:
        with open(os.path.join(directory, name), "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


def run_once(
    method: str,
    cfg: Config,
    ckpt: str,
    ranks: int,
    timeout: float,
    warm_up: bool = True,
    options: dict | None = None,
    launch: Callable[[int], tuple[list[str], dict[str, str]]] | None = None,
    warm: bool = True,
    fields: dict | None = None,
) -> list[dict]:
    """Launch ``ranks`` fresh worker processes for one method; one result dict per rank.
    ``launch(rank)``: a command prefix and environment for that rank (``bench.nodes``: its node's
    network namespace). ``warm``: each process measures a second, warm call after the cold one.
    ``warm_up``: the save methods' tiny save before the clock (the loads have none: they are cold).
    ``fields``: more fields for every rank's spec (``--resume``: the phase and the state's folder)."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    # The workers run this driver's rank0load: without this, "python -m" puts the working directory
    # first on sys.path, and a run started inside another checkout (comparing two trees) would time
    # that checkout's code under this one's name (Python 3.11+; 3.10 ignores the variable).
    env["PYTHONSAFEPATH"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="rank0load-bench-") as tmp:
        store = os.path.join(tmp, "store")
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(ranks)]
        procs = []
        for r in range(ranks):
            spec = {
                "method": method,
                "rank": r,
                "world": ranks,
                "store": store,
                "ckpt": ckpt,
                "model": model_name(cfg),
                "config": cfg.__dict__,
                "out": outs[r],
                "timeout": timeout,
                "warm_up": warm_up,
                "warm": warm,
                "options": options or {},
                **(fields or {}),
            }
            if method in SAVE_METHODS:  # removed by the worker, and with tmp in any case
                spec["save_dir"] = os.path.join(tmp, "saved")
            # Output to files, not pipes: a chatty rank must never block on a full pipe.
            prefix, extra = launch(r) if launch is not None else ([], {})
            with open(os.path.join(tmp, f"rank{r}.log"), "w") as log:
                procs.append(
                    subprocess.Popen(
                        [*prefix, sys.executable, "-m", "benchmarks.bench.worker", json.dumps(spec)],
                        env={**env, **extra},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        deadline = time.monotonic() + timeout + 30
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:  # only the processes this function started
                    if q.poll() is None:
                        q.kill()
                        q.wait()
        results = []
        for r, path in enumerate(outs):
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
            else:
                with open(os.path.join(tmp, f"rank{r}.log"), errors="replace") as log:
                    tail = log.read()[-2000:]
                results.append(
                    {
                        "method": method,
                        "rank": r,
                        "error": f"rank {r} left no result "
                        f"(exit code {procs[r].returncode}; timed out or killed?)\n{tail}",
                    }
                )
        return results


_RESUME_KEYS = (
    "save_seconds",
    "save_cpu_seconds",
    "save_rss_before",
    "save_peak_rss",
    "save_transient",
    "restore_seconds",
    "restore_cpu_seconds",
)


def run_resume(
    method: str, cfg: Config, ckpt: str, ranks: int, timeout: float, warm_up: bool, options: dict | None
) -> list[dict]:
    """(``--resume``) One round of one method: ``ranks`` fresh processes train and save (unless the
    method has no save), then ``ranks`` other fresh processes restore and verify; one result per rank:
    the restore's figures, ``seconds`` = save + restore, the save's under ``save_*``."""
    with tempfile.TemporaryDirectory(prefix="rank0load-bench-resume-") as tmp:
        state_dir = os.path.join(tmp, "state")
        expected = os.path.join(tmp, "expected.json")
        saved: list[dict] | None = None
        if RESUME_METHODS[method][0] is not None:
            phase = {"phase": "save", "state_dir": state_dir, "expected": expected}
            saved = run_once(method, cfg, ckpt, ranks, timeout, warm_up, options, warm=False, fields=phase)
            failed = next((r for r in saved if "error" in r), None)
            if failed is not None:
                return [{**r, "error": f"save: {r['error']}"} if "error" in r else r for r in saved]
        phase = {"phase": "restore", "state_dir": state_dir, "expected": expected if saved else ""}
        restored = run_once(method, cfg, ckpt, ranks, timeout, warm_up, options, warm=False, fields=phase)
    out = []
    for r, rs in enumerate(restored):
        if "error" in rs:
            out.append({**rs, "error": f"restore: {rs['error']}"})
            continue
        merged = {**rs, "restore_seconds": rs["seconds"], "restore_cpu_seconds": rs["cpu_seconds"]}
        if saved is not None:
            sv = saved[r]
            merged.update(
                seconds=sv["seconds"] + rs["seconds"],
                cpu_seconds=sv["cpu_seconds"] + rs["cpu_seconds"],
                save_seconds=sv["seconds"],
                save_cpu_seconds=sv["cpu_seconds"],
                save_rss_before=sv["rss_before"],
                save_peak_rss=sv["peak_rss"],
                save_transient=sv["transient"],
                save_peak_reset=sv["peak_reset"],
                written_bytes=sv.get("written_bytes"),
                save_stream_seconds=sv.get("stream_seconds"),
                save_split=sv.get("split"),
            )
        out.append(merged)
    return out


def _fmt_mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.0f}"


def _round_ok(results: list[dict]) -> bool:
    return all(
        "error" not in r and r.get("verified") is not False and r.get("warm", {}).get("verified") is not False
        for r in results
    )


def _problems(r: dict) -> list[str]:
    return [*r.get("problems", []), *(f"warm load: {p}" for p in r.get("warm", {}).get("problems", []))]


def _round_line(results: list[dict]) -> str:
    errors = [r for r in results if "error" in r]
    if errors:
        return "ERROR " + errors[0]["error"].splitlines()[0]
    secs = max(r["seconds"] for r in results)
    parts = [f"cold {secs:.2f} s"]
    if "restore_seconds" in results[0]:  # --resume
        save = [r["save_seconds"] for r in results if r.get("save_seconds") is not None]
        parts = [
            f"save {max(save):.2f} s" if save else "no save",
            f"restore {max(r['restore_seconds'] for r in results):.2f} s",
        ]
        if save:
            parts.append(
                "save transient "
                + " / ".join(f"r{r['rank']} {_fmt_mib(r['save_transient'])}" for r in results)
            )
    if all("warm" in r for r in results):
        parts.append(f"warm {max(r['warm']['seconds'] for r in results):.2f} s")
    if results[0].get("stream_gbps"):
        parts.append(f"stream {results[0]['stream_gbps']:.2f} GB/s")
    if results[0].get("local_readers") is not None:  # rank0load: ranks that read their own bytes
        parts.append(f"local readers {results[0]['local_readers']}/{len(results) - 1}")
    parts.append(
        "transient " + " / ".join(f"r{r['rank']} {_fmt_mib(r['transient'])}" for r in results) + " MiB"
    )
    verified = results[0].get("verified")
    if verified is not None and results[0].get("warm", {}).get("verified") is False:
        verified = False
    parts.append(
        "verify n/a"
        if verified is None
        else ("verified" if verified else f"VERIFY FAILED: {_problems(results[0])[:3]}")
    )
    return ", ".join(parts)


def summarise(method: str, rounds: list[list[dict]], total_bytes: int) -> dict:
    """A method's best (fastest verified) round, with per-rank and node totals."""
    good = [rs for rs in rounds if _round_ok(rs)]
    out: dict = {"method": method, "rounds": len(rounds), "rounds_ok": len(good)}
    if not good:
        first_bad = next((r for rs in rounds for r in rs if "error" in r or r.get("verified") is False), {})
        out["ok"] = False
        out["failure"] = first_bad.get("error") or "; ".join(_problems(first_bad))
        return out
    best = min(good, key=lambda rs: max(r["seconds"] for r in rs))
    seconds = max(r["seconds"] for r in best)
    warm = [r["warm"] for r in best] if all("warm" in r for r in best) else None
    out.update(
        ok=True,
        seconds=seconds,
        all_round_seconds=[max(r["seconds"] for r in rs) if _round_ok(rs) else None for rs in rounds],
        load_gbps=total_bytes / 1e9 / seconds if method != "build-only" else None,
        stream_gbps=best[0].get("stream_gbps"),
        stream_seconds=best[0].get("stream_seconds"),
        local_readers=best[0].get("local_readers"),
        phases=[r.get("phases") for r in best] if best[0].get("phases") else None,
        warm_seconds=max(w["seconds"] for w in warm) if warm else None,
        warm_phases=[w.get("phases") for w in warm] if warm and warm[0].get("phases") else None,
        warm_max_transient=max(w["transient"] for w in warm) if warm else None,
        warm_node_transient=sum(w["transient"] for w in warm) if warm else None,
        processes=len(best),
        # None: the model has no tie (MoE)
        tie_kept=None if best[0].get("tie_kept") is None else all(r.get("tie_kept") for r in best),
        verified=best[0].get("verified"),
        tensors_checked=best[0].get("tensors_checked"),
        written_bytes=best[0].get("written_bytes"),  # save methods
        written_files=best[0].get("written_files"),
        per_rank=[
            {
                **{
                    k: r.get(k)
                    for k in (
                        "rank",
                        "seconds",
                        "cpu_seconds",
                        "rss_before",
                        "peak_rss",
                        "resident",
                        "transient",
                    )
                },
                **{
                    f"warm_{k}": r.get("warm", {}).get(k)
                    for k in ("seconds", "cpu_seconds", "rss_before", "peak_rss", "resident", "transient")
                },
                **{k: r[k] for k in _RESUME_KEYS if k in r},  # --resume
            }
            for r in best
        ],
        node_cpu_seconds=sum(r.get("cpu_seconds") or 0.0 for r in best),
        max_transient=max(r["transient"] for r in best),
        node_transient=sum(r["transient"] for r in best),
        node_peak=sum(r["peak_rss"] for r in best),
    )
    return out


def run_size(
    size_gb: float,
    *,
    ranks: int,
    methods: Sequence[str],
    rounds: int,
    out: str,
    timeout: float,
    warm_up: bool = True,
    options: dict | None = None,
    model: str = "llama",
    warm: bool = True,
    shape: tuple[int, int] | None = None,
) -> dict:
    """Every method x round at one checkpoint size; returns the JSON-able results. A method in
    ``SINGLE_PROCESS`` (MiniMax's ``transformers``) runs in one process whatever ``ranks``."""
    cfg = config_for(model, size_gb, shape)
    ckpt, meta = ensure_checkpoint(cfg, out)
    print("warming the page cache ...", flush=True)
    warm_page_cache(ckpt, meta)
    raw: dict[str, list[list[dict]]] = {m: [] for m in methods}
    for rnd in range(rounds):
        order = list(methods) if rnd % 2 == 0 else list(reversed(methods))  # alternate, no fixed order bias
        for method in order:
            label = cfg.tag if model == "minimax" else f"{model} {size_gb:g} GB"
            print(f"[{label}, round {rnd + 1}/{rounds}] {method:<16} ...", end=" ", flush=True)
            procs = 1 if model == "minimax" and method in SINGLE_PROCESS else ranks
            if method in RESUME_METHODS:
                results = run_resume(method, cfg, ckpt, procs, timeout, warm_up, options)
            else:
                results = run_once(method, cfg, ckpt, procs, timeout, warm_up, options, warm=warm)
            raw[method].append(results)
            print(_round_line(results), flush=True)
            for r in results:
                if "traceback" in r:
                    print(f"  rank {r['rank']}: {r['traceback']}", file=sys.stderr)
    summary = [summarise(m, raw[m], meta["total_bytes"]) for m in methods]
    return {
        "model": model,
        "save": all(m in SAVE_METHODS for m in methods),
        "resume": all(m in RESUME_METHODS for m in methods),
        "size_gb_requested": size_gb,
        "checkpoint": {
            "dir": ckpt,
            "bytes": meta["total_bytes"],
            "shards": len(meta["files"]),
            "tensors": meta.get("checkpoint_tensors", len(meta["digests"])),
            "config": meta["config"],
        },
        "ranks": ranks,
        "rounds": rounds,
        "warm_up": warm_up,
        "warm": warm,
        "options": options or {},
        "summary": summary,
        "raw": raw,
    }


# ------------------------------------------------------------------------------------------ reporting


def environment() -> dict:
    import safetensors
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": round(mem / (1 << 30), 1) if mem else None,
        "loadavg_1min_at_end": round(load, 2) if load is not None else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "platform": platform.platform(),
    }


def save_results_table(res: dict) -> str:
    """Markdown for ``--save``: one summary row per save method, then one row per method and rank."""
    gb = res["checkpoint"]["bytes"] / 1e9
    lines = [
        (
            f"Model loaded from a {gb:.3g} GB checkpoint ({res['checkpoint']['tensors']} tensors, bf16, tied "
            f"head) with rank0load outside the measurement, then saved; {res['ranks']} gloo ranks on CPU, "
            f"best of {res['rounds']} rounds"
            f"{'' if res.get('warm_up', True) else ', lazy imports inside the measurement (--no-warm-up)'}. "
            "Transient = peak RSS - RSS before (the model's shards are resident before and after)."
        ),
        "",
        (
            "| method | save s | node CPU s | GB/s (written / save s) | files | max transient MiB | "
            "node transient MiB | node peak MiB | verified |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in res["summary"]:
        if not s.get("ok"):
            lines.append(f"| {s['method']} | failed: {str(s.get('failure', ''))[:80]} | | | | | | | |")
            continue
        verified = "yes" if s["verified"] else "NO"
        if s["rounds_ok"] < s["rounds"]:
            verified += f" ({s['rounds_ok']}/{s['rounds']} rounds ok)"
        written = s.get("written_bytes") or 0
        lines.append(
            f"| {s['method']} | {s['seconds']:.2f} | {s.get('node_cpu_seconds', 0.0):.2f} | "
            f"{written / 1e9 / s['seconds']:.2f} | {len(s.get('written_files') or [])} | "
            f"{_fmt_mib(s['max_transient'])} | {_fmt_mib(s['node_transient'])} | {_fmt_mib(s['node_peak'])} | "
            f"{verified} |"
        )
    lines += [
        "",
        "| method | rank | save s | CPU s | RSS before MiB | peak RSS MiB | model shards MiB | transient MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in res["summary"]:
        for r in s.get("per_rank", []):
            lines.append(
                f"| {s['method']} | {r['rank']} | {r['seconds']:.2f} | {r.get('cpu_seconds') or 0.0:.2f} | "
                f"{_fmt_mib(r['rss_before'])} | "
                f"{_fmt_mib(r['peak_rss'])} | {_fmt_mib(r['resident'])} | {_fmt_mib(r['transient'])} |"
            )
    return "\n".join(lines)


RESUME_TIME_TARGET = 1.25  # rank0load's save + restore within 1.25x DCP's
RESUME_TRANSIENT_TARGET_MIB = 64  # and its transient within 64 MiB of build-only's, every rank


def resume_results_table(res: dict) -> str:
    """Markdown for ``--resume``: one summary row per method, the targets, then one row per method and
    rank."""
    gb = res["checkpoint"]["bytes"] / 1e9
    by = {s["method"]: s for s in res["summary"] if s.get("ok")}
    dcp, r0, built = by.get("resume-dcp"), by.get("resume-rank0load"), by.get("resume-build-only")
    lines = [
        (
            f"The {gb:.3g} GB bf16 model (tied head) loaded with rank0load, an AdamW over every parameter "
            f"(bf16 moments: the state is 2x the weights) stepped twice on a dummy loss, all unmeasured; "
            f"then model + optimizer state saved, and restored in fresh processes; {res['ranks']} gloo ranks "
            f"on CPU, best of {res['rounds']} rounds by save + restore s. Save transient = peak RSS - RSS "
            "before (model and state resident throughout); restore transient = peak - before - resident "
            "(model shards + optimizer state). Every restore verified bit for bit (every parameter, every "
            "optimizer state, param groups, the training state)."
        ),
        "",
        "| method | save s | restore s | save + restore s | x resume-dcp | written GB | save max transient MiB | "
        "restore max transient MiB | restore node peak MiB | verified |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in res["summary"]:
        if not s.get("ok"):
            lines.append(f"| {s['method']} | failed: {str(s.get('failure', ''))[:80]} | | | | | | | | |")
            continue
        ranks = s["per_rank"]
        save = [r.get("save_seconds") for r in ranks]
        has_save = None not in save
        ratio = "-" if dcp is None or not has_save else f"{s['seconds'] / dcp['seconds']:.2f}x"
        written = s.get("written_bytes")
        lines.append(
            f"| {s['method']} | {_secs(max(save) if has_save else None)} | "
            f"{max(r['restore_seconds'] for r in ranks):.2f} | {s['seconds']:.2f} | {ratio} | "
            f"{'-' if not written else f'{written / 1e9:.2f}'} | "
            f"{_fmt_mib(max(r['save_transient'] for r in ranks) if has_save else None)} | "
            f"{_fmt_mib(s['max_transient'])} | {_fmt_mib(s['node_peak'])} | {_verified(s)} |"
        )
    if r0 is not None and dcp is not None:
        met = r0["seconds"] <= RESUME_TIME_TARGET * dcp["seconds"]
        lines += [
            "",
            f"Time target: resume-rank0load's save + restore <= {RESUME_TIME_TARGET}x resume-dcp's "
            f"({RESUME_TIME_TARGET * dcp['seconds']:.2f} s): {'met' if met else 'not met'}, "
            f"{r0['seconds'] / dcp['seconds']:.2f}x.",
        ]
        lines += [text for line in _paired(r0, dcp, "resume-dcp's") for text in ("", line)]
    if r0 is not None and built is not None:
        cells = []
        ok = True
        for mine, floor in zip(r0["per_rank"], built["per_rank"], strict=True):
            over = mine["transient"] - floor["transient"]
            ok &= (
                over <= RESUME_TRANSIENT_TARGET_MIB * MiB
                and mine["save_transient"] <= RESUME_TRANSIENT_TARGET_MIB * MiB
            )
            cells.append(
                f"rank {mine['rank']}: restore {_fmt_mib(over)} MiB over build-only's, save {_fmt_mib(mine['save_transient'])} MiB"
            )
        lines += [
            "",
            f"Transient target: resume-rank0load within {RESUME_TRANSIENT_TARGET_MIB} MiB of build-only on every "
            f"rank: {'met' if ok else 'not met'} ({'; '.join(cells)}).",
        ]
    lines += [
        "",
        "| method | rank | save s | restore s | save CPU s | restore CPU s | save transient MiB | "
        "restore RSS before MiB | restore peak RSS MiB | model + optimizer MiB | restore transient MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in res["summary"]:
        for r in s.get("per_rank", []):
            lines.append(
                f"| {s['method']} | {r['rank']} | {_secs(r.get('save_seconds'))} | {r['restore_seconds']:.2f} | "
                f"{_secs(r.get('save_cpu_seconds'))} | {r['restore_cpu_seconds']:.2f} | "
                f"{_fmt_mib(r.get('save_transient'))} | {_fmt_mib(r['rss_before'])} | "
                f"{_fmt_mib(r['peak_rss'])} | {_fmt_mib(r['resident'])} | {_fmt_mib(r['transient'])} |"
            )
    for s in res["summary"]:
        if not s.get("ok"):
            continue
        best = min(
            (rs for rs in res["raw"][s["method"]] if _round_ok(rs)),
            key=lambda rs: max(r["seconds"] for r in rs),
        )
        rank0 = next(r for r in best if r["rank"] == 0)
        for which, key in (
            ("save", "save_split"),
            ("restore", "split"),
            ("restore's load_sharded", "load_phases"),
        ):
            if rank0.get(key):
                text = ", ".join(f"{k} {v:.2f}" for k, v in rank0[key].items())
                lines += ["", f"{s['method']} {which} on rank 0, its best round (wall s): {text}"]
    return "\n".join(lines)


def _measured(res: dict) -> str:
    """How the table's loads were measured, for its heading."""
    if not res.get("warm", True):
        return "cold: each method's first call in a fresh process (--cold-only: no warm figure)"
    return (
        "cold: each method's first call in a fresh process; warm: a second identical call in the same "
        "process, after the first model was freed"
    )


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _per_rank_rows(res: dict) -> list[str]:
    lines = [
        "",
        "| method | rank | cold load s | warm load s | CPU s | RSS before MiB | peak RSS MiB | resident MiB | "
        "transient MiB | warm transient MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in res["summary"]:
        for r in s.get("per_rank", []):
            lines.append(
                f"| {s['method']} | {r['rank']} | {r['seconds']:.2f} | {_secs(r.get('warm_seconds'))} | "
                f"{r.get('cpu_seconds') or 0.0:.2f} | {_fmt_mib(r['rss_before'])} | {_fmt_mib(r['peak_rss'])} | "
                f"{_fmt_mib(r['resident'])} | {_fmt_mib(r['transient'])} | {_fmt_mib(r.get('warm_transient'))} |"
            )
    return lines


def _phase_lines(res: dict) -> list[str]:
    lines = []
    for s in res["summary"]:
        for which, key in (("cold", "phases"), ("warm", "warm_phases")):
            for rank, phases in enumerate(s.get(key) or []):
                if phases:
                    text = ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
                    lines += [
                        "",
                        f"{s['method']} phases on rank {rank}, {which} (seconds, its own report): {text}",
                    ]
    return lines


def results_table(res: dict) -> str:
    """Markdown: one summary row per method, then one row per method and rank."""
    if res.get("resume"):
        return resume_results_table(res)
    if res.get("save"):
        return save_results_table(res)
    if res.get("model") == "minimax":
        return minimax_table(res)
    gb = res["checkpoint"]["bytes"] / 1e9
    if res.get("model", "llama") == "moe":
        c = res["checkpoint"]["config"]
        kind = (
            f"bf16, Qwen3-MoE: {c['layers']} layers of {c['experts']} experts stored one tensor per expert, "
            f"loaded into transformers' fused experts; hidden {c['hidden']}, expert width "
            f"{c['moe_intermediate']}, head not tied"
        )
    else:
        kind = "bf16, tied head"
    lines = [
        (
            f"Checkpoint {gb:.3g} GB ({res['checkpoint']['shards']} shards, {res['checkpoint']['tensors']} tensors, "
            f"{kind}), {res['ranks']} gloo ranks on CPU, best of {res['rounds']} rounds (by cold load s); "
            f"{_measured(res)}"
            f"{''.join(f', {m} options {o}' for m, o in res.get('options', {}).items())}."
        ),
        "",
        (
            "| method | cold load s | warm load s | node CPU s | GB/s (ckpt / cold s) | stream GB/s | "
            "max transient MiB | warm max transient MiB | node transient MiB | node peak MiB | tie kept | verified |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for s in res["summary"]:
        if not s.get("ok"):
            lines.append(f"| {s['method']} | failed: {str(s.get('failure', ''))[:80]} | | | | | | | | | | |")
            continue
        load_gbps = "-" if s["load_gbps"] is None else f"{s['load_gbps']:.2f}"
        stream = "-" if not s["stream_gbps"] else f"{s['stream_gbps']:.2f}"
        tie = "n/a" if s["tie_kept"] is None else ("yes" if s["tie_kept"] else "no")
        lines.append(
            f"| {s['method']} | {s['seconds']:.2f} | {_secs(s.get('warm_seconds'))} | "
            f"{s.get('node_cpu_seconds', 0.0):.2f} | {load_gbps} | {stream} | {_fmt_mib(s['max_transient'])} | "
            f"{_fmt_mib(s.get('warm_max_transient'))} | {_fmt_mib(s['node_transient'])} | "
            f"{_fmt_mib(s['node_peak'])} | {tie} | {_verified(s)} |"
        )
    lines += _per_rank_rows(res)
    for s in res["summary"]:
        if s.get("local_readers") is not None:
            lines += [
                "",
                f"{s['method']}: {s['local_readers']} of the {res['ranks'] - 1} other ranks read their own "
                "bytes through rank 0's descriptors (node-local reads).",
            ]
    return "\n".join(lines + _dense_round_lines(res) + _phase_lines(res))


def _verified(s: dict) -> str:
    verified = "n/a" if s["verified"] is None else ("yes" if s["verified"] else "NO")
    if s["rounds_ok"] < s["rounds"]:
        verified += f" ({s['rounds_ok']}/{s['rounds']} rounds ok)"
    return verified


def minimax_table(res: dict) -> str:
    """``--model minimax``: the methods against ``floor`` (cold and warm), the target line, per rank,
    rank0load's phases."""
    c = res["checkpoint"]["config"]
    gb = res["checkpoint"]["bytes"] / 1e9
    by = {s["method"]: s for s in res["summary"] if s.get("ok")}
    fl = by.get("floor")

    def ratio(s: dict, key: str) -> str:
        if fl is None or s.get(key) is None or not fl.get(key):
            return "-"
        return f"{s[key] / fl[key]:.2f}x"

    lines = [
        (
            f"MiniMax-M2-shaped FP8 checkpoint {gb:.3g} GB ({res['checkpoint']['shards']} files, "
            f"{res['checkpoint']['tensors']} tensors: {c['layers']} layers x {c['experts']} experts, hidden "
            f"{c['hidden']}, expert width {c['intermediate']}, float8_e4m3fn in {c['block']}x{c['block']} "
            f"blocks, dequantised to bf16), {res['ranks']} gloo ranks on CPU (`transformers`: one process), "
            f"best of {res['rounds']} rounds (by cold load s); {_measured(res)}."
        ),
        "",
        "| method | processes | cold load s | warm load s | cold x floor | warm x floor | node CPU s | "
        "max transient MiB | warm max transient MiB | node peak MiB | verified |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in res["summary"]:
        if not s.get("ok"):
            lines.append(f"| {s['method']} | failed: {str(s.get('failure', ''))[:80]} | | | | | | | | | |")
            continue
        lines.append(
            f"| {s['method']} | {s.get('processes', res['ranks'])} | {s['seconds']:.2f} | "
            f"{_secs(s.get('warm_seconds'))} | {ratio(s, 'seconds')} | {ratio(s, 'warm_seconds')} | "
            f"{s.get('node_cpu_seconds', 0.0):.2f} | {_fmt_mib(s['max_transient'])} | "
            f"{_fmt_mib(s.get('warm_max_transient'))} | {_fmt_mib(s['node_peak'])} | {_verified(s)} |"
        )
    if fl is not None:
        line = (
            f"Target: rank0load's cold load <= {FLOOR_TARGET}x floor's ({FLOOR_TARGET * fl['seconds']:.2f} s)"
        )
        r0 = by.get("rank0load")
        if r0 is not None:
            met = r0["seconds"] <= FLOOR_TARGET * fl["seconds"]
            line += f": {'met' if met else 'not met'}, {r0['seconds'] / fl['seconds']:.2f}x"
        lines += ["", line + "."] + _round_lines(res, by)
    lines += _per_rank_rows(res)
    return "\n".join(lines + _phase_lines(res))


def _paired(a: dict, b: dict, whose: str) -> list[str]:
    """Method ``a``'s cold load round by round over ``b``'s (``whose``: "the floor's"), and the
    medians: one line, or none without a round both completed."""
    pairs = [(x, y) for x, y in zip(a["all_round_seconds"], b["all_round_seconds"]) if x is not None and y]
    if not pairs:
        return []
    ratios = [x / y for x, y in pairs]
    mine, theirs = statistics.median(x for x, _ in pairs), statistics.median(y for _, y in pairs)
    return [
        f"Round by round ({a['method']}'s round i over {whose} round i): {min(ratios):.2f}-{max(ratios):.2f}x; "
        f"medians {mine:.2f} s against {theirs:.2f} s ({mine / theirs:.2f}x)."
    ]


def _dense_round_lines(res: dict) -> list[str]:
    """(llama, moe) rank0load's and ``dcp-hf``'s cold loads round by round against ``dcp-hf``'s and
    the floor's, where they ran: the best rounds the table shows move between runs on a shared
    2-core machine by as much as the methods differ."""
    by = {s["method"]: s for s in res["summary"] if s.get("ok")}
    out: list[str] = []
    for a, b in (("rank0load", "dcp-hf"), ("rank0load", "floor"), ("dcp-hf", "floor")):
        if a in by and b in by:
            out += _paired(by[a], by[b], f"{b}'s")
    return [text for line in out for text in ("", line)]


def _round_lines(res: dict, by: dict[str, dict]) -> list[str]:
    """(minimax) The targets round by round, not only for the best rounds the tables show: the
    runs on a shared 2-core machine vary between rounds by as much as the methods differ."""
    r0, fl, built = by.get("rank0load"), by.get("floor"), by.get("build-only")
    out: list[str] = []
    if r0 is None:
        return out
    if fl is not None:
        out += _paired(r0, fl, "the floor's")
    if built is not None:
        limit = built["max_transient"] + TRANSIENT_TARGET_MIB * MiB
        worst = [max(r["transient"] for r in rs) for rs in res["raw"]["rank0load"] if _round_ok(rs)]
        if worst:
            within = sum(w <= limit for w in worst)
            out.append(
                f"Transient target: rank0load's worst rank <= build-only's + {TRANSIENT_TARGET_MIB} MiB "
                f"({_fmt_mib(limit)} MiB): met in {within} of {len(worst)} rounds "
                f"({', '.join(_fmt_mib(w) for w in worst)} MiB)."
            )
    return [text for line in out for text in ("", line)]  # each its own paragraph


def sweep_table(results: list[dict]) -> str:
    methods = [s["method"] for s in results[0]["summary"]]
    verb = "save" if results[0].get("save") else "load"
    head = "| checkpoint GB | " + " | ".join(f"{m} max transient MiB / {verb} s" for m in methods) + " |"
    lines = [head, "|---:|" + "---:|" * len(methods)]
    for res in results:
        cells = []
        for s in res["summary"]:
            cells.append(f"{_fmt_mib(s['max_transient'])} / {s['seconds']:.2f}" if s.get("ok") else "failed")
        lines.append(f"| {res['checkpoint']['bytes'] / 1e9:.3g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> bool:
    """Transient RAM (worst rank, and node total) per method against checkpoint size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: matplotlib is not installed (pip install -e '.[bench]'); skipped", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    methods = [s["method"] for s in results[0]["summary"]]
    # Distinct markers and dashes: some methods share their worst rank's figure exactly.
    styles = itertools.cycle(
        {"marker": m, "linestyle": ls} for m, ls in zip("osD^v", ("-", "--", "-.", ":", "-"), strict=True)
    )
    for method in methods:
        xs, worst, node = [], [], []
        for res in sorted(results, key=lambda r: r["checkpoint"]["bytes"]):
            s = next(s for s in res["summary"] if s["method"] == method)
            if s.get("ok"):
                xs.append(res["checkpoint"]["bytes"] / 1e9)
                worst.append(s["max_transient"] / MiB)
                node.append(s["node_transient"] / MiB)
        style = next(styles)
        axes[0].plot(xs, worst, label=method, **style)
        axes[1].plot(xs, node, label=method, **style)
    for ax, title in zip(axes, ("worst rank", f"node total ({results[0]['ranks']} ranks)")):
        ax.axhline(64, color="grey", linestyle=":", linewidth=1, label="64 MiB target (per rank)")
        if ax.get_ylim()[1] > 1024:  # GB-scale methods next to MiB-scale ones: keep both readable
            ax.set_yscale("symlog", linthresh=8, linscale=0.5)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("checkpoint size (GB)")
        ax.set_ylabel("transient host RAM (MiB)")
        ax.set_title(f"transient RAM, {title}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def readme_section(
    main_res: dict, sweep: list[dict] | None, env: dict, argv: Sequence[str], plot_name: str | None
) -> str:
    cmd = "python -m benchmarks.bench" + ("" if not argv else " " + " ".join(argv))
    model = main_res.get("model", "llama")
    save = bool(main_res.get("save"))
    resume = bool(main_res.get("resume"))
    parts = [
        _markers(main_res["ranks"], model, save, resume)[0],
        f"_Generated by `{cmd}` on {env['date']}._",
        "",
        (
            f"Machine: {env['cpu']}, {env['cores']} cores, {env['mem_gib']} GiB RAM "
            f"(1-min load average at the end: {env['loadavg_1min_at_end']}"
            f"{'' if env.get('loadavg_1min_at_start') is None else ', at the start: ' + str(env['loadavg_1min_at_start'])}"
            f"); {env['platform']}.  "
        ),
        f"Versions: Python {env['python']}, torch {env['torch']}, safetensors {env['safetensors']}.",
        "",
        results_table(main_res),
    ]
    if sweep and len(sweep) > 1:
        parts += ["", "### Sweep: transient RAM as the checkpoint grows", "", sweep_table(sweep)]
        if plot_name:
            parts += ["", f"![transient RAM per method]({plot_name})"]
    parts.append(_markers(main_res["ranks"], model, save, resume)[1])
    return "\n".join(parts)


def update_readme(
    path: str, section: str, ranks: int = 2, model: str = "llama", save: bool = False, resume: bool = False
) -> None:
    start, end = _markers(ranks, model, save, resume)
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    if start in text and end in text:
        head, rest = text.split(start, 1)
        tail = rest.split(end, 1)[1]
        text = head + section + tail
    else:
        title = {"llama": "## Results", "moe": "## MoE checkpoint"}.get(
            model, "## MiniMax-M2 shape: FP8, the real tensor count"
        )
        if save:
            title = "## Save" if model == "llama" else f"## Save ({model})"
        if resume:
            title = "## Save and restore a training state (model + AdamW)"
        if ranks != 2:
            title += f" on {ranks} ranks"
        text = text.rstrip() + f"\n\n{title}\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(text)


# ------------------------------------------------------------------------------------------ CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        choices=MODELS,
        default="llama",
        help="llama: the Llama-style checkpoint (default); moe: a Qwen3-MoE checkpoint with one tensor "
        "per expert, loaded into transformers' fused experts (needs transformers); minimax: a MiniMax-M2-"
        "shaped FP8 checkpoint at the real tensor count (62 layers x 256 experts, ~96,100 tensors, "
        "small widths; --size-gb does not apply), methods build-only, rank0load, floor, transformers",
    )
    p.add_argument("--size-gb", type=float, default=0.8, help="checkpoint size in GB (default 0.8)")
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks on the CPU (default 2)")
    p.add_argument(
        "--save",
        action="store_true",
        help="run the save methods (each loads the model with rank0load first, unmeasured) instead of "
        "the load methods; Llama model only",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="run the training-state methods instead: train an AdamW a few steps, save model and "
        "optimizer state, restore both in fresh processes and verify them bit for bit; Llama model only",
    )
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated subset of {','.join(METHODS)}; with --model minimax of "
        f"{','.join(MINIMAX_METHODS)}; with --save of {','.join(SAVE_METHODS)}; with --resume of "
        f"{','.join(RESUME_METHODS)} (default all)",
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds; methods alternate within each (default 2)")
    p.add_argument(
        "--out", default="bench-out", help="output dir: checkpoints (cached) and JSON (default ./bench-out)"
    )
    p.add_argument(
        "--sweep", default=None, help="comma-separated sizes in GB to run as well, e.g. 0.2,0.8,3.2"
    )
    p.add_argument("--plot", action="store_true", help="write transient-RAM-vs-size PNG (needs matplotlib)")
    p.add_argument(
        "--update-readme",
        nargs="?",
        const=os.path.join("benchmarks", "README.md"),
        default=None,
        metavar="PATH",
        help="rewrite the results section of benchmarks/README.md (or PATH)",
    )
    p.add_argument(
        "--minimax-shape",
        default=None,
        metavar="LAYERSxEXPERTS",
        help="--model minimax: layers x experts per layer (default 62x256, MiniMax-M2's), e.g. 2x4 for a smoke run",
    )
    p.add_argument(
        "--cold-only",
        dest="warm",
        action="store_false",
        help="measure each load once, cold (the first call in a fresh process), without the warm "
        "second call in the same process",
    )
    p.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="--save only: no tiny save before the clock (the save's lazy imports then count in its "
        "time and transient RAM). Loads are always measured cold first; accepted and ignored for them",
    )
    p.add_argument(
        "--staging-mib",
        type=float,
        default=None,
        help="rank0load's max_staging_bytes in MiB (default: the library's default)",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds before one run's ranks count as hung")
    args = p.parse_args(argv)
    known = methods_for(args.model, args.save, args.resume)
    if args.resume and (args.save or args.model != "llama"):
        p.error("--resume runs on the Llama model only, without --save")
    if args.save and args.model != "llama":
        p.error("--save runs on the Llama model only (rank0load saves MoE experts under their fused names)")
    if args.model == "minimax" and args.sweep:
        p.error("--model minimax has one shape (MiniMax-M2's tensor count): no --sweep")
    if args.minimax_shape is not None:
        if args.model != "minimax":
            p.error("--minimax-shape needs --model minimax")
        try:
            layers, experts = (int(v) for v in args.minimax_shape.lower().split("x"))
        except ValueError:
            p.error(f"--minimax-shape {args.minimax_shape!r}: expected LAYERSxEXPERTS, e.g. 62x256")
        if layers < 1 or experts < 1:
            p.error("--minimax-shape: at least one layer and one expert")
        args.minimax_shape = (layers, experts)
    args.methods = [m.strip() for m in (args.methods or ",".join(known)).split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in known]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {list(known)}")
    if args.ranks < 1 or args.rounds < 1:
        p.error("--ranks and --rounds must be at least 1")
    args.options = {}
    if args.staging_mib is not None:
        args.options["rank0load"] = {"max_staging_bytes": int(args.staging_mib * MiB)}
    args.sizes = (
        sorted({args.size_gb, *(float(s) for s in args.sweep.split(",") if s.strip())})
        if args.sweep
        else [args.size_gb]
    )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    load_at_start = env["loadavg_1min_at_end"]  # the 1-min load average now, before any run
    print(
        f"rank0load bench: {'save, ' if args.save else 'resume, ' if args.resume else ''}{args.model} model, sizes {args.sizes} GB, {args.ranks} ranks, {args.rounds} rounds, "
        f"methods {', '.join(args.methods)}; torch {env['torch']}, {env['cores']} cores; output {args.out}",
        flush=True,
    )
    all_results = []
    for size in args.sizes:
        res = run_size(
            size,
            ranks=args.ranks,
            methods=args.methods,
            rounds=args.rounds,
            out=args.out,
            timeout=args.timeout,
            warm_up=args.warm_up,
            options=args.options,
            model=args.model,
            warm=args.warm,
            shape=args.minimax_shape,
        )
        all_results.append(res)
        prefix = ("save" if args.save else "resume" if args.resume else "results") + (
            "" if args.model == "llama" else f"-{args.model}"
        )
        with open(os.path.join(args.out, f"{prefix}-{size:g}gb-{args.ranks}ranks.json"), "w") as f:
            json.dump({"environment": environment(), **res}, f, indent=1)
        print()
        print(results_table(res))
        print()
    env = environment()
    env["loadavg_1min_at_start"] = load_at_start
    main_res = next(r for r in all_results if r["size_gb_requested"] == args.size_gb)
    doc = {
        "environment": env,
        "argv": argv,
        "model": args.model,
        "sizes": args.sizes,
        "save": args.save,
        "resume": args.resume,
        "methods": {m: methods_for(args.model, args.save, args.resume)[m] for m in args.methods},
        "results": all_results,
    }
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    base = "bench-save" if args.save else "bench-resume" if args.resume else "bench"
    for name in (f"{base}-{stamp}.json", f"{base}.json"):  # a dated record, and the latest under a fixed name
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(doc, f, indent=1)
    print(f"wrote {os.path.join(args.out, base + '.json')} (and {base}-{stamp}.json)")
    if len(all_results) > 1:
        print(sweep_table(all_results))
    plot_path = None
    plot_file = "transient_ram" + ("_save" if args.save else "_resume" if args.resume else "")
    plot_file += ".png" if args.model == "llama" else f"_{args.model}.png"
    if args.plot:
        plot_path = os.path.join(args.out, plot_file)
        if plot(all_results, plot_path):
            print(f"wrote {plot_path}")
        else:
            plot_path = None
    if args.update_readme:
        plot_name = None
        if plot_path:  # keep the picture next to the README so the link works
            import shutil

            plot_name = plot_file
            shutil.copyfile(plot_path, os.path.join(os.path.dirname(args.update_readme) or ".", plot_name))
        update_readme(
            args.update_readme,
            readme_section(main_res, all_results, env, argv, plot_name),
            args.ranks,
            args.model,
            args.save,
            args.resume,
        )
        print(f"updated {args.update_readme}")
    failed = [s["method"] for r in all_results for s in r["summary"] if not s.get("ok")]
    if failed:
        print(f"FAILED (error or verification): {sorted(set(failed))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
