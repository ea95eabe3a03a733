"""The variable-count collectives' plans (allgatherv, gatherv, scatterv, reduce_scatterv, alltoallv)
verified symbolically for world sizes 1..16, every root and count pattern, plus the scans' chain
shape, the message tags, and the broken variants the verifier must reject. No processes.

``test_plans.py`` sweeps the uniform collectives (scan and exscan among them); the plans here take
their counts (``counts``, ``matrix``) and are built as one plan per call, so they get their own.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import pytest

from shmcoll import collectives
from shmcoll.algos import pairwise, registry
from shmcoll.plan import cost
from shmcoll.plan.builder import Context, displs, fragments, whole_call
from shmcoll.plan.ir import Buf, CallPlan, Region, Step
from shmcoll.plan.passes import build_piece, channel_skeleton, plan_call
from shmcoll.plan.verify import PlanError, verify

SLOT = 4  # elements per slot: small, so that blocks of a few elements take several messages
VARYING = [(a.collective, a.name) for a in registry.algorithms() if collectives.get(a.collective).varying]
BLOCKED = [(c, name) for c, name in VARYING if c != "alltoallv"]
ALLTOALLV = [(c, name) for c, name in VARYING if c == "alltoallv"]

Matrix = tuple[tuple[int, ...], ...]


def count_patterns(n: int) -> Iterator[tuple[int, ...]]:
    """Counts per rank: none at all, uneven with zeros, one rank with several slots' worth,
    every block a different number of fragments, and one element each."""
    yield (0,) * n
    yield tuple((j * 7) % 5 for j in range(n))
    yield tuple(3 * SLOT + 1 if j == n // 2 else (0 if j % 2 else 2) for j in range(n))
    yield tuple((j % 4) * SLOT + j % 3 for j in range(n))
    yield (1,) * n


def matrix_patterns(n: int) -> Iterator[Matrix]:
    """Counts per pair ``[i][j]`` (rank i to rank j): as ``count_patterns``, plus a heavy row, a
    heavy column and one heavy pair (so ranks differ in how many rounds they take part in)."""
    yield tuple((0,) * n for _ in range(n))
    yield tuple(tuple((i * 7 + j * 3) % 5 for j in range(n)) for i in range(n))
    yield tuple(
        tuple(3 * SLOT + 1 if (i, j) == (n // 2, n - 1 - n // 2) else (i + j) % 2 for j in range(n)) for i in range(n)
    )
    yield tuple(tuple(2 * SLOT + j if i == 0 else j % 2 for j in range(n)) for i in range(n))
    yield tuple(tuple(2 * SLOT + i if j == n - 1 else 0 for j in range(n)) for i in range(n))


def _roots(collective: str, n: int) -> range:
    return range(n) if collectives.get(collective).rooted else range(1)


def _check(collective: str, name: str, n: int, *, counts: tuple[int, ...] = (), matrix: Matrix = ()) -> None:
    """Every root, in place and not, built for one and two slots and verified with one and two."""
    alg = registry.get(collective, name)
    total = sum(counts) + sum(map(sum, matrix))
    modes = (False,) if collective == "alltoallv" else (False, True)
    for root in _roots(collective, n):
        for inplace in modes:
            for built_for in (1, 2):
                plan = plan_call(
                    alg, n, total, SLOT, root=root, inplace=inplace, nslots=built_for, counts=counts, matrix=matrix
                )
                assert plan.body is None and plan.reps == 0
                for nslots in range(built_for, 3):
                    verify(
                        plan,
                        world_size=n,
                        count=total,
                        root=root,
                        inplace=inplace,
                        nslots=nslots,
                        counts=counts,
                        matrix=matrix,
                    )


def _sweep(collective: str, name: str, sizes: range) -> None:
    for n in sizes:
        if collective == "alltoallv":
            for matrix in matrix_patterns(n):
                _check(collective, name, n, matrix=matrix)
        else:
            for counts in count_patterns(n):
                _check(collective, name, n, counts=counts)


# --- the sweep ---------------------------------------------------------------------------------
def test_every_variable_count_collective_has_plans() -> None:
    kinds = {c for c in collectives.COLLECTIVES if collectives.get(c).varying}
    assert {c for c, _ in VARYING} == kinds
    assert ("allgatherv", "ring") in VARYING and ("alltoallv", "pairwise") in VARYING


@pytest.mark.parametrize(("collective", "name"), VARYING)
def test_verifier_accepts_every_plan(collective: str, name: str) -> None:
    _sweep(collective, name, range(1, 17))


@pytest.mark.slow
@pytest.mark.parametrize(("collective", "name"), VARYING)
def test_larger_worlds_verify(collective: str, name: str) -> None:
    _sweep(collective, name, range(17, 34, 8))


@pytest.mark.parametrize(("collective", "name"), VARYING)
def test_no_message_exceeds_a_slot_and_none_is_empty(collective: str, name: str) -> None:
    alg = registry.get(collective, name)
    for n in (1, 2, 3, 5, 8):
        for slot in (1, 3, 7):
            for counts, matrix in _shapes(collective, n):
                plan = plan_call(alg, n, 0, slot, root=n - 1, counts=counts, matrix=matrix)
                for r, program in enumerate(plan.tail.programs):
                    for s in program:
                        if s.recv is not None or s.send is not None:
                            assert 0 < s.count <= slot, f"{collective}/{name} n={n} rank {r}: {s}"


def _shapes(collective: str, n: int) -> Iterator[tuple[tuple[int, ...], Matrix]]:
    if collective == "alltoallv":
        for matrix in matrix_patterns(n):
            yield (), matrix
    else:
        for counts in count_patterns(n):
            yield counts, ()


def test_zero_counts_send_nothing() -> None:
    for collective, name in VARYING:
        for n in (1, 2, 5):
            counts, matrix = next(_shapes(collective, n))  # the all-zero pattern
            plan = plan_call(registry.get(collective, name), n, 0, SLOT, counts=counts, matrix=matrix)
            assert all(not program for program in plan.tail.programs), (collective, name, n)


@pytest.mark.parametrize(("collective", "name"), VARYING)
def test_in_place_never_changes_messages(collective: str, name: str) -> None:
    """Ranks choose in place independently, so it may change only local steps (tags included)."""
    if collective == "alltoallv":
        return  # never in place
    alg = registry.get(collective, name)

    def messages(plan: CallPlan) -> list[list[tuple[int | None, int | None, int, int]]]:
        return [
            [(s.recv, s.send, s.count, s.tag) for s in program if s.recv is not None or s.send is not None]
            for program in plan.tail.programs
        ]

    for n in (1, 2, 3, 5, 8):
        for root in _roots(collective, n):
            for counts in count_patterns(n):
                a, b = (
                    plan_call(alg, n, sum(counts), SLOT, root=root, inplace=inplace, counts=counts)
                    for inplace in (False, True)
                )
                assert messages(a) == messages(b)


# --- tags --------------------------------------------------------------------------------------
def _block_of(offset: int, counts: tuple[int, ...]) -> int:
    starts = displs(counts)
    return max(j for j in range(len(counts)) if starts[j] <= offset and counts[j] > 0)


@pytest.mark.parametrize(("collective", "name"), BLOCKED)
def test_every_message_carries_its_blocks_count(collective: str, name: str) -> None:
    """The tag of a message is the count of the block it belongs to, plus one: found from where
    the block lies in the blocked buffer (the receiver's output, or the sender's input)."""
    alg = registry.get(collective, name)
    for n in (2, 3, 6):
        counts = tuple(2 * SLOT + 1 + j if j % 3 else j for j in range(n))
        checked = 0
        for root in _roots(collective, n):
            plan = plan_call(alg, n, sum(counts), SLOT, root=root, counts=counts).tail
            for program in plan.programs:
                for s in program:
                    if collective in ("allgatherv", "gatherv") and s.recv is not None:
                        assert s.dst is not None and s.dst.buf == Buf.OUT
                        assert s.tag == counts[_block_of(s.dst.off, counts)] + 1, str(s)
                        checked += 1
                    if collective in ("scatterv", "reduce_scatterv") and s.send is not None and s.recv is None:
                        assert s.a is not None and s.a.buf == Buf.IN
                        assert s.tag == counts[_block_of(s.a.off, counts)] + 1, str(s)
                        checked += 1
        assert checked > 0


@pytest.mark.parametrize(("collective", "name"), ALLTOALLV)
def test_alltoallv_tags_are_the_pairs_counts(collective: str, name: str) -> None:
    for n in (2, 3, 4, 7):
        for matrix in matrix_patterns(n):
            plan = plan_call(registry.get(collective, name), n, 0, SLOT, matrix=matrix).tail
            for r, program in enumerate(plan.programs):
                for s in program:
                    if s.send is not None:
                        assert s.tag == matrix[r][s.send] + 1
                    if s.recv is not None:
                        assert s.tag == matrix[s.recv][r] + 1


@pytest.mark.parametrize(("collective", "name"), ALLTOALLV)
def test_alltoallv_rank_reads_only_its_row_and_column(collective: str, name: str) -> None:
    """At run time a rank knows only what it sends and receives: its program must not change
    when the rest of the matrix does (here: is zeroed)."""
    alg = registry.get(collective, name)
    for n in (2, 3, 5, 8):
        for matrix in matrix_patterns(n):
            full = plan_call(alg, n, 0, SLOT, matrix=matrix).tail
            for r in range(n):
                known = tuple(tuple(v if r in (i, j) else 0 for j, v in enumerate(row)) for i, row in enumerate(matrix))
                assert plan_call(alg, n, 0, SLOT, matrix=known).tail.programs[r] == full.programs[r]


def test_plans_need_their_counts() -> None:
    for collective, name in VARYING:
        with pytest.raises(ValueError, match="needs"):
            plan_call(registry.get(collective, name), 3, 12, SLOT)
    plan = plan_call(registry.get("allgatherv", "direct"), 3, 6, SLOT, counts=(1, 2, 3))
    with pytest.raises(PlanError, match="counts"):
        verify(plan, world_size=3, count=6)
    matrix = ((1, 1), (1, 1))
    plan = plan_call(registry.get("alltoallv", "direct"), 2, 4, SLOT, matrix=matrix)
    with pytest.raises(PlanError, match="never in place"):
        verify(plan, world_size=2, count=4, inplace=True, matrix=matrix)


# --- shapes ------------------------------------------------------------------------------------
def _events(plan: CallPlan, rank: int) -> list[tuple[str, int, int]]:
    return channel_skeleton(plan.tail)[rank]


def test_direct_rounds_move_one_fragment_of_every_block() -> None:
    """Round f: fragment f of each block that has one, sends before receives, one per channel."""
    counts = (9, 0, 4, 1)  # 3, 0, 1 and 1 fragments of 4
    plan = plan_call(registry.get("allgatherv", "direct"), 4, 14, SLOT, counts=counts)
    frags = [fragments(c, SLOT) for c in counts]
    for r in range(4):
        want = []
        for f in range(3):
            peers = [(r + k) % 4 for k in range(1, 4)]
            if f < len(frags[r]):
                want += [("send", p, frags[r][f][1]) for p in peers]
            want += [("recv", p, frags[p][f][1]) for p in peers if f < len(frags[p])]
        assert _events(plan, r) == want


@pytest.mark.parametrize("n", range(2, 10))
def test_ring_allgatherv_forwards_each_block_round_the_ring(n: int) -> None:
    """Every rank sends only right and receives only left; block j's fragments reach every
    other rank once, and all but the last hop forward them (fused, with two slots)."""
    counts = tuple((j * 7) % 5 + (2 * SLOT if j == 1 else 0) for j in range(n))
    alg = registry.get("allgatherv", "ring")
    plan = plan_call(alg, n, sum(counts), SLOT, counts=counts, nslots=2)
    messages = sum(len(fragments(c, SLOT)) for c in counts)
    for r in range(n):
        events = _events(plan, r)
        assert {p for kind, p, _ in events if kind == "send"} <= {(r + 1) % n}
        assert {p for kind, p, _ in events if kind == "recv"} <= {(r - 1) % n}
        assert sum(c for kind, _, c in events if kind == "recv") == sum(counts) - counts[r]
        assert sum(c for kind, _, c in events if kind == "send") == sum(counts) - counts[(r + 1) % n]
        fused = [s for s in plan.tail.programs[r] if s.recv is not None and s.send is not None]
        forwarded = messages - len(fragments(counts[r], SLOT)) - len(fragments(counts[(r + 1) % n], SLOT))
        assert len(fused) == forwarded


def test_ring_allgatherv_needs_its_held_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """As ring allgather: every forward fused deadlocks with one slot per ring (fine with two)."""
    monkeypatch.setattr(Context, "no_fuse", lambda self, rank: None)
    counts = (5, 6, 2, 9)
    plan = plan_call(registry.get("allgatherv", "ring"), 4, sum(counts), SLOT, counts=counts)
    verify(plan, world_size=4, count=sum(counts), counts=counts, nslots=2)
    with pytest.raises(PlanError, match="deadlock"):
        verify(plan, world_size=4, count=sum(counts), counts=counts, nslots=1)


@pytest.mark.parametrize("n", (3, 4, 5, 6, 8))
def test_pairwise_alltoallv_partners_and_interleaving(n: int) -> None:
    """n-1 rounds with pairwise's partners; within a round fragment f goes out, then fragment f
    comes in."""
    matrix = tuple(tuple(0 if i == j else SLOT * ((i + 2 * j) % 3) + 1 for j in range(n)) for i in range(n))
    plan = plan_call(registry.get("alltoallv", "pairwise"), n, 0, SLOT, matrix=matrix)
    for r in range(n):
        want = []
        for k in range(1, n):
            to, frm = pairwise.partners(r, n, k)
            out, into = fragments(matrix[r][to], SLOT), fragments(matrix[frm][r], SLOT)
            for f in range(max(len(out), len(into))):
                want += [("send", to, out[f][1])] if f < len(out) else []
                want += [("recv", frm, into[f][1])] if f < len(into) else []
        assert _events(plan, r) == want


@pytest.mark.parametrize("kind", ["scan", "exscan"])
@pytest.mark.parametrize("n", range(2, 10))
def test_ring_scans_are_chains(kind: str, n: int) -> None:
    """Rank r hears only r-1 and tells only r+1, one message each per piece; scan fuses the
    forward with the receive, exscan cannot (it forwards a value it does not store)."""
    plan = build_piece(registry.get(kind, "ring"), n, 6, block=6)
    for r in range(n):
        events = channel_skeleton(plan)[r]
        assert [(k, p) for k, p, _ in events if k == "recv"] == ([("recv", r - 1)] if r else [])
        assert [(k, p) for k, p, _ in events if k == "send"] == ([("send", r + 1)] if r < n - 1 else [])
        fused = [s for s in plan.programs[r] if s.recv is not None and s.send is not None]
        assert len(fused) == (1 if kind == "scan" and 0 < r < n - 1 else 0)
    if kind == "exscan":
        assert all(s.dst is None or s.dst.buf != Buf.OUT for s in plan.programs[0])


# --- the verifier rejects broken variants ------------------------------------------------------
def _replace(plan: CallPlan, rank: int, pick, **changes) -> CallPlan:  # type: ignore[no-untyped-def]
    programs = [list(p) for p in plan.tail.programs]
    index = next(i for i, s in enumerate(programs[rank]) if pick(s))
    programs[rank][index] = dataclasses.replace(programs[rank][index], **changes)
    return dataclasses.replace(plan, tail=dataclasses.replace(plan.tail, programs=programs))


def test_verifier_rejects_a_mismatched_tag() -> None:
    counts = (3, 5, 2)
    plan = plan_call(registry.get("allgatherv", "direct"), 3, 10, SLOT, counts=counts)
    verify(plan, world_size=3, count=10, counts=counts)
    bad = _replace(plan, 2, lambda s: s.recv == 1, tag=counts[1])
    with pytest.raises(PlanError, match="tag"):
        verify(bad, world_size=3, count=10, counts=counts)
    untagged = plan_call(registry.get("allgatherv", "direct"), 3, 10, SLOT, counts=counts)
    programs = [[dataclasses.replace(s, tag=0) for s in p] for p in untagged.tail.programs]
    untagged = dataclasses.replace(untagged, tail=dataclasses.replace(untagged.tail, programs=programs))
    with pytest.raises(PlanError, match="needs a tag"):
        verify(untagged, world_size=3, count=10, counts=counts)


def test_ranks_that_disagree_on_the_counts_meet_a_tag_mismatch() -> None:
    """Rank 1 built with 6 elements for itself, the others with 5: the first fragment has the
    same size either way, and only its tag tells them apart (the engine reports a mismatch)."""
    alg = registry.get("gatherv", "direct")
    agreed, other = (3, 5, 2), (3, 6, 2)
    plan = plan_call(alg, 3, 10, SLOT, counts=agreed)
    mixed = plan_call(alg, 3, 11, SLOT, counts=other).tail.programs[1]
    programs = [plan.tail.programs[0], mixed, plan.tail.programs[2]]
    bad = dataclasses.replace(plan, tail=dataclasses.replace(plan.tail, programs=programs))
    with pytest.raises(PlanError, match="tag 6 but rank 1 sent tag 7"):
        verify(bad, world_size=3, count=10, counts=agreed)


def _all_fragments_first(ctx: Context) -> None:
    """Broken on purpose: every rank sends all its block's fragments before receiving any."""
    counts = ctx.counts
    at = displs(counts)
    n = ctx.world_size
    for r in range(n):
        for peer in range(n):
            if peer != r:
                for off, c in fragments(counts[r], ctx.slot_capacity):
                    ctx.emit(r, Step(count=c, send=peer, a=Region(Buf.IN, off), tag=counts[r] + 1))
        for peer in range(n):
            if peer != r:
                for off, c in fragments(counts[peer], ctx.slot_capacity):
                    ctx.emit(r, Step(count=c, recv=peer, dst=Region(Buf.OUT, at[peer] + off), tag=counts[peer] + 1))
        ctx.copy(r, Region(Buf.IN, 0), Region(Buf.OUT, at[r]), counts[r])


