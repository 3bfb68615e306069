"""FP8 block-quantised checkpoints (MiniMax-M2, DeepSeek-V3) dequantised on the receiving rank.

A quantised weight ``w`` [R, C] is stored as float8 with ``w_scale_inv`` float32
[ceil(R/bm), ceil(C/bn)]; its value is ``float32(w[r, c]) * scale[r // bm, c // bn]`` cast to the
model's dtype, bit for bit as transformers' ``Fp8Dequantize``. The wire carries the float8 bytes (one
per element) and the scales (4 bytes per ``bm * bn`` block); each rank dequantises what it receives.

(rank 0) :func:`block_size`, :func:`checked_block`. (all ranks) :func:`scale_span` and the dequantisers.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Sequence

import torch

from ..errors import ModelMismatchError
from ._format import TensorHeader

FP8_WIRE = frozenset({"F8_E4M3", "F8_E5M2"})
SCALE_SUFFIX = "_scale_inv"  # a weight's block scales are stored as <weight key> + this
_TABLES: dict[torch.dtype, torch.Tensor] = {}


def to_float32(values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``values.to(torch.float32)`` for a float8 tensor (written into ``out``, if given), bit for bit,
    NaNs included; on the CPU through the float32 value of each of its dtype's 256 bytes, no temporary."""
    if out is None:
        out = torch.empty(values.shape, dtype=torch.float32, device=values.device)
    if values.device.type != "cpu" or values.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return out.copy_(values)
    table = _TABLES.get(values.dtype)
    if table is None:
        table = _TABLES[values.dtype] = torch.arange(256, dtype=torch.uint8).view(values.dtype).float()
    torch.index_select(table, 0, values.reshape(-1).view(torch.uint8).int(), out=out.view(-1))
    return out


