"""Moving the tensor data: each rank takes its messages' bytes from its source, round by round (all ranks).

(all ranks) :func:`stream`: each rank hands every arrival into its sink (rank 0 first to the ranks it
serves) and gives its buffer back (each source's ``take``).

The messages are fixed by the plan: after a *local* failure (a read, cast or copy error, a changed
file) a rank keeps sending and receiving the round's remaining messages, from and into scratch, and
does no more local work. At every round's end the ranks compare notes; if any failed, all raise its
error there and the process group stays usable. Only a failing collective (a peer gone) raises at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..common._distribute import settled
from ..errors import LoadError
from ._sink import Sink, Staging
from ._sources import FileSource, OwnSource, ReceiveSource

if TYPE_CHECKING:
    from ._localread import LocalReads

__all__ = ["stream"]


def stream(
    sink: Sink,
    staging: Staging,
    files: Mapping[str, Any],
    on_bytes: Callable[[int], None],
    local: LocalReads,
) -> None:
    """(all ranks) Move every piece of ``sink.plan`` into ``sink``; rank 0 reads from ``files``. ``local``:
    the ranks that read their own bytes (rank 0 sends them only the broadcasts, none when all do).
    Raises the same error on every rank if any rank failed."""
    plan = sink.plan
    with settled(
        sink.faults,
        plan.rounds,
        "moving tensor data",
        "No model was returned; the process group is still usable: fix the cause and load again.",
        LoadError,
        "No model was returned; fix the cause and load again.",
    ) as rounds:
        # the same on every rank: each reads its own bytes into CPU shards, or rank 0 sends to the others
        own = local.reader(plan, staging, sink, files)
        source: FileSource | ReceiveSource | OwnSource
        if own is not None and own.everything and sink.device.type == "cpu":
            source = OwnSource(plan, sink, own, on_bytes)
        elif dist.get_rank() == 0:
            pieces = local.rank0_pieces(plan, on_bytes)
            source = FileSource(plan, staging, files, sink, pieces, local.everyone, on_bytes)
        else:
            source = ReceiveSource(plan, staging, sink, own)
        try:
            for _, stop in rounds:
                for arrival in source.until(stop):
                    source.take(arrival)
                source.round_end(stop)
        finally:
            if isinstance(source, FileSource):  # rank 0's reader thread
                source.close()
