"""Checkpoint tensors that become a model tensor of another name or layout (rank 0 matches).

A :class:`Conversion` says, for a checkpoint key the model lacks, which model tensor it belongs to
and where: the expert index (the leading dimension) and its place among the sources concatenated in
each expert's slice (per-expert Hub MoE tensors into transformers 5's fused experts). A fused
tensor's bytes are then its parts' bytes in (expert, source) order, so the stream moves it like any
other tensor and no rank holds it whole.

:class:`StackExperts` is the public declaration; :class:`TransformersConversions` /
:class:`TransformersRenamings` are transformers' own rules (5 / 4.57): ``MergeModulelist(dim=0)``, optionally then
``Concatenate(dim=1)`` (stacked experts), ``Concatenate(dim=0)`` (a model tensor's rows from several
checkpoint tensors, in order) and ``Split`` / ``Chunk(dim=0)`` (several model tensors, each a range of
one checkpoint tensor's rows) are assembled, as byte ranges; any other operation is reported, never
skipped (``Transpose``, ``PermuteForRope``, ``Interleave`` move single elements, not byte ranges).
:class:`TransformersReversal` / :func:`original_format_reversal` go the other way, for
``original_format=True``.

transformers' private conversion code is reached only here; ``tests/integrations/test_convert.py``
fails loudly when a release changes it.

(all ranks build the conversions before sharding; rank 0 alone matches keys, and builds the reversal
when saving; no collectives)
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from ..errors import SaveError
from . import _compat, _peft


class ConversionMatch(NamedTuple):
    """Where one checkpoint tensor goes (a named tuple: one is made per converted tensor)."""

    target: str  # model key
    expert: int | None  # index along the target's dimension 0; None: the whole target (a renaming)
    source: int  # position among the sources concatenated in each expert's slice
    sources: int  # how many sources each expert's slice concatenates
    rule: str  # the conversion, for messages
    unsupported: str | None = None  # why rank0load cannot assemble it, if it cannot
    # a split (or equal chunks) along dimension 0 into several model tensors: their keys, in row
    # order (``target`` the first); each is a byte range of the checkpoint tensor
    split: tuple[str, ...] = ()


class Conversion(Protocol):
    def match(self, key: str) -> ConversionMatch | None:
        """Where checkpoint ``key`` goes, or None if this conversion does not apply to it."""


@dataclass(frozen=True)
class StackExperts:
    """Per-expert checkpoint tensors stacked into one model parameter.

    ``target[e]`` is ``sources[0]``, ``sources[1]``, ... for expert ``e`` concatenated along their
    first dimension (one source: plain stacking). In the patterns, ``{e}`` is the expert index and
    ``*`` one dotted name segment, matched in order between each source and the target::

        StackExperts(
            target="layers.*.moe.experts.w13",
            sources=("layers.*.feed_forward.experts.{e}.w1.weight",
                     "layers.*.feed_forward.experts.{e}.w3.weight"),
        )

    Every expert ``0 .. E-1`` (E: the target's first dimension) must be present exactly once per
    source, with shapes that concatenate to the target's. Raises ValueError for a malformed pattern.
    """

    target: str
    sources: tuple[str, ...]

    def __post_init__(self) -> None:
        if isinstance(self.sources, str):
            object.__setattr__(self, "sources", (self.sources,))
        compiled = []
        for pattern in self.sources:
            if pattern.count("{e}") != 1:
                raise ValueError(
                    f"StackExperts source {pattern!r} needs exactly one '{{e}}' (the expert index)"
                )
            if pattern.count("*") != self.target.count("*"):
                raise ValueError(
                    f"StackExperts source {pattern!r} and target {self.target!r} need as many '*' each"
                )
            # "*": one dotted segment, captured; "{e}": the expert index, captured as "e"
            regex = re.escape(pattern).replace(r"\*", r"([^.]+)").replace(r"\{e\}", r"(?P<e>\d+)")
            compiled.append(re.compile(f"^{regex}$"))
        object.__setattr__(self, "_compiled", tuple(compiled))

    def match(self, key: str) -> ConversionMatch | None:
        """Where checkpoint ``key`` goes (the target and expert ``e``), or None if no source matches it."""
        for index, regex in enumerate(self._compiled):  # type: ignore[attr-defined]
            found = regex.match(key)
            if found is None:
                continue
            stars = [g for i, g in enumerate(found.groups(), start=1) if i != regex.groupindex["e"]]
            target = self.target
            for value in stars:
                target = target.replace("*", value, 1)
            return ConversionMatch(target, int(found.group("e")), index, len(self.sources), repr(self))
        return None


_STACKABLE = ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])
_SPLITS = ([("Split", 0)], [("Chunk", 0)])  # one checkpoint tensor's rows into several model tensors
_CONCATENATION = [("Concatenate", 0)]  # several checkpoint tensors' rows into one model tensor


def _split(transforms: list[Any]) -> tuple[list[Any], list[Any]]:
    """transformers' transforms as (``WeightRenaming``s, ``WeightConverter``s), in order."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    return (
        [t for t in transforms if isinstance(t, WeightRenaming)],
        [t for t in transforms if isinstance(t, WeightConverter)],
    )


