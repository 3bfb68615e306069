"""Tiny transformers 5 MoE models and the checkpoint layouts they meet on the Hub (importable in spawned ranks).

transformers 5 holds each MoE layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]); ``save_pretrained`` (``save_original_format=True``, its default)
and Hub checkpoints store one 2-D tensor per expert:

  Mixtral, MiniMax-M2     ``model.layers.{l}.block_sparse_moe.experts.{e}.w1/w3/w2.weight``
  Qwen3-MoE, DeepSeek-V3  ``model.layers.{l}.mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``

Writers here: :func:`save` (that per-expert layout, or transformers' own fused layout with
``fused=True``), :func:`save_fp8` (the FP8 block-quantised layout of the MiniMax-M2 and DeepSeek-V3
Hub checkpoints), :func:`save_dequantized` (the same checkpoint with every FP8 weight dequantised by
:func:`dequantize`: the reference), and :func:`rewrite` (edit a saved checkpoint key by key).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable

import torch

FAMILIES = ("mixtral", "qwen3_moe", "minimax_m2", "deepseek_v3")
EXPERTS = 5  # divides neither 2 nor 3 ranks
SHARD = "20KB"  # several files and an index for every family


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def config(name: str):
    """The tiny config of ``name``: hidden 32, expert intermediate 24, 2 layers, 4 heads / 2 kv heads,
    vocab 64, 5 experts, top-2. 24 is no multiple of a 16 block: FP8 tests get partial blocks."""
    _quiet()
    import transformers

    common = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        bos_token_id=1,  # MiniMax-M2's defaults (200034, 200020) lie outside a vocabulary of 64
        eos_token_id=2,
    )
    if name == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=24, num_local_experts=EXPERTS)
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, intermediate_size=40, moe_intermediate_size=24, num_experts=EXPERTS, head_dim=8
        )
    if name == "minimax_m2":
        return transformers.MiniMaxM2Config(
            **common, intermediate_size=24, num_local_experts=EXPERTS, head_dim=8
        )
    if name == "deepseek_v3":
        # MLA projects every head's k and v from kv_b_proj: kv heads = heads, or attention fails.
        common["num_key_value_heads"] = common["num_attention_heads"]
        return transformers.DeepseekV3Config(
            **common,
            intermediate_size=40,  # the dense layer 0
            moe_intermediate_size=24,
            n_routed_experts=EXPERTS,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
            q_lora_rank=24,
            kv_lora_rank=16,  # kv_a_proj_with_mqa: 16 + 8 = 24 rows, like the Hub's 512 + 64 = 576
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
    raise KeyError(name)


def build(name: str, seed: int = 0):
    """``AutoModelForCausalLM.from_config`` with every parameter and every persistent floating buffer
    (the routers' ``e_score_correction_bias``) drawn from a seeded normal: no value is its default."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(name))
    nonpersistent = {
        f"{mn}.{b}" if mn else b for mn, m in model.named_modules() for b in m._non_persistent_buffers_set
    }
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        for n, b in model.named_buffers():
            if n not in nonpersistent and b.is_floating_point():
                b.normal_(0, 0.3)
    return model.eval()


def save(name: str, path: str | os.PathLike[str], *, fused: bool = False, seed: int = 0):
    """``save_pretrained`` in several shards. ``fused=False``: the per-expert layout (transformers'
    default, ``save_original_format=True``, which reverts its conversions); ``fused=True``: transformers'
    own fused layout (``save_original_format=False``). Returns the saved model."""
    import transformers

    model = build(name, seed)
    if int(transformers.__version__.split(".")[0]) < 5:  # per-expert modules: the Hub layout as they are
        assert not fused, "transformers 4.x has no fused experts"
        model.save_pretrained(path, max_shard_size=SHARD)
    else:
        model.save_pretrained(path, max_shard_size=SHARD, save_original_format=not fused)
    return model


def weight_map(path: str | os.PathLike[str]) -> dict[str, str]:
    """Key -> file: the index's, or every key of a single-file checkpoint's model.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        from safetensors import safe_open

        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            return dict.fromkeys(f.keys(), "model.safetensors")
    with open(index) as f:
        return json.load(f)["weight_map"]


def headers(path: str | os.PathLike[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every key of every shard, read from the safetensors headers: key -> (dtype, shape)."""
    out = {}
    for file in sorted(set(weight_map(path).values())):
        with open(os.path.join(path, file), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        out.update({k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()})
    return out


def rewrite(
    path: str | os.PathLike[str],
    edit: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    quantization_config: dict | None = None,
) -> None:
    """Rewrite every shard of a saved checkpoint in place: each key becomes ``edit(key, tensor)`` (no
    entry: the key is dropped; several: they stay in the same file). Rewrites the index to match (a
    single-file checkpoint keeps having none) and, if given, adds ``quantization_config`` to config.json."""
    from safetensors.torch import load_file, save_file

    path = str(path)
    indexed = os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    new_map: dict[str, str] = {}
    total = 0
    for file in sorted(set(weight_map(path).values())):
        out: dict[str, torch.Tensor] = {}
        for key, tensor in load_file(os.path.join(path, file)).items():
            out.update(edit(key, tensor))
        save_file(out, os.path.join(path, file), metadata={"format": "pt"})
        new_map.update(dict.fromkeys(out, file))
        total += sum(t.numel() * t.element_size() for t in out.values())
    if indexed:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(new_map.items()))}, f, indent=2
            )
    if quantization_config is not None:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = quantization_config
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)


