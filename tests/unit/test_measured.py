"""The measured choice (``comm.measured``): its votes, explorations and backoff, with the ranks'
agreement simulated (the other plan runs only where every rank votes for it), and which call
shapes ``select.rival`` measures."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from shmcoll.algos import select
from shmcoll.algos.registry import Query
from shmcoll.comm.measured import FIRST_GAP, LAST_GAP, Measured
from shmcoll.shm import cma

Clock = Callable[[int, int, int], float]  # (rank, plan, call) -> microseconds


def run(calls: int, clock: Clock, ranks: int = 2) -> tuple[list[int], list[Measured]]:
    """``calls`` calls of one measured call shape at ``ranks`` ranks, agreed as ``comm.pages``
    agrees: the plan each ran, and each rank's record."""
    shapes = [Measured() for _ in range(ranks)]
    ran = []
    for call in range(1, calls + 1):
        votes = [m.vote() for m in shapes]
        plan = int(all(votes))
        for r, m in enumerate(shapes):
            m.ran(plan)
            m.took(int(clock(r, plan, call) * 1e3))
        ran.append(plan)
    return ran, shapes


def explorations(shape: Measured, calls: int) -> list[int]:
    """The calls at which ``shape``'s schedule explores, if the choice never changes."""
    m, found = Measured(), []
    for call in range(1, calls + 1):
        m.vote()
        if m.exploring:
            found.append(call)
        m.ran(m.steady if not m.exploring else 1 - m.steady)
    return found


