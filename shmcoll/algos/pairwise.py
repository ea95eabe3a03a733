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

**alltoallv** takes the same partners with blocks of any size (``ctx.matrix``, the whole call
in one plan): in round ``k`` a rank sends its block for ``to`` and receives ``frm``'s block for
it, cut into slot-sized fragments and interleaved, fragment ``f`` out then fragment ``f`` in, so
that with one slot per ring a send waits at most for the partner to take the previous fragment,
which it does before its own next send: no deadlock, whatever the sizes. Each message carries
its pair's count + 1 as its tag (``Step.tag``), and a rank's program reads only its own row and
column of the matrix.
Rounds: ``n - 1``, each of ``ceil(max(sent, received) / slot)`` fragments. Bytes sent per
rank: its row of the matrix but its own block. Never in place.
"""

from __future__ import annotations

from shmcoll.algos.registry import register
from shmcoll.plan.builder import Context, displs, fragments, pair_count, tagged, whole_call
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


@register("alltoallv", "pairwise", piece=whole_call)
def alltoallv(ctx: Context) -> None:
    """Round ``k``: send our block for ``to``, receive ``frm``'s block for us, fragment by fragment."""
    n = ctx.world_size
    for rank in range(n):
        # Only this rank's row (what it sends) and column (what it receives) of the matrix.
        sends = [pair_count(ctx, rank, j) for j in range(n)]
        recvs = [pair_count(ctx, i, rank) for i in range(n)]
        send_at, recv_at = displs(sends), displs(recvs)
        for k in range(1, n):
            to, frm = partners(rank, n, k)
            out = fragments(sends[to], ctx.slot_capacity)
            into = fragments(recvs[frm], ctx.slot_capacity)
            for f in range(max(len(out), len(into))):
                if f < len(out):
                    off, c = out[f]
                    with tagged(ctx, sends[to] + 1):
                        ctx.send(rank, to, Region(Buf.IN, send_at[to] + off), c)
                if f < len(into):
                    off, c = into[f]
                    with tagged(ctx, recvs[frm] + 1):
                        ctx.recv(rank, frm, Region(Buf.OUT, recv_at[frm] + off), c)
        ctx.copy(rank, Region(Buf.IN, send_at[rank]), Region(Buf.OUT, recv_at[rank]), sends[rank])
