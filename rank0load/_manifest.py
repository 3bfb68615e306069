"""Match the checkpoint's headers to the model and produce the manifest (rank 0; no collectives).

(rank 0) :func:`build_manifest` reads every header, maps checkpoint keys to model keys
(:func:`match_keys`, which ``inspect`` shares so its dry run matches keys exactly as a load does),
checks keys, shapes and dtypes, and returns a :class:`Manifest`: the ordered list of
:class:`Entry` that every rank will iterate during streaming. Any problem raises a
:class:`LoadError`, which ``_api`` broadcasts so every rank raises it too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from ._convert import Conversion, ConversionMatch
from ._format import DTYPES, OpenFile, TensorHeader, open_files, read_header
from ._fp8 import FP8_WIRE
from ._fp8 import block_size as fp8_block_size
from ._fp8 import scale_for as fp8_scale_for
from ._meta import ModelLayout
from ._source import Source, resolve
from .errors import CheckpointFormatError, LoadError, ModelMismatchError, format_keys

__all__ = [
    "build_entries",
    "unconsumed",
    "Entry",
    "FLOAT_WIRE",
    "Part",
    "KeyMatch",
    "Manifest",
    "build_manifest",
    "match_keys",
    "read_manifest",
]

# Wire dtypes that may be cast to another of these (bf16 checkpoint -> fp32 model and so on).
# Integers, bools, complex and float8/float4 are never cast: they must match the model exactly.
FLOAT_WIRE = frozenset({"F64", "F32", "F16", "BF16"})


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor's bytes, as a run of an entry's bytes (see :attr:`Entry.parts`)."""

    file: str  # absolute path on rank 0
    ckpt_key: str
    offset: int  # absolute offset in ``file``
    nbytes: int


@dataclass(frozen=True)
class Entry:
    """One model tensor to move, in the wire dtype (the checkpoint's) and the model's shape.

    Its bytes are those of one checkpoint tensor (``file``, ``ckpt_key``, ``offset``), or, for a
    tensor assembled from several (``parts``: stacked experts), the parts' bytes one after the other
    in the model tensor's row-major order. Pieces address an entry's bytes from 0 to ``nbytes``;
    :meth:`extents` says where in the files they are.
    """

    key: str  # canonical model key
    file: str  # absolute path on rank 0 (informational elsewhere); the first part's, if any
    ckpt_key: str  # the first part's, if any
    dtype: str  # wire dtype: the checkpoint's
    shape: tuple[int, ...]  # the model tensor's
    offset: int  # absolute offset in ``file``
    nbytes: int
    parts: tuple[Part, ...] = ()  # several checkpoint tensors, in order; empty: just the one above
    # float8 block-quantised (see _fp8): each part's scale grid, in part order; the block size;
    # each part's rows (its columns are the entry's last dimension). Empty: not quantised.
    scales: tuple[Part, ...] = ()
    block: tuple[int, int] = (0, 0)
    part_rows: tuple[int, ...] = ()

    @property
    def scale_nbytes(self) -> int:
        return sum(p.nbytes for p in self.scales)

    def extents(self, start: int, nbytes: int, scales: bool = False) -> list[tuple[str, int, int, int]]:
        """``(file, file offset, bytes, offset in the buffer)`` for entry bytes [start, start + nbytes)
        (of its scale grids, with ``scales``)."""
        parts = self.scales if scales else self.parts
        if not parts:
            return [(self.file, self.offset + start, nbytes, 0)]
        out, base, stop = [], 0, start + nbytes
        for part in parts:  # a few hundred parts at most (experts x sources): a scan is enough
            lo, hi = max(start, base), min(stop, base + part.nbytes)
            if lo < hi:
                out.append((part.file, part.offset + lo - base, hi - lo, lo - start))
            base += part.nbytes
            if base >= stop:
                break
        return out


@dataclass(frozen=True)
class Manifest:
    entries: tuple[Entry, ...]
    missing: tuple[str, ...] = ()  # canonical model keys absent from the checkpoint (strict=False)
    unexpected: tuple[str, ...] = ()  # checkpoint keys skipped (strict=False)
    ignored: tuple[str, ...] = ()  # checkpoint keys held by the model as non-persistent buffers
    files: tuple[str, ...] = field(default=())
    total_bytes: int = 0


