"""Cross-memory attach (the ``cma`` algorithm) beyond the correctness matrix (which runs its plans
at every world size, count, root and dtype): large unaligned calls on ordinary buffers, the
automatic choice, and the clean fallback when it is turned off or not permitted."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from harness import run_ranks

from shmcoll import config
from shmcoll.algos.cma import SLOW_BLOCK_NS
from shmcoll.algos.select import choose, decide
from shmcoll.errors import UnsupportedError
from shmcoll.plan.algorithm import Query
from shmcoll.shm import cma

permitted = pytest.mark.skipif(not cma.probe()[0], reason=f"cross-memory attach {cma.probe()[1]}")


def _large(comm, count: int) -> list[str]:  # type: ignore[no-untyped-def]
    """Every cma collective on ``count`` elements at odd offsets (views that start mid-page)."""
    r, n = comm.rank, comm.world_size
    bad = []

    def val(j: int, size: int, dtype=np.float32) -> np.ndarray:  # type: ignore[no-untyped-def]
        return (np.arange(size, dtype=np.int64) * 7 + j * 1_000_003).astype(dtype)

    backing = np.zeros(count * n + 3, np.float32)
    x = backing[3 : 3 + count]  # 12 bytes into an allocation: not page- or cache-line-aligned
    x[...] = val(r, count)
    g = comm.allgather(x, algorithm="cma")
    if not all(np.array_equal(g[j], val(j, count)) for j in range(n)):
        bad.append("allgather")
    out = np.empty((n, count), np.float32)
    out[r] = val(r, count)
    comm.allgather(out[r], out=out, algorithm="cma")  # in place
    if not all(np.array_equal(out[j], val(j, count)) for j in range(n)):
        bad.append("allgather in place")
    b = val(r, count)
    comm.broadcast(b, root=n - 1, algorithm="cma")
    if not np.array_equal(b, val(n - 1, count)):
        bad.append("broadcast")
    got = np.full(count, -1.0, np.float32)  # out of place: the peers fill the root's output too
    comm.broadcast(val(r, count), out=got, root=1 % n, algorithm="cma")
    if not np.array_equal(got, val(1 % n, count)):
        bad.append("broadcast out of place")
    rows = np.stack([val(r * n + j, count, np.float64) for j in range(n)])
    t = comm.alltoall(rows, algorithm="cma")
    if not all(np.array_equal(t[j], val(j * n + r, count, np.float64)) for j in range(n)):
        bad.append("alltoall")
    comm.alltoall(rows, out=rows, algorithm="cma")  # in place
    if not all(np.array_equal(rows[j], val(j * n + r, count, np.float64)) for j in range(n)):
        bad.append("alltoall in place")
    src = np.stack([val(j, count) for j in range(n)]) if r == 0 else None
    s = comm.scatter(src, out=np.empty(count, np.float32), root=0, algorithm="cma")
    if not np.array_equal(s, val(r, count)):
        bad.append("scatter")
    ga = comm.gather(val(r, count), root=1 % n, algorithm="cma")
    if r == 1 % n and not all(np.array_equal(ga[j], val(j, count)) for j in range(n)):
        bad.append("gather")
    # The reductions: int64, so that any order of combination gives exactly numpy's sum; the
    # same bits on every rank (each chunk is combined once, by its owner).
    total = sum(val(j, count, np.int64) for j in range(n))
    y = np.zeros(count + 1, np.int64)[1:]  # (8 bytes in)
    y[...] = val(r, count, np.int64)
    comm.allreduce(y, algorithm="cma")
    if not np.array_equal(y, total) or len({d for d in comm.allgather_object(y.tobytes())}) != 1:
        bad.append("allreduce in place")
    avg = comm.allreduce(val(r, count), "avg", algorithm="cma")
    if not np.allclose(avg, sum(val(j, count, np.float64) for j in range(n)) / n, rtol=1e-6):
        bad.append("allreduce avg")
    blocks = np.stack([val(r + j, count, np.int64) for j in range(n)])
    rs = comm.reduce_scatter(blocks.reshape(-1), algorithm="cma")
    if not np.array_equal(rs, sum(val(j + r, count, np.int64) for j in range(n))):
        bad.append("reduce_scatter")
    return bad


@permitted
@pytest.mark.parametrize("world_size", [2, 3])
def test_large_unaligned_calls(world_size: int) -> None:
    for rank_bad in run_ranks(_large, world_size, (1 << 20) + 5, timeout=120):
        assert rank_bad == []


def test_auto_weighs_cma_only_for_large_calls() -> None:
    def pick(
        nbytes: int, *, permitted: bool = True, n: int = 2, collective: str = "allgather", inplace: bool = False
    ) -> str:
        count = nbytes // 4 // (n if collective != "broadcast" else 1)
        query = Query(collective, n, count, 4, inplace=inplace, cma=permitted)
        return decide(query, overrides="", table=None).algorithm.name

    assert pick(16 << 20) == "cma"  # one copy instead of two: the model sees it
    assert pick(16 << 10) != "cma"  # a system call per block does not pay below auto_from
    for collective in ("allgather", "alltoall", "broadcast"):  # 2 ranks: from 32 KiB
        assert pick(32 << 10, collective=collective) == "cma", collective
    assert pick(32 << 10, collective="scatter") != "cma" and pick(64 << 10, collective="scatter") == "cma"
    assert pick(16 << 20, permitted=False) != "cma"
    assert pick(128 << 10, n=4) != "cma" and pick(16 << 20, n=4) == "cma"  # more ranks, more syncs
    assert pick(256 << 10, n=4) == "cma" and pick(256 << 10, n=4, collective="alltoall") == "cma"
    # gather: every rank writes its block into the root's output at once
    assert pick(32 << 10, collective="gather") != "cma" and pick(64 << 10, collective="gather") == "cma"
    assert pick(512 << 10, n=4, collective="gather") != "cma" and pick(1 << 20, n=4, collective="gather") == "cma"
    assert pick(16 << 20, collective="broadcast") == "cma" and pick(16 << 20, n=4, collective="broadcast") == "cma"
    # broadcast from 1 to 16 MiB at 4 ranks: the rings (faster in place, the common call), cma
    # again above; at 2 ranks cma throughout (the root writes a share while its peer reads)
    assert pick(512 << 10, collective="broadcast") == "cma" and pick(4 << 20, collective="broadcast") == "cma"
    assert pick(1 << 20, n=4, collective="broadcast") != "cma" and pick(8 << 20, n=4, collective="broadcast") != "cma"
    # In place is per rank: what a rank picks must not depend on it, or ranks would disagree.
    for collective in ("broadcast", "alltoall", "allgather"):
        for n, nbytes in ((2, 32 << 10), (2, 1 << 20), (4, 16 << 20)):
            count = nbytes // 4 // (n if collective != "broadcast" else 1)
            picked = {choose(Query(collective, n, count, 4, inplace=ip, cma=True)).name for ip in (False, True)}
            assert len(picked) == 1, (collective, n, nbytes, picked)

    # The reductions: preferred over the model from a measured size on, up to 4 ranks
    def reduction(collective: str, n: int, nbytes: int) -> str:
        count = nbytes // 4 // (n if collective == "reduce_scatter" else 1)
        return decide(Query(collective, n, count, 4, cma=True), overrides="", table=None).algorithm.name

    assert reduction("allreduce", 2, 32 << 10) != "cma" and reduction("allreduce", 2, 64 << 10) == "cma"
    assert reduction("allreduce", 4, 64 << 10) != "cma" and reduction("allreduce", 4, 128 << 10) == "cma"
    assert reduction("reduce_scatter", 2, 32 << 10) != "cma" and reduction("reduce_scatter", 2, 64 << 10) == "cma"
    assert reduction("reduce_scatter", 4, 512 << 10) != "cma" and reduction("reduce_scatter", 4, 1 << 20) == "cma"
    assert decide(Query("allreduce", 2, 1 << 20, 4, cma=True), overrides="", table=None).reason == "preferred"
    reason = decide(Query("allgather", 2, 4 << 20, 4, cma=False), overrides="allgather:cma", table=None)
    assert reason.algorithm.name != "cma"  # an override it cannot serve is skipped (and logged)


def test_auto_waits_for_larger_calls_where_the_kernel_copies_slowly() -> None:
    def pick(collective: str, nbytes: int, block_ns: int, n: int = 2, inplace: bool = False) -> str:
        blocked = collective in ("allgather", "alltoall", "scatter", "gather", "reduce_scatter")
        count = nbytes // 4 // (n if blocked else 1)
        query = Query(collective, n, count, 4, inplace=inplace, cma=True, cma_block_ns=block_ns)
        return decide(query, overrides="", table=None).algorithm.name

    slow, fast = SLOW_BLOCK_NS + 500, SLOW_BLOCK_NS - 500
    for collective in ("allgather", "alltoall"):  # 2 ranks: 32 KiB, or 64 where slow
        assert pick(collective, 32 << 10, fast) == "cma" and pick(collective, 32 << 10, 0) == "cma", collective
        assert pick(collective, 32 << 10, slow) != "cma", collective
    assert pick("allgather", 64 << 10, slow) == "cma"
    assert pick("broadcast", 32 << 10, slow) == "cma"  # measured: a tie with the rings, dbtree slower
    for collective in ("gather", "scatter", "reduce_scatter", "alltoall"):  # 64 KiB, or 128 where slow
        assert pick(collective, 64 << 10, fast) == "cma", collective
        assert pick(collective, 64 << 10, slow) != "cma" and pick(collective, 128 << 10, slow) == "cma", collective
    assert pick("allreduce", 64 << 10, slow) == "cma"  # measured: the others were no faster there
    # Only 2 ranks' sizes move (above, cma's sizes were measured with the syncs' cost in them)
    assert pick("allgather", 256 << 10, slow, n=4) == "cma" and pick("allgather", 128 << 10, fast, n=4) != "cma"
    for inplace in (False, True):  # still one choice whatever a rank's in-place
        assert choose(Query("alltoall", 2, 4 << 10, 4, inplace=inplace, cma=True, cma_block_ns=slow)).name != "cma"


def _agreed(comm) -> tuple[int, list[str], bool]:  # type: ignore[no-untyped-def]
    """Each rank pretends to have measured another copy time; rank 0 asks first, rank 1 after."""
    from shmcoll.comm import calls

    own = cma.block_ns
    cma.block_ns = lambda: (SLOW_BLOCK_NS + 500) if comm.rank == 0 else (SLOW_BLOCK_NS - 500)
    sub = comm.split(0)  # an arena of its own: the pool's may have agreed on a time before
    try:
        if sub.rank == 1:
            sub.barrier()
        agreed = calls.cma_block_ns(sub)
        if sub.rank == 0:
            sub.barrier()
        g = sub.allgather(np.full(4 << 10, sub.rank, np.float32))  # 32 KiB out: cma only where fast
        labels = [c.label for c in sub._calls.values() if c.kind == "allgather"]
        return agreed, labels, bool((g[1] == 1).all() and (g[0] == 0).all())
    finally:
        sub.close()
        cma.block_ns = own  # the pool's processes live on


@permitted
def test_ranks_take_the_first_measured_copy_time() -> None:
    """Every rank takes the time rank 0 published, though rank 1 measured one on the other side
    of the limit: both choose the rings for a 32 KiB allgather, and it runs."""
    results = run_ranks(_agreed, 2, timeout=60)
    assert [agreed for agreed, _, _ in results] == [SLOW_BLOCK_NS + 500] * 2
    for _, labels, right in results:
        assert right and len(labels) == 1 and "cma" not in labels[0], labels


def _refused(comm) -> tuple[str, str, bool]:  # type: ignore[no-untyped-def]
    x = np.full(1 << 18, comm.rank, np.float32)
    try:
        comm.allgather(x, algorithm="cma")
        raised = ""
    except UnsupportedError as exc:
        raised = str(exc)
    g = comm.allgather(x)  # auto, on the rings
    return raised, cma.probe()[1], bool(all((g[j] == j).all() for j in range(comm.world_size)))


def test_off_falls_back_to_the_rings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMCOLL_CMA", "0")  # inherited by the ranks this test starts
    for raised, why, right in run_ranks(_refused, 2, timeout=60):
        assert "cross-memory attach is not permitted here" in raised and why == "off (SHMCOLL_CMA=0)" and right


def test_info_and_debug_say_whether_it_is_on() -> None:
    env_off = {"SHMCOLL_CMA": "0"}
    info = subprocess.run(
        [sys.executable, "-m", "shmcoll.cli", "info"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env_off},
    )
    assert info.returncode == 0 and "cross-memory attach" in info.stdout and "off (SHMCOLL_CMA=0)" in info.stdout
    assert "16 KiB block" not in info.stdout
    if cma.probe()[0]:  # and how fast the kernel copies here, which moves auto's sizes
        info = subprocess.run([sys.executable, "-m", "shmcoll.cli", "info"], capture_output=True, text=True, timeout=60)
        assert info.returncode == 0 and "copies a 16 KiB block in" in info.stdout, info.stdout
    code = "import shmcoll; shmcoll.init().close()"
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SHMCOLL_DEBUG": "INFO"},
    )
    assert run.returncode == 0, run.stderr
    assert "cross-memory attach " + cma.probe()[1] in run.stderr


def test_bad_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="SHMCOLL_CMA must be auto or 0"):
        config.load({"SHMCOLL_CMA": "sometimes"})
