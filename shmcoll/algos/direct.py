"""``direct``: every rank sends straight to every rank that needs its data.

The obviously correct algorithm for every collective, kept as the test oracle and used for small
messages, where one round of messages beats any multi-round schedule. Within a piece, each rank
first posts all its sends (one message per channel, so with at least one slot per ring a send
never waits on the current piece), then receives. Reductions combine contributions in rank
order, ``((x0 (op) x1) (op) x2) ...``, the same expression on every rank that computes it, so
allreduce results are bitwise identical everywhere.

Rounds: 1. Bytes sent per rank per piece: ``(n-1) V`` for allreduce and allgather,
``(n-1) V/n``-sized blocks for reduce_scatter and alltoall, ``(n-1) V`` at the root of broadcast
and scatter. Every step moves one whole piece, so a piece is one slot's worth of elements.

**scan** and **exscan**: rank ``r`` sends its input to every later rank and combines what it
needs in rank order, ``((x0 (op) x1) (op) ...) (op) xr`` (exscan: up to ``x(r-1)``; rank 0's
output is not written). Rounds: 1. Bytes sent by rank ``r`` per piece: ``(n-1-r) V``; rank
``n-1`` receives ``(n-1) V``. No division: the API rejects AVG for scans.

**The variable-count forms** (allgatherv, gatherv, scatterv, reduce_scatterv, alltoallv) take
the counts in the plan (``ctx.counts``, ``ctx.matrix``) and build the whole call as one plan,
cutting each block into slot-sized fragments themselves: round ``f`` moves fragment ``f`` of
every block that has one, as the uniform forms move one piece. Rounds: the largest block's
fragments, ``ceil(max count / slot)``. Bytes sent per rank: ``(n-1) counts[r]`` for
allgatherv; ``counts[r]`` to the root for gatherv, and ``sum(counts) - counts[root]`` from it
for scatterv; ``sum(counts) - counts[r]`` for reduce_scatterv; row ``r`` of the matrix but its
own block for alltoallv. Every message is tagged with its whole block's count + 1
(``Step.tag``), so ranks that disagree on the counts fail with a mismatch. An alltoallv rank's
program reads only its own row and column of the matrix, all it knows at run time.
Constraints: none; every world size, count (zero-size blocks send nothing) and root; in place
as the collective allows (never for alltoallv).
"""

from __future__ import annotations

from shmcoll.algos.registry import Query, register
from shmcoll.plan.builder import (
    Context,
    accumulate_in_rank_order,
    block_counts,
    displs,
    fragments,
    pair_count,
    tagged,
    whole_call,
)
from shmcoll.plan.ir import Buf, Region


def _others(ctx: Context, rank: int) -> list[int]:
    """Every other rank, starting after ``rank`` so that not everyone hits rank 0 first."""
    n = ctx.world_size
    return [(rank + k) % n for k in range(1, n)]


@register("broadcast", "direct")
def broadcast(ctx: Context) -> None:
    """Root sends its buffer to each rank."""
    root, count = ctx.root, ctx.count
    for peer in _others(ctx, root):
        ctx.send(root, peer, ctx.region(Buf.IN), count)
        ctx.recv(peer, root, ctx.region(Buf.OUT), count)
    if not ctx.inplace:
        ctx.copy(root, ctx.region(Buf.IN), ctx.region(Buf.OUT), count)


@register("scatter", "direct")
def scatter(ctx: Context) -> None:
    """Root sends block j of its input to rank j."""
    root, count = ctx.root, ctx.count
    for peer in _others(ctx, root):
        ctx.send(root, peer, ctx.block_region(Buf.IN, peer), count)
        ctx.recv(peer, root, ctx.region(Buf.OUT), count)
    if not ctx.inplace:
        ctx.copy(root, ctx.block_region(Buf.IN, root), ctx.region(Buf.OUT), count)


@register("gather", "direct")
def gather(ctx: Context) -> None:
    """Each rank sends its input to the root, which stores it as block j."""
    root, count = ctx.root, ctx.count
    for peer in _others(ctx, root):
        ctx.send(peer, root, ctx.region(Buf.IN), count)
    for peer in _others(ctx, root):
        ctx.recv(root, peer, ctx.block_region(Buf.OUT, peer), count)
    if not ctx.inplace:
        ctx.copy(root, ctx.region(Buf.IN), ctx.block_region(Buf.OUT, root), count)


