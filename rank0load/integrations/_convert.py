"""Checkpoint tensors that become a model tensor of another name or layout (rank 0 matches).

Hub MoE checkpoints store one tensor per expert (``experts.{e}.w1.weight`` [I, H]); transformers 5
models hold them fused (``experts.gate_up_proj`` [E, 2I, H]). A :class:`Conversion` says, for a
checkpoint key the model does not have, which model tensor it belongs to and where: the expert
index ``e`` (the leading dimension) and its place among the sources concatenated in each expert's
slice. Because each expert's slice is the sources one after the other in row-major order, the
fused tensor's bytes are the parts' bytes in (expert, source) order: the manifest describes it as
one entry made of parts (``_entries.Entry.parts``) and the stream moves it like any other tensor,
each byte once, straight into its owner's shard. No rank ever holds a fused parameter whole.

* :class:`StackExperts` — the public way to declare such a conversion for any model.
* :class:`TransformersConversions` — built from transformers' own conversion mapping for a
  transformers model (``conversion_mapping.get_model_conversion_mapping``; renamings and
  converters), before ``fully_shard`` renames its classes. Only ``MergeModulelist(dim=0)``,
  optionally followed by ``Concatenate(dim=1)``, can be assembled this way; a key that needs any
  other operation is reported with the converter's name (a ``ModelMismatchError`` when the model
  tensor has no other source), never skipped.

* :class:`TransformersReversal` — the other way, for ``save_sharded(original_format=True)``: a fused
  model tensor's saved names and shapes, from transformers' own reverse conversions (those
  ``save_pretrained`` applies), each a contiguous byte range of the fused tensor in row-major order.

(all ranks build the conversions before sharding; rank 0 alone matches keys, and builds the reversal
when saving; no collectives)
"""

from __future__ import annotations

import itertools
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from ..errors import SaveError
from . import _compat

__all__ = [
    "Conversion",
    "ConversionMatch",
    "KeyResolver",
    "StackExperts",
    "TransformersConversions",
    "TransformersReversal",
    "TransformersRenamings",
    "conversions_for",
    "transformers_conversions",
    "transformers_reversal",
]


class ConversionMatch(NamedTuple):
    """Where one checkpoint tensor goes. (A named tuple: one is made per converted checkpoint
    tensor, ~96,000 in a MoE checkpoint, several times cheaper than a frozen dataclass.)"""

    target: str  # model key
    expert: int | None  # index along the target's dimension 0; None: the whole target (a renaming)
    source: int  # position among the sources concatenated in each expert's slice
    sources: int  # how many sources each expert's slice concatenates
    rule: str  # the conversion, for messages
    unsupported: str | None = None  # why rank0load cannot assemble it, if it cannot


class Conversion(Protocol):
    def match(self, key: str) -> ConversionMatch | None:
        """Where checkpoint ``key`` goes, or None if this conversion does not apply to it."""


