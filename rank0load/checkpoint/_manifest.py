"""Rank 0's steps on the checkpoint: open it, then make its manifest, the entry list every rank
streams, in file order (rank 0; no collectives). Headers are matched run by run, each run's freed
before the next, so rank 0 never holds every header at once; what spans runs is settled by
:func:`_merge`. Every problem raises a :class:`~..errors.LoadError`; :func:`unforeseen` words others.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from torch import nn

from ..common._failure import internal_error
from ..errors import CheckpointChangedError, CheckpointFormatError, LoadError, ModelMismatchError, format_keys
from ..integrations import _peft
from ..integrations._convert import Conversion
from ..integrations._resolve import KeyResolver
from ..model._meta import ModelLayout
from ._entries import Entry
from ._files import OpenFile, open_files
from ._fit import KeyMatch, build_entries, check_stored_once, match_keys, quantised_keys, slices, unconsumed
from ._format import TensorHeader
from ._fp8 import SCALE_SUFFIX
from ._fp8 import block_size as fp8_block_size
from ._source import Source, file_tensors, read_headers, resolve

RUN_TENSORS = 4096  # a run ends with the file that brings it to this many tensors


@dataclass(frozen=True)
class Manifest:
    entries: tuple[Entry, ...]
    missing: tuple[str, ...]  # canonical model keys absent from the checkpoint (strict=False)
    kept: tuple[str, ...]  # canonical keys absent from the checkpoint that keep model_fn's values (PEFT)
    unexpected: tuple[str, ...]  # checkpoint keys skipped (strict=False)
    ignored: tuple[str, ...]  # checkpoint keys held by the model as non-persistent buffers
    files: tuple[str, ...]
    total_bytes: int
    # (elements of the parameters initialised rather than loaded, elements of all parameters)
    initialised: tuple[int, int]
    runs: int  # runs of files whose headers were matched together


@dataclass(frozen=True)
class Adapter:
    """(rank 0) A PEFT adapter folder to load with the base checkpoint: its resolved source, and the
    model key each of its file's names stands for (``_peft.adapter_names``, inverted)."""

    source: Source
    model_keys: dict[str, str]


def adapters_of(model: nn.Module, adapter: object) -> list[Adapter]:
    """(rank 0) ``load_sharded(adapter=...)`` resolved (a folder for the active adapter, or name ->
    folder), each ``adapter_config.json`` checked against the model's config of that adapter."""
    if isinstance(adapter, (str, os.PathLike)):
        specs = {str(getattr(model, "active_adapter", "default")): adapter}
    elif isinstance(adapter, dict):
        specs = dict(adapter)
    else:
        raise LoadError(
            f"adapter={adapter!r}: pass a PEFT adapter folder, or a dict of adapter name -> folder"
        )
    found = []
    for name, path in specs.items():
        source = resolve(path)
        if [os.path.basename(f) for f in source.files] != [_peft.ADAPTER_WEIGHTS]:
            raise CheckpointFormatError(
                f"adapter {os.fspath(path)!r} holds {[os.path.basename(f) for f in source.files]}, not "
                f"{_peft.ADAPTER_WEIGHTS!r} alone: pass the folder PEFT's save_pretrained (safetensors) "
                "or rank0load.save_sharded(model, out_dir, adapter=...) wrote."
            )
        _peft.check_adapter_config(model, name, source.root, os.fspath(path))
        names = _peft.adapter_names(model, name)
        found.append(Adapter(source, {saved: key for key, saved in names.items()}))
    return found


@dataclass
class Checkpoint:
    """(rank 0) The checkpoint and its adapters resolved, their files open; opened before the ranks
    agree on their models, while the slower ranks still build."""

    source: Source
    adapters: Sequence[Adapter]
    files: dict[str, OpenFile]  # by path: the checkpoint's files in load order, then each adapter's


def open_checkpoint(
    ckpt_path: str | os.PathLike[str],
    revision: str | None,
    stack: contextlib.ExitStack,
    adapters: Callable[[], Sequence[Adapter]],
) -> Checkpoint:
    """(rank 0) Resolve the checkpoint (and ``adapters()``) and open their files once (closed by
    ``stack``). Raises a LoadError (anything unforeseen is wrapped in one)."""
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


