"""Exceptions raised by rank0load: every detected failure is a :class:`LoadError` (or subclass),
raised on every rank with the same message. Subclasses also derive from the matching builtin
(``FileNotFoundError``, ``ValueError``). Each is built from one message string, so rank 0's instance
pickles for the other ranks to re-raise.
"""

from __future__ import annotations


class LoadError(RuntimeError):
    """Base class: the checkpoint could not be loaded into the model."""


class CheckpointNotFoundError(LoadError, FileNotFoundError):
    """The checkpoint path, or a file its index names, does not exist or is not allowed."""


class CheckpointFormatError(LoadError, ValueError):
    """A safetensors file or index is malformed: truncated, corrupt header, bad index."""


class ModelMismatchError(LoadError, ValueError):
    """The checkpoint does not fit the model: missing/unexpected keys, shapes, dtypes, ties."""


class CheckpointChangedError(LoadError):
    """A checkpoint file changed (replaced, rewritten, truncated) while it was being loaded."""


class RankMismatchError(LoadError):
    """Ranks disagree: ``model_fn``/``shard_fn`` failed on some ranks or built different models."""


class SaveError(LoadError):
    """Saving failed: the model could not be written as a checkpoint (``save_sharded``)."""


class InternalError(LoadError):
    """rank0load's own code failed: a bug, or a version of torch / transformers it cannot handle.
    Never the caller's model, checkpoint or arguments; the message names the versions to report."""


def format_keys(keys: object, limit: int = 10) -> str:
    """Sorted, the first ``limit`` keys quoted, then "and N more"."""
    items = sorted(str(k) for k in keys)  # type: ignore[attr-defined]
    shown = ", ".join(repr(k) for k in items[:limit])
    if len(items) > limit:
        shown += f" and {len(items) - limit} more"
    return shown
