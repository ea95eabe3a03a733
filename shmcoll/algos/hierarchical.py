"""``hierarchical``: collectives in two levels, within groups of ranks and between them.

**Groups.** The builder option ``group_size`` (``g``) puts rank ``r`` in group ``r // g``: contiguous
groups of ``g`` ranks, the last one smaller when ``g`` does not divide ``n``. Without it (or with
``g >= n``) there is one group. The communicator sets it from ``SHMCOLL_GROUP_SIZE`` or the
machine's topology (NUMA node, socket, shared L3: :mod:`shmcoll.topology`), agreed by every rank;
the simulator from its model's group size. Messages within a group are cheap (one NUMA node), those
between groups dear, so each phase keeps the dear traffic to the least the schedule allows.

Nothing here moves data itself: every phase is another algorithm's builder run on a view of the
call (``builder.compose``): a subset of the ranks and a placement of its buffers in ours.

**allreduce** (the textbook two-level schedule, generalised to uneven groups):

1. *intra-group reduce-scatter*: a group of ``m`` ranks cuts the piece into ``m`` chunks of
   ``q = count // m`` (the last member's chunk also takes the ``count - m q`` leftover elements);
   ``ring``'s reduce_scatter over the ``q``-sized blocks, then (only when there are leftovers)
   ``dbtree``'s reduce of the leftovers to the last member. Each member now holds its chunk
   reduced over its group.
2. *inter-group allreduce*: the chunk boundaries of all groups are merged (their common
   refinement); each refined piece lies in exactly one member's chunk in every group, and those
   owners, one per group, allreduce it in place with ``dbtree`` (or the ``inter`` option). With
   equal groups and ``g`` dividing the count this is one allreduce of ``count / g`` per group
   position, among the ranks holding the same shard: the only inter-group traffic.
3. *intra-group allgather*: ``ring``'s allgather of the chunks (and ``dbtree``'s broadcast of the
   leftovers from the last member), in place in the output.

Why these: ring is the bandwidth-optimal reduce-scatter/allgather, and within a group its
``m - 1`` cheap hops are affordable; the inter-group step has ``count / m`` per rank, crosses the
dear links and may span thousands of groups, so it needs a logarithmic depth: the double binary
tree, which also pipelines its halves. Each element is reduced in one group per phase and the
inter-group allreduce is bitwise identical at every owner, so results are too; AVG's division is
kept only in the last phase that combines (2, or 1 with a single group).

**broadcast**: the root sends to the group leaders (the root leads its own group, the first
member the others) with ``dbtree``'s broadcast, then each leader broadcasts within its group with
``dbtree``. **reduce** mirrors it: ``dbtree`` reduce within each group to its leader (partials in
scratch, since only the root has an output), then among the leaders to the root. dbtree for both
levels: logarithmic depth, each inner rank forwards at most the whole piece, pipelined halves.

Rounds (equal groups, ``G = n / g``): allreduce ``2 (g - 1)`` ring hops plus ``2 floor(log2 G)``
tree hops; broadcast and reduce ``floor(log2 (G - 1)) + 1 + floor(log2 (g - 1)) + 1``. Inter-group
bytes per rank: allreduce at most ``2 V / g`` (a tree's inner rank), ``V / g`` for two groups;
broadcast and reduce at most ``V`` per leader. Constraints: none (every world size, group size,
count, root, in place). An allreduce piece gives each member of the smallest group one slot and,
where it can, is a multiple of every group size, so that steady-state pieces have no leftovers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from shmcoll.algos import registry
from shmcoll.algos.registry import register
from shmcoll.plan.builder import Context, Place, compose
from shmcoll.plan.ir import Buf, Region

INTER_DEFAULT = "dbtree"


def groups(world_size: int, group_size: object) -> list[list[int]]:
    """Contiguous groups of ``group_size`` ranks (the last smaller); one group without a size."""
    g = world_size if group_size is None else int(group_size)  # type: ignore[call-overload]
    if g < 1:
        raise ValueError(f"group_size must be >= 1, got {g}")
    return [list(range(lo, min(lo + g, world_size))) for lo in range(0, world_size, g)]


def _groups(ctx: Context) -> list[list[int]]:
    return groups(ctx.world_size, ctx.options.get("group_size"))


def _allreduce_piece(slot_capacity: int, world_size: int, options: Mapping[str, object]) -> int:
    sizes = {len(m) for m in groups(world_size, options.get("group_size"))}
    most = min(sizes) * slot_capacity  # chunks of at most one slot in every group
    step = math.lcm(*sizes)
    return most // step * step if most >= step else most


def _two_slots(slot_capacity: int, world_size: int) -> int:
    return 2 * slot_capacity  # dbtree's halves at both levels


def _at(buf: Buf, off: int) -> Place:
    """Every region of the sub-collective at ``off`` onwards in our ``buf``."""
    return lambda rank, r: Region(buf, off + r.off)


def _shifted(off: int) -> Place:
    """Each buffer of the sub-collective at ``off`` onwards in the same buffer of ours."""
    return lambda rank, r: Region(r.buf, off + r.off)


def _out_to_scratch(off: int) -> Place:
    """The sub-collective's OUT in our scratch from ``off`` (a rank with no output of its own)."""
    return lambda rank, r: Region(Buf.TMP, off + r.off) if r.buf == Buf.OUT else r


