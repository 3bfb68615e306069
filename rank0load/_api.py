"""``load_sharded``: the pipeline, one step per line, each step one call into the module that owns it.

all ranks  build model_fn() on meta (rank 0's random state), shard, allocate -> _model
rank 0     resolve the checkpoint, open its files         -> _manifest.open_checkpoint
all ranks  agree: same model, same options, or all raise  -> _distribute.agree
rank 0     read, match and validate the headers; offer its descriptors -> _manifest.read_manifest, _handover
all ranks  rank 0's manifest and offer, or its error      -> _distribute.from_rank0
all ranks  init what's missing, adapters, staging, plan; any rank's failure raised everywhere
                                                          -> _distribute.run (_model, _plan)
all ranks  agree on local readers, stream, re-tie, report -> _handover, _transfer, _model.finish, _report
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .checkpoint._manifest import (
    Checkpoint,
    Manifest,
    adapters_of,
    open_checkpoint,
    read_manifest,
    unforeseen,
)
from .common import _distribute
from .common._memory import trim_heap
from .common._report import Clock, LoadReport, fsdp_plan, log_summary, peak_rss_bytes, progress_bar
from .common._staging import DEFAULT_STAGING_BYTES, MIN_STAGING_BYTES, slot_bytes
from .errors import LoadError
from .integrations._convert import StackExperts, record_used
from .load import _handover, _model, _sink, _transfer
from .load._plan import Plan, build_plan
from .model._layout import rank_coordinates
from .model._shard import replicated_parameters
from .train._replicas import keep_in_step

# from this many checkpoint tensors on, the manifest leaves enough memory to be worth malloc_trim's heap walk
_TRIM_FROM_TENSORS = 10_000
# max_staging_bytes' default on an accelerator mesh (DEFAULT_STAGING_BYTES on a CPU one): rank 0
# stages in pinned host memory and copies to the device, and more staging keeps its readers ahead
ACCELERATOR_STAGING_BYTES = 256 << 20


def load_sharded(
    model_fn: Callable[[], nn.Module],
    ckpt_path: str | os.PathLike[str],
    mesh: DeviceMesh | None = None,
    *,
    shard_fn: Callable[[nn.Module, DeviceMesh], object] | None = None,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    key_map: Callable[[str], str | None] | None = None,
    revision: str | None = None,
    max_staging_bytes: int | None = None,
    conversions: Sequence[StackExperts] = (),
    local_reads: bool = True,
    readers: str = "rank0",
    adapter: str | os.PathLike[str] | dict[str, str | os.PathLike[str]] | None = None,
) -> nn.Module:
    """Build ``model_fn()`` sharded with FSDP2 over ``mesh`` and load a safetensors checkpoint into it.

    Every rank calls this with the same arguments; only rank 0 reads the checkpoint, and each rank
    receives just its own shard.

    Args:
        model_fn: zero-argument callable returning the model; called on every rank with
            parameters created on meta (their initialisers cost nothing) and buffers created for real.
        ckpt_path: a directory (``model.safetensors`` or ``*.safetensors.index.json``), a
            ``.safetensors`` file, an index ``.json``, or a Hugging Face Hub repo id. Read on rank 0 only.
        mesh: the device mesh. ``None``: a 1-D mesh over the world on ``cuda`` if available, else ``cpu``.
        shard_fn: ``shard_fn(model, mesh)`` applies the caller's own ``fully_shard`` / parallelisation.
            ``None``: :func:`default_shard_fn`.
        dtype: ``None`` keeps the dtypes ``model_fn`` gave; a floating dtype casts the model's floating
            tensors to it (like ``model.to(dtype)``) before sharding.
        strict: raise on missing or unexpected keys. ``False``: skip unexpected keys and give missing
            parameters the model's own initialisation (``reset_parameters`` / ``_init_weights``).
        key_map: maps a checkpoint key to a model key, or to ``None`` to drop it (used on rank 0).
        revision: the Hub revision, when ``ckpt_path`` is a repo id (used on rank 0).
        max_staging_bytes: host RAM the loader may use for staging on each rank (on an accelerator
            mesh: rank 0's pinned host slots, the other ranks' device slots). ``None``:
            ``DEFAULT_STAGING_BYTES`` (16 MiB) on a CPU mesh, 256 MiB on an accelerator mesh.
        conversions: checkpoint tensors assembled into model tensors (:class:`StackExperts`), tried
            for keys the model lacks, before transformers' own (applied automatically to its models).
        local_reads: ranks on rank 0's host read their own bytes through the files rank 0 opened
            (handed over a Unix socket) instead of receiving them; ``False``: rank 0 sends them, and
            no rank but 0 reads the checkpoint (``readers`` must then be ``"rank0"``).
        readers: ``"rank0"``: only rank 0's host opens the checkpoint; rank 0 sends the other hosts'
            ranks their bytes (one reader: for filesystems where one client should read).
            ``"host"``: the first rank of every other host checks, before any data moves, that the
            same path there holds rank 0's files (size, header and sampled bytes: no full hash);
            each host that does reads for its own ranks as rank 0's host does, and rank 0 sends
            those ranks only the tensors every rank gets whole. A host whose copy differs, or lacks a
            file, takes the stream (``LoadReport.host_readers`` and ``local_status`` say which and why).
        adapter: a PEFT adapter folder (as PEFT's ``save_pretrained`` or ``save_sharded(...,
            adapter=)`` writes it) or Hub repo id, loaded into the ``PeftModel``'s active adapter
            with ``ckpt_path`` in one load, read on rank 0 only; or a dict of adapter name -> folder.

    A ``PeftModel`` built in ``model_fn`` loads its base model's checkpoint as it is. Its adapters are
    drawn from rank 0's random state on every rank; those the checkpoint lacks keep those values
    (``LoadReport.kept``), also with ``strict=True``. Call ``get_peft_model`` inside ``model_fn``:
    on the returned model it adds unsharded adapters that differ between ranks.

    Returns:
        The sharded model, its parameters DTensors on the mesh device, ready for training.
        ``model.rank0load_report`` holds a :class:`LoadReport`.

    Raises:
        LoadError: on every rank, with the same message, for any problem with the checkpoint,
            the model, the arguments or the ranks' agreement, and for a failure on any rank during
            the transfer. Subclasses: ``CheckpointNotFoundError``, ``CheckpointFormatError``,
            ``CheckpointChangedError``, ``ModelMismatchError``, ``RankMismatchError``.
    """
    _distribute.require_process_group()
    clock, rank = Clock(), dist.get_rank()
    if mesh is None:
        mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))
    if max_staging_bytes is None:
        max_staging_bytes = DEFAULT_STAGING_BYTES if mesh.device_type == "cpu" else ACCELERATOR_STAGING_BYTES
    options = {
        "strict": strict,
        "dtype": dtype,
        "max_staging_bytes": max_staging_bytes,
        "local_reads": local_reads,
        "readers": readers,
    }
    mesh_device = _distribute.mesh_device(mesh.device_type)
    rng = _distribute.rank0_rng_state(mesh_device)  # PEFT's draws
    building = _distribute.attempt(lambda: _build(model_fn, mesh, shard_fn, options, conversions, rng))
    clock("build")
    with contextlib.ExitStack() as opened:  # rank 0's checkpoint files, open until the stream ends
        if gc.isenabled():  # the cyclic collector off inside: many small containers, no cycles
            gc.disable()
            opened.callback(gc.enable)  # left off if the caller turned it off
        # the shards allocated, a thread faulting them in; a failure is raised by agree or the stream
        allocating = _distribute.attempt(lambda: _model.materialise(building.get()[0].model, mesh_device))
        if allocating.value is not None:
            opened.callback(allocating.value.close)
        clock("allocate")
        # rank 0 opens the checkpoint while slower ranks build; a failure is raised with the manifest's
        checkpoint = _distribute.Outcome[Checkpoint]()
        if rank == 0 and building.error is None:
            checkpoint = _distribute.attempt(
                lambda: open_checkpoint(
                    ckpt_path,
                    revision,
                    opened,
                    lambda: adapters_of(building.get()[0].model, adapter) if adapter is not None else (),
                )
            )
        clock("headers")
        built, flags = _distribute.agree(building)
        clock("agree")
        agreed = dict(zip(built.flags, flags))

        def targets(manifest: Manifest) -> tuple[list[torch.Tensor], list[int]]:  # shards resident
            allocating.get().wait()
            _model.init_missing(built.model, built.layout, manifest.missing)
            _model.apply_built(built.model, built.real_values, manifest.kept)
            found = _model.targets(built.model, built.layout)
            return [found[e.key] for e in manifest.entries], [agreed[e.key] for e in manifest.entries]

        manifest, plan, handover = stream_checkpoint(
            opened,
            checkpoint,
            ckpt_path,
            lambda c: read_manifest(c, built.layout, strict, key_map, built.conversions),
            targets,
            mesh,
            max_staging_bytes,
            local_reads,
            clock,
            readers,
        )
    return _finished(built, manifest, plan, clock, handover, mesh)


def _finished(
    built: _model.Built,
    manifest: Manifest,
    plan: Plan,
    clock: Clock,
    local: _handover.LocalReads,
    mesh: DeviceMesh,
) -> nn.Module:
    """(all ranks) Ties restored, nothing left on meta; the gradients of the parameters FSDP leaves
    out averaged over ``mesh`` after each backward; the report attached and summarised."""
    _model.finish(built.model, built.layout)
    if dist.get_rank() == 0:  # what a save of the model reverts, as from_pretrained keeps it
        record_used(built.conversions)
    replicated = replicated_parameters(built.model)
    if replicated:
        keep_in_step(built.model, replicated, mesh)
    clock("finish")
    whole = plan.broadcast_whole
    report = LoadReport(
        tensors=len(manifest.entries),
        bytes=manifest.total_bytes,
        seconds=time.perf_counter() - clock.started,
        stream_seconds=clock.phases.get("stream", 0.0),
        missing=manifest.missing,
        kept=manifest.kept,
        initialised_fraction=manifest.initialised[0] / max(1, manifest.initialised[1]),
        unexpected=manifest.unexpected,
        ignored=manifest.ignored,
        broadcast_whole=tuple(whole),
        kinds={e.key: k.value for e, k in zip(plan.entries, plan.kinds)},
        assembled=(
            sum(len(e.parts) for e in manifest.entries if e.parts),
            sum(1 for e in manifest.entries if e.parts),
        ),
        dequantised=sum(1 for e in manifest.entries if e.scales),
        files=manifest.files,
        phases=clock.phases,
        peak_rss_bytes=peak_rss_bytes(),
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        manifest_runs=manifest.runs,
        local_read=local.files is not None,
        local_readers=tuple(sorted(local.readers)),
        local_status=local.status,
        host_readers=tuple(sorted(local.hosts)),
        network_bytes=local.network_bytes,
        fsdp_groups=fsdp_plan(built.model),
        replicated=tuple(n for n, _ in replicated),
    )
    built.model.rank0load_report = report  # type: ignore[assignment]
    if dist.get_rank() == 0:
        log_summary(report, whole)
    return built.model


def _build(
    model_fn: Callable[[], nn.Module],
    mesh: DeviceMesh,
    shard_fn: Callable[[nn.Module, DeviceMesh], object] | None,
    options: dict[str, Any],
    conversions: Sequence[StackExperts],
    rng_state: torch.Tensor | None,
) -> tuple[_model.Built, _distribute.Proposal]:
    """(all ranks) Check the arguments that would fail later and the mesh, with no collective (it must
    span every rank, with global rank 0 at its origin; raises LoadError); then build and shard, and make
    this rank's proposal."""
    local_reads = options["local_reads"]
    max_staging_bytes = options["max_staging_bytes"]
    dtype = options["dtype"]
    if not isinstance(local_reads, bool):
        raise LoadError(
            f"local_reads={local_reads!r} is not a bool (True: ranks on rank 0's host read their own bytes)"
        )
    if options["readers"] not in ("rank0", "host"):
        raise LoadError(
            f"readers={options['readers']!r} is not 'rank0' (rank 0's host reads the checkpoint) or "
            "'host' (every host that holds identical files reads for its own ranks)"
        )
    if options["readers"] == "host" and not local_reads:
        raise LoadError(
            "readers='host' has each host lend its open files to its ranks, which local_reads=False "
            "turns off: pass readers='rank0' with local_reads=False, or local_reads=True"
        )
    if isinstance(max_staging_bytes, bool) or not isinstance(max_staging_bytes, int):
        raise LoadError(f"max_staging_bytes={max_staging_bytes!r} is not an int (bytes)")
    if max_staging_bytes < MIN_STAGING_BYTES:
        raise LoadError(
            f"max_staging_bytes={max_staging_bytes} is too small: use at least {MIN_STAGING_BYTES} bytes "
            f"(the default, {DEFAULT_STAGING_BYTES >> 20} MiB, keeps the stream fast)"
        )
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise LoadError(f"dtype={dtype} is not a floating torch.dtype; integer tensors are never cast")
    world_size = dist.get_world_size()
    ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    if ranks != list(range(world_size)):
        raise LoadError(
            f"the mesh spans ranks {ranks[:8]}{'...' if len(ranks) > 8 else ''} but the world has "
            f"{world_size} ranks: load_sharded needs a mesh over every rank"
        )
    coord = dict(rank_coordinates(mesh))[0]
    if any(coord):
        raise LoadError(f"global rank 0 sits at mesh coordinate {coord}; rank0load needs it at the origin")
    built = _model.build_sharded(model_fn, mesh, shard_fn, dtype, conversions, rng_state)
    options["mesh"] = (tuple(mesh.shape), mesh.mesh_dim_names)
    return built, _distribute.Proposal(built.layout.fingerprint(), options, tuple(built.flags.values()))


