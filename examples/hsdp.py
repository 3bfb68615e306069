"""HSDP: shard within a node, replicate across nodes (here a 2 x 2 mesh of 4 ranks).

torchrun --nproc-per-node 4 examples/hsdp.py CKPT
"""

from __future__ import annotations

import sys

import torch.distributed as dist
from _common import finish, init, say
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

import rank0load


def main(ckpt: str) -> None:
    device = init()
    nodes = 2  # replicas: on a real job, the number of nodes
    # --- recipe: hsdp ---
    mesh = init_device_mesh(
        device, (nodes, dist.get_world_size() // nodes), mesh_dim_names=("replicate", "shard")
    )
    model = rank0load.load_pretrained(AutoModelForCausalLM, ckpt, mesh)  # shards over "shard"
    # --- end recipe ---
    weight = model.model.embed_tokens.weight
    say(f"embed_tokens: {weight.placements} on {tuple(mesh.shape)}, local {tuple(weight.to_local().shape)}")
    say(f"loaded {model.rank0load_report.tensors} tensors: {set(model.rank0load_report.kinds.values())}")
    finish()


if __name__ == "__main__":
    main(sys.argv[1])
