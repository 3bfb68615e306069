"""The default FSDP2 wrapping policy, and the checks every policy's groups must pass.

Nothing at or below a **routed list** gets a group (ranks whose tokens reach different experts
would issue different collectives): a ``ModuleList`` / ``ModuleDict`` inside a block whose elements
with parameters include two or more of one class, or whose attribute name contains ``expert``.

A trainable parameter of another dtype than its group's that cannot get a group of its own (one a
module holds itself beside a routed list, as MiniMax-M2 ports hold their fp32 router bias beside bf16
experts; one inside a routed list; one beside parameters of the group's dtype on its own module) is
**replicated**: kept out of FSDP (``fully_shard(..., ignored_params=...)``), a plain tensor on every
rank whose gradient ``train._replicas`` averages over the ranks (:func:`replicated_parameters`).

(all ranks) :func:`routed_modules`, before any policy (``fully_shard`` renames the classes blocks are
found by); :func:`default_shard_fn`, the default policy; :func:`prepare_groups` and
:func:`replicated_parameters`, after any policy.
``fully_shard`` on a meta model issues no collectives.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Set as AbstractSet

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ..errors import ModelMismatchError, format_keys
from ..integrations._compat import (
    can_reduce_scatter_unused_params,
    fsdp_groups,
    fsdp_shards_integer_parameters,
    no_split_modules,
)

logger = logging.getLogger(__name__)


def find_blocks(model: nn.Module, routed: frozenset[int], owners: dict[int, set[int]]) -> list[nn.Module]:
    """The modules to shard one by one, innermost first: those whose class ``_no_split_modules``
    names, else the children of the largest ``nn.ModuleList``; none in ``routed`` (:func:`routed_modules`)
    nor sharing a parameter outside itself (``owners``: :func:`_owners`)."""
    blocks = [b for b in _candidate_blocks(model) if id(b) not in routed and not _shares_outside(b, owners)]
    # Innermost first: fully_shard on a child must precede its parent.
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(blocks, key=lambda m: -order[id(m)])


def _candidate_blocks(model: nn.Module) -> list[nn.Module]:
    names = no_split_modules(model)
    blocks = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if not blocks:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
        if lists:
            biggest = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
            blocks = [b for b in biggest if any(True for _ in b.parameters())]
    return blocks


def routed_modules(model: nn.Module) -> frozenset[int]:
    """(all ranks, before sharding) Ids of the modules at or below a routed list: none may be a unit."""
    inside_block: set[int] = set()
    for block in _candidate_blocks(model):
        inside_block.update(id(m) for m in block.modules() if m is not block)
    out: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in out or not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        attr = name.rsplit(".", 1)[-1]
        if "expert" in attr.lower() or (id(module) in inside_block and _replicas(module)):
            out.update(id(m) for m in module.modules())
    return frozenset(out)


def _replicas(container: nn.Module) -> bool:
    """Whether two or more of the container's elements that hold parameters share a class (experts);
    ``[Linear, Dropout]`` or one adapter per name run whole."""
    classes = Counter(type(m) for m in container.children() if any(True for _ in m.parameters()))
    return any(n > 1 for n in classes.values())


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
    """Whether ``block`` holds a parameter also used outside it (a tie): it cannot be its own group,
    the outside user would see it resharded. ``managed``: parameters already grouped, ignored."""
    inside = {id(m) for m in block.modules()}
    return any(not owners[id(p)] <= inside for p in block.parameters() if id(p) not in managed)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Policy:
    """One pass of the default policy: which parameters already have a group, which are replicated."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, routed: frozenset[int]) -> None:
        self.mesh = mesh
        self.routed = routed
        self.managed: set[int] = set()
        self.owners = _owners(model)
        self.groups = 0
        self.replicated: dict[int, nn.Parameter] = {}  # kept out of FSDP, by id, in the order found

    def shard_unit(self, unit: nn.Module, outer: torch.dtype | None = None) -> None:
        """``fully_shard(unit)``, after giving each of its odd-dtype submodules a group of its own.
        ``outer``: the dtype of the group ``unit`` would otherwise join; then ``unit`` gets a group
        only if its own dtype differs and none of its free parameters is used outside it."""
        dtype = self._group_dtype(unit)
        if dtype is not None:
            self._isolate(unit, dtype)
        own_group = outer is None or dtype != outer and not _shares_outside(unit, self.owners, self.managed)
        if dtype is not None and (own_group or dtype == outer):  # (a tie outside: check_dtype_groups tells)
            self._replicate_odd(unit, dtype)
        if own_group:
            self._shard(unit)

    def _isolate(self, module: nn.Module, dtype: torch.dtype) -> None:
        """Give every submodule of ``module`` that runs whole, is outside any routed list, and whose
        free trainable parameters are not all ``dtype`` a group of its own, innermost first."""
        for child in module.children():
            counts = self._counts(child)
            if not counts or set(counts) == {dtype} or id(child) in self.routed:
                continue  # a routed list's odd parameters: replicated by _replicate_odd
            if type(child).forward is nn.Module.forward:  # ModuleList, ModuleDict, a namespace: never
                self._isolate(child, dtype)  # called, so FSDP's hooks on it would not run; look inside
                continue
            self.shard_unit(child, outer=dtype)

    def _replicate_odd(self, unit: nn.Module, dtype: torch.dtype) -> None:
        """(after :meth:`_isolate`) The free trainable parameters under ``unit`` that are not ``dtype``
        could get no group of their own: keep them out of FSDP, replicated."""
        for p in unit.parameters():
            if p.requires_grad and p.dtype != dtype and id(p) not in self.managed:
                self.replicated.setdefault(id(p), p)

    def _shard(self, module: nn.Module) -> None:
        if not fsdp_shards_integer_parameters():
            # torch < 2.12: fully_shard raises for an integer or bool parameter, trainable or not
            # (_compat.fsdp_shards_integer_parameters); such a parameter is never trained, so it is
            # kept out of FSDP like the odd dtypes: a plain copy on every rank, listed as replicated.
            for p in module.parameters():
                if not (p.is_floating_point() or p.is_complex()) and id(p) not in self.managed:
                    self.replicated.setdefault(id(p), p)
        ignored = {p for p in module.parameters() if id(p) in self.replicated}
        fully_shard(module, mesh=self.mesh, ignored_params=ignored or None)
        self.managed.update(id(p) for p in module.parameters())
        self.groups += 1

    def _counts(self, module: nn.Module, recurse: bool = True) -> Counter[torch.dtype]:
        """Elements of ``module``'s trainable parameters (``recurse``: its submodules' too) that have
        no group yet, by dtype."""
        counts: Counter[torch.dtype] = Counter()
        for p in module.parameters(recurse=recurse):
            if p.requires_grad and id(p) not in self.managed:
                counts[p.dtype] += p.numel()
        return counts

    def _group_dtype(self, module: nn.Module) -> torch.dtype | None:
        """The dtype ``module``'s group will train in: that of the most elements among the free
        trainable parameters of the routed lists it would hold (they can have no group of their own),
        else among its own trainable parameters, else among all its free trainable parameters; None
        when it has none."""
        counts = self._routed_counts(module) or self._counts(module, recurse=False) or self._counts(module)
        return counts.most_common(1)[0][0] if counts else None

    def _routed_counts(self, module: nn.Module) -> Counter[torch.dtype]:
        """:meth:`_counts` of the routed lists below ``module`` reached through containers only (those
        below a submodule that runs whole follow that submodule's group)."""
        counts: Counter[torch.dtype] = Counter()
        for child in module.children():
            if id(child) in self.routed:
                counts.update(self._counts(child))
            elif type(child).forward is nn.Module.forward:
                counts.update(self._routed_counts(child))
        return counts


