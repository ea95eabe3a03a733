"""The timed choice (``comm/timed.py``): ranks that choose between ``auto``'s plan and cma at every
call by what the leader's calls took run the same plan at every call, get exact results, and
follow the leader's times: cma while the rings' calls are slow, the rings again once they are
not. The times are made up where a test needs a plan to be slower than the other (each rank
scales what its calls took), so that the test does not hang on the machine's spells."""

from __future__ import annotations

import ast
import contextlib
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
from harness import run_ranks

import shmcoll
from shmcoll import PeerLostError
from shmcoll.algos.registry import ALGORITHM_NAMES
from shmcoll.comm.bind import MEMO_MAX_BYTES
from shmcoll.comm.timed import (
    BROADCAST_FROM,
    EXPLORE_CALLS,
    FIRST_CALLS,
    PAIR_FROM,
    PROBE_CALLS,
    PROBE_LEN,
    SAMPLE,
    TIMED_FROM,
    WARM_CALLS,
)
from shmcoll.engine import cpu as engine
from shmcoll.plan import ir
from shmcoll.shm import cma, layout, pages

permitted = pytest.mark.skipif(not cma.probe()[0], reason=f"cross-memory attach {cma.probe()[1]}")

COUNT = TIMED_FROM // 4  # float32: the smallest timed call
PAIR_COUNT = PAIR_FROM // 4  # the same at 2 ranks
PAGED_PAIR_COUNT = (1 << 20) // 4  # a 2-rank reduce page-aware too (cma.huge_from)


@contextlib.contextmanager
def _scaled(scale: dict[str, float]) -> Iterator[list[str]]:
    """While the block runs, this rank's calls of the rings' plan (``"own"``) and of cma
    (``"cma"``) count as ``scale`` times what they took (changed in place to change it midway);
    yields the labels of the plans run, in order."""
    from shmcoll.comm import pages as agreement
    from shmcoll.comm import timed

    ran: list[str] = []
    own_count, own_agreed = timed.Timed._count, agreement.agreed

    def count(self, alt, elapsed_ns):  # type: ignore[no-untyped-def]
        own_count(self, alt, int(elapsed_ns * scale["cma" if alt else "own"]))

    def agreed(rt, b, limit):  # type: ignore[no-untyped-def]
        chosen = own_agreed(rt, b, limit)
        ran.append("cma" if "algorithm=cma" in chosen[0].label else "own")
        return chosen

    timed.Timed._count, agreement.agreed = count, agreed  # type: ignore[method-assign,assignment]
    try:
        yield ran
    finally:
        timed.Timed._count, agreement.agreed = own_count, own_agreed  # type: ignore[method-assign]


def _expected(n: int, count: int = COUNT) -> np.ndarray:
    return n * (np.arange(count, dtype=np.float32) % 1000) + sum(range(n))


def _follows(comm, slow_first: list[str], calls: tuple[int, int], count: int = COUNT, on: str | list[str] = "numpy"):  # type: ignore[no-untyped-def]
    """``calls[0]`` reduces of ``count`` elements (on pages ``on``, or ``on[rank]``) in which this rank's calls of
    ``slow_first[rank]`` ("own", "cma" or "") count 20 times what they took, then ``calls[1]`` in
    which the other plan's do: the plans run, whether every result was exact, the algorithm auto
    picked, and whether the call shape was page-aware too. (The plan run is read from the rank's
    record after each call: a remembered call's agreement may run in compiled code.)"""
    r, n = comm.rank, comm.world_size
    kind = on[r] if isinstance(on, list) else on
    x = pages.array(count, np.float32, kind)
    x[...] = (np.arange(count, dtype=np.float32) % 1000) + r
    out = pages.array(count, np.float32, kind)
    expected = _expected(n, count)
    scale = {"own": 1.0, "cma": 1.0}
    slow = slow_first[r]
    exact = True
    ran = []
    with _scaled(scale):
        for phase, count in enumerate(calls):
            if slow:
                other = "cma" if slow == "own" else "own"
                scale[slow], scale[other] = (20.0, 1.0) if phase == 0 else (1.0, 20.0)
            for _ in range(count):
                out[...] = -1
                got = comm.reduce(x, 0, out=out if r == 0 else None)
                exact &= r != 0 or bool(np.array_equal(got, expected))
                ran.append(_plan_run(comm))
    shape = next(c for c in comm._calls.values() if getattr(c, "timed", None) is not None)
    return ran, exact, shape.label, shape.timed.paged


