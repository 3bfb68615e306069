"""Data-parallel training as users run it: each rank its own batch, on 2 and 3 gloo ranks, the checkpoints
hidden from ranks other than 0, against the single-process reference with the same weights.

Each rank trains ``STEPS`` AdamW steps with ``rank0load.clip_grad_norm_`` on its own batch of two tokens
(small enough that ranks route their tokens to different experts: checked on the reference). The
reference is the ecosystem's own loader (``from_pretrained``, then ``get_peft_model`` with rank 0's
seed) and runs each step over every rank's batch: the loss of each rank's batch, and the gradient of
their mean, as the sum of each batch's backward divided by the world size (what FSDP2's averaging
reduce-scatter gives every rank; scaling the loss by 1/3 before a bf16 backward would round otherwise). Before each reference step, a
trainable parameter that no reference batch reached but FSDP2 reduced (zeros, since a group holding
routed experts reduce-scatters zeros for the experts a rank did not use) gets a zero gradient too, so
AdamW updates the same parameters on both sides. Tolerances: the loaded weights bit for bit; losses,
gradients, norms and trained parameters to float32 rounding where the trained parameters are float32
(``FP32_TOL``) and to bfloat16 rounding where they are bfloat16 (``BF16_TOL``; trained parameters
``BF16_TRAINED_TOL``): the reduce-scatter sums the ranks' gradients in another order than autograd does.

The models:
- ``moe_lora``: transformers' Mixtral (4.57: per-expert ``ModuleList``, only the experts hit run; newest:
  fused experts) in bf16, LoRA on attention and on the experts (4.57: ``w1``/``w2``/``w3`` modules;
  newest: the fused parameters through ``target_parameters``), through ``load_pretrained(peft_config=)``;
- ``remote_lora``: a remote-code per-expert MoE (``tests/remote_code/``: hit-only loop, an fp32
  ``e_score_correction_bias`` Parameter), LoRA on every linear layer including each expert's;
- ``remote_full``: the same model fully fine-tuned in bf16, its fp32 router bias frozen;
- ``remote_bias_trainable``: the seed team's first line, ``load_pretrained(TinyMoeForCausalLM, ckpt,
  dtype=bfloat16)``, everything trainable: the fp32 router bias (a Parameter on the MoE block beside the bf16
  expert list) is kept out of FSDP, replicated; it never receives a gradient and stays as loaded;
- ``remote_scaled``: that model with trainable fp32 scales no group can take, which do receive gradients that
  differ per rank: one on each MoE block's output (every rank) and one on each expert's output (only the
  ranks whose tokens reach it; none for an expert no rank reaches): replicated, averaged after each backward;
- ``head``: a new fp32 classification head on a frozen bf16 Llama body (``strict=False``);
- ``llama``: dense Llama, every parameter trained, float32.
Each per-expert MoE has one FSDP group per decoder layer and the root, whatever its expert count.
Replicated parameters stay bit-identical on every rank. And two refusals, on every rank alike: the
remote MoE loaded frozen whose parameters are made trainable afterwards (its fp32 bias then trains in the
bf16 layer's group: ``ModelMismatchError`` at the first forward, not FSDP's ``AssertionError``), and a
``shard_fn`` that gives every expert its own group. A ``shard_fn`` that freezes the bias and then runs the
default policy loads too.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

import pytest
import torch
from torch.distributed.tensor import DTensor

from rank0load.integrations._compat import can_reduce_scatter_unused_params
from tests import _dist, hf, moe_models
from tests.models import assert_same, gather, reference

pytestmark = [pytest.mark.slow, pytest.mark.torch_range, pytest.mark.transformers, pytest.mark.peft]

BF16 = torch.bfloat16
SEED = 1234
STEPS = 3
LR = 1e-2
MAX_NORM = 0.5  # small enough that clipping scales every step
TOKENS = 2
FP32_TOL = {"rtol": 1e-4, "atol": 1e-6}
BF16_TOL = {"rtol": 3e-2, "atol": 1e-3}
# AdamW moves an element by about LR whatever its gradient's size, so a bf16 gradient near zero whose
# rounding differs in sign moves it the other way: bf16-trained parameters agree to 2 LR.
BF16_TRAINED_TOL = {"rtol": 3e-2, "atol": 2 * LR}
EXPERTS = 8


def _transformers5() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def batch(step: int, rank: int, vocab: int) -> torch.Tensor:
    """Rank ``rank``'s own batch at ``step`` (a DistributedSampler's part)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(3, vocab, (1, TOKENS), generator=generator)


