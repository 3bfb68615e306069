"""The config of a MiniMax-M2-shaped MoE as its remote code defines it (shipped beside the weights; read
with ``trust_remote_code=True``)."""

from __future__ import annotations

from transformers import PretrainedConfig


class MiniMaxM2Config(PretrainedConfig):
    # Not "minimax_m2": PEFT on transformers 5 reads that model_type as transformers' own fused
    # MiniMax-M2 and turns LoRA targets w1/w2/w3 into target_parameters this per-expert model lacks.
    model_type = "minimax_m2_per_expert"

    def __init__(
        self,
        vocab_size: int = 1024,
        hidden_size: int = 128,
        intermediate_size: int = 128,
        num_hidden_layers: int = 62,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        head_dim: int = 32,
        num_local_experts: int = 256,
        num_experts_per_tok: int = 8,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 5_000_000.0,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.num_local_experts = num_local_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
