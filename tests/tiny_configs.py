"""Tiny random configs for every causal-LM architecture of the installed transformers, made by shrinking
each config class's defaults (importable in spawned ranks; tests/integrations/test_causal_lm_sweep.py).

:func:`tiny_config` takes ``CONFIG_MAPPING[model_type]()`` and shrinks it by rules keyed on attribute
names (hidden 64, 4 heads of 16 with 2 kv heads, intermediate 128, vocabulary 256, 4 experts top-2, ...),
the same rules for nested configs (a composite model's ``text_config``, ``vision_config``). Per-layer lists
(``layer_types``, ``mlp_layer_types``, ``layers_block_type``, ...) and layer-index lists (``mlp_only_layers``,
``moe_layers``, ...) are cut together to one layer of each kind, so a hybrid keeps one attention and one
mamba or linear-attention layer, a MoE model one dense and one sparse layer; then ``num_hidden_layers``
follows. Only the attributes the rules change are passed to the class, so whatever the class derives from
them (``head_dim``, a default ``layer_types``) it derives again. :data:`OVERRIDES` holds the few per-model
fields the generic rules cannot know.
"""

from __future__ import annotations

from typing import Any

import torch

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
MOE_INTERMEDIATE = 32
VOCAB = 256
POSITIONS = 128
EXPERTS = 4
TOP_K = 2
SHARD = "100KB"  # save_pretrained(max_shard_size=...): several files for every architecture

# attribute name -> the tiny value, applied where the default is an int (not a bool)
_SIZES: dict[str, int] = {
    **dict.fromkeys(
        [
            "hidden_size",
            "d_model",
            "n_embd",
            "dim",
            "model_dim",
            "embed_dim",
            "word_embed_proj_dim",
            "attention_hidden_size",
            "lru_width",
            "backbone_hidden_size",
            "out_hidden_size",
        ],
        HIDDEN,
    ),
    **dict.fromkeys(
        [
            "num_attention_heads",
            "n_head",
            "n_heads",
            "num_heads",
            "decoder_attention_heads",
            "encoder_attention_heads",
            "swa_num_attention_heads",
            "num_encoder_attention_heads",
            "num_decoder_attention_heads",
        ],
        HEADS,
    ),
    **dict.fromkeys(
        [
            "head_dim",
            "swa_head_dim",
            "kv_channels",
            "attention_head_dim",
            "dim_head",
            "attention_head_size",
            "d_kv",
            "qk_head_dim",
            "v_head_dim",
            "index_head_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_head_dim",
            "mamba_d_head",
            "mamba_head_dim",
        ],
        HEAD_DIM,
    ),
    **dict.fromkeys(
        [
            "intermediate_size",
            "ffn_dim",
            "decoder_ffn_dim",
            "encoder_ffn_dim",
            "n_inner",
            "ffn_hidden_size",
            "dff",
            "dim_ff",
            "intermediate_size_mlp",
            "dense_intermediate_size",
            "first_dense_intermediate_size",
            "mlp_only_intermediate_size",
        ],
        INTERMEDIATE,
    ),
    **dict.fromkeys(
        [
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "shared_intermediate_size",
            "moe_shared_expert_intermediate_size",
            "shared_experts_intermediate_size",
            "expert_ffn_hidden_size",
        ],
        MOE_INTERMEDIATE,
    ),
    **dict.fromkeys(["max_position_embeddings", "n_positions", "n_ctx"], POSITIONS),
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"], EXPERTS),
    **dict.fromkeys(["num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token"], TOP_K),
    **dict.fromkeys(["n_shared_experts", "num_shared_experts", "moe_num_shared_experts"], 1),
    **dict.fromkeys(["n_group", "num_expert_group", "topk_group"], 1),
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "o_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "index_n_heads": 2,
    "index_num_heads": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_num_heads": 4,
    "mamba_d_state": 16,
    "state_size": 16,
    "ssm_state_size": 16,
    "mamba_n_heads": 8,  # mamba_expand (2) * HIDDEN / mamba_d_head
    "mamba_num_heads": 8,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "mamba_chunk_size": 16,
    "chunk_size": 16,
    "rotary_dim": 8,  # a partial rotary embedding (CodeGen, GPT-J) within HEAD_DIM
    "mamba_headdim": 16,  # Zamba2: 2 * HIDDEN / n_mamba_heads (8)
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": VOCAB,
    "laurel_rank": 8,
    "depth": 2,  # vision towers (Qwen2-VL style)
}
_KV = ["num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "multi_query_group_num"]
_LAYERS = [
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "num_blocks",
    "decoder_layers",
    "num_decoder_layers",
    "encoder_layers",
    "num_encoder_layers",
]
_VOCABS = ["vocab_size", "decoder_vocab_size"]

# model_type -> fields the rules cannot know (applied last, to the top-level config): hybrids whose kinds of
# layer come from a period and an offset, or a pattern shorter than the model, or from nothing at all
OVERRIDES: dict[str, dict[str, Any]] = {
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "dots1": dict(
        n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1, first_k_dense_replace=1
    ),
    "deepseek_v2": dict(num_experts_per_tok=TOP_K),
    "mamba2": dict(num_heads=8),  # num_heads * head_dim = expand (2) * HIDDEN
    "reformer": dict(is_decoder=True),
}


def _n_layers(d: dict) -> tuple[str, int] | None:
    for name in _LAYERS:
        if isinstance(d.get(name), int) and not isinstance(d[name], bool):
            return name, d[name]
    return None


def _is_layer_index_list(name: str, v: Any, n: int) -> bool:
    return (
        isinstance(v, list)
        and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in v)
        and any(w in name for w in ("layers", "idxs", "layer_ids"))
    )


