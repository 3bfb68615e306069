"""What a checkpoint holds, and whether it fits a model, from the headers alone (one process; no
collectives). :func:`inspect_checkpoint` validates and matches as a load does, listing every problem
rather than the first; no tensor data is read.
"""

from __future__ import annotations

import datetime
import importlib
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..common._report import FSDPGroup, fsdp_plan
from ..errors import LoadError, ModelMismatchError
from ..integrations._convert import conversions_for
from ..integrations._resolve import KeyResolver
from ..model._meta import build_on_meta, describe
from ..model._shard import check_dtype_groups, default_shard_fn, replicated_parameters
from ._fit import build_entries, match_keys, quantised_keys, unconsumed
from ._format import TensorHeader
from ._fp8 import block_size as fp8_block_size
from ._source import Source, read_headers, resolve


@dataclass(frozen=True)
class FileSummary:
    name: str  # as the checkpoint names it (a Hub snapshot's file, not the blob it links to)
    path: str
    bytes: int  # file size on disk
    tensors: int


@dataclass(frozen=True)
class Inspection:
    """A checkpoint's contents and, when a model was given, how its keys fit that model (its fields,
    in order, are ``python -m rank0load inspect --json``'s keys)."""

    checkpoint: str  # the source's description
    files: tuple[FileSummary, ...]
    tensors: int
    total_bytes: int  # tensor data, the bytes a load moves
    dtypes: dict[str, tuple[int, int]]  # safetensors dtype -> (tensors, bytes)
    largest: TensorHeader | None
    model_checked: bool = False
    model_tensors: int = 0
    matched: int = 0  # model tensors the checkpoint holds (after key_map)
    missing: tuple[str, ...] = ()  # model keys the checkpoint lacks
    unexpected: tuple[str, ...] = ()  # checkpoint keys the model lacks
    converted: tuple[str, ...] = ()  # model tensors assembled from several tensors or dequantised
    mismatched: tuple[str, ...] = ()  # one message per key whose shape/dtype cannot load
    ignored: tuple[str, ...] = ()  # checkpoint keys key_map dropped or non-persistent in the model
    # tied parameters stored under several names ("a = b"): only a load compares their bytes
    tied_twice: tuple[str, ...] = ()
    # the default policy's FSDP groups (root first), as LoadReport.fsdp_groups; None: see fsdp_unlisted
    fsdp_groups: tuple[FSDPGroup, ...] | None = None
    fsdp_unlisted: str = ""
    # parameters the default policy keeps out of FSDP, replicated on every rank, as LoadReport.replicated
    replicated: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        """No missing, unexpected or mismatched keys (True when no model was checked); values unread."""
        return not (self.missing or self.unexpected or self.mismatched)


