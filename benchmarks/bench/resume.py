"""The training-state (resume) methods: ``python -m benchmarks.bench --resume``.

A method has two halves, run by different fresh processes (all ranks call each in lock step):

- ``save(model, optimizer, out_dir, training_state, options) -> info``: in the process that trained
  (the benchmark's checkpoint loaded with rank0load, an AdamW over every parameter, :data:`STEPS`
  steps of a dummy loss so that ``exp_avg`` / ``exp_avg_sq`` exist, all outside the measurement);
- ``restore(cfg, out_dir, mesh, options) -> (model, optimizer, training_state, info)``: in a fresh
  process, the model built and its weights and the optimizer's state restored from ``out_dir``.

``resume-build-only`` has no save: its restore builds the sharded model and an AdamW with its state
allocated (zeros) and faulted in, restoring nothing: the least every restore pays, whose transient RAM
the others are held to. The parameters stay bf16 as the checkpoint is (AdamW's moments are then bf16
too: 2x the weights).

:func:`expected_digests` records, on rank 0 of the saving process, the SHA-256 of every parameter's
and every optimizer state's full tensor and the param groups' hyperparameters; :func:`verify` checks a
restore against them bit for bit, so no method is timed doing the wrong thing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from rank0load.common._memory import prefault
from rank0load.integrations._compat import local_tensor

from .methods import Config, _tied, build_sharded, model_fn
from .model import BenchConfig, tensor_digest

__all__ = [
    "RESUME_METHODS",
    "RESUME_METHOD_NOTES",
    "STEPS",
    "expected_digests",
    "make_optimizer",
    "state_bytes",
    "train",
    "verify",
]

STEPS = 2  # optimizer steps before the save: exp_avg has a history, step is 2
BATCH, SEQ = 2, 16  # the dummy loss's token ids
HYPER: dict[str, Any] = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

Save = Callable[[nn.Module, torch.optim.Optimizer, str, dict, dict], dict]
Restore = Callable[[Config, str, DeviceMesh, dict], tuple[nn.Module, torch.optim.Optimizer, dict, dict]]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The AdamW every method trains and restores: over every parameter (the tied head once)."""
    return torch.optim.AdamW(model.parameters(), **HYPER)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Config, steps: int = STEPS) -> None:
    """(all ranks) ``steps`` optimizer steps of a dummy loss (the mean square of the logits) on fixed
    token ids, different on each rank as data parallelism's batches are; gradients freed after."""
    if not isinstance(cfg, BenchConfig):
        raise ValueError("--resume runs on the Llama model only")
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab, (BATCH, SEQ), generator=gen)
        loss = model(ids).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _named_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """``state.<fqn>.<key>`` (torch's flattened names) and each state tensor, in model order."""
    out = []
    for name, p in model.named_parameters():
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                out.append((f"state.{name}.{key}", value))
    return out


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state tensors (local shards; each storage once)."""
    storages: dict[int, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                s = local_tensor(value).untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The param groups' hyperparameters as JSON (the params left out)."""
    return [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]


