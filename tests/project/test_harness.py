"""tests/_dist.py itself: a rank that hangs fails the test with where every hung rank is."""

from __future__ import annotations

import time

import pytest

from tests import _dist


def _rank1_waits_forever(rank: int, world: int) -> int:
    while rank == 1:
        time.sleep(0.1)
    return rank


def test_a_hang_fails_with_the_hung_ranks_stacks():
    with pytest.raises(pytest.fail.Exception) as failed:
        _dist.spawn(_rank1_waits_forever, 2, timeout=20)
    message = str(failed.value)
    assert "ranks [1] of 2 still running after 20 s: a hang" in message
    assert "rank 1, inside fn:" in message and "rank 0," not in message
    assert "_rank1_waits_forever" in message  # its Python stack, from the faulthandler dump
