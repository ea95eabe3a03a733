"""``zerocopy``: ranks read each other's registered buffers in place; no data goes through slots.

Buffers from ``comm.alloc`` live in shared memory that every rank maps, so a rank can combine or
copy a peer's input straight into its own output: the sender's copy into a slot disappears, and
so do the slot-size pieces (a call is one piece). The rings carry only zero-byte messages, used
for synchronisation: a *sync* is a dissemination barrier (``ceil(log2 n)`` rounds), after which
every rank has heard, transitively, from every other. Three rules make the reads safe, and the
verifier checks them with vector clocks:

- a peer's buffer is read only after a sync that follows the peer's entry into the call (before
  it the peer may still be filling it);
- a rank overwrites an element only after a sync that follows every peer's read of it;
- a rank returns only after a sync that follows every peer's read of its buffers (afterwards
  the user may overwrite them).

**allreduce**: sync; rank ``r`` combines chunk ``r`` of every rank's input, in rank order, into
its output; sync; it copies every other chunk from the peer that finished it; sync. Each
element is computed once, so results are bitwise identical everywhere. Peers read this rank's
*output* in the second phase, so it must be registered too (or be the input itself).
**reduce_scatter**: the first phase alone, on blocks. **reduce**: the root combines everyone's
input. **broadcast**: every rank copies the root's buffer. **allgather**, **gather**,
**alltoall**: every rank copies what it needs from the others'. (Not scatter: only its root
passes a buffer, so there is no same-place buffer on every rank to read from.)

Rounds: 2 or 3 syncs of ``ceil(log2 n)`` zero-byte rounds each. Bytes moved through the rings:
none. Memory traffic per rank: it reads what it needs from its peers once and writes its output
once. Constraints: every rank passes a registered buffer (``comm.alloc``) at the same place of
the same allocation (``supports`` is told so through ``Query.registered``; each message's PLACE
tag catches ranks that did not, before anything is read).
"""

from __future__ import annotations

from shmcoll.algos.direct import barrier
from shmcoll.algos.registry import Query, register
from shmcoll.plan.builder import Context, split
from shmcoll.plan.ir import PEERS_REGISTERED, Buf, Region

_WHOLE_CALL = 1 << 62  # no slots carry data, so a call is never cut into pieces


def _whole(slot_capacity: int, world_size: int) -> int:
    return _WHOLE_CALL


def _registered(query: Query) -> str | None:
    if not query.registered:
        return "it reads peers' buffers in place: every rank must pass arrays from comm.alloc"
    return None


# Every rank's buffers are ready (or no longer read) once all ranks have passed a barrier:
# the direct algorithm's dissemination barrier of zero-byte messages, emitted into this plan.
sync = barrier


def _combine(ctx: Context, rank: int, sources: list[Region], dst: Region, count: int, own: int | None) -> None:
    """``dst = sources[0] (op) sources[1] (op) ...`` left to right, AVG's division at the end.

    ``own`` is the position of the source that ``dst`` aliases (in place), if any: the running
    value then waits in scratch until that source has been read.
    """
    if len(sources) == 1:
        ctx.copy(rank, sources[0], dst, count)
        return
    acc = ctx.tmp(count) if own is not None and own >= 2 else dst
    for pos in range(1, len(sources)):
        last = pos == len(sources) - 1
        left = sources[0] if pos == 1 else acc
        ctx.reduce_local(rank, left, sources[pos], dst if last else acc, count, final=last)


def _mine_or(rank: int, owner: int, buf: Buf, off: int) -> Region:
    return Region(buf, off) if owner == rank else Region(buf, off, rank=owner)


@register("allreduce", "zerocopy", piece=_whole, supports=_registered, peers=PEERS_REGISTERED)
def allreduce(ctx: Context) -> None:
    """Each rank reduces its chunk from every input, then copies the others' chunks."""
    n, count = ctx.world_size, ctx.count
    chunks = split(count, n)
    sync(ctx)
    for r in range(n):
        off, c = chunks[r]
        sources = [_mine_or(r, j, Buf.IN, off) for j in range(n)]
        _combine(ctx, r, sources, Region(Buf.OUT, off), c, r if ctx.inplace else None)
    sync(ctx)
    for r in range(n):
        for s in range(n):
            if s != r:
                off, c = chunks[s]
                ctx.copy(r, Region(Buf.OUT, off, rank=s), Region(Buf.OUT, off), c)
    sync(ctx)