class TransformersConversions:
    """transformers' own renamings and converters for ``model`` (see the module docstring)."""

    def __init__(self, model: nn.Module, model_keys: Sequence[str]) -> None:
        """Some conversions are looked up by class name: build this before ``fully_shard`` renames them."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import rename_source_key

        transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
        self._model, self._transforms = model, transforms
        self._renamings, self._converters = _split(transforms)
        self._rename = rename_source_key  # the renamings, then at most one converter
        self._prefix = getattr(model, "base_model_prefix", None)
        self._model_keys = dict.fromkeys(model_keys, True)

    def record_used(self) -> None:
        """(rank 0, after the load) Keep the transforms the load used on the model, as transformers'
        ``from_pretrained`` does (``_weight_conversions``): a save reverts those (:class:`TransformersReversal`),
        computed before ``fully_shard`` renamed the classes some are scoped by."""
        if all(
            callable(getattr(t, "was_used", None)) for t in self._transforms
        ):  # else: the save's own mapping
            self._model._weight_conversions = [t for t in self._transforms if t.was_used()]  # type: ignore[assignment]

    def match(self, key: str) -> ConversionMatch | None:
        renamed, pattern = self._rename(
            key, self._renamings, self._converters, self._prefix, self._model_keys
        )
        if pattern is None:
            return ConversionMatch(renamed, None, 0, 1, "transformers renaming") if renamed != key else None
        converter = next(c for c in self._converters if pattern in c.source_patterns)
        name = f"{type(converter).__name__}({converter.source_patterns} -> {converter.target_patterns})"
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
        index, total = converter.source_patterns.index(pattern), len(converter.source_patterns)
        targets = converter.target_patterns
        by_config = any(getattr(op, "num_shards_attribute", None) for op in converter.operations)
        if ops in _SPLITS and total == 1 and len(targets) > 1 and not by_config and targets[0] in renamed:
            # the key renamed to the first target; the others as Split.convert names them
            return ConversionMatch(
                renamed, None, 0, 1, name, split=tuple(renamed.replace(targets[0], t) for t in targets)
            )
        if ops == _CONCATENATION and total > 1 and len(targets) == 1 and not by_config:
            return ConversionMatch(renamed, None, index, total, name)  # the index-th rows of one tensor
        if ops not in _STACKABLE or len(converter.target_patterns) != 1:
            what = ", ".join(f"{n}(dim={d})" if d is not None else n for n, d in ops)
            return ConversionMatch(renamed, None, index, total, name, f"needs {what}")
        # the expert: the integer the pattern's "*" stands for in the key after the renamings alone
        # (transformers' source patterns are regular expressions in which "*" is an index)
        source = self._rename(key, self._renamings, [], None, None)[0]
        found = re.search(pattern.replace("*", r"(\d+)"), source)
        if found is None or not found.groups():
            return ConversionMatch(renamed, None, index, total, name, "no expert index found in the key")
        return ConversionMatch(renamed, int(found.group(1)), index, total, name)


class Reverted(NamedTuple):
    """A byte range of a model tensor as it is saved (the ranges of one model tensor follow each other)."""

    name: str  # the saved tensor's name
    shape: tuple[int, ...]  # the range's shape
    # the saved tensor joins ``of`` model tensors' ranges along dimension 0 (a reverted Split);
    # this is the ``position``-th
    position: int = 0
    of: int = 1


# a model tensor's saved parts, in byte order: save._saveplan.Revert
Reversal = Callable[[str, tuple[int, ...]], list[Reverted]]

# the reverse of _STACKABLE: Chunk(dim=1) into the sources, then SplitModulelist(dim=0) into the experts
_SPLITTABLE = ([("SplitModulelist", 0)], [("Chunk", 1), ("SplitModulelist", 0)])


class TransformersReversal:
    """(rank 0) A model tensor's saved names and shapes with transformers' conversions reverted as
    ``save_pretrained``'s ``revert_weight_conversion`` reverts them, each a contiguous byte range of
    the fused tensor (found by reverting a stand-in that numbers the (expert, source) slices);
    SaveError for one that is not."""

    def __init__(self, model: nn.Module) -> None:
        """The model's ``_weight_conversions``, else its mapping without ``PrefixChange`` (found through
        ``config.model_type`` after ``fully_shard``), each reversed, last first."""
        import transformers.core_model_loading as core
        from transformers.conversion_mapping import get_model_conversion_mapping

        self._model, self._core = model, core
        transforms = getattr(model, "_weight_conversions", None)
        if transforms is None:
            transforms = get_model_conversion_mapping(model, add_legacy=False)  # type: ignore[arg-type]
            transforms = [t for t in transforms if not isinstance(t, core.PrefixChange)]
        self._renamings, self._converters = _split([t.reverse_transform() for t in transforms[::-1]])

    def __call__(self, name: str, shape: tuple[int, ...]) -> list[Reverted]:
        # reverted: at most one converter; from transformers 5.24 the renamings on a key no converter
        # takes, else on the converter's outputs; before 5.24 together with it (rename_source_key)
        core = self._core
        current = hasattr(core, "apply_converters")  # transformers 5.24 and later
        if current:
            renamed, pattern = core.apply_converters(name, self._converters)
            if pattern is None:
                renamed = core.apply_renamings(name, self._renamings)
        else:
            renamed, pattern = core.rename_source_key(name, self._renamings, self._converters, reverse=True)
        if pattern is None:
            return [Reverted(renamed, shape)]
        converter = next(c for c in self._converters if pattern in c.source_patterns)
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
        sources, targets = converter.source_patterns, converter.target_patterns
        if ops == _CONCATENATION and len(sources) > 1 and len(targets) == 1 and shape:
            # a reverted Split: this model tensor's rows, the index-th of the saved tensor's
            saved = core.apply_renamings(renamed, self._renamings) if current else renamed
            return [Reverted(saved, shape, sources.index(pattern), len(sources))]
        if ops in _SPLITS and len(sources) == 1 and len(targets) > 1 and shape:
            return self._row_ranges(name, renamed, pattern, shape, converter, current)
        slices = shape[0] * len(targets) if shape else 0
        if (
            ops not in _SPLITTABLE
            or len(shape) < 2
            or shape[1] % len(targets)
            or (len(targets) > 1) != (len(ops) > 1)
        ):
            what = ", ".join(f"{n}(dim={d})" if d is not None else n for n, d in ops)
            raise SaveError(
                f"{name!r} {shape}: transformers reverts it with {what}, which rank0load cannot save as "
                "byte ranges of the model tensor. Save with original_format=False (the model's own names)."
            )
        standin = torch.arange(slices).reshape(shape[0], len(targets), *[1] * (len(shape) - 2))
        order = self._numbered(name, renamed, pattern, standin, converter, current)
        if len(order) != slices or sorted(order) != list(range(slices)):
            raise SaveError(
                f"{name!r} {shape}: transformers' reverse conversion gave {len(order)} tensors, not the "
                f"{slices} per-expert slices expected. Save with original_format=False."
            )
        part = (shape[1] // len(targets), *shape[2:])
        return [Reverted(order[v], part) for v in range(slices)]

    def _numbered(
        self, name: str, renamed: str, pattern: str, standin: torch.Tensor, converter: Any, current: bool
    ) -> dict[int, str]:
        """Run ``converter`` on a stand-in whose slices are numbered: each output's first number -> its
        name (renamed as ``save_pretrained`` renames it); outputs of more than one number are left out."""
        converter = copy.deepcopy(converter)
        converter.add_tensor(renamed, name, pattern, standin)
        converted = converter.convert(renamed, model=self._model, config=getattr(self._model, "config", None))
        out = {n: v[0] if isinstance(v, list) else v for n, v in converted.items()}
        if current:
            out = {self._core.apply_renamings(n, self._renamings): v for n, v in out.items()}
        return {int(v.reshape(-1)[0]): n for n, v in out.items() if v.numel() == 1}

    def _row_ranges(
        self, name: str, renamed: str, pattern: str, shape: tuple[int, ...], converter: Any, current: bool
    ) -> list[Reverted]:
        """A reverted ``Concatenate(dim=0)`` (``Split``/``Chunk`` on saving): the saved tensors, each a
        range of the model tensor's rows, found by splitting a stand-in of numbered rows as transformers
        would. SaveError where a saved tensor is not one range of rows, in order."""
        rows = shape[0]
        converter = copy.deepcopy(converter)
        converter.add_tensor(
            renamed, name, pattern, torch.arange(rows).reshape(rows, *[1] * (len(shape) - 1))
        )
        try:
            converted = converter.convert(
                renamed, model=self._model, config=getattr(self._model, "config", None)
            )
        except Exception as exc:  # Split sizes come from model parameters this name may not have
            raise SaveError(
                f"{name!r} {shape}: transformers' reverse conversion failed on it ({type(exc).__name__}: "
                f"{exc}). Save with original_format=False (the model's own names)."
            ) from None
        out = []
        for n, v in converted.items():
            v = (v[0] if isinstance(v, list) else v).reshape(-1)
            out.append(
                (
                    int(v[0]) if v.numel() else rows,
                    self._core.apply_renamings(n, self._renamings) if current else n,
                    v,
                )
            )
        out.sort(key=lambda o: o[0])
        at = 0
        parts = []
        for first, saved, v in out:
            if first != at or not torch.equal(v, torch.arange(at, at + v.numel())):
                raise SaveError(
                    f"{name!r} {shape}: transformers' reverse conversion does not cut it into consecutive "
                    f"ranges of rows ({saved!r} starts at row {first}, not {at}). Save with original_format=False."
                )
            parts.append(Reverted(saved, (v.numel(), *shape[1:])))
            at += v.numel()
        if at != rows:
            raise SaveError(
                f"{name!r} {shape}: transformers' reverse conversion kept {at} of its {rows} rows"
            )
        return parts


class TransformersRenamings:
    """transformers 4.x's key renamings, as ``from_pretrained`` does them: ``_fix_state_dict_key_on_load``,
    then a vision-language model's ``key_mapping`` (the first pattern that matches:
    ``_compat.hf_key_mapping``), then ``base_model_prefix`` added or removed where that names a model key."""

    def __init__(self, model: nn.Module, model_keys: Sequence[str]) -> None:
        self._fix = type(model)._fix_state_dict_key_on_load  # type: ignore[attr-defined]  # a staticmethod
        self._mapping = [(re.compile(p), r) for p, r in (_compat.hf_key_mapping(model) or {}).items()]
        self._prefix = getattr(model, "base_model_prefix", None) or None
        self._model_keys = frozenset(model_keys)

    def match(self, key: str) -> ConversionMatch | None:
        renamed = str(self._fix(key)[0])
        for pattern, replacement in self._mapping:
            renamed, replaced = pattern.subn(replacement, renamed)
            if replaced:
                break
        if renamed not in self._model_keys and self._prefix is not None:
            head = f"{self._prefix}."
            if renamed.startswith(head) and renamed[len(head) :] in self._model_keys:
                renamed = renamed[len(head) :]
            elif head + renamed in self._model_keys:
                renamed = head + renamed
        return ConversionMatch(renamed, None, 0, 1, "transformers renaming") if renamed != key else None


def original_format_reversal(model: nn.Module, adapters: frozenset[str]) -> Reversal | None:
    """(rank 0) ``save_sharded(original_format=True)``'s saved names: what ``save_pretrained`` reverts
    for a transformers model (:class:`TransformersReversal`; transformers 4.57 reverts only a
    vision-language model's ``key_mapping``); for a ``PeftModel``, ``adapters`` (its adapter tensors'
    names) under its own names, every other tensor under its base model's (``_peft.base_key``), then
    the base's reversal; None for any other model (its own names)."""
    base = _compat.peft_base_model(model)
    reversal: Reversal | None = None
    if _compat.is_transformers_model(base) and _compat.transformers_5():
        reversal = TransformersReversal(base)
    elif _compat.is_transformers_model(base):
        reversal = _key_mapping_reversal(_compat.hf_key_mapping(base))
    if base is model:
        return reversal

    def peft_reversal(name: str, shape: tuple[int, ...]) -> list[Reverted]:
        if name in adapters:
            return [Reverted(name, shape)]
        base_name = _peft.base_key(name)
        return reversal(base_name, shape) if reversal is not None else [Reverted(base_name, shape)]

    return peft_reversal


