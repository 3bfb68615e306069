"""A per-expert MoE at the real parameter count: what a transformers 4.57 user (one ``nn.Linear`` per
expert, as MiniMax-M2's remote code and 4.57's Qwen3-MoE build it) pays to load with rank0load.

    python benchmarks/per_expert.py --out /tmp/per-expert            # 62 layers x 256 experts, 2 ranks

Writes (once) a Qwen3-MoE checkpoint with ``save_pretrained`` (hidden 64, expert width 64, bf16,
62 x 256 x 3 expert weights: 48,177 parameters, 0.39 GB), then runs, each in fresh processes:

- ``rank0load``: ``load_pretrained(AutoModelForCausalLM, ckpt, dtype=torch.bfloat16)`` on ``--ranks``
  gloo ranks; its phases per rank and the FSDP groups it made;
- ``fsdp-only``: what any FSDP2 load pays before moving a byte, on the same ranks: the model built on
  meta (rank0load's ``build_on_meta``), ``fully_shard`` per decoder layer (rank0load's default
  policy), ``to_empty``; each step timed, and the groups counted;
- ``transformers``: ``from_pretrained`` in one process (no FSDP).

``--fp8-remote`` measures the seed team's own shape instead: MiniMax-M2 as its Hub remote code builds
it on transformers 4.57 (``examples/minimax_m2``: one module per expert, ``trust_remote_code=True``),
from an FP8 block checkpoint in the Hub's layout at the real count (62 x 256 experts, 96,103
tensors, hidden 128, expert width 128: 0.79 GB, ``benchmarks.bench.minimax``'s tensors), dequantised
into bf16. Each round runs, in fresh processes on ``--ranks`` gloo ranks:

- ``rank0load``: ``load_pretrained(AutoModelForCausalLM, ckpt, dtype=torch.bfloat16,
  trust_remote_code=True)``; its phases per rank;
- ``floor``: what any FSDP2 load of this model must do: the model built on meta as rank0load builds
  it (``build_on_meta``), the same ``fully_shard`` policy (``default_shard_fn``), ``to_empty``, then
  each rank reading every file whole (one ``os.preadv``) and dequantising the elements it holds
  into its shards, a layer's experts batched per projection (``benchmarks.bench.minimax_methods``'
  ``_File`` and ``_dequantize_into``); each step timed.

Both are verified after the timing: every parameter of the first and last layer (and the rest of
the model outside the layers) compared, as ``full_tensor()``, with the checkpoint dequantised by
torch's own float8 conversion. The summary gives rank0load / floor round by round (the slower rank
of each) and the peak RSS of both.

``--router-bias`` runs ``fsdp-only`` alone with a trainable fp32 ``e_score_correction_bias`` added to every
MoE block, as public MiniMax-M2 ports declare it: the shape on which a policy that isolates every dtype
island would give each of the 256 experts of each layer a group of its own (the default policy keeps the
bias out of FSDP, replicated, and the experts in their layer's group).

Run it with the transformers whose per-expert layout you want (4.57 builds ``nn.ModuleList`` experts;
transformers 5 fuses them, which ``python -m benchmarks.bench --model moe`` measures).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

# the benchmark's modules (benchmarks.bench), from a run started anywhere
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write(out: str, layers: int, experts: int) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=experts, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(out, max_shard_size="20MB")


def _groups(model: nn.Module) -> str:
    """The FSDP groups (modules that are ``FSDPModule``s) in all, and the counts found per decoder layer
    (at or below it)."""
    from torch.distributed.fsdp import FSDPModule

    from rank0load.model._shard import replicated_parameters

    total = sum(isinstance(m, FSDPModule) for m in model.modules())
    per_layer = sorted({sum(isinstance(m, FSDPModule) for m in x.modules()) for x in model.model.layers})
    replicated = len(replicated_parameters(model))
    return f"{total} FSDP groups ({'/'.join(map(str, per_layer))} per decoder layer), {replicated} replicated"


def _rank0load(ckpt: str) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import rank0load

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    start = time.perf_counter()
    model = rank0load.load_pretrained(AutoModelForCausalLM, ckpt, dtype=torch.bfloat16)
    took = time.perf_counter() - start
    phases = ", ".join(f"{k} {v:.2f}" for k, v in model.rank0load_report.phases.items())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"rank0load rank {dist.get_rank()}: {took:.1f} s ({phases}); {_groups(model)}; "
        f"peak RSS {peak:.0f} MiB",
        flush=True,
    )
    dist.destroy_process_group()


def _add_router_bias(model: nn.Module) -> None:
    """A trainable fp32 ``e_score_correction_bias`` Parameter on every MoE block, as public MiniMax-M2
    ports declare it (what made the policy before the routed-list rule give every expert a group)."""
    import torch
    from torch import nn

    for layer in model.model.layers:
        experts = len(layer.mlp.experts)
        bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32, device="meta"))
        layer.mlp.register_parameter("e_score_correction_bias", bias)


def _fsdp_only(ckpt: str, router_bias: bool = False) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    from rank0load.model._meta import build_on_meta
    from rank0load.model._shard import default_shard_fn

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    config = AutoConfig.from_pretrained(ckpt)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    t0 = time.perf_counter()
    model, _ = build_on_meta(lambda: AutoModelForCausalLM.from_config(config), torch.bfloat16)
    if router_bias:
        _add_router_bias(model)
    t1 = time.perf_counter()
    default_shard_fn(model, mesh)
    t2 = time.perf_counter()
    model.to_empty(device="cpu")
    t3 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"fsdp-only rank {dist.get_rank()}: {t3 - t0:.1f} s (meta build {t1 - t0:.1f}, fully_shard "
        f"{t2 - t1:.1f}, to_empty {t3 - t2:.1f}); {sum(1 for _ in model.parameters())} parameters, "
        f"{_groups(model)}; peak RSS {peak:.0f} MiB",
        flush=True,
    )
    dist.destroy_process_group()


def _transformers(ckpt: str) -> None:
    import resource

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    start = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"transformers (1 process): {time.perf_counter() - start:.1f} s; peak RSS {peak:.0f} MiB", flush=True
    )


# ---------------------------------------------------------------- --fp8-remote: the seed team's shape

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
CODE_FILES = ("configuration_minimax_m2.py", "modeling_minimax_m2.py")


def _write_fp8(out: str, layers: int, experts: int) -> None:
    """The FP8 checkpoint (benchmarks.bench.minimax's tensors, one file a layer) with the remote code
    of examples/minimax_m2 beside it and ``auto_map`` in config.json. Written once; ``done`` last."""
    import json
    import shutil

    from safetensors.torch import save_file

    from benchmarks.bench.minimax import MiniMaxConfig, _generate, _layer

    cfg = MiniMaxConfig(layers=layers, experts=experts)
    os.makedirs(out, exist_ok=True)
    sys.path.insert(0, EXAMPLES)
    from minimax_m2.configuration_minimax_m2 import MiniMaxM2Config

    config = MiniMaxM2Config(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, num_local_experts=experts, num_experts_per_tok=min(cfg.top_k, experts),
    )  # fmt: skip
    config.save_pretrained(out)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        raw = json.load(f)
    raw.update(
        architectures=["MiniMaxM2ForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_minimax_m2.MiniMaxM2Config",
            "AutoModelForCausalLM": "modeling_minimax_m2.MiniMaxM2ForCausalLM",
        },
        quantization_config=cfg.quantization_config(),
        torch_dtype="bfloat16",
    )
    with open(path, "w") as f:
        json.dump(raw, f, indent=2)
    for name in CODE_FILES:
        shutil.copy(os.path.join(EXAMPLES, "minimax_m2", name), out)
    weight_map: dict[str, str] = {}
    n = layers + 1
    for index in range(n):
        name = f"model-{index + 1:05d}-of-{n:05d}.safetensors"
        if index < layers:
            tensors = _layer(cfg, index, {}, {})
        else:
            tensors = {
                k: _generate(k, shape)
                for k, shape in (
                    ("model.embed_tokens.weight", (cfg.vocab, cfg.hidden)),
                    ("model.norm.weight", (cfg.hidden,)),
                    ("lm_head.weight", (cfg.vocab, cfg.hidden)),
                )
            }
        save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    open(os.path.join(out, "done"), "w").close()
    print(f"wrote {out}: {len(weight_map)} tensors in {n} files", flush=True)


def _result(**fields: object) -> None:
    import json

    sys.stdout.flush()  # one write per line: the ranks share torchrun's stdout
    os.write(sys.stdout.fileno(), ("RESULT " + json.dumps(fields) + "\n").encode())


def _peak_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _fp8_rank0load(ckpt: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import rank0load

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    start = time.perf_counter()
    model = rank0load.load_pretrained(
        AutoModelForCausalLM, ckpt, dtype=torch.bfloat16, trust_remote_code=True
    )
    took = time.perf_counter() - start
    peak = _peak_mib()
    phases = {k: round(v, 2) for k, v in model.rank0load_report.phases.items()}
    _result(method="rank0load", rank=dist.get_rank(), seconds=took, phases=phases, peak_mib=peak,
            groups=_groups(model), verified=_verify(model, ckpt))  # fmt: skip
    dist.destroy_process_group()


def _fp8_floor(ckpt: str) -> None:
    import gc
    import json

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    from rank0load.model._meta import build_on_meta
    from rank0load.model._shard import default_shard_fn

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    t0 = time.perf_counter()
    config = AutoConfig.from_pretrained(ckpt, trust_remote_code=True)
    block = config.quantization_config["weight_block_size"][0]  # square blocks, as the writer makes them
    del config.quantization_config  # the model holds bf16, as rank0load builds it
    model, _ = build_on_meta(
        lambda: AutoModelForCausalLM.from_config(config, trust_remote_code=True), torch.bfloat16
    )
    t1 = time.perf_counter()
    default_shard_fn(model, mesh)
    t2 = time.perf_counter()
    model.to_empty(device="cpu")
    t3 = time.perf_counter()
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        where: dict[str, str] = json.load(f)["weight_map"]
    was = gc.isenabled()
    gc.disable()
    try:
        read = _floor_fill(model, where, ckpt, block)
    finally:
        if was:
            gc.enable()
    t4 = time.perf_counter()
    peak = _peak_mib()
    steps = {"meta build": t1 - t0, "fully_shard": t2 - t1, "to_empty": t3 - t2, "read+dequantise": t4 - t3}
    _result(method="floor", rank=dist.get_rank(), seconds=t4 - t0, phases={k: round(v, 2) for k, v in steps.items()},
            peak_mib=peak, groups=_groups(model), read_bytes=read, verified=_verify(model, ckpt))  # fmt: skip
    dist.destroy_process_group()


def _floor_fill(model: nn.Module, where: dict[str, str], ckpt: str, block: int) -> int:
    """(each rank, no collectives) Every local shard filled from the checkpoint: each file read whole
    into one reused buffer; a layer's experts stacked per projection (this rank's rows of each),
    dequantised at once and copied into each expert's shard; every other tensor's rows copied, or
    dequantised, one by one. Returns the bytes read."""
    import re

    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from benchmarks.bench.minimax_methods import _dequantize_into, _File

    expert = re.compile(r"(.*\.experts\.)(\d+)(\.w\d\.weight)$")
    per_file: dict[str, dict] = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        first = 0
        if isinstance(p, DTensor):
            first = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1][0]
        if local.shape[0] == 0:
            continue
        jobs = per_file.setdefault(where[name], {"experts": {}, "single": []})
        m = expert.match(name)
        if m:  # grouped by (layer, projection); all experts share one shape and so one row range
            jobs["experts"].setdefault(m[1] + "*" + m[3], []).append((name, local.data, first))
        else:
            jobs["single"].append((name, local.data, first))
    read, buf = 0, [torch.empty(0, dtype=torch.uint8)]
    with torch.no_grad():
        for file in sorted(per_file):
            f = _File(os.path.join(ckpt, file), buf)
            read += f.data.numel()
            for group in per_file[file]["experts"].values():
                keys = [k for k, _, _ in group]
                first, rows = group[0][2], group[0][1].shape[0]
                q = f.stacked(keys)[:, first : first + rows]
                s = f.stacked([k + "_scale_inv" for k in keys])[:, first // block :]
                out = torch.empty(len(keys), rows, q.shape[-1], dtype=torch.bfloat16)
                _dequantize_into(out, q, s, first, block)
                for (_, local, _), value in zip(group, out):
                    local.copy_(value)
            for key, local, first in per_file[file]["single"]:
                rows = f[key][first : first + local.shape[0]]
                if rows.dtype == torch.float8_e4m3fn:
                    _dequantize_into(local, rows, f[key + "_scale_inv"][first // block :], first, block)
                else:
                    local.copy_(rows)
            del f
    return read


def _verify(model: nn.Module, ckpt: str) -> bool:
    """(all ranks, collectives) Every parameter of the first and last layer and outside the layers,
    as ``full_tensor()``, against the checkpoint dequantised with torch's float8 conversion."""
    import json

    import torch
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    from benchmarks.bench.minimax import dequantize

    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        where: dict[str, str] = json.load(f)["weight_map"]
    with open(os.path.join(ckpt, "config.json")) as f:
        block = json.load(f)["quantization_config"]["weight_block_size"][0]
    last = len(model.model.layers) - 1
    ok = True
    for name, p in model.named_parameters():
        if ".layers." in name and not (".layers.0." in name or f".layers.{last}." in name):
            continue
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if dist.get_rank() != 0:
            continue
        with safe_open(os.path.join(ckpt, where[name]), "pt") as f:
            stored = f.get_tensor(name)
            if stored.dtype == torch.float8_e4m3fn:
                stored = dequantize(stored, f.get_tensor(name + "_scale_inv"), block)
        ok = ok and torch.equal(full, stored.to(full.dtype))
    flag = torch.tensor([int(ok)])
    dist.broadcast(flag, 0)
    return bool(flag.item())


