"""Which model key each checkpoint key loads into (rank 0, or one process for ``inspect``; no
collectives): the one matcher, so a load and ``inspect`` agree."""

from __future__ import annotations

import os
from collections.abc import Callable, Set

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
    check_one_layout(stacked.keys(), by_model_key.keys())
    return KeyMatch(
        by_model_key={k: tuple(found) for k, found in by_model_key.items()},
        unexpected=tuple(sorted(unexpected)),
        ignored=tuple(sorted(ignored)),
        stacked={k: tuple(found) for k, found in stacked.items()},
        unsupported=unsupported,
    )


def check_one_layout(stacked: Set[str], whole: Set[str]) -> None:
    """Raise ModelMismatchError for model tensors both ``stacked`` (per expert) and ``whole``."""
    both = sorted(stacked & whole)
    if both:
        raise ModelMismatchError(
            f"{format_keys(both)} are stored both whole and per expert in the checkpoint; keep one "
            "layout (re-save it, or drop one set of keys with key_map)."
        )


def key_map_collision(first: str, second: str, model_key: str) -> str:
    """The error for ``key_map`` mapping checkpoint keys ``first`` and ``second`` to one model key."""
    return (
        f"key_map maps both {first!r} and {second!r} to model key {model_key!r}. Each model key may "
        "come from one checkpoint key only."
    )