def _plan_run(comm) -> str:  # type: ignore[no-untyped-def]
    """Which plan this rank's last call ran ("cma" or "own"), from its rank record."""
    sig = comm._arena.rank_field(comm.rank, layout.R_DONE_SIG)
    return "cma" if "algorithm=cma" in ir.describe_sig(sig, ALGORITHM_NAMES) else "own"


@permitted
def test_every_rank_runs_cma_while_the_rings_are_slower_and_the_rings_again_after() -> None:
    calls = (96, PROBE_CALLS[1] + 64)
    results = run_ranks(_follows, 3, ["own"] * 3, calls, timeout=120)
    ran = results[0][0]
    assert all(r[0] == ran for r in results), "the ranks ran different plans"
    assert all(r[1] for r in results)
    assert "algorithm=cma" not in results[0][2]  # (auto's own pick is the rings')
    assert len(ran) == sum(calls)
    assert ran[:FIRST_CALLS] == ["own"] * FIRST_CALLS
    assert "cma" in ran[FIRST_CALLS : FIRST_CALLS + WARM_CALLS + 2]  # (the others follow a call late at most)
    # The rings' calls look 20x slower: cma soon after the warm calls, the rings probed now and
    # then, a few calls in a row.
    slow_phase = ran[FIRST_CALLS + WARM_CALLS + 8 : calls[0]]
    assert slow_phase.count("own") <= 4 * PROBE_LEN, slow_phase
    # Now cma's look 20x slower: the next probe of the rings finds them faster, and they stay
    # (but for cma's probe, every PROBE_CALLS[2] calls).
    tail = ran[calls[0] + PROBE_CALLS[1] :]
    assert tail.count("own") >= len(tail) - PROBE_LEN, tail


@permitted
def test_a_pair_runs_cma_while_the_rings_are_slower_on_ordinary_pages() -> None:
    """At 2 ranks from 1 MiB, where the call shape looks at the ranks' pages too: on 4 KiB pages
    the leader's times decide, as at 3 ranks."""
    calls = (96, PROBE_CALLS[1] + 64)
    results = run_ranks(_follows, 2, ["own"] * 2, calls, PAGED_PAIR_COUNT, "small", timeout=120)
    ran = results[0][0]
    assert all(r[0] == ran for r in results), "the ranks ran different plans"
    assert all(r[1] for r in results)
    assert "algorithm=cma" not in results[0][2]
    assert all(r[3] == pages.can_scan() for r in results), results[0][3]  # (page-aware where pages can be seen)
    assert ran[:FIRST_CALLS] == ["own"] * FIRST_CALLS
    slow_phase = ran[FIRST_CALLS + WARM_CALLS + 8 : calls[0]]
    assert slow_phase.count("own") <= 4 * PROBE_LEN, slow_phase
    tail = ran[calls[0] + PROBE_CALLS[1] :]
    assert tail.count("own") >= len(tail) - PROBE_LEN, tail


huge_pages = pytest.mark.skipif(
    not (pages.can_scan() and pages.thp_setting() in ("always", "madvise")), reason="no PAGEMAP_SCAN or huge pages"
)


@permitted
@huge_pages
def test_a_pair_on_huge_pages_runs_cma_whatever_the_times_say() -> None:
    """Where every rank's buffers are on huge pages, cma runs at every call, as it did before the
    shape was timed, even where the leader's times make cma look 20x slower."""
    results = run_ranks(_follows, 2, ["cma"] * 2, (40, 0), PAGED_PAIR_COUNT, "huge", timeout=120)
    ran = results[0][0]
    assert all(r[0] == ran for r in results) and all(r[1] for r in results)
    assert all(r[3] for r in results)
    assert ran[1:] == ["cma"] * (len(ran) - 1), ran  # (the first call sees its pages before they are settled)


