"""The CUDA benchmark: a checkpoint of several GB loaded from the page cache into a world-size-1
FSDP2 model on one GPU, against the alternatives and the machine's own copy bandwidth.

    python benchmarks/cuda_bench.py --size-gb 4 --out /tmp/cuda-bench --json cuda.json

(one process per method, world size 1 on NCCL) It writes a Llama-style bf16 checkpoint (the main
bench's shapes, ``benchmarks.bench.model``; values drawn on the GPU, so writing 4 GB takes seconds)
with a ``config.json`` for transformers' ``LlamaForCausalLM``, reads it once so every method reads
from the page cache, then runs each method in a fresh process and measures its **first call**
(cold; CUDA and the process group are initialised before the clock, as every method needs them)
and a second call in the same process (warm): wall time to a synchronised device, the peak host
RSS above the RSS before the call (``VmHWM`` reset through ``/proc/self/clear_refs``), and the
device memory peak. Every load is checked bit for bit against ``safetensors``' ``load_file``.

Methods: ``pinned-copy`` (the machine's host-to-device bandwidth: a loop of copies from one pinned
buffer, the target's 100 %), ``read-pinned`` (page cache into pinned memory by ``preadv``, 1 and 8
threads: what any reader of these files is bound by), ``read-copy`` (8 threads reading into pinned
slots while each full slot is copied with a non-blocking copy: the ceiling of rank0load's design;
and the copy's and the reads' bandwidth while they run side by side), ``rank0load`` (``load_sharded``, the
defaults), ``safetensors`` (``load_file(path, device=DEV)`` per file: a state dict, no model),
``transformers`` (``LlamaForCausalLM.from_pretrained(..., device_map="cuda")``, not sharded),
``sweep`` (rank0load warm with other reader threads and staging sizes), ``fp8`` (float8 block
dequantisation on the device: ``_fp8.dequantize`` against plain torch).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import subprocess
import sys
import time
import zlib

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# CUDA_BENCH_LIB: the tree whose rank0load to measure (another checkout, for a same-run comparison)
sys.path.insert(0, os.environ.get("CUDA_BENCH_LIB") or os.path.dirname(HERE))

from benchmarks.bench.model import BenchConfig, _pack, config_for_size, tensor_specs  # noqa: E402
from benchmarks.bench.worker import _reset_peak, _status  # noqa: E402

# --cpu-smoke: the same code on the CPU with gloo (no pinning, no device clocks), to check the
# script itself before a GPU is lent; its figures mean nothing.
DEV = "cuda"
METHODS = [
    "pinned-copy",
    "read-pinned",
    "read-copy",
    "mapped-copy",
    "build-only",
    "sweep",
    "rank0load",
    "safetensors",
    "transformers",
    "fp8",
]


# ------------------------------------------------------------------------------------ checkpoint


def write_checkpoint(cfg: BenchConfig, directory: str) -> int:
    """bf16 shards (about 4, never splitting a tensor), the index and a Llama config.json; values
    drawn on the GPU from a generator seeded by each key. Returns the tensor bytes."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    done = os.path.join(directory, "done.json")
    if os.path.exists(done):
        with open(done) as f:
            return int(json.load(f)["bytes"])
    shards = _pack(tensor_specs(cfg))
    weight_map, total = {}, 0
    for i, specs in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key, shape in specs:
            gen = torch.Generator(device=DEV).manual_seed(zlib.crc32(key.encode()))
            t = torch.randn(shape, generator=gen, device=DEV) * 0.02
            tensors[key] = (t + 1.0 if len(shape) == 1 else t).to(torch.bfloat16).cpu()
            weight_map[key] = name
            total += tensors[key].numel() * 2
        save_file(tensors, os.path.join(directory, name), metadata={"format": "pt"})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "vocab_size": cfg.vocab,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    with open(done, "w") as f:
        json.dump({"bytes": total}, f)
    return total


def files_of(ckpt: str) -> list[str]:
    return sorted(os.path.join(ckpt, n) for n in os.listdir(ckpt) if n.endswith(".safetensors"))


