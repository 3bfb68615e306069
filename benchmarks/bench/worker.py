"""One rank of one benchmark run: ``python -m benchmarks.bench.worker '<json spec>'``.

(every rank, a fresh process per method and round) Import what any method may import (torch,
safetensors, DCP, rank0load; transformers and the model's module for the MoE and MiniMax models),
join a gloo group through a FileStore, then measure the method's **first call in this process**
(cold: its own lazy imports and one-time initialisation inside the clock, no warm-up before it):
read ``VmRSS`` ("before"), reset the peak (``/proc/self/clear_refs`` <- 5 resets ``VmHWM``), run the
method between barriers (timed), read ``VmHWM`` ("peak"), count the rank's resident shard bytes,
then — after the measurement, so it cannot inflate the peak — verify the loaded model bit-exact
against the SHA-256 digests recorded when the checkpoint was written. Then (unless the spec says
``"warm": false``) free that model, return the freed heap to the kernel (``malloc_trim``), and
measure and verify a second identical call in the same process the same way: the warm figure,
under ``"warm"`` in the result. The result (or the error) goes to the JSON file named in the spec.
With ``RANK0LOAD_BENCH_PROFILE=<dir>`` the cold call runs under cProfile (slower: for where the time
goes, not for timings), its stats written to ``<dir>/<method>-rank<r>.prof``.

A save method (``--save``) loads the model with rank0load first, outside the measurement, pays its
lazy imports on a tiny save (unless ``"warm_up": false``), then measures the save the same way
(transient = peak - before) and verifies the written files against the same digests.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import resource
import sys
import time
import traceback

from benchmarks.bench._exit import exit_without_teardown


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, every thread included (gloo's too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _link_bytes() -> tuple[int, int] | None:
    """(tx, rx) bytes so far of this rank's gloo interface (``GLOO_SOCKET_IFNAME``: the veth of a
    ``bench.nodes`` node), or None without one."""
    dev = os.environ.get("GLOO_SOCKET_IFNAME")
    if not dev:
        return None
    try:
        counts = []
        for way in ("tx", "rx"):
            with open(f"/sys/class/net/{dev}/statistics/{way}_bytes") as f:
                counts.append(int(f.read()))
    except (OSError, ValueError):
        return None
    return counts[0], counts[1]


def _resident_bytes(model) -> int:
    """Bytes of this rank's local parameter shards and buffers (each storage counted once)."""
    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}
    tensors = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    tensors += list(model.buffers())
    for t in tensors:
        s = t.untyped_storage()
        if t.device.type != "meta":
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _expected_buffers(cfg) -> dict:
    """The non-persistent buffers every rank must hold, computed the way the model's constructor does."""
    from . import minimax
    from .model import BenchConfig, expected_inv_freq
    from .moe import MoeConfig, expected_buffers

    if isinstance(cfg, MoeConfig):
        return expected_buffers(cfg)
    if isinstance(cfg, minimax.MiniMaxConfig):
        return minimax.expected_buffers(cfg)
    assert isinstance(cfg, BenchConfig)
    return {"model.rotary_emb.inv_freq": expected_inv_freq(cfg)}