# --- FP8 block quantisation, as in the MiniMax-M2 and DeepSeek-V3 Hub checkpoints --------------------
#
# weight: float8_e4m3fn [R, C]; weight_scale_inv: float32 [ceil(R/b0), ceil(C/b1)];
# dequantised[r, c] = weight[r, c].float() * weight_scale_inv[r // b0, c // b1], then cast to the
# model's dtype. The last row / column block is partial when R or C is no multiple of the block.
# config.json: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
#               "weight_block_size": [b0, b1]}. The block size must come from there: with partial blocks
#               the scale grid does not determine it (24 rows, 2 scale rows: blocks of 16, not 12).

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448

# Which 2-D weights the Hub checkpoints store in FP8; everything else stays bf16, the routers and
# e_score_correction_bias fp32 (MiniMax-M2), e_score_correction_bias fp32 (DeepSeek-V3).
_FP8_KEYS = {
    # MiniMax-M2: attention and experts; the router (gate), e_score_correction_bias, lm_head are not.
    "minimax_m2": re.compile(r"\.(self_attn\.[qkvo]_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$"),
    # Mixtral quantised the same way (MiniMax-M2's layout on a model transformers 4.57 has built in).
    "mixtral": re.compile(r"\.(self_attn\.[qkvo]_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$"),
    # DeepSeek-V3: every linear of attention, the dense MLP, shared and routed experts (not the router).
    "deepseek_v3": re.compile(r"_proj(_with_mqa)?\.weight$"),
}
FP32_KEYS = re.compile(r"(e_score_correction_bias|block_sparse_moe\.gate\.weight)$")


def is_fp8_key(name: str, key: str) -> bool:
    return bool(_FP8_KEYS[name].search(key))


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 weight_scale_inv): each block's max |w| maps to 448."""
    rows, cols = w.shape
    b0, b1 = block
    padded = torch.zeros(math.ceil(rows / b0) * b0, math.ceil(cols / b1) * b1)
    padded[:rows, :cols] = w.float()
    tiles = padded.unflatten(0, (-1, b0)).unflatten(2, (-1, b1))  # [R/b0, b0, C/b1, b1]
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).flatten(2).flatten(0, 1)
    return q[:rows, :cols].to(torch.float8_e4m3fn).contiguous(), scale_inv.contiguous()


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 ``q.float() * scale_inv`` per block (the last blocks partial): the documented formula,
    as in DeepSeek-V3's ``weight_dequant`` and transformers' ``_dequantize_fp8_weight``."""
    rows, cols = q.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * scale[:rows, :cols]


def fp8_config(block: tuple[int, int]) -> dict:
    """config.json's ``quantization_config``, as DeepSeek-V3's Hub config.json writes it. (transformers'
    ``FineGrainedFP8Config`` reads ``quant_method``, ``activation_scheme`` and ``weight_block_size``;
    ``fmt`` is the Hub's own field.)"""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }


def save_fp8(
    name: str, path: str | os.PathLike[str], block: tuple[int, int] = (128, 128), seed: int = 0
) -> None:
    """The Hub layout of ``name`` (``minimax_m2`` or ``deepseek_v3``): per-expert keys, FP8 weights with
    ``weight_scale_inv`` beside them, the other tensors bf16 (fp32 where the Hub keeps fp32)."""

    def edit(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if is_fp8_key(name, key):
            q, s = quantize(t, block)
            return {key: q, key.removesuffix("weight") + "weight_scale_inv": s}
        return {key: t.float() if FP32_KEYS.search(key) else t.to(torch.bfloat16)}

    save(name, path, seed=seed)
    rewrite(path, edit, quantization_config=fp8_config(block))


def save_dequantized(fp8_path: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Copy an FP8 checkpoint with every FP8 weight replaced by its float32 :func:`dequantize` and the
    scales and quantization_config dropped: transformers' ``from_pretrained`` of it is the reference."""
    import shutil

    shutil.copytree(fp8_path, path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    block = tuple(cfg.pop("quantization_config")["weight_block_size"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    from safetensors.torch import load_file

    scales: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map(path).values())):
        scales.update(
            {k: v for k, v in load_file(os.path.join(path, file)).items() if k.endswith("_scale_inv")}
        )

    def edit(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if key.endswith("weight_scale_inv"):
            return {}
        if t.dtype == torch.float8_e4m3fn:
            return {key: dequantize(t, scales[key.removesuffix("weight") + "weight_scale_inv"], block)}
        return {key: t}

    rewrite(path, edit)


def sample_inputs() -> dict:
    return {"input_ids": torch.tensor([[1, 5, 9, 2, 7, 3, 60, 33], [4, 4, 8, 1, 0, 6, 63, 17]])}
