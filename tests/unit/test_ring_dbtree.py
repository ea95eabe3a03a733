"""ring and dbtree plans: textbook message counts, fusion, tree shapes, and broken variants caught."""

from __future__ import annotations

import dataclasses
import math

import pytest

from shmcoll.algos import dbtree, registry
from shmcoll.algos.dbtree import NO_PARENT, Tree, double_tree, in_order_tree
from shmcoll.plan.builder import Context
from shmcoll.plan.ir import Buf, CallPlan
from shmcoll.plan.passes import build_piece, channel_skeleton, plan_call
from shmcoll.plan.verify import PlanError, verify

MINE = [
    ("allreduce", "ring"),
    ("reduce_scatter", "ring"),
    ("allgather", "ring"),
    ("broadcast", "ring"),
    ("reduce", "ring"),
    ("allreduce", "dbtree"),
    ("reduce", "dbtree"),
    ("broadcast", "dbtree"),
]
ROOTED = {"broadcast", "reduce"}


def _piece(collective: str, name: str, n: int, count: int, **kw):  # type: ignore[no-untyped-def]
    return build_piece(registry.get(collective, name), n, count, block=count, **kw)


def _sent(plan, rank: int) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    return [(peer, c) for kind, peer, c in channel_skeleton(plan)[rank] if kind == "send"]


def _received(plan, rank: int) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    return [(peer, c) for kind, peer, c in channel_skeleton(plan)[rank] if kind == "recv"]


# --- ring -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", range(2, 13))
def test_ring_allreduce_sends_the_textbook_amount(n: int) -> None:
    """2(n-1) messages per rank, each one chunk: 2(n-1)/n of the piece, all to the right."""
    count = 6 * n
    plan = _piece("allreduce", "ring", n, count)
    for r in range(n):
        sent, received = _sent(plan, r), _received(plan, r)
        assert len(sent) == len(received) == 2 * (n - 1)
        assert {p for p, _ in sent} == {(r + 1) % n} and {p for p, _ in received} == {(r - 1) % n}
        assert sum(c for _, c in sent) == sum(c for _, c in received) == 2 * (n - 1) * count // n


@pytest.mark.parametrize("n", range(2, 13))
def test_ring_allreduce_forwards_are_fused(n: int) -> None:
    """Every receive that is forwarded is one step with its send, but for one rank per step index
    (the one that keeps the ring from deadlocking on one slot); partial sums never hit memory
    elsewhere."""
    plan = _piece("allreduce", "ring", n, 6 * n)
    held = 0
    for r in range(n):
        steps = plan.programs[r]
        fused = [s for s in steps if s.recv is not None and s.send is not None]
        # A held forward: a plain receive, then the send of what it received.
        holds = [
            s
            for s, t in zip(steps, steps[1:], strict=False)
            if s.recv is not None and s.send is None and t.send is not None and t.recv is None and t.a == s.dst
        ]
        held += len(holds)
        assert len(fused) + len(holds) == 2 * n - 3
        # Scratch is stored only where a forward is held back.
        assert sum(1 for s in steps if s.count and s.dst is not None and s.dst.buf == Buf.TMP) <= len(holds)
    assert held == 2 * n - 3


@pytest.mark.parametrize("n", range(2, 13))
def test_ring_allreduce_fuses_every_forward_with_two_slots(n: int) -> None:
    """With two slots per ring no forward is held back: 2n-3 fused steps per rank, no scratch."""
    alg = registry.get("allreduce", "ring")
    plan = build_piece(alg, n, 6 * n, block=6 * n, nslots=2)
    for r in range(n):
        steps = plan.programs[r]
        assert sum(1 for s in steps if s.recv is not None and s.send is not None) == 2 * n - 3
        assert not any(s.dst is not None and s.dst.buf == Buf.TMP for s in steps)


@pytest.mark.parametrize("collective", ["allgather", "reduce_scatter"])
@pytest.mark.parametrize("n", range(2, 10))
def test_ring_blocks_take_n_minus_1_steps(collective: str, n: int) -> None:
    count = 5
    plan = _piece(collective, "ring", n, count)
    for r in range(n):
        assert _sent(plan, r) == [((r + 1) % n, count)] * (n - 1)
        assert _received(plan, r) == [((r - 1) % n, count)] * (n - 1)


@pytest.mark.parametrize("n", range(2, 10))
def test_chains(n: int) -> None:
    """broadcast starts at the root and reduce ends there; every middle rank is one fused step."""
    for root in range(n):
        chain = [(root + i) % n for i in range(n)]
        b = _piece("broadcast", "ring", n, 7, root=root, inplace=True)
        r = _piece("reduce", "ring", n, 7, root=root, inplace=True)
        order = {"broadcast": chain, "reduce": chain[1:] + chain[:1]}
        for plan, kind in ((b, "broadcast"), (r, "reduce")):
            seq = order[kind]
            assert _sent(plan, seq[0]) == [(seq[1], 7)] and _received(plan, seq[0]) == []
            assert _received(plan, seq[-1]) == [(seq[-2], 7)] and _sent(plan, seq[-1]) == []
            for i in range(1, n - 1):
                (step,) = plan.programs[seq[i]]
                assert step.recv == seq[i - 1] and step.send == seq[i + 1]


