"""``halving_doubling``: recursive halving and doubling (Rabenseifner's allreduce).

**allreduce** (Rabenseifner). A recursive-halving reduce-scatter: in round ``k`` each rank
exchanges half of the range it is still responsible for with the rank ``pow2 / 2^(k+1)`` away
(in member numbering, below), keeps reducing the half it keeps, and after ``log2 pow2`` rounds
owns one fully reduced chunk of about ``V / pow2`` elements; that final combination applies
AVG's division. Then a recursive-doubling allgather in the reverse order of partners copies the
chunks everywhere. Each output element is therefore computed once, by one rank, and only copied
elsewhere: results are bitwise identical on every rank.

**reduce_scatter** is the first half alone, and **allgather** the second half alone, on blocks
instead of chunks: in round ``k`` a rank sends every block of the range it hands over, one
message per block (within a piece, blocks are not contiguous: each is a sub-range of its own
block of the buffer).

**Any world size.** Let ``pow2`` be the largest power of two ``<= world_size`` and ``rem =
world_size - pow2``. The first ``2 rem`` ranks pair up: each even one (an *extra*) first folds
its data into the odd rank after it (its *partner*), sits out the power-of-two exchange, and
receives the result from its partner last. The ``pow2`` ranks left are *members* ``0..pow2-1``
in rank order, so a range of members covers a contiguous range of ranks and of blocks.

Rounds (message hops on the critical path): allreduce ``2 log2 pow2``, reduce_scatter and
allgather ``log2 pow2``; otherwise plus a fold-in and a fold-out round. Those are 2 more hops
for allreduce; in reduce_scatter and allgather an extra's own block can travel alongside round
0, so the longest chain grows by 1 or 2. A block-wise round of ``b`` blocks is ``b`` messages
each way, alternating send and receive (see ``_exchange``).

Bytes sent per rank per piece, for a power of two ``n`` and a piece of ``V`` elements per block
(so ``V`` elements in all for allreduce): allreduce ``2 (n-1) V / n`` (each half ``V - V/n``);
reduce_scatter and allgather ``(n-1) V``. Otherwise an extra sends ``V`` (allreduce and
allgather) or ``n V`` (reduce_scatter) to its partner, which sends it back ``V`` (allreduce),
``(n-1) V`` (allgather) or ``V`` (reduce_scatter) on top of a member's share.

Constraints: none on world size, count, root or in-place. Messages are at most one slot: an
allreduce piece is two slots, since no message carries more than half of it (the fold in and out
are sent as the two halves of round 0); reduce_scatter and allgather pieces are one slot, one
block per message. Partial values are combined with the lower member's on the left (an
extra's before its partner's), so each element's reduction is one fixed tree of the inputs.

Fusion (``passes.fuse`` turns ``recv-reduce into R; send R`` into one step that writes the
outgoing slot straight from the incoming one): the partner of an extra reduces the extra's half
that it hands over in round 0 and forwards it at once; at the turn from reduce-scatter to
allgather the lower rank of each last pair forwards its final chunk as it computes it; the
partner forwards to its extra what it receives in the last allgather round; and in the
block-wise rounds the block received last is the first one sent on.
"""

from __future__ import annotations

import dataclasses

from shmcoll.algos.registry import register
from shmcoll.plan.builder import Context
from shmcoll.plan.ir import Buf, Region, Step


