"""``ring``: every rank talks only to its neighbours, ``rank - 1`` (left) and ``rank + 1`` (right).

**allreduce** is a reduce-scatter followed by an allgather, both around the ring. A piece is cut
into ``n`` chunks. In reduce-scatter step ``j`` (``0 <= j < n-1``) rank ``r`` sends chunk
``r - j`` to the right and receives chunk ``r - j - 1`` from the left, combining it with its own
copy; after ``n-1`` steps rank ``r`` holds chunk ``r + 1`` fully reduced. Allgather step ``t``
then sends chunk ``r + 1 - t`` and receives chunk ``r - t``, stored and forwarded unchanged. Chunk
``k`` is folded in ring order starting at rank ``k``, ``((x_k (op) x_k+1) (op) ...) (op) x_k-1``,
by exactly one rank (the one that applies ``final``, AVG's division); every other rank receives
copies of that result, so results are bitwise identical everywhere.

Each received-and-forwarded value is written as "receive (and reduce) into R, then send R", which
``passes.fuse`` turns into one step that reads the incoming slot once and writes the outgoing slot
directly. Partial sums go to scratch, whose store the fuse pass then drops: a reduce-scatter step
reads one slot and the input and writes one slot, nothing else; an allgather step reads one slot
and writes the output and one slot. At each step index one rank keeps the two apart (it stores,
then re-reads from cache) so that the ring cannot deadlock with one slot per ring; see ``_take``.

**reduce_scatter** is allreduce's first phase on blocks (rank ``r`` ends with block ``r``);
**allgather** its second phase on blocks.

**broadcast** and **reduce** are pipelined chains: ``root, root+1, ..., root-1`` for broadcast
(each rank receives a piece and forwards it), ``root+1, ..., root-1, root`` for reduce (each rank
adds its own value and forwards; the root finishes). Pipelining comes from the pieces: a rank
forwards piece ``p`` while its predecessor already sends piece ``p + 1``, so a call of many pieces
costs about ``pieces + n - 2`` hops rather than ``pieces * (n - 1)``.

**scan** and **exscan** are pipelined chains ``0 -> 1 -> ... -> n-1`` like reduce: rank ``r``
receives the running prefix from ``r-1``, combines it with its own value (received value on the
left, so every result is ``((x0 (op) x1) (op) ...) (op) xr``) and forwards it. scan stores what
it forwards; exscan stores what it received and forwards ``prefix(r-1) (op) x_r``, a local
reduce that goes straight into the slot (in place, the received prefix waits in scratch until
the input it overwrites has been combined).

**allgatherv** runs allgather's ring on slot-sized fragments of the variable-size blocks
(``ctx.counts``, the whole call in one plan): pass ``f`` takes the ``f``-th fragment of every
block that has one around the ring, ``n-1`` steps, and a block without one is simply skipped
by every rank. As in allgather, at step ``t`` of a pass rank ``t`` keeps its receive and
forward apart when rings have one slot: the ring could deadlock only if every rank sat in a
fused step of the same step index. Its messages carry the block's count + 1 as their tag
(``Step.tag``).

Rounds per piece (``n`` ranks): allreduce ``2(n-1)``; reduce_scatter, allgather ``n-1``;
broadcast, reduce, scan and exscan ``n-1`` (chain latency; ``1`` in steady state when
pipelined); allgatherv ``n-1`` per pass, ``ceil(max count / slot)`` passes.
Bytes sent per rank, for ``V`` bytes per rank's vector: allreduce ``2 (n-1)/n V``;
reduce_scatter and allgather ``(n-1) B`` for blocks of ``B`` bytes (``(n-1)/n`` of
reduce_scatter's input); broadcast, reduce, scan and exscan ``V`` on every rank but the
chain's end (0); allgatherv ``sum(counts) - counts[r+1]`` elements.
Constraints: none; every world size, count (0 included), root and in-place combination. An
allreduce piece is ``n`` slots' worth (each chunk one slot), the others one slot per block;
allgatherv is never cut into pieces (it cuts its own messages).
"""

from __future__ import annotations

import dataclasses

