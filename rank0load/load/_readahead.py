"""Reading checkpoint bytes at their file offsets, and rank 0's reader, one thread ahead of the sender.

(rank 0 and local readers; no collectives) Every read goes through :func:`read_vectored`, so a test
patches it once for rank 0 and local readers. No file is mapped: page-cache pages never count in a
rank's RSS.

(rank 0 only) :class:`Reader` reads each message in a background thread, straight into its
destination or into a staging buffer (on an accelerator mesh, a pinned ring read by several
threads); a buffer is filled again only once the sender released it, so staging stays in its budget.
"""

from __future__ import annotations

import collections
import concurrent.futures
import operator
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..checkpoint._entries import Entry
from ..checkpoint._files import opened
from ..errors import CheckpointFormatError, LoadError
from ..integrations._compat import host_bytes
from ._plan import Message, Route
from ._sink import Arrival, Staging

# accelerator mesh: threads read every free slot's message at once, in parts of at most _PART_BYTES
ACCELERATOR_READ_THREADS = 16
_PART_BYTES = 8 << 20
_RING_ALIGN = 4096
_RING_MESSAGES = 64  # messages read ahead at most, in the ring

_Ready = tuple[Arrival, list[concurrent.futures.Future[None]]]  # a message, its parts' reads in flight


def read_threads(device: torch.device) -> int:
    """How many threads rank 0's reader uses for the stream to ``device``'s meshes."""
    if device.type == "cpu":
        return 1
    return max(1, min(ACCELERATOR_READ_THREADS, os.cpu_count() or 1))


_IOV_MAX = 1024  # buffers one preadv takes (Linux's IOV_MAX)


def read_into(
    fd: int, views: list[memoryview], offset: int, path: str, reader: str = "rank 0", hint: str = ""
) -> None:
    """:func:`read_vectored`, its OSError a LoadError naming ``reader`` (``hint``: another way)."""
    try:
        read_vectored(fd, views, offset, path)
    except OSError as exc:
        raise LoadError(
            f"{reader} could not read {path} at byte {offset}: {exc.strerror or exc}. Check the disk "
            f"and the file (was it moved or changed during the load?) and retry{hint}."
        ) from None


def read_vectored(fd: int, views: list[memoryview], offset: int, path: str) -> None:
    """Fill ``views`` one after the other from the file bytes at ``offset`` on: one ``preadv`` for
    them all unless the kernel returns less (short reads retried). Raises CheckpointFormatError at
    end of file, OSError as the kernel gives it."""
    at, i = offset, 0
    views = list(views)
    while i < len(views):
        n = os.preadv(fd, views[i : i + _IOV_MAX], at)
        if n <= 0:
            raise CheckpointFormatError(
                f"{path}: unexpected end of file at byte {at} while reading "
                "(was the file changed during the load?). Load again; if it repeats, re-download the file."
            )
        at += n
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]


def runs(
    extents: list[tuple[str, int, int, int]], data: torch.Tensor
) -> list[tuple[str, int, list[memoryview]]]:
    """A piece's extents (``Entry.extents``) as runs of nearby file bytes, each read with one
    ``preadv`` scattering into ``data``: ``(file, offset, buffers)``, the files in the order the
    extents first name them, each file's runs by offset; extents at most ``_GAP`` apart share a run."""
    view = host_bytes(data)
    if len(extents) == 1:
        path, offset, nbytes, at = extents[0]
        return [(path, offset, [view[at : at + nbytes]])]
    order = dict.fromkeys(map(_PATH, extents))
    if len(order) == 1:  # the usual case: sorted by offset with a C-level key
        ordered = sorted(extents, key=_OFFSET)
    else:
        rank = {path: i for i, path in enumerate(order)}
        ordered = sorted(extents, key=lambda e: (rank[e[0]], e[1]))
    out: list[tuple[str, int, list[memoryview]]] = []
    end = -1
    for path, offset, nbytes, at in ordered:
        if out and out[-1][0] == path and end <= offset <= end + _GAP:
            if offset > end:  # bytes no one asked for: read into the scratch buffer, not another call
                out[-1][2].append(_SCRATCH[: offset - end])
            out[-1][2].append(view[at : at + nbytes])
        else:
            out.append((path, offset, [view[at : at + nbytes]]))
        end = offset + nbytes
    return out


_PATH, _OFFSET = operator.itemgetter(0), operator.itemgetter(1)


