"""Soak: thousands of mixed collectives, random sizes and algorithms, every result checked;
memory, file descriptors and /dev/shm flat at the end."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import psutil
import pytest
from cases import COLLECTIVES, REDUCING, ROOTED, SAME_ON_ALL, Case, call, expected, inputs, make_case

from shmcoll import ReduceOp
from shmcoll.algos import registry
from shmcoll.types import supports

DTYPE_NAMES = ("float32", "float64", "int32", "int8", "uint16", "bool", "float16", "complex64")


def random_cases(world_size: int, ncalls: int, seed: int) -> list[Case]:
    """The same sequence on every rank: drawn from one seed, not from the rank."""
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(ncalls):
        kind = str(rng.choice(COLLECTIVES))
        algs = [a.name for a in registry.algorithms(kind)]
        dtype = np.dtype(str(rng.choice(DTYPE_NAMES)))
        ops = [op for op in ReduceOp if supports(op, dtype)] if kind in REDUCING else [ReduceOp.SUM]
        count = int(rng.choice([0, 1, 7, 64, 301, 4097, 20000], p=[0.05, 0.15, 0.2, 0.2, 0.2, 0.15, 0.05]))
        cases.append(
            make_case(
                kind=kind,
                algorithm=str(rng.choice(algs)),
                dtype=dtype.name,
                op=int(rng.choice(ops)),
                root=int(rng.integers(world_size)) if kind in ROOTED else 0,
                count=count,
                inplace=bool(rng.integers(2)),
                data="int",
                case_id=i,
            )
        )
    return cases


def _soak(comm, ncalls: int, seed: int):  # type: ignore[no-untyped-def]
    proc = psutil.Process()
    cases = random_cases(comm.world_size, ncalls, seed)
    warm = max(ncalls // 5, 1)
    rss0 = fds0 = 0
    mismatches = []
    digests = {}
    for i, case in enumerate(cases):
        if i == warm:
            rss0, fds0 = proc.memory_info().rss, len(os.listdir("/proc/self/fd"))
        xs = inputs(case, comm.world_size)
        want = expected(case, xs, comm.rank)
        got = call(comm, case, xs[comm.rank].copy())
        if want is None:
            if got is not None:
                mismatches.append(case.describe())
            continue
        if got is None or not np.array_equal(np.asarray(got).reshape(-1), want.reshape(-1)):
            mismatches.append(case.describe())
        elif case.kind in SAME_ON_ALL:
            digests[i] = hashlib.sha1(np.asarray(got).tobytes()).hexdigest()
    rss1, fds1 = proc.memory_info().rss, len(os.listdir("/proc/self/fd"))
    return mismatches, digests, rss1 - rss0, fds1 - fds0


def check_soak(pools, world_size: int, ncalls: int, seed: int) -> None:  # type: ignore[no-untyped-def]
    pool = pools.get(world_size, slot_bytes=4096, nslots=2)
    results = pool.run(_soak, ncalls, seed, timeout=1800)
    for rank, (mismatches, _, rss_growth, fd_growth) in enumerate(results):
        assert not mismatches, f"rank {rank}: {len(mismatches)} wrong results, first: {mismatches[:5]}"
        assert fd_growth == 0, f"rank {rank}: {fd_growth} file descriptors more at the end"
        assert rss_growth < 32 << 20, f"rank {rank}: RSS grew by {rss_growth >> 20} MiB"
    digests = [r[1] for r in results]
    for i in digests[0]:
        assert all(d.get(i) == digests[0][i] for d in digests), f"call {i}: results differ across ranks"


def test_soak_short(pools) -> None:  # type: ignore[no-untyped-def]
    check_soak(pools, 4, 2000, seed=1)


@pytest.mark.slow
def test_soak_long(pools) -> None:  # type: ignore[no-untyped-def]
    check_soak(pools, 4, 20000, seed=2)


def test_plan_cache_is_bounded(pools) -> None:  # type: ignore[no-untyped-def]
    pool = pools.get(2, slot_bytes=4096, nslots=2)
    sizes = pool.run(_many_shapes)
    assert all(s <= 512 for s in sizes), sizes


def _many_shapes(comm):  # type: ignore[no-untyped-def]
    for count in range(1500):
        comm.allreduce(np.ones(count, np.float32))
    return len(comm._calls)