def stream_checkpoint(
    opened: contextlib.ExitStack,
    checkpoint: _distribute.Outcome[Checkpoint],
    ckpt_path: str | os.PathLike[str],
    match: Callable[[Checkpoint], Manifest],
    targets: Callable[[Manifest], tuple[list[torch.Tensor], list[int]]],
    mesh: DeviceMesh,
    max_staging_bytes: int,
    local_reads: bool,
    clock: Clock,
    readers: str = "rank0",
) -> tuple[Manifest, Plan, _handover.LocalReads]:
    """(all ranks, once they agreed on what they load into) The stream of a load, after the build:
    rank 0 reads and ``match``es the headers of its open ``checkpoint`` (its manifest, or its error,
    on every rank) and offers its descriptors; every rank gets the ``targets`` of the manifest's
    entries (and their layout flags, AND-ed over the ranks), plans and streams. ``opened`` closes
    what the load opens; ``readers`` as ``load_sharded``'s (agreed). Raises LoadError on every rank."""
    rank = dist.get_rank()
    mesh_device = _distribute.mesh_device(mesh.device_type)
    server: _handover.Server | None = None  # rank 0's, when it offers its descriptors

    def manifest_and_offer() -> tuple[Manifest, _handover.Offer | None]:  # rank 0
        nonlocal server
        opened_checkpoint = checkpoint.get()
        manifest = match(opened_checkpoint)
        if local_reads and dist.get_world_size() > 1:  # a server lending the files to this host
            lent = [opened_checkpoint.files[p] for p in manifest.files]
            server = _handover.Server.listen(lent, digests=readers == "host")
        if server is None:
            return manifest, None
        opened.callback(server.close)
        return manifest, server.offer

    manifest, offer = _distribute.from_rank0(
        manifest_and_offer, lambda exc: unforeseen(ckpt_path, exc, ours=True)
    )
    files = checkpoint.value.files if checkpoint.value is not None else {}  # what the stream reads
    if sum(len(e.parts) or 1 for e in manifest.entries) >= _TRIM_FROM_TENSORS:
        trim_heap()  # what making and sharing a MoE manifest used, back to the OS
    clock("manifest")
    # a local reader's pinned host buffer: one staging slot (no piece is larger)
    slot = slot_bytes(max_staging_bytes)
    handover = _handover.hand_over(offer, server, manifest.files, mesh_device, slot, local_reads, readers)
    opened.callback(handover.close)

    def prepare() -> tuple[Plan, _sink.Sink, _sink.Staging]:
        found, flags = targets(manifest)
        plan = build_plan(manifest.entries, found, flags, mesh, slot)
        staging = _sink.allocate_staging(plan.piece_bytes, mesh_device, max_staging_bytes)
        return plan, _sink.Sink(plan, found, mesh_device), staging

    plan, sink, staging = _distribute.run(
        prepare, "allocating or initialising the model", _distribute.NO_DATA_MOVED
    )
    handover.decide()
    clock("plan")
    with progress_bar(manifest.total_bytes, show=rank == 0) as on_bytes:
        _transfer.stream(sink, staging, files, on_bytes, handover)
    clock("stream")
    return manifest, plan, handover
