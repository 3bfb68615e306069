"""clip_grad_norm_: the global gradient norm, and clipping, for parameters on several meshes.

Each gradient joins a *bucket* named by the process groups it is sharded over: one per ``Shard`` /
``_StridedShard`` mesh dimension, named by its global ranks (``Replicate`` dimensions are not reduced
over; a plain or fully replicated tensor is local only). Each bucket's local ``sum |g|^p`` (``max``
for inf) is all-reduced over its groups, then added to (maxed with) the local-only part. Buckets and
schedule come from the parameters' placements, never from which gradients exist locally: a rank
with empty shards or no gradients reaches the same collectives with zeros.

(all ranks, the same parameters in the same order) ``clip_grad_norm_``; collectives: ``_total_norm``.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..integrations._compat import StridedShard, foreach_mul_, foreach_norm, foreach_supported, local_tensor


@dataclass(frozen=True)
class _Group:
    """One mesh dimension's process group, as seen from this rank."""

    ranks: tuple[int, ...]  # its global ranks, sorted: the same name on every member
    pg: dist.ProcessGroup  # the group the all-reduce runs on
    device: torch.device  # where its collectives run (the mesh's device type)


# the ranks of each group a bucket is sharded over -> (those groups, its local gradients); () local only
_Buckets = dict[tuple[tuple[int, ...], ...], tuple[tuple[_Group, ...], list[torch.Tensor]]]


def _shard_groups(mesh: DeviceMesh, placements: tuple[object, ...], what: str) -> tuple[_Group, ...]:
    """The groups a tensor with these placements must be summed over: one per ``Shard`` /
    ``_StridedShard`` mesh dimension of size > 1, in mesh-dimension order."""
    groups = []
    for dim, placement in enumerate(placements):
        if isinstance(placement, (Shard, StridedShard)):
            if mesh.size(dim) > 1:
                pg = mesh.get_group(dim)
                ranks = tuple(sorted(dist.get_process_group_ranks(pg)))
                groups.append(_Group(ranks, pg, torch.device(mesh.device_type)))
        elif type(placement) is not Replicate:
            hint = (
                " A Partial gradient is not yet reduced: redistribute it to Shard or Replicate "
                "(grad.redistribute(...)) first."
                if getattr(placement, "is_partial", lambda: False)()
                else ""
            )
            raise ValueError(
                f"clip_grad_norm_: {what} has placement {placement!r} on mesh dimension {dim}; only "
                f"Shard, _StridedShard and Replicate are supported.{hint}"
            )
    return tuple(groups)


