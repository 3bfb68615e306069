"""Rank 0's two steps on the checkpoint: open it, then read its manifest for the model (rank 0;
no collectives).

(rank 0) :func:`open_checkpoint`, then :func:`read_manifest`, the one entry point for the
manifest. Both raise a LoadError (``_api`` runs them through ``_distribute.from_rank0``, which
raises it on every rank); :func:`unforeseen` words any other exception.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..common._failure import internal_error
from ..errors import LoadError
from ..integrations._convert import Conversion
from ..model._meta import ModelLayout
from ._files import OpenFile, open_files
from ._manifest import Adapter, Manifest, build_manifest
from ._source import Source, resolve

__all__ = ["Checkpoint", "open_checkpoint", "read_manifest", "unforeseen"]


@dataclass
class Checkpoint:
    """(rank 0) The checkpoint resolved, with the adapters loaded with it, and their files open: what
    :func:`read_manifest` matches against the model. Opened before the ranks agree on their models,
    while the slower ranks still build."""

    source: Source
    adapters: Sequence[Adapter]
    files: dict[str, OpenFile]


def open_checkpoint(
    ckpt_path: str | os.PathLike[str],
    revision: str | None,
    stack: contextlib.ExitStack,
    adapters: Callable[[], Sequence[Adapter]] = lambda: (),
) -> Checkpoint:
    """(rank 0) Resolve the checkpoint (and ``adapters()``, resolved here too) and open their files
    once (closed by ``stack``): the files the manifest's headers and the stream are read through.
    Raises a LoadError (anything unforeseen is wrapped in one)."""
    try:
        source = resolve(ckpt_path, revision)
        found = adapters()
        files = open_files((*source.files, *(f for a in found for f in a.source.files)))
        for opened in files.values():
            stack.callback(opened.close)
        return Checkpoint(source, found, files)
    except LoadError:
        raise
    except Exception as exc:  # the Hub client's, PEFT's config reader's: the plain wording
        raise unforeseen(ckpt_path, exc) from exc


def read_manifest(
    checkpoint: Checkpoint,
    layout: ModelLayout,
    strict: bool,
    key_map: Callable[[str], str | None] | None,
    conversions: Sequence[Conversion] = (),
) -> Manifest:
    """(rank 0) The manifest of ``checkpoint`` (:func:`open_checkpoint`) for the model
    (``_manifest.build_manifest``); raises a LoadError for any problem found matching its headers."""
    return build_manifest(
        checkpoint.source,
        checkpoint.files,
        layout,
        strict=strict,
        key_map=key_map,
        conversions=conversions,
        adapters=checkpoint.adapters,
    )


def unforeseen(ckpt_path: str | os.PathLike[str], exc: Exception, ours: bool = False) -> LoadError:
    """(rank 0) The LoadError to share for an exception rank0load did not foresee while reading.
    ``ours``: raised while matching the headers to the model, where only rank0load's code (and the
    transformers conversions it drives) runs: unless the machine's (``OSError``, ``MemoryError``),
    an :class:`~..errors.InternalError` naming where it was raised and the versions. Resolving and
    opening the checkpoint also runs the Hub client and PEFT's config reader: their failures keep
    the plain wording."""
    what = f"rank 0 could not read checkpoint {os.fspath(ckpt_path)!r}"
    if ours and not isinstance(exc, (OSError, MemoryError)):
        return internal_error(what, exc)
    return LoadError(f"{what}: {type(exc).__name__}: {exc}")
