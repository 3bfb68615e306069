"""Replicated parameters kept in step: the gradients of the parameters FSDP leaves out (a full copy on
every rank: ``model._shard.replicated_parameters``) averaged over the data-parallel ranks at the end of
every backward, as FSDP2's reduce-scatter averages the rest.

(all ranks, at the load) :func:`keep_in_step` hooks every FSDP unit's forward. In a backward, the first
output gradient of any unit queues :meth:`_Replicas.sync` on the autograd engine, after the callback
FSDP2 queues from the same tensor (its hook was registered first), so every rank runs FSDP2's final
callback, then this one. Collectives, in ``sync``, on every rank alike: one all-reduce of a has-gradient
flag per parameter, then, if any rank has a gradient, one all-reduce per dtype of those gradients
(zeros where a rank has none), per mesh dimension. Nothing is issued without a backward (``no_grad``,
evaluation). Averaging is linear, so gradients accumulated over several backwards stay the average of
the sum (each backward communicates, ``set_requires_gradient_sync(False)`` or not).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from ..integrations._compat import backward_task_id, queue_backward_callback

logger = logging.getLogger(__name__)


class _Replicas:
    """The replicated parameters of one model and the mesh whose ranks each hold a copy."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], mesh: DeviceMesh) -> None:
        self.params = params
        self.mesh = mesh
        self.device = torch.device(mesh.device_type)
        self.queued_in: int | None = None  # the backward sync is queued in (None: none queued)

    def on_output_grad(self, grad: torch.Tensor) -> None:
        """(all ranks, in a backward) Queue :meth:`sync` once per backward."""
        task = backward_task_id()
        if self.queued_in is not None and (task is None or task == self.queued_in):
            return
        self.queued_in = -1 if task is None else task
        queue_backward_callback(self.sync)

    @torch.no_grad()
    def sync(self) -> None:
        """(all ranks, at the end of a backward) Each gradient becomes the sum of every rank's (zeros
        where a rank has none) over the mesh size; it stays None where no rank has one (an optimizer
        then skips it, as on one process)."""
        self.queued_in = None
        grads = [p.grad for _, p in self.params]
        flags = torch.tensor([g is not None for g in grads], dtype=torch.int32, device=self.device)
        self._all_reduce(flags)
        buckets: dict[torch.dtype, list[int]] = {}
        for i, (had, (_, p)) in enumerate(zip(flags.tolist(), self.params, strict=True)):
            if had:
                buckets.setdefault(p.dtype, []).append(i)
        for indices in buckets.values():  # dtypes in the agreed order of the parameters
            flat = torch.cat(
                [
                    torch.zeros(self.params[i][1].numel(), dtype=self.params[i][1].dtype, device=self.device)
                    if grads[i] is None
                    else grads[i].reshape(-1).to(self.device)  # type: ignore[union-attr]
                    for i in indices
                ]
            )
            self._all_reduce(flat)
            flat /= self.mesh.size()
            at = 0
            for i in indices:
                p = self.params[i][1]
                part = flat[at : at + p.numel()].view_as(p)
                at += p.numel()
                if p.grad is None:
                    p.grad = part.to(p.device).clone()
                else:
                    p.grad.copy_(part)

    def _all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over every rank of the mesh: over each dimension in turn (HSDP: shard, replicate)."""
        for dim in range(self.mesh.ndim):
            if self.mesh.size(dim) > 1:
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.mesh.get_group(dim))


def _grad_tensors(output: object, out: list[torch.Tensor], depth: int = 0) -> None:
    """The tensors requiring grad in a module's output (tensors, dicts and ModelOutputs, lists, tuples)."""
    if isinstance(output, torch.Tensor):
        if output.requires_grad:
            out.append(output)
    elif depth < 8 and isinstance(output, dict):
        for value in output.values():
            _grad_tensors(value, out, depth + 1)
    elif depth < 8 and isinstance(output, (list, tuple)):
        for value in output:
            _grad_tensors(value, out, depth + 1)


def keep_in_step(model: nn.Module, params: list[tuple[str, nn.Parameter]], mesh: DeviceMesh) -> None:
    """(all ranks, after sharding; ``params`` the same on every rank) Average the gradients of the
    replicated ``params`` over the ranks of ``mesh`` at the end of every backward through ``model``:
    a forward hook on each FSDP unit (the root first) puts a hook on its outputs' gradients. No
    collective here."""
    replicas = _Replicas(params, mesh)

    def hook(module: nn.Module, args: object, output: object) -> None:
        if not torch.is_grad_enabled():
            return
        tensors: list[torch.Tensor] = []
        _grad_tensors(output, tensors)
        for t in tensors:
            t.register_hook(replicas.on_output_grad)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.register_forward_hook(hook)
    logger.debug("%d replicated parameters averaged after each backward", len(params))