def default_shard_fn(model: nn.Module, mesh: DeviceMesh) -> None:
    """(all ranks) ``fully_shard`` each block, then the root; inside each, first every submodule
    that runs every step and whose trainable parameters have another dtype than its group's (FSDP2
    needs one dtype per group's trainable parameters; frozen ones may differ). Nothing inside a
    routed list gets a group; a trainable parameter of another dtype that can get no group of its own
    (beside or inside a routed list, or on a module beside parameters of the group's dtype) is kept out
    of FSDP, replicated on every rank (the load averages its gradient: ``rank0load.load_sharded``).
    """
    shard_default(model, mesh, routed_modules(model))


def shard_default(model: nn.Module, mesh: DeviceMesh, routed: frozenset[int]) -> None:
    """:func:`default_shard_fn` with the routed modules already found (:func:`routed_modules`)."""
    policy = _Policy(model, mesh, routed)
    blocks = find_blocks(model, routed, policy.owners)
    for block in blocks:
        if any(id(p) not in policy.managed for p in block.parameters()):
            policy.shard_unit(block)
    policy.shard_unit(model)
    logger.debug(
        "default policy: %d FSDP groups for %d blocks and the root, %d parameters replicated",
        policy.groups,
        len(blocks),
        len(policy.replicated),
    )