def _cut_layers(d: dict, out: dict) -> None:
    """Keep one layer of each kind: the kinds are given by every per-layer list (a list as long as the
    default depth) and every layer-index list, taken together; at least two layers."""
    found = _n_layers(d)
    if found is None:
        return
    key, n = found
    per_layer = {k: v for k, v in d.items() if isinstance(v, list) and len(v) == n and n > 1}
    index_lists = {k: v for k, v in d.items() if k not in per_layer and _is_layer_index_list(k, v, n)}
    kinds: dict[tuple, int] = {}
    for i in range(n):
        kind = tuple(repr(v[i]) for v in per_layer.values()) + tuple(i in v for v in index_lists.values())
        kinds.setdefault(kind, i)
    keep = sorted(kinds.values())
    for i in range(n):
        if len(keep) >= 2:
            break
        if i not in keep:
            keep = sorted([*keep, i])
    for k, v in per_layer.items():
        out[k] = [v[i] for i in keep]
    for k, v in index_lists.items():
        out[k] = [keep.index(i) for i in v if i in keep]
    for name in _LAYERS:
        if isinstance(d.get(name), int) and not isinstance(d[name], bool) and d[name] > len(keep):
            out[name] = len(keep)
    if isinstance(d.get("first_k_dense_replace"), int) and d["first_k_dense_replace"] > 1:
        out["first_k_dense_replace"] = 1  # layer 0 dense, layer 1 sparse


def _token_ids(d: dict, out: dict) -> None:
    """Special token ids beyond the tiny vocabulary move to its top (distinct ids stay distinct)."""
    moved: dict[int, int] = {}

    def fit(i: Any) -> Any:
        if isinstance(i, int) and not isinstance(i, bool) and i >= VOCAB:
            return moved.setdefault(i, VOCAB - 1 - len(moved))
        return i

    for k, v in d.items():
        if k.endswith(("_token_id", "_token_index", "_token_ids")):
            new = [fit(i) for i in v] if isinstance(v, list) else fit(v)
            if new != v:
                out[k] = new


def shrink(d: dict) -> dict:
    """The attributes of config dict ``d`` (``to_dict()`` of the defaults) that the rules change."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, bool) or not isinstance(v, int):
            continue
        if k in _SIZES and v > _SIZES[k]:
            out[k] = _SIZES[k]
        elif k in _VOCABS and v > VOCAB:
            out[k] = VOCAB
    heads = out.get("num_attention_heads", d.get("num_attention_heads"))
    for k in _KV:
        v = d.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            out[k] = heads if v == d.get("num_attention_heads") else min(v, KV_HEADS)
        elif k in d and v is None and k == "num_key_value_heads":
            out[k] = KV_HEADS
    if "head_dim" in d and d["head_dim"] is None and "num_attention_heads" in d:
        out["head_dim"] = HEAD_DIM  # some classes read it before deriving it
    if "qk_rope_head_dim" in d and d.get("head_dim") == d["qk_rope_head_dim"]:  # MLA: rotary head_dim
        out["head_dim"] = out["qk_rope_head_dim"]
    if isinstance(d.get("mamba_n_heads"), int) and isinstance(d.get("mamba_d_head"), int):
        expand = d.get("mamba_expand", 2)
        out["mamba_n_heads"] = expand * HIDDEN // out.get("mamba_d_head", d["mamba_d_head"])
    _cut_layers(d, out)
    _token_ids(d, out)
    for k, v in d.items():  # nested configs: the same rules, only what changes
        if isinstance(v, dict) and k.endswith("_config") and "model_type" in v:
            sub = shrink(v)
            if sub:
                out[k] = {"model_type": v["model_type"], **sub}
    return out


def tiny_config(model_type: str):
    """A tiny config of ``model_type`` from its class's defaults (see the module docstring)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    kwargs = shrink(cls().to_dict())
    kwargs.update(OVERRIDES.get(model_type, {}))
    return cls(**kwargs)


def random_model(config, seed: int = 0):
    """``AutoModelForCausalLM.from_config(config)`` in float32, every floating parameter moved off its
    initial value by seeded noise (std 0.05): zeros (biases, a router's correction) become nonzero, a norm's
    ones stay near one, so the logits stay finite."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.05)
    return model.eval()