def _fp8_main(args: argparse.Namespace, torchrun: list[str], me: list[str]) -> None:
    import json
    import statistics

    ckpt = os.path.join(args.out, f"minimax-m2-remote-fp8-l{args.layers}-e{args.experts}")
    if not os.path.exists(os.path.join(ckpt, "done")):
        _write_fp8(ckpt, args.layers, args.experts)
    ratios = []
    for r in range(args.rounds):
        results: dict[str, list[dict]] = {}
        for step in ("rank0load", "floor"):
            done = subprocess.run([*torchrun, *me, "--fp8-remote", "--step", step], check=True,
                                  capture_output=True, text=True)  # fmt: skip
            results[step] = [json.loads(x[7:]) for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            for line in sorted(results[step], key=lambda x: x["rank"]):
                print(f"round {r + 1} {step} rank {line['rank']}: {line['seconds']:.1f} s ({line['phases']}); "
                      f"{line['groups']}; peak RSS {line['peak_mib']:.0f} MiB; verified {line['verified']}",
                      flush=True)  # fmt: skip
        ours = max(x["seconds"] for x in results["rank0load"])
        floor = max(x["seconds"] for x in results["floor"])
        rss = max(x["peak_mib"] for x in results["rank0load"]) - max(x["peak_mib"] for x in results["floor"])
        ratios.append(ours / floor)
        print(f"round {r + 1}: rank0load {ours:.1f} s / floor {floor:.1f} s = {ours / floor:.2f}x; "
              f"peak RSS rank0load - floor: {rss:+.0f} MiB", flush=True)  # fmt: skip
    print(f"rank0load / floor over {args.rounds} rounds: {min(ratios):.2f}-{max(ratios):.2f}x, "
          f"median {statistics.median(ratios):.2f}x (target 1.15x)", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="./per-expert-out")
    parser.add_argument("--layers", type=int, default=62)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--router-bias",
        action="store_true",
        help="fsdp-only alone, with a trainable fp32 e_score_correction_bias on every MoE block (MiniMax-M2's shape)",
    )
    parser.add_argument(
        "--fp8-remote",
        action="store_true",
        help="MiniMax-M2 as its remote code builds it (examples/minimax_m2), from an FP8 checkpoint: rank0load vs floor",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--fp8-remote: rounds of rank0load then floor")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fp8_remote and args.step:
        fp8 = os.path.join(args.out, f"minimax-m2-remote-fp8-l{args.layers}-e{args.experts}")
        {"rank0load": _fp8_rank0load, "floor": _fp8_floor}[args.step](fp8)
        return
    ckpt = os.path.join(args.out, f"qwen3-moe-l{args.layers}-e{args.experts}")
    if args.step == "fsdp-only":
        _fsdp_only(ckpt, args.router_bias)
        return
    if args.step:
        {"rank0load": _rank0load, "transformers": _transformers}[args.step](ckpt)
        return
    if not args.fp8_remote and not os.path.exists(os.path.join(ckpt, "model.safetensors.index.json")):
        _write(ckpt, args.layers, args.experts)
    import torch
    import transformers

    import rank0load

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, rank0load from "
        f"{os.path.dirname(rank0load.__file__)}, {args.layers} layers x {args.experts} experts",
        flush=True,
    )
    me = [
        os.path.abspath(__file__),
        "--out",
        args.out,
        "--layers",
        str(args.layers),
        "--experts",
        str(args.experts),
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks)]
    if args.fp8_remote:
        _fp8_main(args, torchrun, me)
        return
    if args.router_bias:  # the checkpoint holds no bias: the groups and their cost alone
        subprocess.run([*torchrun, *me, "--router-bias", "--step", "fsdp-only"], check=True)
        return
    for step in ("rank0load", "fsdp-only"):
        subprocess.run([*torchrun, *me, "--step", step], check=True)
    subprocess.run([sys.executable, *me, "--step", "transformers"], check=True)


if __name__ == "__main__":
    main()
