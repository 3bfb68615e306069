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

``--router-bias`` runs ``fsdp-only`` alone with a frozen fp32 ``e_score_correction_bias`` added to every
MoE block, as public MiniMax-M2 ports hold it: the shape on which a policy that isolates every dtype
island would give each of the 256 experts of each layer a group of its own.

Run it with the transformers whose per-expert layout you want (4.57 builds ``nn.ModuleList`` experts;
transformers 5 fuses them, which ``python -m rank0load.bench --model moe`` measures).
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

    total = sum(isinstance(m, FSDPModule) for m in model.modules())
    per_layer = sorted({sum(isinstance(m, FSDPModule) for m in x.modules()) for x in model.model.layers})
    return f"{total} FSDP groups ({'/'.join(map(str, per_layer))} per decoder layer)"


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
    """A frozen fp32 ``e_score_correction_bias`` Parameter on every MoE block, as public MiniMax-M2
    ports hold it (what made the policy before the routed-list rule give every expert a group)."""
    import torch
    from torch import nn

    for layer in model.model.layers:
        experts = len(layer.mlp.experts)
        bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32, device="meta"), requires_grad=False)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="./per-expert-out")
    parser.add_argument("--layers", type=int, default=62)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--router-bias",
        action="store_true",
        help="fsdp-only alone, with a frozen fp32 e_score_correction_bias on every MoE block (MiniMax-M2's shape)",
    )
    parser.add_argument("--step", help=argparse.SUPPRESS)
    args = parser.parse_args()
    ckpt = os.path.join(args.out, f"qwen3-moe-l{args.layers}-e{args.experts}")
    if args.step == "fsdp-only":
        _fsdp_only(ckpt, args.router_bias)
        return
    if args.step:
        {"rank0load": _rank0load, "transformers": _transformers}[args.step](ckpt)
        return
    if not os.path.exists(os.path.join(ckpt, "model.safetensors.index.json")):
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
    if args.router_bias:  # the checkpoint holds no bias: the groups and their cost alone
        subprocess.run([*torchrun, *me, "--router-bias", "--step", "fsdp-only"], check=True)
        return
    for step in ("rank0load", "fsdp-only"):
        subprocess.run([*torchrun, *me, "--step", step], check=True)
    subprocess.run([sys.executable, *me, "--step", "transformers"], check=True)


if __name__ == "__main__":
    main()
