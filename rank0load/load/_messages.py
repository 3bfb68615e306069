"""Which pieces travel together: the plan's pieces grouped into messages (all ranks; no collectives).

:func:`messages` groups consecutive pieces of one *lane* (the rank they go to, or :data:`BROADCAST`)
into one :class:`Message` of at most ``Plan.piece_bytes``, read into one staging slot and sent once;
rank 0's own pieces and BLOCK pieces are messages of their own. Every rank groups its own view of
the plan, so a group is closed only by facts every rank knows (:meth:`_Gaps.apart`):

* a round's end;
* for a broadcast group: an entry in between that sends something point to point;
* for a group to rank ``r``: an entry in between that broadcasts something or fans out a BLOCK entry.

A rank closes a group at the first piece it sees that would separate it, so messages to rank ``r``
and broadcasts come in the same order on rank 0 and on rank ``r``: no rank waits on a broadcast
while its peer waits on a send."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..common._staging import aligned
from ._plan import Kind, Piece, Plan, Route

__all__ = ["BROADCAST", "Message", "messages"]

BROADCAST = -1  # the lane of broadcast pieces (scale grids broadcast to all included)
_ALONE = -2  # rank 0's own pieces (rows, scale grid rows): kept, never sent; separate nothing
_BLOCK = -3  # a BLOCK entry's chunk or block: a message of its own (``_sink.fan_out``)


@dataclass(frozen=True)
class Message:
    """Pieces moved as one buffer: piece ``i``'s bytes at ``offsets[i]`` (multiples of ALIGN, so
    each slice views as its dtype), ``nbytes`` in all (at most ``Plan.piece_bytes``)."""

    pieces: tuple[Piece, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @property
    def first(self) -> Piece:
        return self.pieces[0]

    @property
    def index(self) -> int:
        """The entry of its first piece (a message never crosses a round's end)."""
        return self.pieces[0].index

    @property
    def dst(self) -> int:
        """Its destination rank, or -1: every rank (a broadcast) or a FAN_OUT chunk."""
        return self.pieces[0].dst

    def parts(self) -> Iterator[tuple[Piece, int]]:
        return zip(self.pieces, self.offsets)

    @classmethod
    def of(cls, piece: Piece) -> Message:
        return cls((piece,), (0,), piece.nbytes)

    @classmethod
    def packed(cls, pieces: list[Piece]) -> Message:
        """A message of ``pieces``, in order, each from the ALIGN boundary after the one before."""
        offsets = [0]
        for p in pieces[:-1]:
            offsets.append(aligned(offsets[-1] + p.nbytes))
        return cls(tuple(pieces), tuple(offsets), offsets[-1] + pieces[-1].nbytes)


def _lane(piece: Piece) -> int:
    if piece.route is Route.FAN_OUT or piece.kind is Kind.BLOCK and piece.route is Route.TO_RANK:
        return _BLOCK
    if piece.dst < 0:
        return BROADCAST
    return _ALONE if piece.dst == 0 else piece.dst


@dataclass(frozen=True)
class _Gaps:
    """Prefix counts over the plan's entries, so that any two pieces' separation is O(1)."""

    sends: tuple[int, ...]  # entries [0, i) that send point to point (SHARDED, BLOCK)
    shares: tuple[int, ...]  # entries [0, i) that broadcast or fan out (all but SHARDED)
    round_of: tuple[int, ...]  # each entry's round

    @classmethod
    def of(cls, plan: Plan) -> _Gaps:
        moving = [e.nbytes > 0 for e in plan.entries]
        sends = [m and k in (Kind.SHARDED, Kind.BLOCK) for m, k in zip(moving, plan.kinds)]
        shares = [m and k is not Kind.SHARDED for m, k in zip(moving, plan.kinds)]
        return cls(
            tuple(itertools.accumulate(sends, initial=0)),
            tuple(itertools.accumulate(shares, initial=0)),
            tuple(bisect.bisect_right(plan.rounds, i) for i in range(len(plan.entries))),
        )

    def apart(self, last: Piece, lane: int, piece: Piece, piece_lane: int) -> bool:
        """Whether an open group of ``lane`` ending with ``last`` must close before ``piece``."""
        a, b = last.index, piece.index
        if self.round_of[a] != self.round_of[b]:
            return True
        if piece_lane == _ALONE:
            return False
        if lane == BROADCAST:  # an entry's own point-to-point pieces follow its broadcast ones
            return piece_lane != BROADCAST or self.sends[b] > self.sends[a]
        if piece_lane in (BROADCAST, _BLOCK):  # an entry's broadcast pieces precede its own
            return True
        return piece_lane == lane and self.shares[b + 1] > self.shares[a + 1]


def messages(plan: Plan, pieces: Iterable[Piece], own_together: bool = False) -> Iterator[Message]:
    """(all ranks) ``pieces`` (one rank's view of ``plan``, in plan order) grouped into messages, in
    the order they move. BLOCK pieces are messages of one piece each; so are rank 0's own pieces,
    unless ``own_together``: then consecutive own pieces are grouped too, and any other piece closes
    their group first, so that nothing another rank sees moves in another order."""
    gaps = _Gaps.of(plan)
    open_: dict[int, list[Piece]] = {}  # lane -> its open group
    ends: dict[int, int] = {}  # lane -> where its open group's bytes end, laid out as Message.packed does

    round_ = -1
    for piece in pieces:
        lane = _lane(piece)
        if lane != _ALONE and _ALONE in open_:  # rank 0's own pieces never wait behind another's
            yield Message.packed(open_.pop(_ALONE))
        # The lanes this piece may separate (see _Gaps.apart): every one at a round's first piece, a
        # broadcast or a BLOCK piece; else only its own and the broadcast one.
        if gaps.round_of[piece.index] != round_ or lane in (BROADCAST, _BLOCK):
            round_, suspects = gaps.round_of[piece.index], sorted(open_)
        else:
            suspects = [other for other in (BROADCAST, lane) if other in open_]
        for other in suspects:
            if gaps.apart(open_[other][-1], other, piece, lane):
                yield Message.packed(open_.pop(other))
        if lane == _BLOCK or lane == _ALONE and not own_together:
            yield Message.of(piece)
            continue
        at = aligned(ends[lane]) if lane in open_ else 0
        if lane in open_ and at + piece.nbytes > plan.piece_bytes:
            yield Message.packed(open_.pop(lane))
            at = 0
        open_.setdefault(lane, []).append(piece)
        ends[lane] = at + piece.nbytes
    for lane in sorted(open_):
        yield Message.packed(open_.pop(lane))
