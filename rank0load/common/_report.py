"""What a load did: :class:`LoadReport` (every rank), rank 0's log lines and progress bar, the peak-RSS
probe, and a sharded model's FSDP groups (any rank). No collectives."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..integrations._compat import fsdp_groups

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FSDPGroup:
    """One FSDP2 parameter group: what a training step gathers and reduces as one unit."""

    module: str  # qualified name of the module fully_shard was applied to; "" for the root
    parameters: int  # parameters in the group (a tied parameter once)
    elements: int  # their elements, whole (unsharded): what one all-gather assembles
    trainable_dtypes: tuple[torch.dtype, ...]  # dtypes of the parameters with requires_grad, sorted
    frozen_dtypes: tuple[torch.dtype, ...]  # dtypes of the others (gathered, never reduced), sorted
    # parameters below the unit kept out of FSDP (ignored_params): a full copy on every rank, their
    # gradients averaged by rank0load after each backward; not counted above
    replicated: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = self.module or "(root)"
        noun = "parameter" if self.parameters == 1 else "parameters"
        text = f"{where}: {self.parameters} {noun}, {self.elements:,} elements"
        for label, dtypes in (("trainable", self.trainable_dtypes), ("frozen", self.frozen_dtypes)):
            if dtypes:
                text += f", {label} " + " + ".join(str(d).removeprefix("torch.") for d in dtypes)
        if self.replicated:
            text += ", replicated " + ", ".join(self.replicated)
        return text


def fsdp_plan(model: nn.Module) -> tuple[FSDPGroup, ...]:
    """(any rank) The FSDP2 groups of a sharded ``model``, in ``named_modules()`` order (root first);
    each plain parameter (kept out of FSDP) listed under the innermost unit that holds it."""
    groups = fsdp_groups(model)
    units = {name for name, _, _ in groups}
    replicated: dict[str, list[str]] = {}
    if isinstance(model, FSDPModule):  # the root is a unit: plain parameters were left out of FSDP
        for name, p in model.named_parameters():
            if not isinstance(p, DTensor):
                owner = name.rpartition(".")[0]
                while owner and owner not in units:
                    owner = owner.rpartition(".")[0]
                replicated.setdefault(owner, []).append(name)
    return tuple(
        FSDPGroup(
            module=name,
            parameters=len(params),
            elements=sum(p.numel() for _, p in params),
            trainable_dtypes=tuple(sorted({p.dtype for _, p in params if p.requires_grad}, key=str)),
            frozen_dtypes=tuple(sorted({p.dtype for _, p in params if not p.requires_grad}, key=str)),
            replicated=tuple(replicated.pop(name, ())),  # on the unit's first group
        )
        for name, _, params in groups
    )


@dataclass
class LoadReport:
    """What a load did (on every rank; byte counts are the checkpoint's)."""

    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    stream_seconds: float = 0.0
    missing: tuple[str, ...] = ()  # initialised by the model's own initialisation (strict=False)
    # absent from the checkpoint, left as model_fn built them (PEFT adapters); not in missing
    kept: tuple[str, ...] = ()
    # fraction of the parameters' elements initialised rather than loaded (kept ones not counted)
    initialised_fraction: float = 0.0
    unexpected: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    # keys held in full on every rank for a moment, outside the staging budget; empty for FSDP/HSDP/TP
    broadcast_whole: tuple[str, ...] = ()
    # model key -> "sharded" (rows), "block" (cut by rank 0), "plain" (pieces) or "generic" (whole)
    kinds: dict[str, str] = field(default_factory=dict)
    # (checkpoint tensors, model tensors): per-expert tensors assembled into fused parameters
    assembled: tuple[int, int] = (0, 0)
    dequantised: int = 0  # model tensors loaded from float8 block-quantised checkpoint tensors
    phases: dict[str, float] = field(default_factory=dict)  # seconds per pipeline phase, this rank
    peak_rss_bytes: int = 0  # this rank's peak resident set size (VmHWM) when the load finished
    rank: int = 0
    world_size: int = 1
    # node-local reads: whether this rank read through rank 0's open files; the ranks that did (same
    # on every rank); this rank's path and why: "rank 0", "local: ...", or "stream: <why not local>"
    local_read: bool = False
    local_readers: tuple[int, ...] = ()
    local_status: str = ""
    # readers="host": the first rank of each host, other than rank 0's, whose copy of the files was
    # rank 0's and whose ranks read for themselves (the same on every rank)
    host_readers: tuple[int, ...] = ()
    # (rank 0; 0 elsewhere) bytes rank 0 sent to ranks off its host, each broadcast counted once
    network_bytes: int = 0
    # runs of checkpoint files whose headers rank 0 matched one run at a time
    manifest_runs: int = 0
    # the model's FSDP2 groups as sharded, root first; the same on every rank
    fsdp_groups: tuple[FSDPGroup, ...] = ()
    # parameters kept out of FSDP (a full copy on every rank; their gradients averaged over the ranks
    # after each backward), as the model names them: e.g. an fp32 router bias beside bf16 experts
    replicated: tuple[str, ...] = ()

    @property
    def gb_per_s(self) -> float:
        """Bytes streamed per second of ``stream_seconds``, in GB/s (0.0 when nothing was streamed)."""
        return self.bytes / 1e9 / self.stream_seconds if self.stream_seconds > 0 else 0.0


class Clock:
    """(each rank) Records the seconds since the previous mark under each phase name."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.started = self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self.last
        self.last = now


def log_summary(report: LoadReport, sizes: dict[str, int]) -> None:
    """(rank 0) Warnings for what the load skipped or could not bound, then one INFO line.
    ``sizes``: bytes of each key in ``report.broadcast_whole``."""
    if report.initialised_fraction > 0.5:
        logger.warning(
            "MOST OF THE MODEL WAS NOT LOADED: %.0f%% of its parameters' elements were initialised "
            "because the checkpoint lacks them (strict=False), e.g. %s. Check that model_fn builds the "
            "model this checkpoint holds, or pass key_map.",
            100 * report.initialised_fraction,
            ", ".join(report.missing[:5]),
        )
    for level, message, keys, shown in (
        (
            logging.INFO,
            "kept %d tensors as model_fn built them (PEFT adapters the checkpoint lacks): %s",
            report.kept,
            5,
        ),
        (logging.WARNING, "initialised %d tensors absent from the checkpoint: %s", report.missing, 10),
        (logging.WARNING, "skipped %d unexpected checkpoint keys: %s", report.unexpected, 10),
    ):
        if keys:
            logger.log(level, message, len(keys), ", ".join(keys[:shown]))
    if report.replicated:
        logger.info(
            "kept %d parameters out of FSDP (no group could take them): a full copy on every rank, "
            "their gradients averaged over the ranks after each backward: %s",
            len(report.replicated),
            ", ".join(report.replicated[:5]) + (" ..." if len(report.replicated) > 5 else ""),
        )
    whole = report.broadcast_whole
    if whole:
        largest = max(whole, key=lambda k: sizes[k])
        logger.warning(
            "%d tensors were broadcast whole and cut on every rank, outside max_staging_bytes "
            "(their placements are not Shard/_StridedShard/Replicate, or their rows are wider than "
            "max_staging_bytes / 8); the largest, %s, holds %.1f MB: %s",
            len(whole),
            largest,
            sizes[largest] / 1e6,
            ", ".join(whole[:10]),
        )
    if report.assembled[1] or report.dequantised:
        logger.info(
            "assembled %d checkpoint tensors into %d model tensors; dequantised %d float8 tensors",
            report.assembled[0],
            report.assembled[1],
            report.dequantised,
        )
    logger.info(
        "rank0load: %d tensors, %.2f GB in %.2f s (stream %.2f GB/s) over %d ranks in %d FSDP groups, "
        "rank 0 peak RSS %.0f MB",
        report.tensors,
        report.bytes / 1e9,
        report.seconds,
        report.gb_per_s,
        report.world_size,
        len(report.fsdp_groups),
        report.peak_rss_bytes / 1e6,
    )
    if logger.isEnabledFor(logging.DEBUG):  # one line per group: thousands for a MoE model
        logger.debug("FSDP groups:\n%s", "\n".join(f"  {g}" for g in report.fsdp_groups))


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
    """(all ranks) A byte counter: with ``show`` (rank 0) and stderr a terminal, one drawing
    huggingface_hub's ``tqdm`` bar (``HF_HUB_DISABLE_PROGRESS_BARS=1`` turns it off); else
    :func:`no_progress`."""
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
