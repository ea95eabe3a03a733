"""``cma``: cross-memory attach; each rank copies what it needs straight out of its peers' buffers.

The rings copy every byte twice: the sender into a slot, the receiver out of it. With
cross-memory attach (``process_vm_readv``, see :mod:`shmcoll.shm.cma`) the kernel copies from a
peer's own buffer, ordinary numpy memory included, into the caller's: one copy, and the ranks
copy at the same time. The plans are :mod:`~shmcoll.algos.zerocopy`'s copy plans (regions on
other ranks, dissemination syncs of zero-byte messages, the same three safety rules, checked by
the verifier); only the way the engine reaches a peer's region differs: each rank publishes its
buffers' addresses when it enters the call, and a copy from a peer's region is one system call
(``ir.PEERS_CMA``).

**broadcast**: every rank copies the root's buffer. **allgather**, **gather**: every rank (the
root) copies each peer's input into its block. **alltoall**: rank ``r`` copies block ``r`` of
every input. **scatter**: rank ``r`` copies block ``r`` of the root's input.

Rounds: 2 syncs (3 for alltoall) of ``ceil(log2 n)`` zero-byte rounds each. Bytes through the
rings: none. Memory traffic per rank: it reads what it needs once and writes its output once.
Constraints: only copies (a reduction would need the peer's data in this process first, which
is what the rings do); cross-memory attach must be permitted (``Query.cma``); ``auto`` considers
it from ``AUTO_FROM_BYTES`` on (a system call per block costs about a microsecond, which the cost
model does not see) and weighs it against the rings there with the model or the tune table's
measurements; asked for by name it serves any size.
"""

from __future__ import annotations

from shmcoll.algos import zerocopy
from shmcoll.algos.registry import Query, register
from shmcoll.plan.builder import Context
from shmcoll.plan.ir import Buf, Region

AUTO_FROM_BYTES = 64 << 10
"""Smallest call (``select.call_size``) for which ``auto`` weighs cma."""


def _permitted(query: Query) -> str | None:
    if query.registered:
        return "buffers from comm.alloc are read in place by zerocopy"
    if not query.cma:
        return "cross-memory attach is not permitted here (see `shmcoll info`)"
    return None


_whole = zerocopy._whole  # no slots carry data, so a call is never cut into pieces


@register("broadcast", "cma", piece=_whole, supports=_permitted, auto_from_bytes=AUTO_FROM_BYTES)
def broadcast(ctx: Context) -> None:
    """Every rank copies the root's buffer."""
    zerocopy.broadcast(ctx)


@register("allgather", "cma", piece=_whole, supports=_permitted, auto_from_bytes=AUTO_FROM_BYTES)
def allgather(ctx: Context) -> None:
    """Every rank copies every input into its block."""
    zerocopy.allgather(ctx)


@register("gather", "cma", piece=_whole, supports=_permitted, auto_from_bytes=AUTO_FROM_BYTES)
def gather(ctx: Context) -> None:
    """The root copies every rank's input into its block."""
    zerocopy.gather(ctx)


@register("alltoall", "cma", piece=_whole, supports=_permitted, auto_from_bytes=AUTO_FROM_BYTES)
def alltoall(ctx: Context) -> None:
    """Rank ``r`` copies block ``r`` of every input (through scratch when in place)."""
    zerocopy.alltoall(ctx)


@register("scatter", "cma", piece=_whole, supports=_permitted, auto_from_bytes=AUTO_FROM_BYTES)
def scatter(ctx: Context) -> None:
    """Rank ``r`` copies block ``r`` of the root's input; the root, its own unless in place."""
    n, root, count = ctx.world_size, ctx.root, ctx.count
    zerocopy.sync(ctx)
    for r in range(n):
        if r != root:
            ctx.copy(r, Region(Buf.IN, r * ctx.block, rank=root), Region(Buf.OUT, 0), count)
        elif not ctx.inplace:
            ctx.copy(r, Region(Buf.IN, r * ctx.block), Region(Buf.OUT, 0), count)
    zerocopy.sync(ctx)
