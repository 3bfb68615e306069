"""Match the checkpoint's headers to the model and produce the manifest (rank 0; no collectives).

(rank 0) :func:`build_manifest` takes all the checkpoint's headers at once, with those of the PEFT
adapters loaded with it (:func:`adapters_of`), maps checkpoint keys to model keys
(``_match.match_keys``), checks them, and returns a :class:`Manifest` (:func:`manifest_of`, which
``_runs`` shares): the ordered :class:`Entry` list every rank iterates while streaming. Any problem
raises a :class:`LoadError`, which ``_api`` broadcasts so every rank raises it too.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

from ..errors import CheckpointFormatError, LoadError, ModelMismatchError, format_keys
from ..integrations import _peft
from ..integrations._convert import Conversion
from ..model._meta import ModelLayout
from ._entries import Entry
from ._files import OpenFile
from ._fit import build_entries, quantised_keys, unconsumed
from ._format import TensorHeader
from ._fp8 import block_size as fp8_block_size
from ._headers import read_headers
from ._match import match_keys, nothing_matched
from ._source import Source, resolve

__all__ = ["Adapter", "Manifest", "adapters_of", "build_manifest", "manifest_of"]


@dataclass(frozen=True)
class Manifest:
    entries: tuple[Entry, ...]
    missing: tuple[str, ...] = ()  # canonical model keys absent from the checkpoint (strict=False)
    # canonical keys absent from the checkpoint that keep the values model_fn built (PEFT adapters)
    kept: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()  # checkpoint keys skipped (strict=False)
    ignored: tuple[str, ...] = ()  # checkpoint keys held by the model as non-persistent buffers
    files: tuple[str, ...] = field(default=())
    total_bytes: int = 0
    # (elements of the parameters initialised rather than loaded, elements of all parameters)
    initialised: tuple[int, int] = (0, 0)
    # runs of files whose headers were matched one run at a time (see _runs); 0: all at once
    runs: int = 0


@dataclass(frozen=True)
class Adapter:
    """(rank 0) A PEFT adapter folder to load with the base checkpoint: its resolved source, and the
    model key each of its file's names stands for (``_peft.adapter_names``, inverted)."""

    name: str
    source: Source
    model_keys: dict[str, str]


def adapters_of(model: nn.Module, adapter: object) -> list[Adapter]:
    """(rank 0) ``load_sharded(adapter=...)`` resolved: a PEFT adapter folder (or Hub repo id) for the
    model's active adapter, or a mapping of adapter name -> folder; each folder's
    ``adapter_config.json`` checked against the model's config of that adapter."""
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
        _peft.check_adapter_config(model, name, _peft.read_adapter_config(source.root), os.fspath(path))
        names = _peft.adapter_names(model, name)
        found.append(Adapter(name, source, {saved: key for key, saved in names.items()}))
    return found


def build_manifest(
    source: Source,
    layout: ModelLayout,
    *,
    strict: bool,
    key_map: Callable[[str], str | None] | None,
    files: dict[str, OpenFile] | None = None,
    conversions: Sequence[Conversion] = (),
    adapters: Sequence[Adapter] = (),
    headers: dict[str, TensorHeader] | None = None,
) -> Manifest:
    """(rank 0) Validate the checkpoint (and the ``adapters`` loaded with it) against the model and
    list what to move, in file order. ``files``: the files, opened once (see
    ``_read.open_checkpoint``). ``headers``: the source's headers, read already (there)."""
    if headers is None:
        headers = read_headers(source, files)
    headers, key_map = _with_adapters(headers, key_map, adapters, files)
    match = match_keys(headers, layout, key_map, conversions)
    quantised = quantised_keys(match, layout)
    missing, unexpected = match.missing, unconsumed(match, layout, quantised)
    description = " + ".join([source.description, *(a.source.description for a in adapters)])
    if layout.tensors and not match.by_model_key and not match.stacked:
        raise ModelMismatchError(nothing_matched(description, headers, layout, match))
    cannot = {k: v for k, v in match.unsupported.items() if k in missing}
    if cannot:
        target, (ckpt_key, rule, why) = sorted(cannot.items())[0]
        raise ModelMismatchError(
            f"{description}: model tensor {target!r} would come from checkpoint key {ckpt_key!r} "
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
            f"{description}: keys do not match the model; "
            + "; ".join(parts)
            + ". Pass key_map to rename keys, or strict=False to skip unexpected keys and "
            "initialise missing ones with the model's own initialisation."
        )
    uninitialisable = [k for k in missing if layout.tensors[k].is_param and k not in layout.initialisable]
    if uninitialisable:
        raise ModelMismatchError(
            f"{description}: missing parameters {format_keys(uninitialisable)} have no "
            "initialiser (their module has no reset_parameters() and no ancestor has _init_weights()), "
            "so strict=False would leave them uninitialised. Add them to the checkpoint or give the "
            "module a reset_parameters()."
        )

    block = fp8_block_size(source.root) if quantised else None
    entries = build_entries(match, layout, headers, block, quantised=quantised, files=files)
    every = [*source.files, *(f for a in adapters for f in a.source.files)]
    order = {path: i for i, path in enumerate(every)}
    entries.sort(key=lambda e: (order[e.file], e.offset))
    return manifest_of(entries, layout, missing, unexpected, match.ignored, match.kept, tuple(every))


def manifest_of(
    entries: list[Entry],
    layout: ModelLayout,
    missing: tuple[str, ...],
    unexpected: tuple[str, ...],
    ignored: tuple[str, ...],
    kept: tuple[str, ...],
    files: tuple[str, ...],
    runs: int = 0,
) -> Manifest:
    """(rank 0) The manifest of checked ``entries`` (in file order) and the keys' verdicts."""
    params = [t for t in layout.tensors.values() if t.is_param]
    return Manifest(
        entries=tuple(entries),
        missing=missing,
        unexpected=unexpected,
        ignored=ignored,
        files=files,
        total_bytes=sum(e.nbytes for e in entries),
        kept=kept,
        initialised=(
            sum(math.prod(layout.tensors[k].shape) for k in missing if layout.tensors[k].is_param),
            sum(math.prod(t.shape) for t in params),
        ),
        runs=runs,
    )


def _with_adapters(
    headers: dict[str, TensorHeader],
    key_map: Callable[[str], str | None] | None,
    adapters: Sequence[Adapter],
    files: dict[str, OpenFile] | None,
) -> tuple[dict[str, TensorHeader], Callable[[str], str | None] | None]:
    """The base checkpoint's headers with each adapter's added under the model keys PEFT's names
    stand for; key_map is then applied to the base checkpoint's keys only."""
    if not adapters:
        return headers, key_map
    merged, own = dict(headers), set()
    for adapter in adapters:
        for name, t in read_headers(adapter.source, files).items():
            key = adapter.model_keys.get(name, name)
            if key in merged:
                raise CheckpointFormatError(
                    f"{key!r} is stored both in {os.path.basename(merged[key].file)} and in adapter "
                    f"{adapter.source.description} ({name!r}); keep one copy."
                )
            merged[key] = t
            own.add(key)
    if key_map is None:
        return merged, None
    user_map = key_map
    return merged, lambda k: k if k in own else user_map(k)