def unforeseen(ckpt_path: str | os.PathLike[str], exc: Exception, ours: bool = False) -> LoadError:
    """(rank 0) The LoadError to share for an exception rank0load did not foresee while reading.
    ``ours`` (raised while matching headers, where only rank0load's code runs): an
    :class:`~..errors.InternalError` naming where and the versions, unless OSError or MemoryError."""
    what = f"rank 0 could not read checkpoint {os.fspath(ckpt_path)!r}"
    if ours and not isinstance(exc, (OSError, MemoryError)):
        return internal_error(what, exc)
    return LoadError(f"{what}: {type(exc).__name__}: {exc}")


@dataclass
class _Runs:
    """What every run of one load shares, and what the runs leave for :func:`_merge` to settle."""

    layout: ModelLayout
    resolver: KeyResolver  # one for all runs: its rules, learnt from the first keys, hold for the rest
    block: tuple[int, int] | None  # the float8 block size config.json gives
    tied: frozenset[str]  # canonical keys of tied parameters
    files: dict[str, OpenFile]
    entries: list[Entry] = field(default_factory=list)
    # the tensors a run could not settle alone (partial expert stacks, unscaled float8, tied names)
    pending: KeyMatch = field(default_factory=lambda: KeyMatch({}, (), (), {}, {}))
    scales: list[TensorHeader] = field(default_factory=list)  # grids those may need
    unexpected: list[str] = field(default_factory=list)  # grids consumed within their run left out
    ignored: list[str] = field(default_factory=list)
    unsupported: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # as KeyMatch's
    count: int = 0  # checkpoint keys
    first: list[str] = field(default_factory=list)  # the first 50 of them, sorted (_nothing_matched)
    runs: int = 0


def read_manifest(
    checkpoint: Checkpoint,
    layout: ModelLayout,
    strict: bool,
    key_map: Callable[[str], str | None] | None,
    conversions: Sequence[Conversion],
) -> Manifest:
    """(rank 0) Validate the checkpoint (and the adapters loaded with it) against the model and
    list what to move, in file order; every header is read through its open files. ``key_map``
    renames the checkpoint's keys (not the adapters'). Raises CheckpointFormatError /
    CheckpointChangedError (the files and the index disagree, a key stored twice) or
    ModelMismatchError (the keys, shapes or dtypes do not fit the model)."""
    source, files, adapters = checkpoint.source, checkpoint.files, checkpoint.adapters
    load = _Runs(
        layout,
        KeyResolver(layout.canonical, conversions, layout.canonical_all),
        fp8_block_size(source.root),
        frozenset(layout.aliases.values()),
        files,
    )
    own = {  # the adapters' tensors under the model keys PEFT's names stand for
        adapter.model_keys.get(name, name): (adapter, t)
        for adapter in adapters
        for name, t in read_headers(adapter.source, files).items()
    }
    listing = source.listing
    every: list[str | tuple[str, ...]] | None = [] if listing is None and len(source.files) > 1 else None
    headers: dict[str, TensorHeader] = {}
    for i, path in enumerate(source.files):
        tensors = file_tensors(source, path, files[path], headers)  # checked within the run
        if every is not None:  # no index: a key stored in files of two runs is found at the end
            joined = "\n".join(tensors)  # one string a file, unless a key holds a newline
            every.append(joined if joined.count("\n") == len(tensors) - 1 else tuple(tensors))
        if own and not own.keys().isdisjoint(tensors):
            key = next(k for k in tensors if k in own)
            raise CheckpointFormatError(
                f"{key!r} is stored both in {os.path.basename(path)} and in adapter "
                f"{own[key][0].source.description} ({own[key][1].key!r}); keep one copy."
            )
        headers.update(tensors)
        del tensors
        if len(headers) >= RUN_TENSORS or i == len(source.files) - 1:
            _run(headers, load, key_map)
            headers = {}  # the run's header objects freed before the next run's are made
    if listing is not None and load.count != listing.total or every is not None and _stored_twice(every):
        read_headers(source, files)  # raises, naming the key (the files read again, as a whole)
        raise CheckpointChangedError(
            f"{source.description}: the checkpoint changed while it was loaded. Load again once it is written."
        )
    if own:
        _run({key: t for key, (_, t) in own.items()}, load, None)
    return _merge(load, checkpoint, strict, key_map)