# ------------------------------------------------------------------------------------- measuring


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def measured(fn) -> dict:
    """``fn()``'s wall time to a synchronised device, its host RSS peak above the RSS before, and
    the device memory peak; ``fn``'s own dict merged in."""
    gc.collect()
    sync()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = _status("VmRSS")
    reset = _reset_peak()
    started = time.perf_counter()
    info = fn()
    sync()
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "rss_before_mib": before / 2**20,
        "transient_mib": (_status("VmHWM") - before) / 2**20 if reset else None,
        "device_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0,
        **(info or {}),
    }


def init_world() -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if DEV != "cuda":
        dist.init_process_group("gloo", rank=0, world_size=1)
        return
    torch.cuda.set_device(0)
    torch.empty(1, device=DEV)  # the CUDA context, before any clock
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)


# --------------------------------------------------------------------------------------- methods


def _expected(ckpt: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in files_of(ckpt):
        out.update(load_file(path, device=DEV))
    return out


def _check(got: dict[str, torch.Tensor], ckpt: str) -> dict:
    """Every checkpoint tensor bit-equal in ``got`` (names as in the checkpoint)."""
    want, bad = _expected(ckpt), []
    for key, value in want.items():
        t = got.get(key)
        if (
            t is None
            or t.shape != value.shape
            or not torch.equal(t.view(torch.int16), value.view(torch.int16))
        ):
            bad.append(key)
    return {"verified": not bad, "mismatched": bad[:5], "checked": len(want)}


def _model_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
    out["model.embed_tokens.weight"] = out.get("model.embed_tokens.weight", out.get("lm_head.weight"))
    return out


def m_rank0load(ckpt: str, cfg: BenchConfig, options: dict) -> dict:
    import rank0load
    from benchmarks.bench.model import BenchLlama

    holder: dict = {}

    def load() -> dict:
        holder["model"] = rank0load.load_sharded(lambda: BenchLlama(cfg), ckpt, **options)
        report = holder["model"].rank0load_report
        return {"phases": dict(report.phases), "stream_s": report.stream_seconds}

    out = measured(load)
    model = holder.pop("model")
    out["on"] = str(next(model.parameters()).device)
    out.update(_check(_model_state(model), ckpt))
    out["tie_kept"] = model.lm_head.weight is model.model.embed_tokens.weight
    del model
    return out


def m_build_only(ckpt: str, cfg: BenchConfig, options: dict) -> dict:
    """What every FSDP2 load shares: meta build, ``fully_shard`` per layer and the root,
    ``to_empty`` on the device, the shards zeroed, one collective on the mesh's group (NCCL's
    communicator is made by the first one). Loads nothing."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from benchmarks.bench.model import BenchLlama

    holder: dict = {}

    def build() -> None:
        mesh = init_device_mesh(DEV, (1,))
        with torch.device("meta"):
            model = BenchLlama(cfg)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device=DEV)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().zero_()
        dist.barrier()
        holder["model"] = model

    out = measured(build)
    holder.clear()
    return out


def m_safetensors(ckpt: str, cfg: BenchConfig, options: dict) -> dict:
    from safetensors.torch import load_file

    holder: dict = {}

    def load() -> None:
        state: dict[str, torch.Tensor] = {}
        for path in files_of(ckpt):
            state.update(load_file(path, device=DEV))
        holder["state"] = state

    out = measured(load)
    out.update(_check(holder.pop("state"), ckpt))
    return out


def m_transformers(ckpt: str, cfg: BenchConfig, options: dict) -> dict:
    from transformers import LlamaForCausalLM

    holder: dict = {}

    def load() -> None:
        holder["model"] = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map=DEV)

    out = measured(load)
    model = holder.pop("model")
    out.update(_check({k: v.detach() for k, v in model.state_dict().items()}, ckpt))
    return out


def m_pinned_copy(ckpt: str, cfg: BenchConfig, options: dict) -> dict:
    """Host-to-device from one pinned buffer, in chunks of each size, to the checkpoint's bytes."""
    total = sum(os.path.getsize(p) for p in files_of(ckpt))
    out = {}
    for chunk_mib in (4, 16, 64, 256):
        n = chunk_mib << 20
        src = torch.empty(n, dtype=torch.uint8, pin_memory=DEV == "cuda")
        src.fill_(1)
        dst = torch.empty(total, dtype=torch.uint8, device=DEV)
        sync()
        started = time.perf_counter()
        for at in range(0, total, n):
            k = min(n, total - at)
            dst[at : at + k].copy_(src[:k], non_blocking=True)
        sync()
        out[f"gbps_{chunk_mib}mib"] = total / 1e9 / (time.perf_counter() - started)
        started = time.perf_counter()
        for at in range(0, total, n):  # synchronous, as a loader that waits on each copy
            k = min(n, total - at)
            dst[at : at + k].copy_(src[:k])
        out[f"gbps_sync_{chunk_mib}mib"] = total / 1e9 / (time.perf_counter() - started)
        del dst
    pageable = torch.empty(64 << 20, dtype=torch.uint8)
    pageable.fill_(1)
    dst = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    started = time.perf_counter()
    for _ in range(32):
        dst.copy_(pageable)
    out["gbps_pageable_64mib"] = 32 * (64 << 20) / 1e9 / (time.perf_counter() - started)
    out["gbps"] = max(v for k, v in out.items() if k.startswith("gbps_") and "pageable" not in k)
    return out


def m_read_pinned(ckpt: str, cfg: BenchConfig, options: dict) -> dict:
    """Every file's bytes read by ``preadv`` into a pinned buffer, in slots of 4 MiB (the default
    staging's) and 16 MiB, by 1, 4, 8 and 16 threads: the page cache's own speed here."""
    import concurrent.futures

    files = files_of(ckpt)
    total = sum(os.path.getsize(p) for p in files)
    out = {}
    for slot_mib in (4, 16):
        size = slot_mib << 20
        for threads in (1, 4, 8, 16):
            buf = torch.empty(size * threads, dtype=torch.uint8, pin_memory=DEV == "cuda")
            views = [memoryview(buf[i * size : (i + 1) * size].numpy()) for i in range(threads)]
            jobs = []
            for path in files:
                length = os.path.getsize(path)
                jobs += [(path, at, min(size, length - at)) for at in range(0, length, size)]
            fds = {p: os.open(p, os.O_RDONLY) for p in files}

            def read(i_job, fds=fds, views=views, threads=threads, jobs=jobs):
                i = i_job
                while i < len(jobs):
                    path, at, n = jobs[i]
                    os.preadv(fds[path], [views[i_job][:n]], at)
                    i += threads

            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                list(pool.map(read, range(threads)))
            out[f"gbps_{slot_mib}mib_{threads}t"] = total / 1e9 / (time.perf_counter() - started)
            for fd in fds.values():
                os.close(fd)
    return out


def m_mapped_copy(ckpt: str, cfg: BenchConfig, options: dict) -> dict:
    """No bounce buffer: each file mapped read-only, its page-cache pages registered with CUDA
    (``cudaHostRegister``, read-only) a window at a time and copied to the device straight from
    them (non-blocking; a window unregistered once an event after its copy has completed, at most
    ``inflight`` windows registered at once). What a reader that pins the page cache instead of
    reading it into pinned staging could reach here; ``register_s``: the time spent pinning."""
    import mmap

    files = files_of(ckpt)
    total = sum(os.path.getsize(p) for p in files)
    out: dict = {}
    if DEV != "cuda":
        return {"skipped": "needs CUDA"}
    rt = torch.cuda.cudart()
    read_only = 8  # cudaHostRegisterReadOnly
    for window_mib, inflight in ((16, 4), (64, 4), (256, 2)):
        window = window_mib << 20
        dst = torch.empty(total, dtype=torch.uint8, device=DEV)
        pending: list = []
        registered = 0.0
        sync()
        started = time.perf_counter()
        at_dst = 0
        maps = []
        try:
            for path in files:
                with open(path, "rb") as f:
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                maps.append(m)
                host = torch.frombuffer(m, dtype=torch.uint8)
                base = host.data_ptr()
                for at in range(0, len(m), window):
                    n = min(window, len(m) - at)
                    while len(pending) >= inflight:
                        ptr, event = pending.pop(0)
                        event.synchronize()
                        rt.cudaHostUnregister(ptr)
                    t0 = time.perf_counter()
                    err = rt.cudaHostRegister(base + at, n, read_only)
                    registered += time.perf_counter() - t0
                    if int(err) != 0:
                        raise RuntimeError(f"cudaHostRegister failed: {err}")
                    dst[at_dst : at_dst + n].copy_(host[at : at + n], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                    pending.append((base + at, event))
                    at_dst += n
            for ptr, event in pending:
                event.synchronize()
                rt.cudaHostUnregister(ptr)
            pending = []
            sync()
            seconds = time.perf_counter() - started
            ok = all(
                torch.equal(dst[o : o + 4096].cpu(), torch.frombuffer(m, dtype=torch.uint8)[:4096])
                for o, m in zip(itertools.accumulate([0] + [len(m) for m in maps[:-1]]), maps)
            )
            out[f"{window_mib}mib_x{inflight}"] = {
                "gbps": total / 1e9 / seconds,
                "register_s": registered,
                "seconds": seconds,
                "first_bytes_equal": ok,
            }
        except Exception as exc:
            out[f"{window_mib}mib_x{inflight}"] = {"error": repr(exc)}
        finally:
            for ptr, event in pending:
                event.synchronize()
                rt.cudaHostUnregister(ptr)
            del dst
            for m in maps:
                try:
                    m.close()
                except BufferError:  # a tensor still views it: the process ends soon
                    pass
    return out


def m_read_copy(ckpt: str, cfg: BenchConfig, options: dict) -> dict:
    """The ceiling of rank0load's design with no library around it: 8 threads read every file's
    bytes (4 MiB parts) into 4 pinned slots of 16 or 64 MiB, each slot copied to the device with a
    non-blocking copy as soon as its reads are done and filled again once an event after that copy
    has completed (``pipeline_gbps_*``). And the two sharing the host's memory: a loop of
    non-blocking 16 MiB pinned copies while 8 threads read the page cache into other pinned buffers
    (``copy_while_reading_gbps``, ``read_while_copying_gbps``). ``CUDA_BENCH_READ_COPY_THREADS``: other
    than 8 read threads."""
    import concurrent.futures
    import threading

    files = files_of(ckpt)
    total = sum(os.path.getsize(p) for p in files)
    fds = {p: os.open(p, os.O_RDONLY) for p in files}
    part = 4 << 20
    pin = DEV == "cuda"
    out: dict = {}
    n_threads = int(os.environ.get("CUDA_BENCH_READ_COPY_THREADS", "8"))  # 8: rank0load's default
    pool = concurrent.futures.ThreadPoolExecutor(n_threads)

    def read(path: str, at: int, view: memoryview) -> None:
        while len(view):
            n = os.preadv(fds[path], [view], at)
            if n <= 0:
                raise OSError(f"{path}: short read at {at}")
            view, at = view[n:], at + n

    for slot_mib in (16, 64):
        size = slot_mib << 20
        slots = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(4)]
        events: list = [None] * 4
        dst = torch.empty(total, dtype=torch.uint8, device=DEV)
        jobs = []  # (path, file offset, length, device offset)
        placed = 0
        for path in files:
            length = os.path.getsize(path)
            for at in range(0, length, size):
                jobs.append((path, at, min(size, length - at), placed))
                placed += min(size, length - at)
        sync()
        started = time.perf_counter()
        inflight: list = []
        for i, (path, at, n, into) in enumerate(jobs):
            k = i % 4
            if events[k] is not None:
                events[k].synchronize()
            view = memoryview(slots[k].numpy())
            reads = [pool.submit(read, path, at + o, view[o : min(n, o + part)]) for o in range(0, n, part)]
            inflight.append((reads, k, n, into))
            if len(inflight) == 3:  # keep 3 slots reading while the oldest is copied
                reads, k0, n0, into0 = inflight.pop(0)
                for r in reads:
                    r.result()
                dst[into0 : into0 + n0].copy_(slots[k0][:n0], non_blocking=True)
                events[k0] = torch.Event(device=DEV) if DEV == "cuda" else None
                if events[k0] is not None:
                    events[k0].record()
        for reads, k0, n0, into0 in inflight:
            for r in reads:
                r.result()
            dst[into0 : into0 + n0].copy_(slots[k0][:n0], non_blocking=True)
        sync()
        out[f"pipeline_gbps_{slot_mib}mib"] = total / 1e9 / (time.perf_counter() - started)
        del dst, slots

    stop = threading.Event()
    read_bytes = [0] * n_threads
    bufs = [torch.empty(part, dtype=torch.uint8, pin_memory=pin) for _ in range(n_threads)]
    jobs = [
        (p, at, min(part, os.path.getsize(p) - at))
        for p in files
        for at in range(0, os.path.getsize(p), part)
    ]

    def reader(t: int) -> None:
        view, i = memoryview(bufs[t].numpy()), t
        while not stop.is_set():
            path, at, n = jobs[i % len(jobs)]
            read(path, at, view[:n])
            read_bytes[t] += n
            i += n_threads

    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=pin)
    src.fill_(1)
    dst = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    chunk = 16 << 20
    threads = [threading.Thread(target=reader, args=(t,)) for t in range(n_threads)]
    started = time.perf_counter()
    for th in threads:
        th.start()
    copied = 0
    while copied < total:
        at = copied % (256 << 20)
        dst[at : at + chunk].copy_(src[at : at + chunk], non_blocking=True)
        copied += chunk
    sync()
    seconds = time.perf_counter() - started
    stop.set()
    for th in threads:
        th.join()
    out["copy_while_reading_gbps"] = copied / 1e9 / seconds
    out["read_while_copying_gbps"] = sum(read_bytes) / 1e9 / (time.perf_counter() - started)
    pool.shutdown()
    for fd in fds.values():
        os.close(fd)
    return out


