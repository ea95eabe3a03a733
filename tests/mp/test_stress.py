"""The ring protocol under random delays on both sides, with and without spinning.

Tiny slots (64 bytes) and one or two per ring make every message wrap the ring many times;
random pauses on the producer and the consumer leave rings full, empty and in between at
every moment; ``SHMCOLL_SPIN=0`` sends every wait straight to sched_yield and the futex."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from harness import RankPool


def _stream(comm, messages: int, seed: int):  # type: ignore[no-untyped-def]
    """Rank 0 streams numbered messages of random sizes to every other rank; both sides pause
    at random; every byte is checked."""
    rng = np.random.default_rng([seed, comm.rank])
    sizes = np.random.default_rng(seed).integers(0, 400, messages)  # same on every rank
    bad = 0
    for i, size in enumerate(sizes):
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.002)
        if comm.rank == 0:
            for peer in range(1, comm.world_size):
                comm.send(np.arange(size, dtype=np.int32) + i * 1000 + peer, dst=peer)
        else:
            buf = np.empty(size, np.int32)
            comm.recv(buf, src=0)
            bad += int(np.count_nonzero(buf != np.arange(size, dtype=np.int32) + i * 1000 + comm.rank))
    comm.barrier()
    # Collectives under the same jitter.
    for i in range(messages // 4):
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.002)
        x = np.full(int(sizes[i]), i + comm.rank, np.int64)
        comm.allreduce(x)
        n = comm.world_size
        bad += int(np.count_nonzero(x != n * i + n * (n - 1) // 2))
    return bad


@pytest.mark.parametrize(("world_size", "nslots", "spin"), [(2, 1, "0"), (3, 2, "0"), (2, 2, "auto"), (4, 1, "auto")])
def test_ring_under_random_delays(monkeypatch, world_size: int, nslots: int, spin: str) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SHMCOLL_SPIN", spin)
    pool = RankPool(world_size, slot_bytes=64, nslots=nslots)
    try:
        assert pool.run(_stream, 300, 7, timeout=600) == [0] * world_size
    finally:
        if not pool.broken:
            pool.close()


def _run_ahead(comm, calls: int, flag: str):  # type: ignore[no-untyped-def]
    """The root makes ``calls`` small broadcasts, then a large one, before any other rank has
    entered its first: the others wait for the root's flag file before they start."""
    import os

    small = np.zeros(2, np.float32)
    large = np.zeros(3 * 1024, np.float32)  # 12 KiB: 3 of the pool's 4 KiB slots, a stride each
    if comm.rank == 0:
        for i in range(calls):
            small[:] = i
            comm.broadcast(small, root=0, algorithm="direct")
        large[:] = np.arange(large.size)
        comm.broadcast(large, root=0, algorithm="direct")
        open(flag, "w").close()
        got_small = [float(i) for i in range(calls)]
    else:
        deadline = time.monotonic() + 20
        while not os.path.exists(flag):
            assert time.monotonic() < deadline, "the root never finished its calls alone"
            time.sleep(0.01)
        got_small = []
        for _ in range(calls):
            comm.broadcast(small, root=0, algorithm="direct")
            got_small.append(float(small[0]))
        comm.broadcast(large, root=0, algorithm="direct")
    comm.barrier()
    return got_small == [float(i) for i in range(calls)] and bool(np.array_equal(large, np.arange(large.size)))


def test_a_root_runs_small_calls_far_ahead(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A ring counts cells, not slots: 100 8-byte broadcasts (a cell each, where a ring of slots
    held 4 messages) and then a 3-piece one (a slot stride per piece) all fit in the rings of
    325 cells while the receivers have not started, so a root never waits for ranks that are
    switched out; the receivers then get every call's data in order."""
    pool = RankPool(3, slot_bytes=4096, nslots=4)
    try:
        assert pool.run(_run_ahead, 100, str(tmp_path / "root-done"), timeout=120) == [True] * 3
    finally:
        if not pool.broken:
            pool.close()


def _on_one_core(comm, calls: int):  # type: ignore[no-untyped-def]
    """``calls`` allreduces with every rank pinned to core 0; each result checked; the engine's
    spin budget (adapted, and its ceiling) at the end."""
    import os

    from shmcoll.engine import cpu as engine

    os.sched_setaffinity(0, {0})
    x = np.zeros(64, np.float32)
    bad = 0
    for i in range(calls):
        x[:] = comm.rank + i
        comm.allreduce(x)
        bad += int(np.count_nonzero(x != 2 * i + 1))
    return bad, int(comm._state[engine.S_SPIN_CUR]), int(comm._state[engine.S_SPIN_NS])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores, so the ranks spin as if they had one each")
def test_ranks_left_on_one_core_stop_spinning_long() -> None:
    """Two ranks that the scheduler leaves on one core (another process holding the second one;
    pinned here) cannot hand off while the waiter spins: each first yield runs the peer, which
    then has sent what the waiter waits for, so the spin budget shrinks (a hand-off cost the
    whole 20 us spin before: 23 us per call against 4.3 us adapted)."""
    pool = RankPool(2)
    try:
        for bad, spin, ceiling in pool.run(_on_one_core, 3000, timeout=120):
            assert bad == 0
            assert ceiling > 0 and spin <= ceiling // 4, (spin, ceiling)
    finally:
        if not pool.broken:
            pool.close()
