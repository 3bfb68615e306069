"""The config of the tiny MiniMax-M2-shaped MoE (remote code: shipped beside the weights)."""

from __future__ import annotations

from transformers import PretrainedConfig


class TinyMoeConfig(PretrainedConfig):
    model_type = "tiny_moe"

    def __init__(
        self,
        vocab_size: int = 64,
        hidden_size: int = 32,
        intermediate_size: int = 24,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_local_experts: int = 7,
        num_experts_per_tok: int = 2,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_local_experts = num_local_experts
        self.num_experts_per_tok = num_experts_per_tok
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