@register("allgather", "direct")
def allgather(ctx: Context) -> None:
    """Each rank sends its input to every rank."""
    count = ctx.count
    for rank in range(ctx.world_size):
        for peer in _others(ctx, rank):
            ctx.send(rank, peer, ctx.region(Buf.IN), count)
        if not ctx.inplace:  # right after the send, with which it fuses (plan.passes)
            ctx.copy(rank, ctx.region(Buf.IN), ctx.block_region(Buf.OUT, rank), count)
        for peer in _others(ctx, rank):
            ctx.recv(rank, peer, ctx.block_region(Buf.OUT, peer), count)


@register("alltoall", "direct")
def alltoall(ctx: Context) -> None:
    """Each rank sends block j of its input to rank j."""
    count = ctx.count
    for rank in range(ctx.world_size):
        for peer in _others(ctx, rank):
            ctx.send(rank, peer, ctx.block_region(Buf.IN, peer), count)
        if not ctx.inplace:  # while the peers' messages are on their way
            ctx.copy(rank, ctx.block_region(Buf.IN, rank), ctx.block_region(Buf.OUT, rank), count)
        for peer in _others(ctx, rank):
            ctx.recv(rank, peer, ctx.block_region(Buf.OUT, peer), count)


@register("reduce", "direct")
def reduce(ctx: Context) -> None:
    """Each rank sends its input to the root, which combines them in rank order."""
    root, count = ctx.root, ctx.count
    for peer in _others(ctx, root):
        ctx.send(peer, root, ctx.region(Buf.IN), count)
    accumulate_in_rank_order(
        ctx,
        root,
        ctx.region(Buf.IN),
        ctx.region(Buf.OUT),
        count,
        list(range(ctx.world_size)),
        acc_aliases_own=ctx.inplace,
    )


def _two_ranks(query: Query, size: int) -> bool:
    """``Algorithm.auto_prefer`` for allreduce: at 2 ranks, at every size, one round of whole
    pieces beats the rings' two rounds of halves; the model says otherwise from 16 KiB. On
    buffers from ``comm.alloc`` it holds below 64 KiB only: above, zerocopy, which copies nothing,
    is the model's to weigh (``tests/mp/test_zerocopy.py``). Where cma
    is weighed too and prefers the call, cma runs (``select.decide``: the preference weighed from
    the larger size wins), so on a machine whose kernel copies faster than its rings this rule
    holds below cma's 64 KiB only. Measured: an AMD VM (stop 31, ``shmcoll bench -n 2 -c
    allreduce -a auto,direct,ring,... --both``, 2 launches), 16 KiB 3.4-3.5 us against 4.0 for
    ``ring``, 64 KiB 10.2-10.7 against 11.8-12.0, in place and out of place alike; the Zen 5 VM,
    where cma is not weighed at 2 ranks (``-a auto,ring,direct -b 16K -e 64M -f 4``, 3 launches,
    ring / direct of the medians): in place 1.30 at 64 KiB, 1.26 at 256 KiB, 1.15 at 1 MiB, 1.16
    at 4 MiB, 1.11 at 16 MiB, 1.01 at 64 MiB (and from 32 to 256 MiB no launch had ring faster),
    out of place 1.17, 1.03, 1.02, 0.93, 0.96, 1.01. A tune table's measurements still decide."""
    return query.world_size == 2 and (size < 64 << 10 or not query.registered)


@register("allreduce", "direct", auto_prefer=_two_ranks)
def allreduce(ctx: Context) -> None:
    """Each rank sends its input to every rank; every rank combines all in rank order."""
    count = ctx.count
    contributors = list(range(ctx.world_size))
    for rank in contributors:
        for peer in _others(ctx, rank):
            ctx.send(rank, peer, ctx.region(Buf.IN), count)
        accumulate_in_rank_order(
            ctx,
            rank,
            ctx.region(Buf.IN),
            ctx.region(Buf.OUT),
            count,
            contributors,
            acc_aliases_own=ctx.inplace,
        )


@register("reduce_scatter", "direct")
def reduce_scatter(ctx: Context) -> None:
    """Each rank sends block j of its input to rank j, which combines them in rank order."""
    count = ctx.count
    contributors = list(range(ctx.world_size))
    for rank in contributors:
        for peer in _others(ctx, rank):
            ctx.send(rank, peer, ctx.block_region(Buf.IN, peer), count)
        accumulate_in_rank_order(
            ctx,
            rank,
            ctx.block_region(Buf.IN, rank),
            ctx.region(Buf.OUT),
            count,
            contributors,
            acc_aliases_own=ctx.inplace,
        )


