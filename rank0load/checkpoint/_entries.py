"""One :class:`Entry` per model tensor and the checkpoint tensors (:class:`Parts`) it is made of:
plain data rank 0 makes (``_fit``) and every rank reads; no collectives."""

from __future__ import annotations

import array
import bisect
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

from ._format import TensorHeader

_FILE, _OFFSET, _NBYTES = map(operator.attrgetter, ("file", "offset", "nbytes"))


@dataclass(frozen=True)
class Parts:
    """Several checkpoint tensors whose bytes, one after the other, are an entry's bytes, held as
    arrays (not one object per part) so that the manifest pickles fast to every rank."""

    files: tuple[str, ...] = ()  # the distinct files, absolute paths on rank 0
    file_of: array.array = field(default_factory=lambda: array.array("I"))  # index into ``files``
    offsets: array.array = field(default_factory=lambda: array.array("q"))  # absolute offset in its file
    starts: array.array = field(default_factory=lambda: array.array("q", [0]))  # its first entry byte

    @classmethod
    def of(cls, tensors: Sequence[TensorHeader]) -> Parts:
        """The parts of ``tensors``, in order."""
        paths = list(map(_FILE, tensors))
        files = tuple(dict.fromkeys(paths))
        index = {f: i for i, f in enumerate(files)}
        return cls(
            files,
            array.array("I", map(index.__getitem__, paths)),
            array.array("q", map(_OFFSET, tensors)),
            array.array("q", [0, *itertools.accumulate(map(_NBYTES, tensors))]),
        )

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def nbytes(self) -> int:
        return self.starts[-1]

    def extents(self, start: int, nbytes: int) -> list[tuple[str, int, int, int]]:
        """See :meth:`Entry.extents`; the parts found by bisection."""
        stop, starts, n = start + nbytes, self.starts, len(self.offsets)
        lo = bisect.bisect_right(starts, start) - 1
        if lo >= n or nbytes <= 0:
            return []
        hi = bisect.bisect_left(starts, stop, lo + 1, n)  # parts lo .. hi - 1 begin before stop
        skipped = starts[lo:hi].tolist()
        begins, ends = skipped.copy(), starts[lo + 1 : hi + 1].tolist()
        begins[0], ends[-1] = max(begins[0], start), min(ends[-1], stop)  # only these two are cut
        sizes = list(map(operator.sub, ends, begins))
        out = list(
            zip(
                map(self.files.__getitem__, self.file_of[lo:hi]),
                map(operator.add, self.offsets[lo:hi], map(operator.sub, begins, skipped)),
                sizes,
                map(operator.sub, begins, itertools.repeat(start)),
            )
        )
        return out if min(sizes) > 0 else [e for e in out if e[2] > 0]  # zero-byte parts: nothing to read


NO_PARTS = Parts()


@dataclass(frozen=True)
class Entry:
    """One model tensor to move, in the wire dtype (the checkpoint's) and the model's shape.

    Its bytes are one checkpoint tensor's (``file``, ``ckpt_key``, ``offset``), or ``parts``' bytes
    one after the other in row-major order (stacked experts); pieces address bytes 0 .. ``nbytes``."""

    key: str  # canonical model key
    file: str  # absolute path on rank 0 (informational elsewhere); the first part's, if any
    ckpt_key: str  # the first part's, if any
    dtype: str  # wire dtype: the checkpoint's
    shape: tuple[int, ...]  # the model tensor's
    offset: int  # absolute offset in ``file``
    nbytes: int
    parts: Parts = NO_PARTS  # several checkpoint tensors, in order; empty: just the one above
    # float8 block-quantised (see _fp8): each part's scale grid, in part order; the block size;
    # each part's rows (its columns are the entry's last dimension). Empty: not quantised.
    scales: Parts = NO_PARTS
    block: tuple[int, int] = (0, 0)
    part_rows: tuple[int, ...] = ()

    def extents(self, start: int, nbytes: int, scales: bool) -> list[tuple[str, int, int, int]]:
        """``(file, file offset, bytes, offset in the buffer)`` for entry bytes [start, start + nbytes)
        (of its scale grids, with ``scales``)."""
        parts = self.scales if scales else self.parts
        if not parts:
            return [(self.file, self.offset + start, nbytes, 0)]
        return parts.extents(start, nbytes)
