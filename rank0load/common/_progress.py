"""Rank 0's progress bar over bytes, and the peak-RSS probe (no collectives).

(rank 0) :func:`progress_bar`: huggingface_hub's ``tqdm`` (``HF_HUB_DISABLE_PROGRESS_BARS=1`` turns
it off), only when stderr is a terminal. (all ranks) :func:`peak_rss_bytes`."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator

__all__ = ["peak_rss_bytes", "progress_bar"]

logger = logging.getLogger(__name__)


def peak_rss_bytes() -> int:
    """(any rank) This process's peak resident set size in bytes (``VmHWM``, else ``getrusage``)."""
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        open("/proc/self/status", encoding="ascii") as f,
    ):
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return 0
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # bytes on macOS, KiB on Linux


def no_progress(nbytes: int) -> None:
    """A byte counter that counts nothing (the bar is off)."""


@contextlib.contextmanager
def progress_bar(total_bytes: int, show: bool) -> Iterator[Callable[[int], None]]:
    """(all ranks) A byte counter: with ``show`` (rank 0), one drawing a progress bar on a terminal;
    :func:`no_progress` when the bar is off."""
    try:
        terminal = show and sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        terminal = False
    if not terminal:
        yield no_progress
        return
    from huggingface_hub.utils import tqdm  # a dependency; imported only when a bar is drawn

    bar = tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="rank0load",
        leave=False,
        dynamic_ncols=True,
        file=sys.stderr,
        name="rank0load",
    )
    try:
        yield no_progress if bar.disable else bar.update  # disabled by HF_HUB_DISABLE_PROGRESS_BARS
    finally:
        bar.close()