# (staging MiB, reader threads, read part MiB; "si": the interpreter's switch interval at 0.1 ms;
# "apart": rank 0's own pieces one message each, not grouped); CUDA_BENCH_SWEEP="64:8:4,64:8:1:si" picks others
SWEEP = "64:1:4,16:8:4,64:8:4,64:16:4,128:8:4,128:16:4,256:16:4"


def m_sweep(ckpt: str, cfg: BenchConfig, options: dict) -> dict:
    """rank0load warm (after one load), with each staging size, reader thread count and read part
    size, and where the time goes. The sender thread: waiting for the reader (``wait_s``) or moving
    the bytes it was handed (``scatter_s``: the host-to-device copies; non-blocking ones, only the
    time to queue them), its CPU time (``send_cpu_s``). The reader thread: waiting for a free slot
    (``slot_wait_s``: on an accelerator, for the copies out of it) and handing out reads
    (``submit_s``). The read threads: their summed time in reads (``read_busy_s``, over ``parts``;
    divided by the stream's time, the reads' mean concurrency). ``process_cpu_s``: all threads."""
    import threading

    from rank0load.load import _readahead, _sink, _transfer

    try:  # the byte sources (8cdf6ff on): rank 0's loop is stream (_in_rounds before), its local work Sink.take
        from rank0load.load import _sources
    except ImportError:  # the sources in _transfer, or an older tree (CUDA_BENCH_LIB): _send and _scatter
        _sources = _transfer if hasattr(_transfer, "own_together") else None
    spent: dict = {}
    busy: list[float] = []
    iterate = _readahead.Reader.__iter__
    scatter = _sink.Sink.take if _sources is not None else _transfer._scatter
    get_slot, submit, read_part = (
        _readahead.Reader._get_slot,
        _readahead.Reader._submit,
        _readahead.Reader._read_part,
    )
    loop = "_send" if _sources is None else "_in_rounds" if hasattr(_transfer, "_in_rounds") else "stream"
    send = getattr(_transfer, loop)
    own_together = getattr(_sources, "own_together", None)

    def add(key: str, started: float) -> None:
        spent[key] = spent.get(key, 0.0) + time.perf_counter() - started

    def timed_iter(self):
        items = iterate(self)
        while True:
            started = time.perf_counter()
            try:
                item = next(items)
            except StopIteration:
                return
            add("wait_s", started)
            spent["messages"] = spent.get("messages", 0) + 1
            yield item

    def timed(key, fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                add(key, started)

        return wrapper

    def timed_read_part(*args, **kwargs):
        started = time.perf_counter()
        read_part(*args, **kwargs)
        busy.append(time.perf_counter() - started)

    def timed_send(*args, **kwargs):
        cpu, process = time.thread_time(), time.process_time()
        try:
            return send(*args, **kwargs)
        finally:
            spent["send_cpu_s"] = time.thread_time() - cpu
            spent["process_cpu_s"] = time.process_time() - process

    _readahead.Reader.__iter__ = timed_iter  # type: ignore[method-assign]
    _readahead.Reader._get_slot = timed("slot_wait_s", get_slot)  # type: ignore[method-assign]
    if hasattr(_readahead, "_Ring"):  # the ring's wait for released bytes counts as the slot's
        _readahead._Ring.take = timed("slot_wait_s", _readahead._Ring.take)  # type: ignore[method-assign]
    _readahead.Reader._submit = timed("submit_s", submit)  # type: ignore[method-assign]
    _readahead.Reader._read_part = timed_read_part  # type: ignore[method-assign]
    if _sources is not None:
        _sink.Sink.take = timed("scatter_s", scatter)  # type: ignore[method-assign]
    else:
        _transfer._scatter = timed("scatter_s", scatter)
    setattr(_transfer, loop, timed_send)
    m_rank0load(ckpt, cfg, {})  # warm-up
    out: dict = {}
    interval = sys.getswitchinterval()
    for variant in os.environ.get("CUDA_BENCH_SWEEP", SWEEP).split(","):
        staging_mib, threads, part_mib, *flags = variant.split(":")
        _readahead.ACCELERATOR_READ_THREADS = int(threads)
        _readahead._PART_BYTES = int(float(part_mib) * (1 << 20))
        sys.setswitchinterval(1e-4 if "si" in flags else interval)
        if own_together is not None:  # "apart": rank 0's own pieces one message each, as before 8cdf6ff
            _sources.own_together = (lambda device: False) if "apart" in flags else own_together
        spent.clear()
        busy.clear()
        try:
            r = m_rank0load(ckpt, cfg, {"max_staging_bytes": int(staging_mib) << 20})
        finally:
            sys.setswitchinterval(interval)
        repeats = sum(k == variant or k.startswith(variant + "#") for k in out)  # a variant run again
        name = f"{variant}#{repeats + 1}" if repeats else variant
        out[name] = {
            **{k: r[k] for k in ("seconds", "transient_mib", "verified", "stream_s")},
            **spent,
            "read_busy_s": sum(busy),
            "parts": len(busy),
            "threads_alive": threading.active_count(),
        }
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return out


def m_fp8(ckpt: str, cfg: BenchConfig, options: dict) -> dict:
    """Float8 e4m3 block-quantised (128 x 128) matrices dequantised into bf16 on the device:
    rank0load's ``_fp8.dequantize`` (a whole matrix, and 1 MiB steps as the stream does them)
    against plain torch (``q.float() * scales`` broadcast per block), bit-equal."""
    from rank0load.checkpoint import _fp8

    rows, cols, block = (16384, 8192, 128) if DEV == "cuda" else (1024, 512, 128)
    q = (torch.randn(rows, cols, device=DEV) * 100).to(torch.float8_e4m3fn)
    grid = torch.rand(rows // block, cols // block, device=DEV) + 0.5
    n = rows * cols

    def plain() -> torch.Tensor:
        s = grid.repeat_interleave(block, 0).repeat_interleave(block, 1)
        return (q.to(torch.float32) * s).to(torch.bfloat16)

    def ours(step: int) -> torch.Tensor:
        into = torch.empty(n, dtype=torch.bfloat16, device=DEV)
        flat = q.view(-1)
        for at in range(0, n, step):
            some = flat[at : at + step]
            _fp8.dequantize(
                some, at, [rows], cols, (block, block), grid.reshape(-1), into[at : at + some.numel()]
            )
        return into.view(rows, cols)

    out: dict = {"elements": n}
    want = plain()
    steps = (
        ("whole", lambda: ours(n)),
        ("step_1mi", lambda: ours(1 << 18)),
        ("step_16mi", lambda: ours(1 << 24)),
    )
    for name, fn in (("plain", plain), *steps):
        got = fn()
        sync()
        if name != "plain":
            out[f"{name}_bit_equal"] = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
        reps = 5
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        seconds = (time.perf_counter() - started) / reps
        out[f"{name}_gelem_s"] = n / 1e9 / seconds
    return out


RUNNERS = {
    "pinned-copy": m_pinned_copy,
    "read-pinned": m_read_pinned,
    "read-copy": m_read_copy,
    "mapped-copy": m_mapped_copy,
    "rank0load": m_rank0load,
    "build-only": m_build_only,
    "safetensors": m_safetensors,
    "transformers": m_transformers,
    "sweep": m_sweep,
    "fp8": m_fp8,
}


def worker(method: str, ckpt: str, cfg: BenchConfig, warm: bool, tuned: tuple[int, int] | None) -> dict:
    init_world()
    import torch.distributed as dist

    options: dict = {}
    if tuned is not None and method == "rank0load":
        from rank0load.load import _readahead

        options["max_staging_bytes"] = tuned[0] << 20
        _readahead.ACCELERATOR_READ_THREADS = tuned[1]
    try:
        runner = RUNNERS[method]
        result = {"cold": runner(ckpt, cfg, options), "options": {k: str(v) for k, v in options.items()}}
        if tuned is not None and method == "rank0load":
            result["tuned"] = list(tuned)
        if warm and method in ("rank0load", "safetensors", "transformers", "build-only"):
            gc.collect()
            if DEV == "cuda":
                torch.cuda.empty_cache()
            result["warm"] = runner(ckpt, cfg, options)
        return result
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=4.0)
    parser.add_argument("--out", default="/tmp/rank0load-cuda-bench")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per method")
    parser.add_argument(
        "--tuned", default=None, help="STAGING_MIB,THREADS for rank0load (else: its defaults)"
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="check the script on the CPU")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEV
    DEV = "cpu" if args.cpu_smoke else "cuda"
    cfg = config_for_size(args.size_gb)
    ckpt = os.path.join(args.out, f"ckpt-{cfg.tag}")
    if args.worker:
        tuned = tuple(int(x) for x in args.tuned.split(",")) if args.tuned else None
        result = worker(args.worker, ckpt, cfg, warm=True, tuned=tuned)  # type: ignore[arg-type]
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    started = time.perf_counter()
    total = write_checkpoint(cfg, ckpt)
    wrote = time.perf_counter() - started
    for path in files_of(ckpt):  # into the page cache
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    env = {
        "device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (smoke run)",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "bytes": total,
        "config": cfg.tag,
        "write_s": wrote,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    print(json.dumps(env), flush=True)
    results: dict = {"environment": env, "methods": {}}
    tuned = args.tuned
    for method in args.methods.split(","):
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--worker",
                    method,
                    "--size-gb",
                    str(args.size_gb),
                    "--out",
                    args.out,
                    *(["--cpu-smoke"] if args.cpu_smoke else []),
                    *(["--tuned", tuned] if tuned and method == "rank0load" else []),
                ],
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            res = (
                json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-3000:], "rc": proc.returncode}
            )
        except subprocess.TimeoutExpired:
            res = {"error": f"timed out after {args.timeout} s"}
        res["process_s"] = time.perf_counter() - t0
        results["methods"][method] = res
        print(method, json.dumps(res), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    print(table(results))
    return 0


def table(results: dict) -> str:
    env, ms = results["environment"], results["methods"]
    gb = env["bytes"] / 1e9
    copy = ms.get("pinned-copy", {}).get("cold", {}).get("gbps")
    lines = [
        f"{env['device']}, torch {env['torch']}, {env['cpus']} CPUs; checkpoint {gb:.2f} GB bf16 ({env['config']})",
        "",
        "| method | cold s | cold GB/s | of pinned copy | warm s | warm GB/s | host transient MiB (cold) | device peak GiB | bit-exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("build-only", "rank0load", "safetensors", "transformers"):
        r = ms.get(name)
        if not r or "cold" not in r:
            continue
        cold, warm = r["cold"], r.get("warm", {})
        rate = gb / cold["seconds"]
        share = f"{100 * rate / copy:.0f} %" if copy else "-"
        w = f"{warm['seconds']:.2f} | {gb / warm['seconds']:.1f}" if warm else "- | -"
        t = cold.get("transient_mib")
        lines.append(
            f"| {name} | {cold['seconds']:.2f} | {rate:.1f} | {share} | {w} | "
            f"{t:.0f} | {cold['device_peak_gib']:.2f} | {cold.get('verified')} |"
            if t is not None
            else f"| {name} | {cold['seconds']:.2f} | {rate:.1f} | {share} | {w} | - | "
            f"{cold['device_peak_gib']:.2f} | {cold.get('verified')} |"
        )
    if copy:
        lines.append(f"\npinned host-to-device copy: {copy:.1f} GB/s (best chunk size)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