def labels(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 3, (1,), generator=torch.Generator().manual_seed(7000 + 1000 * step + rank))


# --- the models ---------------------------------------------------------------------------------------


def mixtral_config():
    config = moe_models.config("mixtral")
    config.num_local_experts = EXPERTS
    return config


def remote_config():
    from tests.remote_code.configuration_tiny_moe import TinyMoeConfig

    return TinyMoeConfig(num_local_experts=EXPERTS)


def lora_config(kind: str):
    from peft import LoraConfig

    if kind == "remote_lora":
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"]
        return LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    if _transformers5():
        return LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"],
            lora_dropout=0.0,
        )
    return LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "w1", "w2", "w3"], lora_dropout=0.0
    )


def remote_model(bias_trainable: bool = False, frozen: bool = False):
    """model_fn: the remote MoE from its config, its router bias frozen unless ``bias_trainable``,
    everything frozen with ``frozen``."""
    from tests.remote_code.modeling_tiny_moe import TinyMoeForCausalLM

    model = TinyMoeForCausalLM(remote_config())
    for n, p in model.named_parameters():
        p.requires_grad_(not frozen and (bias_trainable or not n.endswith("e_score_correction_bias")))
    return model


def _scaled_expert_forward(self, x: torch.Tensor) -> torch.Tensor:
    return (type(self).forward(self, x) * self.scale).to(x.dtype)


def _scaled_moe_forward(self, x: torch.Tensor) -> torch.Tensor:
    return (type(self).forward(self, x).float() * self.out_scale).to(x.dtype)


def scaled_model():
    """model_fn: the remote MoE in bf16, everything trainable, with fp32 scales that no FSDP group can take:
    ``block_sparse_moe.out_scale`` (beside the expert list) and ``experts.{e}.scale`` (inside it)."""
    import types

    model = remote_model(bias_trainable=True)
    hidden = model.config.hidden_size
    model.to(BF16)
    for layer in model.model.layers:
        moe = layer.block_sparse_moe
        moe.e_score_correction_bias.data = moe.e_score_correction_bias.data.float()
        moe.out_scale = torch.nn.Parameter(torch.ones(hidden))
        moe.forward = types.MethodType(_scaled_moe_forward, moe)
        for expert in moe.experts:
            expert.scale = torch.nn.Parameter(torch.ones(hidden))
            expert.forward = types.MethodType(_scaled_expert_forward, expert)
    return model


def freeze_bias_first(model, mesh) -> None:
    """The refusal's way out for load_pretrained users: freeze the router bias, then the default policy."""
    import rank0load

    for n, p in model.named_parameters():
        if n.endswith("e_score_correction_bias"):
            p.requires_grad_(False)
    rank0load.default_shard_fn(model, mesh)


def shard_each_expert(model, mesh) -> None:
    """A shard_fn as a user might write it: every expert its own group, then each layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        for expert in layer.block_sparse_moe.experts:
            fully_shard(expert, mesh=mesh)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


class WithHead(torch.nn.Module):
    """A new fp32 classification head on Llama's body (``model.*``, as the checkpoint names it)."""

    def __init__(self) -> None:
        from transformers import LlamaModel

        super().__init__()
        config = hf.config("llama_untied")
        self.model = LlamaModel(config)
        self.value_head = torch.nn.Linear(config.hidden_size, 3)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        logits = self.value_head(hidden[:, -1].float())
        return torch.nn.functional.cross_entropy(logits, labels)


def head_model() -> WithHead:
    """model_fn: the body in bf16 and frozen, the new head in fp32."""
    model = WithHead()
    for (
        p
    ) in model.model.parameters():  # parameters only: rotary inv_freq stays fp32, as from_pretrained keeps it
        p.data = p.data.to(BF16)
    model.model.requires_grad_(False)
    return model


# The checkpoint each job loads: a model family saved with its own save_pretrained.
CHECKPOINTS = {
    "moe_lora": "mixtral",
    "remote_lora": "remote",
    "remote_full": "remote",
    "remote_bias_trainable": "remote",
    "remote_scaled": "scaled",
    "unfrozen_later": "remote",
    "expert_groups": "remote",
    "frozen_in_shard_fn": "remote",
    "head": "llama",
    "llama": "llama",
}


