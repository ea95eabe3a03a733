"""halving_doubling, pairwise and ps: shapes of their plans, checked without processes.

``test_plans.py`` verifies every plan's postcondition; these check what each algorithm claims in
its docstring: rounds, bytes per rank, partners, message sizes, fusion, and that the verifier
rejects the broken variants the design avoids.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest

from shmcoll.algos import halving_doubling, pairwise, registry
from shmcoll.plan.builder import Context
from shmcoll.plan.ir import Buf, CallPlan, Plan, Step
from shmcoll.plan.passes import channel_skeleton, fuse, plan_call
from shmcoll.plan.verify import PlanError, verify, verify_plan

POW2 = (2, 4, 8, 16)
OTHERS = (3, 5, 6, 7, 9, 12, 15)
BIG_SLOT = 1 << 20  # one piece for every count used here


def _one_piece(collective: str, name: str, world_size: int, count: int, **kw) -> Plan:  # type: ignore[no-untyped-def]
    plan = plan_call(registry.get(collective, name), world_size, count, BIG_SLOT, **kw)
    assert plan.body is None
    return plan.tail


def _depth(plan: Plan) -> int:
    """Rounds as data dependencies: the longest chain of messages behind any output element.

    Every element carries the number of message hops its value went through (inputs 0); a
    received value is one hop more than when it was sent, and a combination takes the larger of
    its operands. Sends of data that does not depend on a receive do not wait on one here, as
    they need not with enough slots, so an exchange of many blocks still counts as one round.
    """
    n = plan.world_size
    size = n * plan.count
    hops = [{Buf.IN: [0] * size, Buf.OUT: [0] * size, Buf.TMP: [0] * plan.tmp_count} for _ in range(n)]
    queues: dict[tuple[int, int], collections.deque[list[int]]] = collections.defaultdict(collections.deque)
    pcs = [0] * n
    progressed = True
    while progressed:
        progressed = False
        for r in range(n):
            program = plan.programs[r]
            while pcs[r] < len(program):
                s = program[pcs[r]]
                if s.recv is not None and not queues[(s.recv, r)]:
                    break

                def read(region, s=s, r=r):  # type: ignore[no-untyped-def]
                    return hops[r][region.buf][region.off : region.off + s.count]

                received = [h + 1 for h in queues[(s.recv, r)].popleft()] if s.recv is not None else None
                if s.reduce:
                    x = received if (received is not None and s.recv_left) else read(s.a)
                    y = received if (received is not None and not s.recv_left) else read(s.b)
                    value = [max(a, b) for a, b in zip(x, y, strict=True)]
                else:
                    value = received if received is not None else (read(s.a) if s.a is not None else [])
                if s.send is not None:
                    queues[(r, s.send)].append(value)
                if s.dst is not None:
                    hops[r][s.dst.buf][s.dst.off : s.dst.off + s.count] = value
                pcs[r] += 1
                progressed = True
    assert all(pcs[r] == len(plan.programs[r]) for r in range(n)), "plan did not run to completion"
    return max(max(h[Buf.OUT], default=0) for h in hops)


def _sent(plan: Plan) -> list[int]:
    """Elements each rank sends."""
    return [sum(c for kind, _, c in events if kind == "send") for events in channel_skeleton(plan)]


def _received(plan: Plan) -> list[int]:
    return [sum(c for kind, _, c in events if kind == "recv") for events in channel_skeleton(plan)]


def _log2(n: int) -> int:
    return n.bit_length() - 1


# --- rounds ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", POW2 + OTHERS)
def test_halving_doubling_rounds(n: int) -> None:
    """log2 n rounds per half for a power of two, plus the fold in and out otherwise."""
    k = _log2(n)
    if n & (n - 1) == 0:
        assert _depth(_one_piece("allreduce", "halving_doubling", n, 4 * n)) == 2 * k
        assert _depth(_one_piece("reduce_scatter", "halving_doubling", n, 3)) == k
        assert _depth(_one_piece("allgather", "halving_doubling", n, 3)) == k
        return
    # Every allreduce output depends on every input, so the fold in and out are both on its
    # critical path. In reduce_scatter and allgather an extra's own block enters in parallel
    # with the first round, so a chain may skip one of them.
    assert _depth(_one_piece("allreduce", "halving_doubling", n, 4 * n)) == 2 * k + 2
    for collective in ("reduce_scatter", "allgather"):
        plan = _one_piece(collective, "halving_doubling", n, 3)
        assert k + 1 <= _depth(plan) <= k + 2
        events = channel_skeleton(plan)
        fold = halving_doubling.Fold(n)
        for extra in range(0, 2 * fold.rem, 2):
            partner = extra + 1
            # The extra talks to its partner only: everything in, then the result back.
            kinds = [kind for kind, _, _ in events[extra]]
            assert {peer for _, peer, _ in events[extra]} == {partner}
            assert kinds == sorted(kinds, key=lambda kind: kind == "recv")
            # Its partner hears from it before anything else and answers after everything
            # else it receives from it.
            with_extra = [(i, kind) for i, (kind, peer, _) in enumerate(events[partner]) if peer == extra]
            assert events[partner][0][:2] == ("recv", extra)
            last_in = max(i for i, kind in with_extra if kind == "recv")
            assert all(i > last_in for i, kind in with_extra if kind == "send")


@pytest.mark.parametrize("n", POW2 + OTHERS)
def test_ps_rounds(n: int) -> None:
    assert _depth(_one_piece("allreduce", "ps", n, 3)) == 2
    assert _depth(_one_piece("reduce", "ps", n, 3, root=n - 1)) == 1
    assert _depth(_one_piece("broadcast", "ps", n, 3, root=n // 2)) == 1


def test_single_rank_has_no_messages() -> None:
    for a in registry.algorithms():
        if a.name in ("halving_doubling", "pairwise", "ps"):
            # alltoallv takes its counts as a matrix (one rank: its block for itself).
            matrix = ((5,),) if a.collective == "alltoallv" else ()
            plan = plan_call(a, 1, 5, 4, matrix=matrix)
            assert channel_skeleton(plan.tail) == [[]], a.collective


# --- bytes per rank per piece --------------------------------------------------------------------
@pytest.mark.parametrize("n", POW2)
def test_halving_doubling_bytes_power_of_two(n: int) -> None:
    v = 6 * n  # divisible by n: the textbook figures hold exactly
    assert _sent(_one_piece("allreduce", "halving_doubling", n, v)) == [2 * (n - 1) * v // n] * n
    assert _sent(_one_piece("reduce_scatter", "halving_doubling", n, v)) == [(n - 1) * v] * n
    assert _sent(_one_piece("allgather", "halving_doubling", n, v)) == [(n - 1) * v] * n


@pytest.mark.parametrize("n", OTHERS)
def test_halving_doubling_bytes_with_extras(n: int) -> None:
    p = 1 << _log2(n)
    rem = n - p
    v = 6 * p
    member = 2 * (p - 1) * v // p
    sent = _sent(_one_piece("allreduce", "halving_doubling", n, v))
    received = _received(_one_piece("allreduce", "halving_doubling", n, v))
    for r in range(n):
        if r < 2 * rem and r % 2 == 0:  # an extra: its buffer out, the result back
            assert (sent[r], received[r]) == (v, v)
        elif r < 2 * rem:  # its partner: a member's share plus the result for the extra
            assert (sent[r], received[r]) == (member + v, member + v)
        else:
            assert (sent[r], received[r]) == (member, member)
    rs = _sent(_one_piece("reduce_scatter", "halving_doubling", n, v))
    ag = _sent(_one_piece("allgather", "halving_doubling", n, v))
    for r in range(0, 2 * rem, 2):
        assert rs[r] == n * v and ag[r] == v
    # Every block but one's own crosses to its owner at least once; the fold adds the extras'.
    assert sum(rs) >= n * (n - 1) * v and sum(ag) >= n * (n - 1) * v


@pytest.mark.parametrize("n", POW2 + OTHERS)
def test_pairwise_and_ps_bytes(n: int) -> None:
    v = 5
    assert _sent(_one_piece("alltoall", "pairwise", n, v)) == [(n - 1) * v] * n
    assert _sent(_one_piece("allreduce", "ps", n, v)) == [(n - 1) * v] + [v] * (n - 1)
    assert _received(_one_piece("allreduce", "ps", n, v)) == [(n - 1) * v] + [v] * (n - 1)
    root = n - 1
    assert _sent(_one_piece("reduce", "ps", n, v, root=root)) == [v] * (n - 1) + [0]
    assert _sent(_one_piece("broadcast", "ps", n, v, root=root)) == [0] * (n - 1) + [(n - 1) * v]


# --- partners and orders -------------------------------------------------------------------------
@pytest.mark.parametrize("n", range(2, 17))
def test_pairwise_partners(n: int) -> None:
    plan = _one_piece("alltoall", "pairwise", n, 2)
    for r, events in enumerate(channel_skeleton(plan)):
        sends = [peer for kind, peer, _ in events if kind == "send"]
        recvs = [peer for kind, peer, _ in events if kind == "recv"]
        if n & (n - 1) == 0:
            assert sends == recvs == [r ^ k for k in range(1, n)]
        else:
            assert sends == [(r + k) % n for k in range(1, n)]
            assert recvs == [(r - k) % n for k in range(1, n)]
        # Round by round: one send, then one receive.
        assert [kind for kind, _, _ in events] == ["send", "recv"] * (n - 1)


@pytest.mark.parametrize("n", (2, 4, 8))
def test_halving_doubling_partners_power_of_two(n: int) -> None:
    """Halving partners n/2, n/4, ..., 1 away, then doubling partners 1, 2, ..., n/2 away."""
    k = _log2(n)
    distances = [n >> (i + 1) for i in range(k)]
    for r, events in enumerate(channel_skeleton(_one_piece("allreduce", "halving_doubling", n, 8 * n))):
        peers = [peer for kind, peer, _ in events if kind == "send"]
        assert peers == [r ^ d for d in distances + distances[::-1]]


def test_ps_server_reduces_in_rank_order() -> None:
    n = 6
    plan = _one_piece("allreduce", "ps", n, 4)
    server = plan.programs[0]
    assert [s.recv for s in server if s.recv is not None] == list(range(1, n))
    assert [s.send for s in server if s.send is not None] == list(range(1, n))
    for r in range(1, n):
        assert [(kind, peer) for kind, peer, _ in channel_skeleton(plan)[r]] == [("send", 0), ("recv", 0)]


def test_chunk_bounds_halve_evenly() -> None:
    for count in (0, 1, 5, 6, 17, 100):
        for parts in (1, 2, 4, 8, 16):
            bounds = halving_doubling.chunk_bounds(count, parts)
            assert bounds[0] == 0 and bounds[-1] == count
            assert all(bounds[i] <= bounds[i + 1] for i in range(parts))
            size = parts
            while size > 1:
                for lo in range(0, parts, size):
                    cnt = bounds[lo + size] - bounds[lo]
                    first = bounds[lo + size // 2] - bounds[lo]
                    assert first == (cnt + 1) // 2
                size //= 2


def test_fold_maps_ranks_to_members() -> None:
    for n in range(1, 17):
        fold = halving_doubling.Fold(n)
        members = [fold.member(r) for r in range(n)]
        assert sorted(m for m in members if m is not None) == list(range(fold.pow2))
        for v in range(fold.pow2):
            assert fold.member(fold.rank_of(v)) == v
        assert fold.blocks((0, fold.pow2)) == range(n)


# --- message sizes and fusion --------------------------------------------------------------------
# Uniform collectives only: pairwise's alltoallv takes a matrix of counts and is checked (slot
# sizes, partners, tags) in test_varying_plans.py.
OURS = [
    (a.collective, a.name)
    for a in registry.algorithms()
    if a.name in ("halving_doubling", "pairwise", "ps") and a.collective != "alltoallv"
]


@pytest.mark.parametrize(("collective", "name"), OURS)
def test_no_message_exceeds_a_slot(collective: str, name: str) -> None:
    alg = registry.get(collective, name)
    for n in (1, 2, 3, 5, 8, 11):
        for slot in (1, 2, 3, 7):
            for count in (0, 1, slot, 2 * slot + 1, 5 * slot + 3):
                plan = plan_call(alg, n, count, slot)
                for piece in (plan.body, plan.tail):
                    if piece is None:
                        continue
                    for program in piece.programs:
                        for s in program:
                            if s.send is not None or s.recv is not None:
                                assert s.count <= slot, f"{collective}/{name} n={n} slot={slot}: {s}"


def _fused(plan: Plan, rank: int) -> list[Step]:
    return [s for s in plan.programs[rank] if s.recv is not None and s.send is not None]


def test_allreduce_fuses_fold_turn_and_fold_out() -> None:
    # n = 3: rank 0 folds into rank 1 (member 0), rank 2 is member 1.
    plan = _one_piece("allreduce", "halving_doubling", 3, 8)
    fused = _fused(plan, 1)
    # The extra's half reduced straight into the slot to rank 2, not stored anywhere.
    assert fused[0].reduce and fused[0].recv == 0 and fused[0].send == 2 and fused[0].dst is None
    # The turn: the final chunk leaves as it is computed.
    assert fused[1].reduce and fused[1].final and fused[1].recv == 2 and fused[1].send == 2
    # The fold out: what arrives in the last round is passed on to the extra.
    assert not fused[2].reduce and fused[2].recv == 2 and fused[2].send == 0
    assert _fused(plan, 2) == []  # the higher side of the turn must not fuse (see below)
    assert _fused(_one_piece("allreduce", "halving_doubling", 3, 0), 1) == []  # nothing to fuse


@pytest.mark.parametrize("n", (3, 5, 6, 7, 12))
def test_block_forwards_never_store_scratch(n: int) -> None:
    """A value reduced on its way out goes straight to the slot: no scratch store is left."""
    for collective in ("reduce_scatter", "allgather"):
        plan = _one_piece(collective, "halving_doubling", n, 4)
        fused = [s for r in range(n) for s in _fused(plan, r)]
        assert fused, collective
        assert all(s.dst is None or s.dst.buf != Buf.TMP for s in fused)


# --- the verifier rejects broken variants --------------------------------------------------------
def _unfused(collective: str, name: str, n: int, count: int, inplace: bool = False) -> Plan:
    alg = registry.get(collective, name)
    ctx = Context(kind=collective, algorithm=name, world_size=n, count=count, inplace=inplace)
    alg.build(ctx)
    return ctx.plan()


def _replace(plan: Plan, rank: int, index: int, step: Step) -> Plan:
    programs = [list(p) for p in plan.programs]
    programs[rank][index] = step
    return dataclasses.replace(plan, programs=programs)


def test_verifier_rejects_double_division() -> None:
    plan = _unfused("allreduce", "halving_doubling", 4, 8)
    i = next(i for i, s in enumerate(plan.programs[0]) if s.reduce and not s.final)
    bad = _replace(plan, 0, i, dataclasses.replace(plan.programs[0][i], final=True))
    verify_plan(fuse(plan))
    with pytest.raises(PlanError, match="AVG"):
        verify_plan(fuse(bad))


def test_verifier_rejects_a_dropped_fold() -> None:
    """The extra's partner storing the extra's data instead of combining it with its own."""
    plan = _unfused("allreduce", "halving_doubling", 3, 8)
    step = plan.programs[1][0]
    assert step.recv == 0 and step.reduce
    bad = _replace(plan, 1, 0, Step(count=step.count, recv=0, dst=step.dst))
    with pytest.raises(PlanError, match="expected each of"):
        verify_plan(fuse(bad))


def test_verifier_rejects_fusing_both_sides_of_the_turn() -> None:
    """The higher rank of the last pair keeps its final recv-reduce and its send apart (a
    zero-count step between them); fused on both sides, each fused step would wait for a slot
    the other has not emptied."""
    plan = _unfused("allreduce", "halving_doubling", 2, 8)
    higher = list(plan.programs[1])
    fence = next(i for i, s in enumerate(higher) if s.count == 0)
    assert higher[fence - 1].final and higher[fence + 1].send == 0
    assert len(_fused(fuse(plan), 1)) == 0
    bad = fuse(dataclasses.replace(plan, programs=[plan.programs[0], higher[:fence] + higher[fence + 1 :]]))
    assert len(_fused(bad, 1)) == 1
    verify_plan(bad, nslots=2)  # fine with a spare slot ...
    with pytest.raises(PlanError, match="deadlock"):
        verify_plan(bad, nslots=1)  # ... but not with one


def _recursive_doubling_allreduce(ctx: Context) -> None:
    """Broken on purpose: each rank combines ``mine (op) theirs``, so partners compute the same
    element in opposite operand orders and results differ across ranks in floating point."""
    n = ctx.world_size
    d = 1
    src = Buf.IN
    while d < n:
        final = d * 2 == n
        for r in range(n):
            ctx.send(r, r ^ d, ctx.region(src), ctx.count)
            ctx.recv_reduce(r, r ^ d, ctx.region(src), ctx.region(Buf.OUT), ctx.count, final=final)
        src = Buf.OUT
        d *= 2


def test_verifier_rejects_recursive_doubling_with_own_operand_first() -> None:
    ctx = Context(kind="allreduce", algorithm="halving_doubling", world_size=4, count=3)
    _recursive_doubling_allreduce(ctx)
    with pytest.raises(PlanError, match="differently"):
        verify_plan(fuse(ctx.plan()))


def _pairwise_unparked(ctx: Context) -> None:
    """Broken on purpose in place: receives straight into OUT before our block has left."""
    n = ctx.world_size
    for r in range(n):
        for k in range(1, n):
            to, frm = pairwise.partners(r, n, k)
            ctx.send(r, to, ctx.block_region(Buf.IN, to), ctx.count)
            ctx.recv(r, frm, ctx.block_region(Buf.OUT, frm), ctx.count)
        if not ctx.inplace:
            ctx.copy(r, ctx.block_region(Buf.IN, r), ctx.block_region(Buf.OUT, r), ctx.count)


@pytest.mark.parametrize("n", (3, 5, 6))
def test_verifier_rejects_unparked_in_place_pairwise(n: int) -> None:
    for inplace in (False, True):
        ctx = Context(kind="alltoall", algorithm="pairwise", world_size=n, count=2, inplace=inplace)
        _pairwise_unparked(ctx)
        seg = CallPlan(body=None, tail=fuse(ctx.plan()), reps=0, piece=2)
        if inplace:
            with pytest.raises(PlanError, match="expected"):
                verify(seg, world_size=n, count=2, inplace=True)
        else:
            verify(seg, world_size=n, count=2)