def _digests(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """(all ranks, collective) Every parameter's and optimizer state's full-tensor digest, on rank 0
    (empty on the others). One full tensor at a time."""
    rank = dist.get_rank()
    out: dict[str, str] = {}
    named = [(n, p) for n, p in model.named_parameters()] + _named_states(model, optimizer)
    for name, t in named:
        full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
        if rank == 0:
            out[name] = tensor_digest(full)
        del full
    return out


def expected_digests(model: nn.Module, optimizer: torch.optim.Optimizer, training_state: dict) -> dict:
    """(all ranks, collective) What a restore must give back: digests (rank 0's), groups, user state."""
    return {
        "digests": _digests(model, optimizer),
        "param_groups": _groups(optimizer),
        "training_state": training_state,
    }


def verify(
    model: nn.Module, optimizer: torch.optim.Optimizer, training_state: dict, expected: dict | None
) -> dict:
    """(all ranks, collective) The restored parameters and optimizer states against ``expected`` (read
    on rank 0, None elsewhere) bit for bit, the param groups and the returned training state on every
    rank, the tie kept; every rank gets the verdict."""
    rank = dist.get_rank()
    got = _digests(model, optimizer)
    problems: list[str] = []
    if not _tied(model):
        problems.append(f"rank {rank}: lm_head / embed_tokens tie broken")
    verdict: list = [expected]
    dist.broadcast_object_list(verdict, src=0)
    want = verdict[0]
    if _groups(optimizer) != want["param_groups"]:
        problems.append(f"rank {rank}: param groups {_groups(optimizer)} != saved {want['param_groups']}")
    if training_state != want["training_state"]:
        problems.append(f"rank {rank}: training state {training_state} != saved {want['training_state']}")
    if rank == 0:
        digests = want["digests"]
        for name in sorted(set(digests) | set(got)):
            if name not in got:
                problems.append(f"{name}: saved, not restored")
            elif name not in digests:
                problems.append(f"{name}: restored, never saved")
            elif got[name] != digests[name]:
                problems.append(f"{name}: differs from the saved tensor")
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    every = [p for rank_problems in gathered for p in rank_problems]
    return {
        "verified": not every,
        "tensors_checked": len(got) if rank == 0 else None,
        "problems": every[:10],
        "problem_count": len(every),
        "tie_kept": _tied(model),
    }


class Split:
    """Wall seconds of a method's steps, in order: ``split("step")`` closes the step that ends now."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, step: str) -> None:
        now = time.perf_counter()
        self.seconds[step] = now - self._last
        self._last = now


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------ build-only


def restore_build_only(
    cfg: Config, out_dir: str, mesh: DeviceMesh, options: dict
) -> tuple[nn.Module, torch.optim.Optimizer, dict, dict]:
    """Meta build + fully_shard + the local shards allocated and faulted in, an AdamW with its state
    (``step``, ``exp_avg``, ``exp_avg_sq``: zeros like each parameter) allocated and faulted in."""
    split = Split()
    model = build_sharded(cfg, mesh)
    optimizer = make_optimizer(model)
    with torch.no_grad():
        for p in model.parameters():
            prefault(local_tensor(p))
            state = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
            for key in ("exp_avg", "exp_avg_sq"):
                prefault(local_tensor(state[key]))
            optimizer.state[p] = state
    split("build, allocate")
    return model, optimizer, {}, {"split": split.seconds}


# ------------------------------------------------------------------------------------ rank0load


def save_rank0load(
    model: nn.Module, optimizer: torch.optim.Optimizer, out_dir: str, training_state: dict, options: dict
) -> dict:
    """``rank0load.save_sharded(model, out_dir, optimizer=optimizer, training_state=...)``: each rank
    sends its own rows of every weight and optimizer state, rank 0 writes."""
    import rank0load

    report = rank0load.save_sharded(
        model, out_dir, optimizer=optimizer, training_state=training_state, **options.get("rank0load", {})
    )
    return {
        "stream_seconds": report.stream_seconds,
        "report_bytes": report.bytes,
        "split": dict(getattr(report, "phases", {}) or {}),
    }


def restore_rank0load(
    cfg: Config, out_dir: str, mesh: DeviceMesh, options: dict
) -> tuple[nn.Module, torch.optim.Optimizer, dict, dict]:
    """``load_sharded(model_fn, out_dir, mesh)``, an AdamW, then ``load_training_state(model,
    optimizer, out_dir)``: rank 0 reads, each rank gets its own rows."""
    import rank0load

    split = Split()
    model = rank0load.load_sharded(model_fn(cfg), out_dir, mesh, **options.get("rank0load", {}))
    split("load_sharded")
    optimizer = make_optimizer(model)
    split("AdamW")
    training_state = rank0load.load_training_state(model, optimizer, out_dir)
    split("load_training_state")
    phases = dict(getattr(model.rank0load_report, "phases", {}) or {})
    return model, optimizer, dict(training_state), {"split": split.seconds, "load_phases": phases}


# ------------------------------------------------------------------------------------ DCP


def save_dcp(
    model: nn.Module, optimizer: torch.optim.Optimizer, out_dir: str, training_state: dict, options: dict
) -> dict:
    """``dcp.save({"model", "optim", "training_state"}, checkpoint_id=out_dir)`` of ``get_state_dict
    (model, optimizer)``: every rank writes its own shards into the one folder, rank 0 the metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    split = Split()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    split("get_state_dict")
    dcp.save({"model": model_sd, "optim": optim_sd, "training_state": training_state}, checkpoint_id=out_dir)
    split("dcp.save")
    return {"split": split.seconds}


def restore_dcp(
    cfg: Config, out_dir: str, mesh: DeviceMesh, options: dict
) -> tuple[nn.Module, torch.optim.Optimizer, dict, dict]:
    """The sharded model built (as the torch-native load methods build it), an AdamW, ``get_state_dict``
    (which allocates the optimizer's state), ``dcp.load`` into it in place, ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    split = Split()
    model = build_sharded(cfg, mesh)
    optimizer = make_optimizer(model)
    split("build")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    split("get_state_dict")
    training_state: dict[str, Any] = {"step": 0}
    dcp.load({"model": model_sd, "optim": optim_sd, "training_state": training_state}, checkpoint_id=out_dir)
    split("dcp.load")
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    split("set_state_dict")
    return model, optimizer, training_state, {"split": split.seconds}


# ------------------------------------------------------------------------------------ full state dict


def save_full_sd(
    model: nn.Module, optimizer: torch.optim.Optimizer, out_dir: str, training_state: dict, options: dict
) -> dict:
    """``get_model_state_dict`` then ``get_optimizer_state_dict`` with ``StateDictOptions(
    full_state_dict=True, cpu_offload=True)``: rank 0 holds each whole and ``torch.save``s it (model.pt,
    then optim.pt with the training state), fsynced; one at a time, so rank 0 holds the larger alone."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    split = Split()
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    rank0 = dist.get_rank() == 0
    if rank0:
        os.makedirs(out_dir, exist_ok=True)
    model_sd = get_model_state_dict(model, options=opts)
    split("get_model_state_dict")
    if rank0:
        torch.save(model_sd, os.path.join(out_dir, "model.pt"))
        _fsync(os.path.join(out_dir, "model.pt"))
    del model_sd
    split("save model.pt")
    optim_sd = get_optimizer_state_dict(model, optimizer, options=opts)
    split("get_optimizer_state_dict")
    if rank0:
        path = os.path.join(out_dir, "optim.pt")
        torch.save({"optim": optim_sd, "training_state": training_state}, path)
        _fsync(path)
    del optim_sd
    split("save optim.pt")
    return {"split": split.seconds}


def restore_full_sd(
    cfg: Config, out_dir: str, mesh: DeviceMesh, options: dict
) -> tuple[nn.Module, torch.optim.Optimizer, dict, dict]:
    """The sharded model built, an AdamW; rank 0 ``torch.load``s model.pt and
    ``set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))``
    broadcasts it (the others pass an empty dict), then the same for optim.pt with
    ``set_optimizer_state_dict``; the training state broadcast from rank 0."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    split = Split()
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    rank0 = dist.get_rank() == 0
    model = build_sharded(cfg, mesh)
    optimizer = make_optimizer(model)
    split("build")
    model_sd = torch.load(os.path.join(out_dir, "model.pt"), weights_only=True) if rank0 else {}
    split("torch.load model.pt")
    set_model_state_dict(model, model_sd, options=opts)
    del model_sd
    split("set_model_state_dict")
    saved = torch.load(os.path.join(out_dir, "optim.pt"), weights_only=True) if rank0 else {}
    split("torch.load optim.pt")
    set_optimizer_state_dict(model, optimizer, saved.get("optim", {}), options=opts)
    shared: list = [saved.get("training_state")]
    del saved
    dist.broadcast_object_list(shared, src=0)
    split("set_optimizer_state_dict")
    return model, optimizer, dict(shared[0]), {"split": split.seconds}


RESUME_METHODS: dict[str, tuple[Save | None, Restore]] = {
    "resume-build-only": (None, restore_build_only),
    "resume-rank0load": (save_rank0load, restore_rank0load),
    "resume-dcp": (save_dcp, restore_dcp),
    "resume-full-sd": (save_full_sd, restore_full_sd),
}

RESUME_METHOD_NOTES: dict[str, str] = {
    "resume-build-only": "restore only: meta build + `fully_shard` + local shards allocated and faulted in, an AdamW with zeroed `exp_avg`/`exp_avg_sq` allocated and faulted in: the least every restore pays; restores nothing",
    "resume-rank0load": "`rank0load.save_sharded(model, out_dir, optimizer=optimizer, training_state={'step': n})`; restore: `load_sharded(model_fn, out_dir, mesh)`, AdamW, `load_training_state(model, optimizer, out_dir)`",
    "resume-dcp": "`dcp.save({'model', 'optim'} of get_state_dict(model, optimizer), checkpoint_id=out_dir)`, every rank writing to the one folder; restore: build, AdamW, `get_state_dict`, `dcp.load`, `set_state_dict`",
    "resume-full-sd": "`get_model_state_dict` / `get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)`, rank 0 `torch.save`s each; restore: build, AdamW, rank 0 `torch.load`s, `set_model_state_dict` / `set_optimizer_state_dict(full_state_dict=True, broadcast_from_rank0=True)`",
}
