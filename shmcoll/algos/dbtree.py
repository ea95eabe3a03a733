"""``dbtree``: the double binary tree. Two binary trees, each carrying half of the data.

**One tree.** ``m`` members sit at positions ``1..m`` of an in-order binary tree: the root of
positions ``lo..hi`` is the one divisible by the largest power of two (unique in the range), and
the positions below and above it form its left and right subtrees. For ``m = 2^k - 1`` that is
the perfect tree; for other ``m`` the right edge is cut short. Every odd position is a leaf
(a range holding an odd position alone has no room for children, and any longer range holds an
even position, which wins) and every even position has a left child, so even positions are
exactly the inner nodes. With ``m = 13``::

                8
            /       \\
          4           12
        /   \\       /    \\
       2     6     10     13
      / \\   / \\   /  \\
     1   3 5   7 9   11

**Two trees.** Tree A puts member ``i`` at position ``i + 1``: its inner nodes are the odd
members. Tree B relabels A so that they become leaves: mirrored (member ``i`` at position
``m - i``) when ``m`` is even, shifted by one (member ``i`` at position ``i``, member 0 at ``m``)
when ``m`` is odd. Then every member is an inner node in at most one tree and a leaf in at
least one: for even ``m`` each member is inner in exactly one, for odd ``m`` member 0 is a leaf
in both. That is what halves the load: an inner node receives from two children and sends to
two, a leaf only one way, so each member does an inner node's work for half the data.

**Collectives.** *allreduce*: members are the ranks; each tree reduces its half up to its root
(left subtree, own value, right subtree, in that order), which finishes it (AVG's division, once)
and broadcasts it back down, so every rank holds copies of one computation: bitwise identical.
*reduce* and *broadcast* are rooted: the root sits above both trees, whose ``m = n - 1`` members
are the other ranks relabelled from the root (member ``i`` is rank ``root + 1 + i``), so both
trees end (or start) at the root, which receives (sends) one half from (to) each tree's top.

**Pipelining.** A piece is two halves of at most one slot each; a large call is many pieces, and
a rank moves on to the next piece as soon as its part of this one is done, so pieces stream up
(reduce) and down (broadcast) the trees. In allreduce an inner node waits for each piece's
round trip through the part of its tree above it.

Rounds per piece: a tree over ``m`` members is ``floor(log2 m)`` deep, so allreduce takes
``2 floor(log2 n)`` hops (up, then down; both trees at once), reduce and broadcast
``floor(log2 (n-1)) + 1``. Bytes sent per rank, for ``V`` bytes per rank: allreduce
``2 (n-1)/n V`` on average (each tree moves ``V/2`` up and down each of its ``n-1`` edges), at
most ``2 V`` (an inner node with two children: ``V/2`` up, ``V`` down; plus ``V/2`` up as a
leaf of the other tree); reduce ``V`` per rank but the root (``V/2`` up each tree); broadcast
at most ``V`` (``V/2`` to each of two children in the inner tree), ``V`` at the root.
Constraints: none; every world size, count (0 included), root and in-place combination.
``auto`` weighs it from :func:`auto_from` on.
"""

from __future__ import annotations

import dataclasses

from shmcoll.algos.registry import register
from shmcoll.plan.builder import Context
from shmcoll.plan.ir import Buf, Region

NO_PARENT = -1


def auto_from(world_size: int) -> int:
    """Smallest call (``select.call_size``) for which ``auto`` weighs dbtree: 16 KiB at 2 ranks,
    where its two trees are the same single link and a piece is two messages where ``direct``
    sends one (a per-message cost the model does not see: ``shmcoll bench -n 2 -a direct,dbtree``
    on the 2-core machine, reduce and broadcast 8 B: 0.77 against 0.89-1.01 us; 4 KiB: even;
    32 KiB: dbtree 5-8% faster); anywhere above."""
    return 16 << 10 if world_size <= 2 else 0


@dataclasses.dataclass(frozen=True)
class Tree:
    """A rooted tree over members ``0..m-1``: ``parent[i]`` (``NO_PARENT`` at the root) and
    ``children[i]`` (the left child first where there are two)."""

    root: int
    parent: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]

    def is_leaf(self, member: int) -> bool:
        return not self.children[member]


def _top(lo: int, hi: int) -> int:
    """The position in ``lo..hi`` divisible by the largest power of two."""
    bit = 1 << (hi.bit_length() - 1)
    while True:
        top = hi - hi % bit
        if top >= lo:
            return top
        bit >>= 1


