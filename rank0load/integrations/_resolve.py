"""Which model key each checkpoint key loads into, decided once per key *pattern*: :class:`KeyResolver`.

(rank 0, or one process for ``inspect``; no collectives)
"""

from __future__ import annotations

import itertools
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from ._convert import Conversion, ConversionMatch

_NUMBER = re.compile(r"(?<![^.])(\d+)(?![^.])")  # a number that is a whole dotted segment
_DOTTED_NUMBER = re.compile(r"\.(\d+)(?=\.)")  # the same, in keys each written as "." + key + "."


def _numbers_blanked(keys: list[str]) -> Iterator[str]:
    """Each key's pattern (whole-segment numbers replaced by NUL), for keys without newlines or NULs."""
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
    """What a conversion did to one key pattern, read off one of its keys."""

    first: tuple[str, ...]  # the numbers of the key the rule was read from
    pieces: tuple[str, ...]  # the target split around its numbers: text, number, text, ...
    slots: tuple[int | None, ...]  # for each number of the target, the key's slot it copies; None: literal
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
        return ConversionMatch("".join(out), expert, m.source, m.sources, m.rule, m.unsupported, m.split)


class KeyResolver:
    """(rank 0) A checkpoint key -> its canonical model key and, when the model lacks the key, the
    conversion that places it. A pattern's keys differ only in their numbers, so the rule read off
    one key (which numbers the target copies, which is the expert index) is trusted once it
    predicted every key exactly until each number took a second value. A pattern whose rule
    mispredicts, or whose numbers repeat within a key, is computed key by key; a predicted target
    must still be a model key."""

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
        trusted = rule is not None and len(rule.varied) == len(rule.first)
        predicted = rule.predict(numbers) if rule is not None else None
        if trusted and (predicted is None or self._canonical(predicted.target) == predicted.target):
            return (predicted.target if predicted else None), predicted
        found = self._convert(key)  # no rule, one not trusted yet, or a trusted one's target not a model key
        if rule is None:
            unread = pattern not in self._rules
            if unread and len(set(numbers)) == len(numbers):  # else: read it off a later key
                self._rules[pattern] = _rule_of(numbers, found)
        elif not trusted:  # the rule confirmed, or given up
            if found == predicted:
                rule.varied.update(i for i, (a, b) in enumerate(zip(numbers, rule.first)) if a != b)
            else:
                self._rules[pattern] = None
        return (found.target if found else None), found

    def resolve_columns(self, keys: Sequence[str]) -> tuple[list[str | None], list[ConversionMatch | None]]:
        """``[self(key) for key in keys]`` computed in bulk, as two columns (canonical keys, conversions); a pattern's keys
        go one by one until its rule is trusted, the rest are predicted together."""
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
            if rule is None or at == len(members):  # nothing left: every key went one by one
                continue
            for i, predicted in zip(members[at:], self._predict_all(rule, [keys[i] for i in members[at:]])):
                canonical[i], converted[i] = (predicted.target if predicted else None), predicted
        return canonical, converted

    def _trusted(self, pattern: str) -> bool:
        rule = self._rules.get(pattern)
        return rule is not None and len(rule.varied) == len(rule.first)

    def _predict_all(self, rule: _Rule, keys: list[str]) -> list[ConversionMatch | None]:
        """A trusted ``rule``'s answers for ``keys`` (all of its pattern), as :meth:`__call__` gives them."""
        if rule.match is None or not keys:
            return [None] * len(keys)
        rows = list(_numbers_of(keys, len(rule.first)))
        copied = tuple(slot for slot in rule.slots if slot is not None)
        # the numbers a target copies, for each key: () when it copies none
        which = list(map(operator.itemgetter(*copied), rows)) if copied else [()] * len(rows)
        if len(copied) == 1:
            which = [(w,) for w in which]
        targets: dict[tuple[str, ...], str | None] = {}
        for numbers, row in dict(zip(which, rows)).items():  # each distinct target once
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
            target_of, experts, *map(itertools.repeat, (m.source, m.sources, m.rule, m.unsupported, m.split))
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
    """The rule ``found`` follows for a key with ``numbers`` (all different), or None if unreadable."""
    if found is None:
        return _Rule(tuple(numbers), (), (), None, None, set())
    if found.split:  # several targets: each key computed alone (one per layer)
        return None
    joined = _NUMBER.split(found.target)  # text, number, text, ...
    values = joined[1::2]
    slots = tuple(numbers.index(v) if v in numbers else None for v in values)
    expert = None
    if found.expert is not None:
        if str(found.expert) not in numbers:
            return None
        expert = numbers.index(str(found.expert))
    return _Rule(tuple(numbers), tuple(joined), slots, expert, found, set())
