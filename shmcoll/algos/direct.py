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
"""

from __future__ import annotations

from shmcoll.algos.registry import register
from shmcoll.plan.builder import Context, accumulate_in_rank_order
from shmcoll.plan.ir import Buf


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
        for peer in _others(ctx, rank):
            ctx.recv(rank, peer, ctx.block_region(Buf.OUT, peer), count)
        if not ctx.inplace:
            ctx.copy(rank, ctx.region(Buf.IN), ctx.block_region(Buf.OUT, rank), count)


@register("alltoall", "direct")
def alltoall(ctx: Context) -> None:
    """Each rank sends block j of its input to rank j."""
    count = ctx.count
    for rank in range(ctx.world_size):
        for peer in _others(ctx, rank):
            ctx.send(rank, peer, ctx.block_region(Buf.IN, peer), count)
        for peer in _others(ctx, rank):
            ctx.recv(rank, peer, ctx.block_region(Buf.OUT, peer), count)
        if not ctx.inplace:
            ctx.copy(rank, ctx.block_region(Buf.IN, rank), ctx.block_region(Buf.OUT, rank), count)


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


@register("allreduce", "direct")
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


@register("p2p", "direct")
def p2p(ctx: Context) -> None:
    """Point to point: ``root`` sends its input to ``peer``'s output."""
    ctx.send(ctx.root, ctx.peer, ctx.region(Buf.IN), ctx.count)
    ctx.recv(ctx.peer, ctx.root, ctx.region(Buf.OUT), ctx.count)