def test_verifier_rejects_a_deadlocking_fragment_order() -> None:
    alg = registry.Algorithm("allgatherv", "direct", _all_fragments_first, whole_call, lambda q: None, "")
    counts = (2 * SLOT, 2 * SLOT, 1)
    plan = plan_call(alg, 3, sum(counts), SLOT, counts=counts)
    verify(plan, world_size=3, count=sum(counts), counts=counts, nslots=2)  # two slots hold both fragments
    with pytest.raises(PlanError, match="deadlock"):
        verify(plan, world_size=3, count=sum(counts), counts=counts, nslots=1)
    # Blocks of one fragment each are fine either way: the rounds matter only past one slot.
    small = (SLOT, 1, 0)
    verify(plan_call(alg, 3, sum(small), SLOT, counts=small), world_size=3, count=sum(small), counts=small)


def test_verifier_rejects_wrong_blocks_and_orders() -> None:
    counts = (3, 1, 2)
    # allgatherv: block 1 stored one element too far.
    plan = plan_call(registry.get("allgatherv", "ring"), 3, 6, SLOT, counts=counts)
    with pytest.raises(PlanError, match="expected|outside"):
        shifted = _replace(plan, 0, lambda s: s.recv is not None and s.dst.off == 3, dst=Region(Buf.OUT, 4))
        verify(shifted, world_size=3, count=6, counts=counts)
    # reduce_scatterv: rank 2 combining x0 and x1 in the wrong order.
    plan = plan_call(registry.get("reduce_scatterv", "direct"), 3, 6, SLOT, counts=counts)
    verify(plan, world_size=3, count=6, counts=counts)
    first = next(s for s in plan.tail.programs[2] if s.recv is not None)
    second = next(s for s in plan.tail.programs[2] if s.recv is not None and s is not first)
    programs = [list(p) for p in plan.tail.programs]
    i, j = programs[2].index(first), programs[2].index(second)
    programs[2][i] = dataclasses.replace(first, recv=second.recv)
    programs[2][j] = dataclasses.replace(second, recv=first.recv)
    swapped = dataclasses.replace(plan, tail=dataclasses.replace(plan.tail, programs=programs))
    with pytest.raises(PlanError, match="rank order"):
        verify(swapped, world_size=3, count=6, counts=counts)