def _verify(model, cfg, ckpt: str) -> dict:
    """(all ranks, collective) Every parameter's full_tensor() against the recorded digests (on rank 0),
    the rotary buffers against their formula (on every rank), nothing left on meta."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from .model import META_FILE, tensor_digest

    rank = dist.get_rank()
    problems: list[str] = []
    digests: dict[str, str] = {}
    tied: dict[str, str] = {}
    meta: dict = {}
    if rank == 0:
        with open(os.path.join(ckpt, META_FILE)) as f:
            meta = json.load(f)
        digests, tied = meta["digests"], meta["tied"]
    checked: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        local = p.to_local() if isinstance(p, DTensor) else p
        if local.is_meta:
            problems.append(f"{name}: left on meta")
            continue
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if rank == 0:
            key = tied.get(name, name)
            if key not in digests:
                problems.append(f"{name}: not in the checkpoint")
            elif full.dtype != torch.bfloat16:
                problems.append(f"{name}: dtype {full.dtype}, checkpoint bfloat16")
            elif tensor_digest(full) != digests[key]:
                problems.append(f"{name}: values differ from checkpoint key {key!r}")
            checked.add(key)
        del full
    if rank == 0:
        never = sorted(set(digests) - checked)
        problems += [f"{k}: in the checkpoint, no parameter holds it" for k in never]
    # Persistent buffers (MiniMax's e_score_correction_bias): every rank's against rank 0's digests.
    nonpersistent = {
        f"{mn}.{b}" if mn else b for mn, m in model.named_modules() for b in m._non_persistent_buffers_set
    }
    mine = {n: tensor_digest(b) for n, b in model.named_buffers() if n not in nonpersistent and not b.is_meta}
    every_buffers: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_buffers, mine)
    if rank == 0:
        for name, digest in sorted(meta.get("buffer_digests", {}).items()):
            bad = [r for r, theirs in enumerate(every_buffers) if theirs.get(name) != digest]
            if bad:
                problems.append(f"buffer {name}: values differ from the checkpoint on ranks {bad}")
            checked.add(name)
    for name, expected in _expected_buffers(cfg).items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        buf = getattr(module, leaf)
        if buf.is_meta or buf.dtype != torch.float32 or not torch.equal(buf, expected):
            problems.append(f"rank {rank}: {name} is wrong ({buf.dtype}, meta={buf.is_meta})")
        if leaf not in module._non_persistent_buffers_set:
            problems.append(f"rank {rank}: {name} became persistent")
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    every = [p for rank_problems in gathered for p in rank_problems]
    return {
        "verified": not every,
        "tensors_checked": len(checked) if rank == 0 else None,
        "problems": every[:10],
        "problem_count": len(every),
    }


def _verify_saved(out_dir: str, ckpt: str) -> dict:
    """(all ranks, collective) Rank 0 reads every top-level ``*.safetensors`` in ``out_dir`` (one
    tensor at a time) and compares each tensor's SHA-256 with the digest recorded when the source
    checkpoint was written; the key sets must match too (the tied head saved once). Every rank gets
    rank 0's verdict."""
    import torch
    import torch.distributed as dist
    from safetensors import safe_open

    from .model import META_FILE, tensor_digest

    verdict: list = [None]
    if dist.get_rank() == 0:
        with open(os.path.join(ckpt, META_FILE)) as f:
            digests = json.load(f)["digests"]
        problems: list[str] = []
        seen: set[str] = set()
        written = 0
        files = sorted(n for n in os.listdir(out_dir) if n.endswith(".safetensors"))
        if not files:
            problems.append(f"no .safetensors file in {out_dir}")
        for name in files:
            path = os.path.join(out_dir, name)
            written += os.path.getsize(path)
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    if key in seen:
                        problems.append(f"{key}: saved twice")
                    elif key not in digests:
                        problems.append(f"{key}: not in the source checkpoint")
                    elif t.dtype != torch.bfloat16:
                        problems.append(f"{key}: dtype {t.dtype}, source bfloat16")
                    elif tensor_digest(t) != digests[key]:
                        problems.append(f"{key}: values differ from the source checkpoint")
                    seen.add(key)
                    del t
        problems += [f"{k}: in the source checkpoint, not saved" for k in sorted(set(digests) - seen)]
        verdict[0] = {
            "verified": not problems,
            "tensors_checked": len(seen),
            "problems": problems[:10],
            "problem_count": len(problems),
            "written_bytes": written,
            "written_files": files,
        }
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def _remove(path: str) -> None:
    """(all ranks, collective) Rank 0 removes ``path`` once every rank is done with it."""
    import shutil

    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def _malloc_trim() -> None:
    """glibc's ``malloc_trim(0)``: return freed heap pages to the kernel (a no-op elsewhere)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _run_save(spec: dict, mesh, cfg, save) -> dict:
    """One save method: load the model (rank0load, outside the measurement), pay the method's lazy
    imports on a tiny model saved to a throwaway directory (unless told not to), then measure the
    save like a load (transient = peak - before: the model is resident before and after), and verify
    the files written after the measurement."""
    import torch.distributed as dist

    import rank0load

    from .methods import build_sharded, model_fn
    from .model import BenchConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    options = spec.get("options", {})
    out_dir = spec["save_dir"]
    model = rank0load.load_sharded(model_fn(cfg), spec["ckpt"], mesh)
    if spec.get("warm_up", True):
        tiny = BenchConfig(hidden=64, layers=2, vocab=128, heads=4, kv_heads=2, intermediate=96)
        save(build_sharded(tiny, mesh), out_dir + "-warm-up", options)
        _remove(out_dir + "-warm-up")
    dist.barrier()
    gc.collect()
    _malloc_trim()  # hand back the heap the unmeasured load freed, so no save reuses it unseen
    before = _status("VmRSS")
    reset_ok = _reset_peak()
    dist.barrier()
    started = time.perf_counter()
    cpu_started = _cpu_seconds()
    info = save(model, out_dir, options)
    dist.barrier()
    seconds = time.perf_counter() - started
    cpu = _cpu_seconds() - cpu_started
    peak = _status("VmHWM")
    anon_after, file_after = _status("RssAnon"), _status("RssFile")
    result = {
        "method": spec["method"],
        "rank": rank,
        "world": world,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "rss_before": before,
        "peak_rss": peak,
        "resident": _resident_bytes(model),  # already resident before the save: not subtracted
        "transient": peak - before,
        "rss_anon_after": anon_after,
        "rss_file_after": file_after,
        "peak_reset": reset_ok,
        "warm_up": spec.get("warm_up", True),
        **info,
    }
    result.update(_verify_saved(out_dir, spec["ckpt"]))
    _remove(out_dir)
    return result


def _resume_save(spec: dict, mesh, cfg, save) -> dict:
    """(``--resume``, the saving half) Load the model with rank0load, build the AdamW and train it
    (``resume.train``), pay the save's lazy imports on a tiny trained model (unless told not to), all
    outside the measurement; then measure the save as ``_run_save`` does (transient = peak - before:
    model and optimizer state resident throughout). After the measurement rank 0 writes what a restore
    must give back (``resume.expected_digests``) to ``spec["expected"]``."""
    import torch.distributed as dist

    import rank0load

    from . import resume
    from .methods import build_sharded, model_fn
    from .model import BenchConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    options = spec.get("options", {})
    out_dir = spec["state_dir"]
    training_state = {"step": resume.STEPS}
    model = rank0load.load_sharded(model_fn(cfg), spec["ckpt"], mesh)
    optimizer = resume.make_optimizer(model)
    resume.train(model, optimizer, cfg)
    if spec.get("warm_up", True):
        tiny_cfg = BenchConfig(hidden=64, layers=2, vocab=128, heads=4, kv_heads=2, intermediate=96)
        tiny = build_sharded(tiny_cfg, mesh)
        tiny_optimizer = resume.make_optimizer(tiny)
        resume.train(tiny, tiny_optimizer, tiny_cfg, steps=1)
        save(tiny, tiny_optimizer, out_dir + "-warm-up", training_state, options)
        _remove(out_dir + "-warm-up")
        del tiny, tiny_optimizer
    dist.barrier()
    gc.collect()
    _malloc_trim()
    before = _status("VmRSS")
    reset_ok = _reset_peak()
    dist.barrier()
    started = time.perf_counter()
    cpu_started = _cpu_seconds()
    info = save(model, optimizer, out_dir, training_state, options)
    dist.barrier()
    seconds = time.perf_counter() - started
    cpu = _cpu_seconds() - cpu_started
    peak = _status("VmHWM")
    expected = resume.expected_digests(model, optimizer, training_state)
    if rank == 0:
        with open(spec["expected"], "w") as f:
            json.dump(expected, f)
    written = 0
    if rank == 0:
        for root, _, names in os.walk(out_dir):
            written += sum(os.path.getsize(os.path.join(root, n)) for n in names)
    return {
        "method": spec["method"],
        "rank": rank,
        "world": world,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "rss_before": before,
        "peak_rss": peak,
        "resident": _resident_bytes(model) + resume.state_bytes(optimizer),
        "transient": peak - before,
        "peak_reset": reset_ok,
        "warm_up": spec.get("warm_up", True),
        "written_bytes": written if rank == 0 else None,
        **info,
    }


def _resume_restore(spec: dict, mesh, cfg, restore) -> dict:
    """(``--resume``, the restoring half, a fresh process) Measure the restore cold, as ``_measure``
    measures a load (transient = peak - before - resident, resident = the model's shards and the
    optimizer's state); then check it against the saving process's record (``resume.verify``)."""
    import torch.distributed as dist

    from . import resume

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    gc.collect()
    _malloc_trim()
    before = _status("VmRSS")
    reset_ok = _reset_peak()
    dist.barrier()
    started = time.perf_counter()
    cpu_started = _cpu_seconds()
    model, optimizer, training_state, info = restore(cfg, spec["state_dir"], mesh, spec.get("options", {}))
    dist.barrier()
    seconds = time.perf_counter() - started
    cpu = _cpu_seconds() - cpu_started
    peak = _status("VmHWM")
    resident = _resident_bytes(model) + resume.state_bytes(optimizer)
    result = {
        "method": spec["method"],
        "rank": rank,
        "world": world,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "rss_before": before,
        "peak_rss": peak,
        "resident": resident,
        "transient": peak - before - resident,
        "peak_reset": reset_ok,
        **info,
    }
    if not spec.get("expected"):  # build-only: nothing was saved
        result.update(verified=None, problems=[], problem_count=0, tensors_checked=0)
        return result
    expected = None
    if rank == 0:
        with open(spec["expected"]) as f:
            expected = json.load(f)
    result.update(resume.verify(model, optimizer, training_state, expected))
    return result


def config_from_spec(spec: dict):
    """The spec's model config: a BenchConfig (``"model": "llama"``, the default) or a MoeConfig."""
    from .minimax import MiniMaxConfig
    from .model import BenchConfig
    from .moe import MoeConfig

    kinds = {"llama": BenchConfig, "moe": MoeConfig, "minimax": MiniMaxConfig}
    return kinds[spec.get("model", "llama")](**spec["config"])


def _measure(spec: dict, method, cfg, mesh) -> tuple:
    """(all ranks) One call of the load method between barriers: the model and its figures."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    gc.collect()
    _malloc_trim()  # hand back what an earlier load freed, so no load reuses it unseen
    before = _status("VmRSS")
    reset_ok = _reset_peak()
    dist.barrier()
    started = time.perf_counter()
    cpu_started = _cpu_seconds()
    link = _link_bytes()
    model, info = method(cfg, spec["ckpt"], mesh, spec.get("options", {}))
    dist.barrier()
    seconds = time.perf_counter() - started
    cpu = _cpu_seconds() - cpu_started
    link_after = _link_bytes()
    if link is not None and link_after is not None:  # this node's interface, during the load only
        info = {**info, "link_tx_bytes": link_after[0] - link[0], "link_rx_bytes": link_after[1] - link[1]}
    peak = _status("VmHWM")
    # Not the peak's split (Linux keeps none), but a hint: file-backed pages (a mmap'd checkpoint)
    # count in RSS like anonymous memory, although the kernel can drop them.
    anon_after, file_after = _status("RssAnon"), _status("RssFile")
    resident = _resident_bytes(model)
    figures = {
        "method": spec["method"],
        "rank": rank,
        "world": world,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "rss_before": before,
        "peak_rss": peak,
        "resident": resident,
        "transient": peak - before - resident,
        "rss_anon_after": anon_after,
        "rss_file_after": file_after,
        "peak_reset": reset_ok,
        **info,
    }
    return model, figures


def _check(spec: dict, model, cfg, info: dict) -> dict:
    """(all ranks, collective) The verification figures of one load (none for build-only)."""
    if spec["method"] == "build-only":
        return {"verified": None, "problems": [], "problem_count": 0, "tensors_checked": 0}
    out = _verify(model, cfg, spec["ckpt"])
    if spec["method"].startswith("rank0load") and info.get("tie_kept") is False:
        out["verified"] = False
        out["problems"] = [*out["problems"], "rank0load broke the lm_head / embed_tokens tie"]
    return out


def main(spec: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    # Import what any method may import, so "before" is the same baseline for every method.
    import safetensors.torch  # noqa: F401
    import torch.distributed as dist
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import rank0load  # noqa: F401

    from .methods import METHODS, SAVE_METHODS
    from .minimax_methods import MINIMAX_METHODS
    from .resume import RESUME_METHODS

    model_kind = spec.get("model", "llama")
    if model_kind in ("moe", "minimax"):
        # transformers, the model's module and what rank0load uses of it (its conversion mapping)
        import transformers.conversion_mapping
        import transformers.core_model_loading  # noqa: F401
        from transformers import AutoModelForCausalLM  # noqa: F401
        from transformers.models.minimax_m2 import modeling_minimax_m2  # noqa: F401
        from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401

    rank, world = spec["rank"], spec["world"]
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(spec["store"], world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=spec["timeout"]),
    )
    try:
        mesh = init_device_mesh("cpu", (world,))
        cfg = config_from_spec(spec)
        if spec["method"] in SAVE_METHODS:
            return _run_save(spec, mesh, cfg, SAVE_METHODS[spec["method"]])
        if spec["method"] in RESUME_METHODS:
            save, restore = RESUME_METHODS[spec["method"]]
            if spec["phase"] == "save":
                assert save is not None
                return _resume_save(spec, mesh, cfg, save)
            return _resume_restore(spec, mesh, cfg, restore)
        method = (MINIMAX_METHODS if model_kind == "minimax" else METHODS)[spec["method"]]
        profile_dir = os.environ.get("RANK0LOAD_BENCH_PROFILE")  # cProfile of the cold call, per rank
        if profile_dir:
            import cProfile

            profiler = cProfile.Profile()
            model, result = profiler.runcall(_measure, spec, method, cfg, mesh)
            profiler.dump_stats(os.path.join(profile_dir, f"{spec['method']}-rank{spec['rank']}.prof"))
        else:
            model, result = _measure(spec, method, cfg, mesh)  # cold: the first call in this process
        result.update(_check(spec, model, cfg, result))
        if spec.get("warm", True):  # the same call again, in the same process
            del model
            model, warm = _measure(spec, method, cfg, mesh)
            warm.update(_check(spec, model, cfg, warm))
            result["warm"] = {k: v for k, v in warm.items() if k not in ("method", "rank", "world")}
        return result
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    try:
        out = main(spec)
    except BaseException as exc:
        out = {
            "method": spec.get("method"),
            "rank": spec.get("rank"),
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
    tmp = spec["out"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, spec["out"])
    exit_without_teardown(1 if "error" in out else 0)  # the result is written: skip module teardown
