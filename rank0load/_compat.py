"""The one place rank0load leans on DTensor behaviour that could change between torch releases.

``tests/test_compat.py`` fails loudly if it does.
"""

from __future__ import annotations

import ctypes

import torch
from torch.distributed.tensor import DTensor

__all__ = ["host_bytes", "local_tensor"]


def host_bytes(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous uint8 CPU tensor's bytes, without numpy (``Tensor.numpy()``
    needs it, and neither torch nor rank0load requires it). The caller keeps ``t`` alive while the
    view is in use."""
    if not (t.device.type == "cpu" and t.dtype == torch.uint8 and t.is_contiguous()):
        raise ValueError(f"host_bytes needs a contiguous uint8 CPU tensor, got {t.dtype} on {t.device}")
    if t.numel() == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


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