def test_the_faster_plan_runs_and_the_other_is_explored_ever_less_often() -> None:
    ran, shapes = run(6000, lambda r, plan, call: 100.0 if plan else 200.0)
    # auto's pick, the other explored twice (a plan's first run is not timed), auto's pick again;
    # the other's second timed run (the next exploration) confirms it, and it runs from there
    assert ran[:4] == [0, 1, 1, 0] and ran[2 + FIRST_GAP] == 1 and set(ran[2 + FIRST_GAP :]) != {0}, ran[:16]
    first = ran.index(1, 3 + FIRST_GAP)
    assert first == 3 + FIRST_GAP and all(ran[first : first + FIRST_GAP - 1]), ran[:30]
    slow = [i + 1 for i, plan in enumerate(ran) if plan == 0 and i > first]  # explorations of the slower plan
    assert len(slow) <= 9 + 6000 // LAST_GAP, slow
    gaps = [b - a for a, b in zip(slow[1:], slow[2:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] == LAST_GAP, gaps
    assert shapes[0].runs == shapes[1].runs and shapes[0].changes == 1


def test_the_choice_follows_a_change_of_speed_within_one_longest_gap() -> None:
    def clock(r: int, plan: int, call: int) -> float:
        # the other plan is faster until call 2000, then twice as slow
        return (100.0 if plan else 200.0) if call < 2000 else (400.0 if plan else 200.0)

    ran, shapes = run(8000, clock)
    back = next(i + 1 for i in range(1999, 8000) if ran[i] == 0 and all(p == 0 for p in ran[i : i + 50]))
    assert back - 2000 <= 2 * LAST_GAP + 3, back  # (two explorations confirm a change)
    after = ran[back:]
    assert after.count(1) <= 8 + len(after) // LAST_GAP, after.count(1)  # explored again, ever less often
    assert shapes[0].steady == shapes[1].steady == 0


def test_auto_s_pick_runs_where_the_ranks_disagree() -> None:
    # rank 0 finds the other plan faster, rank 1 finds it slower: only explorations run it
    ran, shapes = run(2000, lambda r, plan, call: (100.0 if plan else 200.0) if r == 0 else (300.0 if plan else 200.0))
    ones = [i + 1 for i, plan in enumerate(ran) if plan == 1]
    assert ones == explorations(shapes[0], 2000)
    assert shapes[0].changes == shapes[1].changes == 0


def test_plans_within_the_margin_keep_the_one_running() -> None:
    ran, shapes = run(2000, lambda r, plan, call: 100.0 if plan else 108.0)
    assert shapes[0].changes == 0 and ran.count(1) == len(explorations(shapes[0], 2000))
    # the margin is on the plan not running: once the other runs, an 8% edge keeps it
    m = Measured()
    m.steady, m.runs, m.calls, m.explore_at = 1, [5, 5], 10, 100
    m.last = 0
    m.took(100_000)
    m.took(100_000)
    m.last = 1
    m.took(108_000)
    assert m.vote() is True


def test_one_call_alone_does_not_change_the_choice() -> None:
    # one call of the running plan preempted (10x): the least of three ignores it
    ran, shapes = run(600, lambda r, plan, call: 1000.0 if call == 300 else (100.0 if plan else 150.0))
    assert shapes[0].changes == shapes[1].changes == 1 and ran[300:310] == [1] * 10
    # one lucky exploration of the other plan (10x faster once): it takes two
    lucky = 3 + 3 * FIRST_GAP  # (an exploration)
    ran, shapes = run(600, lambda r, plan, call: 10.0 if plan and call == lucky else (150.0 if plan else 100.0))
    assert shapes[0].changes == 0 and ran.count(1) == len(explorations(shapes[0], 600))


def test_explorations_start_at_the_second_call_and_back_off() -> None:
    found = explorations(Measured(), 6000)
    # twice at first (a plan's first run is not timed), then ever further apart
    assert found[:5] == [2, 3, 3 + FIRST_GAP, 3 + 3 * FIRST_GAP, 3 + 7 * FIRST_GAP], found[:5]
    assert all(b - a == LAST_GAP for a, b in zip(found[-3:], found[-2:], strict=False))


def test_a_plan_s_estimate_is_the_least_of_its_last_three_times_after_its_first_run() -> None:
    m = Measured()
    m.ran(0)
    m.took(999_000)  # its first run: first touches, not timed
    assert m.times[0] == []
    for ns in (5_000, 1_000, 4_000, 3_000, 6_000):
        m.ran(0)
        m.took(ns)
    assert m.times[0] == [4_000, 3_000, 6_000] and m.describe() == "plan 0: 3.0 us, plan 1: -"


# --- which call shapes are measured -------------------------------------------------------------
@pytest.fixture
def fresh():  # type: ignore[no-untyped-def]
    select.reset()
    yield
    select.reset()


def _query(collective: str, nbytes: int, crossover: int, n: int = 2, **kw: object) -> Query:
    per = 1 if collective in ("allreduce", "broadcast") else n
    return Query(collective, n, nbytes // 4 // per, 4, cma=True, cma_crossover=crossover, cores=2, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("collective", ["allreduce", "allgather", "alltoall", "broadcast", "reduce_scatter"])
def test_rival_is_cma_or_auto_s_pick_without_it(fresh, collective: str) -> None:  # type: ignore[no-untyped-def]
    for nbytes in (select.MEASURED_FROM, 2 * select.MEASURED_FROM, 64 << 20):
        for crossover in (cma.LADDER_BYTES[0], cma.NEVER):
            q = _query(collective, nbytes, crossover)
            picked, other = select.choose(q, quiet=True), select.rival(q)
            assert other is not None and other.name != picked.name, (collective, nbytes)
            if picked.name == "cma":
                assert other.name == select.choose(dataclasses.replace(q, cma=False), quiet=True).name
            else:
                assert other.name == "cma", (collective, nbytes, crossover, picked.name)
            # in place or not: one answer (every rank decides alike)
            assert select.rival(dataclasses.replace(q, inplace=True)) is other


def test_no_rival_below_the_size_with_one_rank_without_cma_or_by_override_or_pages(fresh, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from shmcoll import config

    big = _query("allgather", 4 << 20, cma.LADDER_BYTES[0])
    assert select.rival(big) is not None
    assert select.rival(_query("allgather", select.MEASURED_FROM // 2, cma.LADDER_BYTES[0])) is None
    assert select.rival(dataclasses.replace(big, cma=False)) is None
    assert select.rival(_query("allreduce", 4 << 20, cma.LADDER_BYTES[0], n=1)) is None
    assert select.rival(dataclasses.replace(big, huge_pages=True)) is None  # (the pages decided)
    monkeypatch.setenv("SHMCOLL_ALGO", "allgather:direct")
    config.reload()
    select.reset()
    try:
        assert select.rival(big) is None
    finally:
        monkeypatch.undo()
        config.reload()
