"""The seed team's stack in one script: a MiniMax-M2-shaped MoE whose code ships with the checkpoint
(``trust_remote_code=True``, one module per expert as transformers 4.57 runs it), FP8 block weights
dequantised into bf16, a new fp32 value head on the frozen body, LoRA on attention and on every expert,
data-parallel steps with a different batch on every rank, then the adapter and the head saved and
resumed.

    python examples/remote_fp8_moe.py --write CKPT                       # a tiny FP8 checkpoint + its code
    torchrun --nproc-per-node 2 examples/remote_fp8_moe.py CKPT OUT_DIR

Only rank 0 reads CKPT: the other ranks receive the config and the model's code from it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
from _common import batch, finish, init, say
from peft import LoraConfig
from torch import nn
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

import rank0load

CODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "minimax_m2")
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "w1", "w2", "w3"])
STEPS = 3


def value_target(input_ids: torch.Tensor) -> torch.Tensor:
    """A toy per-sequence regression target for the value head (your rewards go here)."""
    return (input_ids.float().mean(-1) / 64.0).to(input_ids.device)


def main(ckpt: str, out_dir: str) -> None:
    device = init()
    torch.manual_seed(0)  # rank 0's random state draws lora_A, the same on every rank
    # --- recipe: remote code, FP8, new head, LoRA ---
    model = rank0load.load_pretrained(
        AutoModelForCausalLM, ckpt, dtype=torch.bfloat16, trust_remote_code=True, peft_config=LORA
    )
    mesh = next(model.parameters()).device_mesh  # the mesh load_pretrained built (one dim, every rank)
    hidden = model.config.hidden_size
    torch.manual_seed(1)  # the new head: fp32, drawn alike on every rank, sharded on the same mesh
    head = fully_shard(nn.Linear(hidden, 1, device=device), mesh=mesh)

    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad] + list(head.parameters())
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    for step in range(STEPS):
        data = batch(model.config.vocab_size, device, step)  # this rank's own batch
        out = model(**data, output_hidden_states=True)
        value = head(out.hidden_states[-1][:, -1].float()).squeeze(-1)
        loss = out.loss + nn.functional.mse_loss(value, value_target(data["input_ids"]))
        loss.backward()
        norm = rank0load.clip_grad_norm_(trainable, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        say(f"step {step}: loss {loss.item():.6f}, grad norm {norm.item():.6f}")

    rank0load.save_sharded(model, os.path.join(out_dir, "adapter"), adapter="default")
    rank0load.save_sharded(head, os.path.join(out_dir, "head"))

    # Resume: base, adapter and head, each read on rank 0 only.
    resumed = rank0load.load_pretrained(
        AutoModelForCausalLM, ckpt, dtype=torch.bfloat16, trust_remote_code=True, peft_config=LORA,
        adapter=os.path.join(out_dir, "adapter"),
    )  # fmt: skip
    resumed_head = rank0load.load_sharded(lambda: nn.Linear(hidden, 1), os.path.join(out_dir, "head"), mesh)
    # --- end recipe ---
    pairs = [(a, b) for (n, a), b in zip(model.named_parameters(), resumed.parameters()) if "lora_" in n]
    pairs += list(zip(head.parameters(), resumed_head.parameters()))
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in pairs)
    say(f"resumed {len(pairs)} adapter and head tensors, equal to the trained ones: {same}")
    finish()


# ------------------------------------------------------------------ the example's own FP8 checkpoint


def _quantize(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hub's FP8 block layout: float8_e4m3fn values and one float32 ``weight_scale_inv`` per
    ``block`` x ``block`` tile (value = float8 x scale)."""
    rows, cols = weight.shape
    grid = (-(-rows // block), -(-cols // block))
    padded = torch.zeros(grid[0] * block, grid[1] * block)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(grid[0], block, grid[1], block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def write_checkpoint(folder: str, block: int = 32) -> None:
    """A tiny MiniMax-M2-shaped checkpoint in the Hub's FP8 layout, with its code beside it and
    ``auto_map`` in config.json, as MiniMax publishes theirs."""
    from safetensors.torch import save_file

    sys.path.insert(0, os.path.dirname(CODE))
    from minimax_m2.configuration_minimax_m2 import MiniMaxM2Config
    from minimax_m2.modeling_minimax_m2 import MiniMaxM2ForCausalLM

    config = MiniMaxM2Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MiniMaxM2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:  # the router bias small beside the gate's scores: tokens spread over the experts
                p.normal_(0, 0.01 if name.endswith("e_score_correction_bias") else 0.1)
    os.makedirs(folder, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        if t.dim() == 2 and ("self_attn" in key or "experts" in key):
            tensors[key], tensors[key + "_scale_inv"] = _quantize(t, block)
        elif "gate" in key or "e_score_correction_bias" in key:
            tensors[key] = t.float()  # the router as the Hub stores it
        else:
            tensors[key] = t.to(torch.bfloat16)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    raw["architectures"] = ["MiniMaxM2ForCausalLM"]
    raw["auto_map"] = {
        "AutoConfig": "configuration_minimax_m2.MiniMaxM2Config",
        "AutoModelForCausalLM": "modeling_minimax_m2.MiniMaxM2ForCausalLM",
    }
    raw["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block],
    }  # fmt: skip
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    for name in ("configuration_minimax_m2.py", "modeling_minimax_m2.py"):
        shutil.copy(os.path.join(CODE, name), folder)


if __name__ == "__main__":
    if sys.argv[1] == "--write":
        write_checkpoint(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
