"""Untrusted JSON decoded, repeated keys found (rank 0 only; no collectives)."""

from __future__ import annotations

import json
from collections.abc import Callable

__all__ = ["RepeatedKeys", "mark_repeated_keys", "parse_json", "short_repr"]


def short_repr(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RepeatedKeys(dict[str, object]):
    """A JSON object in which some key occurs more than once (``twice`` lists them, in order)."""

    twice: tuple[str, ...] = ()


def mark_repeated_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json.loads``' ``object_pairs_hook``: the object, a :class:`RepeatedKeys` when a key repeats."""
    obj = dict(pairs)  # once per JSON object: the common case in C
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    twice = [key for key, _ in pairs if key in seen or seen.add(key)]  # type: ignore[func-returns-value]
    marked = RepeatedKeys(obj)
    marked.twice = tuple(twice)
    return marked


def parse_json(raw: bytes, what: str, fail: Callable[[str], Exception]) -> object:
    """Decode untrusted JSON; objects with a repeated key come back as :class:`RepeatedKeys`.

    Invalid UTF-8 or JSON, a number too long to convert, or nesting too deep for the parser raise
    ``fail(problem)``, where ``problem`` starts with ``what`` ("header", "index")."""
    try:
        text = raw.decode("utf-8")
        del raw  # the caller's reference may be the last other one (see _index._read_map)
        found = json.loads(text)
        # Each key is followed by one ':', as is each ':' in a string: if the top two levels' keys
        # equal the colons, no key repeats; otherwise parse again with the slower hook.
        if _keys_two_deep(found) != text.count(":"):
            found = json.loads(text, object_pairs_hook=mark_repeated_keys)
        return found
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        problem = f"{what} is not valid JSON ({exc})"
    except ValueError as exc:  # int("9" * 5000): Python's integer-string conversion limit
        problem = f"{what} holds a number too long to parse ({short_repr(str(exc), 90)})"
    except RecursionError:
        problem = f"{what} is nested too deeply to parse"
    raise fail(problem)


def _keys_two_deep(found: object) -> int:
    """The keys of ``found`` (a dict) and of the dicts among its values (-1: ``found`` is no dict)."""
    if type(found) is not dict:
        return -1
    return len(found) + sum(len(v) for v in found.values() if type(v) is dict)
