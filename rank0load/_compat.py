"""The one place rank0load leans on DTensor behaviour that could change between torch releases.

``tests/test_compat.py`` fails loudly if it does.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's data: a DTensor's local shard (the storage FSDP2 keeps, so
    writing into it loads the parameter), or ``t`` itself for a plain tensor.

    ``DTensor.to_local()`` under ``no_grad`` returns the local tensor itself rather than an
    autograd view.
    """
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():
        return t.to_local()