def _local_power(
    grads: list[torch.Tensor], p: float, foreach: bool | None, device: torch.device
) -> torch.Tensor:
    """``sum |g|^p`` over ``grads`` (``max |g|`` for inf), a float64 scalar on ``device``; 0 for none.
    Per-tensor norms as torch's ``_get_total_norm`` takes them, in float32 at least."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():  # empty shards contribute 0, and inf has no identity for an empty tensor
            by_kind.setdefault((g.device, g.dtype), []).append(g)
    norms: list[torch.Tensor] = []
    for (dev, dtype), tensors in by_kind.items():
        acc = torch.promote_types(dtype, torch.float32)
        if _use_foreach(foreach, dev):
            norms.extend(foreach_norm(tensors, p, acc))
        else:
            norms.extend(torch.linalg.vector_norm(t, p, dtype=acc) for t in tensors)
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    stacked = torch.stack([n.to(device=device, dtype=torch.float64) for n in norms])
    return stacked.max() if math.isinf(p) else stacked.pow(p).sum()


def _use_foreach(foreach: bool | None, device: torch.device) -> bool:
    if foreach is None:
        return foreach_supported(device)
    if foreach and not foreach_supported(device):
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return foreach


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` in place by their global norm, as
    ``torch.nn.utils.clip_grad_norm_`` does on the unsharded model.

    Call it on every rank with the same parameters in the same order. Parameters may be plain
    (replicated) tensors or DTensors on meshes cut from one device mesh (FSDP2, HSDP, TP + FSDP2),
    frozen ones included; pipeline parallelism is not handled. One all-reduce per process group.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clipped.
        max_norm: the largest norm the gradients keep.
        norm_type: ``p`` of the p-norm (default 2), > 0, or ``inf`` (largest absolute entry).
        error_if_nonfinite: raise if the total norm is nan or inf (on every rank alike).
        foreach: use the fused ``_foreach`` kernels (None: where the device has them).

    Returns:
        The total norm of all gradients as one vector, a plain 0-d tensor (not a DTensor) on the
        first gradient's device, float32 (float64 if a parameter is float64), the same on every rank.

    Raises:
        ValueError: ``norm_type`` is not > 0; a gradient is ``Partial`` or lies on another mesh or
            placement than its parameter (raised on every rank before any collective).
        RuntimeError: ``error_if_nonfinite`` and the total norm is nan or inf; ``foreach=True`` on a
            device without ``_foreach`` kernels.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if isinstance(parameters, types.GeneratorType) and not params:
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=2)
    p = float(norm_type)
    if math.isnan(p) or p <= 0:
        raise ValueError(
            f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type!r}. norm_type=0 counts "
            "nonzero entries and negative orders are not norms: neither can bound a gradient."
        )
    if not params:
        return torch.tensor(0.0)

    buckets = _buckets(params)
    first = next((q.grad for q in params if q.grad is not None), params[0])
    device = local_tensor(first).device  # torch returns the norm on the first gradient's device
    dtype = torch.float64 if any(local_tensor(q).dtype == torch.float64 for q in params) else torch.float32
    total = _total_norm(buckets, p, foreach, device).to(dtype)

    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )
    _clip_([g for _, gs in buckets.values() for g in gs], max_norm, total, foreach)
    return total


def _buckets(params: list[torch.Tensor]) -> _Buckets:
    """Each parameter's local gradient in its bucket (by the ranks of the groups it is sharded over,
    in the order of its bucket's first parameter; the local-only bucket, ``()``, first); checked
    before any collective."""
    buckets: _Buckets = {(): ((), [])}
    seen: dict[tuple[DeviceMesh, tuple[object, ...]], tuple[_Group, ...]] = {}
    for i, param in enumerate(params):
        groups: tuple[_Group, ...] = ()
        if isinstance(param, DTensor):
            spec = (param.device_mesh, tuple(param.placements))
            if spec not in seen:
                seen[spec] = _shard_groups(*spec, what=f"parameter {i} {tuple(param.shape)}")
            groups = seen[spec]
            _check_grad(i, param, groups)
        elif isinstance(param.grad, DTensor):
            raise ValueError(
                f"clip_grad_norm_: parameter {i} is a plain tensor but its gradient is a DTensor"
            )
        grads = buckets.setdefault(tuple(g.ranks for g in groups), (groups, []))[1]
        if param.grad is not None:
            grads.append(local_tensor(param.grad))
    return buckets


def _total_norm(buckets: _Buckets, p: float, foreach: bool | None, device: torch.device) -> torch.Tensor:
    """(collective, all ranks) The total norm, float64 on ``device``: each bucket's local power
    reduced over each of its groups in turn, then summed (maxed). Stage ``s`` runs one all-reduce per
    distinct ``s``-th group, in first-parameter order, the same on every member, so ranks meet in
    every group in the same order and none deadlock."""
    inf = math.isinf(p)
    values = [_local_power(gs, p, foreach, device) for _, gs in buckets.values()]
    if inf:  # MAX need not propagate nan: a nan flag beside each max makes every rank end with nan alike
        values = [torch.stack([torch.where(v.isnan(), 0.0, v), v.isnan().to(v.dtype)]) for v in values]
    groups = [gs for gs, _ in buckets.values()]
    for stage in range(max((len(g) for g in groups), default=0)):
        schedule: dict[tuple[int, ...], tuple[_Group, list[int]]] = {}
        for b, bucket_groups in enumerate(groups):
            if stage < len(bucket_groups):
                group = bucket_groups[stage]
                schedule.setdefault(group.ranks, (group, []))[1].append(b)
        for group, members in schedule.values():
            home = values[members[0]].device
            packed = torch.stack([values[b] for b in members]).to(group.device)
            dist.all_reduce(packed, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group.pg)
            for j, b in enumerate(members):
                values[b] = packed[j].to(home)
    if inf:
        return torch.stack([torch.where(v[1] > 0, torch.nan, v[0]) for v in values]).max()
    return torch.stack(values).sum().pow(1.0 / p)


def _check_grad(i: int, param: DTensor, groups: tuple[_Group, ...]) -> None:
    """ValueError unless the gradient is sharded over the same groups as its parameter (buckets use those)."""
    grad = param.grad
    if grad is None:
        return
    if not isinstance(grad, DTensor):
        raise ValueError(f"clip_grad_norm_: parameter {i} is a DTensor but its gradient is a plain tensor")
    if grad.device_mesh == param.device_mesh and tuple(grad.placements) == tuple(param.placements):
        return
    grad_groups = _shard_groups(
        grad.device_mesh, tuple(grad.placements), what=f"the gradient of parameter {i}"
    )
    if tuple(g.ranks for g in grad_groups) != tuple(g.ranks for g in groups):
        raise ValueError(
            f"clip_grad_norm_: parameter {i} {tuple(param.shape)} has placements {param.placements} but "
            f"its gradient {grad.placements}: they must be sharded over the same mesh dimensions."
        )


def _clip_(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor, foreach: bool | None) -> None:
    """``grad *= min(max_norm / (total + 1e-6), 1)`` in place, as torch's ``_clip_grads_with_norm_``
    (no branch on the coefficient: no host sync on an accelerator)."""
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), tensors in by_kind.items():
        if _use_foreach(foreach, dev):
            foreach_mul_(tensors, coef.to(dev))
        else:
            for t in tensors:
                t.mul_(coef.to(dev))
