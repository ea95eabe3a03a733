"""Nonblocking collectives: requests, order, progress while the caller computes, and failures."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import shmcoll
from shmcoll import CommunicatorBrokenError, PeerLostError, ShmcollError


def _every_i_form_matches_its_blocking_form(comm):  # type: ignore[no-untyped-def]
    n, r = comm.world_size, comm.rank
    x = (np.arange(12, dtype=np.int64) + r).reshape(4, 3)
    blocks = np.arange(n * 3, dtype=np.int64).reshape(n, 3) * (r + 1)
    counts = [j % 3 for j in range(n)]  # (every rank sends counts[j] to rank j in the alltoallv)
    recv = [counts[r]] * n
    v = np.arange(counts[r], dtype=np.int64) + 10 * r
    flat = np.arange(sum(counts), dtype=np.int64) * (r + 1)
    pairs = [
        (lambda: comm.allreduce(x.copy(), "sum"), lambda: comm.iallreduce(x.copy(), "sum")),
        (lambda: comm.reduce(x.copy(), root=n - 1, op="max"), lambda: comm.ireduce(x.copy(), root=n - 1, op="max")),
        (lambda: comm.broadcast(x.copy(), root=0), lambda: comm.ibroadcast(x.copy(), root=0)),
        (lambda: comm.allgather(x), lambda: comm.iallgather(x)),
        (lambda: comm.gather(x, root=0), lambda: comm.igather(x, root=0)),
        (
            lambda: comm.scatter(blocks if r == 0 else None, root=0, out=np.empty(3, np.int64)),
            lambda: comm.iscatter(blocks if r == 0 else None, root=0, out=np.empty(3, np.int64)),
        ),
        (lambda: comm.reduce_scatter(blocks.reshape(-1)), lambda: comm.ireduce_scatter(blocks.reshape(-1))),
        (lambda: comm.alltoall(blocks), lambda: comm.ialltoall(blocks)),
        (lambda: comm.barrier(), lambda: comm.ibarrier()),
        (lambda: comm.scan(x.copy(), "prod"), lambda: comm.iscan(x.copy(), "prod")),
        (lambda: comm.exscan(x.copy(), "max"), lambda: comm.iexscan(x.copy(), "max")),
        (lambda: comm.allgatherv(v, counts), lambda: comm.iallgatherv(v, counts)),
        (lambda: comm.gatherv(v, counts, root=n - 1), lambda: comm.igatherv(v, counts, root=n - 1)),
        (
            lambda: comm.scatterv(flat if r == 0 else None, counts, out=np.empty(counts[r], np.int64)),
            lambda: comm.iscatterv(flat if r == 0 else None, counts, out=np.empty(counts[r], np.int64)),
        ),
        (lambda: comm.reduce_scatter(flat, "sum", counts), lambda: comm.ireduce_scatter(flat, "sum", counts)),
        (lambda: comm.alltoallv(flat, counts, recv), lambda: comm.ialltoallv(flat, counts, recv)),
    ]
    for blocking, nonblocking in pairs:
        want = blocking()
        req = nonblocking()
        assert isinstance(req, shmcoll.Request)
        got = req.wait()
        if want is None:
            assert got is None
        else:
            np.testing.assert_array_equal(got, want)
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_i_form_returns_what_the_blocking_call_returns(pools, world_size) -> None:  # type: ignore[no-untyped-def]
    assert pools.get(world_size).run(_every_i_form_matches_its_blocking_form) == [True] * world_size


def _out_of_order_and_mixed(comm):  # type: ignore[no-untyped-def]
    r = comm.rank
    xs = [np.full(1000, float(r + k)) for k in range(4)]
    reqs = [comm.iallreduce(x) for x in xs[:3]]
    mid = comm.allreduce(xs[3])  # blocking, after three started: completes after them
    assert all(req.done for req in reqs)
    results = [reqs[2].wait(), reqs[0].wait(), reqs[1].wait()]  # waited out of start order
    reqs2 = [comm.iallreduce(np.full(10, float(k))) for k in range(5)]
    first = shmcoll.wait_any(reqs2)
    everything = shmcoll.wait_all(reqs2)
    assert all(req.test() for req in reqs2)
    got = comm.allgather_object(r)  # a call made of several: it waits for the started ones
    return [float(v[0]) for v in results], float(mid[0]), first in range(5), [float(v[0]) for v in everything], got


def test_requests_complete_in_start_order_whatever_order_they_are_waited_in(pools) -> None:  # type: ignore[no-untyped-def]
    results = pools.get(3).run(_out_of_order_and_mixed)
    # rank r contributes r + k: sums 3 + 3k over 3 ranks
    for res in results:
        assert res == ([9.0, 3.0, 6.0], 12.0, True, [0.0, 3.0, 6.0, 9.0, 12.0], [0, 1, 2])


def _progress_while_sleeping(comm):  # type: ignore[no-untyped-def]
    x = np.ones(1 << 20, np.float32)
    comm.allreduce(x.copy())  # plans built, pages touched
    comm.barrier()
    req = comm.iallreduce(x)
    time.sleep(1.0)  # the caller does something else entirely
    done_while_sleeping = req.test()
    req.wait()
    return done_while_sleeping, float(x[0])


def test_started_operations_advance_while_the_caller_sleeps(pools) -> None:  # type: ignore[no-untyped-def]
    assert pools.get(2).run(_progress_while_sleeping) == [(True, 2.0)] * 2


def _late_peer(comm):  # type: ignore[no-untyped-def]
    if comm.rank == 1:
        time.sleep(0.5)
    req = comm.iallreduce(np.ones(4))
    first = req.test()
    with pytest.raises(TimeoutError, match="goes on"):
        if comm.rank == 0:
            req.wait(timeout=0.05)
        else:
            raise TimeoutError("goes on")
    return first, req.wait().tolist()


def test_test_does_not_block_and_wait_timeout_leaves_the_operation_going(pools) -> None:  # type: ignore[no-untyped-def]
    results = pools.get(2).run(_late_peer)
    assert results[0] == (False, [2.0] * 4)
    assert results[1][1] == [2.0] * 4


def _killed_with_requests_in_flight(comm, path):  # type: ignore[no-untyped-def]
    x = np.ones(1 << 16, np.float32)
    comm.allreduce(x)
    comm.barrier()
    if comm.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    reqs, kinds = [], []
    for _ in range(4):
        try:
            reqs.append(comm.iallreduce(x.copy()))
        except ShmcollError as exc:  # the communicator broke already: starting fails at once
            kinds.append(type(exc).__name__)
    for req in reqs:
        try:
            req.wait()
            kinds.append("ok")
        except ShmcollError as exc:
            kinds.append(type(exc).__name__)
    with open(f"{path}.{comm.rank}", "w") as f:
        f.write(repr((kinds, time.monotonic() - t0)))
    return kinds


def test_a_peer_killed_with_requests_in_flight_fails_every_wait_within_seconds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "r")
    with pytest.raises(shmcoll.SpawnError):
        shmcoll.spawn(_killed_with_requests_in_flight, 3, args=(path,), timeout=120)
    for rank in (0, 1):
        with open(f"{path}.{rank}") as f:
            kinds, elapsed = eval(f.read())  # noqa: S307  (a repr we wrote)
        # Rank 2 died before any of the operations: none can complete, each start or wait fails.
        assert len(kinds) == 4, kinds
        assert all(k in (PeerLostError.__name__, CommunicatorBrokenError.__name__) for k in kinds), kinds
        assert elapsed < 5.0


def _mismatch_through_requests(comm):  # type: ignore[no-untyped-def]
    req = comm.iallreduce(np.ones(8, np.float32)) if comm.rank == 0 else comm.iallgather(np.ones(8, np.float32))
    with pytest.raises(shmcoll.CollectiveMismatchError) as info:
        req.wait()
        comm.barrier()
    return str(info.value)


def test_errors_surface_from_wait_with_the_blocking_calls_messages() -> None:
    texts = shmcoll.spawn(_mismatch_through_requests, 2, timeout=60)
    assert all("allreduce(" in t and "allgather(" in t for t in texts), texts


def _close_waits_for_started(comm):  # type: ignore[no-untyped-def]
    sub = comm.split(0)
    x = np.ones(1 << 18, np.float32)
    req = sub.iallreduce(x)
    sub.close()  # the operation ends first: nothing runs while the arena goes
    return req.done and float(x[0]) == comm.world_size


def test_close_lets_started_operations_finish_first(pools) -> None:  # type: ignore[no-untyped-def]
    assert pools.get(2).run(_close_waits_for_started) == [True, True]


def _i_forms_in_loops(comm):  # type: ignore[no-untyped-def]
    """Each i-form started again and again on the same arrays: from its third start on it skips
    the binder (Runtime._start_again), and every result is the exact one for its round's data;
    a start whose arguments changed in any way the lean test compares is bound anew."""
    from shmcoll.comm import bind

    n, r = comm.world_size, comm.rank
    bound = []
    saved = {name: getattr(bind, name) for name in ("elementwise", "gathering", "scattering")}

    def counting(name):  # type: ignore[no-untyped-def]
        def f(rt, coll, *args):  # type: ignore[no-untyped-def]
            bound.append(coll.name)
            return saved[name](rt, coll, *args)

        return f

    x, y = np.empty(5, np.int64), np.empty(5, np.int64)
    mine, blocks = np.empty(3, np.int32), np.empty((n, 3), np.int32)
    stacked, a2a, row = np.empty((n, 3), np.int32), np.empty((n, 3), np.int32), np.empty((1, 3), np.int32)
    wrong, per_round = [], []
    try:
        for name in saved:
            setattr(bind, name, counting(name))
        for k in range(5):
            before = len(bound)
            x[...] = r + k
            comm.iallreduce(x, out=y).wait()
            wrong += [] if (y == sum(q + k for q in range(n))).all() else [("iallreduce", k, y.tolist())]
            x[...] = r * k
            res = comm.ireduce(x, n - 1, out=y if r == n - 1 else None).wait()
            if r == n - 1:
                wrong += [] if (y == k * sum(range(n))).all() else [("ireduce", k, y.tolist())]
            elif res is not None:
                wrong.append(("ireduce off root returned", res))
            mine[...] = r + 10 * k
            comm.ibroadcast(mine, root=n - 1).wait()
            wrong += [] if (mine == n - 1 + 10 * k).all() else [("ibroadcast", k, mine.tolist())]
            mine[...] = r + 10 * k
            comm.iallgather(mine, out=stacked).wait()
            wrong += [] if (stacked[:, 0] == np.arange(n) + 10 * k).all() else [("iallgather", k)]
            stacked[...] = -1
            comm.igather(mine, root=0, out=stacked if r == 0 else None).wait()
            if r == 0:
                wrong += [] if (stacked[:, 0] == np.arange(n) + 10 * k).all() else [("igather", k)]
            blocks[...] = np.arange(n)[:, None] * 100 + r + k
            comm.ialltoall(blocks, out=a2a).wait()
            wrong += [] if (a2a[:, 0] == 100 * r + np.arange(n) + k).all() else [("ialltoall", k, a2a.tolist())]
            comm.ireduce_scatter(blocks, out=row).wait()
            wrong += [] if (row == n * 100 * r + sum(range(n)) + n * k).all() else [("ireduce_scatter", k)]
            comm.iscatter(blocks if r == 0 else None, out=mine, root=0).wait()
            wrong += [] if (mine == 100 * r + k).all() else [("iscatter", k, mine.tolist())]
            x[...] = r + 1 + k
            comm.iscan(x, "sum", out=y).wait()
            wrong += [] if (y == sum(q + 1 + k for q in range(r + 1))).all() else [("iscan", k, y.tolist())]
            comm.iexscan(x, "max", out=y).wait()
            wrong += [] if r == 0 or (y == r + k).all() else [("iexscan", k, y.tolist())]
            per_round.append(bound[before:])
        before = len(bound)
        for k in range(4):  # (a collective's last call is remembered: in place in its own loop)
            x[...] = r + k
            comm.iallreduce(x, "max").wait()
            wrong += [] if (x == n - 1 + k).all() else [("iallreduce in place", k, x.tolist())]
        in_place = len(bound) - before
        # Started behind pending operations, the lean starts keep their order.
        x[...], mine[...] = r, r
        first = comm.iallreduce(x, out=y)
        second = comm.ibroadcast(mine, root=n - 1)
        third = comm.iallgather(mine, out=stacked)
        third.wait(), first.wait(), second.wait()
        wrong += [] if (y == sum(range(n))).all() and (stacked == n - 1).all() else [("in order", y.tolist())]
        before = len(bound)
        # What the lean test compares: each change is bound anew.
        comm.iallreduce(x, out=y, timeout=30).wait()  # a timeout given
        comm.iallreduce(x, "min", out=y).wait()  # another op
        comm.iallreduce(x, out=x).wait()  # another out
        x.dtype = np.float64  # the same object, another dtype
        out = y.view(np.float64)
        x[...] = r + 0.5
        comm.iallreduce(x, out=out).wait()
        wrong += [] if (out == sum(q + 0.5 for q in range(n))).all() else [("dtype", out.tolist())]
        comm.iallreduce(x, out=out).wait()  # found in the memo
        comm.iallreduce(x, out=out).wait()  # lean, until its out is made read-only:
        out.flags.writeable = False
        try:
            comm.iallreduce(x, out=out)
            wrong.append("a read-only out was started")
        except ValueError:
            pass
        changed = bound[before:]
    finally:
        for name, f in saved.items():
            setattr(bind, name, f)
    return r, wrong, per_round, in_place, changed


@pytest.mark.parametrize("world_size", [2, 3])
def test_i_forms_started_again_skip_the_binder_and_stay_exact(pools, world_size) -> None:  # type: ignore[no-untyped-def]
    for r, wrong, per_round, in_place, changed in pools.get(world_size).run(_i_forms_in_loops):
        assert wrong == []
        # Round 0 binds all ten, round 1 finds them in the binder's memo (which gives them their
        # record), then none is bound but exscan on rank 0, whose result is written after the
        # engine's call (no lean path, as for the blocking call).
        assert [len(names) for names in per_round[:2]] == [10, 10]
        assert per_round[2:] == [["exscan"] if r == 0 else []] * 3, per_round
        assert in_place == 2
        # a timeout, another op, another out, another dtype (then found in the memo), read-only
        assert changed == ["allreduce"] * 6, changed


def _i_form_in_a_loop(comm):  # type: ignore[no-untyped-def]
    # An i-form repeated on the same arrays takes the lean path (bind._promote); a small one then
    # runs at its start until its first wait (requests.Queue._admit), and its wait resumes it.
    from shmcoll.engine.cpu import WAITING

    x, out = np.zeros(4), np.empty(4)
    seen = []
    for k in range(4):
        x[...] = k + comm.rank
        comm.barrier()
        if comm.rank == 1:
            time.sleep(0.2)  # rank 0 starts alone: what it can do without rank 1 is posting
        req = comm.iallreduce(x, out=out)
        parked = req._parked == WAITING
        seen.append((parked, req.wait().tolist()))
    return seen


def test_a_repeated_small_i_form_starts_at_once_and_its_wait_resumes_it(pools) -> None:  # type: ignore[no-untyped-def]
    first, second = pools.get(2).run(_i_form_in_a_loop)
    assert [parked for parked, _ in first] == [False, True, True, True]  # bound, then remembered: lean
    for seen in (first, second):
        assert [total for _, total in seen] == [[2.0 * k + 1] * 4 for k in range(4)]