def test_verifier_rejects_broken_scans() -> None:
    n, count = 4, 3  # one piece
    scan = plan_call(registry.get("scan", "ring"), n, count, SLOT)
    verify(scan, world_size=n, count=count)
    # x_r (op) prefix instead of prefix (op) x_r: a different expression from direct's.
    flipped = _replace(scan, 2, lambda s: s.reduce, recv_left=False, a=Region(Buf.IN, 0), b=None)
    with pytest.raises(PlanError, match="expected"):
        verify(flipped, world_size=n, count=count)
    # A scan never divides.
    with pytest.raises(PlanError, match="expected"):
        verify(_replace(scan, 3, lambda s: s.reduce, final=True), world_size=n, count=count)
    exscan = plan_call(registry.get("exscan", "direct"), n, count, SLOT)
    verify(exscan, world_size=n, count=count)
    programs = [list(p) for p in exscan.tail.programs]
    programs[0].append(Step(count=count, a=Region(Buf.IN, 0), dst=Region(Buf.OUT, 0)))
    wrote = dataclasses.replace(exscan, tail=dataclasses.replace(exscan.tail, programs=programs))
    with pytest.raises(PlanError, match="rank 0 writes"):
        verify(wrote, world_size=n, count=count)


# --- the cost model ----------------------------------------------------------------------------
@pytest.mark.parametrize(("collective", "name"), VARYING)
def test_cost_model_simulates_even_counts(collective: str, name: str) -> None:
    """``plan_time`` (what auto weighs) spreads the call's total evenly over the ranks (alltoallv:
    the total is each rank's send total, as bench sizes it)."""
    model = cost.CostModel(alpha_s=1e-6, beta_Bps=1e9)
    for n, total in itertools.product((1, 3, 4), (0, 7, 4096)):
        got = cost.plan_time(registry.get(collective, name), n, total, 4, model, 64 * 4)
        assert got.exact and 0 <= got.time_s < 1
    n, total = 4, 4 * 1000
    traffic = cost.plan_time(registry.get(collective, name), n, total, 4, model, 64 * 4).traffic_bytes
    per_rank = total // n
    want = {
        "allgatherv": n * (n - 1) * per_rank,
        "gatherv": (n - 1) * per_rank,
        "scatterv": (n - 1) * per_rank,
        "reduce_scatterv": n * (n - 1) * per_rank,
        "alltoallv": n * (n - 1) * per_rank,
    }[collective]
    assert traffic == 4 * want
