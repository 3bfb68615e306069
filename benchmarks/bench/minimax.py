"""The benchmark's MiniMax-M2-shaped FP8 checkpoint: the real tensor count at small widths (``--model minimax``).

(one process, no collectives) :class:`MiniMaxConfig` is MiniMax-M2's layout — 62 decoder layers of
256 experts, FP8 weights in 128 x 128 blocks — with every width small (hidden 128, expert width 128,
4 heads of 32, 2 kv heads, vocab 1024), so the checkpoint holds the real model's ~96,100 tensors in
~0.78 GB: what it measures is the cost per tensor, not per byte. :func:`write_checkpoint` writes it
in the Hub's layout, as transformers' ``save_pretrained`` names the keys (tests/project/test_bench.py
compares them with the FP8 layout of a tiny real MiniMax-M2): one safetensors file per layer plus
one for the embedding, final norm and head, ``model.safetensors.index.json`` and ``config.json``
(``quantization_config``: FP8 e4m3, ``weight_block_size`` [128, 128]). Per layer ``l``:

  ``model.layers.{l}.self_attn.{q,k,v,o}_proj.weight``     float8_e4m3fn, + ``.weight_scale_inv`` float32
  ``model.layers.{l}.self_attn.{q,k}_norm.weight``         bf16 [heads * head_dim], [kv_heads * head_dim]
  ``model.layers.{l}.{input,post_attention}_layernorm.weight``   bf16
  ``model.layers.{l}.block_sparse_moe.gate.weight``        float32 [E, H]
  ``model.layers.{l}.block_sparse_moe.e_score_correction_bias``   float32 [E]
  ``model.layers.{l}.block_sparse_moe.experts.{e}.w1/w3.weight`` [I, H], ``w2.weight`` [H, I]: float8 + scales

Values are deterministic per key (a generator seeded from the key's name; the experts of one layer
and projection drawn together): float8 bytes uniformly random with the NaN codes (``b & 0x7F ==
0x7F``) replaced by +-448, scales in [1e-4, 2.1e-3]. The metadata (``bench-meta.json``, written
last: it marks a complete checkpoint) holds the SHA-256 of every *model parameter* as
``rank0load.load_pretrained(AutoModelForCausalLM, ckpt, dtype=torch.bfloat16)`` must leave it
(transformers 5 fuses the experts: ``mlp.experts.gate_up_proj`` [E, 2I, H] is each expert's
``cat(w1, w3)``, ``mlp.experts.down_proj`` [E, H, I] the ``w2``s; a float8 weight becomes
``bf16(float32(q) * scale of its block)``; the router ``mlp.gate.weight`` is cast to bf16), and of
the persistent buffers (``mlp.e_score_correction_bias``, bf16). The reference dequantisation here is
torch's own float8 -> float32 conversion, not rank0load's table.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .model import _GENERATOR_VERSION, META_FILE, _generate, tensor_digest

__all__ = [
    "MiniMaxConfig",
    "attention_shapes",
    "build_model",
    "expected_buffers",
    "write_checkpoint",
]

MODEL_TYPE = "minimax_m2"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_WEIGHTS = ("w1", "w2", "w3")


@dataclass(frozen=True)
class MiniMaxConfig:
    """MiniMax-M2's tensor count (62 layers x 256 experts) with small widths; ``block``: the FP8 block."""

    layers: int = 62
    experts: int = 256
    hidden: int = 128
    intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    vocab: int = 1024
    block: int = 128
    top_k: int = 8

    @property
    def tag(self) -> str:
        return (
            f"minimax-m2-fp8-l{self.layers}-e{self.experts}-h{self.hidden}-i{self.intermediate}"
            f"-v{self.vocab}-b{self.block}"
        )

    def hf_config(self) -> Any:
        """transformers' ``MiniMaxM2Config`` for this shape (no ``quantization_config``: the model
        rank0load and the benchmark build holds bf16)."""
        _quiet()
        from transformers import MiniMaxM2Config

        return MiniMaxM2Config(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            num_local_experts=self.experts,
            num_experts_per_tok=min(self.top_k, self.experts),
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            bos_token_id=1,  # MiniMax-M2's defaults (200034, 200020) lie outside a small vocabulary
            eos_token_id=2,
            architectures=["MiniMaxM2ForCausalLM"],
            dtype="bfloat16",
        )

    def quantization_config(self) -> dict:
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [self.block, self.block],
        }


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def build_model(cfg: MiniMaxConfig) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config`` in bf16 (on the current default device: meta for a meta build)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(cfg.hf_config(), dtype=torch.bfloat16)


def expected_buffers(cfg: MiniMaxConfig) -> dict[str, torch.Tensor]:
    """The non-persistent rotary buffers, as transformers' rotary embedding computes them on the CPU."""
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RotaryEmbedding

    with torch.device("cpu"):
        rotary = MiniMaxM2RotaryEmbedding(config=cfg.hf_config())
    return {f"model.rotary_emb.{name}": b for name, b in rotary.named_buffers()}


def attention_shapes(cfg: MiniMaxConfig) -> dict[str, tuple[int, int]]:
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return {
        "q_proj": (q, cfg.hidden),
        "k_proj": (kv, cfg.hidden),
        "v_proj": (kv, cfg.hidden),
        "o_proj": (cfg.hidden, q),
    }


def expert_shape(cfg: MiniMaxConfig, w: str) -> tuple[int, int]:
    return (cfg.hidden, cfg.intermediate) if w == "w2" else (cfg.intermediate, cfg.hidden)


