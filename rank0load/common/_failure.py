"""What a rank's failure is, and how every rank words it (all ranks; no collectives).

A failure is the caller's code (:class:`UserCodeFailure`, from :func:`user_code`), the machine's
(``OSError``, ``MemoryError``) or rank0load's own (any other: :class:`~..errors.InternalError`)."""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from ..errors import InternalError, LoadError, RankMismatchError

R = TypeVar("R")


@contextlib.contextmanager
def peer_failures(
    what: str,
    cls: type[LoadError] = LoadError,
    todo: str = "No model was returned; fix the cause and load again.",
) -> Iterator[None]:
    """(the rank whose collective failed) A RuntimeError inside (a peer died or stalled) raised as
    ``cls`` naming ``what``; a LoadError passes unchanged."""
    try:
        yield
    except LoadError:
        raise
    except RuntimeError as exc:
        raise cls(
            f"rank {dist.get_rank()}: {what} failed ({type(exc).__name__}: {exc}). Another rank probably "
            "died or stalled (see its log); the wait is bounded by the process-group timeout "
            f"(dist.init_process_group(timeout=...)). {todo}"
        ) from exc


class UserCodeFailure(Exception):
    """An exception from the caller's code (``model_fn``, ``shard_fn``, the model's own
    initialisers), carried through a step so that ``_distribute.settle`` blames that code."""


# the package root (this module sits in rank0load/common/): a frame in any of its files is ours
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_code(what: str, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """``fn(*args, **kwargs)``, the caller's code: an exception it raises becomes a
    :class:`UserCodeFailure` naming ``what``, unless it is a LoadError, already one, or was raised in
    rank0load's own code that ``fn`` called (then it stays ours)."""
    try:
        return fn(*args, **kwargs)
    except (LoadError, UserCodeFailure):
        raise
    except Exception as exc:
        frames = traceback.extract_tb(exc.__traceback__)[1:]  # [0] is this function
        if any(f.filename.startswith(_PACKAGE) for f in frames):
            raise
        raise UserCodeFailure(f"{what} raised {type(exc).__name__}: {exc}") from exc


def failure_of(
    error: BaseException, count: int, first: int, stage: str, todo: str, wrap: type[LoadError]
) -> LoadError:
    """(rank ``first``, the lowest of the ``count`` ranks that failed in ``stage``) The error every rank
    raises for its ``error``: its LoadError, in its own words when every rank failed; for the caller's
    code (:class:`UserCodeFailure`) or the machine's (``OSError``, ``MemoryError``), ``wrap`` and the
    message; for any other exception, rank0load's own failure (:class:`~..errors.InternalError`, or
    ``wrap`` where that is not RankMismatchError), where it was raised and the versions."""
    world = dist.get_world_size()
    where = f"{count} of {world} ranks" if count < world else "every rank"
    if isinstance(error, LoadError):
        if count == world:  # the same check failed everywhere: its own words
            return type(error)(str(error))
        return type(error)(f"{error} ({stage} failed on {where}; the first was rank {first})")
    head = f"{stage} failed on {where}: rank {first}"
    if isinstance(error, UserCodeFailure):
        return wrap(f"{head}: {error}. {todo}")
    if isinstance(error, (OSError, MemoryError)):  # the machine's, not a bug: disk, permissions, RAM
        return wrap(f"{head}: {type(error).__name__}: {error}. {todo}")
    if wrap is RankMismatchError:  # not the ranks' disagreement, nor the caller's code: ours
        return internal_error(head, error)
    # the stage's own class (LoadError, SaveError) and advice, the cause named as ours
    return wrap(f"{internal_error(head, error)} {todo}")


def internal_error(what: str, error: BaseException) -> InternalError:
    """rank0load's own ``error`` on one rank while doing ``what``, as the InternalError to share: where
    it was raised, and the versions to report."""
    from importlib.metadata import PackageNotFoundError, version

    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if f.filename.startswith(_PACKAGE)]
    where = ""
    if frames:
        last = frames[-1]
        where = f" in {last.name} ({os.path.basename(last.filename)}:{last.lineno})"
        if ours and ours[-1] is not last:
            where += f", called from rank0load's {ours[-1].name} ({os.path.basename(ours[-1].filename)}:{ours[-1].lineno})"
    found = []  # the versions to report
    for name in ("rank0load", "torch", "transformers", "peft", "diffusers"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            continue
    return InternalError(
        f"{what}: rank0load's own code raised {type(error).__name__}: {error}{where}. This is not caused "
        "by your model, checkpoint or arguments: it is a bug in rank0load or a dependency version it "
        f"cannot handle ({', '.join(found)}). Check the README's tested versions, and report it with "
        "this message."
    )


def rank_mismatch(first: int, count: int, explained: str) -> RankMismatchError:
    """The error every rank raises when ``count`` ranks, the lowest ``first``, built another model
    than rank 0's or were passed other arguments; ``explained``: how rank ``first``'s differs."""
    ranks = f"[{first}]" if count == 1 else f"[{first}, ...] ({count} ranks)"
    return RankMismatchError(
        f"ranks {ranks} built a different model from rank 0, or were passed other arguments; rank "
        f"{first}: {explained}. model_fn, shard_fn, dtype, strict, max_staging_bytes and "
        "local_reads must be the same on every rank: build the same model on every rank."
    )