from shmcoll.algos.registry import Query, register
from shmcoll.plan.builder import Context, block_counts, displs, fragments, split, tagged, whole_call
from shmcoll.plan.ir import Buf, Region, Step


def _allreduce_piece(slot_capacity: int, world_size: int) -> int:
    # n chunks of at most one slot each: every step moves one chunk.
    return world_size * slot_capacity


def _at(buf: Buf, off: int = 0) -> Region:
    return Region(buf, off)


@dataclasses.dataclass(frozen=True)
class _Hop:
    """One message a rank takes from its left neighbour: where it goes, and whether it moves on."""

    count: int
    dst: Region
    own: Region | None = None  # combine with this local value (the received one on the left)
    final: bool = False
    forward: bool = True


def _partials(ctx: Context, hops: int, count: int) -> list[Region]:
    """Scratch for the partial sums of reduce-scatter steps ``1..hops``, one region per step.

    Each is forwarded as soon as it is made, so the fuse pass drops the store and no scratch is
    ever written (but at a held step). Separate regions are what lets it: fuse keeps a scratch
    store if any later step reads the same region, even after overwriting it.
    """
    return [ctx.tmp(count) for _ in range(hops)]


def _take(ctx: Context, rank: int, hops: list[_Hop]) -> None:
    """Rank ``rank``'s receives from the left in a ring pass (after its first send to the right).

    Why some steps stay unfused: a fused receive-and-forward needs an incoming message *and* a
    free outgoing slot at once. After every rank's first send, each ring channel holds one
    message; with one slot per ring (allowed, and what the verifier tries first) every channel
    is then full and no fused step can start: deadlock. If at each step index one rank receives
    first and sends afterwards, its receive frees a slot, the others fire one after another
    behind it, and its send follows. Which rank does that rotates with the step index, so the
    small cost (the forwarded value is stored, then read back from cache) is spread evenly; with
    more slots nobody waits on it.
    """
    n = ctx.world_size
    left, right = (rank - 1) % n, (rank + 1) % n
    for j, hop in enumerate(hops, start=1):
        if hop.own is None:
            ctx.recv(rank, left, hop.dst, hop.count)
        else:
            ctx.recv_reduce(rank, left, hop.own, hop.dst, hop.count, final=hop.final, received_left=True)
        if hop.forward:
            if (j - 1) % n == rank:
                ctx.no_fuse(rank)
            ctx.send(rank, right, hop.dst, hop.count)


@register("allreduce", "ring", piece=_allreduce_piece)
def allreduce(ctx: Context) -> None:
    """Reduce-scatter then allgather around the ring; ``2(n-1)`` steps, ``2(n-1)/n`` of the data sent."""
    n, count = ctx.world_size, ctx.count
    if n == 1:
        if not ctx.inplace:
            ctx.copy(0, _at(Buf.IN), _at(Buf.OUT), count)
        return
    chunks = split(count, n)
    partials = _partials(ctx, n - 2, chunks[0][1])
    for r in range(n):
        hops = []
        for j in range(1, n):
            off, c = chunks[(r - j) % n]
            last = j == n - 1
            # Reduce-scatter step j: chunk r - j, folded so far from rank r - j on. The last one
            # (chunk r + 1) is finished here, once, and its forward is allgather step 0. In
            # place, IN[off] is read for the only time in the step that may overwrite it,
            # element by element: safe.
            acc = _at(Buf.OUT, off) if last else partials[j - 1]
            hops.append(_Hop(c, acc, own=_at(Buf.IN, off), final=last))
        for t in range(n - 1):
            # Allgather step t: chunk r - t, finished elsewhere; store it and pass it on.
            off, c = chunks[(r - t) % n]
            hops.append(_Hop(c, _at(Buf.OUT, off), forward=t < n - 2))
        off, c = chunks[r]
        ctx.send(r, (r + 1) % n, _at(Buf.IN, off), c)
        _take(ctx, r, hops)