def grid(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    """The scale grid of a weight whose last two dims are ``shape[-2:]``."""
    return (*shape[:-2], math.ceil(shape[-2] / block), math.ceil(shape[-1] / block))


# ---------------------------------------------------------------------------------------- values


def _generator(key: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(key.encode()) ^ (_GENERATOR_VERSION << 32))


def _fp8(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Uniformly random float8_e4m3fn bytes, the NaN codes (0x7F, 0xFF) replaced by +-448 (0x7E, 0xFE)."""
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=_generator(key))
    b[(b & 0x7F) == 0x7F] -= 1
    return b.view(torch.float8_e4m3fn)


def _scale(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.rand(shape, generator=_generator(key)) * 2e-3 + 1e-4


def _f32(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(key)) * 0.1


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """The reference: bf16 of torch's ``float32(q)`` times the scale of each element's block (the last
    two dims are the matrix; leading dims batch). tests/moe_models.py ``dequantize``, batched."""
    rows, cols = q.shape[-2:]
    full = scale.repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :rows, :cols]
    return (q.to(torch.float32) * full).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------- checkpoint


def _layer(cfg: MiniMaxConfig, layer: int, digests: dict[str, str], buffers: dict[str, str]) -> dict:
    """One layer's checkpoint tensors; the model's digests recorded in ``digests`` / ``buffers``."""
    p, b = f"model.layers.{layer}.", cfg.block
    out: dict[str, torch.Tensor] = {}
    for proj, shape in attention_shapes(cfg).items():
        key = f"{p}self_attn.{proj}.weight"
        q, s = _fp8(key, shape), _scale(key + "_scale_inv", grid(shape, b))
        out[key], out[key + "_scale_inv"] = q, s
        digests[key] = tensor_digest(dequantize(q, s, b))
    for name, size in (
        ("self_attn.q_norm.weight", cfg.heads * cfg.head_dim),
        ("self_attn.k_norm.weight", cfg.kv_heads * cfg.head_dim),
        ("input_layernorm.weight", cfg.hidden),
        ("post_attention_layernorm.weight", cfg.hidden),
    ):
        out[p + name] = _generate(p + name, (size,))
        digests[p + name] = tensor_digest(out[p + name])
    gate = out[p + "block_sparse_moe.gate.weight"] = _f32(
        p + "block_sparse_moe.gate.weight", (cfg.experts, cfg.hidden)
    )
    digests[p + "mlp.gate.weight"] = tensor_digest(gate.to(torch.bfloat16))
    bias = out[p + "block_sparse_moe.e_score_correction_bias"] = _f32(
        p + "block_sparse_moe.e_score_correction_bias", (cfg.experts,)
    )
    buffers[p + "mlp.e_score_correction_bias"] = tensor_digest(bias.to(torch.bfloat16))
    fused: dict[str, torch.Tensor] = {}
    for w in EXPERT_WEIGHTS:
        batch = (cfg.experts, *expert_shape(cfg, w))
        # All experts of one projection drawn at once: expert e's values depend on its key's name alone.
        name = f"{p}block_sparse_moe.experts.*.{w}.weight"
        q, s = _fp8(name, batch), _scale(name + "_scale_inv", grid(batch, b))
        for e in range(cfg.experts):
            key = f"{p}block_sparse_moe.experts.{e}.{w}.weight"
            out[key], out[key + "_scale_inv"] = q[e].clone(), s[e].clone()  # save_file refuses shared storage
        fused[w] = dequantize(q, s, b)
    digests[p + "mlp.experts.gate_up_proj"] = tensor_digest(torch.cat((fused["w1"], fused["w3"]), dim=1))
    digests[p + "mlp.experts.down_proj"] = tensor_digest(fused["w2"])
    return out


def write_checkpoint(cfg: MiniMaxConfig, directory: str, log: Callable[[str], None] = print) -> dict:
    """Write the checkpoint into ``directory`` (replaced); return its metadata (also in META_FILE)."""
    from safetensors.torch import save_file

    if os.path.exists(directory):
        shutil.rmtree(directory)
    os.makedirs(directory)
    cfg.hf_config().save_pretrained(directory)  # config.json as save_pretrained writes it, then the Hub's
    with open(os.path.join(directory, "config.json")) as f:  # quantization_config added to it
        config = json.load(f)
    config["quantization_config"] = cfg.quantization_config()
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    n = cfg.layers + 1
    digests: dict[str, str] = {}
    buffers: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    files: dict[str, int] = {}
    total = 0
    for index in range(n):
        name = f"model-{index + 1:05d}-of-{n:05d}.safetensors"
        if index < cfg.layers:
            tensors = _layer(cfg, index, digests, buffers)
        else:
            tensors = {
                "model.embed_tokens.weight": _generate("model.embed_tokens.weight", (cfg.vocab, cfg.hidden)),
                "model.norm.weight": _generate("model.norm.weight", (cfg.hidden,)),
                "lm_head.weight": _generate("lm_head.weight", (cfg.vocab, cfg.hidden)),
            }
            digests.update({k: tensor_digest(t) for k, t in tensors.items()})
        path = os.path.join(directory, name)
        save_file(tensors, path, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        files[name] = os.path.getsize(path)
        del tensors
        if index % 16 == 15 or index == n - 1:
            log(f"  wrote {index + 1}/{n} files ({len(weight_map)} tensors)")
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2
        )
    meta = {
        "generator_version": _GENERATOR_VERSION,
        "model": MODEL_TYPE,
        "config": asdict(cfg),
        "total_bytes": total,
        "files": files,
        "checkpoint_tensors": len(weight_map),
        "digests": digests,
        "buffer_digests": buffers,
        "tied": {},
    }
    tmp = os.path.join(directory, META_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(directory, META_FILE))  # written last: marks a complete checkpoint
    return meta