def _key_mapping_reversal(mapping: dict[str, str] | None) -> Reversal | None:
    """(rank 0) transformers 4.57's ``save_pretrained`` of a model with a ``key_mapping``
    (``_compat.hf_key_mapping``): each name renamed by the first reverted pattern that matches."""
    if not mapping:
        return None
    reverted = [(re.compile(r), re.sub(r"\(.*\)", "", p.lstrip("^"))) for p, r in mapping.items()]

    def revert(name: str, shape: tuple[int, ...]) -> list[Reverted]:
        for pattern, replacement in reverted:
            name, replaced = pattern.subn(replacement, name)
            if replaced:
                break
        return [Reverted(name, shape)]

    return revert


def record_used(conversions: Sequence[Any]) -> None:
    """(rank 0, after the load) :meth:`TransformersConversions.record_used` of the transformers ones."""
    for conversion in conversions:
        if isinstance(conversion, TransformersConversions):
            conversion.record_used()


def conversions_for(model: nn.Module, model_keys: Sequence[str], extra: Sequence[Any] = ()) -> list[Any]:
    """(all ranks, before sharding) The caller's conversions, then transformers' for a transformers
    model (for a ``PeftModel``'s transformers base, on the base names): conversions and renamings
    (transformers 5), or renamings alone (4.57)."""
    out = list(extra)
    base = _compat.peft_base_model(model)
    if _compat.is_transformers_model(base):
        keys = model_keys if base is model else [_peft.base_key(k) for k in model_keys]
        transformers = TransformersConversions if _compat.transformers_5() else TransformersRenamings
        out.append(transformers(base, keys))
    return out