@register("reduce_scatter", "ring")
def reduce_scatter(ctx: Context) -> None:
    """Block ``k`` travels the ring from rank ``k+1``, gaining a term per hop; ``n-1`` steps."""
    n, count = ctx.world_size, ctx.count
    if n == 1:
        if not ctx.inplace:
            ctx.copy(0, ctx.block_region(Buf.IN, 0), _at(Buf.OUT), count)
        return
    partials = _partials(ctx, n - 2, count)
    for r in range(n):
        hops = []
        for j in range(1, n):
            block = (r - 1 - j) % n
            last = j == n - 1  # then block == r
            # In place, OUT is IN's block r: read and overwritten only in this last step.
            acc = _at(Buf.OUT) if last else partials[j - 1]
            hops.append(_Hop(count, acc, own=ctx.block_region(Buf.IN, block), final=last, forward=not last))
        # One block behind allreduce's schedule, so that the last block in is our own.
        ctx.send(r, (r + 1) % n, ctx.block_region(Buf.IN, (r - 1) % n), count)
        _take(ctx, r, hops)


@register("allgather", "ring")
def allgather(ctx: Context) -> None:
    """Each rank forwards the block it received last; ``n-1`` steps of one block."""
    n, count = ctx.world_size, ctx.count
    for r in range(n):
        # Our own block goes out first, so the ring starts moving before the local copy.
        if n > 1:
            ctx.send(r, (r + 1) % n, _at(Buf.IN), count)
        if not ctx.inplace:
            # In place, IN already is OUT's block r.
            ctx.copy(r, _at(Buf.IN), ctx.block_region(Buf.OUT, r), count)
        # Step t: block r - 1 - t arrives, and moves on unless it has gone all the way round.
        _take(
            ctx, r, [_Hop(count, ctx.block_region(Buf.OUT, (r - 1 - t) % n), forward=t < n - 2) for t in range(n - 1)]
        )


@register("broadcast", "ring")
def broadcast(ctx: Context) -> None:
    """Chain ``root -> root+1 -> ... -> root-1``: receive a piece, forward it."""
    n, root, count = ctx.world_size, ctx.root, ctx.count
    chain = [(root + i) % n for i in range(n)]
    if n > 1:
        ctx.send(root, chain[1], _at(Buf.IN), count)
    if not ctx.inplace:
        ctx.copy(root, _at(Buf.IN), _at(Buf.OUT), count)
    # A chain has no cycle, so every forward may fuse: the last rank only receives, and the
    # others drain towards it whatever the number of slots.
    for i in range(1, n):
        rank = chain[i]
        ctx.recv(rank, chain[i - 1], _at(Buf.OUT), count)
        if i < n - 1:
            ctx.send(rank, chain[i + 1], _at(Buf.OUT), count)


# Below this call size ``auto`` leaves reduce's chain out where ranks outnumber the cores.
_CHAIN_REDUCE_OUTNUMBERED_UNTIL = 16 << 20


def _chain_outnumbered(query: Query, size: int) -> bool:
    """``Algorithm.auto_skip`` for reduce: not where ranks outnumber the machine's cores
    (``Query.cores``) at most twice over: below 16 MiB, and at any size where they are fewer than
    twice the cores. The built-in model took the chain from 128 KiB;
    there every piece waits at each of the chain's ``n-1`` links for the next rank to get a core,
    where ``dbtree``'s two trees wait at ``log2 n`` links.

    Measured on the 2-core Zen 4 VM (stop 49, ``shmcoll bench -c reduce -a ring,dbtree --both``,
    sizes 256 KiB to 8 MiB, the order turned between launches; ``ring``'s time over ``dbtree``'s
    in the same launch):
    - 3 ranks, 9 launches, 90 points: geometric mean 1.28, the chain slower at 82 and more than
      1.1x slower at 69;
    - 4 ranks, 10 launches, 120 points: geometric mean 1.17, slower at 79 (more than 1.1x at 68),
      under 0.9x at 18, mostly in the two launches that ran in a slow spell (the rings' hand-offs
      3-5x slower), where the two tie (0.93-1.04 per launch);
    - 8 ranks, 5 launches, 48 points: geometric mean 0.88, the chain faster at 39: so from three
      ranks a core the model decides, as it does from 16 MiB at twice as many ranks as cores (4
      ranks: 0.98-1.17 at 8-16 MiB, 1.01-1.23 at 32-64 MiB);
    - 3 ranks from 16 MiB (stop 50, ``-a ring,dbtree -b 16M -e 64M --both``, 3 launches, and 8
      launches of 16 MiB in place beside ``auto`` and ``cma``): the chain 0.99-1.46, slower at 17
      of 18 points of the first and in all 8 of the second (1.07-1.48)."""
    cores, n = query.cores, query.world_size
    return bool(cores) and cores < n <= 2 * cores and (size < _CHAIN_REDUCE_OUTNUMBERED_UNTIL or n < 2 * cores)


