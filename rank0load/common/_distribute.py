"""Every collective rank0load issues lives here: the rank protocol. Each step is one call, made
by every rank in the same order:

* :func:`run` — a step every rank runs; if it fails on any rank, every rank raises that rank's
  error. :func:`attempt` and :func:`settle` are its two halves, for a failure raised later.
* :func:`from_rank0` — a value rank 0 computes alone, on every rank, or its error on every rank.
* :func:`agree` — settle the build, and check every rank built the same model with the same options.
* small agreements: :func:`all_gather_ints`, :func:`ranks_where`.
* rounds of transfers (:func:`settled`): each rank notes its first local failure (:class:`Faults`)
  and keeps the messages flowing; each round's end says whether any rank failed, and every rank
  raises the same error once.

A collective that itself fails (a peer died, a timeout) is a ``_failure.peer_failures``: the only
case where a rank cannot learn the real cause."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import pickle
import struct
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NoReturn, TypeVar, cast

import torch
import torch.distributed as dist

from ..errors import LoadError, RankMismatchError
from ..integrations._compat import host_bytes
from ._failure import failure_of, peer_failures, rank_mismatch

logger = logging.getLogger(__name__)


R = TypeVar("R")


NO_DATA_MOVED = "No data was moved; fix the cause and load again."


def require_process_group(error: type[LoadError] = LoadError) -> None:
    """(each rank, before anything else) Raise ``error`` unless torch.distributed is initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise error(
            "torch.distributed is not initialised: call dist.init_process_group() first "
            "(torchrun sets the environment for it)"
        )


def rank0_rng_state(device: torch.device) -> torch.Tensor | None:
    """(all ranks; one broadcast) Rank 0's CPU random state, on the other ranks; None on rank 0."""
    wire = torch.get_rng_state().to(device)
    dist.broadcast(wire, 0)
    return None if dist.get_rank() == 0 else wire.cpu()


@dataclass(frozen=True)
class Outcome(Generic[R]):
    """A step's result on this rank, or its error, until :func:`settle` or :func:`agree`."""

    value: R | None = None
    error: Exception | None = None

    def get(self) -> R:
        """(this rank) The value, or this rank's error raised (for a step settled by a later one)."""
        if self.error is not None:
            raise self.error
        return cast(R, self.value)


def attempt(step: Callable[[], R]) -> Outcome[R]:
    """(any rank) Run a step, keeping its error; then :func:`settle` (or :func:`agree`) it on every rank."""
    try:
        return Outcome(step())
    except Exception as exc:
        return Outcome(error=exc)


def run(step: Callable[[], R], stage: str, todo: str, wrap: type[LoadError] = RankMismatchError) -> R:
    """(all ranks) ``step()``'s value; if it failed on any rank, every rank raises the first one's error."""
    return settle(attempt(step), stage, todo, wrap)


def round_ends(sizes: Sequence[int], round_bytes: int) -> tuple[int, ...]:
    """(any rank) Where the rounds of a transfer end: the index just past each run of items carrying
    at least ``round_bytes``, the last one at ``len(sizes)``."""
    ends, carried = [], 0
    for index, size in enumerate(sizes):
        carried += size
        if carried >= round_bytes:
            ends.append(index + 1)
            carried = 0
    if not ends or ends[-1] != len(sizes):
        ends.append(len(sizes))
    return tuple(ends)


class Faults:
    """This rank's first local failure (each rank); once set, the transfer skips local work and only
    keeps the messages flowing to the round's end. Thread-safe: a reader or writer thread may note one."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[..., object], *args: Any) -> None:
        if self.error is not None:
            return
        try:
            fn(*args)
        except Exception as exc:
            self.note(exc)

    def note(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                logger.debug("rank %d: local failure", dist.get_rank(), exc_info=exc)
                self.error = exc


def mesh_device(device_type: str) -> torch.device:
    """(any rank) The host for ``cpu``, else this rank's current accelerator."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.accelerator.current_device_index())


def _object_device() -> torch.device:
    """Where the default group's collectives take tensors: the host for gloo, else the accelerator."""
    if "gloo" in str(dist.get_backend()):
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return mesh_device(accelerator.type if accelerator is not None else "cpu")


def _all_reduce(t: torch.Tensor, op: Any) -> torch.Tensor:
    dist.all_reduce(t, op=op)
    return t


# Python objects travel pickled in uint8 tensors (broadcast_object_list would need numpy). A large
# one (a MoE manifest: 2 MB pickled for 96,000 tensors) travels zlib-compressed, about 6x smaller:
# with readers="host" it is the only thing on rank 0's link that grows with the hosts, and level 1
# costs rank 0 ~10 ms for 2 MB (small ones skip it: the loopback copy is cheaper than the call).
_COMPRESS_FROM = 1 << 20