def _save(root: str, kind: str) -> str:
    family = CHECKPOINTS[kind]
    path = os.path.join(root, family)
    if os.path.exists(path):
        return path
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    if family == "mixtral":
        model = AutoModelForCausalLM.from_config(mixtral_config())
    elif family == "remote":
        from tests.remote_code.modeling_tiny_moe import TinyMoeForCausalLM

        model = TinyMoeForCausalLM(remote_config())
    elif family == "scaled":
        model = scaled_model().float()
    else:
        model = hf.model_class("llama_untied")(hf.config("llama_untied"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0, 0.3 if "experts" in n or "gate" in n else 0.1)
            if n.endswith("scale"):
                p.add_(1.0)
    model.save_pretrained(path, max_shard_size="20KB")
    return path


# --- the ranks ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    kind: str
    ckpt: str


def _load(job: Job):
    import rank0load

    torch.manual_seed(SEED + torch.distributed.get_rank())  # rank 0's state decides the adapters
    if job.kind == "moe_lora":
        from transformers import AutoModelForCausalLM

        return rank0load.load_pretrained(
            AutoModelForCausalLM, job.ckpt, dtype=BF16, peft_config=lora_config(job.kind)
        )
    if job.kind == "remote_lora":
        from tests.remote_code.modeling_tiny_moe import TinyMoeForCausalLM

        return rank0load.load_pretrained(
            TinyMoeForCausalLM, job.ckpt, dtype=BF16, peft_config=lora_config(job.kind)
        )
    if job.kind == "remote_full":
        return rank0load.load_sharded(remote_model, job.ckpt, dtype=BF16)
    if job.kind == "remote_bias_trainable":  # the seed team's first line: no shard_fn, nothing frozen
        from tests.remote_code.modeling_tiny_moe import TinyMoeForCausalLM

        return rank0load.load_pretrained(TinyMoeForCausalLM, job.ckpt, dtype=BF16)
    if job.kind == "remote_scaled":
        return rank0load.load_sharded(scaled_model, job.ckpt)
    if job.kind == "unfrozen_later":
        model = rank0load.load_sharded(functools.partial(remote_model, frozen=True), job.ckpt, dtype=BF16)
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    if job.kind == "frozen_in_shard_fn":
        return rank0load.load_sharded(
            functools.partial(remote_model, bias_trainable=True),
            job.ckpt,
            dtype=BF16,
            shard_fn=freeze_bias_first,
        )
    if job.kind == "expert_groups":
        return rank0load.load_sharded(remote_model, job.ckpt, dtype=BF16, shard_fn=shard_each_expert)
    if job.kind == "head":
        return rank0load.load_sharded(head_model, job.ckpt, strict=False)
    if job.kind == "llama":
        from transformers import AutoModelForCausalLM

        return rank0load.load_pretrained(AutoModelForCausalLM, job.ckpt)
    raise KeyError(job.kind)


def _loss(model, kind: str, step: int, rank: int) -> torch.Tensor:
    vocab = 67 if kind in ("head", "llama") else 64
    ids = batch(step, rank, vocab)
    if kind == "head":
        return model(input_ids=ids, labels=labels(step, rank))
    return model(input_ids=ids, labels=ids).loss


def _groups(model) -> list[str]:
    from rank0load.integrations._compat import fsdp_groups

    return [name for name, _, _ in fsdp_groups(model)]


def _train_rank(job: Job) -> dict:
    import torch.distributed as dist

    import rank0load

    rank = dist.get_rank()
    model = _load(job)
    out: dict = {
        "loaded": gather(model),
        "groups": _groups(model),
        "replicated": model.rank0load_report.replicated,
        "plain": sorted(n for n, p in model.named_parameters() if not isinstance(p, DTensor)),
    }
    if job.kind == "frozen_in_shard_fn":  # loads; its training is remote_full's
        return out
    if job.kind in routed_trained() and not can_reduce_scatter_unused_params():
        return _refused_and_ways_out(model, job.kind, rank, out)
    model.train()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([p for _, p in trainable], lr=LR)
    out["losses"], out["grads"], out["norms"] = [], [], []
    for step in range(STEPS):
        loss = _loss(model, job.kind, step, rank)
        loss.backward()
        out["losses"].append(loss.detach().float())
        out["grads"].append({n: _full(p.grad) for n, p in trainable if p.grad is not None})
        out["norms"].append(rank0load.clip_grad_norm_([p for _, p in trainable], MAX_NORM))
        optimizer.step()
        optimizer.zero_grad()
    out["trained"] = {n: _full(p) for n, p in trainable}
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full tensor, a plain (replicated) one as it is: a copy."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def routed_trained() -> tuple[str, ...]:
    """The kinds whose groups hold trainable parameters inside a routed (per-expert) list: transformers
    4.57's Mixtral is per-expert, the newest's fuses its experts into parameters every token uses."""
    remote = ("remote_lora", "remote_full", "remote_bias_trainable", "remote_scaled")
    return remote if _transformers5() else ("moe_lora", *remote)


def _refused_and_ways_out(model, kind: str, rank: int, out: dict) -> dict:
    """torch < 2.13: the first training forward is refused on every rank; the message's ways out work
    with each rank's own batch: a forward under ``no_grad``, then training with the experts frozen."""
    from rank0load.errors import ModelMismatchError

    model.train()
    try:
        _loss(model, kind, 0, rank)
    except ModelMismatchError as exc:
        out["refused"] = str(exc)
    with torch.no_grad():
        out["no_grad_loss"] = _loss(model, kind, 0, rank).float()
    for n, p in model.named_parameters():
        if ".experts." in n:
            p.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR)
    out["frozen_losses"] = []
    for step in range(STEPS):
        loss = _loss(model, kind, step, rank)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out["frozen_losses"].append(loss.detach().float())
    return out


