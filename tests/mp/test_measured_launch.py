"""The measured choice (``comm.measured``) in real launches: call shapes whose ranks time ``auto``'s
pick against its rival run both plans (the explorations), agree at every call, and give exact
results, bitwise the same on every rank, in the blocking, lean, nonblocking and persistent forms."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from harness import run_ranks

from shmcoll import collectives
from shmcoll.algos import select
from shmcoll.shm import cma

permitted = pytest.mark.skipif(not cma.probe()[0], reason=f"cross-memory attach {cma.probe()[1]}")

_CALLS = 12  # explorations at calls 2, 3 and 11: both plans run


def _measured(comm, crossover: int) -> tuple[list[str], list[str], dict[str, Any], str]:  # type: ignore[no-untyped-def]
    """Each collective ``_CALLS`` times just over ``MEASURED_FROM``, with the launch's race set to
    ``crossover``: what was wrong, the plans the measured agreements chose (in order), each
    measured shape's runs per plan, and a digest of the float results."""
    from shmcoll.comm import pages as agreement

    timed: list[str] = []
    own = agreement.agreed

    def spy(rt, b, timeout):  # type: ignore[no-untyped-def]
        chosen = own(rt, b, timeout)
        if b[0].measured is not None:
            timed.append(chosen[0].label.rpartition("algorithm=")[2].rstrip(")"))
        return chosen

    agreement.agreed = spy  # type: ignore[assignment]
    saved, comm._cma_crossover = comm._cma_crossover, crossover
    try:
        r, n = comm.rank, comm.world_size
        count = select.MEASURED_FROM // 4 // n + 1  # elements per block: calls just over MEASURED_FROM
        bad: list[str] = []
        digest = hashlib.sha256()
        rng = np.random.default_rng(r)

        def check(what: str, ok: bool) -> None:
            if not ok and what not in bad:
                bad.append(what)

        x = np.full(count, r + 1, np.float32)
        out = np.empty((n, count), np.float32)
        rows = (np.arange(n, dtype=np.float32) * 10 + r)[:, None] * np.ones(count, np.float32)
        floats = rng.standard_normal(count * n).astype(np.float32)
        summed = np.empty_like(floats)
        for i in range(_CALLS):
            out[...] = -1
            comm.allgather(x, out=out)  # (the same arrays: the lean path from the second call)
            check("allgather", all((out[j] == j + 1).all() for j in range(n)))
            got = comm.alltoall(rows)
            check("alltoall", all((got[j] == r * 10 + j).all() for j in range(n)))
            b = np.full(count * n, i if r == n - 1 else -1, np.float32)
            comm.broadcast(b, root=n - 1)
            check("broadcast", (b == i).all())
            comm.allreduce(floats, out=summed)
            digest.update(summed.tobytes())
            ints = np.full(count * n, r + i, np.float32)
            comm.allreduce(ints)  # in place
            check("allreduce in place", (ints == n * i + n * (n - 1) // 2).all())
            part = comm.reduce_scatter(np.full(count * n, r + 1, np.float32))
            check("reduce_scatter", (part == n * (n + 1) // 2).all())
            g = comm.gather(x, root=0)
            check("gather", r != 0 or all((g[j] == j + 1).all() for j in range(n)))
            s = np.empty(count, np.float32)
            comm.scatter(rows if r == 1 % n else None, root=1 % n, out=s)
            check("scatter", (s == r * 10 + 1 % n).all())
        # the nonblocking and persistent forms of a measured shape
        req = comm.allgather_init(x, out=out)
        for _ in range(_CALLS):
            out[...] = -1
            req.start()
            req.wait()
            check("allgather_init", all((out[j] == j + 1).all() for j in range(n)))
        for _ in range(_CALLS):
            out[...] = -1
            comm.iallgather(x, out=out).wait()
            check("iallgather", all((out[j] == j + 1).all() for j in range(n)))
        runs = {c.label: list(c.measured.runs) for c in comm._calls.values() if c.measured is not None}
        return bad, timed, runs, digest.hexdigest()
    finally:
        agreement.agreed = own  # type: ignore[method-assign]  # (the pool's processes live on)
        comm._cma_crossover = saved


@permitted
@pytest.mark.parametrize("n", [2, 3])
def test_measured_call_shapes_run_both_plans_alike_on_every_rank(n: int) -> None:
    # (a race that found the kernel's copy faster from 16 KiB: auto picks cma, and times the
    # rings against it; where the race found the rings faster, these sizes' choice hinges on
    # the pages instead, comm.pages)
    results = run_ranks(_measured, n, cma.LADDER_BYTES[0], timeout=180)
    for bad, _, runs, _ in results:
        assert not bad, bad
        assert runs, "no call shape was measured"
        for label, (first, other) in runs.items():
            assert first > 0 and other > 0, (label, first, other)  # both plans ran (explorations)
    assert len({tuple(timed) for _, timed, _, _ in results}) == 1  # every rank ran the same plans
    assert len({str(sorted(runs.items())) for _, _, runs, _ in results}) == 1
    assert len({digest for _, _, _, digest in results}) == 1  # a float allreduce: the same bits everywhere
    kinds = {label.partition("(")[0] for label in results[0][2]}
    # every collective here has a cma plan and a ring one from 256 KiB
    assert kinds >= {"allgather", "alltoall", "allreduce", "reduce_scatter"}, kinds


def _lean_small(comm) -> bool:  # type: ignore[no-untyped-def]
    """A small call made again keeps its lean path: no agreement below ``MEASURED_FROM``."""
    tiny = np.ones(4, np.float32)
    comm.allreduce(tiny)
    comm.allreduce(tiny)
    m = comm._lean[collectives.get("allreduce").code]
    return bool(m is not None and len(m) > 9 and m[9][0].other is None and m[9][0].measured is None)


@permitted
def test_small_calls_are_not_measured() -> None:
    assert all(run_ranks(_lean_small, 2, timeout=60))