@register("barrier", "direct", piece=lambda slot_capacity, world_size: 1)
def barrier(ctx: Context) -> None:
    """Dissemination barrier: in round k each rank signals rank + 2^k; ceil(log2 n) rounds."""
    n = ctx.world_size
    distance = 1
    while distance < n:
        for rank in range(n):
            ctx.send(rank, (rank + distance) % n, None, 0)
            ctx.recv(rank, (rank - distance) % n, None, 0)
        distance *= 2


# --- prefix reductions ------------------------------------------------------------------------
@register("scan", "direct")
def scan(ctx: Context) -> None:
    """Each rank sends its input to every later rank; rank r combines x0 .. xr in rank order."""
    n, count = ctx.world_size, ctx.count
    # In place, ranks from 2 on keep the running value apart from their own input until they
    # have used it (one region serves every rank: scratch is private to each).
    scratch = ctx.tmp(count) if ctx.inplace and n > 2 else None
    for rank in range(n):
        for peer in range(rank + 1, n):
            ctx.send(rank, peer, ctx.region(Buf.IN), count)
        if rank == 0:
            if not ctx.inplace:
                ctx.copy(0, ctx.region(Buf.IN), ctx.region(Buf.OUT), count)
            continue
        accumulate_in_rank_order(
            ctx,
            rank,
            ctx.region(Buf.IN),
            ctx.region(Buf.OUT),
            count,
            list(range(rank + 1)),
            acc_aliases_own=ctx.inplace,
            final=False,
            scratch=scratch,
        )


@register("exscan", "direct")
def exscan(ctx: Context) -> None:
    """Each rank sends its input to every later rank; rank r >= 1 combines x0 .. x(r-1) in rank
    order; rank 0's output is left alone."""
    n, count = ctx.world_size, ctx.count
    for rank in range(n):
        for peer in range(rank + 1, n):
            ctx.send(rank, peer, ctx.region(Buf.IN), count)
        # Our own input has left before anything is received, so in place the result may
        # overwrite it at once.
        if rank == 1:
            ctx.recv(1, 0, ctx.region(Buf.OUT), count)
        elif rank > 1:
            accumulate_in_rank_order(
                ctx,
                rank,
                ctx.region(Buf.IN),  # not a contributor: never read
                ctx.region(Buf.OUT),
                count,
                list(range(rank)),
                acc_aliases_own=False,
                final=False,
            )


# --- variable counts ----------------------------------------------------------------------------
# The whole call is one plan (``passes.plan_call``): blocks are cut into slot-sized fragments
# here, and round f moves fragment f of every block that has one. A rank posts its sends of a
# round (at most one message per channel) before its receives, so with one slot per ring a
# send waits at most for the previous round's message to be taken: no deadlock, whatever the
# counts. Every message carries its block's count + 1 as its tag.
def _frags(ctx: Context, counts: tuple[int, ...] | list[int]) -> list[list[tuple[int, int]]]:
    return [fragments(c, ctx.slot_capacity) for c in counts]


def _rounds(frags: list[list[tuple[int, int]]]) -> range:
    return range(max((len(f) for f in frags), default=0))


def _at(buf: Buf, off: int) -> Region:
    return Region(buf, off)


@register("allgatherv", "direct", piece=whole_call)
def allgatherv(ctx: Context) -> None:
    """Each rank sends its block to every rank, one fragment per round."""
    counts = block_counts(ctx)
    at = displs(counts)
    frags = _frags(ctx, counts)
    for f in _rounds(frags):
        for rank in range(ctx.world_size):
            if f < len(frags[rank]):
                off, c = frags[rank][f]
                with tagged(ctx, counts[rank] + 1):
                    for peer in _others(ctx, rank):
                        ctx.send(rank, peer, _at(Buf.IN, off), c)
            for peer in _others(ctx, rank):
                if f < len(frags[peer]):
                    off, c = frags[peer][f]
                    with tagged(ctx, counts[peer] + 1):
                        ctx.recv(rank, peer, _at(Buf.OUT, at[peer] + off), c)
    if not ctx.inplace:  # in place, IN already is OUT's block
        for rank in range(ctx.world_size):
            ctx.copy(rank, _at(Buf.IN, 0), _at(Buf.OUT, at[rank]), counts[rank])