def load_factory(spec: str, option: str) -> Callable[..., Any]:
    """``"package.module:factory"`` (the attribute may be dotted) -> the callable. ``option``: the
    command-line option that named ``spec``, for messages.

    Raises:
        ValueError: ``spec`` is not ``MODULE:CALLABLE``.
        TypeError: the attribute is not callable.
        ImportError / AttributeError: the module or attribute does not exist.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{option} {spec!r}: expected MODULE:CALLABLE, e.g. 'mypkg.models:build_llama'")
    obj: object = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{option} {spec!r}: {attr} is a {type(obj).__name__}, not a callable")
    return obj  # type: ignore[return-value]


def inspect_checkpoint(
    ckpt_path: str | os.PathLike[str],
    *,
    revision: str | None = None,
    model_fn: Callable[[], nn.Module] | None = None,
    key_map: Callable[[str], str | None] | None = None,
    conversions: Sequence[Any] = (),
) -> Inspection:
    """Summarise a checkpoint and, with ``model_fn``, check its keys, shapes and dtypes against the model.

    Args:
        ckpt_path: directory, ``.safetensors`` file, index ``.json`` or Hub repo id.
        revision: Hub revision for a repo id.
        model_fn: zero-argument callable building the model; it runs with parameters on meta.
        key_map: checkpoint key -> model key, or None to drop the key; as ``load_sharded`` takes it.
            Read only with ``model_fn`` (the command line refuses ``--key-map`` without ``--model``).
        conversions: :class:`~rank0load.StackExperts` rules, as ``load_sharded`` takes them.

    With ``model_fn`` and no process group, the model is also sharded on meta in a one-rank gloo
    world made here, for ``Inspection.fsdp_groups`` (refusals listed in ``mismatched``).

    Returns:
        An :class:`Inspection`.

    Raises:
        LoadError: the checkpoint cannot be found or is malformed (``CheckpointNotFoundError``,
            ``CheckpointFormatError``).
        ModelMismatchError: ``key_map`` raised, returned neither a str nor None, or mapped two
            checkpoint keys to one model key (what ``load_sharded`` raises too).
        Exception: whatever ``model_fn`` raises.
    """
    source = resolve(ckpt_path, revision)
    headers = read_headers(source)
    summary = _summarise(source, headers)
    if model_fn is None:
        return summary
    model, built = build_on_meta(model_fn)
    layout = describe(model, built)
    keys = list(layout.tensors) + list(layout.aliases)
    resolver = KeyResolver(layout.canonical, conversions_for(model, keys, conversions), layout.canonical_all)
    match = match_keys(headers, layout, key_map, resolver)
    found = match.by_model_key.keys() | match.stacked.keys()  # kept ones aside, as a load keeps them
    missing = tuple(sorted(k for k in layout.tensors if k not in found and k not in layout.built))
    mismatched: list[str] = [
        f"model tensor {target!r} would come from {ckpt_key!r} through {rule}, which {why}"
        for target, (ckpt_key, rule, why) in sorted(match.unsupported.items())
        if target in missing
    ]
    quantised = quantised_keys(match, layout)
    block = fp8_block_size(source.root) if quantised else None
    entries = build_entries(match, layout, headers, block, errors=mismatched, quantised=quantised)
    groups, unlisted, refused = _fsdp_groups(model)
    if refused:
        mismatched.append(refused)
    converted = tuple(
        f"{e.key} <- {len(e.parts) or 1} tensors ({e.ckpt_key}, ...)"
        + (f", float8 dequantised in blocks of {list(e.block)}" if e.scales else "")
        for e in sorted(entries, key=lambda e: e.key)
        if e.parts or e.scales
    )
    return replace(
        summary,
        model_checked=True,
        model_tensors=len(layout.tensors),
        matched=len(found),
        missing=missing,
        unexpected=unconsumed(match.unexpected, quantised),
        mismatched=tuple(sorted(mismatched)),
        ignored=match.ignored,
        converted=converted,
        tied_twice=tuple(
            sorted(
                " = ".join(t.key for t in found) for found in match.by_model_key.values() if len(found) > 1
            )
        ),
        fsdp_groups=groups,
        fsdp_unlisted=unlisted,
        replicated=tuple(n for n, _ in replicated_parameters(model)),  # sharded in place, or none
    )


def _summarise(source: Source, headers: dict[str, TensorHeader]) -> Inspection:
    per_file = Counter(t.file for t in headers.values())
    dtypes: dict[str, tuple[int, int]] = {}
    for t in headers.values():
        count, nbytes = dtypes.get(t.dtype, (0, 0))
        dtypes[t.dtype] = (count + 1, nbytes + t.nbytes)
    try:  # real path -> name for the files of the root (Hub snapshots link their files to blobs)
        names = {os.path.realpath(os.path.join(source.root, n)): n for n in os.listdir(source.root)}
    except OSError:
        names = {}
    files = []
    for path in source.files:
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            raise LoadError(f"cannot stat {path!r}: {exc.strerror}") from None
        files.append(
            FileSummary(names.get(path, os.path.relpath(path, source.root)), path, size, per_file[path])
        )
    return Inspection(
        checkpoint=source.description,
        files=tuple(files),
        tensors=len(headers),
        total_bytes=sum(t.nbytes for t in headers.values()),
        dtypes=dict(sorted(dtypes.items())),
        largest=max(headers.values(), key=lambda t: t.nbytes, default=None),
    )


def _fsdp_groups(model: nn.Module) -> tuple[tuple[FSDPGroup, ...] | None, str, str]:
    """(groups, why not listed, the ModelMismatchError a load would raise) for the default policy on
    ``model`` (on meta; sharded in place); not listed when this process already has a process group."""
    if not dist.is_available() or dist.is_initialized():
        return None, "this process already has a process group", ""
    # fully_shard on meta issues no collectives, and the groups are the same at any world size
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        try:
            default_shard_fn(model, init_device_mesh("cpu", (1,)))
        except ModelMismatchError as exc:
            return None, "the default policy refused the model (see mismatched)", str(exc)
        try:
            check_dtype_groups(model)
        except ModelMismatchError as exc:
            return fsdp_plan(model), "", str(exc)
        return fsdp_plan(model), "", ""
    finally:
        dist.destroy_process_group()
