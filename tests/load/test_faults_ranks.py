"""Fault corpus, ranks: model_fn or shard_fn failing on one rank (or returning no module), ranks
building different models, reset_parameters() failing on one rank, the shards' fault-in failing on
one rank (in its background thread), a read error on rank 0 while it streams, and ranks that die or
stall mid-load.

Every rank raises the same LoadError, never a hang. The corpus cases run in one pair of gloo ranks
(see tests/faults_common.py); a rank that dies needs a process group of its own per case.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests import _dist
from tests.faults_common import (
    Case,
    check_fault,
    check_good_load,
    check_never_written,
    read_bytes,
    run_corpus,
    single,
    without,
)
from tests.models import Toy, toy

# --------------------------------------------------------------------------------------------
# Picklable model_fn / shard_fn variants (spawned ranks import this module).


class RaiseOnRank:
    """model_fn that raises on one rank only."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self) -> Toy:
        import torch.distributed as dist

        if dist.get_rank() == self.rank:
            raise RuntimeError(f"model_fn failed on purpose on rank {self.rank}")
        return Toy()


class ShardRaiseOnRank:
    """shard_fn that raises on one rank only, after doing the default sharding elsewhere."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, model, mesh) -> None:
        import torch.distributed as dist

        from rank0load import default_shard_fn

        if dist.get_rank() == self.rank:
            raise ValueError(f"shard_fn failed on purpose on rank {self.rank}")
        default_shard_fn(model, mesh)


class WiderOnRank:
    """model_fn whose output differs on one rank (dim 6 instead of 5)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self) -> Toy:
        import torch.distributed as dist

        return Toy(dim=6) if dist.get_rank() == self.rank else Toy()


class _FailingInitLinear(torch.nn.Linear):
    def reset_parameters(self) -> None:
        import torch.distributed as dist

        # Fine during the meta build; fails when the loader initialises a missing weight on rank 1.
        if not self.weight.is_meta and dist.get_rank() == 1:
            raise MemoryError("reset_parameters failed on purpose on rank 1")
        super().reset_parameters()


def toy_failing_init() -> Toy:
    model = Toy()
    model.blocks[1].fc = _FailingInitLinear(5, 5)
    return model


def not_a_module():
    return "not a module"


# --------------------------------------------------------------------------------------------
# The corpus: failures on one rank (or all), settled before any data moves or, for the read
# error, while rank 0 streams.


