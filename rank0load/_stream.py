"""Rank 0's reader: file bytes into a few reusable staging slots, one thread ahead of the sender.

(rank 0 only) :class:`Reader` runs in a background thread. For each :class:`~._plan.Piece` it
either reads straight into the final destination (rank 0's own shard or a plain tensor, when no
cast is needed and the tensor is on the CPU) or into one of ``slots`` staging buffers of
``piece_bytes`` each. The sender hands slots back once their bytes are sent, so host RAM spent
on staging never exceeds ``slots * piece_bytes`` whatever the checkpoint's size. Reads use
``os.preadv`` at file offsets: no file is mapped, so page-cache pages never count in RSS.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from ._compat import host_bytes
from ._plan import Piece
from .errors import CheckpointFormatError, LoadError

__all__ = ["Reader", "Staged", "read_into"]


def read_into(fd: int, buf: torch.Tensor, offset: int, path: str) -> None:
    """Fill the contiguous uint8 CPU tensor ``buf`` from ``fd`` at ``offset`` (short reads retried)."""
    view = host_bytes(buf)
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointFormatError(
                f"{path}: unexpected end of file at byte {offset + done} while reading "
                "(was the file changed during the load?). Load again; if it repeats, re-download the file."
            )
        done += n


@dataclass
class Staged:
    """A piece whose bytes are ready: in ``slot`` (a staging buffer) or already at ``direct``."""

    piece: Piece
    data: torch.Tensor  # uint8, exactly piece.nbytes
    slot: int | None  # staging slot index to release, or None when read in place


class Reader:
    """Background reader. Iterate it to get :class:`Staged` pieces in order; call :meth:`release`."""

    _DONE = object()

    def __init__(
        self,
        pieces: Iterable[Piece],
        files: list[str],
        direct: Callable[[Piece], torch.Tensor | None],
        *,
        slots: int,
        piece_bytes: int,
        pin: bool = False,
    ) -> None:
        self._pieces = pieces
        self._files = files
        self._direct = direct
        self._buffers = [torch.empty(piece_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(slots)]
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(slots):
            self._free.put(i)
        self._ready: queue.Queue[object] = queue.Queue(maxsize=slots + 1)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.failed: LoadError | None = None  # the first read error (I/O error, file changed)
        self._thread = threading.Thread(target=self._run, name="rank0load-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fds: dict[str, int] = {}
        try:
            for piece in self._pieces:
                if self._stop.is_set():
                    return
                path = self._files[piece.index]
                target = self._direct(piece)
                slot: int | None = None
                if target is None:
                    slot = self._get_slot()
                    if slot is None:
                        return
                    data = self._buffers[slot][: piece.nbytes]
                else:
                    data = target
                if self.failed is None:
                    try:
                        fd = fds.get(path)
                        if fd is None:
                            for old in fds.values():  # one file open at a time; manifest is in file order
                                os.close(old)
                            fds.clear()
                            fd = fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                        read_into(fd, data, piece.file_offset, path)
                    except LoadError as exc:
                        self.failed = exc
                    except OSError as exc:
                        self.failed = LoadError(
                            f"rank 0 could not read {path} at byte {piece.file_offset}: {exc.strerror or exc}. "
                            "Check the disk and the file (was it moved or changed during the load?) and retry."
                        )
                # After a read error the remaining pieces still flow (unread bytes) so that every
                # rank completes the same collectives; the sender then reports ``failed`` to all.
                self._put(Staged(piece, data, slot))
        except BaseException as exc:  # handed to the consumer, re-raised there
            self._error = exc
        finally:
            for fd in fds.values():
                os.close(fd)
            self._put(self._DONE)

    def _get_slot(self) -> int | None:
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def _put(self, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def buffer(self, slot: int) -> torch.Tensor:
        """The whole staging buffer behind ``slot`` (``Staged.data`` is its first bytes)."""
        return self._buffers[slot]

    def release(self, slot: int | None) -> None:
        if slot is not None:
            self._free.put(slot)

    def __iter__(self) -> Iterator[Staged]:
        while True:
            item = self._ready.get()
            if item is self._DONE:
                if self._error is not None:
                    raise self._error
                return
            yield item  # type: ignore[misc]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._buffers.clear()