@register("gatherv", "direct", piece=whole_call)
def gatherv(ctx: Context) -> None:
    """Each rank sends its block to the root, one fragment per round."""
    root = ctx.root
    counts = block_counts(ctx)
    at = displs(counts)
    frags = _frags(ctx, counts)
    for f in _rounds(frags):
        for peer in _others(ctx, root):
            if f < len(frags[peer]):
                off, c = frags[peer][f]
                with tagged(ctx, counts[peer] + 1):
                    ctx.send(peer, root, _at(Buf.IN, off), c)
                    ctx.recv(root, peer, _at(Buf.OUT, at[peer] + off), c)
    if not ctx.inplace:
        ctx.copy(root, _at(Buf.IN, 0), _at(Buf.OUT, at[root]), counts[root])


@register("scatterv", "direct", piece=whole_call)
def scatterv(ctx: Context) -> None:
    """Root sends block j of its input to rank j, one fragment per round."""
    root = ctx.root
    counts = block_counts(ctx)
    at = displs(counts)
    frags = _frags(ctx, counts)
    for f in _rounds(frags):
        for peer in _others(ctx, root):
            if f < len(frags[peer]):
                off, c = frags[peer][f]
                with tagged(ctx, counts[peer] + 1):
                    ctx.send(root, peer, _at(Buf.IN, at[peer] + off), c)
                    ctx.recv(peer, root, _at(Buf.OUT, off), c)
    if not ctx.inplace:
        ctx.copy(root, _at(Buf.IN, at[root]), _at(Buf.OUT, 0), counts[root])


@register("reduce_scatterv", "direct", piece=whole_call)
def reduce_scatterv(ctx: Context) -> None:
    """Each rank sends block j of its input to rank j, which combines them in rank order; one
    fragment of every block per round."""
    n = ctx.world_size
    counts = block_counts(ctx)
    at = displs(counts)
    frags = _frags(ctx, counts)
    if n == 1:
        if not ctx.inplace:
            ctx.copy(0, _at(Buf.IN, 0), _at(Buf.OUT, 0), counts[0])
        return
    contributors = list(range(n))
    # In place, a rank from 2 on keeps its running value apart from its own block until it has
    # used it; one fragment's worth serves every fragment and rank.
    held = max((c for r in range(2, n) for _, c in frags[r]), default=0)
    scratch = ctx.tmp(held) if ctx.inplace and held else None
    for f in _rounds(frags):
        for rank in contributors:
            for peer in _others(ctx, rank):
                if f < len(frags[peer]):
                    off, c = frags[peer][f]
                    with tagged(ctx, counts[peer] + 1):
                        ctx.send(rank, peer, _at(Buf.IN, at[peer] + off), c)
            if f < len(frags[rank]):
                off, c = frags[rank][f]
                with tagged(ctx, counts[rank] + 1):
                    accumulate_in_rank_order(
                        ctx,
                        rank,
                        _at(Buf.IN, at[rank] + off),
                        _at(Buf.OUT, off),
                        c,
                        contributors,
                        acc_aliases_own=ctx.inplace,
                        scratch=scratch,
                    )


@register("alltoallv", "direct", piece=whole_call)
def alltoallv(ctx: Context) -> None:
    """Each rank sends its block for rank j to rank j, one fragment of every block per round."""
    n = ctx.world_size
    for rank in range(n):
        # Only this rank's row (what it sends) and column (what it receives) of the matrix.
        sends = [pair_count(ctx, rank, j) for j in range(n)]
        recvs = [pair_count(ctx, i, rank) for i in range(n)]
        send_at, recv_at = displs(sends), displs(recvs)
        out_frags, in_frags = _frags(ctx, sends), _frags(ctx, recvs)
        for f in _rounds(out_frags + in_frags):
            for peer in _others(ctx, rank):
                if f < len(out_frags[peer]):
                    off, c = out_frags[peer][f]
                    with tagged(ctx, sends[peer] + 1):
                        ctx.send(rank, peer, _at(Buf.IN, send_at[peer] + off), c)
            for peer in _others(ctx, rank):
                if f < len(in_frags[peer]):
                    off, c = in_frags[peer][f]
                    with tagged(ctx, recvs[peer] + 1):
                        ctx.recv(rank, peer, _at(Buf.OUT, recv_at[peer] + off), c)
        ctx.copy(rank, _at(Buf.IN, send_at[rank]), _at(Buf.OUT, recv_at[rank]), sends[rank])
