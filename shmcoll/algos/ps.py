"""``ps``: the parameter-server pattern. One server does all the work.

**allreduce** (server = rank 0): every worker sends its buffer to the server, the server
combines the ``n`` contributions in rank order, ``((x0 (op) x1) (op) x2) ...`` with AVG's
division on the last combination (``builder.accumulate_in_rank_order``), then sends the result
back to every worker, one after another. **reduce** (server = root) is the first half,
**broadcast** (server = root) the second.

Kept as the textbook baseline that shows why it stops scaling: the server receives ``(n-1) V``
and sends ``(n-1) V`` per piece of ``V`` elements while a worker sends and receives only ``V``,
so time grows linearly in ``n`` at the server's bandwidth, and every reduction runs on one
core. It is deliberately not pipelined cleverly or spread over ranks.

Rounds: 2 for allreduce (gather to the server, then return), 1 for reduce and broadcast, with
the server's ``n - 1`` messages each way serialised. Bytes sent per piece: ``V`` per worker and
``(n-1) V`` by the server (allreduce, broadcast); ``V`` per worker and none by the server
(reduce). Constraints: none; every step moves one whole piece, so a piece is one slot. The
result is computed once, at the server, and only copied: bitwise identical on every rank.
"""

from __future__ import annotations

from shmcoll.algos.registry import register
from shmcoll.plan.builder import Context, accumulate_in_rank_order
from shmcoll.plan.ir import Buf


def _workers(ctx: Context, server: int) -> list[int]:
    return [r for r in range(ctx.world_size) if r != server]


def _gather_and_reduce(ctx: Context, server: int) -> None:
    """Workers push their input; the server folds all inputs into its OUT, in rank order."""
    for worker in _workers(ctx, server):
        ctx.send(worker, server, ctx.region(Buf.IN), ctx.count)
    # In place, the server's running value would overwrite its own input before it is used
    # unless the helper keeps it in scratch (``acc_aliases_own``).
    accumulate_in_rank_order(
        ctx,
        server,
        ctx.region(Buf.IN),
        ctx.region(Buf.OUT),
        ctx.count,
        list(range(ctx.world_size)),
        acc_aliases_own=ctx.inplace,
    )


def _serve(ctx: Context, server: int, src: Buf) -> None:
    """The server sends ``src`` to each worker in turn. Right after the reduction, the first
    send follows the final recv-reduce into OUT and is fused with it."""
    for worker in _workers(ctx, server):
        ctx.send(server, worker, ctx.region(src), ctx.count)
        ctx.recv(worker, server, ctx.region(Buf.OUT), ctx.count)


@register("allreduce", "ps")
def allreduce(ctx: Context) -> None:
    """Workers push to rank 0, which reduces in rank order and sends the result to each."""
    _gather_and_reduce(ctx, 0)
    _serve(ctx, 0, Buf.OUT)


@register("reduce", "ps")
def reduce(ctx: Context) -> None:
    """Workers push to the root, which reduces in rank order."""
    _gather_and_reduce(ctx, ctx.root)


@register("broadcast", "ps")
def broadcast(ctx: Context) -> None:
    """The root sends its buffer to each worker in turn."""
    _serve(ctx, ctx.root, Buf.IN)
    if not ctx.inplace:
        ctx.copy(ctx.root, ctx.region(Buf.IN), ctx.region(Buf.OUT), ctx.count)