@register("reduce_scatter", "zerocopy", piece=_whole, supports=_registered, peers=PEERS_REGISTERED)
def reduce_scatter(ctx: Context) -> None:
    """Rank ``r`` reduces block ``r`` of every input."""
    n, count = ctx.world_size, ctx.count
    sync(ctx)
    for r in range(n):
        sources = [_mine_or(r, j, Buf.IN, r * ctx.block) for j in range(n)]
        _combine(ctx, r, sources, Region(Buf.OUT, 0), count, r if ctx.inplace else None)
    sync(ctx)


@register("reduce", "zerocopy", piece=_whole, supports=_registered, peers=PEERS_REGISTERED)
def reduce(ctx: Context) -> None:
    """The root reduces every input."""
    n, root, count = ctx.world_size, ctx.root, ctx.count
    sync(ctx)
    sources = [_mine_or(root, j, Buf.IN, 0) for j in range(n)]
    _combine(ctx, root, sources, Region(Buf.OUT, 0), count, root if ctx.inplace else None)
    sync(ctx)


@register("broadcast", "zerocopy", piece=_whole, supports=_registered, peers=PEERS_REGISTERED)
def broadcast(ctx: Context) -> None:
    """Every rank copies the root's buffer."""
    n, root, count = ctx.world_size, ctx.root, ctx.count
    sync(ctx)
    for r in range(n):
        if r != root:
            ctx.copy(r, Region(Buf.IN, 0, rank=root), Region(Buf.OUT, 0), count)
        elif not ctx.inplace:
            ctx.copy(r, Region(Buf.IN, 0), Region(Buf.OUT, 0), count)
    sync(ctx)


@register("gather", "zerocopy", piece=_whole, supports=_registered, peers=PEERS_REGISTERED)
def gather(ctx: Context) -> None:
    """The root copies every rank's input into its block."""
    n, root, count = ctx.world_size, ctx.root, ctx.count
    sync(ctx)
    for j in range(n):
        if j != root or not ctx.inplace:
            ctx.copy(root, _mine_or(root, j, Buf.IN, 0), Region(Buf.OUT, j * ctx.block), count)
    sync(ctx)


@register("allgather", "zerocopy", piece=_whole, supports=_registered, peers=PEERS_REGISTERED)
def allgather(ctx: Context) -> None:
    """Every rank copies every input into its block."""
    n, count = ctx.world_size, ctx.count
    sync(ctx)
    for r in range(n):
        for j in range(n):
            if j != r or not ctx.inplace:
                ctx.copy(r, _mine_or(r, j, Buf.IN, 0), Region(Buf.OUT, j * ctx.block), count)
    sync(ctx)


@register("alltoall", "zerocopy", piece=_whole, supports=_registered, peers=PEERS_REGISTERED)
def alltoall(ctx: Context) -> None:
    """Rank ``r`` copies block ``r`` of every input. In place, a block a peer still has to read
    is this rank's own input: gather into scratch, sync, then write the output."""
    n, count = ctx.world_size, ctx.count
    staging = ctx.tmp(n * count) if ctx.inplace else None
    sync(ctx)
    for r in range(n):
        for j in range(n):
            src = _mine_or(r, j, Buf.IN, r * ctx.block)
            if staging is None:
                ctx.copy(r, src, Region(Buf.OUT, j * ctx.block), count)
            elif j != r:
                ctx.copy(r, src, Region(Buf.TMP, staging.off + j * count), count)
    # The middle sync is needed only in place, but ranks choose in place independently, and
    # their messages must not depend on it.
    sync(ctx)
    if staging is not None:
        for r in range(n):
            for j in range(n):
                if j != r:
                    ctx.copy(r, Region(Buf.TMP, staging.off + j * count), Region(Buf.OUT, j * ctx.block), count)
    sync(ctx)
