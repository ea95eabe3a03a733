"""The ring protocol under random delays on both sides, with and without spinning.

Tiny slots (64 bytes) and one or two per ring make every message wrap the ring many times;
random pauses on the producer and the consumer leave rings full, empty and in between at
every moment; ``SHMCOLL_SPIN=0`` sends every wait straight to sched_yield and the futex."""

from __future__ import annotations

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