@register("reduce", "ring", auto_skip=_chain_outnumbered)
def reduce(ctx: Context) -> None:
    """Chain ``root+1 -> ... -> root-1 -> root``: add your value, forward; the root finishes."""
    n, root, count = ctx.world_size, ctx.root, ctx.count
    if n == 1:
        if not ctx.inplace:
            ctx.copy(root, _at(Buf.IN), _at(Buf.OUT), count)
        return
    chain = [(root + 1 + i) % n for i in range(n)]
    # Ranks other than the root have no output buffer: their partial sums live in scratch
    # (and, being forwarded at once, the fuse pass drops even that store).
    partial = ctx.tmp(count)
    ctx.send(chain[0], chain[1], _at(Buf.IN), count)
    for i in range(1, n):
        rank = chain[i]
        last = i == n - 1  # rank == root
        acc = _at(Buf.OUT) if last else partial
        ctx.recv_reduce(rank, chain[i - 1], _at(Buf.IN), acc, count, final=last, received_left=True)
        if not last:
            ctx.send(rank, chain[i + 1], acc, count)


def _forwards_outnumbered(query: Query, size: int) -> bool:
    """``Algorithm.auto_skip`` for allgatherv: not where ranks outnumber the machine's cores
    (``Query.cores``). Each fragment is forwarded ``n-2`` times, and each forward waits for the
    rank it goes to to get a core, while ``direct``'s ``n-1`` messages per rank all go out at once.
    The built-in model, which prices a hand-off alike either way, had the two within 2-7% and
    took the ring at 1-2 MiB; measured at 4 ranks on the 2-core Zen 5 VM (``auto_vs_best.py -n 4
    -c allgatherv --mode both --repeat 5``, ``ring`` / ``direct``): 1.15-1.74 at every size from 16
    KiB to 4 MiB on 4 KiB pages, 1.25-1.45 from 1 to 16 MiB on huge ones (stop 39 too: 1.21-1.33
    at 1-2 MiB). At 2 ranks the two tie (0.95-1.04), and there nothing is forwarded."""
    return bool(query.cores) and query.world_size > query.cores


@register("allgatherv", "ring", piece=whole_call, auto_skip=_forwards_outnumbered)
def allgatherv(ctx: Context) -> None:
    """allgather's ring on fragments: pass ``f`` sends the ``f``-th fragment of every block that
    has one around the ring; ``n-1`` steps per pass."""
    n = ctx.world_size
    counts = block_counts(ctx)
    at = displs(counts)
    frags = [fragments(c, ctx.slot_capacity) for c in counts]
    for f in range(max((len(x) for x in frags), default=0)):
        for r in range(n):
            right, left = (r + 1) % n, (r - 1) % n
            if n > 1 and f < len(frags[r]):
                off, c = frags[r][f]
                with tagged(ctx, counts[r] + 1):
                    ctx.send(r, right, _at(Buf.IN, off), c)
            if f == 0 and not ctx.inplace:
                # In place, IN already is OUT's block r.
                ctx.copy(r, _at(Buf.IN), _at(Buf.OUT, at[r]), counts[r])
            # Step t: block r - 1 - t arrives, and moves on unless it has gone all the way round.
            for t in range(n - 1):
                block = (r - 1 - t) % n
                if f >= len(frags[block]):
                    continue  # no such fragment: nobody sends or receives it
                off, c = frags[block][f]
                dst = _at(Buf.OUT, at[block] + off)
                with tagged(ctx, counts[block] + 1):
                    ctx.recv(r, left, dst, c)
                    if t < n - 2:
                        # As ``_take`` does: at step t rank t keeps its receive and forward
                        # apart, so that with one slot per ring the ring never fills with
                        # fused steps that each wait for the next one's slot.
                        if t == r:
                            ctx.no_fuse(r)
                        ctx.send(r, right, dst, c)