def refuse_integer_parameters(model: nn.Module, error: BaseException) -> None:
    """(all ranks, after the caller's ``shard_fn`` raised ``error``) torch < 2.12's ``fully_shard``
    raises for an integer or bool parameter (``_compat.fsdp_shards_integer_parameters``): raise
    ModelMismatchError naming them and the ways out instead; otherwise return."""
    if fsdp_shards_integer_parameters() or "floating point dtype can require gradients" not in str(error):
        return
    names = [
        n
        for n, p in model.named_parameters()
        if not (p.is_floating_point() or p.is_complex() or isinstance(p, DTensor))
    ]
    if names:
        raise ModelMismatchError(
            f"torch {torch.__version__}'s fully_shard cannot shard integer or bool parameters "
            f"({format_keys(names)}): it makes each shard a parameter that requires grad, which torch "
            "refuses for them (fixed in torch 2.12). Upgrade torch to 2.12 or newer; or keep them out "
            "of FSDP in shard_fn with fully_shard(..., ignored_params={...}) (a full copy on every "
            "rank), or pass shard_fn=None: rank0load's default policy does that on this torch."
        ) from error


def replicated_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(any rank, after sharding) The parameters kept out of FSDP (``ignored_params``: plain tensors,
    a full copy on every rank) of a model whose root is an FSDP unit, by first name in
    ``named_parameters()`` order; none when the root is not one (no data parallelism to keep them
    in step with)."""
    if not _is_unit(model):
        return []
    return [(n, p) for n, p in model.named_parameters() if not isinstance(p, DTensor)]


def prepare_groups(model: nn.Module, routed: frozenset[int]) -> None:
    """(all ranks, after sharding by any policy) Refuse a group inside a routed list; make groups
    holding routed parameters reduce-scatter zeros for unused ones (torch < 2.13: refuse to train
    them, at each forward); refuse a group with two trainable dtypes, now and at the first forward.
    ``routed``: :func:`routed_modules` of the unsharded model. Raises ModelMismatchError for a
    refusal (at a forward: from the hooks installed here)."""
    named = list(model.named_modules())  # walked once for names
    names = {id(m): n for n, m in named}
    units = [m for _, m in named if _is_unit(m)]
    inside = sorted(names[id(m)] for m in units if id(m) in routed)
    if inside:
        raise ModelMismatchError(
            f"shard_fn gave FSDP groups of their own to modules inside a routed list ({', '.join(inside[:5])}"
            f"{f' and {len(inside) - 5} more' if len(inside) > 5 else ''}): such a module runs only on the "
            "ranks whose tokens reach it, so ranks with different batches would issue different "
            "collectives (an abort or a hang). fully_shard the block that holds the list instead, or "
            "pass shard_fn=None: rank0load's default policy does that."
        )
    routed_names = {
        f"{name}.{n}" if name else n
        for name, m in named
        if id(m) in routed
        for n, _ in m.named_parameters(recurse=False)
    }
    groups = fsdp_groups(model, names)
    for where, unit, params in groups:
        watched = [(name, p) for name, p in params if name in routed_names]
        if watched and can_reduce_scatter_unused_params():
            # zeros for a trainable parameter with no gradient on this rank
            unit.set_reduce_scatter_unused_params(True, recurse=False)  # type: ignore[operator]
        elif watched:
            _refuse_training_routed(unit, where or "the root module", watched)
    check_dtype_groups(model, groups)
    handles: list[RemovableHandle] = []

    def check(module: nn.Module, args: object) -> None:  # ahead of FSDP's own bare AssertionError
        for h in handles:
            h.remove()
        check_dtype_groups(model)  # requires_grad changed after the load, checked as at the load

    handles.extend(u.register_forward_pre_hook(check, prepend=True) for u in units)


def _is_unit(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` (a bool, so a filter keeps ``nn.Module``)."""
    return isinstance(module, FSDPModule)


