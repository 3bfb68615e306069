"""The benchmark's MoE model and checkpoint: transformers' Qwen3-MoE, per-expert checkpoint, fused model.

(one process, no collectives) The model is ``AutoModelForCausalLM.from_config(cfg.hf_config(),
dtype=torch.bfloat16)``: a transformers 5 ``Qwen3MoeForCausalLM``, which holds each layer's experts
fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]), head not tied.

The checkpoint is written directly with safetensors, one shard's tensors in RAM at a time, in the
layout ``save_pretrained`` writes for that model and the Hub stores: one tensor per expert,
``model.layers.{l}.mlp.experts.{e}.gate_proj.weight`` [I, H], ``up_proj.weight`` [I, H],
``down_proj.weight`` [H, I] — the same keys, shapes and dtype (tests/project/test_bench.py compares them with
``save_pretrained``'s), plus ``config.json``. Values are :func:`~.model._generate`'s (deterministic per
key). :func:`write_checkpoint` records, per *model parameter*, the SHA-256 of the full tensor the model
must hold after loading: the tensor's own bytes, and for the fused experts the per-expert tensors'
bytes in (expert, gate, up) / (expert) order, which are the fused tensor's bytes in row-major order.

:func:`config_for_size` keeps the shapes of a scaled-down Qwen3-30B-A3B (hidden 1024, 16 experts of
width 512, 16 heads of 64, 4 kv heads, vocab 32000) and changes the number of layers with the size;
sizes too small for the embeddings and one layer halve hidden size, vocab and expert width.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .model import _GENERATOR_VERSION, META_FILE, _generate, _pack, tensor_digest

__all__ = [
    "MoeConfig",
    "build_model",
    "config_for_size",
    "expected_buffers",
    "fuse_experts",
    "tensor_specs",
    "write_checkpoint",
]

MODEL_TYPE = "qwen3_moe"


@dataclass(frozen=True)
class MoeConfig:
    hidden: int = 1024
    layers: int = 12
    vocab: int = 32000
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    moe_intermediate: int = 512
    experts: int = 16
    top_k: int = 2

    @property
    def tag(self) -> str:
        return (
            f"qwen3moe-h{self.hidden}-l{self.layers}-v{self.vocab}-e{self.experts}"
            f"-i{self.moe_intermediate}-kv{self.kv_heads}"
        )

    def hf_config(self) -> Any:
        """The transformers ``Qwen3MoeConfig``: every layer sparse, head untied, bf16."""
        _quiet()
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim: a config attribute, taken as a kwarg
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=3 * self.hidden,  # the dense MLP's; no layer has one (mlp_only_layers=[])
            moe_intermediate_size=self.moe_intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            num_experts=self.experts,
            num_experts_per_tok=self.top_k,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            architectures=["Qwen3MoeForCausalLM"],
            dtype="bfloat16",
        )


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def build_model(cfg: MoeConfig) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config`` in bf16 (on the current default device: meta for a meta build)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(cfg.hf_config(), dtype=torch.bfloat16)


def expected_buffers(cfg: MoeConfig) -> dict[str, torch.Tensor]:
    """The non-persistent rotary buffers, as transformers' rotary embedding computes them on the CPU."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    with torch.device("cpu"):
        rotary = Qwen3MoeRotaryEmbedding(config=cfg.hf_config())
    return {f"model.rotary_emb.{name}": b for name, b in rotary.named_buffers()}


def _layer_params(cfg: MoeConfig) -> int:
    attn = 2 * cfg.hidden * cfg.heads * cfg.head_dim + 2 * cfg.hidden * cfg.kv_heads * cfg.head_dim
    return (
        attn + 2 * cfg.head_dim + 2 * cfg.hidden + cfg.experts * cfg.hidden * (1 + 3 * cfg.moe_intermediate)
    )


