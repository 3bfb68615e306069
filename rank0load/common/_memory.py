"""Host memory for the local shards (each rank; no collectives): staging reservations, shards faulted in.

Every local shard is made resident right after it is allocated (``madvise(MADV_POPULATE_WRITE)``,
Linux 5.14+, else ``zero_()``), so receives take no page faults; the bytes of its storage outside
the shard (FSDP2's padding) are zeroed, so no stale memory is reachable."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterable

import torch

from ..errors import LoadError

_MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE
_madvise: object = None  # the libc function once found; False when unavailable


@functools.cache
def _libc(name: str, argtypes: tuple[type, ...]) -> object:
    """The C library's function ``name``, returning an int (Linux); False where there is none."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):  # not in this C library (malloc_trim is glibc's)
        return False
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def prefault(t: torch.Tensor) -> None:
    """(any rank) Make ``t``'s storage resident (CPU) or zero it (other devices, or no
    ``MADV_POPULATE_WRITE``); zero the storage's bytes outside ``t``."""
    _fill(_outside_zeroed(t), t)


def _fill(pages: tuple[int, int] | None, t: torch.Tensor) -> None:
    """Make ``pages`` resident (one GIL-free ctypes call), else zero ``t``."""
    global _madvise
    if pages is not None:
        if _madvise is None:
            _madvise = _libc("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
        if _madvise is not False and _madvise(*pages, _MADV_POPULATE_WRITE) == 0:  # type: ignore[operator]
            return
        _madvise = False  # none, or EINVAL before Linux 5.14: zero-fill from now on
    t.zero_()


def _outside_zeroed(t: torch.Tensor) -> tuple[int, int] | None:
    """Zero the bytes of ``t``'s storage outside ``t``; the whole pages of that storage (address,
    length) for ``MADV_POPULATE_WRITE``, or None where ``t`` is to be zero-filled instead."""
    storage = t.untyped_storage()
    if t.device.type != "cpu" or not t.is_contiguous() or storage.nbytes() == 0:
        return None
    start, stop = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    lo, hi = -(-start // _PAGE) * _PAGE, stop // _PAGE * _PAGE
    whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    first = t.storage_offset() * t.element_size()
    last = first + t.numel() * t.element_size()
    whole[:first].zero_()
    whole[last:].zero_()
    return (lo, hi - lo) if hi > lo else None


_SMALL = 1 << 20


class FaultIn:
    """(each rank) :func:`prefault` each of ``tensors`` behind the caller's next work: a background
    thread takes them largest first (non-CPU tensors are zeroed here, asynchronously; CPU tensors
    under ``_SMALL`` that fill their storage are skipped: their first write faults them in at the
    same cost). :meth:`wait` faults in what the thread has not reached on the caller's thread too,
    and returns once all are resident."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        todo = []
        with torch.no_grad():
            for t in tensors:
                if t.device.type != "cpu":
                    prefault(t)
                elif t.nbytes >= _SMALL or t.storage_offset() or t.untyped_storage().nbytes() != t.nbytes:
                    todo.append((_outside_zeroed(t), t))
        todo.sort(key=lambda item: item[1].nbytes, reverse=True)
        self._todo = collections.deque(todo)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rank0load-fault-in", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if sys.platform.startswith("linux"):  # nice 19: the pages are needed after the manifest only
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            self._work(self._todo.popleft)
        except BaseException as exc:  # handed to wait(), on the caller's thread
            self._error = exc

    def _work(self, take: Callable[[], tuple[tuple[int, int] | None, torch.Tensor]]) -> None:
        """Fault in tensors taken off the queue (atomic pops) until it is empty."""
        with torch.no_grad():  # grad mode is per thread; the tensors may be parameters
            while True:
                try:
                    item = take()
                except IndexError:
                    return
                _fill(*item)

    def close(self) -> None:
        """Until the thread is done, raising nothing (cleanup on the way out of a failed load)."""
        self._todo.clear()
        self._thread.join()

    def wait(self) -> None:
        """Fault in the rest here too (smallest first); then raise what the thread raised."""
        try:
            self._work(self._todo.pop)
        finally:
            self.close()
        if self._error is not None:
            raise self._error


def trim_heap() -> None:
    """(any rank) Give the C heap's free pages back to the OS (glibc's ``malloc_trim(0)``; elsewhere
    nothing); no allocator setting changes."""
    malloc_trim = _libc("malloc_trim", (ctypes.c_size_t,))
    if malloc_trim:
        malloc_trim(0)  # type: ignore[operator]


def reserve(
    count: int,
    nbytes: int,
    device: torch.device,
    max_staging_bytes: int,
    pin: bool = False,
    error: type[LoadError] = LoadError,
) -> list[torch.Tensor]:
    """(each rank) ``count`` staging buffers of ``nbytes`` on ``device`` (``torch.empty``: no page is
    touched); raises ``error`` naming ``max_staging_bytes`` when they cannot be had."""
    try:
        return [torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin) for _ in range(count)]
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        raise error(
            f"max_staging_bytes={max_staging_bytes}: could not reserve {count} staging buffers of "
            f"{nbytes} bytes ({count * nbytes} in all) on {device} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}). Pass a smaller max_staging_bytes: the "
            "default, 16 MiB, keeps the stream fast."
        ) from None
