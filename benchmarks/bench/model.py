"""The benchmark's model and checkpoint: a small Llama-style decoder, written without transformers.

(one process, no collectives) :func:`config_for_size` picks a shape for a checkpoint size,
:func:`write_checkpoint` writes it deterministically in bf16 as several safetensors shards plus
``model.safetensors.index.json`` (one shard's tensors in RAM at a time) and records the SHA-256 of
every tensor's bytes *as generated*, so verification catches a wrong load and a damaged file alike.
:func:`cached_checkpoint` reuses a checkpoint already in the output directory when it is complete.

Keys follow Hugging Face's Llama (``model.layers.3.self_attn.q_proj.weight`` ...). The head is tied
to the embedding and, as ``save_pretrained`` does, stored once under ``model.embed_tokens.weight``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import zlib
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = [
    "META_FILE",
    "BenchConfig",
    "BenchLlama",
    "cached_checkpoint",
    "config_for_size",
    "expected_inv_freq",
    "tensor_digest",
    "tensor_specs",
    "write_checkpoint",
]

META_FILE = "bench-meta.json"
_GENERATOR_VERSION = 1  # bump when the values written for a key change


@dataclass(frozen=True)
class BenchConfig:
    hidden: int = 2048
    layers: int = 8
    vocab: int = 32000
    heads: int = 16
    kv_heads: int = 4
    intermediate: int = 5504
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tag(self) -> str:
        return f"llama-h{self.hidden}-l{self.layers}-v{self.vocab}-i{self.intermediate}-kv{self.kv_heads}"


def _layer_params(hidden: int, intermediate: int, heads: int, kv_heads: int) -> int:
    kv = hidden // heads * kv_heads
    return 2 * hidden * hidden + 2 * kv * hidden + 3 * hidden * intermediate + 2 * hidden


def config_for_size(size_gb: float) -> BenchConfig:
    """A Llama-style shape whose bf16 checkpoint is close to ``size_gb`` (10^9 bytes).

    0.8 GB gives hidden 2048, 8 layers, vocab 32000 (the default); other sizes from 0.2 GB up keep
    those tensor shapes and change the number of layers, so a sweep grows the checkpoint without
    growing its largest tensor. Sizes too small for the embedding and one layer (within 20%) halve
    hidden size, vocab and MLP width until they fit (the smoke test's few MB).
    """
    if size_gb <= 0:
        raise ValueError(f"size_gb must be positive, got {size_gb}")
    target = size_gb * 1e9 / 2  # parameters, bf16
    hidden, vocab, intermediate, heads = 2048, 32000, 5504, 16
    while hidden > 64 and vocab * hidden + _layer_params(hidden, intermediate, heads, 4) > 1.2 * target:
        hidden, vocab, intermediate, heads = hidden // 2, vocab // 2, intermediate // 2, max(4, heads // 2)
    per_layer = _layer_params(hidden, intermediate, heads, 4)
    layers = max(1, round((target - vocab * hidden - hidden) / per_layer))
    return BenchConfig(
        hidden=hidden, layers=layers, vocab=vocab, heads=heads, kv_heads=4, intermediate=intermediate
    )


# --------------------------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: BenchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        kv = cfg.head_dim * cfg.kv_heads
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(cfg.hidden, kv, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(cfg.hidden, kv, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, s, c.heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, c.hidden))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class MLP(nn.Module):
    def __init__(self, cfg: BenchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class BenchDecoderLayer(nn.Module):
    def __init__(self, cfg: BenchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, dtype)
        self.self_attn = Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, dtype)
        self.mlp = MLP(cfg, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


def expected_inv_freq(cfg: BenchConfig) -> torch.Tensor:
    """The rotary frequencies, computed the way the model's constructor computes them."""
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))


class Rotary(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", expected_inv_freq(cfg), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class BenchModel(nn.Module):
    def __init__(self, cfg: BenchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden, dtype=dtype)
        self.layers = nn.ModuleList(BenchDecoderLayer(cfg, dtype) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, dtype)
        self.rotary_emb = Rotary(cfg)


class BenchLlama(nn.Module):
    """Llama-style causal LM, head tied to the embedding; parameters in ``dtype``, ``inv_freq`` fp32."""

    _no_split_modules: ClassVar[list[str]] = ["BenchDecoderLayer"]

    def __init__(self, cfg: BenchConfig, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = BenchModel(cfg, dtype)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, dtype=dtype)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        cos, sin = self.model.rotary_emb(torch.arange(ids.shape[1], device=ids.device))
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.model.norm(h))