def _pickled(obj: object) -> io.BytesIO:
    written = io.BytesIO()
    pickle.Pickler(written, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return written


def _broadcast_object(obj: object, src: int = 0, written: io.BytesIO | None = None) -> Any:
    """(all ranks; two broadcasts) ``obj`` of rank ``src`` on every rank (``written``: ``obj`` already
    pickled): ``src`` keeps its own (no second copy of a large manifest), the others unpickle theirs."""
    device = _object_device()
    payload = None
    compressed = 0
    if dist.get_rank() == src:
        data: bytearray | memoryview = (written if written is not None else _pickled(obj)).getbuffer()
        if len(data) >= _COMPRESS_FROM:  # a bytearray: frombuffer warns on read-only bytes
            data, compressed = bytearray(zlib.compress(data, 1)), 1
        payload = torch.frombuffer(data, dtype=torch.uint8).to(device)
    header = torch.tensor(
        [payload.numel() if payload is not None else 0, compressed], dtype=torch.int64, device=device
    )
    dist.broadcast(header, src=src)
    if payload is None:
        payload = torch.empty(int(header[0].item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src)
    if dist.get_rank() == src:
        return obj
    received = host_bytes(payload.cpu().contiguous())
    return pickle.loads(zlib.decompress(received) if header[1].item() else received)


def _scalar(value: int, op: Any) -> int:
    return int(_all_reduce(torch.tensor([value], dtype=torch.int64, device=_object_device()), op).item())


def _first_failure(error: BaseException | None) -> int:
    """(all ranks; one all-reduce) The lowest rank whose ``error`` is set, or the world size if none."""
    return _scalar(dist.get_rank() if error is not None else dist.get_world_size(), dist.ReduceOp.MIN)


def _raise_failure(
    first: int, error: BaseException | None, word: Callable[[BaseException, int], LoadError]
) -> NoReturn:
    """(all ranks, ``first`` < world the lowest rank whose ``error`` is set) Raise on every rank the
    error rank ``first`` words once, ``word(error, count)`` (``count``: how many ranks failed).
    Collectives may raise RuntimeError: callers wrap it."""
    count = _scalar(1 if error is not None else 0, dist.ReduceOp.SUM)
    mine = word(error, count) if error is not None and dist.get_rank() == first else None
    shared: LoadError = _broadcast_object(mine, src=first)
    raise type(shared)(*shared.args)


def _raise_if(first: int, error: BaseException | None, stage: str, todo: str, wrap: type[LoadError]) -> None:
    """(all ranks) Unless ``first`` is the world size, raise rank ``first``'s :func:`failure_of`
    everywhere."""
    if first < dist.get_world_size():
        _raise_failure(first, error, lambda exc, count: failure_of(exc, count, first, stage, todo, wrap))


def settle(outcome: Outcome[R], stage: str, todo: str, wrap: type[LoadError] = RankMismatchError) -> R:
    """(all ranks) ``outcome``'s value, once every rank has said whether its step failed: if any did,
    every rank raises the first failing rank's error; a failed collective is a :func:`peer_failures`
    (LoadError, or ``wrap`` when it is not RankMismatchError)."""
    cls = LoadError if wrap is RankMismatchError else wrap
    with peer_failures(f"agreeing with the other ranks after {stage}", cls, todo):
        _raise_if(_first_failure(outcome.error), outcome.error, stage, todo, wrap)
    return cast(R, outcome.value)


@dataclass(frozen=True)
class Proposal:
    """What each rank brings to :func:`agree`. Only :meth:`digest` and the flags cross the wire; the
    rest only when the digests differ, to say how."""

    model: tuple[Any, ...]  # ModelLayout.fingerprint(): names, shapes, dtypes, ties, buffers
    options: dict[str, object]  # arguments that shape the messages or the result, compared by repr
    flags: tuple[int, ...]  # _layout.layout_flags per canonical key, in the model's key order

    def digest(self) -> bytes:
        return hashlib.sha256(repr((self.model, self.options)).encode()).digest()

    def explain(self, reference: Proposal) -> str:
        """How this rank's proposal differs from rank 0's ``reference``."""
        for name, theirs in reference.options.items():
            mine = self.options.get(name)
            if repr(mine) != repr(theirs):
                return f"{name}={mine!r} here but {theirs!r} on rank 0; pass every rank the same value"
        ref = {t[0]: t for t in reference.model[0]}
        for t in self.model[0]:
            other = ref.get(t[0])
            if other is None:
                return f"tensor {t[0]!r} exists here but not on rank 0"
            if other != t:
                return f"tensor {t[0]!r} is (shape, dtype, param, dtensor) {t[1:]} here but {other[1:]} on rank 0"
        extra = ref.keys() - {t[0] for t in self.model[0]}
        if extra:
            return f"rank 0 has tensors this rank lacks: {sorted(extra)[:5]}"
        return "ties or non-persistent buffers differ"


def agree(built: Outcome[tuple[R, Proposal]]) -> tuple[R, tuple[int, ...]]:
    """(all ranks) Settle the build step (its value and this rank's proposal), then check every rank
    built the same model with the same options; returns the value and the layout flags AND-ed over
    the ranks. Raises the same error on every rank (RankMismatchError if they differ; LoadError for a
    failed collective); no message grows with the world size. Two all-reduces when the ranks agree:
    the settle and the digests' MIN and MAX in one, then the flags."""
    stage = "building or sharding the model"
    todo = "No data was moved; fix model_fn / shard_fn and retry."
    world = dist.get_world_size()
    mine = cast(tuple[R, Proposal], built.value)[1].digest() if built.error is None else bytes(32)
    words = struct.unpack("<8I", mine)  # non-negative in int64: MAX is -MIN of the negated
    with peer_failures(f"agreeing with the other ranks after {stage}", LoadError, todo):
        first = dist.get_rank() if built.error is not None else world
        row = torch.tensor([first, *words, *(-w for w in words)], dtype=torch.int64, device=_object_device())
        got = _all_reduce(row, dist.ReduceOp.MIN).cpu().tolist()
        _raise_if(got[0], built.error, stage, todo, RankMismatchError)
    value, proposal = cast(tuple[R, Proposal], built.value)
    with peer_failures("agreeing with the other ranks"):
        device = _object_device()
        if got[1:9] != [-w for w in got[9:]]:  # the lowest and highest digest differ
            reference: Proposal = _broadcast_object(proposal if dist.get_rank() == 0 else None)
            differs = proposal.digest() != reference.digest()
            mismatch = RankMismatchError() if differs else None
            first = _first_failure(mismatch)
            _raise_failure(
                first, mismatch, lambda _, count: rank_mismatch(first, count, proposal.explain(reference))
            )
        n = len(proposal.flags)
        planes = torch.tensor(
            [f & 1 for f in proposal.flags] + [(f >> 1) & 1 for f in proposal.flags], dtype=torch.uint8
        ).to(device)
        both = _all_reduce(planes, dist.ReduceOp.MIN).cpu().tolist()  # MIN of 0/1: AND, on any backend
    return value, tuple(both[i] | (both[n + i] << 1) for i in range(n))


def from_rank0(step: Callable[[], R], unforeseen: Callable[[Exception], LoadError]) -> R:
    """(all ranks) ``step()``, run on rank 0 alone, and its value on every rank (rank 0 keeps its
    own). If it raises, every rank raises its LoadError, or ``unforeseen(exc)`` for any other
    exception (a value that cannot be pickled included); LoadError for a failed collective."""
    value: object = None
    written = None
    if dist.get_rank() == 0:
        try:  # pickled here, so that a value that cannot be pickled is an error every rank raises
            value = step()
            written = _pickled(value)
        except Exception as exc:  # sent instead: a LoadError (no step returns one)
            value = exc if isinstance(exc, LoadError) else unforeseen(exc)
    with peer_failures("receiving rank 0's result"):
        value = _broadcast_object(value, written=written)
    if isinstance(value, LoadError):
        raise type(value)(*value.args)
    return cast(R, value)


def all_gather_ints(values: Sequence[int], what: str) -> list[tuple[int, ...]]:
    """(all ranks) Every rank's ``values`` (the same number of int64s everywhere), on every rank, by
    rank. One all-gather; LoadError naming ``what`` for a failed collective."""
    with peer_failures(what):
        device = _object_device()
        mine = torch.tensor(list(values), dtype=torch.int64, device=device)
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(out, mine)
    return [tuple(int(v) for v in t.cpu().tolist()) for t in out]


def ranks_where(flag: bool, what: str) -> frozenset[int]:
    """(all ranks) The ranks whose ``flag`` is set, on every rank: one all-reduce of one bit per rank;
    LoadError naming ``what`` for a failed collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    with peer_failures(what):
        bits = torch.zeros((world + 7) // 8, dtype=torch.uint8)
        if flag:
            bits[rank // 8] = 1 << (rank % 8)
        got = _all_reduce(bits.to(_object_device()), dist.ReduceOp.SUM).cpu().tolist()
    return frozenset(r for r in range(world) if got[r // 8] >> (r % 8) & 1)


@contextlib.contextmanager
def settled(
    faults: Faults, ends: Sequence[int], stage: str, todo: str, wrap: type[LoadError], peer_todo: str
) -> Iterator[Iterator[tuple[int, int]]]:
    """(all ranks) ``with settled(...) as rounds: for begin, stop in rounds:`` run a transfer, each
    round's items; after each body the ranks compare notes (a collective every rank must run), and
    the loop ends after the round in which any rank failed. Then raise the first failing rank's error
    on every rank (``todo``), or this rank's peer failure (``peer_todo``)."""
    first = dist.get_world_size()

    def rounds() -> Iterator[tuple[int, int]]:
        nonlocal first
        begin = 0
        for stop in ends:
            yield begin, stop
            first = _first_failure(faults.error)
            if first < dist.get_world_size():
                return
            begin = stop

    with peer_failures(stage, wrap, peer_todo):  # a rank died or stalled, or the network broke
        yield rounds()
        _raise_if(first, faults.error, stage, todo, wrap)