def _headers(source: Source, files: dict[str, OpenFile] | None = None) -> dict[str, TensorHeader]:
    """All tensors of all files; cross-checked against the index when there is one.

    ``files``: the source's files already opened (``_format.open_files(source.files)``); each
    header is then read through its descriptor. Without it, each file is opened by path.
    """
    found: dict[str, TensorHeader] = {}
    for path in source.files:
        tensors, _ = read_header(files[path] if files is not None else path)
        for key, t in tensors.items():
            if key in found:
                raise CheckpointFormatError(
                    f"key {key!r} is stored twice: in {os.path.basename(found[key].file)} and in "
                    f"{os.path.basename(path)}. Remove one copy or re-save the checkpoint."
                )
            found[key] = t
    if source.weight_map is not None:
        for key, path in source.weight_map.items():
            stored = found.get(key)
            if stored is None:
                raise CheckpointFormatError(
                    f"{source.description}: index lists key {key!r} in {os.path.basename(path)}, "
                    "but no file stores it. The index and the shards disagree: re-save the checkpoint."
                )
            if stored.file != path:
                raise CheckpointFormatError(
                    f"{source.description}: index lists key {key!r} in {os.path.basename(path)}, "
                    f"but it is stored in {os.path.basename(stored.file)}. Re-save the checkpoint."
                )
        extra = set(found) - set(source.weight_map)
        if extra:
            raise CheckpointFormatError(
                f"{source.description}: the shards store keys the index does not list: "
                f"{format_keys(extra)}. The index and the shards disagree: re-save the checkpoint."
            )
    return found


