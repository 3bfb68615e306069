"""The manifest made run by run: rank 0 reads and matches a few files' headers at a time (rank 0;
no collectives).

Why: made at once, a large checkpoint's header entries, matches and entries are many small
Python objects on rank 0; freed, they leave allocator arenas that the few objects outliving them
keep resident for the rest of the load. Here each run of consecutive files (at least
:data:`RUN_TENSORS` tensors) is read, matched and made into entries, then its header objects are
freed before the next run reuses their memory; an entry's checkpoint names are kept as one string
per entry.

(rank 0) ``_read.read_manifest`` calls :func:`manifest_by_runs` when the load has no ``key_map``
and no adapters (see ``_read.open_checkpoint(by_runs=)``). Each file's header is checked as
``_headers`` checks it (:func:`~._headers.file_tensors`, within its run). A run settles what lies
within it (:func:`_share`); :func:`_merge` settles what spans runs: the index's key count, a model
tensor found in two runs, expert groups and float8 scale grids whose pieces lie in several runs.
Anything else that is not a clean load (any error, a tied parameter stored twice, strict keys that
do not match) returns None, and ``_read.read_manifest`` reads every header again and makes the
manifest at once (``_manifest.build_manifest``), which raises the same first error, worded the
same, as without runs: runs change where memory goes, never what a load loads or says.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..errors import LoadError, ModelMismatchError
from ..integrations._convert import Conversion, ConversionMatch
from ..integrations._resolve import KeyResolver
from ..model._meta import ModelLayout
from ._entries import Entry
from ._files import OpenFile
from ._fit import KeyMatch, build_entries, quantised_keys, unconsumed
from ._format import TensorHeader
from ._fp8 import SCALE_SUFFIX
from ._fp8 import block_size as fp8_block_size
from ._headers import file_tensors
from ._manifest import Manifest, manifest_of
from ._match import match_keys
from ._source import Source

__all__ = ["RUN_TENSORS", "manifest_by_runs"]

logger = logging.getLogger(__name__)

RUN_TENSORS = 4096  # a run ends with the file that brings it to this many tensors


class _AtOnce(Exception):
    """Why the manifest must be made at once (:func:`manifest_by_runs` then returns None)."""


@dataclass
class _Share:
    """One run's part of the manifest."""

    entries: list[Entry]
    # model key -> checkpoint tensors, for what the run cannot settle alone: stacked experts not
    # all in it, float8 weights whose scale grid is not in it
    stacked: dict[str, list[tuple[ConversionMatch, TensorHeader]]] = field(default_factory=dict)
    single: dict[str, tuple[TensorHeader, ...]] = field(default_factory=dict)
    scales: list[TensorHeader] = field(default_factory=list)  # grids those may need
    unexpected: tuple[str, ...] = ()  # grids consumed within the run left out
    ignored: tuple[str, ...] = ()
    unsupported: tuple[str, ...] = ()  # model keys only a conversion rank0load cannot do would fill


def manifest_by_runs(
    source: Source,
    files: dict[str, OpenFile],
    layout: ModelLayout,
    strict: bool,
    conversions: Sequence[Conversion] = (),
) -> Manifest | None:
    """(rank 0) The manifest of ``source`` (its ``files`` open) made run by run, or None where it
    must be made at once (``_read.read_manifest`` then makes it so: any error, and anything else
    that is not a clean load, is worded there)."""
    try:
        return _by_runs(source, files, layout, strict, conversions)
    except (_AtOnce, LoadError) as exc:
        logger.debug("rank0load: the manifest is made at once (%s)", exc)
    except Exception as exc:  # ours; the load goes on without runs
        logger.warning("rank0load: making the manifest run by run failed (%s: %s)", type(exc).__name__, exc)
    return None


def _by_runs(
    source: Source,
    files: dict[str, OpenFile],
    layout: ModelLayout,
    strict: bool,
    conversions: Sequence[Conversion],
) -> Manifest:
    resolver = KeyResolver(layout.canonical, conversions, layout.canonical_all)  # one for all runs
    block = fp8_block_size(source.root)
    listing = source.listing
    shares: list[_Share] = []
    every: list[str] | None = [] if listing is None and len(source.files) > 1 else None
    count, headers = 0, dict[str, TensorHeader]()
    for i, path in enumerate(source.files):
        # checked within the run and against the index (its errors: the manifest made at once)
        tensors = file_tensors(source, path, files[path], headers)
        count += len(tensors)
        if every is not None:  # no index: a key stored in two files of two runs is found at the end
            every.append("\n".join(tensors))
        headers.update(tensors)
        del tensors
        if len(headers) >= RUN_TENSORS or i == len(source.files) - 1:
            shares.append(_share(headers, layout, resolver, block))
            headers = {}  # the run's header objects freed before the next run's are made
    if listing is not None and count != listing.total:
        raise _AtOnce("the index lists keys no header holds")
    if every is not None:
        keys = list(itertools.chain.from_iterable(k.split("\n") for k in every if k))
        if len(set(keys)) != len(keys) or len(keys) != count:
            raise _AtOnce("a key is stored in two files, or holds a newline")
    return _merge(shares, source, layout, strict, block)


