"""Persistent collectives: bound once, started again and again on new data in the same buffers."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import shmcoll


def _every_init_form_repeats_its_blocking_form(comm):  # type: ignore[no-untyped-def]
    n, r = comm.world_size, comm.rank
    x = np.zeros((4, 3), np.int64)
    blocks = np.zeros((n, 3), np.int64)
    counts = [j % 3 for j in range(n)]
    recv = [counts[r]] * n
    v = np.zeros(counts[r], np.int64)
    flat = np.zeros(sum(counts), np.int64)
    scat_out, scatv_out = np.empty(3, np.int64), np.empty(counts[r], np.int64)

    def fill(k: int) -> None:  # new input in the same arrays before every start
        x[...] = (np.arange(12).reshape(4, 3) + r) * (k + 1)
        blocks[...] = np.arange(n * 3).reshape(n, 3) * (r + 1) + k
        v[...] = np.arange(counts[r]) + 10 * r + k
        flat[...] = np.arange(sum(counts)) * (r + 1) - k

    pairs = [
        (lambda: comm.allreduce(x.copy(), "sum"), comm.allreduce_init(x, "sum", out=np.empty_like(x))),
        (lambda: comm.reduce(x.copy(), root=n - 1, op="max"), comm.reduce_init(x, root=n - 1, op="max")),
        (lambda: comm.broadcast(x.copy(), root=0), comm.broadcast_init(x, root=0, out=np.empty_like(x))),
        (lambda: comm.allgather(x), comm.allgather_init(x)),
        (lambda: comm.gather(x, root=0), comm.gather_init(x, root=0)),
        (
            lambda: comm.scatter(blocks if r == 0 else None, root=0, out=np.empty(3, np.int64)),
            comm.scatter_init(blocks if r == 0 else None, root=0, out=scat_out),
        ),
        (lambda: comm.reduce_scatter(blocks.reshape(-1)), comm.reduce_scatter_init(blocks.reshape(-1))),
        (lambda: comm.alltoall(blocks), comm.alltoall_init(blocks)),
        (lambda: comm.barrier(), comm.barrier_init()),
        (lambda: comm.scan(x.copy(), "sum"), comm.scan_init(x, "sum", out=np.empty_like(x))),
        (lambda: comm.exscan(x.copy(), "max"), comm.exscan_init(x, "max", out=np.empty_like(x))),
        (lambda: comm.allgatherv(v, counts), comm.allgatherv_init(v, counts)),
        (lambda: comm.gatherv(v, counts, root=n - 1), comm.gatherv_init(v, counts, root=n - 1)),
        (
            lambda: comm.scatterv(flat if r == 0 else None, counts, out=np.empty(counts[r], np.int64)),
            comm.scatterv_init(flat if r == 0 else None, counts, out=scatv_out),
        ),
        (lambda: comm.reduce_scatter(flat, "sum", counts), comm.reduce_scatter_init(flat, "sum", counts)),
        (lambda: comm.alltoallv(flat, counts, recv), comm.alltoallv_init(flat, counts, recv)),
    ]
    for k in range(3):
        for blocking, persistent in pairs:
            fill(k)
            want = blocking()
            want = None if want is None else np.array(want)
            persistent.start()
            got = persistent.wait()
            if want is None:
                assert got is None, persistent.what
            else:
                np.testing.assert_array_equal(got, want, err_msg=f"{persistent.what} start {k}")
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_init_form_gives_the_blocking_result_at_every_start(pools, world_size) -> None:  # type: ignore[no-untyped-def]
    assert pools.get(world_size).run(_every_init_form_repeats_its_blocking_form) == [True] * world_size


def _rules(comm):  # type: ignore[no-untyped-def]
    x = np.ones(10)
    req = comm.allreduce_init(x)
    assert isinstance(req, shmcoll.Persistent) and req.done
    errors = []
    for bad in (req.wait, req.test):
        try:
            bad()
        except RuntimeError as exc:
            errors.append("never started" in str(exc))
    req.start()
    try:
        req.start()  # started twice without a wait
    except RuntimeError as exc:
        errors.append("started already" in str(exc))
    req.wait()
    req.start()  # ... and again after it
    out = req.wait()
    for bad_call in (
        lambda: comm.allreduce_init(np.ones((4, 4)).T),  # not contiguous: refused at init
        lambda: comm.allreduce_init(x, timeout=-1),
        lambda: comm.allgatherv_init(x, None),
    ):
        try:
            bad_call()
            errors.append(False)
        except (ValueError, TypeError):
            errors.append(True)
    comm.barrier()  # still usable: refused inits never communicated
    return errors, out.tolist()


def test_persistent_request_rules(pools) -> None:  # type: ignore[no-untyped-def]
    n = 2
    assert pools.get(n).run(_rules) == [([True] * 6, [float(n**2)] * 10)] * n


def _restarts(comm):  # type: ignore[no-untyped-def]
    # A start after the first reuses the request (Queue.restart): it must still queue behind
    # operations started before it, see new input, and refuse a closed communicator.
    sub = comm.split(0)
    x = np.zeros(5, np.int64)
    req = sub.allreduce_init(x, out=np.empty(5, np.int64))
    got, requests = [], []
    for k in range(4):
        x[...] = k + sub.rank
        before = sub.iallgather(np.full(2, k, np.int64))  # started first: must complete first
        req.start()
        requests.append(req._active)
        got.append((req.wait().tolist(), before.done, before.wait().reshape(-1).tolist()))
    assert all(r is requests[0] for r in requests)  # (the restart path was taken)
    sub.close()
    try:
        req.start()
        refused = False
    except shmcoll.ShmcollError as exc:
        refused = "closed" in str(exc)
    return got, refused


def test_restarted_requests_keep_their_order_and_refuse_a_closed_communicator(pools) -> None:  # type: ignore[no-untyped-def]
    n = 3
    results = pools.get(n).run(_restarts)
    for got, refused in results:
        assert refused
        for k, (total, before_done, gathered) in enumerate(got):
            assert total == [n * k + sum(range(n))] * 5
            assert before_done and gathered == [k] * (2 * n)


def _killed_during_restarts(comm, path, count):  # type: ignore[no-untyped-def]
    x = np.ones(count, np.float32)
    req = comm.allreduce_init(x)
    req.start()
    req.wait()  # the next starts reuse the request and enter the engine through the lean record
    comm.barrier()
    if comm.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    kinds = []
    for _ in range(3):
        try:
            req.start()
            req.wait()
            kinds.append("ok")
        except shmcoll.ShmcollError as exc:
            kinds.append(type(exc).__name__)
    with open(f"{path}.{comm.rank}", "w") as f:
        f.write(repr((kinds, time.monotonic() - t0)))


# (128 KiB restarts are queued; 16 bytes run at their start: requests.START_AT_ONCE)
@pytest.mark.parametrize("count", [1 << 15, 4])
def test_a_peer_killed_between_restarts_fails_every_wait_within_seconds(tmp_path, count) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "r")
    with pytest.raises(shmcoll.SpawnError):
        shmcoll.spawn(_killed_during_restarts, 3, args=(path, count), timeout=120)
    for rank in (0, 1):
        with open(f"{path}.{rank}") as f:
            kinds, elapsed = eval(f.read())  # noqa: S307  (a repr we wrote)
        assert kinds[0] == "PeerLostError" and set(kinds[1:]) <= {"PeerLostError", "CommunicatorBrokenError"}, kinds
        assert elapsed < 5.0


def _started_at_once(comm, count):  # type: ignore[no-untyped-def]
    # A small request found alone in its queue runs at its start as far as it goes without
    # waiting (requests.Queue._admit). Each case forces one order of arrival with sleeps far
    # longer than a start; what is checked is where the call stood, never how long it took.
    from shmcoll.engine.cpu import WAITING

    r = comm.rank
    x = np.zeros(count, np.int64)
    y = np.zeros(3, np.int64)
    req = comm.allreduce_init(x, out=np.empty(count, np.int64))
    req.start()
    req.wait()  # (the first start is queued; the later ones are restarts)
    seen = {}

    def start(k: int, late: int) -> None:  # new input, then a start with rank ``late`` 0.3 s late
        x[0], x[1:] = k + r, 10 * k
        y[...] = r
        comm.barrier()
        if r == late:
            time.sleep(0.3)
        req.start()

    # 1. This rank starts first: its start posts its part and parks; its wait carries it on.
    start(1, late=1)
    if r == 0:
        seen["parked"] = req._active._parked == WAITING and not req.done
    seen["late peer"] = req.wait()[:2].tolist()

    # 2. The peer's part is there already: the start completes the call by itself.
    start(2, late=0)
    if r == 0:
        seen["done in start"] = req.done
    seen["early peer"] = req.wait()[:2].tolist()

    # 3. Nobody waits on a parked request: the progress thread carries it on.
    start(3, late=1)
    if r == 0:
        deadline = time.monotonic() + 10
        while not req.test() and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["progress thread"] = req.done
    seen["unwaited"] = req.wait()[:2].tolist()

    # 4. A blocking call made while a request is parked runs after it.
    start(4, late=1)
    total = comm.allreduce(y)
    seen["blocking after"] = (req.done, req.wait()[:2].tolist(), total.tolist())
    return seen


# 16 bytes, and 64 KiB: requests.START_AT_ONCE (a larger one is queued at its start)
@pytest.mark.parametrize("count", [2, 8192])
def test_a_small_restart_runs_at_its_start_until_it_would_wait(pools, count) -> None:  # type: ignore[no-untyped-def]
    first, second = pools.get(2).run(_started_at_once, count)
    assert first["parked"] and first["progress thread"]
    if count == 2:  # (one step: the late rank finds its peer's part there; 64 KiB may take more,
        # and the early peer sleeps in its wait meanwhile)
        assert first["done in start"]
    for seen in (first, second):
        assert seen["late peer"] == [3, 20]
        assert seen["early peer"] == [5, 40]
        assert seen["unwaited"] == [7, 60]
        assert seen["blocking after"] == (True, [9, 80], [1, 1, 1])


def _mismatched_restarts(comm):  # type: ignore[no-untyped-def]
    x = np.ones(8, np.float32)
    a, g = comm.allreduce_init(x, out=np.empty_like(x)), comm.allgather_init(x)
    for req in (a, g):  # first starts, queued, matched
        req.start()
        req.wait()
    req = a if comm.rank == 0 else g  # restarts, run at their start: mismatched
    try:
        req.start()
        req.wait()
    except shmcoll.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def test_a_mismatch_found_at_a_start_is_raised_by_the_wait_with_the_blocking_message() -> None:
    texts = shmcoll.spawn(_mismatched_restarts, 2, timeout=60)
    assert all("allreduce(" in t and "allgather(" in t for t in texts), texts
