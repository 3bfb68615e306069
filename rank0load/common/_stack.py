"""Room on CPython's frame stack for a whole load or save (all ranks, in the calling thread).

CPython 3.11 and later keep a thread's Python frames on a stack of chunks (16 KiB at least). A call
whose frame does not fit in the current chunk gets a new chunk from ``mmap``, and returning from the
first frame of a chunk gives the chunk back with ``munmap``. A loop that calls a function right at a
chunk's end therefore maps, faults in and unmaps a fresh page on every call: 6.5-6.9 µs a call
against 0.03-0.09 µs at other depths and inside :func:`roomy` at any depth (this project's 2-core
VM; Python 3.11.7, 3.12.1 and 3.13.0 alike; 3.10.13 has no chunks and no such depth), more with
other threads running, since each ``munmap`` flushes their TLBs.

Where that boundary falls depends on how deep the caller's stack already is, which nothing inside
the callee can see. Counted with strace on rank 1 of the bench's first dense load (0.84 GB, 2
ranks) called from 8 depths (0 to 13 frames more), the build (the ``torch._dynamo`` import that
DTensor's constructor triggers, and ``fully_shard``) mapped and unmapped 1,191 to 14,138 chunks;
DCP's reader, built the same way by the bench, 771 to 14,066. :func:`roomy` runs the call inside
a frame so large that the chunk made for it leaves 128 KiB free behind it, enough for the deepest
stack a load reaches (a few hundred frames), wherever it is called from: 0 chunks in the load at
the 3 depths tried. In the bench (8 paired rounds, fresh processes) it took rank0load's first call
from 1.03x to 1.00x DCP's and from 1.10x to 1.05x the floor (medians).

The large frame costs one 256 KiB chunk per call, of which only the pages the deeper frames use are
ever touched: the frame's own value stack is never written (CPython initialises only its locals).
"""

from __future__ import annotations

import functools
import struct
import sys
import types
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["roomy"]

P = ParamSpec("P")
R = TypeVar("R")

# Free stack behind the large frame: a chunk is the smallest power of two from 16 KiB up that holds
# its first frame, so a frame just over 128 KiB gets a 256 KiB chunk with ~128 KiB to spare.
ROOM_BYTES = 128 << 10


def _call(fn: Callable[[], R]) -> R:
    return fn()


def _with_room() -> Callable[[Callable[[], R]], R]:
    """``_call`` with a value stack of ``ROOM_BYTES`` (unused: only its size matters), on CPython
    3.11+; before 3.11 frames are separate objects and there is no chunk to keep, so ``_call``."""
    if sys.version_info < (3, 11) or sys.implementation.name != "cpython":
        return _call
    code = _call.__code__
    words = ROOM_BYTES // struct.calcsize("P")
    return types.FunctionType(
        code.replace(co_stacksize=code.co_stacksize + words), _call.__globals__, "_call_with_room"
    )


_call_with_room = _with_room()


def roomy(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` called inside :data:`ROOM_BYTES` of fresh frame stack (see the module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        return _call_with_room(functools.partial(fn, *args, **kwargs))

    return wrapper