def _share(
    headers: dict[str, TensorHeader],
    layout: ModelLayout,
    resolver: KeyResolver,
    block: tuple[int, int] | None,
) -> _Share:
    """One run's entries, and what it leaves to :func:`_merge`."""
    match = match_keys(headers, layout, None, resolver=resolver)
    if any(len(found) > 1 for found in match.by_model_key.values()):
        raise _AtOnce("a tied parameter is stored under two names")  # compared at once
    quantised = quantised_keys(match, layout)

    def lacks_scale(t: TensorHeader) -> bool:
        return t.key in quantised and t.key + SCALE_SUFFIX not in headers

    stacked = {
        k: list(members)
        for k, members in match.stacked.items()
        if len(members) < (layout.tensors[k].shape or (0,))[0] * members[0][0].sources
        or any(lacks_scale(t) for _, t in members)
    }
    single = {k: found for k, found in match.by_model_key.items() if lacks_scale(found[0])}
    whole = replace(
        match,
        by_model_key={k: v for k, v in match.by_model_key.items() if k not in single},
        stacked={k: v for k, v in match.stacked.items() if k not in stacked},
    )
    entries = [_compact(e) for e in build_entries(whole, layout, headers, block, quantised=quantised)]
    unexpected = unconsumed(match, layout, quantised)
    pending = itertools.chain((t for m in stacked.values() for _, t in m), (f[0] for f in single.values()))
    scales = [
        headers[k] for k in (t.key + SCALE_SUFFIX for t in pending if t.key in quantised) if k in headers
    ]
    scales += [headers[k] for k in unexpected if k.endswith(SCALE_SUFFIX)]  # perhaps another run's weight's
    return _Share(entries, stacked, single, scales, unexpected, match.ignored, tuple(match.unsupported))


def _compact(entry: Entry) -> Entry:
    """``entry`` with its checkpoint names in one string each (as they travel to the other ranks):
    the run's name objects are then freed with its headers."""
    if not entry.parts and not entry.scales:
        return entry
    return replace(entry, parts=entry.parts.compacted(), scales=entry.scales.compacted())


def _merge(
    shares: Sequence[_Share],
    source: Source,
    layout: ModelLayout,
    strict: bool,
    block: tuple[int, int] | None,
) -> Manifest:
    """(rank 0) The runs' shares as one manifest, with ``_manifest.build_manifest``'s checks; any
    that would raise raises _AtOnce instead (the manifest made at once words it)."""
    entries = [e for s in shares for e in s.entries]
    stacked: dict[str, list[tuple[ConversionMatch, TensorHeader]]] = {}
    single: dict[str, tuple[TensorHeader, ...]] = {}
    for s in shares:
        for k, members in s.stacked.items():
            stacked.setdefault(k, []).extend(members)
        if single.keys() & s.single.keys():
            raise _AtOnce("a model tensor is stored in two runs")
        single.update(s.single)
    found = {e.key for e in entries}
    if (
        len(found) != len(entries)
        or found & (stacked.keys() | single.keys())
        or stacked.keys() & single.keys()
    ):
        raise _AtOnce("a model tensor is stored in two runs")
    pending = KeyMatch(single, (), (), (), stacked={k: tuple(v) for k, v in stacked.items()})
    pool = {t.key: t for tensors in single.values() for t in tensors}
    pool.update((t.key, t) for members in stacked.values() for _, t in members)
    pool.update((t.key, t) for s in shares for t in s.scales)
    quantised = quantised_keys(pending, layout)
    try:
        entries += [_compact(e) for e in build_entries(pending, layout, pool, block, quantised=quantised)]
    except ModelMismatchError as exc:
        raise _AtOnce(str(exc)) from None
    consumed = {k + SCALE_SUFFIX for k in quantised}
    unexpected = tuple(sorted(k for s in shares for k in s.unexpected if k not in consumed))
    found |= stacked.keys() | single.keys()
    absent = [k for k in layout.tensors if k not in found]
    missing = tuple(sorted(k for k in absent if k not in layout.built))
    if layout.tensors and not found:
        raise _AtOnce("nothing matched")
    unsupported = {k for s in shares for k in s.unsupported}
    if unsupported.intersection(missing) or (strict and (missing or unexpected)):
        raise _AtOnce("keys do not match the model")
    if any(layout.tensors[k].is_param and k not in layout.initialisable for k in missing):
        raise _AtOnce("missing parameters have no initialiser")
    order = {path: i for i, path in enumerate(source.files)}
    entries.sort(key=lambda e: (order[e.file], e.offset))
    ignored = tuple(sorted(k for s in shares for k in s.ignored))
    kept = tuple(sorted(k for k in absent if k in layout.built))
    return manifest_of(entries, layout, missing, unexpected, ignored, kept, tuple(source.files), len(shares))
