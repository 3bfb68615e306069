"""A MiniMax-M2-shaped MoE as its Hub remote code builds it on transformers 4.57: one module per
expert (``block_sparse_moe.experts.{e}.w1/w2/w3``), a router ``gate`` and an fp32
``e_score_correction_bias``, attention with grouped key/value heads and RMS norms over the whole
query and key projections, rotary positions computed in the forward. The checkpoint names are the
Hub's (``model.layers.{l}.self_attn.q_proj.weight``, ...), so an FP8 checkpoint in the Hub's layout
loads into it once dequantised.

Only the experts a token was routed to run: ranks with different batches run different experts,
which is what data-parallel training of it must survive. Runs on transformers 4.57 and 5.x.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_minimax_m2 import MiniMaxM2Config


class MiniMaxM2RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary positions on [batch, heads, tokens, head_dim], computed here (no buffers to restore)."""
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angle = torch.arange(x.shape[-2], dtype=torch.float32, device=x.device)[:, None] * freq
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class MiniMaxM2Attention(nn.Module):
    def __init__(self, config: MiniMaxM2Config) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.theta = config.rope_theta
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = MiniMaxM2RMSNorm(self.heads * d, config.rms_norm_eps)
        self.k_norm = MiniMaxM2RMSNorm(self.kv_heads * d, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor, n: int) -> torch.Tensor:
            return y.view(b, t, n, self.head_dim).transpose(1, 2)

        q = _rotate(heads(self.q_norm(self.q_proj(x)), self.heads), self.theta)
        k = _rotate(heads(self.k_norm(self.k_proj(x)), self.kv_heads), self.theta)
        v = heads(self.v_proj(x), self.kv_heads)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MiniMaxM2MLP(nn.Module):
    def __init__(self, config: MiniMaxM2Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MiniMaxM2SparseMoeBlock(nn.Module):
    def __init__(self, config: MiniMaxM2Config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = nn.ModuleList(MiniMaxM2MLP(config) for _ in range(config.num_local_experts))
        # Updated from routing statistics, not by gradients (it only shifts a top-k choice); kept in
        # float32, and requires_grad=True as public ports declare it (rank0load replicates it).
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


class MiniMaxM2DecoderLayer(nn.Module):
    def __init__(self, config: MiniMaxM2Config) -> None:
        super().__init__()
        self.input_layernorm = MiniMaxM2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MiniMaxM2Attention(config)
        self.post_attention_layernorm = MiniMaxM2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.block_sparse_moe = MiniMaxM2SparseMoeBlock(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class MiniMaxM2PreTrainedModel(PreTrainedModel):
    config_class = MiniMaxM2Config
    base_model_prefix = "model"
    _no_split_modules = ["MiniMaxM2DecoderLayer"]
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)
        elif isinstance(module, MiniMaxM2RMSNorm):
            module.weight.data.fill_(1.0)
        elif isinstance(module, MiniMaxM2SparseMoeBlock):
            module.e_score_correction_bias.data.zero_()


class MiniMaxM2Model(MiniMaxM2PreTrainedModel):
    def __init__(self, config: MiniMaxM2Config) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MiniMaxM2DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = MiniMaxM2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class MiniMaxM2ForCausalLM(MiniMaxM2PreTrainedModel):
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]  # transformers 4.57 reads the class's own

    def __init__(self, config: MiniMaxM2Config) -> None:
        super().__init__(config)
        self.model = MiniMaxM2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        hidden = self.model(input_ids)
        logits = self.lm_head(hidden).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, hidden_states=(hidden,) if output_hidden_states else None
        )