def _run_all(rank: int, world: int, root: str, jobs: dict[str, Job]) -> dict:
    hf._quiet()
    return _dist.run_jobs(
        rank,
        root,
        jobs,
        _train_rank,
        expects_error=lambda job: job.kind in ERRORS,
    )


ERRORS = ("unfrozen_later", "expert_groups")
TRAINED = (
    "moe_lora",
    "remote_lora",
    "remote_full",
    "remote_bias_trainable",
    "remote_scaled",
    "head",
    "llama",
)
KINDS = (*TRAINED, "frozen_in_shard_fn", *ERRORS)
REPLICATED = ("remote_bias_trainable", "remote_scaled")  # trained with parameters kept out of FSDP


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    hf._quiet()
    path = tmp_path_factory.mktemp("train_dp")
    for kind in KINDS:
        _save(str(path), kind)
    return str(path)


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ran(request, root) -> tuple[int, list[dict]]:
    jobs = {kind: Job(kind, _save(root, kind)) for kind in KINDS}
    results = _dist.ok(_dist.run(_run_all, request.param, root, jobs, timeout=600, pg_timeout=120))
    return request.param, results


# --- the reference -------------------------------------------------------------------------------------


def _reference(kind: str, ckpt: str, loaded: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    if kind == "moe_lora":
        from peft import get_peft_model

        return get_peft_model(AutoModelForCausalLM.from_pretrained(ckpt, dtype=BF16), lora_config(kind))
    if kind == "remote_lora":
        from peft import get_peft_model

        from tests.remote_code.modeling_tiny_moe import TinyMoeForCausalLM

        return get_peft_model(TinyMoeForCausalLM.from_pretrained(ckpt, dtype=BF16), lora_config(kind))
    if kind in ("remote_full", "remote_bias_trainable"):
        from tests.remote_code.modeling_tiny_moe import TinyMoeForCausalLM

        model = TinyMoeForCausalLM.from_pretrained(ckpt, dtype=BF16)
        for n, p in model.named_parameters():
            p.requires_grad_(kind == "remote_bias_trainable" or not n.endswith("e_score_correction_bias"))
        return model
    if kind == "remote_scaled":
        import glob

        from safetensors.torch import load_file

        model = scaled_model()
        state: dict[str, torch.Tensor] = {}
        for path in glob.glob(os.path.join(ckpt, "*.safetensors")):
            state.update(load_file(path))
        model.load_state_dict(state)  # cast to the model's dtypes, as the load casts
        return model
    if kind == "head":
        model = WithHead()
        model.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=BF16).model
        model.model.requires_grad_(False)
        with (
            torch.no_grad()
        ):  # the new head as rank0load initialised it (tests/api/test_pretrained checks how)
            model.value_head.weight.copy_(loaded["value_head.weight"])
            model.value_head.bias.copy_(loaded["value_head.bias"])
        return model
    if kind == "llama":
        return AutoModelForCausalLM.from_pretrained(ckpt)
    raise KeyError(kind)


