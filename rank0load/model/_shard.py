"""The default FSDP2 wrapping policy, and the check that no FSDP group mixes parameter dtypes.

(all ranks) :func:`default_shard_fn` applies ``fully_shard`` to the model's blocks, innermost first,
then to the root; inside each of them, every submodule whose parameters have another dtype than the
rest of its group (an fp32 router inside a bf16 decoder layer, a ``_keep_in_fp32_modules`` norm, an
fp32 head) first gets a ``fully_shard`` of its own, at any depth: the largest such submodule that
has a ``forward`` (a container without one, ``ModuleList`` or ``ModuleDict``, is looked into instead,
since FSDP's hooks run only on modules that are called).
(all ranks) :func:`check_dtype_groups`, after any policy (the caller's ``shard_fn`` too): a group that
holds trainable parameters of two dtypes is a :class:`~.errors.ModelMismatchError` before any data
moves, not FSDP's ``AssertionError`` at the first forward.
``fully_shard`` on a meta model issues no collectives.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Set as AbstractSet

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from ..errors import ModelMismatchError
from ..integrations._compat import fsdp_groups, no_split_modules

__all__ = ["check_dtype_groups", "default_shard_fn", "find_blocks"]

logger = logging.getLogger(__name__)


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules to shard one by one, innermost first.

    Modules whose class is named in ``model._no_split_modules`` (transformers' list of decoder /
    encoder layers); failing that, the children of the model's largest ``nn.ModuleList``.
    """
    names = no_split_modules(model)
    blocks = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if not blocks:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
        if lists:
            biggest = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
            blocks = [b for b in biggest if any(True for _ in b.parameters())]
    owners = _owners(model)
    blocks = [b for b in blocks if not _shares_outside(b, owners)]
    # Innermost first: fully_shard on a child must precede its parent.
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(blocks, key=lambda m: -order[id(m)])


def _owners(model: nn.Module) -> dict[int, set[int]]:
    """id(parameter) -> ids of the modules that register it (more than one for a tie)."""
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(id(module))
    return owners


def _shares_outside(
    block: nn.Module, owners: dict[int, set[int]], managed: AbstractSet[int] = frozenset()
) -> bool:
    """A block holding a parameter also used outside it (BERT's word embeddings tied to the
    decoder) cannot be its own FSDP group: the outside user would see the resharded parameter.
    Such blocks are left to the enclosing group. ``managed``: parameters already in a group of
    their own, left out (``fully_shard`` replaced them: ``owners`` predates them)."""
    inside = {id(m) for m in block.modules()}
    return any(not owners[id(p)] <= inside for p in block.parameters() if id(p) not in managed)


def _has_forward(module: nn.Module) -> bool:
    """Whether ``module`` defines ``forward``: only a module that is called can be an FSDP unit (its
    pre-forward hook all-gathers the parameters). Containers keep ``nn.Module``'s unimplemented one."""
    return type(module).forward is not nn.Module.forward


class _Policy:
    """One pass of the default policy: which parameters already have a group."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.managed: set[int] = set()
        self.owners = _owners(model)
        self.groups = 0

    def shard_unit(self, unit: nn.Module) -> None:
        """``fully_shard(unit)``, after giving each of its odd-dtype submodules a group of its own."""
        dtype = self._group_dtype(unit)
        if dtype is not None:
            self._isolate(unit, dtype)
        self._shard(unit)

    def _isolate(self, module: nn.Module, dtype: torch.dtype) -> None:
        """Give every submodule of ``module`` whose free parameters are not all ``dtype`` a group of
        its own (innermost first), so that what stays free below ``module`` is ``dtype`` alone."""
        for child in module.children():
            counts = self._counts(child)
            if not counts or set(counts) == {dtype}:
                continue
            if not _has_forward(child):  # ModuleList, ModuleDict, a namespace: its forward never runs,
                self._isolate(child, dtype)  # so FSDP's hooks on it would not either; look inside
                continue
            own = self._group_dtype(child)
            assert own is not None  # counts is not empty
            self._isolate(child, own)
            if own != dtype and not _shares_outside(child, self.owners, self.managed):
                self._shard(child)

    def _shard(self, module: nn.Module) -> None:
        fully_shard(module, mesh=self.mesh)
        self.managed.update(id(p) for p in module.parameters())
        self.groups += 1

    def _counts(self, module: nn.Module) -> Counter[torch.dtype]:
        counts: Counter[torch.dtype] = Counter()
        for p in module.parameters():
            if id(p) not in self.managed:
                counts[p.dtype] += p.numel()
        return counts

    def _group_dtype(self, module: nn.Module) -> torch.dtype | None:
        """The dtype ``module``'s own group will hold: that of the parameters it registers itself
        (they cannot move to another group), else the most elements' among its free parameters."""
        direct: Counter[torch.dtype] = Counter()
        for p in module._parameters.values():
            if p is not None and id(p) not in self.managed:
                direct[p.dtype] += p.numel()
        counts = direct or self._counts(module)
        return counts.most_common(1)[0][0] if counts else None


def default_shard_fn(model: nn.Module, mesh: DeviceMesh) -> None:
    """(all ranks) ``fully_shard`` each block, then the root; inside each, first every submodule of
    another dtype than its group, at any depth.

    FSDP2 needs one original dtype per parameter group, so a bf16 body with an fp32 router inside
    each layer, or an fp32 head on top, gets those modules in groups of their own instead of
    failing at the first forward.
    """
    policy = _Policy(model, mesh)
    blocks = find_blocks(model)
    for block in blocks:
        if any(id(p) not in policy.managed for p in block.parameters()):
            policy.shard_unit(block)
    policy.shard_unit(model)
    logger.debug("default policy: %d FSDP groups for %d blocks and the root", policy.groups, len(blocks))


def check_dtype_groups(model: nn.Module) -> None:
    """(all ranks, after sharding) Raise a ModelMismatchError for an FSDP group whose trainable
    parameters have more than one dtype: FSDP2 would raise at the first forward (one original dtype
    per group)."""
    names = {id(m): n for n, m in model.named_modules()}
    for module, params in fsdp_groups(model):
        trainable = [(name, dtype) for name, dtype, grad in params if grad]
        dtypes = sorted({str(d).removeprefix("torch.") for _, d in trainable})
        if len(dtypes) < 2:
            continue
        where = names.get(id(module), type(module).__name__) or "the root module"
        by_dtype = {d: [n for n, t in trainable if str(t).removeprefix("torch.") == d] for d in dtypes}
        shown = "; ".join(
            f"{d}: {', '.join(ns[:3])}{' ...' if len(ns) > 3 else ''}" for d, ns in by_dtype.items()
        )
        raise ModelMismatchError(
            f"the FSDP group of {where!r} holds trainable parameters of {len(dtypes)} dtypes ({shown}); "
            "FSDP2 needs one dtype per group and would fail at the first forward. In shard_fn, "
            "fully_shard each submodule of another dtype before its parent (innermost first), or pass "
            "shard_fn=None: rank0load's default policy does that."
        )