def block_size(root: str) -> tuple[int, int] | None:
    """(rank 0) ``quantization_config.weight_block_size`` of ``root/config.json``, or None."""
    try:
        with open(os.path.join(root, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    size = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if isinstance(size, list) and len(size) == 2 and all(type(b) is int and b > 0 for b in size):
        return size[0], size[1]
    return None


def checked_block(
    key: str,
    weight: TensorHeader,
    headers: dict[str, TensorHeader],
    block: tuple[int, int] | None,
    dtype: torch.dtype,
) -> tuple[int, int]:
    """(rank 0) The block size of float8 ``weight`` (checkpoint key ``weight.key``), its ``weight_scale_inv``
    checked against its shape. Raises ModelMismatchError naming what is wrong: a float8 weight is never
    loaded unscaled into a floating model."""
    scale = headers.get(weight.key + SCALE_SUFFIX)
    if scale is None:
        where = os.path.basename(weight.file)
        raise ModelMismatchError(
            f"model tensor {key!r} ({dtype}): checkpoint key {weight.key!r} in {where} is {weight.dtype} "
            f"but the checkpoint has no {weight.key + '_scale_inv'!r} to dequantise it with; loading it "
            "unscaled would give wrong weights. Re-download the checkpoint, or build the model in the "
            "checkpoint's float8 dtype."
        )
    if len(weight.shape) != 2 or len(scale.shape) != 2 or scale.dtype != "F32":
        raise ModelMismatchError(
            f"model tensor {key!r}: {weight.key!r} {weight.shape} with scale {scale.key!r} {scale.shape} "
            f"({scale.dtype}): rank0load dequantises 2-D float8 weights with a 2-D float32 scale grid"
        )
    rows, cols = weight.shape
    if block is None:  # inferred from the grid, then checked like a declared one
        block = (_infer(rows, scale.shape[0]), _infer(cols, scale.shape[1]))
    want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if scale.shape != want:
        raise ModelMismatchError(
            f"model tensor {key!r}: scale {scale.key!r} in {os.path.basename(scale.file)} has shape "
            f"{scale.shape}, but {weight.key!r} {weight.shape} in blocks of {block} needs {want}. "
            "The checkpoint's scales do not fit its weights (or config.json's weight_block_size is wrong)."
        )
    return block


def _infer(size: int, blocks: int) -> int:
    """A block size giving ``blocks`` blocks over ``size``: the smallest power of two at least
    ``ceil(size / blocks)`` if it fits (24 rows in 2 blocks are blocks of 16, not 12)."""
    least = math.ceil(size / max(1, blocks))
    power = 1 << max(0, least - 1).bit_length()
    return power if math.ceil(size / power) == blocks else least


def scale_span(
    part_rows: Sequence[int], cols: int, block: tuple[int, int], start: int, stop: int
) -> tuple[int, int]:
    """The bytes ``[first, end)`` of an entry's scale grids (as :func:`dequantize` takes them) that its
    elements ``[start, stop)`` are dequantised with, as one run of grid rows; ``(0, 0)`` if empty."""
    if start >= stop:
        return 0, 0
    bm, bn = block
    row_bytes = math.ceil(cols / bn) * 4  # one grid row of float32
    first, last = start // cols, (stop - 1) // cols  # the rows of the first and last elements
    span, base, grid_base = [0, 0], 0, 0  # the part's first row and first grid row
    for rows in part_rows:
        if base <= first < base + rows:
            span[0] = (grid_base + (first - base) // bm) * row_bytes
        if base <= last < base + rows:
            span[1] = (grid_base + (last - base) // bm + 1) * row_bytes
            break
        base, grid_base = base + rows, grid_base + math.ceil(rows / bm)
    return span[0], span[1]


def dequantize(
    values: torch.Tensor,
    start: int,
    part_rows: list[int],
    cols: int,
    block: tuple[int, int],
    scales: torch.Tensor,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 values of elements ``[start, start + len(values))`` of an entry made of 2-D parts
    of ``part_rows[p]`` rows and ``cols`` columns each, one after the other; ``scales``: the parts'
    float32 scale grids, one after the other. ``into``: a contiguous floating tensor of
    ``len(values)`` elements that receives the values instead (returned), each product rounded once
    to its dtype, as ``.to(dtype)`` would."""
    out = to_float32(values, torch.empty(values.numel(), dtype=torch.float32, device=values.device))
    dest = out if into is None else into.view(-1)
    bm, bn = block
    grid_cols = math.ceil(cols / bn)
    base, grid_base, stop = 0, 0, start + values.numel()
    for rows in part_rows:
        size = rows * cols
        pos, end = max(start, base) - start, min(stop, base + size) - start  # the part's values
        if pos < end:
            grid = scales[grid_base : grid_base + math.ceil(rows / bm) * grid_cols].view(-1, grid_cols)
            while pos < end:  # a partial first row, the whole rows, a partial last row
                row, col = divmod(start + pos - base, cols)
                if col or end - pos < cols:  # part of one row
                    take = min(end - pos, cols - col)
                    shape: tuple[int, int] = (1, take)
                else:
                    take = (end - pos) // cols * cols
                    shape, col = (take // cols, cols), 0
                scaled = dest[pos : pos + take].view(shape)
                _scale_rows(out[pos : pos + take].view(shape), scaled, grid, row, col, block)
                pos += take
        base += size
        grid_base += math.ceil(rows / bm) * grid_cols
        if base >= stop:
            break
    return dest


def dequantize_stacked(
    values: torch.Tensor, grids: torch.Tensor, first_row: int, block: tuple[int, int]
) -> torch.Tensor:
    """float32 values of ``k`` rows (from ``first_row``) of each of ``n`` same-shape 2-D float8
    entries at once (a layer's experts, each rank's rows of them): ``values`` [n, k, cols] (any
    strides), ``grids`` [n, grid rows from ``first_row // bm``, cols / bn] their block scales
    (float32), ``cols`` a multiple of ``bn``. The same products as :func:`dequantize` per entry."""
    n, k, cols = values.shape
    bm, bn = block
    out = torch.empty((n, k, cols), dtype=torch.float32, device=values.device)
    to_float32(values.reshape(n, k * cols), out.view(n, k * cols))
    rows = torch.arange(first_row, first_row + k, device=values.device) // bm - first_row // bm
    scale = grids.index_select(1, rows)  # [n, k, cols / bn]: each matrix row's block scales
    out.view(n, k, cols // bn, bn).mul_(scale.unsqueeze(-1))
    return out


def dequantize_at(
    values: torch.Tensor,
    flat: torch.Tensor,
    part_rows: list[int],
    cols: int,
    block: tuple[int, int],
    scales: torch.Tensor,
) -> torch.Tensor:
    """float32 values of the entry's elements at flat indices ``flat`` (int64, one per value, any
    order; a tensor-parallel block's). Same arithmetic as :func:`dequantize`."""
    bm, bn = block
    grid_cols = math.ceil(cols / bn)
    bases = torch.tensor([0, *itertools.accumulate(part_rows)], dtype=torch.int64, device=flat.device)
    grid_rows = [math.ceil(rows / bm) for rows in part_rows]
    grid_bases = torch.tensor([0, *itertools.accumulate(grid_rows)], dtype=torch.int64, device=flat.device)
    row, col = flat // cols, flat % cols
    part = torch.searchsorted(bases[1:], row, right=True)
    grid_row = grid_bases[part] + (row - bases[part]) // bm
    scale = scales.view(-1, grid_cols)[grid_row, col // bn]
    return to_float32(values) * scale


def _scale_rows(
    x: torch.Tensor, y: torch.Tensor, grid: torch.Tensor, row: int, col: int, block: tuple[int, int]
) -> None:
    """``y = x`` [k, w] times the block scales of rows ``row ..`` and columns ``col ..`` of a part
    (``y`` may be ``x``), with no full-size scale tensor."""
    bm, bn = block
    k, width = x.shape
    one_row = row // bm == (row + k - 1) // bm  # rows inside one block row: one grid row, broadcast
    if not col and not width % bn and (one_row or not row % bm and not k % bm):
        g, n = row // bm, 1 if one_row else k // bm
        blocks = (n, k // n, width // bn, bn)
        torch.mul(x.view(blocks), grid[g : g + n, None, : width // bn, None], out=y.view(blocks))
        return
    index = torch.arange(row, row + k, device=grid.device) // bm
    rows = grid.index_select(0, index)  # [k, grid columns]
    at = 0
    while at < width:  # a partial first column block, the whole blocks, a partial last one
        c = col + at
        n, w = (1, min(width - at, bn - c % bn)) if c % bn or width - at < bn else ((width - at) // bn, bn)
        span, g = slice(at, at + n * w), c // bn
        torch.mul(x[:, span].view(k, n, w), rows[:, g : g + n, None], out=y[:, span].view(k, n, w))
        at += n * w