def _stored_twice(every: list[str | tuple[str, ...]]) -> bool:
    """Whether a key is in two files' ``every`` (each file's keys joined by newlines, or a tuple)."""
    keys = [k for held in every for k in (held.split("\n") if isinstance(held, str) else held)]
    return len(set(keys)) != len(keys)


def _run(headers: dict[str, TensorHeader], load: _Runs, key_map: Callable[[str], str | None] | None) -> None:
    """One run's entries, and what it leaves to :func:`_merge`, added to ``load``."""
    layout = load.layout
    match = match_keys(headers, layout, key_map, load.resolver)
    quantised = quantised_keys(match, layout)

    def lacks_scale(t: TensorHeader) -> bool:
        return t.key in quantised and t.key + SCALE_SUFFIX not in headers

    stacked = {
        k: members
        for k, members in match.stacked.items()
        if len(members) < slices(members, layout.tensors[k].shape) * members[0][0].sources
        or any(lacks_scale(t) for _, t in members)
    }
    single = {k: found for k, found in match.by_model_key.items() if k in load.tied or lacks_scale(found[0])}
    whole = replace(
        match,
        by_model_key={k: v for k, v in match.by_model_key.items() if k not in single},
        stacked={k: v for k, v in match.stacked.items() if k not in stacked},
    )
    load.entries += build_entries(whole, layout, headers, load.block, quantised=quantised, files=load.files)
    unexpected = unconsumed(match.unexpected, quantised)
    pending = itertools.chain((t for m in stacked.values() for _, t in m), (f[0] for f in single.values()))
    load.scales += [
        headers[k] for k in (t.key + SCALE_SUFFIX for t in pending if t.key in quantised) if k in headers
    ]
    load.scales += [headers[k] for k in unexpected if k.endswith(SCALE_SUFFIX)]  # another run's weight's?
    for k, members in stacked.items():
        load.pending.stacked[k] = load.pending.stacked.get(k, ()) + members
    for k, found in single.items():  # a tied parameter's names are compared in _merge
        load.pending.by_model_key[k] = load.pending.by_model_key.get(k, ()) + found
    load.unexpected += unexpected
    load.ignored += match.ignored
    for k, why in match.unsupported.items():
        load.unsupported.setdefault(k, why)  # the first run's wins
    load.count += len(headers)
    load.first = heapq.nsmallest(50, itertools.chain(load.first, headers))
    load.runs += 1


def _merge(
    load: _Runs, checkpoint: Checkpoint, strict: bool, key_map: Callable[[str], str | None] | None
) -> Manifest:
    """(rank 0) The runs' parts as one manifest: what spans runs settled, the keys checked."""
    source, adapters = checkpoint.source, checkpoint.adapters
    description = " + ".join([source.description, *(a.source.description for a in adapters)])
    layout, entries, pending = load.layout, load.entries, load.pending
    found = check_stored_once(entries, pending, key_map)
    if layout.tensors and not found:
        raise ModelMismatchError(_nothing_matched(load, description))
    absent = [k for k in layout.tensors if k not in found]
    missing = tuple(sorted(k for k in absent if k not in layout.built))
    quantised = quantised_keys(pending, layout)
    unexpected = unconsumed(sorted(load.unexpected), quantised)
    _check_keys(load, description, strict, missing, unexpected)
    pool = {t.key: t for tensors in pending.by_model_key.values() for t in tensors}
    pool.update((t.key, t) for members in pending.stacked.values() for _, t in members)
    pool.update((t.key, t) for t in load.scales)
    entries += build_entries(pending, layout, pool, load.block, quantised=quantised, files=load.files)
    order = {path: i for i, path in enumerate(checkpoint.files)}
    entries.sort(key=lambda e: (order[e.file], e.offset))
    return Manifest(
        entries=tuple(entries),
        missing=missing,
        kept=tuple(sorted(k for k in absent if k in layout.built)),
        unexpected=unexpected,
        ignored=tuple(sorted(load.ignored)),
        files=tuple(checkpoint.files),
        total_bytes=sum(e.nbytes for e in entries),
        initialised=(
            sum(math.prod(layout.tensors[k].shape) for k in missing if layout.tensors[k].is_param),
            sum(math.prod(t.shape) for t in layout.tensors.values() if t.is_param),
        ),
        runs=load.runs,
    )


