"""Opening checkpoint files: regular files only, read-only, opened once, checked for changes (rank 0;
no collectives). Every later read goes through that descriptor, never by re-opening the path; ranks
on rank 0's host check lent descriptors against its :class:`FileIdentity`."""

from __future__ import annotations

import hashlib
import os
import stat
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..errors import CheckpointChangedError, CheckpointFormatError, CheckpointNotFoundError, InternalError

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def not_regular(path: str, mode: int, where: str | None = None) -> CheckpointFormatError:
    """The error for a checkpoint path that is not a regular file; ``where``: what named it, if any."""
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    what = (
        "pass the directory itself as ckpt_path, or name a .safetensors file inside it"
        if stat.S_ISDIR(mode)
        else "rank0load reads checkpoint files at offsets (pread), which only a regular file allows: "
        "write the data to a regular file first and load that"
    )
    prefix = f"{where}: " if where else ""
    target = os.path.realpath(path)
    link = f", a symlink to {target}" if os.path.islink(path) or target != os.path.abspath(path) else ""
    return CheckpointFormatError(f"{prefix}{path} is not a regular file ({kind}{link}): {what}.")


# O_NONBLOCK: a FIFO with no writer would block rank 0's open() while the others wait in a collective.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class FileIdentity:
    """What ``os.fstat`` says when the file is opened: a later difference means it changed."""

    dev: int  # st_dev: the filesystem
    ino: int  # st_ino: the file on it (a rename over the path gives a new one)
    size: int  # st_size in bytes
    mtime_ns: int  # st_mtime_ns: moves on every write (to the filesystem's timestamp granularity)

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def rewritten(self, fd: int) -> list[str]:
        """How the file open at ``fd`` differs from this identity in size or mtime; empty if not."""
        now = FileIdentity.of(os.fstat(fd))
        changes = []
        if now.size != self.size:
            changes.append(f"size {self.size} -> {now.size}")
        if now.mtime_ns != self.mtime_ns:
            changes.append(f"rewritten: mtime changed ({self.mtime_ns} -> {now.mtime_ns} ns)")
        return changes


class OpenFile:
    """(rank 0) One checkpoint file, opened once; the caller closes it (:meth:`close` or ``with``)."""

    __slots__ = ("path", "fd", "identity")

    def __init__(self, path: str, fd: int, identity: FileIdentity) -> None:
        self.path = path  # as given to open(): TensorHeader.file and error messages use it
        self.fd = fd  # -1 once closed
        self.identity = identity

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> OpenFile:
        """Open ``path`` if it is a regular file (after following symlinks).

        Raises:
            CheckpointNotFoundError: it does not exist or cannot be opened.
            CheckpointFormatError: it is not a regular file (FIFO, socket, device, directory).
        """
        path = os.fspath(path)
        try:
            mode = os.stat(path).st_mode  # refuse before open(): open() itself may block or act
            if not stat.S_ISREG(mode):
                raise not_regular(path, mode)
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            raise CheckpointNotFoundError(
                f"{path}: cannot open: {exc.strerror}. Check that the file exists and is readable by this "
                "process (permissions, a broken symlink, an unmounted filesystem)."
            ) from None
        try:
            st = os.fstat(fd)  # the path may have been swapped since os.stat: check what we opened
            if not stat.S_ISREG(st.st_mode):
                raise not_regular(path, st.st_mode)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, FileIdentity.of(st))

    def check(self) -> None:
        """Raise :class:`CheckpointChangedError` unless the open file and the file at its path are
        still the one opened: same device, inode, size and mtime (``os.fstat`` and ``os.stat``)."""
        if self.fd < 0:
            raise ValueError(f"{self.path}: check() on a closed OpenFile")
        was = self.identity
        changes = was.rewritten(self.fd)
        try:
            at_path = FileIdentity.of(os.stat(self.path))
        except OSError as exc:
            changes.append(f"removed: the path cannot be read any more ({exc.strerror})")
        else:
            if (at_path.dev, at_path.ino) != (was.dev, was.ino):
                dev = f", device {was.dev} -> {at_path.dev}" if at_path.dev != was.dev else ""
                changes.append(f"replaced: inode {was.ino} -> {at_path.ino}{dev}")
        if changes:
            raise CheckpointChangedError(
                f"{self.path} changed ({'; '.join(changes)}): the checkpoint changed during the load; "
                "wait until whatever writes it has finished, then load again."
            )

    def close(self) -> None:
        """Close the descriptor; calling it again does nothing."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> OpenFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            warnings.warn(f"unclosed OpenFile {self.path!r}", ResourceWarning, stacklevel=2)
            self.close()

    def __repr__(self) -> str:
        return f"OpenFile({self.path!r}, fd={self.fd})"


def open_files(paths: Iterable[str]) -> dict[str, OpenFile]:
    """(rank 0) Open every path once (:meth:`OpenFile.open`), keyed by the path as given; if one
    fails, those opened are closed and the error raised. The caller closes the returned files."""
    files: dict[str, OpenFile] = {}
    try:
        for path in paths:
            if path not in files:
                files[path] = OpenFile.open(path)
    except BaseException:
        for f in files.values():
            f.close()
        raise
    return files


def opened(files: Mapping[str, OpenFile], path: str) -> OpenFile:
    """(rank 0) ``files[path]``, opened when its header was read; a missing one is our bug."""
    found = files.get(path)
    if found is None:
        raise InternalError(f"internal error: {path} was not opened when its header was read")
    return found


def read_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    """``n`` bytes at ``offset`` (short reads retried); CheckpointChangedError if the file ends first."""
    parts = []
    done = 0
    while done < n:
        chunk = os.pread(fd, n - done, offset + done)
        if not chunk:
            raise CheckpointChangedError(
                f"{path} changed (it ended after {offset + done} bytes, {n - done} short of what was "
                "read before): the checkpoint changed during the load; wait until whatever writes it "
                "has finished, then load again."
            )
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)


# what content_digest reads of a file's data besides its header: this many blocks of this size, spread
# evenly from the data's first byte to its last (a copy with other values differs in them)
_SAMPLES, _SAMPLE_BYTES = 16, 4096


def content_digest(fd: int, size: int, path: str) -> bytes:
    """A digest of the safetensors file of ``size`` bytes open at ``fd``: its header (length and JSON)
    and a few sampled blocks of its data; no full-file hashing. Two files of one size with one digest
    hold the same tensors (names, shapes, dtypes, offsets, metadata) and the same sampled bytes: a copy
    with other values, or another file under the name, differs; a change between the samples does
    not. Raises CheckpointChangedError if the file ends early, OSError if it cannot be read."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(size.to_bytes(8, "little"))
    if size < 8:
        digest.update(read_exact(fd, size, 0, path))
        return digest.digest()
    length = int.from_bytes(read_exact(fd, 8, 0, path), "little")
    header = min(length, size - 8)  # a header longer than the file: what there is (rank 0 refused it)
    digest.update(read_exact(fd, header, 8, path))
    begin = 8 + header
    span = size - begin
    if span <= _SAMPLES * _SAMPLE_BYTES:
        digest.update(read_exact(fd, span, begin, path))
        return digest.digest()
    step = (span - _SAMPLE_BYTES) // (_SAMPLES - 1)
    for i in range(_SAMPLES):
        digest.update(read_exact(fd, _SAMPLE_BYTES, begin + i * step, path))
    return digest.digest()