@permitted
@huge_pages
@pytest.mark.parametrize("kinds", [["huge", "small"], ["small", "huge"]])
def test_a_pair_on_mixed_pages_follows_the_leaders_times_alone(kinds: list[str]) -> None:
    """Where one rank's buffers are on huge pages and the other's are not, the pages ask for the
    rings, and cma runs only where the leader's times ask for it: the leader's vote for its
    pages is not read as a vote by its times."""
    explored = FIRST_CALLS + EXPLORE_CALLS + 2
    for slow, wanted in (("cma", "own"), ("own", "cma")):
        results = run_ranks(_follows, 2, [slow] * 2, (64, 0), PAGED_PAIR_COUNT, kinds, timeout=120)
        ran = results[0][0]
        assert all(r[0] == ran for r in results) and all(r[1] for r in results)
        late = ran[explored:]
        assert late.count(wanted) >= len(late) - 4 * PROBE_LEN, (slow, late)


LEAN_COUNT = MEMO_MAX_BYTES // 4 // 4  # float32: a call the lean path remembers (256 KiB)


def _lean_follows(comm, calls: tuple[int, int], collective: str = "reduce", root: int = 0):  # type: ignore[no-untyped-def]
    """As :func:`_follows`, on a call the lean path remembers (a reduce of 256 KiB, the timed
    floor lowered in this rank to its size; a broadcast of 1 MiB), the rings' calls counting 20
    times what they took on the leader, then cma's: per call, the plan this rank ran (read from
    its rank record, not from the agreement, which the lean entry makes in compiled code),
    whether its agreement ran in Python and whether the leader timed it; whether every result
    was exact, and the leader's count of the shape's calls (0 elsewhere)."""
    from shmcoll.comm import timed

    timed.TIMED_FROM = LEAN_COUNT * 4
    r, n = comm.rank, comm.world_size
    if collective == "reduce":
        count = LEAN_COUNT
        x = (np.arange(count, dtype=np.float32) % 1000) + r
        out = np.empty(count, np.float32)
        expected = _expected(n, count)

        def call() -> bool:
            got = comm.reduce(x, root, out=out if r == root else None)
            return r != root or bool(np.array_equal(got, expected))
    else:  # (on 4 KiB pages: a call shape of 1 MiB is page-aware too)
        count = MEMO_MAX_BYTES // 4
        expected = (np.arange(count, dtype=np.float32) % 1000) + root
        x = pages.array(count, np.float32, "small")
        x[...] = expected if r == root else -1.0

        def call() -> bool:
            if r != root:
                x[...] = -1.0
            return bool(np.array_equal(comm.broadcast(x, root=root), expected))

    scale = {"own": 1.0, "cma": 1.0}
    plans: list[str] = []
    in_python: list[bool] = []
    timed_here: list[bool] = []
    exact = True
    with _scaled(scale) as ran:
        scaled_count = timed.Timed._count
        counted: list[bool] = []

        def count(self, alt, elapsed_ns):  # type: ignore[no-untyped-def]
            counted.append(alt)
            scaled_count(self, alt, elapsed_ns)

        timed.Timed._count = count  # type: ignore[method-assign]
        for phase, made in enumerate(calls):
            scale["own"], scale["cma"] = (20.0, 1.0) if phase == 0 else (1.0, 20.0)
            for _ in range(made):
                before, timed_before = len(ran), len(counted)
                exact &= call()
                plans.append(_plan_run(comm))
                in_python.append(len(ran) > before)
                timed_here.append(len(counted) > timed_before)
        timed.Timed._count = scaled_count  # type: ignore[method-assign]
    shape = next(c for c in comm._calls.values() if getattr(c, "timed", None) is not None)
    made = 0
    if shape.timed.leader:
        # (the leader's vote for its next call counted it; and the calls its entry has made
        # since that vote, the last of them timed unless it went to Python)
        skip = int(shape.lean_agree[4][engine.AG_SKIP])
        made = shape.timed.calls + shape.timed.quiet - (skip + 1 if skip >= 0 else 0)
    return plans, in_python, exact, made, shape.timed.leader, timed_here