def test_one_slot_needs_the_held_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without them, a ring of fused steps deadlocks on one slot per ring (and works on two)."""
    alg = registry.get("allreduce", "ring")
    monkeypatch.setattr(Context, "no_fuse", lambda self, rank: None)
    plan = plan_call(alg, 4, 40, 2)
    verify(plan, world_size=4, count=40, nslots=2)
    with pytest.raises(PlanError, match="deadlock"):
        verify(plan, world_size=4, count=40, nslots=1)


def _broken(plan: CallPlan, rank: int, pick, **changes) -> CallPlan:  # type: ignore[no-untyped-def]
    programs = [list(p) for p in plan.tail.programs]
    index = next(i for i, s in enumerate(programs[rank]) if pick(s))
    programs[rank][index] = dataclasses.replace(programs[rank][index], **changes)
    return dataclasses.replace(plan, tail=dataclasses.replace(plan.tail, programs=programs))


def test_verifier_rejects_broken_ring() -> None:
    n, count = 5, 10
    plan = plan_call(registry.get("allreduce", "ring"), n, count, 100)
    verify(plan, world_size=n, count=count)
    # The finishing reduction without AVG's division.
    with pytest.raises(PlanError, match="AVG"):
        verify(_broken(plan, 2, lambda s: s.final, final=False), world_size=n, count=count)
    # A partial sum that skips this rank's own term (received value stored as is).
    no_own = _broken(plan, 2, lambda s: s.reduce and not s.final, reduce=False, b=None, recv_left=False)
    with pytest.raises(PlanError, match="combines"):
        verify(no_own, world_size=n, count=count)
    # An allgather forward sent to the wrong neighbour.
    wrong = _broken(plan, 2, lambda s: not s.reduce and s.recv is not None and s.send is not None, send=4)
    with pytest.raises(PlanError):
        verify(wrong, world_size=n, count=count)


# --- dbtree ---------------------------------------------------------------------------------
def _check_tree(tree: Tree, m: int) -> None:
    assert tree.parent[tree.root] == NO_PARENT
    assert sum(p == NO_PARENT for p in tree.parent) == 1
    for member in range(m):
        assert len(tree.children[member]) <= 2
        for kid in tree.children[member]:
            assert tree.parent[kid] == member
        if member != tree.root:
            assert member in tree.children[tree.parent[member]]
        # Every member reaches the root within floor(log2 m) hops.
        hops, at = 0, member
        while tree.parent[at] != NO_PARENT:
            at = tree.parent[at]
            hops += 1
        assert at == tree.root and hops <= int(math.log2(m))


@pytest.mark.parametrize("m", list(range(1, 70)) + [127, 128, 129, 1000])
def test_double_tree_shape(m: int) -> None:
    a, b = double_tree(m)
    _check_tree(a, m)
    _check_tree(b, m)
    inner_a = {i for i in range(m) if not a.is_leaf(i)}
    inner_b = {i for i in range(m) if not b.is_leaf(i)}
    # Tree A: in-order, inner nodes at the even positions (odd members).
    assert inner_a == {i for i in range(m) if i % 2 == 1}
    for member in range(m):
        kids = a.children[member]
        if len(kids) == 2:
            assert kids[0] < member < kids[1]
    # Complementary: inner in at most one tree, so a leaf in at least one.
    assert not inner_a & inner_b
    if m % 2 == 0:
        assert inner_a | inner_b == set(range(m))  # each inner in exactly one
        label = [m - 1 - i for i in range(m)]  # mirrored
    else:
        assert set(range(m)) - inner_a - inner_b == {0}
        label = [(i + 1) % m for i in range(m)]  # shifted by one
    for i in range(m):
        assert b.parent[label[i]] == (NO_PARENT if a.parent[i] == NO_PARENT else label[a.parent[i]])
    if m >= 2:
        assert a.root != b.root


def test_in_order_tree_example() -> None:
    """The m = 13 tree drawn in the module docstring (positions = members + 1)."""
    t = in_order_tree(13)
    kids = {i + 1: tuple(k + 1 for k in t.children[i]) for i in range(13)}
    assert t.root + 1 == 8
    assert kids[8] == (4, 12) and kids[4] == (2, 6) and kids[12] == (10, 13) and kids[10] == (9, 11)
    assert kids[13] == () and kids[2] == (1, 3)


@pytest.mark.parametrize("n", range(2, 18))
def test_dbtree_allreduce_moves_each_half_once_per_edge(n: int) -> None:
    """Per tree, each non-root rank sends its half up once and gets it back down once."""
    count = 10
    h = (count + 1) // 2
    halves = (h, count - h)
    plan = _piece("allreduce", "dbtree", n, count)
    trees = double_tree(n)
    for r in range(n):
        sent, received = _sent(plan, r), _received(plan, r)
        want_sent, want_received = [], []
        for tree, c in zip(trees, halves, strict=True):
            if tree.parent[r] != NO_PARENT:
                want_sent.append((tree.parent[r], c))
                want_received.append((tree.parent[r], c))
            want_sent += [(k, c) for k in tree.children[r]]
            want_received += [(k, c) for k in tree.children[r]]
        assert sorted(sent) == sorted(want_sent) and sorted(received) == sorted(want_received)
        assert sum(c for _, c in sent) <= 2 * count


@pytest.mark.parametrize("n", range(2, 12))
def test_dbtree_rooted_trees_hang_from_the_root(n: int) -> None:
    for root in range(n):
        red = _piece("reduce", "dbtree", n, 9, root=root)
        bc = _piece("broadcast", "dbtree", n, 9, root=root)
        a, b = double_tree(n - 1)
        tops = sorted({(root + 1 + a.root) % n, (root + 1 + b.root) % n})
        assert sorted({p for p, _ in _received(red, root)}) == tops and _sent(red, root) == []
        assert sorted({p for p, _ in _sent(bc, root)}) == tops and _received(bc, root) == []
        for r in range(n):
            if r != root:
                # One half up each tree (reduce), one half down each tree (broadcast).
                assert sorted(c for _, c in _sent(red, r)) == [4, 5]
                assert sorted(c for _, c in _received(bc, r)) == [4, 5]


def test_verifier_rejects_broken_dbtree() -> None:
    n, count = 6, 8
    plan = plan_call(registry.get("allreduce", "dbtree"), n, count, 100)
    verify(plan, world_size=n, count=count)
    root_a = dbtree.double_tree(n)[0].root
    with pytest.raises(PlanError, match="AVG"):
        verify(_broken(plan, root_a, lambda s: s.final, final=False), world_size=n, count=count)
    # A leaf's result stored in the wrong half.
    leaf = next(r for r in range(n) if dbtree.double_tree(n)[0].is_leaf(r))
    last = plan.tail.programs[leaf][-1]
    other = dataclasses.replace(last.dst, off=0 if last.dst.off else count // 2)
    with pytest.raises(PlanError):
        verify(_broken(plan, leaf, lambda s: s is last, dst=other), world_size=n, count=count)


# --- every algorithm here -------------------------------------------------------------------
@pytest.mark.parametrize(("collective", "name"), MINE)
def test_forwarded_partial_sums_are_never_stored(collective: str, name: str) -> None:
    """A fused step that sends a partial result keeps no scratch copy (nothing reads it later)."""
    for n in range(2, 12):
        for root in range(n) if collective in ROOTED else (0,):
            plan = _piece(collective, name, n, 4 * n, root=root)
            for program in plan.programs:
                for s in program:
                    if s.recv is not None and s.send is not None:
                        assert s.dst is None or s.dst.buf != Buf.TMP, (n, root, s)


@pytest.mark.parametrize("name", ["ring", "dbtree"])
def test_reduce_leaves_non_roots_output_alone(name: str) -> None:
    """A non-root rank of reduce has no output buffer at all: its steps must never name OUT."""
    for n in range(1, 12):
        for root in range(n):
            for inplace in (False, True):
                plan = plan_call(registry.get("reduce", name), n, 23, 4, root=root, inplace=inplace)
                for piece in (plan.body, plan.tail):
                    if piece is None:
                        continue
                    for r in range(n):
                        if r == root:
                            continue
                        for s in piece.programs[r]:
                            assert all(x is None or x.buf != Buf.OUT for x in (s.a, s.b, s.dst)), (n, root, r, s)


@pytest.mark.parametrize(("collective", "name"), MINE)
def test_no_message_exceeds_a_slot(collective: str, name: str) -> None:
    """The piece rule at work (local copies may be longer: they use no slot)."""
    alg = registry.get(collective, name)
    for n in (1, 2, 3, 5, 8, 13):
        for slot in (1, 3, 8):
            for count in (0, 1, slot * n - 1, slot * n * 2 + 1, 97):
                plan = plan_call(alg, n, count, slot)
                for piece in (plan.body, plan.tail):
                    if piece is not None:
                        moved = [s.count for p in piece.programs for s in p if s.recv is not None or s.send is not None]
                        assert max(moved, default=0) <= slot


@pytest.mark.parametrize(("collective", "name"), MINE)
def test_larger_worlds_verify(collective: str, name: str) -> None:
    """test_plans covers 1..16 ranks; the trees change shape at powers of two, so a few more."""
    alg = registry.get(collective, name)
    for n in (17, 24, 31, 32, 33):
        roots = (0, n // 2, n - 1) if collective in ROOTED else (0,)
        for root in roots:
            for count, slot in ((0, 4), (n + 3, 2), (3 * n + 1, 5)):
                for inplace in (False, True):
                    plan = plan_call(alg, n, count, slot, root=root, inplace=inplace)
                    for nslots in (1, 2):
                        verify(plan, world_size=n, count=count, root=root, inplace=inplace, nslots=nslots)
