"""Property: for any block layout (each rank's indices per dimension, as runs) and any staging size,
rank 0's chunks, cut into each rank's parts, rebuild every rank's local shard exactly, each byte written
once; and each receiver's own piece sequence is exactly what rank 0 sends it, in the same order.
Pure planning, no process group: the multi-rank tests in test_blocks and test_meshes move the bytes.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from rank0load.checkpoint._entries import Entry
from rank0load.common import _staging
from rank0load.integrations._compat import StridedShard
from rank0load.load import _plan, _sink
from rank0load.model import _layout


def _fixed_plan(entry: Entry, per_rank: dict, piece_bytes: int) -> _plan.Plan:
    """A one-entry BLOCK plan whose ranks hold the drawn runs (not ones a mesh would give)."""

    class Fixed(_plan.Plan):
        def block_of(self, index, rank):
            return per_rank[rank]

    world = len(per_rank)
    coords = tuple((r, (r,)) for r in range(world))
    return Fixed((entry,), (_plan.Kind.BLOCK,), (None,), (world,), coords, piece_bytes, (1,))


@st.composite
def layouts(draw):
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    if draw(st.booleans()):  # 3-D with wide dimension-0 slices: chunks inside one index (experts)
        shape = (draw(st.integers(1, 5)), draw(st.integers(1, 9)), draw(st.integers(8, 30)))
    world = draw(st.integers(1, 4))
    per_rank = {}
    for rank in range(world):
        # Any ordered subset of each dimension: row ranges, strided runs, empty shards.
        per_rank[rank] = tuple(
            _layout._runs(
                torch.tensor(sorted(draw(st.sets(st.integers(0, n - 1), max_size=n))), dtype=torch.int64)
            )
            for n in shape
        )
    piece_bytes = draw(st.integers(2, 40)) * _staging.ALIGN
    return shape, per_rank, piece_bytes


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-3, 40), max_size=60))
def test_runs_are_the_maximal_runs_of_consecutive_indices(values):
    """``_layout._runs`` (vectorised) against the obvious loop, on any sequence: sorted or not,
    repeats, gaps, negative values, empty."""
    want: list[tuple[int, int]] = []
    for i in values:
        if want and want[-1][1] == i:
            want[-1] = (want[-1][0], i + 1)
        else:
            want.append((i, i + 1))
    assert _layout._runs(torch.tensor(values, dtype=torch.int64)) == tuple(want)


@given(layouts())
def test_chunks_and_parts_rebuild_every_shard(layout):
    shape, per_rank, piece_bytes = layout
    numel = math.prod(shape)
    entry = Entry("w", "f", "w", "F32", shape, 4096, numel * 4)
    full = torch.arange(numel, dtype=torch.float32).reshape(shape)
    if not _plan.fits_block(entry, piece_bytes):  # even one dimension-1 row is too wide: GENERIC
        assert math.prod(shape[1:]) * 4 > _staging.block_half(piece_bytes)
        return

    def indices(runs):
        return [i for a, b in runs for i in range(a, b)]

    want = {r: full[np.ix_(*[indices(d) for d in runs])].reshape(-1) for r, runs in per_rank.items()}
    got = {r: torch.full((w.numel(),), -1.0) for r, w in want.items()}
    sent: dict[int, list[tuple[int, int]]] = {r: [] for r in per_rank}
    plan = _fixed_plan(entry, per_rank, piece_bytes)
    chunks = list(plan.pieces(0))
    row_bytes = entry.nbytes // shape[0]
    assert sum(c.nbytes for c in chunks) == entry.nbytes  # every row read once, in order
    for c in chunks:
        assert c.route is _plan.Route.FAN_OUT and c.nbytes <= _staging.block_half(piece_bytes)
        assert c.chunk is not None and (c.chunk.start, c.chunk.nbytes) == (c.start, c.nbytes)
        rows = c.chunk.shape[0]
        if len(c.chunk.shape) == len(shape):  # whole dimension-0 rows
            first, at = divmod(c.start, row_bytes)
            assert at == 0
            chunk = full[first : first + rows]
        else:  # dimension-1 rows of one dimension-0 index (one expert)
            sub_bytes = row_bytes // shape[1]
            outer, at = divmod(c.start, row_bytes)
            first, at = divmod(at, sub_bytes)
            assert len(c.chunk.shape) == len(shape) - 1 and at == 0 and first + rows <= shape[1]
            chunk = full[outer, first : first + rows]
        assert chunk.shape == c.chunk.shape and chunk.numel() * 4 == c.nbytes
        assert [(p.rank, p.local_offset) for p in c.parts] == sorted(
            (p.rank, p.local_offset) for p in c.parts
        )
        for d in c.parts:
            block = _sink.cut(chunk, d).reshape(-1)
            assert block.numel() * 4 == d.nbytes
            lo = d.local_offset // 4
            target = got[d.rank][lo : lo + block.numel()]
            assert torch.all(target == -1), "a byte was delivered twice"
            target.copy_(block)
            sent[d.rank].append((d.local_offset, d.nbytes))
    for r in per_rank:
        assert torch.equal(got[r], want[r]), r
        if r == 0:
            continue
        own = list(plan.pieces(r))
        assert [(p.local_offset, p.nbytes) for p in own] == sent[r]
        assert all(p.dst == r and p.route is _plan.Route.TO_RANK and p.kind is _plan.Kind.BLOCK for p in own)


@st.composite
def meshes(draw):
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    shape = tuple(draw(st.lists(st.integers(0, 13), min_size=1, max_size=3)))
    placements = []
    for _ in mesh_shape:
        choice = draw(st.integers(0, 2))
        dim = draw(st.integers(0, len(shape) - 1))
        if choice == 0:
            placements.append(Replicate())
        elif choice == 1:
            placements.append(Shard(dim))
        else:
            placements.append(StridedShard(dim, split_factor=draw(st.integers(1, 3))))
    return mesh_shape, tuple(placements), shape


@settings(max_examples=300, deadline=None)
@given(meshes())
def test_runs_at_every_coordinate_tile_the_tensor(layout):
    """Rank 0 computes every rank's block with runs_at: over all coordinates, each element is held
    by exactly as many ranks as the Replicate dimensions multiply to (and each rank's own runs are
    checked against its real shard at agreement: _layout.layout_flags)."""
    mesh_shape, placements, shape = layout
    counts = torch.zeros(shape, dtype=torch.int64)
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        runs = _layout.runs_at(placements, mesh_shape, coord, shape)
        assert runs is not None
        index = [[i for a, b in dim_runs for i in range(a, b)] for dim_runs in runs]
        if all(index):
            counts[np.ix_(*index)] += 1
    copies = math.prod(n for n, p in zip(mesh_shape, placements) if type(p) is Replicate)
    assert torch.all(counts == copies), (layout, counts)


@settings(max_examples=300, deadline=None)
@given(layouts(), st.data())
def test_global_indices_name_the_elements_a_block_holds(layout, data):
    """A float8 BLOCK shard is dequantised by the global position of each local element."""
    shape, per_rank, _ = layout
    full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    for runs in per_rank.values():
        held = full[np.ix_(*[[i for a, b in d for i in range(a, b)] for d in runs])].reshape(-1)
        first = data.draw(st.integers(0, held.numel()))
        count = data.draw(st.integers(0, held.numel() - first))
        assert torch.equal(
            _layout.global_indices(_layout.held_indices(runs), shape, first, count),
            held[first : first + count],
        )