def _segment_regex(pattern: str) -> str:
    """``*`` is one dotted segment, captured; ``{e}`` is the expert index, captured as ``e``."""
    out = re.escape(pattern).replace(r"\*", r"([^.]+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return f"^{out}$"


@dataclass(frozen=True)
class StackExperts:
    """Per-expert checkpoint tensors stacked into one model parameter.

    ``target[e]`` is the concatenation, along their first dimension, of ``sources[0]`` for expert
    ``e``, ``sources[1]`` for expert ``e``, and so on (transformers' ``MergeModulelist(dim=0)`` then
    ``Concatenate(dim=1)``; with one source, plain stacking). In the patterns, ``{e}`` is the expert
    index and ``*`` one dotted name segment (a layer index), matched in order between each source
    and the target::

        StackExperts(
            target="layers.*.moe.experts.w13",
            sources=("layers.*.feed_forward.experts.{e}.w1.weight",
                     "layers.*.feed_forward.experts.{e}.w3.weight"),
        )

    Every expert ``0 .. E-1`` must be present exactly once per source (E: the target's first
    dimension), with shapes that concatenate to the target's.
    """

    target: str
    sources: tuple[str, ...]

    def __post_init__(self) -> None:
        if isinstance(self.sources, str):
            object.__setattr__(self, "sources", (self.sources,))
        for pattern in self.sources:
            if pattern.count("{e}") != 1:
                raise ValueError(
                    f"StackExperts source {pattern!r} needs exactly one '{{e}}' (the expert index)"
                )
            if pattern.count("*") != self.target.count("*"):
                raise ValueError(
                    f"StackExperts source {pattern!r} and target {self.target!r} need as many '*' each"
                )
        object.__setattr__(self, "_compiled", tuple(re.compile(_segment_regex(p)) for p in self.sources))

    def match(self, key: str) -> ConversionMatch | None:
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


_NUMBER = re.compile(r"(?<![^.])(\d+)(?![^.])")  # a number that is a whole dotted segment
_DOTTED_NUMBER = re.compile(r"\.(\d+)(?=\.)")  # the same, in keys each written as "." + key + "."


def _numbers_blanked(keys: list[str]) -> Iterator[str]:
    """Each key's pattern (as :class:`KeyResolver` keys its rules: every whole-segment number
    replaced by NUL), for keys without newlines or NULs: one regular-expression pass over them all,
    joined, each between dots (a literal dot lets the scan skip ahead, where ``_NUMBER``'s
    look-behind tests every character: 50 ms instead of 150 for 96,000 keys). A generator: one
    pattern string per key would be ~10 MiB for a MoE checkpoint, so they live a chunk at a time."""
    for at in range(0, len(keys), _KEYS_AT_ONCE):
        blanked = _DOTTED_NUMBER.sub(".\0", _dotted(keys[at : at + _KEYS_AT_ONCE]))
        yield from [line[1:-1] for line in blanked.split("\n")]


def _numbers_of(keys: list[str], width: int) -> Iterator[tuple[str, ...]]:
    """The ``width`` whole-segment numbers of each of ``keys`` (one pattern's), in key order."""
    for at in range(0, len(keys), _KEYS_AT_ONCE):
        chunk = keys[at : at + _KEYS_AT_ONCE]
        if not width:
            yield from [()] * len(chunk)
            continue
        flat = _DOTTED_NUMBER.findall(_dotted(chunk))
        yield from zip(*[iter(flat)] * width)


def _joined(keys: list[str]) -> Iterator[str]:
    """``keys`` concatenated, a chunk at a time (bounded temporaries)."""
    for at in range(0, len(keys), _KEYS_AT_ONCE):
        yield "".join(keys[at : at + _KEYS_AT_ONCE])


def _dotted(keys: list[str]) -> str:
    """``keys`` one a line, each between dots (what ``_DOTTED_NUMBER`` scans)."""
    return "." + ".\n.".join(keys) + "."


_KEYS_AT_ONCE = 8192


@dataclass
class _Rule:
    """What a conversion did to one key pattern: its target with each number slot of the pattern
    (``None``: a literal), the slot holding the expert index, and the match's other fields."""

    first: tuple[str, ...]  # the numbers of the key the rule was read from
    pieces: tuple[str, ...]  # the target split around its numbers: text, number, text, ...
    slots: tuple[int | None, ...]  # for each number of the target, the key's slot it copies
    expert: int | None  # the key's slot holding the expert index
    match: ConversionMatch | None
    varied: set[int]  # slots seen with another value than ``first``'s, every prediction confirmed

    def predict(self, numbers: list[str]) -> ConversionMatch | None:
        if self.match is None:
            return None
        out = list(self.pieces)
        for i, slot in enumerate(self.slots):
            if slot is not None:
                out[2 * i + 1] = numbers[slot]
        expert = int(numbers[self.expert]) if self.expert is not None else None
        m = self.match
        return ConversionMatch("".join(out), expert, m.source, m.sources, m.rule, m.unsupported)


class KeyResolver:
    """(rank 0) A checkpoint key -> its canonical model key and, when the model does not have the
    key itself, the conversion that places it, decided once per key *pattern*.

    MoE checkpoints repeat a few patterns (``layers.N.….experts.E.w1.weight``) tens of thousands of
    times, and a transformers conversion costs about a dozen regular-expression renamings per key.
    A pattern's keys differ only in their numbers, so the rule read from one key (which of its
    numbers the target copies, which one is the expert index) holds for the others. It is taken on
    trust only after it predicted every key of the pattern exactly until each of its numbers had
    taken a second value (within the first layer of a MoE checkpoint: a few hundred keys in all);
    a pattern whose rule mispredicts, or whose numbers repeat within a key (``layers.0.experts.0``),
    is computed key by key. A predicted target must still be a model key, or the key is computed.
    """

    def __init__(
        self,
        canonical: Callable[[str], str | None],
        conversions: Sequence[Conversion],
        canonical_all: Callable[[Sequence[str]], list[str | None]] | None = None,
    ) -> None:
        """``canonical_all``: ``canonical`` of many keys at once (``ModelLayout.canonical_all``)."""
        self._canonical, self._conversions = canonical, tuple(conversions)
        self._canonical_all = canonical_all or (lambda keys: list(map(canonical, keys)))
        self._rules: dict[str, _Rule | None] = {}  # None: computed key by key

    def __call__(self, key: str) -> tuple[str | None, ConversionMatch | None]:
        canonical = self._canonical(key)
        if canonical is not None or not self._conversions:
            return canonical, None
        pieces = _NUMBER.split(key)  # text, number, text, ...: one regex pass for both
        numbers, pattern = pieces[1::2], "\0".join(pieces[0::2])
        rule = self._rules.get(pattern)
        if rule is None:
            found = self._convert(key)
            unread = pattern not in self._rules
            if unread and len(set(numbers)) == len(numbers):  # else: read it off a later key
                self._rules[pattern] = _rule_of(numbers, found)
            return (found.target if found else None), found
        predicted = rule.predict(numbers)
        if len(rule.varied) == len(rule.first):  # trusted
            if predicted is None or self._canonical(predicted.target) == predicted.target:
                return (predicted.target if predicted else None), predicted
            found = self._convert(key)
            return (found.target if found else None), found
        found = self._convert(key)
        if found != predicted:
            self._rules[pattern] = None
        else:
            rule.varied.update(i for i, (a, b) in enumerate(zip(numbers, rule.first)) if a != b)
        return (found.target if found else None), found

    def resolve_all(self, keys: Sequence[str]) -> list[tuple[str | None, ConversionMatch | None]]:
        """``[self(key) for key in keys]``, the same answers at a fraction of the cost (see
        :meth:`resolve_columns`)."""
        return list(zip(*self.resolve_columns(keys)))

    def resolve_columns(self, keys: Sequence[str]) -> tuple[list[str | None], list[ConversionMatch | None]]:
        """:meth:`resolve_all`'s answers as two columns (each key's canonical model key, and its
        conversion), without a pair per key (~96,000 in a MoE checkpoint, 5 MiB under rank 0's peak).
        The keys the model lacks are grouped by pattern with one regular-expression pass over them
        all; a pattern's keys go one by one until its rule is trusted, the rest are predicted
        together (their numbers found in one pass, each distinct target checked once)."""
        canonical = self._canonical_all(keys)
        converted: list[ConversionMatch | None] = [None] * len(keys)
        if not self._conversions:
            return canonical, converted
        lacking = list(
            itertools.compress(range(len(keys)), map(operator.is_, canonical, itertools.repeat(None)))
        )
        if any("\n" in text or "\0" in text for text in _joined([keys[i] for i in lacking])):  # one by one
            for i in lacking:
                canonical[i], converted[i] = self(keys[i])
            return canonical, converted
        groups: dict[str, list[int]] = {}
        for i, pattern in zip(lacking, _numbers_blanked([keys[i] for i in lacking])):
            groups.setdefault(pattern, []).append(i)
        for pattern, members in groups.items():
            at = 0
            while at < len(members) and not self._trusted(pattern):
                canonical[members[at]], converted[members[at]] = self(keys[members[at]])
                at += 1
            rule = self._rules.get(pattern)
            if rule is None or not self._trusted(pattern):
                for i in members[at:]:
                    canonical[i], converted[i] = self(keys[i])
                continue
            for i, predicted in zip(members[at:], self._predict_all(rule, [keys[i] for i in members[at:]])):
                canonical[i], converted[i] = (predicted.target if predicted else None), predicted
        return canonical, converted

    def _trusted(self, pattern: str) -> bool:
        rule = self._rules.get(pattern)
        return rule is not None and len(rule.varied) == len(rule.first)

    def _predict_all(self, rule: _Rule, keys: list[str]) -> list[ConversionMatch | None]:
        """A trusted ``rule``'s answers for ``keys`` (all of its pattern), as :meth:`__call__` gives
        them: the predicted target must be a model key, else the key is converted by itself. Made
        column by column (each distinct target predicted and checked once), not key by key."""
        if rule.match is None or not keys:
            return [None] * len(keys)
        rows = list(_numbers_of(keys, len(rule.first)))
        copied = tuple(slot for slot in rule.slots if slot is not None)
        # the numbers a target copies, for each key: () when it copies none
        which = list(map(operator.itemgetter(*copied), rows)) if copied else [()] * len(rows)
        if len(copied) == 1:
            which = [(w,) for w in which]
        targets: dict[tuple[str, ...], str | None] = {}
        for numbers, row in dict(zip(which, rows)).items():  # a few hundred targets for ~96,000 keys
            predicted = rule.predict(list(row)).target  # type: ignore[union-attr]
            targets[numbers] = predicted if self._canonical(predicted) == predicted else None
        target_of = list(map(targets.__getitem__, which))
        experts: Iterable[int | None] = (
            map(int, map(operator.itemgetter(rule.expert), rows))
            if rule.expert is not None
            else itertools.repeat(None)
        )
        m = rule.match
        columns = zip(
            target_of, experts, *map(itertools.repeat, (m.source, m.sources, m.rule, m.unsupported))
        )
        # tuple.__new__ straight from the columns: the named tuple's own __new__ is a Python function
        out: list[ConversionMatch | None] = list(
            map(tuple.__new__, itertools.repeat(ConversionMatch), columns)
        )
        for i in (i for i, t in enumerate(target_of) if t is None):  # not a model key: converted alone
            out[i] = self._convert(keys[i])
        return out

    def _convert(self, key: str) -> ConversionMatch | None:
        """The first conversion that maps ``key`` onto a tensor of the model (target canonical)."""
        for conversion in self._conversions:
            found = conversion.match(key)
            target = self._canonical(found.target) if found is not None else None
            if found is not None and target is not None:
                return found._replace(target=target)
        return None


def _rule_of(numbers: list[str], found: ConversionMatch | None) -> _Rule | None:
    """The rule ``found`` follows for a key with ``numbers`` (all different), or None when it cannot
    be read off (an expert index that is none of its numbers)."""
    if found is None:
        return _Rule(tuple(numbers), (), (), None, None, set())
    joined = _NUMBER.split(found.target)  # text, number, text, ...
    values = joined[1::2]
    slots = tuple(numbers.index(v) if v in numbers else None for v in values)
    expert = None
    if found.expert is not None:
        if str(found.expert) not in numbers:
            return None
        expert = numbers.index(str(found.expert))
    return _Rule(tuple(numbers), tuple(joined), slots, expert, found, set())


_STACKABLE = ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])


