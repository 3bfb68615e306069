"""The default FSDP2 wrapping policy.

(all ranks) :func:`default_shard_fn` applies ``fully_shard`` to the model's blocks, then to any
top-level pieces whose dtype differs from the rest, then to the root. ``fully_shard`` on a meta
model issues no collectives.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from ._compat import no_split_modules

__all__ = ["default_shard_fn", "find_blocks"]

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


def _shares_outside(block: nn.Module, owners: dict[int, set[int]]) -> bool:
    """A block holding a parameter also used outside it (BERT's word embeddings tied to the
    decoder) cannot be its own FSDP group: the outside user would see the resharded parameter.
    Such blocks are left to the root's group."""
    inside = {id(m) for m in block.modules()}
    return any(not owners[id(p)] <= inside for p in block.parameters())


def default_shard_fn(model: nn.Module, mesh: DeviceMesh) -> None:
    """(all ranks) ``fully_shard`` each block, each odd-dtype top-level piece, then the root.

    FSDP2 needs one original dtype per parameter group, so a bf16 body with an fp32 head gets
    the head in a group of its own instead of failing at the first forward.
    """
    blocks = find_blocks(model)
    managed: set[int] = set()
    for block in blocks:
        if any(id(p) not in managed for p in block.parameters()):
            fully_shard(block, mesh=mesh)
            managed.update(id(p) for p in block.parameters())
    for piece in _odd_dtype_pieces(model, managed):
        fully_shard(piece, mesh=mesh)
        managed.update(id(p) for p in piece.parameters())
    fully_shard(model, mesh=mesh)
    logger.debug("default policy: %d blocks sharded, then the root", len(blocks))


def _dtype_counts(module: nn.Module, managed: set[int]) -> Counter[torch.dtype]:
    counts: Counter[torch.dtype] = Counter()
    for p in module.parameters():
        if id(p) not in managed:
            counts[p.dtype] += p.numel()
    return counts


def _odd_dtype_pieces(model: nn.Module, managed: set[int]) -> list[nn.Module]:
    """Submodules whose unmanaged parameters all have a dtype other than the root's majority."""
    counts = _dtype_counts(model, managed)
    if len(counts) <= 1:
        return []
    majority = counts.most_common(1)[0][0]
    pieces: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            sub = _dtype_counts(child, managed)
            if not sub:
                continue
            if len(sub) == 1:
                if majority not in sub:
                    pieces.append(child)
            else:
                visit(child)

    visit(model)
    return pieces
