"""A model as remote code defines it (importable in spawned ranks): a ``PreTrainedModel`` subclass that
lives outside transformers, as MiniMax-M2.7's ``modeling_minimax_m2.py`` does, with what that team adds:
an fp32 module inside every bf16 block (``router``, kept by ``_keep_in_fp32_modules_strict``) and an
fp32 head on top (``value_head``). It runs on transformers 4.57 and 5.x alike."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class TinyRemoteConfig(PretrainedConfig):
    model_type = "tiny_remote"

    def __init__(self, vocab_size: int = 61, hidden_size: int = 24, num_layers: int = 3, **kwargs) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        super().__init__(**kwargs)


class TinyRemoteBlock(nn.Module):
    def __init__(self, config: TinyRemoteConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.norm = nn.LayerNorm(h)
        self.up = nn.Linear(h, 2 * h, bias=False)
        self.down = nn.Linear(2 * h, h, bias=False)
        self.router = nn.Linear(h, 1, bias=True)  # fp32 inside a bf16 block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.router(x.float())).to(x.dtype)
        return x + gate * self.down(torch.relu(self.up(self.norm(x))))


class TinyRemotePreTrained(PreTrainedModel):
    config_class = TinyRemoteConfig
    base_model_prefix = "model"
    _no_split_modules = ["TinyRemoteBlock"]
    _keep_in_fp32_modules_strict = ["router"]

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)
            if getattr(module, "bias", None) is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.weight.data.fill_(1.0)
            module.bias.data.zero_()


class TinyRemoteModel(TinyRemotePreTrained):
    def __init__(self, config: TinyRemoteConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TinyRemoteBlock(config) for _ in range(config.num_layers))
        self.post_init()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x


class TinyRemoteForCausalLM(TinyRemotePreTrained):
    _keep_in_fp32_modules_strict = [
        "router",
        "value_head",
    ]  # transformers 4.57 checks the class's own modules

    def __init__(self, config: TinyRemoteConfig) -> None:
        super().__init__(config)
        self.model = TinyRemoteModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.value_head = nn.Linear(config.hidden_size, 1)  # an fp32 head on a bf16 body
        self.post_init()

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.model(input_ids)
        return self.lm_head(x), self.value_head(x.float())


def save(path: str, seed: int = 0) -> None:
    """Random (seeded) weights, saved with the class's own ``save_pretrained`` in several shards."""
    torch.manual_seed(seed)
    model = TinyRemoteForCausalLM(TinyRemoteConfig())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(path, max_shard_size="8KB")
