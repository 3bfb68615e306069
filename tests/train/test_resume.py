"""A training run that stops and resumes as users rely on it (issue 54, items 4 and 5): on 2 and 3 gloo
ranks, each rank its own batch, the checkpoints hidden from ranks other than 0, ``2N`` steps straight equal
``N`` steps + ``save_sharded(optimizer=, training_state=)`` + fresh processes + the model loaded from the save
+ the optimizer built + ``load_training_state`` + ``N`` steps, bit for bit: every parameter's full tensor,
every optimizer state tensor (step counts included), the param groups, each step's loss and lr.

Every run draws its batches from the global RNG, the same on every rank (each rank takes its own row, as a
DistributedSampler's shuffle does), and steps a ``StepLR`` that halves the lr one step after the stop: the RNG
state and the scheduler's state go through ``training_state``, so a resume that lost either draws other batches
or keeps another lr. The runs of one world size share one spawn per phase (straight + stopped, then resumed), as
tests/train/test_train_dp.py's jobs do.

The cases (``CASES``): dense Llama fully fine-tuned in fp32 under each optimizer (AdamW foreach, AdamW fused,
Adam amsgrad, SGD momentum with a frozen ``lm_head`` in the optimizer that never gets state, AdamW with two
param groups of different lr, saved in several files); LoRA + an fp32 head on a frozen bf16 Llama body (the
optimizer over the trainable subset); Mixtral fully fine-tuned (transformers 4.57: per-expert, with experts no
rank reached; the newest: fused experts); the remote-code MoE of tests/remote_code in bf16 with its fp32
router bias frozen, and with it trainable (``remote_moe_trainable_bias``: replicated, its gradient
averaged); TP + FSDP2 on a dp=2 x tp=2 mesh (4 ranks). Saved at 2 ranks, every case is
restored at 3 and at 1 rank, bit-identical to what was saved (gathered before the save, and the files as
safetensors reads them). Refusals, the same on every rank with the optimizer and the model left as they were:
another optimizer class, a parameter missing or added, another grouping, a state shape, a missing state key,
weights and state from different saves (either way, and files mixed), no training state, a save into a file;
a rank killed mid-save leaves the previous training checkpoint byte for byte.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from tests import _dist, hf, moe_models
from tests.models import assert_same, gather, gather_optimizer, optimizer_groups, read_optimizer_files

pytestmark = [pytest.mark.slow, pytest.mark.torch_range, pytest.mark.transformers, pytest.mark.peft]

BF16 = torch.bfloat16
N = 2  # steps before the stop, and after it
SEED = 1234  # the model's random state (rank 0's decides the adapters and the new head)
DATA_SEED = 99  # the data order: the same on every rank
LR = 1e-2
TOKENS = 2  # per rank and step: few enough that MoE ranks reach different experts, and some none
EXPERTS = 8
STEP_SIZE = N + 1  # StepLR halves the lr one step after the stop: a resume without its state does not
TRAINING_STATE_EXTRA = {"data": {"epoch": 0, "note": "résumé"}, "pair": (1, 2.5)}


@dataclass(frozen=True)
class Case:
    model: str  # "llama", "lora_head", "mixtral", "remote_frozen_bias", "remote_trainable_bias", "tp"
    optimizer: str  # see _optimizer
    save: dict = field(default_factory=dict, hash=False)  # save_sharded's other arguments


CASES = {
    "llama_adamw_foreach": Case("llama", "adamw_foreach"),
    "llama_adamw_fused": Case("llama", "adamw_fused"),
    "llama_adam_amsgrad": Case("llama", "adam_amsgrad"),
    "llama_sgd_momentum": Case("llama", "sgd_momentum"),
    "llama_two_groups": Case("llama", "adamw_two_groups", {"max_shard_size": "20KB"}),
    "lora_head": Case("lora_head", "adamw_foreach"),
    "mixtral": Case("mixtral", "adamw_foreach"),
    "remote_moe_frozen_bias": Case("remote_frozen_bias", "adamw_foreach"),
    "remote_moe_trainable_bias": Case("remote_trainable_bias", "adamw_foreach"),
}
TP_CASES = {"tp_fsdp": Case("tp", "adamw_foreach")}


OLD_FSDP = (
    "torch before 2.13 refuses data-parallel training of a routed (per-expert) list, on every rank before "
    "any collective (tests/train/test_train_dp.py checks that refusal)"
)


def _trainable(case: Case) -> bool:
    """Whether this torch trains ``case`` data-parallel: a per-expert list (the remote MoE; transformers
    4.57's Mixtral) needs FSDP2's set_reduce_scatter_unused_params (torch 2.13)."""
    from rank0load.integrations._compat import can_reduce_scatter_unused_params

    per_expert = case.model in ("remote_frozen_bias", "remote_trainable_bias") or (
        case.model == "mixtral" and not _transformers5()
    )
    return not per_expert or can_reduce_scatter_unused_params()


def _cases(world: int) -> dict[str, Case]:
    return {k: v for k, v in (TP_CASES if world == 4 else CASES).items() if _trainable(v)}


def _needs_training(name: str) -> None:
    if not _trainable(CASES[name]):
        pytest.skip(OLD_FSDP)


def _transformers5() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


# --- the models ---------------------------------------------------------------------------------------


class WithHead(nn.Module):
    """A new fp32 classification head on Llama's body (``model.*``, as the checkpoint names it)."""

    def __init__(self) -> None:
        from transformers import LlamaModel

        super().__init__()
        config = hf.config("llama_untied")
        self.model = LlamaModel(config)
        self.value_head = nn.Linear(config.hidden_size, 3)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids).last_hidden_state
        logits = self.value_head(hidden[:, -1].float())
        return nn.functional.cross_entropy(logits, labels)