def _outnumbered(query: Query, size: int) -> bool:
    """``Algorithm.auto_prefer`` for scan and exscan: the chain at every size where ranks
    outnumber the machine's cores (``Query.cores``). ``direct`` hands its ``n(n-1)/2`` messages
    over in one round, which the built-in model prices as one hand-off; but with more ranks than
    cores each of them waits for its sender to get a core, and rank ``r`` takes ``r`` of them in
    turn, while the chain's ``n-1`` hand-offs each go to the rank just woken. Measured on the
    2-core Zen 5 VM (``benchmarks/auto_vs_best.py -n 3,4,8 -c scan,exscan -e 2M --mode both
    --repeat 5``, two runs, paired over each run's 5 launches; ``direct`` / ``ring`` per size
    and form, 8 B-2 MiB): at 8 ranks 1.16-3.39 in every point; at 3 ranks 1.01-1.48 but for
    scan in the first run (32 B in place 0.93, 8 KiB 0.96-0.98, 32 KiB 0.85-0.86, 512 KiB in
    place 0.89), which a third run of scan (2-256 KiB, 1.04-1.38) did not see again, and exscan
    at 8-32 KiB in place (0.99); at 4 ranks 1.02-1.19 up to 2 KiB in both runs, while from
    8 KiB it depended on the run: 1.02-1.49 in the first (part of a sweep of every collective),
    0.85-1.21 in the second. The model had taken ``direct`` below 128-512 KiB. With a core per
    rank the model decides, as before (not measured here). A tune table's measurements still
    decide."""
    return bool(query.cores) and query.world_size > query.cores


@register("scan", "ring", auto_prefer=_outnumbered)
def scan(ctx: Context) -> None:
    """Chain ``0 -> 1 -> ... -> n-1``: receive the prefix, add your value, store and forward it."""
    n, count = ctx.world_size, ctx.count
    if n > 1:
        ctx.send(0, 1, _at(Buf.IN), count)
    if not ctx.inplace:
        ctx.copy(0, _at(Buf.IN), _at(Buf.OUT), count)
    for r in range(1, n):
        # prefix(r) = prefix(r-1) (op) x_r. In place, IN[i] is read in the step that overwrites
        # it, element by element: safe. A chain has no cycle, so every forward may fuse.
        ctx.recv_reduce(r, r - 1, _at(Buf.IN), _at(Buf.OUT), count, received_left=True)
        if r < n - 1:
            ctx.send(r, r + 1, _at(Buf.OUT), count)


@register("exscan", "ring", auto_prefer=_outnumbered)
def exscan(ctx: Context) -> None:
    """Chain ``0 -> 1 -> ... -> n-1``: store the prefix received, forward it combined with your
    value; rank 0's output is left alone."""
    n, count = ctx.world_size, ctx.count
    if n == 1:
        return
    ctx.send(0, 1, _at(Buf.IN), count)
    # In place, the prefix received must not overwrite our input before it has been combined
    # with it: it waits in scratch and is copied home after the forward.
    held = ctx.tmp(count) if ctx.inplace and n > 2 else None
    for r in range(1, n):
        if r == n - 1:
            ctx.recv(r, r - 1, _at(Buf.OUT), count)
            break
        prefix = held if held is not None else _at(Buf.OUT)
        ctx.recv(r, r - 1, prefix, count)
        # prefix(r) = prefix(r-1) (op) x_r goes straight into the slot to the right.
        ctx.emit(r, Step(count=count, send=r + 1, a=prefix, b=_at(Buf.IN), reduce=True))
        if held is not None:
            ctx.copy(r, held, _at(Buf.OUT), count)