def _reserve(ctx: Context, used: int) -> None:
    ctx.tmp_count += used


@register(
    "allreduce", "hierarchical", piece=lambda slot_capacity, world_size: slot_capacity, options_piece=_allreduce_piece
)
def allreduce(ctx: Context) -> None:
    """Intra-group reduce-scatter, inter-group allreduce of each shard, intra-group allgather."""
    count = ctx.count
    parts = _groups(ctx)
    several = len(parts) > 1
    rs = registry.get("reduce_scatter", "ring")
    ag = registry.get("allgather", "ring")
    left_reduce = registry.get("reduce", "dbtree")
    left_bcast = registry.get("broadcast", "dbtree")
    inter = registry.get("allreduce", str(ctx.options.get("inter", INTER_DEFAULT)))
    chunk = [count // len(members) for members in parts]

    # Phase 1: groups run on disjoint ranks, so they share the scratch from the same base.
    used = 0
    for members, q in zip(parts, chunk, strict=True):
        m = len(members)

        def own_chunk(rank: int, r: Region, q: int = q) -> Region:
            # reduce_scatter's IN is ours; its OUT is member ``rank``'s chunk of our OUT (in
            # place, exactly IN's block ``rank``, as reduce_scatter's in place means).
            return Region(r.buf, r.off) if r.buf == Buf.IN else Region(Buf.OUT, rank * q + r.off)

        kw = dict(ranks=members, inplace=ctx.inplace, keep_final=not several)
        used = max(used, compose(ctx, rs, kind="reduce_scatter", count=q, block=q, place=own_chunk, **kw))  # type: ignore[arg-type]
        leftover = count - m * q
        used = max(
            used,
            compose(
                ctx,
                left_reduce,
                kind="reduce",
                count=leftover,
                root=m - 1,
                place=_shifted(m * q),
                **kw,  # type: ignore[arg-type]
            ),
        )
    _reserve(ctx, used)

    # Phase 2: one allreduce per piece of the common refinement of the groups' chunk boundaries,
    # among its owners (one per group), in place in the output.
    if several:
        cuts = {count}
        for members, q in zip(parts, chunk, strict=True):
            cuts.update(b * q for b in range(len(members)))
        bounds = sorted(cuts)
        used = 0
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            owners = [
                members[min(lo // q, len(members) - 1) if q else -1] for members, q in zip(parts, chunk, strict=True)
            ]
            used = max(
                used,
                compose(
                    ctx, inter, kind="allreduce", ranks=owners, count=hi - lo, place=_at(Buf.OUT, lo), inplace=True
                ),
            )
        _reserve(ctx, used)

    # Phase 3: each member's chunk to the rest of its group, in place in the output.
    used = 0
    for members, q in zip(parts, chunk, strict=True):
        m = len(members)

        def gathered(rank: int, r: Region, q: int = q) -> Region:
            # allgather's IN is member ``rank``'s chunk of our OUT, i.e. its own block of OUT.
            return Region(Buf.OUT, rank * q + r.off) if r.buf == Buf.IN else Region(Buf.OUT, r.off)

        used = max(
            used, compose(ctx, ag, kind="allgather", ranks=members, count=q, block=q, place=gathered, inplace=True)
        )
        used = max(
            used,
            compose(
                ctx,
                left_bcast,
                kind="broadcast",
                ranks=members,
                count=count - m * q,
                root=m - 1,
                place=_at(Buf.OUT, m * q),
                inplace=True,
            ),
        )
    _reserve(ctx, used)


def _leaders(parts: list[list[int]], root: int) -> tuple[list[int], int]:
    """Each group's leader (the root for its own group, else the first member), and the root's group."""
    mine = next(i for i, members in enumerate(parts) if root in members)
    return [root if i == mine else members[0] for i, members in enumerate(parts)], mine


@register("broadcast", "hierarchical", piece=_two_slots)
def broadcast(ctx: Context) -> None:
    """dbtree broadcast from the root to the group leaders, then within each group from its leader."""
    root, count = ctx.root, ctx.count
    parts = _groups(ctx)
    leaders, mine = _leaders(parts, root)
    tree = registry.get("broadcast", "dbtree")

    def among_leaders(rank: int, r: Region) -> Region:
        # The root sends from its input (in place for the sub-call: no copy yet); the other
        # leaders receive into their output, where the second phase reads it.
        return Region(Buf.IN if rank == mine else Buf.OUT, r.off)

    used = compose(
        ctx, tree, kind="broadcast", ranks=leaders, count=count, root=mine, place=among_leaders, inplace=True
    )
    _reserve(ctx, used)
    used = 0
    for i, members in enumerate(parts):
        if i == mine:
            # The root's group: the real buffers, and the root's one copy if out of place.
            place: Place = lambda rank, r: r  # noqa: E731
            inplace = ctx.inplace
        else:
            place, inplace = _at(Buf.OUT, 0), True
        used = max(
            used,
            compose(
                ctx,
                tree,
                kind="broadcast",
                ranks=members,
                count=count,
                root=members.index(leaders[i]),
                place=place,
                inplace=inplace,
            ),
        )
    _reserve(ctx, used)


@register("reduce", "hierarchical", piece=_two_slots)
def reduce(ctx: Context) -> None:
    """dbtree reduce within each group to its leader, then among the leaders to the root."""
    root, count = ctx.root, ctx.count
    parts = _groups(ctx)
    leaders, mine = _leaders(parts, root)
    tree = registry.get("reduce", "dbtree")
    several = len(parts) > 1
    # Where each leader's group result lives: the root's output; a lone rank's own input (its
    # group has nothing to combine); else scratch, since only the root has an output buffer.
    partial = ctx.tmp(count) if any(len(m) > 1 for i, m in enumerate(parts) if i != mine) else None
    held: list[Region] = []
    used = 0
    for i, members in enumerate(parts):
        if i == mine:
            place: Place = lambda rank, r: r  # noqa: E731
            held.append(Region(Buf.OUT, 0))
            inplace = ctx.inplace
        elif len(members) == 1:
            held.append(Region(Buf.IN, 0))
            continue
        else:
            assert partial is not None
            place = _out_to_scratch(partial.off)
            held.append(Region(Buf.TMP, partial.off))
            inplace = False
        used = max(
            used,
            compose(
                ctx,
                tree,
                kind="reduce",
                ranks=members,
                count=count,
                root=members.index(leaders[i]),
                place=place,
                inplace=inplace,
                keep_final=not several,
            ),
        )
    _reserve(ctx, used)

    def among_leaders(rank: int, r: Region) -> Region:
        # Each leader contributes its group's result; the root combines in place in its output.
        return Region(held[rank].buf, held[rank].off + r.off)

    used = compose(ctx, tree, kind="reduce", ranks=leaders, count=count, root=mine, place=among_leaders, inplace=True)
    _reserve(ctx, used)