def lora_head_model():
    """model_fn: the body in bf16 and frozen, LoRA (fp32, as PEFT keeps adapters) on its attention, the new
    head in fp32 and trainable."""
    from peft import LoraConfig, get_peft_model

    model = WithHead()
    for p in model.model.parameters():  # parameters only: rotary inv_freq stays fp32
        p.data = p.data.to(BF16)
    model.model.requires_grad_(False)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(model, config)
    model.base_model.model.value_head.requires_grad_(True)
    return model


def mixtral_config():
    config = moe_models.config("mixtral")
    config.num_local_experts = EXPERTS
    return config


def remote_model(bias_trainable: bool = False):
    from tests.remote_code.configuration_tiny_moe import TinyMoeConfig
    from tests.remote_code.modeling_tiny_moe import TinyMoeForCausalLM

    model = TinyMoeForCausalLM(TinyMoeConfig(num_local_experts=EXPERTS))
    for n, p in model.named_parameters():
        p.requires_grad_(bias_trainable or not n.endswith("e_score_correction_bias"))
    return model


SOURCES = {  # the checkpoint each model starts from: written by its family's own save_pretrained
    "llama": "llama",
    "lora_head": "llama",
    "mixtral": "mixtral",
    "remote_frozen_bias": "remote",
    "remote_trainable_bias": "remote",
    "tp": "tp",
}
VOCAB = {"llama": 67, "lora_head": 67, "tp": 67, "mixtral": 64}  # the remote MoE: 64


