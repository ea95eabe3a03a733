"""``pairwise``: alltoall in ``n - 1`` rounds of one message each way.

In round ``k = 1 .. n-1`` a rank sends its block for one peer and receives one peer's block for
it. With ``n`` a power of two the two peers are the same, ``rank XOR k``: rounds are pairwise
exchanges, and every pair of ranks meets in exactly one round. Otherwise a rank sends to
``(rank + k) mod n`` and receives from ``(rank - k) mod n``: a shift, in which every rank still
sends and receives exactly once per round. Unlike ``direct``, which posts all its sends at
once, a rank has one message in flight per round, so each rank talks to one peer at a time
instead of every rank hitting the same peers together.

Rounds: ``n - 1``. Bytes sent per rank per piece: ``(n - 1) V`` for ``V`` elements per block
(the rank's own block is a local copy). Constraints: none; every step moves one block of one
piece, so a piece is one slot. In place with ``n`` not a power of two, a block can arrive
before the rank has sent its own block to that peer (which lives at the same place); such early
arrivals wait in scratch and are copied home once sent, a local change only.
"""

from __future__ import annotations

from shmcoll.algos.registry import register
from shmcoll.plan.builder import Context
from shmcoll.plan.ir import Buf, Region


def partners(rank: int, world_size: int, round_: int) -> tuple[int, int]:
    """``(send_to, recv_from)`` of ``rank`` in round ``round_`` (``1 <= round_ < world_size``)."""
    n = world_size
    if n & (n - 1) == 0:
        return rank ^ round_, rank ^ round_
    return (rank + round_) % n, (rank - round_) % n


@register("alltoall", "pairwise")
def alltoall(ctx: Context) -> None:
    """Round ``k``: send block ``to`` to rank ``to``, receive rank ``frm``'s block for us."""
    n, count = ctx.world_size, ctx.count
    pow2 = n & (n - 1) == 0
    # In place, rank ``frm``'s block arriving in round k overwrites our block for ``frm``, which
    # we send in round ``n - k`` (shift pattern): still to come when ``k < n - k``. Those
    # arrivals park in scratch slot ``k - 1`` (the same offsets on every rank).
    parked = 0 if (pow2 or not ctx.inplace) else (n - 1) // 2
    scratch = ctx.tmp(parked * count).off if parked else 0
    for rank in range(n):
        for k in range(1, n):
            to, frm = partners(rank, n, k)
            ctx.send(rank, to, ctx.block_region(Buf.IN, to), count)
            if k <= parked:
                ctx.recv(rank, frm, Region(Buf.TMP, scratch + (k - 1) * count), count)
            else:
                ctx.recv(rank, frm, ctx.block_region(Buf.OUT, frm), count)
            if n - k <= parked:
                # Our block for ``to`` has just left: the block parked in round ``n - k`` (from
                # the same rank ``to``) can go home.
                j = n - k
                ctx.copy(rank, Region(Buf.TMP, scratch + (j - 1) * count), ctx.block_region(Buf.OUT, to), count)
        if not ctx.inplace:
            ctx.copy(rank, ctx.block_region(Buf.IN, rank), ctx.block_region(Buf.OUT, rank), count)