class TransformersConversions:
    """transformers' own renamings and converters for ``model`` (see the module docstring)."""

    def __init__(self, model: nn.Module, model_keys: Sequence[str]) -> None:
        self._renamings, self._converters = _compat.hf_conversions(model)
        self._prefix = getattr(model, "base_model_prefix", None)
        self._model_keys = dict.fromkeys(model_keys, True)

    def match(self, key: str) -> ConversionMatch | None:
        renamed, pattern = _compat.hf_rename(
            key, self._renamings, self._converters, self._prefix, self._model_keys
        )
        if pattern is None:
            return ConversionMatch(renamed, None, 0, 1, "transformers renaming") if renamed != key else None
        converter = next(c for c in self._converters if pattern in c.source_patterns)
        name = f"{type(converter).__name__}({converter.source_patterns} -> {converter.target_patterns})"
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
        index, total = converter.source_patterns.index(pattern), len(converter.source_patterns)
        if ops not in _STACKABLE or len(converter.target_patterns) != 1:
            what = ", ".join(f"{n}(dim={d})" if d is not None else n for n, d in ops)
            return ConversionMatch(renamed, None, index, total, name, f"needs {what}")
        expert = self._expert(key, pattern)
        if expert is None:
            return ConversionMatch(renamed, None, index, total, name, "no expert index found in the key")
        return ConversionMatch(renamed, expert, index, total, name)

    def _expert(self, key: str, pattern: str) -> int | None:
        """The integer the pattern's ``*`` stands for in ``key`` (after the renamings)."""
        renamed = _compat.hf_rename(key, self._renamings, [], None, None)[0]
        # transformers' source patterns are regular expressions in which "*" is an index
        found = re.search(pattern.replace("*", r"(\d+)"), renamed)
        return int(found.group(1)) if found is not None and found.groups() else None