# ---------------------------------------------------------------------------------------- checkpoint


def tensor_specs(cfg: BenchConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Checkpoint keys and shapes in file order (the tied head is stored once, as the embedding)."""
    kv = cfg.head_dim * cfg.kv_heads
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg.vocab, cfg.hidden))]
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (cfg.hidden,)),
            (p + "self_attn.q_proj.weight", (cfg.hidden, cfg.hidden)),
            (p + "self_attn.k_proj.weight", (kv, cfg.hidden)),
            (p + "self_attn.v_proj.weight", (kv, cfg.hidden)),
            (p + "self_attn.o_proj.weight", (cfg.hidden, cfg.hidden)),
            (p + "post_attention_layernorm.weight", (cfg.hidden,)),
            (p + "mlp.gate_proj.weight", (cfg.intermediate, cfg.hidden)),
            (p + "mlp.up_proj.weight", (cfg.intermediate, cfg.hidden)),
            (p + "mlp.down_proj.weight", (cfg.hidden, cfg.intermediate)),
        ]
    specs.append(("model.norm.weight", (cfg.hidden,)))
    return specs


def _generate(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic bf16 values for ``key``: N(0, 0.02) for matrices, 1 + N(0, 0.02) for norms."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()) ^ (_GENERATOR_VERSION << 32))
    out = torch.empty(shape, dtype=torch.bfloat16)
    flat = out.view(-1)
    step = 1 << 24  # fp32 scratch of at most 64 MB
    for start in range(0, flat.numel(), step):
        chunk = torch.randn(min(step, flat.numel() - start), generator=gen) * 0.02
        if len(shape) == 1:
            chunk += 1.0
        flat[start : start + chunk.numel()] = chunk.to(torch.bfloat16)
    return out


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (row-major, its own dtype)."""
    t = t.detach().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().data).hexdigest()


def _plan_shards(cfg: BenchConfig) -> list[list[tuple[str, tuple[int, ...]]]]:
    return _pack(tensor_specs(cfg))


def _pack(specs: list[tuple[str, tuple[int, ...]]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Greedy packing of bf16 tensors in file order into about four shards (never splitting a tensor)."""
    sizes = [2 * math.prod(s) for _, s in specs]
    limit = max(max(sizes), math.ceil(sum(sizes) / 4))
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for spec, size in zip(specs, sizes):
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += size
    return shards


def write_checkpoint(cfg: BenchConfig, directory: str, log=print) -> dict:
    """Write the checkpoint into ``directory`` (replaced); return its metadata (also in META_FILE)."""
    from safetensors.torch import save_file

    if os.path.exists(directory):
        shutil.rmtree(directory)
    os.makedirs(directory)
    shards = _plan_shards(cfg)
    n = len(shards)
    weight_map: dict[str, str] = {}
    digests: dict[str, str] = {}
    files: dict[str, int] = {}
    total = 0
    for i, specs in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {key: _generate(key, shape) for key, shape in specs}
        for key, t in tensors.items():
            digests[key] = tensor_digest(t)
            weight_map[key] = name
            total += t.numel() * t.element_size()
        path = os.path.join(directory, name)
        save_file(tensors, path, metadata={"format": "pt"})
        del tensors
        files[name] = os.path.getsize(path)
        log(f"  wrote {name} ({files[name] / 1e6:.1f} MB)")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    meta = {
        "generator_version": _GENERATOR_VERSION,
        "config": asdict(cfg),
        "total_bytes": total,
        "files": files,
        "digests": digests,
        "tied": {"lm_head.weight": "model.embed_tokens.weight"},
    }
    tmp = os.path.join(directory, META_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(
        tmp, os.path.join(directory, META_FILE)
    )  # written last: its presence marks a complete checkpoint
    return meta


def cached_checkpoint(cfg: Any, directory: str) -> dict | None:
    """The metadata of a complete checkpoint for ``cfg`` (a :class:`BenchConfig` or a
    :class:`~.moe.MoeConfig`) in ``directory``, or None."""
    try:
        with open(os.path.join(directory, META_FILE)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if meta.get("generator_version") != _GENERATOR_VERSION or meta.get("config") != asdict(cfg):
        return None
    present = {n for n in os.listdir(directory) if n.endswith(".safetensors")}
    if present != set(meta["files"]):  # the DCP reader lists the directory: no strays allowed
        return None
    for name, size in meta["files"].items():
        if os.path.getsize(os.path.join(directory, name)) != size:
            return None
    return meta
