"""Which model key each checkpoint key loads into (rank 0, or one process for ``inspect``; no
collectives): the one matcher, so a load and ``inspect`` agree."""

from __future__ import annotations

import os
from collections.abc import Callable

from ..errors import ModelMismatchError, format_keys
from ..integrations._convert import ConversionMatch
from ..integrations._resolve import KeyResolver
from ..model._meta import ModelLayout
from ._fit import KeyMatch
from ._format import TensorHeader


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
                raise ModelMismatchError(key_map_collision(mapped_from[model_key], ckpt_key, model_key))
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
        elif converted is not None and converted.expert is not None:
            stacked.setdefault(canonical, []).append((converted, headers[ckpt_key]))
        else:
            by_model_key.setdefault(canonical, []).append(headers[ckpt_key])
    both = sorted(set(stacked) & set(by_model_key))
    if both:
        raise ModelMismatchError(both_layouts(both))
    return KeyMatch(
        by_model_key={k: tuple(found) for k, found in by_model_key.items()},
        unexpected=tuple(sorted(unexpected)),
        ignored=tuple(sorted(ignored)),
        stacked={k: tuple(found) for k, found in stacked.items()},
        unsupported=unsupported,
    )


def both_layouts(keys: list[str]) -> str:
    """The error for model tensors stored both whole and per expert."""
    return (
        f"{format_keys(keys)} are stored both whole and per expert in the checkpoint; keep one "
        "layout (re-save it, or drop one set of keys with key_map)."
    )


def key_map_collision(first: str, second: str, model_key: str) -> str:
    """The error for ``key_map`` mapping checkpoint keys ``first`` and ``second`` to one model key."""
    return (
        f"key_map maps both {first!r} and {second!r} to model key {model_key!r}. Each model key may "
        "come from one checkpoint key only."
    )


def nothing_matched(description: str, count: int, first: list[str], ignored: int, layout: ModelLayout) -> str:
    """The error for a load that would load nothing: a few names from each side, and a guess
    (``first``: the checkpoint's first 50 keys, sorted; ``ignored``: how many were dropped)."""
    model = sorted(k for k in layout.tensors if layout.tensors[k].is_param) or sorted(layout.tensors)
    hint = _prefix_hint(first, model)
    if not count:
        found = "The checkpoint holds no tensors."
    elif ignored == count:
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