CASES = [
    Case(
        "model_fn_raises_on_rank1",
        single,
        "RankMismatchError",
        ("rank 1", "failed on purpose"),
        ("fix model_fn",),
        kwargs={"model_fn": RaiseOnRank(1)},
    ),
    Case(
        "model_fn_not_a_module",
        single,
        "RankMismatchError",
        ("nn.Module", "str"),
        ("fix model_fn",),
        kwargs={"model_fn": not_a_module},
    ),
    Case(
        "shard_fn_raises_on_rank0",
        single,
        "RankMismatchError",
        ("rank 0", "failed on purpose"),
        ("fix model_fn / shard_fn",),
        kwargs={"shard_fn": ShardRaiseOnRank(0)},
    ),
    Case(
        "ranks_build_different_models",
        single,
        "RankMismatchError",
        ("ranks [1]",),
        ("same model on every rank",),
        kwargs={"model_fn": WiderOnRank(1)},
    ),
    Case(
        "init_missing_raises_on_rank1",
        without("blocks.1.fc.weight"),
        "RankMismatchError",
        ("rank 1", "MemoryError", "failed on purpose"),
        ("load again",),
        kwargs={"model_fn": toy_failing_init, "strict": False},
    ),
    Case(
        "fault_in_fails_on_rank1",
        single,
        "RankMismatchError",
        ("rank 1", "allocating", "MemoryError", "failed on purpose"),
        ("load again",),
        fault="fault_in_fails_on_rank1",
    ),
    Case(
        "read_error_mid_stream",
        single,
        "LoadError",
        ("model.safetensors", "Input/output error"),
        ("check the disk", "Check the disk"),
        fault="eio_on_rank0",
    ),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return run_corpus(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(corpus, case):
    """Every rank raises the same LoadError subclass, fast, naming what is wrong and what to do."""
    check_fault(corpus, case)


def test_checkpoint_never_written(corpus):
    check_never_written(corpus)


def test_good_load_after_failures(corpus, toy_reference):
    """After every failing case, in the same process group, a good load is bit-exact."""
    check_good_load(corpus, toy_reference)


# --------------------------------------------------------------------------------------------
# A rank that dies mid-load: the survivor fails within the process-group timeout.


def _fail_mid_load(rank: int, world: int, path: str, victim: int, how: str, marker: str) -> str:
    import torch.distributed as dist

    import rank0load
    import rank0load.common._distribute as d

    kwargs: dict = {}
    if how == "dies_in_build":
        kwargs["model_fn"] = ExitOnRank(victim, marker)
    elif how == "dies_in_manifest":
        kwargs["key_map"] = ExitOnRank(0, marker)  # key_map runs on rank 0 alone, while it reads headers
    else:
        # local_reads=False on every rank: the stream itself (a local reader receives nothing point
        # to point; test_local has a local reader that dies).
        kwargs["local_reads"] = False
    if how in ("dies", "stalls") and rank == victim:
        # Fail in the stream phase: rank 0 while sending, rank 1 while receiving.
        name = "isend" if victim == 0 else "irecv"
        original = getattr(dist, name)
        calls = [0]

        def failing(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:
                open(marker, "w").close()
                if how == "stalls":  # alive but stuck: only the timeout can end the wait
                    time.sleep(STALL_SECONDS)
                os._exit(17)
            return original(*args, **kwargs)

        setattr(d.dist, name, failing)
    started = time.monotonic()
    try:
        rank0load.load_sharded(kwargs.pop("model_fn", toy), path, **kwargs)
    finally:
        with open(f"{marker}.rank{rank}", "w") as f:
            f.write(str(time.monotonic() - started))
    return "loaded"


class ExitOnRank:
    """A model_fn or key_map during which one rank dies."""

    def __init__(self, rank: int, marker: str) -> None:
        self.rank, self.marker = rank, marker

    def __call__(self, *args):
        import torch.distributed as dist

        if dist.get_rank() == self.rank:
            open(self.marker, "w").close()
            os._exit(17)
        return args[0] if args else toy()


STALL_SECONDS = 9.0  # longer than the survivor's 5-s timeout, short for the suite


def _run_with_death(
    fn, world: int, *args, timeout: float, pg_timeout: float
) -> tuple[list, list[int | None], float]:
    """Like _dist.run, but a rank may die: returns (results or None per rank, exit codes, seconds)."""
    return _dist.spawn(fn, world, *args, timeout=timeout, pg_timeout=pg_timeout, exit_at_once=True)


@pytest.mark.slow  # 5 spawns, one waiting out a stall: about 40 s
@pytest.mark.parametrize(
    ("victim", "how"),
    [(0, "dies"), (1, "dies"), (0, "stalls"), (1, "dies_in_build"), (0, "dies_in_manifest")],
)
def test_rank_fails_mid_load(tmp_path, toy_checkpoint, victim, how):
    """The survivor raises a LoadError naming the timeout setting, within the process-group timeout."""
    path = toy_checkpoint
    marker = str(tmp_path / "failed")
    pg_timeout = 5.0
    results, codes, _ = _run_with_death(
        _fail_mid_load, 2, path, victim, how, marker, timeout=90, pg_timeout=pg_timeout
    )
    assert os.path.exists(marker) and codes[victim] == 17, f"rank {victim} did not fail as planned: {codes}"
    survivor = results[1 - victim]
    assert isinstance(survivor, _dist.Raised), f"the surviving rank returned {survivor!r}"
    assert "LoadError" in survivor.bases, (
        f"survivor raised {survivor.type_name}: {survivor.message}\n{survivor.tb}"
    )
    assert "died or stalled" in survivor.message and "init_process_group(timeout=" in survivor.message, (
        survivor.message
    )
    seconds = float(read_bytes(f"{marker}.rank{1 - victim}"))
    if how == "stalls":  # nothing but the timeout ends the wait, and it does
        assert pg_timeout * 0.8 < seconds < pg_timeout + 5, f"survivor failed after {seconds:.1f} s"
    else:  # a dead peer is noticed at once (connection reset)
        assert seconds < pg_timeout + 5, f"survivor failed after {seconds:.1f} s"