def in_order_tree(m: int) -> Tree:
    """Tree A over ``m >= 1`` members (see the module docstring); member ``i`` at position ``i + 1``."""
    parent = [NO_PARENT] * m
    children: list[tuple[int, ...]] = [()] * m
    # Ranges still to split, with the member above them; iterative, so no recursion limit.
    todo = [(1, m, NO_PARENT)]
    root = NO_PARENT
    while todo:
        lo, hi, above = todo.pop()
        top = _top(lo, hi)
        member = top - 1
        parent[member] = above
        if above == NO_PARENT:
            root = member
        kids = []
        if lo < top:
            kids.append(_top(lo, top - 1) - 1)
            todo.append((lo, top - 1, member))
        if top < hi:
            kids.append(_top(top + 1, hi) - 1)
            todo.append((top + 1, hi, member))
        children[member] = tuple(kids)
    return Tree(root, tuple(parent), tuple(children))


def _relabel(tree: Tree, label: list[int]) -> Tree:
    """The same shape with member ``i`` renamed ``label[i]``."""
    m = len(label)
    parent = [NO_PARENT] * m
    children: list[tuple[int, ...]] = [()] * m
    for i in range(m):
        p = tree.parent[i]
        parent[label[i]] = NO_PARENT if p == NO_PARENT else label[p]
        children[label[i]] = tuple(label[c] for c in tree.children[i])
    return Tree(label[tree.root], tuple(parent), tuple(children))


def double_tree(m: int) -> tuple[Tree, Tree]:
    """Trees A and B over ``m >= 1`` members: B mirrored (even ``m``) or shifted by one (odd ``m``)."""
    a = in_order_tree(m)
    if m % 2 == 0:
        # A's member at position p is p - 1; B puts member m - p there.
        label = [m - 1 - i for i in range(m)]
    else:
        # B puts member p at position p (member 0 at position m): A's member i becomes i + 1.
        label = [(i + 1) % m for i in range(m)]
    return a, _relabel(a, label)


def _halves(count: int) -> list[tuple[int, int]]:
    h = (count + 1) // 2
    return [(0, h), (h, count - h)]


def _two_slots(slot_capacity: int, world_size: int) -> int:
    # Two halves of at most one slot each: every step moves one half.
    return 2 * slot_capacity


def _reduce_up(
    ctx: Context,
    rank: int,
    kids: list[int],
    up: int | None,
    own: Region,
    acc: Region,
    count: int,
    *,
    finish: Region | None = None,
) -> None:
    """Combine the children's subtree values with our own: ``(left (op) own) (op) right``.

    The result goes on to ``up`` via ``acc`` ("reduce into acc, send acc", which fuse makes one
    step that never stores acc), or, at a root (``up`` is None), into ``finish`` with AVG's
    division.
    """
    target = acc if finish is None else finish
    if len(kids) == 2:
        ctx.recv_reduce(rank, kids[0], own, acc, count, received_left=True)
        ctx.recv_reduce(rank, kids[1], acc, target, count, final=finish is not None)
    else:
        (kid,) = kids
        ctx.recv_reduce(rank, kid, own, target, count, final=finish is not None, received_left=True)
    if up is not None:
        ctx.send(rank, up, acc, count)


@register("allreduce", "dbtree", piece=_two_slots, auto_from=auto_from)
def allreduce(ctx: Context) -> None:
    """Each half reduced up its tree to the tree's root, then broadcast back down it."""
    n, count = ctx.world_size, ctx.count
    if n == 1:
        if not ctx.inplace:
            ctx.copy(0, Region(Buf.IN, 0), Region(Buf.OUT, 0), count)
        return
    trees = double_tree(n)
    ranks = list(range(n))
    halves = _halves(count)
    scratch = [ctx.tmp(c) for _, c in halves]
    for rank in ranks:
        # Leaf sends first: they feed the other tree's inner nodes, whose work is the longest.
        for tree, (off, c) in zip(trees, halves, strict=True):
            if tree.is_leaf(rank):
                ctx.send(rank, tree.parent[rank], Region(Buf.IN, off), c)
        for t, (tree, (off, c), acc) in enumerate(zip(trees, halves, scratch, strict=True)):
            if tree.is_leaf(rank):
                continue
            out = Region(Buf.OUT, off)
            up = tree.parent[rank] if tree.parent[rank] != NO_PARENT else None
            kids = list(tree.children[rank])
            # In place, own (IN) is read in the up phase only, before OUT is written below.
            _reduce_up(ctx, rank, kids, up, Region(Buf.IN, off), acc, c, finish=out if up is None else None)
            if up is not None:
                ctx.recv(rank, up, out, c)
            # Receiving the result and sending it to the first child is one fused step, which
            # needs a free slot towards that child. If that child is also our parent in the
            # other tree, our leaf send to it may still fill that slot, and the child may in
            # turn wait for us (n = 2: each rank is the other's root): with one slot per ring,
            # a deadlock. Then the two stay separate steps; the send re-reads OUT from cache.
            if trees[1 - t].parent[rank] == kids[0]:
                ctx.no_fuse(rank)
            for kid in kids:
                ctx.send(rank, kid, out, c)
        for tree, (off, c) in zip(trees, halves, strict=True):
            if tree.is_leaf(rank):
                ctx.recv(rank, tree.parent[rank], Region(Buf.OUT, off), c)