# the reverse of _STACKABLE: Chunk(dim=1) into the sources, then SplitModulelist(dim=0) into the experts
_SPLITTABLE = ([("SplitModulelist", 0)], [("Chunk", 1), ("SplitModulelist", 0)])


class TransformersReversal:
    """(rank 0) A model tensor's saved names and shapes with transformers' conversions reverted.

    The names come from transformers itself: the reverse converter runs on a stand-in of shape
    ``[E, S, 1, ...]`` whose values number the (expert, source) slices, so each name it produces
    says which slice it holds; the real slice ``v`` is bytes ``[v, v + 1) * numel / (E * S)`` of the
    fused tensor (Chunk along dim 1, then split along dim 0, keep each slice contiguous).
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._renamings, self._converters = _compat.hf_reverse_conversions(model)

    def __call__(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        renamed, converter, pattern = _compat.hf_revert_key(name, self._renamings, self._converters)
        if converter is None or pattern is None:
            return [(renamed, shape)]
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
        sources = len(converter.target_patterns)
        if ops not in _SPLITTABLE or len(shape) < 2 or shape[1] % sources or (sources > 1) != (len(ops) > 1):
            what = ", ".join(f"{n}(dim={d})" if d is not None else n for n, d in ops)
            raise SaveError(
                f"{name!r} {shape}: transformers reverts it with {what}, which rank0load cannot save as "
                "byte ranges of the model tensor. Save with original_format=False (the model's own names)."
            )
        slices = shape[0] * sources
        standin = torch.arange(slices).reshape(shape[0], sources, *[1] * (len(shape) - 2))
        out = _compat.hf_revert_tensor(
            converter, renamed, name, pattern, standin, self._model, self._renamings
        )
        order = {int(v.reshape(-1)[0]): n for n, v in out.items() if v.numel() == 1}
        if len(out) != slices or sorted(order) != list(range(slices)):
            raise SaveError(
                f"{name!r} {shape}: transformers' reverse conversion gave {len(out)} tensors, not the "
                f"{slices} per-expert slices expected. Save with original_format=False."
            )
        part = (shape[1] // sources, *shape[2:])
        return [(order[v], part) for v in range(slices)]


class TransformersRenamings:
    """transformers 4.x's key renamings for ``model`` (it has no conversions: its MoE models keep
    per-expert modules, as the Hub stores them): ``_fix_state_dict_key_on_load`` (LayerNorm
    ``gamma``/``beta``, weight-norm names), then the ``base_model_prefix`` added or removed where
    that names a model key (a base model's checkpoint into a model with a head, and back), as
    ``from_pretrained`` does."""

    def __init__(self, model: nn.Module, model_keys: Sequence[str]) -> None:
        self._model = model
        self._prefix = getattr(model, "base_model_prefix", None) or None
        self._model_keys = frozenset(model_keys)

    def match(self, key: str) -> ConversionMatch | None:
        renamed = _compat.hf_legacy_rename(self._model, key)
        if renamed not in self._model_keys and self._prefix is not None:
            head = f"{self._prefix}."
            if renamed.startswith(head) and renamed[len(head) :] in self._model_keys:
                renamed = renamed[len(head) :]
            elif head + renamed in self._model_keys:
                renamed = head + renamed
        return ConversionMatch(renamed, None, 0, 1, "transformers renaming") if renamed != key else None


def transformers_conversions(model: nn.Module, model_keys: Sequence[str]) -> Conversion:
    """transformers' own key rules for ``model``, for the installed version: conversions and renamings
    (transformers 5), or renamings alone (4.57)."""
    if _compat.hf_has_conversion_mapping():
        return TransformersConversions(model, model_keys)
    return TransformersRenamings(model, model_keys)


def transformers_reversal(model: nn.Module) -> TransformersReversal | None:
    """(rank 0) What ``save_pretrained`` reverts for ``model``: transformers 5's conversions; None for
    4.57, which saves a model's own names."""
    return TransformersReversal(model) if _compat.hf_has_conversion_mapping() else None


def conversions_for(model: nn.Module, model_keys: Sequence[str], extra: Sequence[Any] = ()) -> list[Any]:
    """(all ranks, before sharding) The caller's conversions, then transformers' for a transformers model."""
    out = list(extra)
    if _compat.is_transformers_model(model):
        out.append(transformers_conversions(model, model_keys))
    return out
