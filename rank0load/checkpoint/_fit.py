"""Matching checkpoint keys to model keys (one matcher, so a load and ``inspect`` agree) and fitting the
matched tensors to the model as entries (rank 0, or ``inspect`` in one process; no collectives)."""

from __future__ import annotations

import collections
import itertools
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

import torch

from ..errors import ModelMismatchError, format_keys
from ..integrations._convert import ConversionMatch
from ..integrations._resolve import KeyResolver
from ..model._meta import ModelLayout
from ._entries import Entry, Parts
from ._files import OpenFile, read_exact
from ._format import DTYPES, TensorHeader
from ._fp8 import FP8_WIRE, SCALE_SUFFIX, checked_block

_KEY, _DTYPE, _SHAPE, _NBYTES = map(operator.attrgetter, ("key", "dtype", "shape", "nbytes"))
_SOURCE = operator.attrgetter("source")


# Wire dtypes that may be cast to another of these; all others must match the model exactly.
FLOAT_WIRE = frozenset({"F64", "F32", "F16", "BF16"})
_FLOATING = frozenset(DTYPES[k] for k in FLOAT_WIRE)  # the model dtypes they are cast into


def _check_fits(t: TensorHeader, model_key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    where = os.path.basename(t.file)
    if t.shape != shape:
        raise ModelMismatchError(
            f"key {model_key!r}: checkpoint shape {t.shape} != model {shape} in {where}. "
            "Does model_fn build the same config as the checkpoint?"
        )
    wire = DTYPES[t.dtype]
    if wire == dtype or t.dtype in FLOAT_WIRE and dtype in _FLOATING:
        return
    raise ModelMismatchError(
        f"key {model_key!r}: checkpoint dtype {t.dtype} ({wire}) cannot be loaded into the model's "
        f"{dtype} in {where}: only float64/32/16 and bfloat16 are cast; integers, bools, complex "
        "and float8/float4 must match exactly. Build the model with the checkpoint's dtype."
    )


@dataclass(frozen=True)
class KeyMatch:
    """How the checkpoint's keys map onto the model's (made by :func:`match_keys`)."""

    # canonical model key -> its checkpoint tensors, in header order (several: a tied parameter's names)
    by_model_key: dict[str, tuple[TensorHeader, ...]]
    unexpected: tuple[str, ...]  # checkpoint keys the model lacks, sorted
    ignored: tuple[str, ...]  # checkpoint keys key_map dropped or non-persistent in the model, sorted
    # canonical model key -> the checkpoint tensors a conversion assembles it from
    stacked: dict[str, tuple[tuple[ConversionMatch, TensorHeader], ...]]
    # canonical model key -> (checkpoint key, conversion, why rank0load cannot do it)
    unsupported: dict[str, tuple[str, str, str]]


def unconsumed(unexpected: Sequence[str], quantised: AbstractSet[str]) -> tuple[str, ...]:
    """Checkpoint keys ``unexpected`` less the scale grids of the float8 tensors ``quantised``."""
    # Tested key by key in C with no set of names made: that would raise rank 0's peak.
    scale = map(operator.methodcaller("endswith", SCALE_SUFFIX), unexpected)
    weight = map(operator.getitem, unexpected, itertools.repeat(slice(0, -len(SCALE_SUFFIX))))
    consumed = map(operator.and_, scale, map(quantised.__contains__, weight))
    return tuple(itertools.compress(unexpected, map(operator.not_, consumed)))


def match_keys(
    headers: dict[str, TensorHeader],
    layout: ModelLayout,
    key_map: Callable[[str], str | None] | None,
    resolver: KeyResolver,
) -> KeyMatch:
    """(rank 0, or one process for ``inspect``) Map every checkpoint key to a canonical model key:
    ``key_map`` first, then the model's non-persistent buffers (ignored) and its own aliases
    (:meth:`ModelLayout.canonical`) through ``resolver``, which offers a key the model does not have
    to its conversions (renamed, or one of the parts of a stacked parameter); one resolver serves a
    whole load. Keys the model has win. Shapes and dtypes are not checked here.

    Raises:
        ModelMismatchError: ``key_map`` raised, returned neither a str nor None, or mapped two
            checkpoint keys to one model key.
    """
    ignored: list[str] = []
    non_persistent = layout.non_persistent
    if key_map is None:  # the header's keys are unique: none can map twice
        ckpt_keys = model_keys = [k for k in headers if k not in non_persistent]
        ignored = [k for k in headers if k in non_persistent]
    else:
        ckpt_keys, model_keys = [], []
        mapped_from: dict[str, str] = {}
        for ckpt_key, t in headers.items():
            try:
                model_key = key_map(ckpt_key)
            except Exception as exc:
                raise ModelMismatchError(
                    f"key_map({ckpt_key!r}) raised {type(exc).__name__}: {exc} (checkpoint file "
                    f"{os.path.basename(t.file)}). key_map must return a model key (str) or None for "
                    "every checkpoint key: fix it, or return None for keys to drop."
                ) from None
            if model_key is None:
                ignored.append(ckpt_key)
                continue
            if not isinstance(model_key, str):
                raise ModelMismatchError(
                    f"key_map({ckpt_key!r}) returned {model_key!r}: expected a model key (str) or None "
                    "to drop the key. Fix key_map."
                )
            if model_key in mapped_from:
                raise ModelMismatchError(_key_map_collision(mapped_from[model_key], ckpt_key, model_key))
            mapped_from[model_key] = ckpt_key
            if model_key in non_persistent:
                ignored.append(ckpt_key)  # an old checkpoint stores a buffer the model now computes
            else:
                ckpt_keys.append(ckpt_key)
                model_keys.append(model_key)
    by_model_key: dict[str, list[TensorHeader]] = {}
    stacked: dict[str, list[tuple[ConversionMatch, TensorHeader]]] = {}
    unsupported: dict[str, tuple[str, str, str]] = {}
    unexpected: list[str] = []
    answers = resolver.resolve_columns(model_keys)
    for ckpt_key, canonical, converted in zip(ckpt_keys, *answers):
        if canonical is None or converted is not None and converted.unsupported is not None:
            if converted is not None and canonical is not None:
                unsupported.setdefault(canonical, (ckpt_key, converted.rule, str(converted.unsupported)))
            unexpected.append(ckpt_key)
        elif converted is not None and converted.split:
            for target, rows in _split_rows(headers[ckpt_key], converted, layout):
                by_model_key.setdefault(target, []).append(rows)
        elif converted is not None and (converted.expert is not None or converted.sources > 1):
            stacked.setdefault(canonical, []).append((converted, headers[ckpt_key]))
        else:
            by_model_key.setdefault(canonical, []).append(headers[ckpt_key])
    _check_one_layout(stacked.keys(), by_model_key.keys())
    return KeyMatch(
        by_model_key={k: tuple(found) for k, found in by_model_key.items()},
        unexpected=tuple(sorted(unexpected)),
        ignored=tuple(sorted(ignored)),
        stacked={k: tuple(found) for k, found in stacked.items()},
        unsupported=unsupported,
    )


def _split_rows(
    t: TensorHeader, converted: ConversionMatch, layout: ModelLayout
) -> list[tuple[str, TensorHeader]]:
    """(rank 0) Checkpoint tensor ``t`` split along dimension 0 into the model tensors ``converted.split``
    names, as transformers' ``Split`` does (each as many rows as the model tensor has): each model key
    with the range of ``t``'s bytes it takes, a header of its own. Raises ModelMismatchError where the
    model tensors do not tile ``t``'s rows, or for a float8 tensor (its scale grids are not split)."""
    keys = [layout.canonical(k) for k in converted.split]
    shapes = [layout.tensors[k].shape if k is not None else None for k in keys]
    fits = (
        all(s is not None and len(s) == len(t.shape) and s[1:] == t.shape[1:] for s in shapes)
        and len(t.shape) > 0
        and sum(s[0] for s in shapes if s is not None) == t.shape[0]
    )
    if not fits:
        found = {k: s for k, s in zip(converted.split, shapes)}
        raise ModelMismatchError(
            f"checkpoint key {t.key!r} {t.shape} in {os.path.basename(t.file)}: {converted.rule} splits its "
            f"rows into model tensors {found} (None: not in the model), which do not tile them. Does "
            "model_fn build the checkpoint's config?"
        )
    if t.dtype in FP8_WIRE:
        raise ModelMismatchError(
            f"checkpoint key {t.key!r} is float8 and {converted.rule} splits it: rank0load does not split "
            "float8 tensors with their scale grids. Load a dequantised copy of the checkpoint."
        )
    row = t.nbytes // t.shape[0] if t.shape[0] else 0
    out, at = [], t.offset
    for key, shape in zip(keys, shapes):
        assert key is not None and shape is not None  # checked by fits
        out.append((key, t._replace(shape=shape, offset=at, nbytes=shape[0] * row)))
        at += shape[0] * row
    return out


def _check_one_layout(stacked: AbstractSet[str], whole: AbstractSet[str]) -> None:
    """Raise ModelMismatchError for model tensors both ``stacked`` (per expert) and ``whole``."""
    both = sorted(stacked & whole)
    if both:
        raise ModelMismatchError(
            f"{format_keys(both)} are stored both whole and per expert in the checkpoint; keep one "
            "layout (re-save it, or drop one set of keys with key_map)."
        )


def _key_map_collision(first: str, second: str, model_key: str) -> str:
    """The error for ``key_map`` mapping checkpoint keys ``first`` and ``second`` to one model key."""
    return (
        f"key_map maps both {first!r} and {second!r} to model key {model_key!r}. Each model key may "
        "come from one checkpoint key only."
    )


def check_stored_once(
    entries: Sequence[Entry], pending: KeyMatch, key_map: Callable[[str], str | None] | None
) -> set[str]:
    """(rank 0) The model keys the runs of a load found: ``entries`` made, ``pending`` left to the
    merge. Raises ModelMismatchError for one found under different checkpoint keys in different
    runs (tied parameters aside: ``build_entries`` compares them)."""
    found = {e.key for e in entries}
    stacked, single = pending.stacked.keys(), pending.by_model_key
    _check_one_layout(stacked, found | single.keys())
    if len(found) != len(entries) or not found.isdisjoint(single):
        counts = collections.Counter(e.key for e in entries)
        key = min(k for k in counts if counts[k] > 1 or k in single)
        keys = [e.ckpt_key for e in entries if e.key == key] + [t.key for t in single.get(key, ())]
        if key_map is not None:  # the same model key from two checkpoint keys in two runs
            mapped_from: dict[str | None, str] = {}
            for ckpt_key in keys:
                mapped = key_map(ckpt_key)
                if mapped in mapped_from:
                    raise ModelMismatchError(_key_map_collision(mapped_from[mapped], ckpt_key, str(mapped)))
                mapped_from[mapped] = ckpt_key
        raise ModelMismatchError(
            f"model tensor {key!r} is stored under several checkpoint keys in different files: "
            f"{format_keys(keys)}. Keep one (or drop the others with key_map)."
        )
    return found | stacked | single.keys()


def build_entries(
    match: KeyMatch,
    layout: ModelLayout,
    headers: dict[str, TensorHeader],
    block: tuple[int, int] | None,
    *,
    quantised: AbstractSet[str],
    errors: list[str] | None = None,
    files: Mapping[str, OpenFile] | None = None,
) -> list[Entry]:
    """(rank 0, for one run of files; or ``inspect``) One entry per model tensor found: shapes and
    dtypes checked, stacked experts assembled, float8 tensors (``quantised``) given their scales. Raises
    the first ModelMismatchError, or, with ``errors`` (``inspect``), collects every message there and
    reads no data (tied names stored twice are then not compared). ``block``: ``_fp8.block_size``.
    ``files``: the open checkpoint files, through which tied names stored twice are compared."""
    entries: list[Entry] = []

    def one(model_key: str) -> Entry:
        info = layout.tensors[model_key]
        members = match.stacked.get(model_key)
        if members is not None:
            return _assemble(model_key, members, info.shape, info.dtype, quantised, headers, block)
        found = match.by_model_key[model_key]
        if found[0].key in quantised:
            if found[0].shape != info.shape:
                _check_fits(found[0], model_key, info.shape, info.dtype)  # raises: the shapes differ
            return _with_scales(_single(model_key, found[0]), (found[0],), headers, block, info.dtype)
        for t in found:
            _check_fits(t, model_key, info.shape, info.dtype)
        if len(found) > 1 and errors is None:
            assert files is not None, "tied names stored twice are compared through the open files"
            _check_tied_equal(model_key, found, files)
        return _single(model_key, found[0])

    for model_key in [*match.by_model_key, *match.stacked]:
        try:
            entries.append(one(model_key))
        except ModelMismatchError as exc:
            if errors is None:
                raise
            errors.append(str(exc))
    return entries


def _single(key: str, t: TensorHeader) -> Entry:
    return Entry(key, t.file, t.key, t.dtype, t.shape, t.offset, t.nbytes)


def quantised_keys(match: KeyMatch, layout: ModelLayout) -> set[str]:
    """Checkpoint keys of float8 tensors going into floating model tensors (dequantised, see _fp8)."""
    out = set()
    for key, found in match.by_model_key.items():
        if found[0].dtype in FP8_WIRE and layout.tensors[key].dtype in _FLOATING:
            out.add(found[0].key)
    for key, members in match.stacked.items():
        if layout.tensors[key].dtype in _FLOATING:
            out |= {t.key for _, t in members if t.dtype in FP8_WIRE}
    return out


def _with_scales(
    entry: Entry,
    parts: Sequence[TensorHeader],
    headers: dict[str, TensorHeader],
    block: tuple[int, int] | None,
    dtype: torch.dtype,
) -> Entry:
    """``entry`` (float8 parts) with each part's scale grid, checked; dequantised on arrival."""
    scales = list(map(headers.get, map(operator.add, map(_KEY, parts), itertools.repeat(SCALE_SUFFIX))))
    if None in scales:  # raises, naming the first weight without a scale
        checked_block(entry.key, parts[scales.index(None)], headers, block, dtype)
    # the checks depend on shapes and the scale's dtype alone: made once per kind of part
    kinds = list(zip(map(_SHAPE, parts), map(_SHAPE, scales), map(_DTYPE, scales)))
    first_of = dict(zip(reversed(kinds), reversed(parts)))  # each kind's first part, named in errors
    blocks = {checked_block(entry.key, first_of[k], headers, block, dtype) for k in dict.fromkeys(kinds)}
    if len(blocks) > 1:
        raise ModelMismatchError(
            f"model tensor {entry.key!r}: its float8 parts use different block sizes {sorted(blocks)}"
        )
    block = blocks.pop()
    rows = [shape[0] for shape in map(_SHAPE, parts)]
    # parts that all end on block boundaries are one matrix to the dequantisation: one part_rows
    return replace(
        entry,
        scales=Parts.of(scales),  # type: ignore[arg-type]  # no None: checked above
        block=block,
        part_rows=(sum(rows),) if all(r % block[0] == 0 for r in rows[:-1]) else tuple(rows),
    )


def _assemble(
    key: str,
    members: tuple[tuple[ConversionMatch, TensorHeader], ...],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    quantised: AbstractSet[str],
    headers: dict[str, TensorHeader],
    block: tuple[int, int] | None,
) -> Entry:
    """(rank 0) One entry for a model tensor stacked from per-expert checkpoint tensors: every expert
    ``0 .. E-1`` once per source, one dtype, shapes that concatenate to the model's; its parts in
    (expert, source) order, which is the fused tensor's row-major byte order; float8 parts
    (``quantised``) given their scales."""
    rule = members[0][0].rule
    parts = _stacked_parts(key, members, shape, rule)
    first = parts[0]
    heads = [t.shape for t in parts[: members[0][0].sources]]  # expert 0's, one per source
    each = shape[1:] if members[0][0].expert is not None else shape  # one expert's slice, or the whole
    if len(heads) == 1:
        fits = heads[0] == each
    else:
        fits = all(len(h) == len(each) and len(h) > 0 and h[1:] == each[1:] for h in heads)
        fits = fits and sum(h[0] for h in heads) == each[0]
    same = all(map(operator.eq, map(_SHAPE, parts), itertools.cycle(heads)))
    dtypes = sorted(set(map(_DTYPE, parts)))
    if not (fits and same and len(dtypes) == 1):
        raise ModelMismatchError(
            f"model tensor {key!r} (shape {shape}, {rule}): its per-expert tensors do not stack to it "
            f"(expert 0: shapes {heads}; all experts alike: {same}; dtypes {dtypes}). "
            "Does model_fn build the checkpoint's config?"
        )
    if first.key not in quantised:
        _check_fits(first._replace(shape=shape), key, shape, dtype)
    nbytes = sum(map(_NBYTES, parts))
    entry = replace(_single(key, first), shape=shape, nbytes=nbytes, parts=Parts.of(parts))
    return _with_scales(entry, parts, headers, block, dtype) if first.key in quantised else entry


def slices(members: Sequence[tuple[ConversionMatch, TensorHeader]], shape: tuple[int, ...]) -> int:
    """How many slices of ``shape`` a stack's ``members`` fill: its experts (dimension 0), or one for a
    concatenation of sources along dimension 0."""
    return 1 if members[0][0].expert is None else (shape[0] if shape else 0)


def _stacked_parts(
    key: str,
    members: tuple[tuple[ConversionMatch, TensorHeader], ...],
    shape: tuple[int, ...],
    rule: str,
) -> list[TensorHeader]:
    """The checkpoint tensor of every (expert, source), in that order (the fused tensor's); raises,
    naming the first, for an expert beyond the model's ``shape[0]`` experts or stored twice, or one
    absent (with the key it would have, made from a present expert's key of its source)."""
    experts = slices(members, shape)
    matches, tensors = zip(*members)
    seen: dict[tuple[int, int], TensorHeader] = dict(
        zip(zip((m.expert or 0 for m in matches), map(_SOURCE, matches)), tensors)
    )
    if len(seen) < len(members) or max(e for e, _ in seen) >= experts:  # find the first culprit
        seen = {}
        for m, t in members:
            expert = m.expert or 0  # a concatenation's sources: slice 0
            if expert >= experts or (expert, m.source) in seen:
                what = "beyond the model's" if expert >= experts else "stored twice"
                raise ModelMismatchError(
                    f"model tensor {key!r} (shape {shape}): checkpoint key {t.key!r} is expert {expert}, "
                    f"{what} {experts} experts ({rule}). Does model_fn build the checkpoint's config "
                    "(num_experts)?"
                )
            seen[(expert, m.source)] = t
    every = list(itertools.product(range(experts), range(members[0][0].sources)))
    absent = [k for k in every if k not in seen]
    if absent:
        e, s = absent[0]
        present = next(((e2, t.key) for (e2, s2), t in seen.items() if s2 == s), None)
        named = ""
        if present is not None:  # a present expert's key, with the missing expert's index
            head, sep, tail = present[1].rpartition(f".{present[0]}.")
            named = f" ({head}.{e}.{tail})" if sep else ""
        raise ModelMismatchError(
            f"model tensor {key!r}: the checkpoint has no expert {e} for source {s}{named} of {rule} "
            f"({len(absent)} expert tensors are missing). The checkpoint is incomplete: re-download it, "
            "or check that model_fn builds its config."
        )
    return list(map(seen.__getitem__, every))


def _check_tied_equal(model_key: str, found: tuple[TensorHeader, ...], files: Mapping[str, OpenFile]) -> None:
    """Several stored names of one tied parameter must hold the same bytes (read through ``files``)."""
    chunk = 8 << 20
    first = found[0]
    fa = files[first.file].fd
    for other in found[1:]:
        fb = files[other.file].fd
        same = (first.dtype, first.nbytes) == (other.dtype, other.nbytes) and all(
            read_exact(fa, min(chunk, first.nbytes - pos), first.offset + pos, first.file)
            == read_exact(fb, min(chunk, first.nbytes - pos), other.offset + pos, other.file)
            for pos in range(0, first.nbytes, chunk)
        )
        if not same:
            raise ModelMismatchError(
                f"tied parameter {model_key!r} is stored twice with different values: "
                f"{first.key!r} in {os.path.basename(first.file)} and {other.key!r} in "
                f"{os.path.basename(other.file)}. The model ties them to one tensor; keep one "
                "in the checkpoint or untie them in model_fn."
            )