def config_for_size(size_gb: float) -> MoeConfig:
    """A Qwen3-MoE shape whose bf16 checkpoint is close to ``size_gb`` (10^9 bytes); 0.8 GB: 12 layers."""
    if size_gb <= 0:
        raise ValueError(f"size_gb must be positive, got {size_gb}")
    target = size_gb * 1e9 / 2  # parameters, bf16
    cfg = MoeConfig(layers=1)
    while cfg.hidden > 64 and 2 * cfg.vocab * cfg.hidden + _layer_params(cfg) > 1.2 * target:
        heads = max(4, cfg.heads // 2)
        cfg = MoeConfig(
            hidden=cfg.hidden // 2,
            layers=1,
            vocab=cfg.vocab // 2,
            heads=heads,
            kv_heads=min(cfg.kv_heads, heads),
            head_dim=cfg.hidden // 2 // heads,
            moe_intermediate=cfg.moe_intermediate // 2,
        )
    layers = max(1, round((target - 2 * cfg.vocab * cfg.hidden - cfg.hidden) / _layer_params(cfg)))
    return MoeConfig(**{**asdict(cfg), "layers": layers})


# ---------------------------------------------------------------------------------------- checkpoint


def expert_key(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def fused_key(layer: int, name: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{name}"


def tensor_specs(cfg: MoeConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Checkpoint keys and shapes in file order: per layer, the experts in order, each gate, up, down."""
    h, i, q, kv = cfg.hidden, cfg.moe_intermediate, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg.vocab, h))]
    for layer in range(cfg.layers):
        p = f"model.layers.{layer}."
        specs += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "self_attn.q_norm.weight", (cfg.head_dim,)),
            (p + "self_attn.k_norm.weight", (cfg.head_dim,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate.weight", (cfg.experts, h)),
        ]
        for e in range(cfg.experts):
            specs += [
                (expert_key(layer, e, "gate_proj"), (i, h)),
                (expert_key(layer, e, "up_proj"), (i, h)),
                (expert_key(layer, e, "down_proj"), (h, i)),
            ]
    specs += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg.vocab, h))]
    return specs


def _bytes(t: torch.Tensor) -> memoryview:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().data


def write_checkpoint(cfg: MoeConfig, directory: str, log=print) -> dict:
    """Write the checkpoint into ``directory`` (replaced); return its metadata (also in META_FILE).

    ``digests`` maps every *model parameter* (fused experts included) to the SHA-256 of the full
    tensor it must hold; ``checkpoint_tensors`` counts the checkpoint's keys.
    """
    from safetensors.torch import save_file

    if os.path.exists(directory):
        shutil.rmtree(directory)
    os.makedirs(directory)
    cfg.hf_config().save_pretrained(directory)  # config.json, as save_pretrained writes it
    specs = tensor_specs(cfg)
    shards = _pack(specs)
    n = len(shards)
    # The fused tensors' bytes are the experts' bytes in file order: hash them as they are generated.
    fused = {
        fused_key(la, name): hashlib.sha256()
        for la in range(cfg.layers)
        for name in ("gate_up_proj", "down_proj")
    }
    weight_map: dict[str, str] = {}
    digests: dict[str, str] = {}
    files: dict[str, int] = {}
    total = 0
    params = 0
    for index, shard in enumerate(shards):
        name = f"model-{index + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for key, shape in shard:
            t = _generate(key, shape)
            tensors[key] = t
            parts = key.split(".")
            if parts[3:5] == ["mlp", "experts"] and parts[5].isdigit():
                layer, proj = int(parts[2]), parts[6]
                fused[fused_key(layer, "down_proj" if proj == "down_proj" else "gate_up_proj")].update(
                    _bytes(t)
                )
            else:
                digests[key] = tensor_digest(t)
            weight_map[key] = name
            total += t.numel() * t.element_size()
            params += t.numel()
        path = os.path.join(directory, name)
        save_file(tensors, path, metadata={"format": "pt"})
        del tensors
        files[name] = os.path.getsize(path)
        log(f"  wrote {name} ({files[name] / 1e6:.1f} MB)")
    digests.update({key: h.hexdigest() for key, h in fused.items()})
    index_doc = {
        "metadata": {"total_parameters": params, "total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index_doc, f, indent=2)
    meta = {
        "generator_version": _GENERATOR_VERSION,
        "model": MODEL_TYPE,
        "config": asdict(cfg),
        "total_bytes": total,
        "files": files,
        "checkpoint_tensors": len(specs),
        "digests": digests,
        "tied": {},
    }
    tmp = os.path.join(directory, META_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(directory, META_FILE))  # written last: marks a complete checkpoint
    return meta


# ------------------------------------------------------------------------------------------ loading


def fuse_experts(state: dict[str, torch.Tensor], cfg: MoeConfig) -> dict[str, torch.Tensor]:
    """What a user does to load this checkpoint into the fused model with a full state dict: replace,
    layer by layer, the per-expert tensors by ``torch.stack`` of each expert's ``torch.cat((gate, up))``
    and ``torch.stack`` of the experts' ``down_proj`` (popping the per-expert tensors as they are used). In place."""
    for layer in range(cfg.layers):
        gate = [state.pop(expert_key(layer, e, "gate_proj")) for e in range(cfg.experts)]
        up = [state.pop(expert_key(layer, e, "up_proj")) for e in range(cfg.experts)]
        state[fused_key(layer, "gate_up_proj")] = torch.stack([torch.cat((g, u)) for g, u in zip(gate, up)])
        del gate, up
        down = [state.pop(expert_key(layer, e, "down_proj")) for e in range(cfg.experts)]
        state[fused_key(layer, "down_proj")] = torch.stack(down)
        del down
    return state


def expert_views(name: str, local: torch.Tensor, first: int, cfg: MoeConfig) -> dict[str, torch.Tensor]:
    """Checkpoint keys -> views into this rank's rows of a fused expert parameter ``name`` whose local
    rows are experts ``first, first + 1, ...``: for DCP to read each owned expert's tensors in place."""
    layer = int(name.split(".")[2])
    out: dict[str, torch.Tensor] = {}
    for row in range(local.shape[0]):
        e = first + row
        if name.endswith("gate_up_proj"):
            i = cfg.moe_intermediate
            out[expert_key(layer, e, "gate_proj")] = local[row, :i]
            out[expert_key(layer, e, "up_proj")] = local[row, i:]
        else:
            out[expert_key(layer, e, "down_proj")] = local[row]
    return out


def is_fused_expert(name: str) -> bool:
    return name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
