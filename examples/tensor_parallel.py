"""Tensor parallel on each decoder layer, then FSDP2 over the data-parallel dimension (a 2 x 2 mesh of
4 ranks), a training step with ``rank0load.clip_grad_norm_`` (torch's own fails here: embeddings live
on ``mesh["dp"]``, TP weights on the 2-D mesh).

    torchrun --nproc-per-node 4 examples/tensor_parallel.py CKPT
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from _common import batch, finish, init, say
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import AutoModelForCausalLM

import rank0load


# --- recipe: tensor parallel ---
def tp_then_fsdp(model, mesh) -> None:
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def load(ckpt: str, device: str, tp: int = 2):
    mesh = init_device_mesh(device, (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
    return rank0load.load_pretrained(AutoModelForCausalLM, ckpt, mesh, shard_fn=tp_then_fsdp), mesh


# --- end recipe ---


def main(ckpt: str) -> None:
    device = init()
    model, mesh = load(ckpt, device)
    kinds = model.rank0load_report.kinds
    say(
        f"down_proj travels as {kinds['model.layers.0.mlp.down_proj.weight']!r}, "
        f"embed_tokens as {kinds['model.embed_tokens.weight']!r}"
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Every rank of a tensor-parallel group must see the same batch: seed by the dp coordinate.
    loss = model(**batch(model.config.vocab_size, device, step=0, rank=mesh["dp"].get_local_rank())).loss
    loss.backward()
    norm = rank0load.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    say(f"loss {loss.item():.4f}, grad norm {norm.item():.4f}")
    finish()


if __name__ == "__main__":
    main(sys.argv[1])