def _write_source(root: str, family: str) -> str:
    path = os.path.join(root, "sources", family)
    if os.path.exists(path):
        return path
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    if family == "mixtral":
        model = AutoModelForCausalLM.from_config(mixtral_config())
    elif family == "remote":
        model = remote_model()
    elif family == "tp":
        model = hf.TPLlama()()
    else:
        model = hf.model_class("llama_untied")(hf.config("llama_untied"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0, 0.3 if "experts" in n or "gate" in n else 0.1)
    model.save_pretrained(path, max_shard_size="20KB")
    return path


# --- the ranks ----------------------------------------------------------------------------------------


def _mesh(case: Case, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    if case.model == "tp" and world == 4:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return None


def _dp(case: Case, world: int, rank: int) -> tuple[int, int]:
    """(data-parallel size, this rank's data-parallel index): TP ranks of one dp group share a batch."""
    return (2, rank // 2) if case.model == "tp" and world == 4 else (world, rank)


def _load(case: Case, ckpt: str, first: bool):
    """The model on every rank, from the family's checkpoint (``first``) or from a save of the case."""
    import torch.distributed as dist

    import rank0load

    torch.manual_seed(SEED + dist.get_rank())  # rank 0's random state decides what is not loaded
    world = dist.get_world_size()
    if case.model in ("llama", "mixtral"):
        from transformers import AutoModelForCausalLM

        model = rank0load.load_pretrained(AutoModelForCausalLM, ckpt)
        if case.optimizer == "sgd_momentum":  # frozen, yet in the optimizer: a parameter without state
            model.lm_head.weight.requires_grad_(False)
        return model
    if case.model == "lora_head":
        return rank0load.load_sharded(lora_head_model, ckpt, strict=not first)
    if case.model in ("remote_frozen_bias", "remote_trainable_bias"):
        model_fn = functools.partial(remote_model, bias_trainable=case.model == "remote_trainable_bias")
        return rank0load.load_sharded(model_fn, ckpt, dtype=BF16)
    if case.model == "tp":
        mesh = _mesh(case, world)
        if mesh is None:  # restored at another world size: plain FSDP2
            return rank0load.load_sharded(hf.TPLlama(), ckpt)
        return rank0load.load_sharded(hf.TPLlama(), ckpt, mesh, shard_fn=hf.TPThenFSDP())
    raise KeyError(case.model)


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    """The case's optimizer over the model's trainable parameters (``sgd_momentum``: every parameter), or
    one of the refusals' others."""
    named = list(model.named_parameters())
    trainable = [p for _, p in named if p.requires_grad]
    if kind == "adamw_foreach":
        return torch.optim.AdamW(trainable, lr=LR, foreach=True)
    if kind == "adamw_fused":
        return torch.optim.AdamW(trainable, lr=LR, fused=True)
    if kind == "adam_amsgrad":
        return torch.optim.Adam(trainable, lr=LR, amsgrad=True)
    if kind == "sgd_momentum":
        return torch.optim.SGD([p for _, p in named], lr=LR, momentum=0.9)
    if kind in ("adamw_two_groups", "adamw_two_groups_regrouped"):
        outer = ("model.embed_tokens.", "lm_head.")
        if kind == "adamw_two_groups_regrouped":
            outer = ("model.embed_tokens.",)  # lm_head joins the other group
        first = [p for n, p in named if n.startswith(outer)]
        rest = [p for n, p in named if not n.startswith(outer)]
        groups = [{"params": first, "lr": LR}, {"params": rest, "lr": LR / 10, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, foreach=True)
    if kind == "adamw_minus_lm_head":
        return torch.optim.AdamW([p for n, p in named if p.requires_grad and n != "lm_head.weight"], lr=LR)
    if kind == "adamw_plus_frozen":
        extra = [p for n, p in named if n.endswith("embed_tokens.weight")]
        return torch.optim.AdamW(trainable + extra, lr=LR, foreach=True)
    raise KeyError(kind)


def _scheduler(optimizer: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=STEP_SIZE, gamma=0.5)


class ExpertHits:
    """Which per-expert modules (``experts.<e>``) each forward of this rank ran; nothing for fused experts."""

    def __init__(self, model: nn.Module) -> None:
        self.steps: list[set[str]] = []
        self.hooks = [
            m.register_forward_hook(lambda mod, args, out, name=n: self.steps[-1].add(name))
            for n, m in model.named_modules()
            if re.search(r"experts\.\d+$", n)
        ]
        self.experts = sorted(n for n, m in model.named_modules() if re.search(r"experts\.\d+$", n))


def _train(model, optimizer, scheduler, case: Case, steps: range, hits: ExpertHits | None = None) -> dict:
    """``steps`` steps, each rank on its own row of a batch every rank draws from the global RNG."""
    import torch.distributed as dist

    dp_size, dp_rank = _dp(case, dist.get_world_size(), dist.get_rank())
    vocab = VOCAB.get(case.model, 64)
    model.train()
    out: dict = {"losses": [], "lrs": []}
    for _ in steps:
        ids = torch.randint(3, vocab, (dp_size, TOKENS))[dp_rank : dp_rank + 1]
        labels = torch.randint(0, 3, (dp_size,))[dp_rank : dp_rank + 1]
        if hits is not None:
            hits.steps.append(set())
        if case.model == "lora_head":
            loss = model(input_ids=ids, labels=labels)
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        out["losses"].append(loss.detach().float().clone())
        out["lrs"].append(scheduler.get_last_lr())
    return out


def _snapshot(model, optimizer) -> dict:
    """(all ranks) The full state a resume must give back: parameters and buffers, optimizer state, groups."""
    return {
        "params": gather(model),
        "optim": gather_optimizer(model, optimizer),
        "groups": optimizer_groups(model, optimizer),
    }


def _training_state(scheduler, step: int) -> dict:
    return {
        "step": step,
        "scheduler": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
        **TRAINING_STATE_EXTRA,
    }


@dataclass(frozen=True)
class Train:
    """Phase one: the run that never stops (``2N`` steps), then the run that stops after ``N`` and saves into
    ``out`` (and, with ``later``, one step more saved into ``later``: another save of the same run)."""

    case: Case
    source: str
    out: str
    later: str | None = None


def _train_job(job: Train) -> dict:
    import rank0load

    case = job.case
    model = _load(case, job.source, first=True)
    optimizer = _optimizer(case.optimizer, model)
    scheduler = _scheduler(optimizer)
    torch.manual_seed(DATA_SEED)
    straight = _train(model, optimizer, scheduler, case, range(2 * N))
    straight.update(_snapshot(model, optimizer))
    del model, optimizer, scheduler

    model = _load(case, job.source, first=True)
    optimizer = _optimizer(case.optimizer, model)
    scheduler = _scheduler(optimizer)
    torch.manual_seed(DATA_SEED)
    hits = ExpertHits(model)
    stopped = _train(model, optimizer, scheduler, case, range(N), hits)
    state = _training_state(scheduler, N)
    saved = {**_snapshot(model, optimizer), "state": state, "losses": stopped["losses"]}
    report = rank0load.save_sharded(model, job.out, optimizer=optimizer, training_state=state, **case.save)
    out = {
        "straight": straight,
        "saved": saved,
        "hits": hits.steps,
        "experts": hits.experts,
        "report": report,
    }
    if job.later is not None:
        _train(model, optimizer, scheduler, case, range(N, N + 1))
        rank0load.save_sharded(
            model,
            job.later,
            optimizer=optimizer,
            training_state=_training_state(scheduler, N + 1),
            **case.save,
        )
    return out


@dataclass(frozen=True)
class Resume:
    """Phase two, in fresh processes: the model loaded from ``ckpt``, the optimizer and scheduler built, the
    training state restored; then ``N`` steps unless ``train`` is False (a restore at another world size)."""

    case: Case
    ckpt: str
    train: bool = True
    pass_mesh: bool = False  # load_training_state(mesh=) the mesh the model was loaded on


def _resume_job(job: Resume) -> dict:
    import rank0load

    case = job.case
    model = _load(case, job.ckpt, first=False)
    optimizer = _optimizer(case.optimizer, model)
    scheduler = _scheduler(optimizer)
    mesh = {"mesh": _mesh(case, torch.distributed.get_world_size())} if job.pass_mesh else {}
    state = rank0load.load_training_state(model, optimizer, job.ckpt, **mesh)
    scheduler.load_state_dict(state["scheduler"])
    restored = {**_snapshot(model, optimizer), "state": state}
    if not job.train:
        return {"restored": restored}
    torch.set_rng_state(state["rng"])
    resumed = _train(model, optimizer, scheduler, case, range(state["step"], state["step"] + N))
    resumed.update(_snapshot(model, optimizer))
    return {"restored": restored, "resumed": resumed}


@dataclass(frozen=True)
class Refusal:
    """``load_training_state(model, optimizer, state_dir)`` must raise on every rank, before anything changes:
    the model loaded from ``model_dir`` as ``case`` builds it, the ``optimizer`` built and stepped once (so it
    holds state a partial restore would change)."""

    case: Case
    model_dir: str
    state_dir: str
    optimizer: str


def _refusal_job(job: Refusal) -> dict:
    import rank0load

    model = _load(job.case, job.model_dir, first=False)
    optimizer = _optimizer(job.optimizer, model)
    scheduler = _scheduler(optimizer)
    torch.manual_seed(DATA_SEED)
    _train(model, optimizer, scheduler, job.case, range(1))
    before = _snapshot(model, optimizer)
    error = None
    try:
        rank0load.load_training_state(model, optimizer, job.state_dir)
    except Exception as exc:  # judged by the test: which class, the same on every rank
        bases = tuple(c.__name__ for c in type(exc).__mro__)
        error = _dist.Raised(type(exc).__name__, bases, str(exc), "")
    after = _snapshot(model, optimizer)
    untouched = (
        before["groups"] == after["groups"]
        and _equal(before["optim"], after["optim"])
        and _equal(before["params"], after["params"])
    )
    return {"error": error, "untouched": untouched}


@dataclass(frozen=True)
class StateOnly:
    """``load_training_state(model, None, ckpt)``: the training state alone, no optimizer to restore."""

    case: Case
    ckpt: str


def _state_only_job(job: StateOnly) -> dict:
    import rank0load

    model = _load(job.case, job.ckpt, first=False)
    try:  # an error here is the test's: the jobs after this one still run
        return {"state": rank0load.load_training_state(model, None, job.ckpt), "error": None}
    except Exception as exc:
        return {"error": _dist.Raised(type(exc).__name__, (), str(exc), "")}


@dataclass(frozen=True)
class SaveInto:
    """A save of ``case`` (one step trained) into ``out`` that must fail with SaveError on every rank."""

    case: Case
    source: str
    out: str


def _save_into_job(job: SaveInto) -> dict:
    import rank0load

    model = _load(job.case, job.source, first=False)
    optimizer = _optimizer(job.case.optimizer, model)
    scheduler = _scheduler(optimizer)
    torch.manual_seed(DATA_SEED)
    _train(model, optimizer, scheduler, job.case, range(1))
    try:
        rank0load.save_sharded(
            model, job.out, optimizer=optimizer, training_state=_training_state(scheduler, 1)
        )
    except Exception as exc:
        return {
            "error": _dist.Raised(
                type(exc).__name__, tuple(c.__name__ for c in type(exc).__mro__), str(exc), ""
            )
        }
    return {"error": None}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _run_job(job) -> dict:
    if isinstance(job, Train):
        return _train_job(job)
    if isinstance(job, Resume):
        return _resume_job(job)
    if isinstance(job, Refusal):
        return _refusal_job(job)
    if isinstance(job, SaveInto):
        return _save_into_job(job)
    if isinstance(job, StateOnly):
        return _state_only_job(job)
    raise TypeError(job)


def _run_all(rank: int, world: int, root: str, jobs: dict) -> dict:
    hf._quiet()
    moe_models._quiet()
    # the flip case may fail (item 1) without stopping the jobs after it
    flip = lambda job: getattr(getattr(job, "case", None), "model", "") == "remote_trainable_bias"
    return _dist.run_jobs(rank, root, jobs, _run_job, expects_error=flip)


# --- the phases -----------------------------------------------------------------------------------------


def _out(root: str, world: int, name: str) -> str:
    return os.path.join(root, f"saved{world}", name)


def _spawn(root: str, world: int, jobs: dict) -> list[dict]:
    results = _dist.ok(_dist.run(_run_all, world, root, jobs, timeout=600, pg_timeout=120))
    for r, res in enumerate(results):
        assert res["touched"] == [], f"rank {r} touched the hidden checkpoints: {res['touched'][:10]}"
    return results


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    hf._quiet()
    moe_models._quiet()
    path = str(tmp_path_factory.mktemp("resume"))
    for family in sorted(set(SOURCES.values())):
        _write_source(path, family)
    return path


def _source(root: str, case: Case) -> str:
    return os.path.join(root, "sources", SOURCES[case.model])


def _trained(root: str, world: int) -> list[dict]:
    jobs = {
        name: Train(
            case,
            _source(root, case),
            _out(root, world, name),
            later=_out(root, world, f"{name}-later") if name == "llama_adamw_foreach" else None,
        )
        for name, case in _cases(world).items()
    }
    return _spawn(root, world, jobs)


@pytest.fixture(scope="module")
def trained2(root):
    return _trained(root, 2)


@pytest.fixture(scope="module")
def trained3(root):
    return _trained(root, 3)


@pytest.fixture(scope="module")
def trained4(root):
    return _trained(root, 4)


@pytest.fixture(scope="module")
def resumed2(root, trained2):
    jobs: dict = {name: Resume(case, _out(root, 2, name)) for name, case in _cases(2).items()}
    jobs.update(_refusals(root))
    return _spawn(root, 2, jobs)


@pytest.fixture(scope="module")
def resumed3(root, trained2, trained3):
    jobs: dict = {name: Resume(case, _out(root, 3, name)) for name, case in _cases(3).items()}
    jobs.update(
        {f"from2:{name}": Resume(case, _out(root, 2, name), train=False) for name, case in _cases(2).items()}
    )
    return _spawn(root, 3, jobs)


@pytest.fixture(scope="module")
def resumed4(root, trained4):
    jobs = {
        f"{name}:mesh": Resume(case, _out(root, 4, name), pass_mesh=True) for name, case in _cases(4).items()
    }
    jobs.update(
        {name: Resume(case, _out(root, 4, name)) for name, case in _cases(4).items()}
    )  # last: may raise
    return _spawn(root, 4, jobs)


@pytest.fixture(scope="module")
def restored1(root, trained2, trained4):
    jobs = {
        f"from2:{name}": Resume(case, _out(root, 2, name), train=False) for name, case in _cases(2).items()
    }
    jobs.update(
        {f"from4:{name}": Resume(case, _out(root, 4, name), train=False) for name, case in _cases(4).items()}
    )
    return _spawn(root, 1, jobs)


def _got(results: list[dict], name: str) -> list[dict]:
    """Job ``name``'s result on every rank; the first rank's traceback if it raised or never ran."""
    out = []
    for r, res in enumerate(results):
        got = res["jobs"].get(name)
        if got is None:
            failed = [
                f"{k}: {v.type_name}: {v.message}"
                for k, v in res["jobs"].items()
                if isinstance(v, _dist.Raised)
            ]
            pytest.fail(f"job {name} never ran on rank {r}: an earlier job failed: {failed}", pytrace=False)
        if isinstance(got, _dist.Raised):
            pytest.fail(
                f"job {name} raised {got.type_name} on rank {r}: {got.message}\n{got.tb}", pytrace=False
            )
        out.append(got)
    return out


def _same_snapshot(got: dict, want: dict, what: str) -> None:
    assert got["groups"] == want["groups"], f"{what}: param groups differ"
    assert_same(got["optim"], want["optim"])
    assert_same(got["params"], want["params"])


def _same_state(got: dict, want: dict) -> None:
    """The training_state as load_training_state returns it: JSON's types, tensors equal."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    assert torch.equal(got["rng"], want["rng"]) and got["rng"].dtype == want["rng"].dtype
    assert got["scheduler"] == json.loads(json.dumps(want["scheduler"]))
    assert got["step"] == want["step"] and got["data"] == want["data"]
    assert got["pair"] == [1, 2.5]  # a tuple comes back as JSON's list


def _check_exact(
    name: str, world: int, trained: list[dict], resumed: list[dict], job: str | None = None
) -> None:
    """On every rank: what load_training_state restored is what was saved, bit for bit; N more steps then
    give the run that never stopped, bit for bit (parameters, every optimizer state, groups, losses, lrs)."""
    for rank, (first, second) in enumerate(zip(_got(trained, name), _got(resumed, job or name))):
        saved, straight = first["saved"], first["straight"]
        restored, resumed_ = second["restored"], second["resumed"]
        _same_snapshot(restored, saved, f"rank {rank}: restored")
        _same_state(restored["state"], saved["state"])
        for step in range(N):
            assert torch.equal(saved["losses"][step], straight["losses"][step]), (rank, step)
            assert torch.equal(resumed_["losses"][step], straight["losses"][N + step]), (rank, N + step)
        assert resumed_["lrs"] == straight["lrs"][N:], (rank, resumed_["lrs"], straight["lrs"])
        _same_snapshot(resumed_, straight, f"rank {rank}: resumed")
    want = _got(trained, name)[0]["saved"]
    assert want["optim"], "no optimizer state was saved"


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def exact(request) -> tuple[int, list[dict], list[dict]]:
    world = request.param
    return world, request.getfixturevalue(f"trained{world}"), request.getfixturevalue(f"resumed{world}")


# --- exact resume -----------------------------------------------------------------------------------------


def test_llama_adamw_foreach_resumes_bit_for_bit(exact):
    world, trained, resumed = exact
    _check_exact("llama_adamw_foreach", world, trained, resumed)
    lrs = _got(trained, "llama_adamw_foreach")[0]["straight"]["lrs"]
    assert lrs[N] != lrs[N - 1] and lrs[N - 1] == lrs[0], lrs  # the scheduler's state decides the lr


def test_llama_adamw_fused_resumes_bit_for_bit(exact):
    world, trained, resumed = exact
    _check_exact("llama_adamw_fused", world, trained, resumed)


def test_llama_adam_amsgrad_resumes_bit_for_bit(exact):
    world, trained, resumed = exact
    _check_exact("llama_adam_amsgrad", world, trained, resumed)
    optim = _got(trained, "llama_adam_amsgrad")[0]["saved"]["optim"]
    assert "state.lm_head.weight.max_exp_avg_sq" in optim, sorted(optim)[:5]


def test_llama_sgd_momentum_with_a_stateless_frozen_parameter_resumes_bit_for_bit(exact):
    world, trained, resumed = exact
    _check_exact("llama_sgd_momentum", world, trained, resumed)
    saved = _got(trained, "llama_sgd_momentum")[0]["saved"]
    assert "state.model.norm.weight.momentum_buffer" in saved["optim"]
    assert not [k for k in saved["optim"] if k.startswith("state.lm_head.")]  # in the optimizer, no state
    assert "lm_head.weight" in saved["groups"][0]["params"]


def test_llama_two_param_groups_in_several_files_resume_bit_for_bit(exact):
    world, trained, resumed = exact
    _check_exact("llama_two_groups", world, trained, resumed)
    groups = _got(trained, "llama_two_groups")[0]["saved"]["groups"]
    assert [len(g["params"]) for g in groups][0] == 2 and groups[0]["lr"] != groups[1]["lr"]


def test_lora_and_an_fp32_head_on_a_frozen_bf16_body_resume_bit_for_bit(exact):
    world, trained, resumed = exact
    _check_exact("lora_head", world, trained, resumed)
    saved = _got(trained, "lora_head")[0]["saved"]
    dtypes = {k.rsplit(".", 1)[-1]: v.dtype for k, v in saved["optim"].items() if "value_head" in k}
    assert dtypes["exp_avg"] == torch.float32
    assert any("lora_A" in k for k in saved["optim"]) and not any("base_layer" in k for k in saved["optim"])


def test_mixtral_resumes_bit_for_bit(exact):
    """transformers 4.57: per-expert modules, only the experts hit run; some expert no rank reached at a
    step (its state still saved and restored), and ranks reached different ones. The newest: fused."""
    _needs_training("mixtral")
    world, trained, resumed = exact
    _check_exact("mixtral", world, trained, resumed)
    _check_unreached(trained, "mixtral", per_expert=not _transformers5())


def _check_unreached(trained: list[dict], name: str, per_expert: bool) -> None:
    got = _got(trained, name)
    experts = got[0]["experts"]
    if not per_expert:
        assert experts == [], experts
        return
    assert experts
    reached = [set().union(*(g["hits"][step] for g in got)) for step in range(N)]
    assert any(set(experts) - hit for hit in reached), "every expert was reached at every step"
    assert len({frozenset(g["hits"][0]) for g in got}) > 1, "every rank reached the same experts"


def test_remote_moe_with_its_router_bias_frozen_resumes_bit_for_bit(exact):
    _needs_training("remote_moe_frozen_bias")
    world, trained, resumed = exact
    _check_exact("remote_moe_frozen_bias", world, trained, resumed)
    _check_unreached(trained, "remote_moe_frozen_bias", per_expert=True)
    saved = _got(trained, "remote_moe_frozen_bias")[0]["saved"]
    assert not [k for k in saved["optim"] if "e_score_correction_bias" in k]
    assert saved["params"]["model.layers.0.block_sparse_moe.e_score_correction_bias"].dtype == torch.float32


def test_remote_moe_with_its_router_bias_trainable_resumes_bit_for_bit(exact):
    _needs_training("remote_moe_trainable_bias")
    world, trained, resumed = exact
    _check_exact("remote_moe_trainable_bias", world, trained, resumed)


def test_tensor_parallel_then_fsdp2_resumes_bit_for_bit(trained4, resumed4):
    """dp=2 x tp=2: TP weights on the 2-D mesh, the rest on mesh["dp"]; a batch per dp group."""
    _check_exact("tp_fsdp", 4, trained4, resumed4)


def test_tensor_parallel_then_fsdp2_resumes_bit_for_bit_given_the_mesh(trained4, resumed4):
    """The same with ``load_training_state(..., mesh=)``: the 2-D mesh the model was loaded on."""
    _check_exact("tp_fsdp", 4, trained4, resumed4, job="tp_fsdp:mesh")


def test_training_state_round_trips_and_is_the_same_on_every_rank(trained2, resumed2):
    want = _got(trained2, "llama_adamw_foreach")[0]["saved"]["state"]
    for got in _got(resumed2, "llama_adamw_foreach"):
        _same_state(got["restored"]["state"], want)
    assert want["rng"].dtype == torch.uint8 and want["scheduler"]["last_epoch"] == N


def test_the_training_state_alone_without_an_optimizer(trained2, resumed2):
    want = _got(trained2, "llama_adamw_foreach")[0]["saved"]["state"]
    for got in _got(resumed2, "state_only"):
        assert got["error"] is None, f"{got['error'].type_name}: {got['error'].message}"
        _same_state(got["state"], want)


def test_saved_files_hold_full_tensors_under_torch_names(root, trained2):
    """training_state/optimizer*.safetensors as safetensors reads them: every state as gathered before the
    save; training_state.json: the optimizer's class and each group's parameters by name."""
    for name in ("llama_adamw_foreach", "llama_two_groups", "mixtral", "remote_moe_frozen_bias"):
        if name not in _cases(2):
            continue  # not trained on this torch (OLD_FSDP)
        saved = _got(trained2, name)[0]["saved"]
        assert_same(read_optimizer_files(_out(root, 2, name)), saved["optim"])
        with open(os.path.join(_out(root, 2, name), "training_state", "training_state.json")) as f:
            text = f.read()
        assert "AdamW" in text, name
        for group in saved["groups"]:
            assert all(f'"{fqn}"' in text for fqn in group["params"]), name
    names = os.listdir(os.path.join(_out(root, 2, "llama_two_groups"), "training_state"))
    assert "optimizer.safetensors.index.json" in names, names
    assert len([n for n in names if re.fullmatch(r"optimizer-\d{5}-of-\d{5}\.safetensors", n)]) > 1, names


# --- resharding ---------------------------------------------------------------------------------------------


def _check_restored(
    root: str, name: str, saved_world: int, trained: list[dict], restored: list[dict]
) -> None:
    saved = _got(trained, name)[0]["saved"]
    files = read_optimizer_files(_out(root, saved_world, name))
    for rank, got in enumerate(_got(restored, f"from{saved_world}:{name}")):
        _same_snapshot(got["restored"], saved, f"rank {rank}")
        assert_same(got["restored"]["optim"], files)
        _same_state(got["restored"]["state"], saved["state"])


@pytest.mark.parametrize("name", list(_cases(2)))
def test_saved_at_2_ranks_restored_at_3_bit_for_bit(root, trained2, resumed3, name):
    _check_restored(root, name, 2, trained2, resumed3)


@pytest.mark.parametrize("name", list(_cases(2)))
def test_saved_at_2_ranks_restored_at_1_bit_for_bit(root, trained2, restored1, name):
    _check_restored(root, name, 2, trained2, restored1)


def test_saved_with_tp_at_4_ranks_restored_at_1_without_tp(root, trained4, restored1):
    _check_restored(root, "tp_fsdp", 4, trained4, restored1)


# --- refusals -------------------------------------------------------------------------------------------------


def _rewrite_optimizer(directory: str, edit) -> None:
    """Rewrite the optimizer file(s) of ``directory`` with safetensors, each file's metadata kept:
    ``edit(tensors)`` changes the dict of one file in place; an index follows what was removed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = os.path.join(directory, "training_state")
    removed: set[str] = set()
    for file in sorted(os.listdir(folder)):
        if not (file.startswith("optimizer") and file.endswith(".safetensors")):
            continue
        path = os.path.join(folder, file)
        with safe_open(path, "pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        keys = set(tensors)
        edit(tensors)
        removed |= keys - set(tensors)
        save_file(tensors, path, metadata=metadata)
    index = os.path.join(folder, "optimizer.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            data = json.load(f)
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if k not in removed}
        with open(index, "w") as f:
            json.dump(data, f)


MISSING_KEY = "state.model.layers.0.self_attn.q_proj.weight.exp_avg_sq"


def _refusals(root: str) -> dict:
    """(the test process, after phase one at 2 ranks) The refusal jobs and the folders they read."""
    a, b = _out(root, 2, "llama_adamw_foreach"), _out(root, 2, "llama_adamw_foreach-later")
    if not os.path.isdir(os.path.join(b, "training_state")):
        return {}  # phase one failed: its own test says how
    case = CASES["llama_adamw_foreach"]
    work = os.path.join(root, "refusals")
    os.makedirs(work, exist_ok=True)

    def copy(name: str) -> str:
        path = os.path.join(work, name)
        shutil.copytree(a, path)
        return path

    shape = copy("shape")

    def smaller_head(tensors: dict) -> None:
        for key in ("state.lm_head.weight.exp_avg", "state.lm_head.weight.exp_avg_sq"):
            if key in tensors:
                tensors[key] = tensors[key][:-1].clone()

    _rewrite_optimizer(shape, smaller_head)
    missing = copy("missing_key")
    _rewrite_optimizer(missing, lambda tensors: tensors.pop(MISSING_KEY, None))
    mixed_file = copy("mixed_optimizer_file")
    folder = os.path.join(mixed_file, "training_state")
    for file in os.listdir(folder):
        if file.startswith("optimizer"):
            os.unlink(os.path.join(folder, file))
    for file in os.listdir(os.path.join(b, "training_state")):
        if file.startswith("optimizer"):
            shutil.copy(os.path.join(b, "training_state", file), folder)
    mixed_folder = copy("mixed_training_state_folder")
    shutil.rmtree(os.path.join(mixed_folder, "training_state"))
    shutil.copytree(os.path.join(b, "training_state"), os.path.join(mixed_folder, "training_state"))
    no_state = copy("no_training_state")
    shutil.rmtree(os.path.join(no_state, "training_state"))
    with open(os.path.join(work, "a_file"), "w") as f:
        f.write("not a directory")
    return {
        "refuse:optimizer_class": Refusal(case, a, a, "sgd_momentum"),
        "refuse:parameter_missing": Refusal(case, a, a, "adamw_minus_lm_head"),
        "refuse:parameter_added": Refusal(
            CASES["lora_head"], _out(root, 2, "lora_head"), _out(root, 2, "lora_head"), "adamw_plus_frozen"
        ),
        "refuse:regrouped": Refusal(
            CASES["llama_two_groups"],
            _out(root, 2, "llama_two_groups"),
            _out(root, 2, "llama_two_groups"),
            "adamw_two_groups_regrouped",
        ),
        "refuse:shape": Refusal(case, shape, shape, case.optimizer),
        "refuse:missing_key": Refusal(case, missing, missing, case.optimizer),
        "refuse:model_a_state_b": Refusal(case, a, b, case.optimizer),
        "refuse:model_b_state_a": Refusal(case, b, a, case.optimizer),
        "refuse:mixed_optimizer_file": Refusal(case, mixed_file, mixed_file, case.optimizer),
        "refuse:mixed_training_state_folder": Refusal(case, mixed_folder, mixed_folder, case.optimizer),
        "refuse:no_training_state": Refusal(case, no_state, no_state, case.optimizer),
        "state_only": StateOnly(case, a),
        "refuse:save_into_a_file": SaveInto(case, a, os.path.join(work, "a_file", "ckpt")),
    }


def _refused(resumed2: list[dict], name: str, cls_name: str) -> str:
    got = _got(resumed2, f"refuse:{name}")
    for rank, g in enumerate(got):
        assert g.get("untouched", True), f"rank {rank}: the optimizer or the model changed before the refusal"
    return _dist.same_error([g["error"] for g in got], cls_name).message


def test_refuses_another_optimizer_class(resumed2):
    message = _refused(resumed2, "optimizer_class", "ModelMismatchError")
    assert "AdamW" in message and "SGD" in message, message


def test_refuses_an_optimizer_missing_a_parameter(resumed2):
    message = _refused(resumed2, "parameter_missing", "ModelMismatchError")
    assert "lm_head.weight" in message, message


def test_refuses_an_optimizer_with_a_parameter_added(resumed2):
    message = _refused(resumed2, "parameter_added", "ModelMismatchError")
    assert "embed_tokens.weight" in message, message


def test_refuses_another_grouping_of_the_parameters(resumed2):
    message = _refused(resumed2, "regrouped", "ModelMismatchError")
    assert "group" in message and "lm_head.weight" in message, message


def test_refuses_a_state_whose_shape_differs(resumed2):
    """The optimizer file rewritten with a smaller state than training_state.json lists: the folder was
    altered after the save (a format error, named before any data moves)."""
    message = _refused(resumed2, "shape", "CheckpointFormatError")
    assert "lm_head.weight" in message and "66" in message and "67" in message, message
    assert "model_fn" not in message, f"load_training_state takes no model_fn: {message}"


def test_refuses_a_missing_state_key(resumed2):
    message = _refused(resumed2, "missing_key", "CheckpointFormatError")
    assert "model.layers.0.self_attn.q_proj.weight" in message and "exp_avg_sq" in message, message
    for advice in ("key_map", "strict=False"):  # the weights' load's way out: load_training_state has neither
        assert advice not in message, f"load_training_state takes no {advice}: {message}"


DIFFERENT_SAVES = re.compile(r"(different|two|another) saves?", re.IGNORECASE)


@pytest.mark.parametrize("name", ["model_a_state_b", "model_b_state_a"])
def test_refuses_weights_and_training_state_from_different_saves(resumed2, name):
    message = _refused(resumed2, name, "LoadError")
    assert DIFFERENT_SAVES.search(message), message


@pytest.mark.parametrize("name", ["mixed_optimizer_file", "mixed_training_state_folder"])
def test_refuses_files_of_different_saves_mixed_in_one_folder(resumed2, name):
    message = _refused(resumed2, name, "LoadError")
    assert DIFFERENT_SAVES.search(message), message
    # the model was loaded from this very folder: loading it from there again changes nothing
    assert not re.search(rf"load the model from '[^']*{name}'", message), message


def test_a_folder_without_training_state_is_checkpoint_not_found(resumed2):
    message = _refused(resumed2, "no_training_state", "CheckpointNotFoundError")
    assert "training_state" in message, message


def test_a_save_that_fails_fails_on_every_rank(resumed2):
    got = _got(resumed2, "refuse:save_into_a_file")
    message = _dist.same_error([g["error"] for g in got], "SaveError").message
    assert "NotADirectoryError" in message, message


# --- a rank killed mid-save ----------------------------------------------------------------------------------


def _killed_mid_save(
    rank: int, world: int, root: str, ckpt: str, scratch: str, full: str | None, reports: str
) -> dict:
    """Resume from ``ckpt``, one step; saves into ``scratch`` counting rank 1's sends (the model alone, then
    with the training state); the save into ``full`` (a filled filesystem) must fail with SaveError on
    every rank; then the save into ``ckpt``, rank 1 dying before its last send. What each rank saw before
    that save goes to ``reports`` (outside ``root``, which ranks other than 0 do not see)."""
    import pickle

    import torch.distributed as dist

    import rank0load

    case = CASES["llama_adamw_foreach"]

    def job(_):
        model = _load(case, ckpt, first=False)
        optimizer = _optimizer(case.optimizer, model)
        scheduler = _scheduler(optimizer)
        state = rank0load.load_training_state(model, optimizer, ckpt)
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        _train(model, optimizer, scheduler, case, range(N, N + 1))
        real, sends = dist.isend, []
        dying: list[int | None] = [None]  # rank 1's send to die at: the scratch save's count

        def counting(*args, **kwargs):
            sends.append(1)
            if rank == 1 and dying[0] is not None and len(sends) == dying[0]:
                os._exit(3)
            return real(*args, **kwargs)

        dist.isend = counting
        rank0load.save_sharded(model, os.path.join(scratch, "weights"))
        weights_only = len(sends)
        sends.clear()
        new_state = _training_state(scheduler, N + 1)
        rank0load.save_sharded(
            model, os.path.join(scratch, "all"), optimizer=optimizer, training_state=new_state
        )
        out = {"weights_only": weights_only, "total": len(sends), "disk_full": None}
        sends.clear()
        if full is not None:
            try:
                rank0load.save_sharded(model, full, optimizer=optimizer, training_state=new_state)
            except Exception as exc:
                bases = tuple(c.__name__ for c in type(exc).__mro__)
                out["disk_full"] = _dist.Raised(type(exc).__name__, bases, str(exc), "")
            sends.clear()
        with open(os.path.join(reports, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
        dist.barrier()  # every rank's report is written before rank 1 dies
        dying[0] = out["total"]
        rank0load.save_sharded(model, ckpt, optimizer=optimizer, training_state=new_state)
        return out

    return _dist.run_jobs(rank, root, {"save": None}, job, expects_error=lambda _: True)


def _tree(directory: str) -> dict[str, bytes]:
    out = {}
    for folder, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
    return out


def test_a_rank_killed_mid_save_or_a_full_disk_leaves_the_previous_training_checkpoint(
    root, trained2, tmp_path
):
    """A save that fails leaves the previous training checkpoint byte for byte (no file changed, none added:
    no temporary left), the one the 2-rank resume above restored and resumed exactly: a filesystem filled
    before the save (SaveError on every rank), and rank 1 killed before its last send of a save whose
    sends the training state adds to (rank 0's SaveError)."""
    import pickle

    from tests.save.test_save import fill, tmpfs

    saved = _out(root, 2, "llama_adamw_foreach")
    ckpt, scratch = os.path.join(root, "killed", "ckpt"), os.path.join(root, "killed", "scratch")
    shutil.copytree(saved, ckpt)
    os.makedirs(scratch)
    before = _tree(ckpt)
    with tmpfs(os.path.join(root, "small"), "size=2m") as small:
        full = os.path.join(small, "ckpt")
        shutil.copytree(saved, full)
        fill(os.path.join(small, "filler"), keep=4096)  # a header fits, the data does not
        results, codes, _ = _dist.spawn(
            _killed_mid_save,
            2,
            root,
            ckpt,
            scratch,
            full,
            str(tmp_path),
            pg_timeout=20,
            timeout=240,
            exit_at_once=True,
        )
        os.unlink(os.path.join(small, "filler"))
        full_after = _tree(full)
    assert codes[1] == 3, (codes, results)
    got = results[0]["jobs"]["save"]
    assert isinstance(got, _dist.Raised) and "SaveError" in got.bases, got
    reports = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            reports.append(pickle.load(f))
    message = _dist.same_error([r["disk_full"] for r in reports], "SaveError").message
    assert "[Errno 28]" in message, message
    assert reports[1]["total"] > reports[1]["weights_only"] > 0, reports[
        1
    ]  # the optimizer's state is sent too
    assert _tree(ckpt) == before, sorted(set(_tree(ckpt)) ^ set(before))
    assert full_after == before, sorted(set(full_after) ^ set(before))