@permitted
@pytest.mark.parametrize(("collective", "root"), [("reduce", 0), ("broadcast", 0), ("broadcast", 2)])
def test_a_remembered_timed_call_agrees_in_compiled_code(collective: str, root: int) -> None:
    """A timed call the lean path remembers: the followers agree in the engine's entry, on either
    plan, and the leader (a reduce's root, the rank before a broadcast's root) votes and times
    one call in ``SAMPLE`` (and the calls of its probes); every rank still runs the same plan at
    every call, and the leader follows its times both ways."""
    calls = (96, PROBE_CALLS[1] + 64)
    results = run_ranks(_lean_follows, 3, calls, collective, root, timeout=120)
    leader = root if collective == "reduce" else (root + 2) % 3
    assert [r[4] for r in results] == [rank == leader for rank in range(3)]
    plans = results[0][0]
    assert all(r[0] == plans for r in results), "the ranks ran different plans"
    assert all(r[2] for r in results)
    assert results[leader][3] == sum(calls)  # (the leader counted the calls its entry made alone)
    # (a probe of the rings lasts a call longer than the leader asks: at the call after it, the
    # followers' entries read the leader's word before its vote for cma is there)
    slow_phase = plans[FIRST_CALLS + WARM_CALLS + 8 : calls[0]]
    assert slow_phase.count("own") <= 4 * (PROBE_LEN + 1), slow_phase
    tail = plans[calls[0] + PROBE_CALLS[1] :]
    assert tail.count("own") >= len(tail) - PROBE_LEN, tail
    # While cma runs and where the rings run again, every call is agreed on in compiled code
    # (the leader's first remembered call aside), and the leader times one call in SAMPLE, and
    # each call of its probes (and the call after each).
    cma_runs = slice(FIRST_CALLS + EXPLORE_CALLS + 8, calls[0])
    rings_run = slice(calls[0] + 64, None)
    for part, probes in ((cma_runs, 3), (rings_run, 2)):
        for rank, r in enumerate(results):
            python = sum(r[1][part])
            made = len(r[1][part])
            assert python == 0, (part, rank, python, made)
            timed_calls = sum(r[5][part])
            if rank == leader:
                assert made // SAMPLE - 1 <= timed_calls <= made // SAMPLE + probes * (PROBE_LEN + 1), (
                    part,
                    timed_calls,
                )
            else:
                assert timed_calls == 0


def _cma_settled(comm, event: str, path: str = ""):  # type: ignore[no-untyped-def]
    """A remembered reduce of 256 KiB at 3 ranks (the timed floor lowered to it) whose rings'
    calls count 20 times what they took, so that cma runs, agreed in the engine's entry; after
    64 calls, ``event`` at one call: "late follower" (rank 1 sleeps 0.3 s before it, past a
    wait's slice: its peers' agreement on cma waits on in Python), "late leader" (the root makes
    the call in Python, ``engine.SKIP_VOTE``, and sleeps 0.3 s between the agreement on cma and
    cma's plan: the followers' plans wait past a slice), "dies" (rank 1 leaves before it; each survivor's
    outcome goes to ``path.RANK``). Returns whether every result was exact, the plans run by
    the last 40 calls, and the statuses this rank's entries left to Python."""
    from shmcoll.comm import pages as agreement
    from shmcoll.comm import timed
    from shmcoll.comm.runtime import Runtime

    timed.TIMED_FROM = LEAN_COUNT * 4
    r, n = comm.rank, comm.world_size
    x = (np.arange(LEAN_COUNT, dtype=np.float32) % 1000) + r
    out = np.empty(LEAN_COUNT, np.float32)
    expected = _expected(n, LEAN_COUNT)
    statuses: list[int] = []
    armed = [False]
    own_wait, own_agreed = Runtime._wait_or_raise, agreement.agreed

    def wait_or_raise(rt, st, *args):  # type: ignore[no-untyped-def]
        statuses.append(st)
        return own_wait(rt, st, *args)

    def agreed(rt, b, limit):  # type: ignore[no-untyped-def]
        chosen = own_agreed(rt, b, limit)
        if armed[0] and "algorithm=cma" in chosen[0].label:
            armed[0] = False
            time.sleep(0.3)
        return chosen

    exact, plans = True, []
    Runtime._wait_or_raise, agreement.agreed = wait_or_raise, agreed  # type: ignore[method-assign,assignment]
    t0 = 0.0
    try:
        with _scaled({"own": 20.0, "cma": 1.0}):
            for i in range(104):
                if i == 64:
                    statuses.clear()
                    t0 = time.monotonic()
                    if event == "late leader" and r == 0:
                        armed[0] = True
                        shape = next(c for c in comm._calls.values() if getattr(c, "timed", None) is not None)
                        shape.lean_agree[4][engine.AG_SKIP] = engine.SKIP_VOTE
                    elif event == "late follower" and r == 1:
                        time.sleep(0.3)
                    elif event == "dies" and r == 1:
                        os._exit(3)
                got = comm.reduce(x, 0, out=out if r == 0 else None)
                exact &= r != 0 or bool(np.array_equal(got, expected))
                if i >= 64:
                    plans.append(_plan_run(comm))
    except PeerLostError as exc:
        with open(f"{path}.{r}", "w") as f:
            f.write(repr(("lost", time.monotonic() - t0, exc.dead_rank, str(exc))))
        raise
    finally:
        Runtime._wait_or_raise, agreement.agreed = own_wait, own_agreed  # type: ignore[method-assign]
    return exact, plans, statuses