def _rooted(ctx: Context) -> tuple[list[Tree], list[int]]:
    """Both trees over the ranks other than the root, member ``i`` being rank ``root + 1 + i``."""
    n, root = ctx.world_size, ctx.root
    return list(double_tree(n - 1)), [(root + 1 + i) % n for i in range(n - 1)]


def _above(tree: Tree, member: int, ranks: list[int], root: int) -> int:
    """The rank above ``member``: its parent's, or the root's for the tree's top."""
    parent = tree.parent[member]
    return root if parent == NO_PARENT else ranks[parent]


@register("reduce", "dbtree", piece=_two_slots, auto_from=auto_from)
def reduce(ctx: Context) -> None:
    """Each half reduced up its tree; the root combines each tree's result with its own."""
    n, root, count = ctx.world_size, ctx.root, ctx.count
    if n == 1:
        if not ctx.inplace:
            ctx.copy(root, Region(Buf.IN, 0), Region(Buf.OUT, 0), count)
        return
    trees, ranks = _rooted(ctx)
    halves = _halves(count)
    # Ranks other than the root have no output buffer: partial results live in scratch.
    scratch = [ctx.tmp(c) for _, c in halves]
    for member, rank in enumerate(ranks):
        for tree, (off, c) in zip(trees, halves, strict=True):
            if tree.is_leaf(member):
                ctx.send(rank, _above(tree, member, ranks, root), Region(Buf.IN, off), c)
        for tree, (off, c), acc in zip(trees, halves, scratch, strict=True):
            if not tree.is_leaf(member):
                kids = [ranks[k] for k in tree.children[member]]
                _reduce_up(ctx, rank, kids, _above(tree, member, ranks, root), Region(Buf.IN, off), acc, c)
    for tree, (off, c) in zip(trees, halves, strict=True):
        # In place, IN and OUT share this half, read and written in the same step.
        own, out = Region(Buf.IN, off), Region(Buf.OUT, off)
        ctx.recv_reduce(root, ranks[tree.root], own, out, c, final=True, received_left=True)


@register("broadcast", "dbtree", piece=_two_slots, auto_from=auto_from)
def broadcast(ctx: Context) -> None:
    """The root sends each half to its tree's top; inner nodes receive and forward to both children."""
    n, root, count = ctx.world_size, ctx.root, ctx.count
    if n == 1:
        if not ctx.inplace:
            ctx.copy(root, Region(Buf.IN, 0), Region(Buf.OUT, 0), count)
        return
    trees, ranks = _rooted(ctx)
    halves = _halves(count)
    for tree, (off, c) in zip(trees, halves, strict=True):
        ctx.send(root, ranks[tree.root], Region(Buf.IN, off), c)
    # After the sends, so that both trees start before this local copy.
    if not ctx.inplace:
        ctx.copy(root, Region(Buf.IN, 0), Region(Buf.OUT, 0), count)
    for member, rank in enumerate(ranks):
        # Inner work first: forwarding feeds whole subtrees, our leaf half feeds nobody.
        for leaf_pass in (False, True):
            for tree, (off, c) in zip(trees, halves, strict=True):
                if tree.is_leaf(member) != leaf_pass:
                    continue
                out = Region(Buf.OUT, off)
                ctx.recv(rank, _above(tree, member, ranks, root), out, c)
                for kid in tree.children[member]:
                    ctx.send(rank, ranks[kid], out, c)