def split_runs(
    reads: list[tuple[str, int, list[memoryview]]], size: int
) -> list[tuple[str, int, list[memoryview]]]:
    """``reads`` (:func:`runs`) cut into reads of at most ``size`` bytes, each still one run of file
    bytes (a buffer is cut where a read ends), so that threads can read them side by side."""
    out: list[tuple[str, int, list[memoryview]]] = []
    for path, offset, views in reads:
        if sum(map(len, views)) <= size:
            out.append((path, offset, views))
            continue
        cur: list[memoryview] = []
        start, filled = offset, 0
        for view in views:
            while len(view):
                take = min(len(view), size - filled)
                cur.append(view[:take])
                view, filled = view[take:], filled + take
                if filled == size:
                    out.append((path, start, cur))
                    start, cur, filled = start + size, [], 0
        if cur:
            out.append((path, start, cur))
    return out


# gaps of at most _GAP bytes are read too, into _SCRATCH (never read, so threads may share it): one
# preadv for a rank's rows of stacked experts, whose parts sit between other tensors'
_GAP = 64 << 10
_SCRATCH = memoryview(bytearray(_GAP))


class _Ring:
    """(rank 0's reader thread, on an accelerator mesh) The pinned staging as one ring, so that many
    small messages are read at once: each takes the next bytes it needs from a ``_RING_ALIGN``
    boundary, filled again only once released and the event released with them has completed.
    Releases may come in any order; the bytes come back in the order they were taken."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.live: collections.deque[tuple[int, int, int]] = collections.deque()  # (token, start, end)
        self._released: dict[int, torch.Event | None] = {}  # tokens released, their bytes not yet taken again
        self._token = 0

    def take(
        self, nbytes: int, released: Callable[[], tuple[int, torch.Event | None] | None]
    ) -> tuple[int, torch.Tensor] | None:
        """The next ``nbytes`` (at most the ring's size) and their release token; None once stopped."""
        size = self.buffer.numel()
        need = min(size, max(1, -(-nbytes // _RING_ALIGN)) * _RING_ALIGN)  # never 0: see _place
        while (at := self._place(need, size)) is None:
            token = self.live[0][0]  # wait for the oldest bytes
            while token not in self._released:
                got = released()
                if got is None:
                    return None
                self._released[got[0]] = got[1]
            copied = self._released.pop(token)
            if copied is not None:
                copied.synchronize()  # the device has read these bytes: they may be filled again
            self.live.popleft()
        self._token += 1
        self.live.append((self._token, at, at + need))
        return self._token, self.buffer[at : at + nbytes]

    def _place(self, need: int, size: int) -> int | None:
        """Where ``need`` (> 0) bytes fit after the newest live region, or None."""
        if not self.live:
            return 0
        first, last = self.live[0][1], self.live[-1][2]
        if self.live[-1][1] >= first:  # not wrapped: the live bytes are first .. last
            if last + need <= size:
                return last
            return 0 if need <= first else None
        return last if last + need <= first else None


class Reader:
    """(rank 0) Background reader: iterate it for each message's :class:`~._sink.Arrival`, in order, and
    :meth:`release` each; iterating re-raises an error of the reader thread itself.

    Reads go through ``files`` (path -> ``_files.OpenFile``), never a re-opened path; each file's
    identity is checked when the reader leaves it (its last reads done) and every file's once more at
    the end. The first failure (I/O error, changed file, allocation) is kept in :attr:`failed`; the
    remaining messages still flow, unread, so that every rank completes the same messages. With
    ``staging.host`` and several ``threads``, ``Arrival.slot`` is a ring token: the consumer must
    release each message before asking for the next, or the reader stalls.
    """

    def __init__(
        self,
        messages: Iterable[Message],
        entries: Sequence[Entry],
        files: Mapping[str, Any],
        direct: Callable[[Message], torch.Tensor | None],
        staging: Staging,
        threads: int,
    ) -> None:
        self._messages = messages
        self._entries = entries
        self._current: str | None = None  # the file read last
        self._files = files
        self._direct = direct
        self._buffers = staging.slots
        # free slots, each with the event after which its last copy to the device is done (or None)
        self._free: queue.Queue[tuple[int, torch.Event | None]] = queue.Queue()
        self._ring = _Ring(staging.host) if staging.host is not None and threads > 1 else None
        if self._ring is None:
            for i in range(len(staging.slots)):
                self._free.put((i, None))
        ahead = _RING_MESSAGES if self._ring is not None else len(staging.slots)
        self._ready: queue.Queue[_Ready | None] = queue.Queue(maxsize=ahead + 1)  # None: the end
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.failed: BaseException | None = None  # the first failure (I/O error, file changed, ...)
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="rank0load-read")
            if threads > 1
            else None
        )
        self._inflight: list[concurrent.futures.Future[None]] = []  # the current file's reads
        self._thread = threading.Thread(target=self._run, name="rank0load-reader", daemon=True)
        self._thread.start()

    def _fail(self, exc: BaseException) -> None:
        if self.failed is None:
            self.failed = exc

    def _submit(self, message: Message, data: torch.Tensor) -> list[concurrent.futures.Future[None]]:
        """Read ``message`` into ``data``, from the one or several checkpoint tensors it spans: here, or
        (``threads`` > 1) handed to the threads in parts, which it returns."""
        extents = []  # shifted to their place in the message, so that adjacent ones merge
        for piece, at in message.parts():
            entry, scales = self._entries[piece.index], piece.route is Route.SCALES
            for path, offset, nbytes, into in entry.extents(piece.start, piece.nbytes, scales):
                extents.append((path, offset, nbytes, at + into))
        parts: list[concurrent.futures.Future[None]] = []
        for path, offset, views in runs(extents, data):
            if path != self._current:  # leaving a file (in manifest order): check it after its last reads
                concurrent.futures.wait(self._inflight)
                self._inflight = []
                self._check(self._current)
                self._current = path
            if self._pool is None:
                read_into(opened(self._files, path).fd, views, offset, path)
                continue
            for part in split_runs([(path, offset, views)], _PART_BYTES):
                parts.append(self._pool.submit(self._read_part, *part))
        self._inflight = [f for f in self._inflight if not f.done()] + parts
        return parts

    def _read_part(self, path: str, offset: int, views: list[memoryview]) -> None:
        try:
            read_into(opened(self._files, path).fd, views, offset, path)
        except Exception as exc:
            self._fail(exc)

    def _check(self, path: str | None) -> None:
        file = self._files.get(path) if path is not None else None
        if file is not None and self.failed is None:
            try:
                file.check()
            except Exception as exc:
                self._fail(exc)

    def _run(self) -> None:
        try:
            for message in self._messages:
                if self._stop.is_set():
                    return
                data: torch.Tensor | None = None
                slot: int | None = None
                try:
                    data = self._direct(message)
                except Exception as exc:
                    self._fail(exc)
                if data is None and self._ring is not None:
                    taken = self._ring.take(message.nbytes, self._released)
                    if taken is None:
                        return
                    slot, data = taken
                elif data is None:
                    slot = self._get_slot()
                    if slot is None:
                        return
                    data = self._buffers[slot][: message.nbytes]
                reads: list[concurrent.futures.Future[None]] = []
                if self.failed is None:
                    try:
                        reads = self._submit(message, data)
                    except Exception as exc:
                        self._fail(exc)
                self._put((Arrival(message, data, slot, in_target=slot is None), reads))
            concurrent.futures.wait(self._inflight)  # the last reads done before the last checks
            for path in self._files:  # every file, once more, after the last read
                self._check(path)
        except BaseException as exc:  # handed to the consumer, re-raised there
            self._error = exc
        finally:
            self._put(None)

    def _get_slot(self) -> int | None:
        released = self._released()
        if released is None:
            return None
        slot, copied = released
        if copied is not None:
            copied.synchronize()  # the device has read the slot: it may be filled again
        return slot

    def _released(self) -> tuple[int, torch.Event | None] | None:
        """The next slot or ring token the sender handed back, with its event; None: stopped."""
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def _put(self, item: _Ready | None) -> None:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def release(self, slot: int | None, copied: torch.Event | None = None) -> None:
        """Hand ``slot`` back, filled again once ``copied`` (recorded after the non-blocking copies that
        read it) has completed: the reader thread waits, not the sender, so the copies queue back to back."""
        if slot is not None:
            self._free.put((slot, copied))

    def __iter__(self) -> Iterator[Arrival]:
        while True:
            item = self._ready.get()
            if item is None:
                if self._error is not None:
                    raise self._error
                return
            arrival, reads = item
            for read in reads:
                read.result()  # never raises: a part's failure is kept in `failed`
            yield arrival

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)  # no read into a slot after this