@permitted
@pytest.mark.parametrize("event", ["late follower", "late leader"])
def test_a_wait_past_a_slice_while_cma_runs_goes_on_in_python(event: str) -> None:
    """Where the entry's agreement on cma, or cma's plan entered from it, waits past a slice,
    Python carries on that wait (``engine.AGREEING``) or that plan (its status plus
    ``engine.ON_CMA``), and the call ends as the others do."""
    results = run_ranks(_cma_settled, 3, event, timeout=120)
    plans = results[0][1]
    assert all(r[0] for r in results)
    assert all(r[1] == plans for r in results), "the ranks ran different plans"
    assert plans.count("cma") >= len(plans) - 2 * (PROBE_LEN + 1), plans
    left = [r[2] for r in results]
    if event == "late follower":  # (rank 2 follows: its entry's agreement waited for rank 1)
        assert engine.AGREEING in left[2], left
    else:  # (each follower's cma plan waited for the root)
        assert all(engine.ON_CMA + engine.WAITING in left[rank] for rank in (1, 2)), left


@permitted
def test_a_peer_lost_while_cma_runs_is_named_by_every_survivor(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "r")
    with pytest.raises(shmcoll.SpawnError) as info:
        shmcoll.spawn(_cma_settled, nprocs=3, args=("dies", path), timeout=120)
    assert info.value.rank == 1 and info.value.exitcode == 3
    for rank in (0, 2):
        with open(f"{path}.{rank}") as f:
            kind, elapsed, dead, text = ast.literal_eval(f.read())
        assert kind == "lost" and dead == 1, (rank, text)
        assert elapsed < 2.0, (rank, elapsed)
        assert "rank 1" in text and "reduce" in text, text


