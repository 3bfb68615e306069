"""transformers models from tiny configs, saved with save_pretrained into several shards."""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch

TRANSFORMERS = version("transformers")


def needs_transformers_5(what: str) -> pytest.MarkDecorator:
    """Skip on transformers 4.x a test of what only transformers 5 has (fused MoE experts, MiniMax-M2,
    its conversion mapping); the 4.57 CI leg tests 4.57's own models in the files marked transformers."""
    return pytest.mark.skipif(
        int(TRANSFORMERS.split(".")[0]) < 5, reason=f"transformers {TRANSFORMERS} has no {what}"
    )


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def config(name: str):
    _quiet()
    from transformers import (
        BertConfig,
        GemmaConfig,
        GPT2Config,
        LlamaConfig,
        Qwen2Config,
        T5Config,
    )

    if name == "llama":
        return LlamaConfig(
            vocab_size=67,
            hidden_size=24,
            intermediate_size=37,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
    if name == "llama_untied":
        cfg = config("llama")
        cfg.tie_word_embeddings = False
        return cfg
    if name == "qwen2":
        return Qwen2Config(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=45,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    if name == "gemma":
        return GemmaConfig(
            vocab_size=53,
            hidden_size=16,
            intermediate_size=29,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=64,
        )
    if name == "gpt2":
        return GPT2Config(vocab_size=71, n_embd=24, n_layer=2, n_head=4, n_positions=40)
    if name == "t5":
        return T5Config(
            vocab_size=59,
            d_model=16,
            d_kv=4,
            d_ff=23,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            tie_word_embeddings=True,
        )
    if name == "bert":
        return BertConfig(
            vocab_size=73,
            hidden_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=31,
            max_position_embeddings=40,
        )
    raise KeyError(name)


def model_class(name: str):
    _quiet()
    import transformers as t

    return {
        "llama": t.LlamaForCausalLM,
        "llama_untied": t.LlamaForCausalLM,
        "qwen2": t.Qwen2ForCausalLM,
        "gemma": t.GemmaForCausalLM,
        "gpt2": t.GPT2LMHeadModel,
        "t5": t.T5ForConditionalGeneration,
        "bert": t.BertForMaskedLM,
    }[name]


class Factory:
    """Picklable model_fn: ``Factory("llama")()`` builds the model from its tiny config."""

    def __init__(self, name: str, dtype: torch.dtype | None = None) -> None:
        self.name = name
        self.dtype = dtype

    def __call__(self):
        model = model_class(self.name)(config(self.name))
        if self.dtype is not None:
            model = model.to(self.dtype)
        return model.eval()


def pretrained(name: str, seed: int = 0):
    """An eager model with random (seeded) weights, as a user's checkpoint would hold."""
    torch.manual_seed(seed)
    model = Factory(name)()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def sample_inputs(name: str) -> dict:
    ids = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 6]])
    if name == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :4]}
    return {"input_ids": ids}


def tp_config():
    """The tiny Llama with MLP width 38, which splits evenly over tp=2 but not again over dp=2 (19
    rows): FSDP2 then stores colwise weights as an uneven ``_StridedShard``. Two layers."""
    cfg = config("llama")
    cfg.intermediate_size = 38
    cfg.num_hidden_layers = 2
    return cfg


class TPLlama:
    def __call__(self):
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(tp_config()).eval()


class TPThenFSDP:
    """shard_fn: Megatron-style TP on each decoder layer over mesh["tp"], then FSDP2 over mesh["dp"]."""

    def __call__(self, model, mesh) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {
            name: ColwiseParallel()
            for name in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
            )
        }
        plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])


REMOTE_AUTO_MAP = {
    "AutoConfig": "configuration_tiny_moe.TinyMoeConfig",
    "AutoModelForCausalLM": "modeling_tiny_moe.TinyMoeForCausalLM",
}


def remote_code_files() -> dict[str, str]:
    """tests/remote_code/ as a checkpoint's remote code: ``configuration_tiny_moe.py`` and
    ``modeling_tiny_moe.py`` (which imports the first relatively, as real remote code does), as they are."""
    import os

    from tests import remote_code

    folder = os.path.dirname(os.path.abspath(remote_code.__file__))
    out = {}
    for name in ("configuration_tiny_moe.py", "modeling_tiny_moe.py"):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            out[name] = f.read()
    return out


def remote_code_checkpoint(folder: str, seed: int = 0) -> None:
    """A remote-code checkpoint in ``folder``: tests/remote_code's ``TinyMoeForCausalLM`` with random
    (seeded) weights, saved with ``save_pretrained`` in several files, its code beside it
    (:func:`remote_code_files`) and ``auto_map`` in config.json naming the config and model classes."""
    import json
    import os

    from tests.remote_code.configuration_tiny_moe import TinyMoeConfig
    from tests.remote_code.modeling_tiny_moe import TinyMoeForCausalLM

    _quiet()
    torch.manual_seed(seed)
    model = TinyMoeForCausalLM(TinyMoeConfig())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(folder, max_shard_size="40KB")
    for name, text in remote_code_files().items():
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(text)
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["auto_map"] = dict(REMOTE_AUTO_MAP)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