@dataclasses.dataclass(frozen=True)
class Fold:
    """How ``world_size`` ranks map onto ``pow2`` members (see the module docstring)."""

    world_size: int

    @property
    def pow2(self) -> int:
        return 1 << (self.world_size.bit_length() - 1)

    @property
    def rem(self) -> int:
        return self.world_size - self.pow2

    @property
    def rounds(self) -> int:
        """``log2 pow2``: the rounds of one half (halving or doubling)."""
        return self.pow2.bit_length() - 1

    def member(self, rank: int) -> int | None:
        """The member a rank plays, or ``None`` for an extra."""
        if rank < 2 * self.rem:
            return rank // 2 if rank % 2 else None
        return rank - self.rem

    def rank_of(self, member: int) -> int:
        return 2 * member + 1 if member < self.rem else member + self.rem

    def extra_of(self, member: int) -> int | None:
        """The extra that folds into this member's rank, if any."""
        return 2 * member if member < self.rem else None

    def first_block(self, member: int) -> int:
        """The first block (= rank) that member ``member`` stands for; ``first_block(pow2) == world_size``."""
        return 2 * member if member < self.rem else member + self.rem

    def blocks(self, group: tuple[int, int]) -> range:
        """The blocks a member range ``[lo, hi)`` stands for."""
        return range(self.first_block(group[0]), self.first_block(group[1]))


def group_of(member: int, size: int) -> tuple[int, int]:
    """The aligned member range of ``size`` (a power of two) that contains ``member``."""
    lo = member - member % size
    return lo, lo + size


def chunk_bounds(count: int, parts: int) -> list[int]:
    """Element offsets ``bounds[0..parts]`` of ``parts`` chunks, cut by repeated halving.

    Cutting each range in two, the first half taking the odd element, makes every aligned group
    of chunks (what a rank keeps after a halving round) within one element of half its parent,
    so no halving message exceeds ``ceil(count / 2)``; plain ``split`` could put
    ``count / 2 + parts / 4`` elements in one half.
    """
    bounds = [0] * (parts + 1)
    stack = [(0, parts, 0, count)]
    while stack:
        lo, hi, off, cnt = stack.pop()
        if hi - lo == 1:
            bounds[hi] = off + cnt
            continue
        mid = (lo + hi) // 2
        first = (cnt + 1) // 2
        stack.append((lo, mid, off, first))
        stack.append((mid, hi, off + first, cnt - first))
    return bounds


def _send(peer: int, src: Region, count: int) -> Step:
    return Step(count=count, send=peer, a=src)


def _recv(peer: int, dst: Region, count: int) -> Step:
    return Step(count=count, recv=peer, dst=dst)


def _recv_reduce(peer: int, local: Region, dst: Region, count: int, *, left: bool, final: bool = False) -> Step:
    """``dst = received (op) local`` when the peer's ranks are the lower ones (``left``), else
    ``local (op) received``."""
    if left:
        return Step(count=count, recv=peer, b=local, dst=dst, reduce=True, final=final, recv_left=True)
    return Step(count=count, recv=peer, a=local, dst=dst, reduce=True, final=final)


def _exchange(ctx: Context, rank: int, sends: list[list[Step]], recvs: list[list[Step]]) -> None:
    """Alternate ``sends[i]`` and ``recvs[i]`` with one partner, ending on a receive.

    With one slot per ring a rank cannot post two messages to a peer before the peer takes the
    first; alternating, each side's i-th send needs only the other side's (i-1)-th receive,
    which never waits on anything later, so the exchange cannot deadlock however uneven. The
    side with more sends holds its last receive back to the very end (its partner's last send
    needs only the receive before it), so that every round ends on a receive and the next
    round's first send can fuse with it.
    """
    held = recvs[-1:] if 0 < len(recvs) < len(sends) else []
    recvs = recvs[: len(recvs) - len(held)]
    for i in range(max(len(sends), len(recvs))):
        for items in (sends, recvs):
            if i < len(items):
                for step in items[i]:
                    ctx.emit(rank, step)
    for item in held:
        for step in item:
            ctx.emit(rank, step)


def _two_slots(slot_capacity: int, world_size: int) -> int:
    """Allreduce piece rule: no message carries more than half a piece (see the docstring)."""
    return 2 * slot_capacity if world_size > 1 else slot_capacity