def _check_fits(t: TensorHeader, model_key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    where = os.path.basename(t.file)
    if t.shape != shape:
        raise ModelMismatchError(
            f"key {model_key!r}: checkpoint shape {t.shape} != model {shape} in {where}. "
            "Does model_fn build the same config as the checkpoint?"
        )
    wire = DTYPES[t.dtype]
    if wire == dtype:
        return
    if t.dtype in FLOAT_WIRE and dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        return
    raise ModelMismatchError(
        f"key {model_key!r}: checkpoint dtype {t.dtype} ({wire}) cannot be loaded into the model's "
        f"{dtype} in {where}: only float64/32/16 and bfloat16 are cast; integers, bools, complex "
        "and float8/float4 must match exactly. Build the model with the checkpoint's dtype."
    )


@dataclass(frozen=True)
class KeyMatch:
    """How the checkpoint's keys map onto the model's (see :func:`match_keys`)."""

    # canonical model key -> the checkpoint tensors stored under its names, in header order
    # (more than one: a tied parameter stored under several of its names)
    by_model_key: dict[str, tuple[TensorHeader, ...]]
    unexpected: tuple[str, ...]  # checkpoint keys the model lacks, sorted
    ignored: tuple[str, ...]  # checkpoint keys key_map dropped or non-persistent in the model, sorted
    missing: tuple[str, ...]  # canonical model keys no checkpoint key maps to, sorted
    # canonical model key -> the checkpoint tensors a conversion assembles it from
    stacked: dict[str, tuple[tuple[ConversionMatch, TensorHeader], ...]] = field(default_factory=dict)
    # canonical model key -> (checkpoint key, conversion, why rank0load cannot do it)
    unsupported: dict[str, tuple[str, str, str]] = field(default_factory=dict)


def match_keys(
    headers: dict[str, TensorHeader],
    layout: ModelLayout,
    key_map: Callable[[str], str | None] | None,
    conversions: Sequence[Conversion] = (),
) -> KeyMatch:
    """(rank 0, or one process for ``inspect``) Map every checkpoint key to a canonical model key:
    ``key_map`` first, then the model's non-persistent buffers (ignored) and its own aliases
    (:meth:`ModelLayout.canonical`); a key the model does not have is offered to ``conversions``
    (renamed, or one of the parts of a stacked parameter). Keys the model has win: a checkpoint
    already in the model's layout loads as it is. Shapes and dtypes are not checked here.

    Raises:
        ModelMismatchError: ``key_map`` raised, returned neither a str nor None, or mapped two
            checkpoint keys to one model key.
    """
    by_model_key: dict[str, list[TensorHeader]] = {}
    stacked: dict[str, list[tuple[ConversionMatch, TensorHeader]]] = {}
    unsupported: dict[str, tuple[str, str, str]] = {}
    mapped_from: dict[str, str] = {}
    unexpected: list[str] = []
    ignored: list[str] = []
    for ckpt_key, t in headers.items():
        try:
            model_key = key_map(ckpt_key) if key_map is not None else ckpt_key
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
            raise ModelMismatchError(
                f"key_map maps both {mapped_from[model_key]!r} and {ckpt_key!r} to model key "
                f"{model_key!r}. Each model key may come from one checkpoint key only."
            )
        mapped_from[model_key] = ckpt_key
        if model_key in layout.non_persistent:
            ignored.append(ckpt_key)  # an old checkpoint stores a buffer the model now computes
            continue
        canonical = layout.canonical(model_key)
        converted = None
        if canonical is None:
            converted = _convert(model_key, layout, conversions)
            canonical = converted.target if converted is not None else None
        if canonical is None or converted is not None and converted.unsupported is not None:
            if converted is not None and canonical is not None:
                unsupported.setdefault(canonical, (ckpt_key, converted.rule, str(converted.unsupported)))
            unexpected.append(ckpt_key)
        elif converted is not None and converted.expert is not None:
            stacked.setdefault(canonical, []).append((converted, t))
        else:
            by_model_key.setdefault(canonical, []).append(t)
    both = sorted(set(stacked) & set(by_model_key))
    if both:
        raise ModelMismatchError(
            f"{format_keys(both)} are stored both whole and per expert in the checkpoint; keep one "
            "layout (re-save it, or drop one set of keys with key_map)."
        )
    return KeyMatch(
        by_model_key={k: tuple(found) for k, found in by_model_key.items()},
        unexpected=tuple(sorted(unexpected)),
        ignored=tuple(sorted(ignored)),
        missing=tuple(sorted(k for k in layout.tensors if k not in by_model_key and k not in stacked)),
        stacked={k: tuple(found) for k, found in stacked.items()},
        unsupported=unsupported,
    )


def _convert(
    model_key: str, layout: ModelLayout, conversions: Sequence[Conversion]
) -> ConversionMatch | None:
    """The first conversion that maps ``model_key`` onto a tensor of the model (target canonical)."""
    for conversion in conversions:
        found = conversion.match(model_key)
        target = layout.canonical(found.target) if found is not None else None
        if found is not None and target is not None:
            return replace(found, target=target)
    return None


def build_manifest(
    source: Source,
    layout: ModelLayout,
    *,
    strict: bool,
    key_map: Callable[[str], str | None] | None,
    files: dict[str, OpenFile] | None = None,
    conversions: Sequence[Conversion] = (),
) -> Manifest:
    """(rank 0) Validate the checkpoint against the model and list what to move, in file order.
    ``files``: the source's files, opened once (see :func:`read_manifest`)."""
    headers = _headers(source, files)
    match = match_keys(headers, layout, key_map, conversions)
    missing, unexpected = match.missing, unconsumed(match, layout, headers)
    cannot = {k: v for k, v in match.unsupported.items() if k in missing}
    if cannot:
        target, (ckpt_key, rule, why) = sorted(cannot.items())[0]
        raise ModelMismatchError(
            f"{source.description}: model tensor {target!r} would come from checkpoint key {ckpt_key!r} "
            f"through the conversion {rule}, which {why}; rank0load assembles only stacked experts "
            f"(MergeModulelist(dim=0), then Concatenate(dim=1)). {len(cannot)} tensors are affected. "
            "Convert the checkpoint to the model's layout first (from_pretrained, then save_pretrained "
            "with save_original_format=False), or pass key_map."
        )
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {format_keys(missing)}")
        if unexpected:
            parts.append(f"unexpected in the checkpoint: {format_keys(unexpected)}")
        raise ModelMismatchError(
            f"{source.description}: keys do not match the model; "
            + "; ".join(parts)
            + ". Pass key_map to rename keys, or strict=False to skip unexpected keys and "
            "initialise missing ones with the model's own initialisation."
        )
    uninitialisable = [k for k in missing if layout.tensors[k].is_param and k not in layout.initialisable]
    if uninitialisable:
        raise ModelMismatchError(
            f"{source.description}: missing parameters {format_keys(uninitialisable)} have no "
            "initialiser (their module has no reset_parameters() and no ancestor has _init_weights()), "
            "so strict=False would leave them uninitialised. Add them to the checkpoint or give the "
            "module a reset_parameters()."
        )

    entries = build_entries(match, layout, headers, source.root)
    order = {path: i for i, path in enumerate(source.files)}
    entries.sort(key=lambda e: (order[e.file], e.offset))
    return Manifest(
        entries=tuple(entries),
        missing=missing,
        unexpected=unexpected,
        ignored=match.ignored,
        files=source.files,
        total_bytes=sum(e.nbytes for e in entries),
    )


def unconsumed(match: KeyMatch, layout: ModelLayout, headers: dict[str, TensorHeader]) -> tuple[str, ...]:
    """``match.unexpected`` less the scale grids of float8 tensors that will be dequantised."""
    scales = {k + "_scale_inv" for k in _quantised(match, layout)} & set(headers)
    return tuple(k for k in match.unexpected if k not in scales)


def build_entries(
    match: KeyMatch,
    layout: ModelLayout,
    headers: dict[str, TensorHeader],
    root: str,
    errors: list[str] | None = None,
) -> list[Entry]:
    """(rank 0, or ``inspect``) One entry per model tensor found: shapes and dtypes checked, stacked
    experts assembled, float8 tensors given their scales. Raises the first ModelMismatchError, or,
    with ``errors`` (``inspect``: headers only), collects every message there and reads no data
    (tied names stored twice are then not compared)."""
    quantised = _quantised(match, layout)  # float8 checkpoint tensors for floating model tensors
    block = fp8_block_size(root) if quantised else None
    entries: list[Entry] = []

    def one(model_key: str) -> Entry:
        info = layout.tensors[model_key]
        members = match.stacked.get(model_key)
        if members is not None:
            entry = _assemble(model_key, members, info.shape, info.dtype, quantised)
            if members[0][1].key in quantised:
                entry = _with_scales(
                    entry, [headers[p.ckpt_key] for p in entry.parts], headers, block, info.dtype
                )
            return entry
        found = match.by_model_key[model_key]
        if found[0].key in quantised:
            if found[0].shape != info.shape:
                _check_fits(found[0], model_key, info.shape, info.dtype)  # raises: the shapes differ
            return _with_scales(_single(model_key, found[0]), (found[0],), headers, block, info.dtype)
        for t in found:
            _check_fits(t, model_key, info.shape, info.dtype)
        if len(found) > 1 and errors is None:
            _check_tied_equal(model_key, found)
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


def _quantised(match: KeyMatch, layout: ModelLayout) -> set[str]:
    """Checkpoint keys of float8 tensors that go into floating (not float8) model tensors: they are
    dequantised with their ``_scale_inv`` (see _fp8)."""
    out = set()
    floating = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    for key, found in match.by_model_key.items():
        if found[0].dtype in FP8_WIRE and layout.tensors[key].dtype in floating:
            out.add(found[0].key)
    for key, members in match.stacked.items():
        if layout.tensors[key].dtype in floating:
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
    found = [fp8_scale_for(entry.key, t, headers, block, dtype) for t in parts]
    blocks = {b for _, b in found}
    if len(blocks) > 1:
        raise ModelMismatchError(
            f"model tensor {entry.key!r}: its float8 parts use different block sizes {sorted(blocks)}"
        )
    return replace(
        entry,
        scales=tuple(Part(s.file, s.key, s.offset, s.nbytes) for s, _ in found),
        block=blocks.pop(),
        part_rows=tuple(t.shape[0] for t in parts),
    )


def _assemble(
    key: str,
    members: tuple[tuple[ConversionMatch, TensorHeader], ...],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    quantised: set[str] = frozenset(),  # type: ignore[assignment]
) -> Entry:
    """(rank 0) One entry for a model tensor stacked from per-expert checkpoint tensors: every expert
    ``0 .. E-1`` once per source, one dtype, shapes that concatenate to the model's; its parts in
    (expert, source) order, which is the fused tensor's row-major byte order."""
    rule = members[0][0].rule
    sources = members[0][0].sources
    experts = shape[0] if shape else 0
    seen: dict[tuple[int, int], TensorHeader] = {}
    for m, t in members:
        if m.expert >= experts or (m.expert, m.source) in seen:  # type: ignore[operator]
            what = "beyond the model's" if m.expert >= experts else "stored twice"  # type: ignore[operator]
            raise ModelMismatchError(
                f"model tensor {key!r} (shape {shape}): checkpoint key {t.key!r} is expert {m.expert}, {what} "
                f"{experts} experts ({rule}). Does model_fn build the checkpoint's config (num_experts)?"
            )
        seen[(m.expert, m.source)] = t  # type: ignore[index]
    absent = [(e, s) for e in range(experts) for s in range(sources) if (e, s) not in seen]
    if absent:
        e, s = absent[0]
        like = next((t.key for (e2, s2), t in seen.items() if s2 == s), None)
        named = ""
        if like is not None:  # the present expert's key with the missing expert's index
            other = next(e2 for (e2, s2), t in seen.items() if t.key == like)
            head, sep, tail = like.rpartition(f".{other}.")
            named = f" ({head}.{e}.{tail!s})" if sep else ""
        raise ModelMismatchError(
            f"model tensor {key!r}: the checkpoint has no expert {e} for source {s}{named} of {rule} "
            f"({len(absent)} expert tensors are missing). The checkpoint is incomplete: re-download it, "
            "or check that model_fn builds its config."
        )
    first = seen[(0, 0)]
    parts = [seen[(e, s)] for e in range(experts) for s in range(sources)]
    heads = [seen[(0, s)].shape for s in range(sources)]
    if sources == 1:
        fits = heads[0] == shape[1:]
    else:
        fits = all(len(h) == len(shape) - 1 and h[1:] == shape[2:] for h in heads)
        fits = fits and sum(h[0] for h in heads) == shape[1]
    same = all(t.shape == heads[s] for (e, s), t in seen.items())
    dtypes = sorted({t.dtype for t in parts})
    if not (fits and same and len(dtypes) == 1):
        raise ModelMismatchError(
            f"model tensor {key!r} (shape {shape}, {rule}): its per-expert tensors do not stack to it "
            f"(expert 0: shapes {heads}; all experts alike: {same}; dtypes {dtypes}). "
            "Does model_fn build the checkpoint's config?"
        )
    if first.key not in quantised:
        _check_fits(replace(first, shape=shape), key, shape, dtype)
    nbytes = sum(t.nbytes for t in parts)
    return Entry(
        key,
        first.file,
        first.key,
        first.dtype,
        shape,
        first.offset,
        nbytes,
        tuple(Part(t.file, t.key, t.offset, t.nbytes) for t in parts),
    )


def _check_tied_equal(model_key: str, found: tuple[TensorHeader, ...], chunk: int = 8 << 20) -> None:
    """Several names of one tied parameter are stored: they must hold the same bytes."""
    first = found[0]
    for other in found[1:]:
        same = first.dtype == other.dtype and first.nbytes == other.nbytes
        if same:
            with open(first.file, "rb", buffering=0) as fa, open(other.file, "rb", buffering=0) as fb:
                for pos in range(0, first.nbytes, chunk):
                    n = min(chunk, first.nbytes - pos)
                    if os.pread(fa.fileno(), n, first.offset + pos) != os.pread(
                        fb.fileno(), n, other.offset + pos
                    ):
                        same = False
                        break
        if not same:
            raise ModelMismatchError(
                f"tied parameter {model_key!r} is stored twice with different values: "
                f"{first.key!r} in {os.path.basename(first.file)} and {other.key!r} in "
                f"{os.path.basename(other.file)}. The model ties them to one tensor; keep one "
                "in the checkpoint or untie them in model_fn."
            )


def read_manifest(
    ckpt_path: str | os.PathLike[str],
    revision: str | None,
    layout: ModelLayout,
    strict: bool,
    key_map: Callable[[str], str | None] | None,
    stack: contextlib.ExitStack,
    conversions: Sequence[Conversion] = (),
) -> tuple[Manifest | LoadError, dict[str, OpenFile]]:
    """(rank 0) Resolve the checkpoint, open its files once (closed by ``stack``), read and validate
    their headers against the model. Returns the manifest, or the LoadError to share with every
    rank (anything unforeseen is wrapped in one), and the open files the stream reads from."""
    files: dict[str, OpenFile] = {}
    try:
        source = resolve(ckpt_path, revision)
        files = open_files(source.files)
        for opened in files.values():
            stack.callback(opened.close)
        manifest = build_manifest(
            source, layout, strict=strict, key_map=key_map, files=files, conversions=conversions
        )
        return manifest, files
    except LoadError as exc:
        return exc, files
    except Exception as exc:  # anything unforeseen must still reach every rank
        message = f"rank 0 could not read checkpoint {os.fspath(ckpt_path)!r}: {type(exc).__name__}: {exc}"
        return LoadError(message), files
