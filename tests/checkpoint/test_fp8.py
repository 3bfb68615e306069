"""Dequantising any run of a float8 entry's elements (as pieces and steps cut them: partial rows,
several parts, partial blocks) gives exactly the documented formula's values for those elements."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rank0load.checkpoint._fp8 import dequantize, dequantize_at, dequantize_stacked, scale_span, to_float32
from tests.moe_models import dequantize as reference
from tests.moe_models import quantize


@st.composite
def entries(draw):
    block = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    cols = draw(st.integers(1, 13))
    part_rows = draw(st.lists(st.integers(1, 11), min_size=1, max_size=4))
    seed = draw(st.integers(0, 1000))
    total = sum(part_rows) * cols
    start = draw(st.integers(0, total - 1))
    n = draw(st.integers(1, total - start))
    return block, cols, part_rows, seed, start, n


def _quantised(block, cols, part_rows, seed):
    """An entry of 2-D parts, quantised: (float8 values, scale grids, the formula's float32 values)."""
    generator = torch.Generator().manual_seed(seed)
    weights, grids, want = [], [], []
    for rows in part_rows:
        q, scale = quantize(torch.randn(rows, cols, generator=generator) * 10, block)
        weights.append(q.reshape(-1))
        grids.append(scale.reshape(-1))
        want.append(reference(q, scale, block).reshape(-1))
    return torch.cat(weights), torch.cat(grids), torch.cat(want)


@settings(max_examples=300, deadline=None)
@given(entries())
def test_any_run_of_elements_dequantises_exactly(case):
    block, cols, part_rows, seed, start, n = case
    values, scales, full = _quantised(block, cols, part_rows, seed)
    got = dequantize(values[start : start + n], start, part_rows, cols, block, scales)
    assert torch.equal(got, full[start : start + n])


@settings(max_examples=200, deadline=None)
@given(entries(), st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64]))
def test_dequantised_into_the_destination_as_to_casts(case, dtype):
    """``into``: the products land in the destination's dtype with the bits ``.to(dtype)`` of the
    float32 values gives (what the shard held when the sink cast a float32 copy), returned as is."""
    block, cols, part_rows, seed, start, n = case
    values, scales, full = _quantised(block, cols, part_rows, seed)
    shard = torch.full((n + 3,), 7.0, dtype=dtype)
    into = shard[2 : 2 + n]
    got = dequantize(values[start : start + n], start, part_rows, cols, block, scales, into=into)
    assert got.data_ptr() == into.data_ptr()
    want = full[start : start + n].to(dtype)
    assert torch.equal(into.view(-1).view(torch.uint8), want.view(torch.uint8))
    assert shard[:2].eq(7).all() and shard[-1] == 7  # nothing written outside it