@register("allreduce", "halving_doubling", piece=_two_slots)
def allreduce(ctx: Context) -> None:
    """Rabenseifner: recursive-halving reduce-scatter, then recursive-doubling allgather."""
    n, count = ctx.world_size, ctx.count
    IN, OUT = Buf.IN, Buf.OUT
    if n == 1:
        if not ctx.inplace:
            ctx.copy(0, ctx.region(IN), ctx.region(OUT), count)
        return
    fold = Fold(n)
    p, rounds = fold.pow2, fold.rounds
    bounds = chunk_bounds(count, p)

    def span(group: tuple[int, int]) -> tuple[int, int]:
        return bounds[group[0]], bounds[group[1]] - bounds[group[0]]

    # Where a partner reduces its extra's round-0 half on the way out: fused with the send, so
    # never actually stored.
    fwd = ctx.tmp((count + 1) // 2) if fold.rem else None

    for rank in range(n):
        v = fold.member(rank)
        if v is None:
            # Extra: hand both halves to the partner in the order it consumes them (the half it
            # keeps in round 0, then the half it forwards), get the result back the same way it
            # is produced (the half the partner receives last, then its own).
            partner = rank + 1
            pv = fold.member(partner)
            assert pv is not None
            keep_off, keep_cnt = span(group_of(pv, p // 2))
            give_off, give_cnt = span(group_of(pv ^ (p // 2), p // 2))
            ctx.send(rank, partner, ctx.region(IN, keep_off), keep_cnt)
            ctx.send(rank, partner, ctx.region(IN, give_off), give_cnt)
            ctx.recv(rank, partner, ctx.region(OUT, give_off), give_cnt)
            ctx.recv(rank, partner, ctx.region(OUT, keep_off), keep_cnt)
            continue

        extra = fold.extra_of(v)
        # --- reduce-scatter by recursive halving: partners pow2/2, pow2/4, ..., 1 ---------------
        for k in range(rounds):
            size = p >> (k + 1)
            u = v ^ size
            peer = fold.rank_of(u)
            keep_off, keep_cnt = span(group_of(v, size))
            give_off, give_cnt = span(group_of(u, size))
            if k == 0 and extra is not None:
                # Fold in: (extra (op) mine) on the half kept, into OUT; the half given away is
                # reduced straight into the outgoing slot.
                assert fwd is not None
                kept = ctx.region(OUT, keep_off)
                ctx.emit(rank, _recv_reduce(extra, ctx.region(IN, keep_off), kept, keep_cnt, left=True))
                ctx.emit(rank, _recv_reduce(extra, ctx.region(IN, give_off), fwd, give_cnt, left=True))
                ctx.emit(rank, _send(peer, fwd, give_cnt))
                local = ctx.region(OUT, keep_off)
            else:
                # Round 0 still reads the input; later rounds the partial sums in OUT. In place,
                # OUT[keep] = IN[keep] (op) recv is elementwise, and IN[give] is read before.
                src = Buf.IN if k == 0 else OUT
                ctx.send(rank, peer, ctx.region(src, give_off), give_cnt)
                local = ctx.region(src, keep_off)
            # The last combination of each element applies AVG's division, once.
            final = k == rounds - 1
            ctx.emit(rank, _recv_reduce(peer, local, ctx.region(OUT, keep_off), keep_cnt, left=u < v, final=final))

        # --- allgather by recursive doubling: partners 1, 2, ..., pow2/2 --------------------
        for j in range(rounds):
            size = 1 << j
            u = v ^ size
            peer = fold.rank_of(u)
            mine_off, mine_cnt = span(group_of(v, size))
            theirs_off, theirs_cnt = span(group_of(u, size))
            mine = ctx.region(OUT, mine_off)
            theirs = ctx.region(OUT, theirs_off)
            if j == 0 and u < v:
                # The turn, higher side. The lower side's final recv-reduce is followed by the
                # send of the same chunk, which the fuse pass merges so the chunk leaves as it
                # is computed. Both sides must not: with one slot per ring, each fused step
                # would wait for a slot the other has not yet emptied. A fence keeps the pass
                # from fusing here; sending before receiving keeps the hop count.
                ctx.no_fuse(rank)
            ctx.send(rank, peer, mine, mine_cnt)
            ctx.recv(rank, peer, theirs, theirs_cnt)
            if extra is not None and j == rounds - 1:
                # Fold out, as two halves: the one just received (fused with its receive),
                # then the one this rank already had.
                ctx.send(rank, extra, theirs, theirs_cnt)
                ctx.send(rank, extra, mine, mine_cnt)


def _rs_orders(fold: Fold) -> dict[tuple[int, int], list[int]]:
    """``orders[(member, round)]``: the blocks a member sends in a halving round, in order.

    The receiver hands half of what it receives on in its next round: sending that half last,
    and the receiver sending the block it got last first, puts its receive-reduce right before
    the send of the same block, which the fuse pass merges (best effort: uneven block counts may
    leave a send last in a round).
    """
    p, rounds = fold.pow2, fold.rounds
    orders: dict[tuple[int, int], list[int]] = {}
    for k in range(rounds):
        size = p >> (k + 1)
        for v in range(p):
            u = v ^ size
            give = list(fold.blocks(group_of(u, size)))
            first = None
            if k > 0:
                got = orders[(v ^ (2 * size), k - 1)]
                if got and got[-1] in give:
                    first = got[-1]
            later: set[int] = set()
            if k + 1 < rounds:
                later = set(fold.blocks(group_of(u ^ (size // 2), size // 2)))
            rest = sorted((b for b in give if b != first), key=lambda b: (b in later, b))
            orders[(v, k)] = ([first] if first is not None else []) + rest
    return orders


@register("reduce_scatter", "halving_doubling")
def reduce_scatter(ctx: Context) -> None:
    """Recursive halving over blocks; extras fold all blocks in first and get theirs back last."""
    n, count = ctx.world_size, ctx.count
    IN, OUT = Buf.IN, Buf.OUT
    if n == 1:
        if not ctx.inplace:
            ctx.copy(0, ctx.block_region(IN, 0), ctx.region(OUT), count)
        return
    fold = Fold(n)
    p, rounds = fold.pow2, fold.rounds
    orders = _rs_orders(fold)
    half = p // 2
    # Partial sums live in scratch, never in the input (which the caller keeps) nor in OUT (one
    # block): one accumulator per block a member keeps after round 0, and one block of scratch
    # for values reduced on their way out (fused with the send, so never actually stored).
    keep_max = max(len(fold.blocks((0, half))), len(fold.blocks((half, p))))
    acc_base = ctx.tmp(keep_max * count).off
    # Each forwarded value gets its own scratch: the fuse pass drops a scratch store only when
    # nothing reads that scratch later, and a shared one would be read by the next forward.
    forwards = 1 + max((len(orders[(v, 0)]) for v in range(fold.rem)), default=0)
    fwd_base = ctx.tmp(forwards * count).off

    def fwd(i: int) -> Region:
        return Region(Buf.TMP, fwd_base + i * count)

    for rank in range(n):
        v = fold.member(rank)
        if v is None:
            partner = rank + 1
            pv = fold.member(partner)
            assert pv is not None
            # In the order the partner consumes them: what it keeps, then what it forwards.
            for b in [*fold.blocks(group_of(pv, half)), *orders[(pv, 0)]]:
                ctx.send(rank, partner, ctx.block_region(IN, b), count)
            ctx.recv(rank, partner, ctx.region(OUT), count)
            continue

        extra = fold.extra_of(v)
        first_kept = fold.blocks(group_of(v, half))[0]

        def acc(block: int, first_kept: int = first_kept) -> Region:
            return Region(Buf.TMP, acc_base + (block - first_kept) * count)

        if extra is not None:
            for b in fold.blocks(group_of(v, half)):
                ctx.emit(rank, _recv_reduce(extra, ctx.block_region(IN, b), acc(b), count, left=True))
        for k in range(rounds):
            size = p >> (k + 1)
            u = v ^ size
            peer = fold.rank_of(u)
            left = u < v
            final = k == rounds - 1
            sends: list[list[Step]] = []
            for i, b in enumerate(orders[(v, k)]):
                if k == 0 and extra is not None:
                    # The extra's block meets ours on its way out: one fused step.
                    reduce = _recv_reduce(extra, ctx.block_region(IN, b), fwd(i + 1), count, left=True)
                    sends.append([reduce, _send(peer, fwd(i + 1), count)])
                else:
                    sends.append([_send(peer, ctx.block_region(IN, b) if k == 0 else acc(b), count)])
            recvs: list[list[Step]] = []
            for b in orders[(u, k)]:
                local = ctx.block_region(IN, b) if (k == 0 and extra is None) else acc(b)
                if not final:
                    recvs.append([_recv_reduce(peer, local, acc(b), count, left=left)])
                elif b == rank:
                    # In place, OUT is IN's block ``rank``: written elementwise from itself.
                    recvs.append([_recv_reduce(peer, local, ctx.region(OUT), count, left=left, final=True)])
                else:
                    # The extra's block: finished here and forwarded in the same step.
                    assert b == extra
                    reduce = _recv_reduce(peer, local, fwd(0), count, left=left, final=True)
                    recvs.append([reduce, _send(extra, fwd(0), count)])
            _exchange(ctx, rank, sends, recvs)


def _ag_orders(fold: Fold) -> dict[tuple[int, int], list[int]]:
    """``orders[(member, round)]``: the blocks a member sends in a doubling round, in order.

    The block received last (the extra's, before round 0) goes first, so that its receive and
    send fuse; the rest in block order.
    """
    p, rounds = fold.pow2, fold.rounds
    orders: dict[tuple[int, int], list[int]] = {}
    for j in range(rounds):
        size = 1 << j
        for v in range(p):
            mine = list(fold.blocks(group_of(v, size)))
            first = fold.extra_of(v) if j == 0 else orders[(v ^ (size // 2), j - 1)][-1]
            orders[(v, j)] = ([first] if first is not None else []) + [b for b in mine if b != first]
    return orders


def _fold_out_order(fold: Fold, orders: dict[tuple[int, int], list[int]], member: int) -> list[int]:
    """The blocks a partner sends its extra after the last round: last received first."""
    last = orders[(member ^ (fold.pow2 // 2), fold.rounds - 1)][-1]
    extra = fold.extra_of(member)
    return [last] + [b for b in range(fold.world_size) if b not in (last, extra)]


@register("allgather", "halving_doubling")
def allgather(ctx: Context) -> None:
    """Recursive doubling over blocks; extras hand their block in first and get the rest last."""
    n, count = ctx.world_size, ctx.count
    IN, OUT = Buf.IN, Buf.OUT
    if n > 1:
        fold = Fold(n)
        rounds = fold.rounds
        orders = _ag_orders(fold)
        for rank in range(n):
            v = fold.member(rank)

            def src(block: int, rank: int = rank) -> Region:
                # A rank's own block is read from IN, which in place is OUT's block anyway.
                return ctx.region(IN) if block == rank else ctx.block_region(OUT, block)

            if v is None:
                partner = rank + 1
                pv = fold.member(partner)
                assert pv is not None
                ctx.send(rank, partner, ctx.region(IN), count)
                for b in _fold_out_order(fold, orders, pv):
                    ctx.recv(rank, partner, ctx.block_region(OUT, b), count)
                continue
            extra = fold.extra_of(v)
            if extra is not None:
                ctx.recv(rank, extra, ctx.block_region(OUT, extra), count)
            for j in range(rounds):
                u = v ^ (1 << j)
                peer = fold.rank_of(u)
                sends = [[_send(peer, src(b), count)] for b in orders[(v, j)]]
                recvs = [[_recv(peer, ctx.block_region(OUT, b), count)] for b in orders[(u, j)]]
                _exchange(ctx, rank, sends, recvs)
            if extra is not None:
                for b in _fold_out_order(fold, orders, v):
                    ctx.send(rank, extra, src(b), count)
    if not ctx.inplace:
        for rank in range(n):
            ctx.copy(rank, ctx.region(IN), ctx.block_region(OUT, rank), count)