def _experts_hit(model, kind: str, world: int, step: int) -> list[set[str]]:
    """Per rank, the per-expert modules its batch at ``step`` ran (empty for fused experts)."""
    hit: set[str] = set()
    hooks = [
        m.register_forward_hook(lambda mod, args, out, name=n: hit.add(name))
        for n, m in model.named_modules()
        if re.search(r"experts\.\d+$", n)
    ]
    out = []
    try:
        with torch.no_grad():
            for r in range(world):
                hit.clear()
                _loss(model, kind, step, r)
                out.append(set(hit))
    finally:
        for h in hooks:
            h.remove()
    return out


def _reference_run(kind: str, ckpt: str, world: int, first: dict) -> dict:
    """The reference's loaded weights, each step's per-rank losses, gradients and norm, and the
    trained parameters. ``first``: rank 0's result, for the new head's initial value and which
    parameters FSDP2 gave a (zero) gradient."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _reference(kind, ckpt, first["loaded"])
        out: dict = {"loaded": reference(model)}
        out["hits"] = _experts_hit(model, kind, world, 0)
        model.train()
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW([p for _, p in trainable], lr=LR)
        out["losses"], out["grads"], out["norms"] = [], [], []
        for step in range(STEPS):
            losses = []
            for r in range(world):  # each rank's backward, summed, then averaged: as FSDP2 reduces
                losses.append(_loss(model, kind, step, r))
                losses[-1].backward()
            for _, p in trainable:
                if p.grad is not None:
                    p.grad /= world
            for n, p in trainable:
                if p.grad is None and n in first["grads"][step]:
                    p.grad = torch.zeros_like(p)
            out["losses"].append([loss.detach().float() for loss in losses])
            out["grads"].append({n: p.grad.clone() for n, p in trainable if p.grad is not None})
            out["norms"].append(torch.nn.utils.clip_grad_norm_([p for _, p in trainable], MAX_NORM))
            optimizer.step()
            optimizer.zero_grad()
        out["trained"] = {n: p.detach().clone() for n, p in trainable}
        return out
    finally:
        torch.set_num_threads(threads)


OLD_FSDP = (
    "torch before 2.13 cannot train a routed list (no set_reduce_scatter_unused_params): refused instead"
)
NEW_FSDP = "this torch's FSDP2 reduce-scatters unused parameters: the routed kinds train"


@pytest.mark.parametrize("kind", TRAINED)
def test_each_rank_its_own_batch_trains_as_the_reference(ran, root, kind):
    if kind in routed_trained() and not can_reduce_scatter_unused_params():
        pytest.skip(OLD_FSDP)
    world, results = ran
    got = [r["jobs"][kind] for r in results]
    for r in results:
        assert r["touched"] == []
    want = _reference_run(kind, _save(root, kind), world, got[0])
    bf16_trained = kind in ("remote_full", "remote_bias_trainable", "remote_scaled")
    tol = BF16_TOL if bf16_trained else FP32_TOL
    if want["hits"][0]:  # per-expert: the batches reach different experts on different ranks
        assert len({frozenset(h) for h in want["hits"]}) > 1, want["hits"]
    for rank, res in enumerate(got):
        assert_same(res["loaded"], want["loaded"])
        for step in range(STEPS):
            torch.testing.assert_close(res["losses"][step], want["losses"][step][rank], **tol)
            assert sorted(res["grads"][step]) == sorted(want["grads"][step]), step
            for n, g in want["grads"][step].items():
                torch.testing.assert_close(res["grads"][step][n], g, **tol, msg=lambda m, n=n: f"{n}: {m}")
            torch.testing.assert_close(
                res["norms"][step], want["norms"][step].float(), **tol
            )  # torch: the grads' dtype
        trained_tol = BF16_TRAINED_TOL if bf16_trained else FP32_TOL
        for n, p in want["trained"].items():
            torch.testing.assert_close(res["trained"][n], p, **trained_tol, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("kind", ("moe_lora", "remote_lora", "remote_full", *REPLICATED))
def test_a_per_expert_layer_is_one_group(ran, kind):
    """One FSDP group per decoder layer and the root: none inside a routed expert list."""
    groups = ran[1][0]["jobs"][kind]["groups"]
    assert not [g for g in groups if "experts" in g], groups
    layers = sorted(g for g in groups if re.search(r"layers\.\d+$", g))
    assert len(layers) == 2 and len(groups) == 3, groups


def test_the_seed_models_router_bias_is_replicated_and_stays_as_loaded(ran):
    """load_pretrained(TinyMoeForCausalLM, ckpt, dtype=bfloat16), nothing frozen and no shard_fn: the fp32
    router bias beside the bf16 experts is reported replicated, a plain tensor, and (it never receives
    a gradient: it only shifts a top-k choice) after the training steps it is the loaded value on every
    rank, bit for bit."""
    if not can_reduce_scatter_unused_params():
        pytest.skip(OLD_FSDP)
    got = [r["jobs"]["remote_bias_trainable"] for r in ran[1]]
    biases = [f"model.layers.{i}.block_sparse_moe.e_score_correction_bias" for i in (0, 1)]
    for res in got:
        assert res["replicated"] == tuple(biases) and res["plain"] == biases, res["replicated"]
        for n in biases:
            assert res["loaded"][n].dtype == torch.float32
            assert torch.equal(res["trained"][n], res["loaded"][n]), n
            assert all(n not in grads for grads in res["grads"]), n


def test_replicated_parameters_with_gradients_stay_identical_on_every_rank(ran):
    """remote_scaled's fp32 scales: replicated (the MoE blocks' and every expert's), each rank's copy
    bit-identical after the AdamW steps (the comparison with the reference is
    test_each_rank_its_own_batch_trains_as_the_reference's); an expert's scale got a gradient where some
    rank reached it (none where no rank did: the reference test compares which have one)."""
    if not can_reduce_scatter_unused_params():
        pytest.skip(OLD_FSDP)
    got = [r["jobs"]["remote_scaled"] for r in ran[1]]
    replicated = got[0]["replicated"]
    assert "model.layers.0.block_sparse_moe.out_scale" in replicated, replicated
    assert f"model.layers.1.block_sparse_moe.experts.{EXPERTS - 1}.scale" in replicated, replicated
    assert len(replicated) == 2 * (2 + EXPERTS), replicated  # bias, out_scale and one per expert, per layer
    for res in got:
        assert res["replicated"] == replicated and res["plain"] == sorted(replicated)
        for n in replicated:
            assert torch.equal(res["trained"][n], got[0]["trained"][n]), n
    grads = got[0]["grads"][0]
    assert {f"model.layers.{i}.block_sparse_moe.out_scale" for i in (0, 1)} <= set(grads), sorted(grads)
    assert [n for n in replicated if ".experts." in n and n in grads], sorted(grads)


def test_the_refusals_way_out_a_shard_fn_that_freezes_first_loads(ran):
    for r in ran[1]:
        groups = r["jobs"]["frozen_in_shard_fn"]["groups"]
        assert len(groups) == 3 and not [g for g in groups if "experts" in g], groups


def test_requires_grad_changed_after_the_load_is_told_at_the_first_forward(ran):
    errors = [r["jobs"]["unfrozen_later"] for r in ran[1]]
    message = _dist.same_error(errors, "ModelMismatchError").message
    assert "float32" in message and "bfloat16" in message and "e_score_correction_bias" in message, message
    assert "AssertionError" not in message


def test_a_shard_fn_that_gives_experts_groups_is_refused_before_data_moves(ran):
    errors = [r["jobs"]["expert_groups"] for r in ran[1]]
    message = _dist.same_error(errors, "ModelMismatchError").message
    assert "model.layers.0.block_sparse_moe.experts.0" in message and "routed list" in message, message
    assert "shard_fn=None" in message, message


@pytest.mark.skipif(can_reduce_scatter_unused_params(), reason=NEW_FSDP)
def test_torch_before_2_13_refuses_to_train_a_routed_list_on_every_rank(ran, root):
    """The same refusal on every rank at the first training forward, before any collective (else an
    abort or a hang); the message's ways out run with each rank's own batch: a forward under no_grad
    gives the reference's loss, and training with the experts frozen takes its steps."""
    world, results = ran
    for kind in routed_trained():
        got = [r["jobs"][kind] for r in results]
        messages = {g.get("refused") for g in got}
        assert len(messages) == 1 and None not in messages, messages
        message = messages.pop()
        for words in ("2.13", "experts", "requires_grad_(False)", "torch.no_grad()"):
            assert words in message, message
        model = _reference(kind, _save(root, kind), got[0]["loaded"])
        for rank, res in enumerate(got):
            assert_same(res["loaded"], reference(model))
            with torch.no_grad():
                want = _loss(model, kind, 0, rank).float()
            torch.testing.assert_close(res["no_grad_loss"], want, **BF16_TOL)
            assert len(res["frozen_losses"]) == STEPS, res
            assert all(bool(torch.isfinite(x)) for x in res["frozen_losses"]), res["frozen_losses"]