@settings(max_examples=300, deadline=None)
@given(entries())
def test_a_run_needs_only_its_scale_span(case):
    """``scale_span``: the scale bytes a run needs (what a row-sharded rank receives) are enough, every
    other scale NaN, and none is spare: its first and last grid rows are the first and last element's."""
    block, cols, part_rows, seed, start, n = case
    values, scales, full = _quantised(block, cols, part_rows, seed)
    first, end = scale_span(part_rows, cols, block, start, start + n)
    only = torch.full_like(scales, float("nan"))
    only.view(torch.uint8)[first:end] = scales.view(torch.uint8)[first:end]
    got = dequantize(values[start : start + n], start, part_rows, cols, block, only)
    assert torch.equal(got, full[start : start + n])
    row = -(-cols // block[1]) * 4  # bytes of one grid row
    assert first % row == 0 and end % row == 0 and first < end <= scales.numel() * 4
    for at, grid_row in ((start, first), (start + n - 1, end - row)):  # its first and last grid rows
        spoiled = scales.clone()  # are needed: the first and last elements' (0 x NaN is NaN)
        spoiled.view(torch.uint8)[grid_row : grid_row + row].view(torch.float32).fill_(float("nan"))
        assert dequantize(values[at : at + 1], at, part_rows, cols, block, spoiled).isnan().all()
    assert scale_span(part_rows, cols, block, start, start) == (0, 0)


@st.composite
def aligned_entries(draw):
    """Parts that end on block boundaries (but the last): stacked experts of 128-multiple widths,
    which dequantise as one matrix."""
    block = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    cols = draw(st.integers(1, 13))
    part_rows = [block[0] * r for r in draw(st.lists(st.integers(1, 3), min_size=1, max_size=5))]
    part_rows[-1] = draw(st.integers(1, 11))
    seed = draw(st.integers(0, 1000))
    total = sum(part_rows) * cols
    start = draw(st.integers(0, total - 1))
    return block, cols, part_rows, seed, start, draw(st.integers(1, total - start))


@settings(max_examples=200, deadline=None)
@given(aligned_entries())
def test_aligned_parts_dequantise_exactly(case):
    block, cols, part_rows, seed, start, n = case
    values, scales, full = _quantised(block, cols, part_rows, seed)
    merged = [sum(part_rows)]  # as _entries describes such an entry
    got = dequantize(values[start : start + n], start, merged, cols, block, scales)
    assert torch.equal(got, full[start : start + n])
    flat = torch.arange(start, start + n)
    assert torch.equal(dequantize_at(values[flat], flat, merged, cols, block, scales), full[flat])


def test_table_conversion_is_torchs_bit_for_bit():
    """to_float32: every float8 byte (NaNs and signed zeros included) as torch converts it."""
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = torch.arange(256, dtype=torch.uint8).view(dtype)
        assert torch.equal(to_float32(q).view(torch.int32), q.to(torch.float32).view(torch.int32))


@settings(max_examples=200, deadline=None)
@given(entries(), st.integers(0, 2**31))
def test_any_set_of_elements_dequantises_exactly(case, pick):
    """dequantize_at (a tensor-parallel block: elements anywhere in the entry) gives the same bits."""
    block, cols, part_rows, seed, _, _ = case
    values, scales, full = _quantised(block, cols, part_rows, seed)
    flat = torch.randperm(values.numel(), generator=torch.Generator().manual_seed(pick))[
        : values.numel() // 2 + 1
    ]
    got = dequantize_at(values[flat], flat, part_rows, cols, block, scales)
    assert torch.equal(got, full[flat])


def test_large_runs_go_in_bounded_steps():
    """Whole rows past 1 MiB of float32 (the sink bounds each call; here one call), across a part boundary."""
    block, cols, part_rows = (128, 128), 1000, [700, 900]
    generator = torch.Generator().manual_seed(0)
    parts = [quantize(torch.randn(r, cols, generator=generator), block) for r in part_rows]
    values = torch.cat([q.reshape(-1) for q, _ in parts])
    scales = torch.cat([s.reshape(-1) for _, s in parts])
    want = torch.cat([reference(q, s, block).reshape(-1) for q, s in parts])
    start = 123
    got = dequantize(values[start:], start, part_rows, cols, block, scales)
    assert torch.equal(got, want[start:])


def test_a_ranks_rows_inside_one_block_row():
    """A rank's rows of one 128 x 128 block (an expert weight split over 2 or 3 ranks), whole rows
    over one or several column blocks: each is one block row's scales broadcast (``_scale_rows``'
    one-multiply path), the formula's values exactly."""
    for cols, (start_row, rows) in ((128, (64, 64)), (256, (0, 43)), (384, (43, 42)), (256, (85, 43))):
        values, scales, full = _quantised((128, 128), cols, [128], seed=cols + start_row)
        start, n = start_row * cols, rows * cols
        got = dequantize(values[start : start + n], start, [128], cols, (128, 128), scales)
        assert torch.equal(got, full[start : start + n]), (cols, start_row, rows)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 5),
    st.data(),
)
def test_stacked_entries_dequantise_as_each_alone(n, bm, bn, col_blocks, data):
    """``dequantize_stacked``: ``n`` same-shape entries' rows ``first ..`` at once (a layer's experts,
    a rank's rows of each), any row range, partial last block row: each entry's values exactly as
    the formula gives them, and as :func:`dequantize` gives that entry alone."""
    rows = data.draw(st.integers(1, 13))
    first = data.draw(st.integers(0, rows - 1))
    k = data.draw(st.integers(1, rows - first))
    cols = bn * col_blocks
    qs, grids, want = [], [], []
    for seed in range(n):
        values, scales, full = _quantised((bm, bn), cols, [rows], seed)
        qs.append(values.view(rows, cols)[first : first + k])
        grids.append(scales.view(-1, col_blocks)[first // bm : -(-(first + k) // bm)])
        want.append(full.view(rows, cols)[first : first + k])
        alone = dequantize(
            values[first * cols : (first + k) * cols], first * cols, [rows], cols, (bm, bn), scales
        )
        assert torch.equal(alone.view(k, cols), want[-1])
    got = dequantize_stacked(torch.stack(qs), torch.stack(grids), first, (bm, bn))
    assert torch.equal(got, torch.stack(want))