def _nothing_matched(load: _Runs, description: str) -> str:
    """The error for a load that would load nothing: a few names from each side, and a guess."""
    layout, count, first = load.layout, load.count, load.first
    model = sorted(k for k in layout.tensors if layout.tensors[k].is_param) or sorted(layout.tensors)
    hint = _prefix_hint(first, model)
    if not count:
        found = "The checkpoint holds no tensors."
    elif len(load.ignored) == count:
        found = (
            f"key_map dropped all {count} checkpoint keys (or they are the model's non-persistent buffers)."
        )
    else:
        found = f"The checkpoint holds {count} keys, e.g. {format_keys(first[:3])}."
    return (
        f"{description}: no checkpoint key matched any model key, so nothing would be loaded (whatever "
        f"strict is). {found} The model has {len(layout.tensors)}, e.g. {format_keys(model[:3])}. "
        + (hint or "Check that model_fn builds the model this checkpoint was saved from, or pass key_map.")
    )


def _prefix_hint(ckpt: list[str], model: list[str]) -> str:
    """A key_map that would make the names meet, when one side has a prefix the other lacks."""
    model_set, ckpt_set = set(model), set(ckpt)
    for key in ckpt[:50]:
        for m in model:
            if m.endswith("." + key) and sum(m[: -len(key)] + k in model_set for k in ckpt[:50]) > 25:
                prefix = m[: -len(key)]
                return f"The model's names have a prefix the checkpoint's lack: pass key_map=lambda k: {prefix!r} + k."
            if key.endswith("." + m) and sum(key[: -len(m)] + k in ckpt_set for k in model[:50]) > 25:
                prefix = key[: -len(m)]
                return (
                    f"The checkpoint's names have a prefix the model's lack: pass "
                    f"key_map=lambda k: k.removeprefix({prefix!r})."
                )
    return ""


def _check_keys(
    load: _Runs, description: str, strict: bool, missing: tuple[str, ...], unexpected: tuple[str, ...]
) -> None:
    """Raise ModelMismatchError where the keys do not fit the model: a missing tensor only an
    unsupported conversion would fill; with ``strict``, any key missing or unexpected; a missing
    parameter the model cannot initialise."""
    cannot = {k: v for k, v in load.unsupported.items() if k in missing}
    if cannot:
        target, (ckpt_key, rule, why) = sorted(cannot.items())[0]
        raise ModelMismatchError(
            f"{description}: model tensor {target!r} would come from checkpoint key {ckpt_key!r} "
            f"through the conversion {rule}, which {why}; rank0load assembles what byte ranges of checkpoint "
            "tensors make (stacked experts: MergeModulelist(dim=0), then Concatenate(dim=1); "
            "Concatenate(dim=0); Split or Chunk(dim=0)), never single elements moved (Transpose, "
            f"PermuteForRope, Interleave). {len(cannot)} tensors are affected. "
            "Convert the checkpoint to the model's layout first (from_pretrained, then save_pretrained "
            "with save_original_format=False), or pass key_map."
        )
    if strict and (missing or unexpected):
        named = (("missing from", missing), ("unexpected in", unexpected))
        parts = [f"{what} the checkpoint: {format_keys(keys)}" for what, keys in named if keys]
        raise ModelMismatchError(
            f"{description}: keys do not match the model; "
            + "; ".join(parts)
            + ". Pass key_map to rename keys, or strict=False to skip unexpected keys and "
            "initialise missing ones with the model's own initialisation."
        )
    layout = load.layout
    uninitialisable = [k for k in missing if layout.tensors[k].is_param and k not in layout.initialisable]
    if uninitialisable:
        raise ModelMismatchError(
            f"{description}: missing parameters {format_keys(uninitialisable)} have no "
            "initialiser (their module has no reset_parameters() and no ancestor has _init_weights()), "
            "so strict=False would leave them uninitialised. Add them to the checkpoint or give the "
            "module a reset_parameters()."
        )
