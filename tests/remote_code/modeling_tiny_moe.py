"""A per-expert MoE as remote code defines it, shaped like the public MiniMax-M2 ports (imported in spawned
ranks as ``tests.remote_code.modeling_tiny_moe``; copied beside a checkpoint as its remote code).

What matters to data-parallel training here: each layer's experts are an ``nn.ModuleList`` of separate
modules (``block_sparse_moe.experts.{e}.w1/w2/w3``), and the MoE block calls **only the experts its
tokens were routed to**, so ranks with different batches run different experts. The router scores
are corrected by an fp32 ``e_score_correction_bias`` *Parameter* on the MoE block (kept in float32 under
``dtype=bfloat16`` by ``_keep_in_fp32_modules_strict``), trainable as the ports declare it, though it never
receives a gradient (it only shifts a top-k choice). Attention is plain causal attention without
rotary embeddings. Runs on transformers 4.57 and 5.x alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_tiny_moe import TinyMoeConfig


class TinyMoeRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class TinyMoeAttention(nn.Module):
    def __init__(self, config: TinyMoeConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_attention_heads
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, h // self.heads).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, h))


class TinyMoeExpert(nn.Module):
    def __init__(self, config: TinyMoeConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TinyMoeSparseMoeBlock(nn.Module):
    def __init__(self, config: TinyMoeConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = nn.ModuleList(TinyMoeExpert(config) for _ in range(config.num_local_experts))
        # Updated from load statistics, not by gradients; yet requires_grad=True, as the ports declare it.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_local_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        scores = torch.sigmoid(self.gate(flat).float())
        _, chosen = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1)
        weights = scores.gather(1, chosen)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e in torch.unique(chosen).tolist():  # only the experts a token was routed to run
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, self.experts[e](flat[token]) * weights[token, slot, None])
        return out.view(b, t, h)


class TinyMoeDecoderLayer(nn.Module):
    def __init__(self, config: TinyMoeConfig) -> None:
        super().__init__()
        self.input_layernorm = TinyMoeRMSNorm(config.hidden_size)
        self.self_attn = TinyMoeAttention(config)
        self.post_attention_layernorm = TinyMoeRMSNorm(config.hidden_size)
        self.block_sparse_moe = TinyMoeSparseMoeBlock(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class TinyMoePreTrainedModel(PreTrainedModel):
    config_class = TinyMoeConfig
    base_model_prefix = "model"
    _no_split_modules = ["TinyMoeDecoderLayer"]
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)
        elif isinstance(module, TinyMoeRMSNorm):
            module.weight.data.fill_(1.0)
        elif isinstance(module, TinyMoeSparseMoeBlock):
            module.e_score_correction_bias.data.zero_()


class TinyMoeModel(TinyMoePreTrainedModel):
    def __init__(self, config: TinyMoeConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TinyMoeDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = TinyMoeRMSNorm(config.hidden_size)
        self.post_init()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class TinyMoeForCausalLM(TinyMoePreTrainedModel):
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]  # transformers 4.57 reads the class's own

    def __init__(self, config: TinyMoeConfig) -> None:
        super().__init__(config)
        self.model = TinyMoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs
    ) -> CausalLMOutput:
        logits = self.lm_head(self.model(input_ids)).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)
