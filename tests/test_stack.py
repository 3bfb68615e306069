"""``roomy``: calls inside it never sit on a CPython frame-stack chunk boundary, whatever the depth.

Counted, not timed: a call whose frame starts a new chunk maps a fresh page and faults it in, so a
loop of ``N`` such calls costs at least ``N`` minor page faults (``ru_minflt``), and a loop of calls
that fit costs none. ``test_a_boundary_exists_without_roomy`` shows that the sweep the other tests
run finds such a boundary outside ``roomy``, so they can fail (both checks of it do with ``roomy`` made
a plain call)."""

from __future__ import annotations

import resource
import sys
import types
from collections.abc import Callable

import pytest
import torch

from rank0load.common._stack import roomy
from tests import _dist
from tests.models import toy

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 11) or sys.implementation.name != "cpython",
    reason="frames are kept on a stack of chunks from CPython 3.11 on",
)

CALLS = 200
DEPTHS = range(300)


def _leaf() -> None:
    return None


# A frame wider than one level of _at (512 bytes against ~100), so that some depth leaves room for
# _loop's frame in a chunk but not for this one's.
_wide = types.FunctionType(_leaf.__code__.replace(co_stacksize=64), _leaf.__globals__, "_wide")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _loop(n: int) -> int:
    before = _faults()
    for _ in range(n):
        _wide()
    return _faults() - before


def _at(depth: int, n: int) -> int:
    return _loop(n) if depth == 0 else _at(depth - 1, n)


def worst_loop_faults() -> int:
    """The most page faults a loop of CALLS calls took, over DEPTHS more frames below the caller."""
    return max(_at(d, CALLS) for d in DEPTHS)


def test_a_boundary_exists_without_roomy():
    assert worst_loop_faults() >= CALLS  # what the checks below would see without roomy


def test_no_boundary_inside_roomy_at_any_depth():
    for outer in range(0, 60, 7):  # roomy itself called from different depths
        assert _nest(outer, roomy(worst_loop_faults)) < CALLS // 10


def _nest(depth: int, fn: Callable[[], int]) -> int:
    return fn() if depth == 0 else _nest(depth - 1, fn)


def test_roomy_keeps_the_function_and_what_it_raises():
    @roomy
    def f(a: int, *, b: int = 2) -> int:
        """doc"""
        if a < 0:
            raise ValueError(a)
        return a + b

    assert f(1, b=3) == 4 and f.__name__ == "f" and f.__doc__ == "doc"
    with pytest.raises(ValueError):
        f(-1)


def _load_checking_room(rank: int, world: int, path: str, out: str) -> dict[str, int]:
    import rank0load

    seen: dict[str, int] = {}
    phase = ["load"]

    def model_fn() -> torch.nn.Module:
        seen["model_fn"] = worst_loop_faults()
        return toy()

    def key_map(key: str) -> str:  # called on rank 0
        seen.setdefault(f"{phase[0]} key_map", worst_loop_faults())
        return key

    model = rank0load.load_sharded(model_fn, path, key_map=key_map)
    phase[0] = "save"
    rank0load.save_sharded(model, out, key_map=key_map)
    return seen


def test_load_and_save_run_inside_roomy(toy_checkpoint, tmp_path):
    """model_fn (called by load_sharded on every rank) and key_map (called by load_sharded and
    save_sharded on rank 0) find no chunk boundary at any depth below them."""
    results = _dist.ok(_dist.run(_load_checking_room, 2, toy_checkpoint, str(tmp_path / "out")))
    assert set(results[0]) == {"model_fn", "load key_map", "save key_map"}
    assert set(results[1]) == {"model_fn"}
    for seen in results:
        assert all(faults < CALLS // 10 for faults in seen.values()), seen
