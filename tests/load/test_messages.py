"""Property: the plan's pieces grouped into messages (``_plan.messages``) agree on every rank.

For any mix of entries (rows, plain, tensor-parallel blocks, float8 scale grids, zero-width), any
world size and staging size: each receiver's messages, point to point and broadcast, are exactly
rank 0's messages to it, in the same order (so no rank waits on a broadcast while its peer waits on a
send); no message exceeds a staging slot or crosses a round's end; each piece's slice views as its
dtype. And the point of it: many small tensors travel in few messages. Pure planning, no process
group: the multi-rank tests in test_coalesce move the bytes.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from rank0load.checkpoint._entries import Entry, Parts
from rank0load.checkpoint._format import TensorHeader
from rank0load.common._distribute import round_ends
from rank0load.common._staging import ALIGN
from rank0load.load import _plan
from rank0load.load._plan import Kind, Message, Route, messages

_PLACEMENTS = {
    Kind.SHARDED: (Shard(0),),
    Kind.BLOCK: (Shard(1),),
    Kind.GENERIC: (Replicate(),),
    Kind.PLAIN: None,
}


def _entry(i: int, shape: tuple[int, ...], scaled: bool) -> Entry:
    nbytes = math.prod(shape) * (1 if scaled else 4)
    entry = Entry(f"t{i}", "f", f"t{i}", "F8_E4M3" if scaled else "F32", shape, 1000 * i, nbytes)
    if not scaled:
        return entry
    grid = math.ceil(shape[0] / 2) * math.ceil(shape[1] / 2) * 4  # blocks of 2 x 2
    scales = Parts.of([TensorHeader("s", f"t{i}_scale_inv", "F32", (), 10**6 + 1000 * i, grid)])
    return Entry(
        entry.key,
        "f",
        entry.ckpt_key,
        "F8_E4M3",
        shape,
        entry.offset,
        nbytes,
        scales=scales,
        block=(2, 2),
        part_rows=(shape[0],),
    )


def make_plan(specs: list[tuple[Kind, tuple[int, ...], bool]], world: int, piece_bytes: int) -> _plan.Plan:
    entries = tuple(_entry(i, shape, scaled) for i, (_, shape, scaled) in enumerate(specs))
    kinds = [k for k, _, _ in specs]
    kinds = [  # as build_plan: blocks whose rows do not fit half a slot go whole
        Kind.GENERIC if k is Kind.BLOCK and not _plan.fits_block(e, piece_bytes) else k
        for k, e in zip(kinds, entries)
    ]
    return _plan.Plan(
        entries=entries,
        kinds=tuple(kinds),
        placements=tuple(_PLACEMENTS[k] for k in kinds),
        mesh_shape=(world,),
        coords=tuple((r, (r,)) for r in range(world)),
        piece_bytes=piece_bytes,
        rounds=round_ends([e.nbytes for e in entries], 4 * piece_bytes),
    )


@st.composite
def plans(draw):
    world = draw(st.integers(2, 4))
    specs = []
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(list(Kind)))
        shape = (draw(st.integers(0, 9)), draw(st.integers(1, 12)))
        scaled = kind is not Kind.GENERIC and draw(st.booleans())
        specs.append((kind, shape, scaled))
    return make_plan(specs, world, draw(st.sampled_from([64, 128, 256, 1024])))


def _seen_by(plan: _plan.Plan, message: Message, rank: int) -> tuple | None:
    """What ``rank`` takes part in for one of rank 0's messages, as the receiver's own messages say it."""
    if message.first.route is Route.FAN_OUT:  # one message per part, the rank's own in order
        parts = [p for p in message.first.parts if p.rank == rank]
        return tuple(("p", ((message.index, p.local_offset, p.nbytes, False),)) for p in parts) or None
    if message.dst >= 0 and message.dst != rank:
        return None
    return (_key(message),)


def _key(message: Message) -> tuple:
    how = "b" if message.dst < 0 else "p"
    return how, tuple((p.index, p.local_offset, p.nbytes, p.route is Route.SCALES) for p in message.pieces)


@pytest.mark.parametrize("own_together", [False, True])
@settings(max_examples=300, deadline=None)
@given(plan=plans())
def test_every_receiver_groups_as_rank0_sends(plan, own_together):
    sent = list(messages(plan, plan.pieces(0), own_together))
    for dst in range(-1, len(plan.coords)):  # nothing lost, nothing reordered for any destination
        got = [p for m in sent for p in m.pieces if p.dst == dst]
        assert got == [p for p in plan.pieces(0) if p.dst == dst]
    for rank in range(1, len(plan.coords)):
        mine = list(messages(plan, plan.pieces(rank)))
        want = [k for m in sent if (seen := _seen_by(plan, m, rank)) is not None for k in seen]
        assert [_key(m) for m in mine] == want, rank
    round_of = {i: sum(i >= end for end in plan.rounds) for i in range(len(plan.entries))}
    for m in sent:
        assert m.nbytes <= plan.piece_bytes
        assert len({round_of[p.index] for p in m.pieces}) == 1, "a message crosses a round's end"
        ends = [0] + [at + p.nbytes for p, at in m.parts()]
        assert all(at % ALIGN == 0 and at >= end for (_, at), end in zip(m.parts(), ends))
        assert m.nbytes == ends[-1]


@pytest.mark.parametrize("scaled", [False, True])
def test_many_small_tensors_travel_in_few_messages(scaled):
    """1,000 small row-sharded tensors of uneven shapes (``scaled``: half of them float8 with scale
    grids), then 1,000 small plain ones, over 3 ranks, 1 MiB slots: one message per tensor per
    rank before (float8 ones: their whole scale grids broadcast besides); a handful now."""
    specs = [(Kind.SHARDED, (3 + i % 5, 7 + i % 3), scaled and i % 2 == 0) for i in range(1000)]
    specs += [(Kind.PLAIN, (5 + i % 4,), False) for i in range(1000)]
    plan = make_plan(specs, 3, 1 << 20)
    pieces = list(plan.pieces(0))
    sent = [m for m in messages(plan, pieces) if m.dst != 0]  # rank 0's own rows are no message
    moving = [p for p in pieces if p.dst != 0]
    assert len(moving) > 2500  # one message each, before
    assert len(sent) <= 10, [(m.dst, len(m.pieces)) for m in sent]
    grids = sum(e.scales.nbytes for e in plan.entries)
    for rank in (1, 2):  # each rank gets the scale grid rows of its rows: about a third of the grids
        scales = sum(p.nbytes for p in plan.pieces(rank) if p.route is Route.SCALES)
        assert scales < grids * 0.6 if scaled else scales == 0, (rank, scales, grids)
        assert len([m for m in messages(plan, plan.pieces(rank))]) == len(
            [m for m in sent if m.dst in (rank, -1)]
        )


@settings(max_examples=200, deadline=None)
@given(plan=plans())
def test_rank0s_own_pieces_grouped_only_among_themselves(plan):
    """``own_together`` (rank 0 of an accelerator mesh): its consecutive own pieces share messages,
    every other message stays exactly as it was, and an own message holds only pieces with no other
    piece between them in the plan (so nothing that another rank sees, or a scale grid its rows
    need, moves in another order)."""
    apart = list(messages(plan, plan.pieces(0)))
    together = list(messages(plan, plan.pieces(0), own_together=True))
    assert [_key(m) for m in together if m.dst != 0] == [_key(m) for m in apart if m.dst != 0]
    pieces = list(plan.pieces(0))
    position = {(p.index, p.route, p.dst, p.start, p.nbytes, p.local_offset): i for i, p in enumerate(pieces)}
    for m in together:
        if m.dst == 0:
            at = [position[(p.index, p.route, p.dst, p.start, p.nbytes, p.local_offset)] for p in m.pieces]
            assert at == list(range(at[0], at[0] + len(at))), "an own message skips a piece in between"
    own = sum(m.dst == 0 for m in apart)
    assert sum(m.dst == 0 for m in together) <= own


def test_world_one_reads_in_few_messages():
    """World size 1 on an accelerator: every piece is rank 0's own; 64 small tensors of 256 bytes
    travel in 16 messages of 1 KiB, not 64."""
    plan = make_plan([(Kind.SHARDED, (4, 16), False)] * 64, 1, 1024)
    assert len(list(messages(plan, plan.pieces(0)))) == 64
    assert [len(m.pieces) for m in messages(plan, plan.pieces(0), own_together=True)] == [4] * 16


def test_rounds_and_slots_bound_messages():
    specs = [(Kind.SHARDED, (4, 16), False)] * 64  # 256 bytes per entry, 128 per rank on 2 ranks
    plan = make_plan(specs, 2, 1024)  # rounds of 4 KiB: 16 entries each
    to_one = [m for m in messages(plan, plan.pieces(1))]
    assert [len(m.pieces) for m in to_one] == [8] * 8  # 8 x 128 bytes fill a slot; 2 per round
    assert list(itertools.accumulate(len(m.pieces) for m in to_one))[1::2] == [16, 32, 48, 64]