def _refuse_training_routed(unit: nn.Module, where: str, watched: list[tuple[str, nn.Parameter]]) -> None:
    """(torch < 2.13, whose reduce-scatters would differ in size) A pre-forward hook on ``unit``, a
    group holding the routed parameters ``watched``, raises, on every rank before any collective,
    whenever one of them is trainable under grad mode."""

    def check(module: nn.Module, args: object) -> None:
        if not torch.is_grad_enabled():
            return
        trainable = [name for name, p in watched if p.requires_grad]
        if trainable:
            raise ModelMismatchError(
                f"torch {torch.__version__}'s FSDP2 cannot train {where}: it holds routed parameters "
                f"that require grad ({', '.join(trainable[:3])}{' ...' if len(trainable) > 3 else ''}), "
                "and with a different batch on each rank, ranks whose tokens reach different experts "
                "would reduce-scatter gradients of different sizes (an abort or a hang). Upgrade torch to "
                "2.13 or newer (FSDPModule.set_reduce_scatter_unused_params), or freeze them with "
                "requires_grad_(False) and train the rest; run inference under torch.no_grad()."
            )

    unit.register_forward_pre_hook(check, prepend=True)


def check_dtype_groups(
    model: nn.Module, groups: list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]] | None = None
) -> None:
    """(all ranks, after sharding) Raise ModelMismatchError for an FSDP group whose trainable
    parameters have more than one dtype. ``groups``: ``fsdp_groups(model)``, if the caller has them."""
    for where, _, params in fsdp_groups(model) if groups is None else groups:
        trainable = [(name, p.dtype) for name, p in params if p.requires_grad]
        dtypes = sorted({_dtype_name(d) for _, d in trainable})
        if len(dtypes) < 2:
            continue
        where = where or "the root module"
        by_dtype = {d: [n for n, t in trainable if _dtype_name(t) == d] for d in dtypes}
        shown = "; ".join(
            f"{d}: {', '.join(ns[:3])}{' ...' if len(ns) > 3 else ''}" for d, ns in by_dtype.items()
        )
        raise ModelMismatchError(
            f"the FSDP group of {where!r} holds trainable parameters of {len(dtypes)} dtypes ({shown}); "
            "FSDP2 needs one dtype among a group's trainable parameters and would fail at the first "
            "forward. Freeze the odd ones (requires_grad_(False)) or give them the group's dtype; or, "
            "in shard_fn, fully_shard each submodule of another dtype before its parent (innermost "
            "first), or pass shard_fn=None: rank0load's default policy does that where the module "
            "runs every step, and keeps a parameter no group can take out of FSDP (replicated, its "
            "gradient averaged over the ranks). If you changed requires_grad after the load, load "
            "with the same requires_grad (set it in model_fn) so the policy can group them."
        )