def _broadcast_shapes(comm) -> list[bool]:  # type: ignore[no-untyped-def]
    """Which broadcasts get a timed call shape: auto's from ``BROADCAST_FROM`` to the largest call
    remembered, below and above them, and one that names its algorithm."""
    for count in (BROADCAST_FROM // 4, MEMO_MAX_BYTES // 4, BROADCAST_FROM // 8, 2 * MEMO_MAX_BYTES // 4):
        comm.broadcast(np.ones(count, np.float32), root=1)
    comm.broadcast(np.ones(BROADCAST_FROM // 4, np.float32), root=1, algorithm="dbtree")
    return [c.timed is not None for c in comm._calls.values() if c.kind == "broadcast"]


@permitted
def test_broadcasts_are_timed_from_broadcast_from_to_the_largest_call_remembered() -> None:
    from shmcoll.algos import cma as cma_plans

    assert cma_plans._BROADCAST_TIMED_UNTIL == MEMO_MAX_BYTES
    for found in run_ranks(_broadcast_shapes, 3, timeout=120):
        assert found == [True, True, False, False, False], found
    for found in run_ranks(_broadcast_shapes, 2, timeout=120):  # (cma is a pair's pick from 128 KiB)
        assert not any(found), found


def _pair_shapes(comm) -> list[tuple[str, bool]]:  # type: ignore[no-untyped-def]
    """Which 2-rank reduces get a timed call shape: auto's from ``PAIR_FROM`` and below it."""
    comm.reduce(np.ones(PAIR_COUNT, np.float32), 0)
    comm.reduce(np.ones(PAIR_COUNT // 2 - 1, np.float32), 0)
    return [(c.label, c.timed is not None) for c in comm._calls.values()]


@permitted
def test_a_pair_is_timed_from_pair_from() -> None:
    for found in run_ranks(_pair_shapes, 2, timeout=120):
        assert [on for _, on in found] == [True, False], found


@permitted
@pytest.mark.parametrize("slow_first", [["own", "cma", "cma"], ["cma", "own", "own"]])
def test_the_leader_decides(slow_first: list[str]) -> None:
    """The root times the calls: where it finds the rings slower, cma runs, whatever the others'
    times say, and where it finds cma slower, the rings run."""
    calls = (120, 0)
    results = run_ranks(_follows, 3, slow_first, calls, timeout=120)
    ran = results[0][0]
    assert all(r[0] == ran for r in results), "the ranks ran different plans"
    assert all(r[1] for r in results)
    late = ran[FIRST_CALLS + 4 * WARM_CALLS :]
    wanted = "cma" if slow_first[0] == "own" else "own"
    assert late.count(wanted) >= 0.8 * len(late), late  # (probes, and a follower a call late after each)


def _mixed(comm) -> tuple[list[str], list[str]]:  # type: ignore[no-untyped-def]
    """Timed reduces in every form, the root in place and out of place in turn, a non-root's
    buffers new at some calls, with a small allreduce between them: the plans run and what was
    wrong."""
    r, n = comm.rank, comm.world_size
    bad = []
    expected = _expected(n)
    tiny = np.ones(2, np.float32)
    with _scaled({"own": 1.0, "cma": 1.0}) as ran:
        x = (np.arange(COUNT, dtype=np.float32) % 1000) + r
        out = np.empty(COUNT, np.float32)
        req = comm.reduce_init(x, 0, out=out if r == 0 else None)
        for i in range(48):
            form = i % 4
            if form == 0:
                got = comm.reduce(x, 0, out=out if r == 0 else None)
            elif form == 1:
                y = x.copy()  # in place on the root; a new input elsewhere
                got = comm.reduce(y, 0, out=y if r == 0 else None)
            elif form == 2:
                got = comm.ireduce(x, 0, out=out if r == 0 else None).wait()
            else:
                req.start()
                got = req.wait()
            if r == 0 and not np.array_equal(got, expected):
                bad.append(f"call {i} (form {form})")
            comm.allreduce(tiny)
    return ran, bad


@permitted
def test_timed_calls_in_every_form_agree_and_are_exact() -> None:
    results = run_ranks(_mixed, 3, timeout=120)
    assert all(r[1] == [] for r in results), [r[1] for r in results]
    assert all(r[0] == results[0][0] for r in results), "the ranks ran different plans"
    assert len(results[0][0]) == 48


def _timed_shapes(comm) -> list[tuple[str, bool]]:  # type: ignore[no-untyped-def]
    """Which reduces get a timed call shape: auto's from ``TIMED_FROM``, auto's below it, and
    one that names its algorithm (each call shape's label, and whether it is timed)."""
    x = np.ones(COUNT, np.float32)
    small = np.ones(COUNT // 2 - 1, np.float32)
    comm.reduce(x, 0)
    comm.reduce(small, 0)
    comm.reduce(x, 0, algorithm="dbtree")
    return [(c.label, c.timed is not None) for c in comm._calls.values()]


@permitted
def test_only_auto_calls_from_timed_from_are_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    for found in run_ranks(_timed_shapes, 3, timeout=120):
        assert [on for _, on in found] == [True, False, False], found
        assert f"count={COUNT}," in found[0][0] and "algorithm=cma" not in found[0][0], found
    monkeypatch.setenv("SHMCOLL_ALGO", "reduce:dbtree")  # (read by the new ranks)
    for found in run_ranks(_timed_shapes, 3, timeout=120):
        assert not any(on for _, on in found), found
