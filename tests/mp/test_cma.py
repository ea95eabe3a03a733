"""Cross-memory attach (the ``cma`` algorithm) beyond the correctness matrix (which runs its plans
at every world size, count, root and dtype): large unaligned calls on ordinary buffers, the
automatic choice, and the clean fallback when it is turned off or not permitted."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from harness import run_ranks

from shmcoll import collectives, config
from shmcoll.algos import cma as cma_plans
from shmcoll.algos import registry
from shmcoll.algos.select import Measured, TuneTable, choose, decide
from shmcoll.errors import UnsupportedError
from shmcoll.plan import cost
from shmcoll.plan.algorithm import Query
from shmcoll.shm import cma, pages

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
    root = n - 1  # in place: the root's own block stays where it is, its peers' are shared out
    src = np.stack([val(j, count) for j in range(n)]) if r == root else None
    dst = src[root] if src is not None else np.full(count, -1.0, np.float32)
    s = comm.scatter(src, out=dst, root=root, algorithm="cma")
    if not np.array_equal(s, val(r, count)):
        bad.append("scatter in place")
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
    root = n - 1  # reduce: the non-roots write their finished parts into the root's buffer
    y = np.zeros(count + 1, np.int64)[1:]
    y[...] = val(r, count, np.int64)
    got = comm.reduce(y, root, out=y if r == root else None, algorithm="cma")  # in place at the root
    if r == root and (got is not y or not np.array_equal(y, total)):
        bad.append("reduce in place")
    if r != root and not np.array_equal(y, val(r, count, np.int64)):
        bad.append("reduce changed a non-root's input")
    out = np.full(count, -1.0, np.float32) if r == 0 else None
    got = comm.reduce(val(r, count), 0, "avg", out=out, algorithm="cma")
    expected = sum(val(j, count, np.float64) for j in range(n)) / n
    if r == 0 and (got is not out or not np.allclose(got, expected, rtol=1e-6)):
        bad.append("reduce avg")
    return bad


def _some_in_place(comm, count: int) -> list[str]:  # type: ignore[no-untyped-def]
    """cma's reductions where the even ranks call in place and the odd ones out of place (each
    rank's plan reads its first peer's part into its output only out of place): exact int64 sums,
    and float32 sums with the same bits on every rank."""
    r, n = comm.rank, comm.world_size
    inplace = r % 2 == 0
    bad = []
    for dtype in (np.int64, np.float32):
        rows = [
            ((np.arange(count * n, dtype=np.int64) * 7 + j * 1_000_003) % 4099 - 2049).astype(dtype) for j in range(n)
        ]
        if dtype == np.float32:
            rows = [x * np.float32(1.1) ** j for j, x in enumerate(rows)]
        x = rows[r].copy()
        got = (
            comm.allreduce(x, algorithm="cma") if inplace else comm.allreduce(x, out=np.empty_like(x), algorithm="cma")
        )
        same = len(set(comm.allgather_object(got.tobytes()))) == 1
        if not same or (dtype == np.int64 and not np.array_equal(got, sum(rows))):
            bad.append(f"allreduce {np.dtype(dtype).name}")
        x = rows[r].copy()
        mine = x.reshape(n, count)[r]
        got = comm.reduce_scatter(x, out=mine if inplace else np.empty(count, dtype), algorithm="cma")
        blocks = comm.allgather_object(got.tobytes())
        whole = np.frombuffer(b"".join(blocks), dtype)
        expected = sum(rows)
        if dtype == np.int64 and not np.array_equal(whole, expected):
            bad.append("reduce_scatter int64")
        if dtype == np.float32:  # (reduce_scatter combines as allreduce does: the same bits)
            theirs = comm.allgather_object(
                comm.allreduce(rows[r].copy(), algorithm="cma")[r * count : (r + 1) * count].tobytes()
            )
            if blocks != theirs:
                bad.append("reduce_scatter float32")
    return bad


@permitted
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_in_place_and_out_of_place_in_one_reduction(world_size: int) -> None:
    count = 3 * cma_plans._PART + 5  # (four parts, the last short)
    for rank_bad in run_ranks(_some_in_place, world_size, count, timeout=120):
        assert rank_bad == []


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
    assert pick(32 << 10, collective="broadcast") == "cma"  # 2 ranks: from 32 KiB
    for collective in ("allgather", "alltoall"):  # 2 ranks: from 64 KiB (direct faster at 32)
        assert pick(32 << 10, collective=collective) != "cma" and pick(64 << 10, collective=collective) == "cma"
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


def test_auto_runs_cma_for_broadcast_where_ranks_crowd_the_cores() -> None:
    """From 1 MiB, where ranks are at least twice the cores (``cma_plans._crowded``), broadcast
    runs cma instead of leaving 1-16 MiB to the rings: their hand-offs wait for the scheduler
    there (Zen 4 VM, 4 ranks on 2 cores: ``dbtree`` 1.3-4.6x slower at 1-4 MiB in two of three
    runs, stop 48). Ranks with a core each, or 3 on 2 cores, keep the rings there; below 1 MiB
    nothing changes; a race that saw the rings win still holds cma back to OVERSUBSCRIBED_DEFAULT."""

    def pick(nbytes: int, n: int, cores: int, crossover: int = 16 << 10, inplace: bool = False) -> str:
        q = Query("broadcast", n, nbytes // 4, 4, inplace=inplace, cma=True, cma_crossover=crossover, cores=cores)
        return choose(q).name

    for n, cores in ((4, 2), (8, 2), (8, 4)):
        for nbytes in (1 << 20, 4 << 20, 8 << 20, 16 << 20):
            assert {pick(nbytes, n, cores, inplace=ip) for ip in (False, True)} == {"cma"}, (n, cores, nbytes)
        assert pick(512 << 10, n, cores) != "cma", (n, cores)  # (the spell decides there: the rings)
    for n, cores in ((3, 2), (4, 8), (4, 0)):  # not crowded, or cores unknown: the rings from 1 to 16 MiB
        for nbytes in (1 << 20, 8 << 20):
            assert pick(nbytes, n, cores) != "cma", (n, cores, nbytes)
        assert pick(16 << 20, n, cores) == "cma", (n, cores)
    assert pick(1 << 20, 4, 2, crossover=cma.NEVER) != "cma" and pick(4 << 20, 4, 2, crossover=cma.NEVER) == "cma"


def test_auto_weighs_cma_from_the_measured_crossover() -> None:
    """``Query.cma_crossover`` (where two cores exchange blocks no slower by the kernel than
    through the rings) moves where ``auto`` starts weighing cma: from ``n`` blocks of it, never
    below the sizes of ``auto_from``; where ranks outnumber cores, from a size per collective
    (``OVERSUBSCRIBED_FROM``) at the latest."""

    def weighed(collective: str, nbytes: int, crossover: int, n: int = 2, cores: int = 2) -> bool:
        count = nbytes // 4 // (n if collective not in ("broadcast", "allreduce") else 1)
        query = Query(collective, n, count, 4, cma=True, cma_crossover=crossover, cores=cores)
        return registry.get(collective, "cma").for_auto(query, nbytes)

    kinds = ("allgather", "alltoall", "gather", "scatter", "reduce_scatter", "allreduce", "broadcast")
    for collective in kinds:
        # not measured (0): the sizes alone; a crossover at the smallest size changes nothing at 2 ranks
        assert weighed(collective, 1 << 20, 0) and weighed(collective, 1 << 20, cma.LADDER_BYTES[0]), collective
        assert not weighed(collective, 16 << 10, cma.LADDER_BYTES[0]), collective  # (below auto_from)
        # a crossover at 256 KiB: from 2 blocks of it at 2 ranks
        assert not weighed(collective, 256 << 10, 256 << 10) and weighed(collective, 512 << 10, 256 << 10), collective
        # never: not at 2 ranks with 2 cores, whatever the size, but for the copy collectives
        # past the race's ladder (cma_plans.PAST_LADDER_FROM): broadcast from 2 MiB, allgather
        # and alltoall from 16 MiB
        past = collective in cma_plans.PAST_LADDER_FROM
        assert not weighed(collective, 1 << 20, cma.NEVER), collective
        assert weighed(collective, 2 << 20, cma.NEVER) is (collective == "broadcast"), collective
        assert weighed(collective, 8 << 20, cma.NEVER) is (collective == "broadcast"), collective
        assert weighed(collective, 16 << 20, cma.NEVER) is past, collective
        assert weighed(collective, 256 << 20, cma.NEVER) is past, collective
        assert not weighed(collective, 256 << 20, cma.NEVER, n=3, cores=4), collective  # (measured at 2 ranks)
        count = (16 << 20) // 4 // (1 if collective in ("broadcast", "allreduce") else 2)
        small = Query(collective, 2, count, 4, cma=True, cma_crossover=cma.NEVER, cores=2, huge_pages=False)
        # known 4 KiB pages: the race's verdict, but for broadcast (cma_plans.PAST_LADDER_ANY_PAGES)
        on_small = registry.get(collective, "cma").for_auto(small, 16 << 20)
        assert on_small is (collective == "broadcast"), collective
    # Ranks outnumbering cores: from the collective's OVERSUBSCRIBED_FROM at the latest (and never
    # below auto_from's sizes), whatever the race says
    assert not weighed("allgather", 2 << 20, cma.NEVER, n=4) and weighed("allgather", 4 << 20, cma.NEVER, n=4)
    starts = (("allreduce", 16 << 20), ("scatter", 16 << 20), ("gather", 64 << 20), ("alltoall", 64 << 20))
    for collective, start in starts:
        assert not weighed(collective, start // 2, cma.NEVER, n=4) and weighed(collective, start, cma.NEVER, n=4)
    assert weighed("alltoall", 4 << 20, 256 << 10, n=4) and weighed("allgather", 256 << 10, 64 << 10, n=4)
    # The reductions above 4 ranks: from 16 MiB, where ranks outnumber cores or the race says so
    for collective in ("allreduce", "reduce_scatter"):
        assert not weighed(collective, 8 << 20, cma.NEVER, n=8) and weighed(collective, 16 << 20, cma.NEVER, n=8)
        assert not weighed(collective, 64 << 20, cma.NEVER, n=8, cores=8)
        assert weighed(collective, 16 << 20, 64 << 10, n=8, cores=8)
    q = Query("allreduce", 8, 4 << 20, 4, cma=True, cma_crossover=cma.NEVER, cores=2)
    assert choose(q).name == "cma" and choose(dataclasses.replace(q, count=1 << 20)).name != "cma"
    assert not weighed("allgather", 128 << 10, 16 << 10, n=4)  # (auto_from: 256 KiB at 4 ranks)
    # ... but with a core each, the crossover holds at any size
    assert not weighed("allgather", 64 << 20, cma.NEVER, n=4, cores=8)
    assert weighed("allgather", 1 << 20, 256 << 10, n=4, cores=8) and not weighed(
        "allgather", 512 << 10, 256 << 10, n=4, cores=8
    )
    assert {"broadcast", "allgather", "alltoall"} == set(cma_plans.PAST_LADDER_FROM)
    for collective in cma_plans.PAST_LADDER_FROM:  # the model then takes cma there
        count = (64 << 20) // 4 // (1 if collective == "broadcast" else 2)
        below = count // 64 if collective == "broadcast" else count // 8  # (1 MiB, 8 MiB)
        for inplace in (False, True):
            q = Query(collective, 2, count, 4, inplace=inplace, cma=True, cma_crossover=cma.NEVER, cores=2)
            assert choose(q).name == "cma" and choose(dataclasses.replace(q, count=below)).name != "cma", collective
    # A race the kernel won only at its largest block: broadcast from 2 MiB all the same
    assert weighed("broadcast", 2 << 20, cma.LADDER_BYTES[-1]) and not weighed(
        "allgather", 4 << 20, cma.LADDER_BYTES[-1]
    )
    # The choice follows: the rings where cma is not weighed, one choice whatever a rank's in-place
    for inplace in (False, True):
        q = Query("alltoall", 2, 1 << 18, 4, inplace=inplace, cma=True, cma_crossover=cma.NEVER, cores=2)
        assert choose(q).name != "cma"
        q = dataclasses.replace(q, cma_crossover=cma.LADDER_BYTES[0])
        assert choose(q).name == "cma"


def test_auto_runs_cma_where_every_rank_is_on_huge_pages() -> None:
    """``Query.huge_pages`` (agreed by the ranks, ``comm.pages``): cma from 1 MiB at up to 4 ranks,
    before a tune table and whatever the race says, up to 16 MiB (alltoall at every size; from
    there at 4 ranks on 2 cores, the oversubscribed sizes, which huge pages bring down to 16 MiB
    for gather); known 4 KiB pages leave the rings to the race alone, without the oversubscribed
    sizes (a 2-rank broadcast aside, ``PAST_LADDER_FROM``)."""

    def decided(collective: str, nbytes: int, huge: bool | None, n: int = 2, table: Any = None) -> tuple[str, str]:
        count = -(-nbytes // 4 // (n if collective not in ("broadcast", "allreduce") else 1))  # (at least nbytes)
        query = Query(collective, n, count, 4, cma=True, cma_crossover=cma.NEVER, cores=2, huge_pages=huge)
        d = decide(query, overrides="", table=table)
        return d.algorithm.name, d.reason

    kinds = ("allgather", "alltoall", "gather", "scatter", "reduce_scatter", "allreduce", "broadcast")
    for collective in kinds:
        for n in (2, 3, 4):
            start = cma_plans.huge_from(collective, n)
            assert start == (4 << 20 if collective in ("gather", "scatter") else 1 << 20) or (
                collective == "reduce_scatter" and n == 2 and start == 2 << 20
            )  # (gather's and scatter's non-roots wait; reduce_scatter at 2 ranks: cma no faster)
            assert decided(collective, start, True, n) == ("cma", "pages"), (collective, n)
            assert decided(collective, start // 2, True, n)[1] != "pages", (collective, n)
            assert decided(collective, 8 << 20, True, n) == ("cma", "pages"), (collective, n)
            # the race: never (but a 2-rank broadcast from 2 MiB, on any pages: cma_plans.PAST_LADDER_FROM)
            on_small = decided(collective, 2 << 20, False, n)[0]
            assert (on_small == "cma") is (collective == "broadcast" and n == 2), (collective, n)
        for n in (2, 4):  # (below: calls repeated with the same arrays take the lean path)
            assert decided(collective, 512 << 10, True, n)[1] != "pages", (collective, n)
        assert decided(collective, 2 << 20, True, n=8)[1] != "pages", collective  # not measured above 4
        assert decided(collective, 12 << 20, True, n=4) == ("cma", "pages"), collective
        if collective == "alltoall":  # (cma's single copy keeps winning there: cma.HUGE_UNBOUNDED)
            for nbytes in (16 << 20, 256 << 20):
                assert decided(collective, nbytes, True) == ("cma", "pages"), nbytes
                assert decided(collective, nbytes, False)[0] != "cma", nbytes
        else:
            assert decided(collective, 16 << 20, True)[1] != "pages", collective  # (past the L3: memory sets both)
    # From 16 MiB on huge pages, the rules for unknown pages: at 4 ranks on 2 cores, cma from the
    # collective's oversubscribed size, which huge pages bring down to 16 MiB for gather and
    # alltoall (they wait for 64 MiB otherwise)
    assert (
        decided("allreduce", 32 << 20, True, n=4)[0] == "cma" and decided("allreduce", 32 << 20, False, n=4)[0] != "cma"
    )
    for collective in ("alltoall", "gather"):
        for nbytes in (16 << 20, 32 << 20):
            assert decided(collective, nbytes, True, n=4)[0] == "cma", (collective, nbytes)
            assert decided(collective, nbytes, None, n=4)[0] != "cma", (collective, nbytes)  # (pages unknown)
            assert decided(collective, nbytes, False, n=4)[0] != "cma", (collective, nbytes)
            assert decided(collective, nbytes, True, n=8)[0] != "cma", (collective, nbytes)  # (not measured above 4)
            if collective == "gather":  # (alltoall: above, cma.HUGE_UNBOUNDED)
                assert decided(collective, nbytes, True, n=2)[0] != "cma", (collective, nbytes)  # (a core each)
        assert decided(collective, 64 << 20, None, n=4)[0] == "cma", collective
    # 4 KiB pages, 4 ranks on 2 cores: the race alone (it never saw the kernel win), not the
    # oversubscribed sizes, which were measured on buffers of either page size
    assert (
        decided("allgather", 4 << 20, None, n=4)[0] == "cma" and decided("allgather", 4 << 20, False, n=4)[0] != "cma"
    )
    assert (
        decided("allreduce", 16 << 20, None, n=4)[0] == "cma" and decided("allreduce", 16 << 20, False, n=4)[0] != "cma"
    )
    # Before a tune table, whose times were taken on buffers of unknown pages
    sizes = (1 << 20, 4 << 20, 16 << 20)
    table = TuneTable(
        cost.CostModel(0.25e-6, 20e9),
        64 << 10,
        (Measured("allgather", 2, sizes, {"direct": (1e-4, 4e-4, 1.6e-3), "cma": (2e-4, 8e-4, 3.2e-3)}),),
        "synthetic",
    )
    assert decided("allgather", 4 << 20, False, table=table) == ("direct", "measured")
    assert decided("allgather", 4 << 20, True, table=table) == ("cma", "pages")
    # In place is per rank: the choice on huge pages must not depend on it either
    for collective in ("broadcast", "alltoall", "allgather", "gather"):
        count = (4 << 20) // 4 // (2 if collective != "broadcast" else 1)
        picked = {
            choose(Query(collective, 2, count, 4, inplace=ip, cma=True, cma_crossover=cma.NEVER, huge_pages=True)).name
            for ip in (False, True)
        }
        assert picked == {"cma"}, (collective, picked)


def test_auto_runs_cma_for_a_reduce_only_at_two_ranks_on_huge_pages() -> None:
    """reduce: cma at 2 ranks where every rank's buffers are on huge pages, from 1 MiB to below 8
    MiB, in place or not; the rings on 4 KiB or unknown pages, at 4 ranks, and outside those
    sizes, whatever the race says (``cma._reduce_skips``)."""

    def picked(nbytes: int, huge: bool | None, n: int = 2, crossover: int = cma.NEVER, inplace: bool = False) -> str:
        query = Query(
            "reduce", n, nbytes // 4, 4, inplace=inplace, cma=True, cma_crossover=crossover, cores=2, huge_pages=huge
        )
        return decide(query, overrides="").algorithm.name

    for crossover in (cma.NEVER, 16 << 10):
        for nbytes in (1 << 20, 2 << 20, 4 << 20):
            assert {picked(nbytes, True, crossover=crossover, inplace=ip) for ip in (False, True)} == {"cma"}
            assert (
                picked(nbytes, False, crossover=crossover) != "cma"
                and picked(nbytes, None, crossover=crossover) != "cma"
            )
            assert picked(nbytes, True, n=4, crossover=crossover) != "cma"
        for nbytes in (256 << 10, 512 << 10, 8 << 20, 16 << 20, 64 << 20):
            assert picked(nbytes, True, crossover=crossover) != "cma", nbytes
            assert picked(nbytes, None, crossover=crossover) != "cma", nbytes


@contextlib.contextmanager
def _agreed_plans() -> Iterator[list[str]]:
    """The labels of the plans ``comm.pages.agreed`` returns while the block runs, in order
    (restored after it: the pool's processes live on)."""
    from shmcoll.comm import pages as agreement

    ran: list[str] = []
    own = agreement.agreed

    def spy(rt, b, timeout):  # type: ignore[no-untyped-def]
        chosen = own(rt, b, timeout)
        ran.append(chosen[0].label)
        return chosen

    agreement.agreed = spy  # type: ignore[assignment]
    try:
        yield ran
    finally:
        agreement.agreed = own  # type: ignore[method-assign]


def _by_pages(comm, kinds: list[str]) -> tuple[list[str], list[str], bool]:  # type: ignore[no-untyped-def]
    """Large calls on buffers of the pages ``kinds[rank]`` names, blocking, nonblocking and
    persistent, with a small allreduce in a loop between them: which plans ran (the labels
    ``comm.pages.agreed`` returned), what was wrong, and whether the small call kept its lean path."""
    from shmcoll.shm import pages

    # As where the rings win the launcher's race (the 2-core VM, unloaded): auto's choice then
    # hinges on pages. (A race run while other tests load the machine can say the kernel wins,
    # and cma is then the choice on any pages.)
    comm._cma_crossover = cma.NEVER
    with _agreed_plans() as ran:
        r, n, kind = comm.rank, comm.world_size, kinds[comm.rank]
        count = (2 << 20) // 4  # 2 MiB per rank: the calls are 2-6 MiB
        bad = []
        tiny = np.ones(2, np.float32)
        comm.allreduce(tiny)
        comm.allreduce(tiny)  # (now on the lean path)
        lean = comm._lean[collectives.get("allreduce").code]
        x = pages.array(count, np.float32, kind)
        x[...] = r
        out = pages.array((n, count), np.float32, kind)
        out[...] = -1
        for _ in range(2):
            comm.allgather(x, out=out)
            comm.allreduce(tiny)
        if not all((out[j] == j).all() for j in range(n)):
            bad.append("allgather")
        rows = pages.array((n, count), np.float32, kind)
        rows[...] = (np.arange(n) * 10 + r)[:, None]
        comm.alltoall(rows, out=rows)  # in place
        if not all((rows[j] == r * 10 + j).all() for j in range(n)):
            bad.append("alltoall in place")
        out[...] = -1
        comm.iallgather(x, out=out).wait()
        if not all((out[j] == j).all() for j in range(n)):
            bad.append("iallgather")
        b = pages.array(count, np.float32, kind)
        req = comm.broadcast_init(b, root=n - 1)
        for value in (5, 6):
            b[...] = value if r == n - 1 else -1
            req.start()
            req.wait()
            if not (b == value).all():
                bad.append("broadcast_init")
        # gather of 1 MiB per rank, made again: at 4 ranks (4 MiB) a non-root's call is
        # remembered (its buffer is small) and takes the lean path, which agrees on pages too;
        # then its i-form
        small = pages.array((1 << 20) // 4, np.float32, kind)
        small[...] = r
        whole = pages.array((n, (1 << 20) // 4), np.float32, kind) if r == 0 else None
        if whole is not None:
            whole[...] = -1  # (pages not yet touched are none: the first call would run the rings)
        for _ in range(3):
            got = comm.gather(small, root=0, out=whole)
            if r == 0 and not all((got[j] == j).all() for j in range(n)):
                bad.append("gather")
        m = comm._lean[collectives.get("gather").code]
        if r != 0 and n >= 4 and not (len(m) > 7 and hasattr(m[7], "records")):  # (from 4 MiB)
            bad.append("gather's lean path")
        got = comm.igather(small, root=0, out=whole).wait()
        if r == 0 and not all((got[j] == j).all() for j in range(n)):
            bad.append("igather")
        comm.allreduce(tiny)
        kept = comm._lean[collectives.get("allreduce").code] is lean and (tiny == n**5).all()
        return ran, bad, bool(kept)


@permitted
@pytest.mark.skipif(not pages.can_scan(), reason="no PAGEMAP_SCAN here (Linux 6.7 and later)")
@pytest.mark.skipif(pages.thp_setting() not in ("always", "madvise"), reason="no transparent huge pages")
@pytest.mark.parametrize(
    "kinds",
    [["huge", "huge"], ["huge", "small"], ["small", "huge", "huge"], ["huge", "huge", "huge"], ["huge", "small"] * 2],
)
def test_ranks_agree_on_their_pages_before_a_call_whose_choice_hinges_on_them(kinds: list[str]) -> None:
    """cma runs where every rank's buffers are on huge pages, the rings where one rank's are on
    4 KiB pages; the blocking, nonblocking and persistent forms and the lean path of a call made
    again alike, with exact results, and the program's small allreduce keeps its lean path
    between them."""
    results = run_ranks(_by_pages, len(kinds), kinds, timeout=120)
    everywhere = all(k == "huge" for k in kinds)
    # allgather twice, alltoall, iallgather, broadcast_init twice (not at 2 ranks, where a broadcast
    # of 2 MiB runs cma on any pages: cma_plans.PAST_LADDER_FROM); gather 3 + 1 from 4 MiB
    agreed = 4 if len(kinds) == 2 else 6
    for ran, bad, kept in results:
        assert not bad and kept, (bad, kept)
        assert len(ran) == agreed + (4 if len(kinds) >= 4 else 0), ran
        assert all(("algorithm=cma" in label) == everywhere for label in ran[:agreed]), ran
        # gather's peers write into the root's output alone: its pages decide
        assert all(("algorithm=cma" in label) == (kinds[0] == "huge") for label in ran[agreed:]), ran
    assert len({tuple(ran) for ran, _, _ in results}) == 1  # every rank ran the same plans


def test_the_buffers_peers_reach_follow_the_plan() -> None:
    """What a rank looks at before a page-aware call (``comm.pages``): the buffers the cma plan's
    peers pin, which for allgather and alltoall are the outputs they write into, or from
    ``_READ_FROM`` elements the inputs they read."""
    from shmcoll.algos import cma as plans

    big = plans._READ_FROM

    def reached(collective: str, at_root: bool, count: int, n: int = 2) -> tuple[bool, bool]:
        return plans.reached(collective, at_root, count, n)

    assert reached("allgather", False, 10) == (False, True) and reached("allgather", False, big) == (True, False)
    assert reached("alltoall", False, 10) == (False, True) and reached("alltoall", False, big) == (True, False)
    many = plans._ALLTOALL_READ_FROM  # (above 2 ranks an alltoall reads from smaller blocks)
    assert reached("alltoall", False, many, 2) == (False, True) and reached("alltoall", False, many, 4) == (True, False)
    assert reached("allgather", False, many, 4) == (False, True)
    assert reached("scatter", True, big) == (True, False) and reached("scatter", False, 10) == (False, False)
    assert reached("gather", True, big) == (False, True) and reached("gather", False, big) == (False, False)
    assert reached("broadcast", True, 10) == (True, True) and reached("broadcast", False, 10) == (False, True)
    assert reached("allreduce", False, big) == (True, True)
    assert reached("reduce_scatter", False, 10) == (True, False)
    assert reached("reduce", True, 10) == (True, True) and reached("reduce", False, 10) == (True, False)


def _reduce_by_pages(comm, kinds: list[str]) -> tuple[list[str], bool]:  # type: ignore[no-untyped-def]
    """A 2 MiB reduce onto each rank in turn, in place and out of place, on buffers of the pages
    ``kinds[rank]`` names: which plans the ranks agreed on, and whether every result was exact."""
    from shmcoll.shm import pages

    with _agreed_plans() as ran:
        r, n = comm.rank, comm.world_size
        count = (2 << 20) // 4
        x = pages.array(count, np.float32, kinds[r])
        out = pages.array(count, np.float32, kinds[r])
        exact = True
        for root in range(n):
            for inplace in (False, True):
                x[...] = np.arange(count, dtype=np.float32) % 1000 + r
                out[...] = -1
                got = comm.reduce(x, root, out=(x if inplace else out) if r == root else None)
                expected = n * (np.arange(count, dtype=np.float32) % 1000) + sum(range(n))
                exact &= r != root or bool(np.array_equal(got, expected))
        return ran, exact


@permitted
@pytest.mark.skipif(not pages.can_scan(), reason="no PAGEMAP_SCAN here (Linux 6.7 and later)")
@pytest.mark.skipif(pages.thp_setting() not in ("always", "madvise"), reason="no transparent huge pages")
@pytest.mark.parametrize("kinds", [["huge", "huge"], ["huge", "small"], ["small", "huge"]])
def test_a_reduce_runs_cma_where_both_ranks_are_on_huge_pages(kinds: list[str]) -> None:
    """A 2-rank reduce from 1 MiB is page-aware (``cma._reduce_skips``): cma where both ranks'
    buffers are on huge pages, the rings elsewhere, exact either way; the root's output is among
    what its peer reaches, and a non-root's input."""
    for ran, exact in run_ranks(_reduce_by_pages, 2, kinds, timeout=120):
        assert exact
        assert len(ran) == 4 and all(("algorithm=cma" in label) == (kinds == ["huge", "huge"]) for label in ran), ran


def _random_votes(comm, calls: int) -> tuple[list[bool], list[str]]:  # type: ignore[no-untyped-def]
    """Page-aware calls whose ranks vote at random (each its own coin), on call shapes whose
    plain plan is the rings' (in which a scatter's root sends its 32 KiB parts into the rings
    and can finish before its peers arrive) and whose other plan is cma, with calls that do not
    agree between them: which plan ran at each call, and what was wrong."""
    import random

    from shmcoll.comm import pages as agreement

    comm._cma_crossover = cma.NEVER  # (the rings: direct)
    coin, order = random.Random(1000 + comm.rank), random.Random(7)  # (the order: the same everywhere)
    n, r = comm.world_size, comm.rank
    count = 8 << 10
    x = np.full(count, r + 1, np.float32)
    gathered = np.empty((n, count), np.float32)
    rows = np.arange(n * count, dtype=np.float32).reshape(n, count)
    part = np.empty(count, np.float32)
    tiny = np.ones(2, np.float32)
    calls_of = {
        "allgather": lambda a: comm.allgather(x, out=gathered, algorithm=a),
        "scatter": lambda a: comm.scatter(rows if r == 0 else None, root=0, out=part, algorithm=a),
    }
    shapes = []
    for make in calls_of.values():  # each call shape, then its cma plan as its other plan
        make("auto")
        shape = next(reversed(comm._calls.values()))
        make("cma")
        shape.huge = next(reversed(comm._calls.values()))
        assert "algorithm=cma" not in shape.label and "algorithm=cma" in shape.huge.label, shape.label
        shapes.append(shape)
    comm._memo[:] = [None] * len(comm._memo)
    comm._lean[:] = [None] * len(comm._lean)
    ran: list[bool] = []
    bad: list[str] = []
    own_vote, own = agreement.local_huge, agreement.agreed

    def spy(rt, b, timeout):  # type: ignore[no-untyped-def]
        chosen = own(rt, b, timeout)
        ran.append(chosen[0] is not b[0])
        return chosen

    agreement.local_huge = lambda b: coin.random() < 0.6  # type: ignore[assignment]
    agreement.agreed = spy  # type: ignore[assignment]
    try:
        for i in range(calls):
            kind = order.choice(sorted(calls_of))
            gathered[...] = -1
            part[...] = -1
            calls_of[kind]("auto")
            if order.random() < 0.3:
                comm.allreduce(tiny)  # (a call that does not agree, between them)
            if kind == "allgather" and not all((gathered[j] == j + 1).all() for j in range(n)):
                bad.append(f"allgather {i}")
            if kind == "scatter" and not (part == rows[r]).all():
                bad.append(f"scatter {i}")
        return ran, bad
    finally:
        agreement.local_huge, agreement.agreed = own_vote, own  # type: ignore[method-assign]  # (the pool's processes live on)
        for shape in shapes:
            shape.huge = None
        comm._memo[:] = [None] * len(comm._memo)
        comm._lean[:] = [None] * len(comm._lean)


@permitted
@pytest.mark.parametrize("n", [2, 3])
def test_ranks_that_vote_at_random_run_the_same_plan_at_every_call(n: int) -> None:
    """The page agreement's protocol (``comm.pages``, ``engine.cpu.agree_pages``) under every
    pattern of votes: the other plan runs only where every rank voted for it, and a rank that
    voted for it reads a peer's word of this call, not of the next, even where the peer has
    finished this call's plain plan alone and gone on (it sends into the rings without waiting).
    A wrong reading would run two plans in one call, which the engine reports as a mismatch."""
    results = run_ranks(_random_votes, n, 3000, timeout=180)
    for ran, bad in results:
        assert not bad, bad[:5]
        assert len(ran) == 3000 and 0 < sum(ran) < 3000
    assert len({tuple(ran) for ran, _ in results}) == 1


def _eager_huge_plan(comm) -> tuple[list[bool], bool]:  # type: ignore[no-untyped-def]
    """A selection that would run ``direct`` on huge pages and cma on 4 KiB ones: whether the
    call shape became page-aware, and whether the call was right."""
    from shmcoll.algos import registry as algorithms
    from shmcoll.comm import calls

    own = calls.choose

    def choose(query, requested="auto", **kw):  # type: ignore[no-untyped-def]
        if requested == "auto" and query.huge_pages:
            return algorithms.get(query.collective, "direct")
        return own(query, requested, **kw)

    calls.choose = choose  # type: ignore[assignment]
    comm._cma_crossover = cma.LADDER_BYTES[0]  # (cma on 4 KiB pages)
    try:
        g = comm.allgather(np.full(1 << 20, comm.rank, np.float32))
        aware = [c.huge is not None for c in comm._calls.values() if c.label.startswith("allgather")]
        return aware, bool((g[1] == 1).all())
    finally:
        calls.choose = own  # type: ignore[assignment]


@permitted
@pytest.mark.skipif(not pages.can_scan(), reason="no PAGEMAP_SCAN here (Linux 6.7 and later)")
def test_only_cma_is_a_huge_page_plan() -> None:
    """The agreement needs an other plan whose syncs wait for every rank (``comm.pages``): where
    the selection would run another algorithm on huge pages, the call shape is not page-aware."""
    for aware, right in run_ranks(_eager_huge_plan, 2, timeout=60):
        assert right and aware == [False], aware


def _without_scan(comm) -> tuple[list[bool], bool]:  # type: ignore[no-untyped-def]
    from shmcoll.shm import pages

    scanner = pages.scanner()
    scanner.ok = False  # as on a kernel before 6.7
    try:
        g = comm.allgather(np.full(1 << 20, comm.rank, np.float32))
        return [c.huge is not None for c in comm._calls.values()], bool((g[1] == 1).all())
    finally:
        scanner.ok = True


@permitted
@pytest.mark.skipif(not pages.can_scan(), reason="no PAGEMAP_SCAN here (Linux 6.7 and later)")
def test_without_the_scan_no_call_waits_for_an_agreement_on_pages() -> None:
    for aware, right in run_ranks(_without_scan, 2, timeout=60):
        assert right and aware == [False], aware


def test_ranks_wait_for_the_first_measurement_or_take_over_from_a_lost_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The arena's crossover word: the first caller measures and publishes; a caller that finds
    it being measured waits for that answer; one whose measurer never answers publishes its own
    after the deadline; a launcher's value stands."""
    import threading
    import time

    from shmcoll.shm import layout
    from shmcoll.shm.arena import Arena
    from shmcoll.shm.segment import new_token

    def arena() -> Arena:
        return Arena.create(2, 4, 4096, new_token())

    a = arena()
    try:
        measured = []

        def slow() -> int:
            measured.append("first")
            time.sleep(0.2)
            return 256 << 10

        first = threading.Thread(target=lambda: measured.append(a.cma_crossover(slow, 10.0)))
        first.start()
        give_up = time.monotonic() + 10
        while a.word(layout.A_CMA_CROSSOVER) != layout.CMA_MEASURING:
            assert time.monotonic() < give_up, "the first caller never claimed the word"
            time.sleep(0.001)
        assert a.cma_crossover(lambda: measured.append("second") or 1, 10.0) == 256 << 10
        first.join()
        assert measured == ["first", 256 << 10]  # (the second never measured)
        assert a.cma_crossover(lambda: 1, 10.0) == 256 << 10  # settled
    finally:
        a.segment.unlink()
        a.close()
    b = arena()
    try:
        assert int(b.ctrl[layout.A_CMA_CROSSOVER]) == 0
        b.ctrl[layout.A_CMA_CROSSOVER] = layout.CMA_MEASURING  # a measurer that died
        assert b.cma_crossover(lambda: 64 << 10, 0.05) == 64 << 10
        b.publish_cma_crossover(16 << 10)  # a later launcher's value does not replace it
        assert b.cma_crossover(lambda: 1, 10.0) == 64 << 10
    finally:
        b.segment.unlink()
        b.close()


@permitted
def test_a_group_measures_the_crossover_before_its_ranks_start() -> None:
    import shmcoll
    from shmcoll.shm import layout

    with shmcoll.Group(2) as group:
        assert group._arena is not None
        assert int(group._arena.ctrl[layout.A_CMA_CROSSOVER]) == cma.crossover_bytes() > 0


@permitted
def test_a_group_races_before_it_starts_its_janitor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The janitor is a Python interpreter starting up: beside the race it can take a core from
    the rings, and a race the kernel wins so sends the whole launch to cma."""
    import shmcoll
    from shmcoll import launch

    order: list[str] = []
    monkeypatch.setattr(launch.cma, "crossover_bytes", lambda: order.append("race") or cma.NEVER)
    janitor = launch.Janitor
    monkeypatch.setattr(launch, "Janitor", lambda token: order.append("janitor") or janitor(token))
    with shmcoll.Group(2):
        pass
    assert order == ["race", "janitor"]


def _one_core_race(nbytes: int) -> tuple[int, int, bool]:
    """cma.race with this thread (and so the race's second thread, which inherits it) on one CPU."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(saved)})
    try:
        return cma.race(nbytes, 1)
    finally:
        os.sched_setaffinity(0, saved)


@permitted
def test_a_race_whose_rings_wait_for_a_core_says_so() -> None:
    # With both threads on one CPU the rings hand off through the scheduler at every slot.
    rings, kernel, contended = _one_core_race(1 << 20)  # 16 slots each way: the rings must wait
    assert contended and rings > 0 and kernel > 0


def test_a_kernel_win_over_contended_rings_is_raced_again(monkeypatch: pytest.MonkeyPatch) -> None:
    races: list[tuple[int, int, bool]] = []
    monkeypatch.setattr(cma, "_CONTENDED_PAUSES_S", (0.0, 0.0, 0.0))
    monkeypatch.setattr(cma, "race", lambda nbytes, reps: races.pop(0))
    races[:] = [(900, 500, True), (400, 500, False)]  # a busy moment, then the rings win
    assert not cma._kernel_wins(1 << 20, 1) and not races
    races[:] = [(900, 500, True), (900, 500, False)]  # the kernel wins on a quiet machine too
    assert cma._kernel_wins(1 << 20, 1) and not races
    races[:] = [(900, 500, True)] * 4  # busy throughout: the ranks will wait for cores too
    assert cma._kernel_wins(1 << 20, 1) and not races
    races[:] = [(400, 500, True)]  # the rings won even so: nothing to race again
    assert not cma._kernel_wins(1 << 20, 1) and not races


def test_a_ladder_that_finds_the_rings_faster_is_climbed_again_and_the_smaller_answer_stands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Right after a process starts, two virtual cores can act for a moment as if they shared one
    physical core's caches, and the race then finds the rings faster at every block: the ladder is climbed again
    a little later (cma._AGAIN_AFTER_S), and the smaller of the two answers stands."""
    ladders: list[int] = []
    slept: list[float] = []
    monkeypatch.setattr(cma, "probe", lambda: (True, "on"))
    monkeypatch.setattr(cma.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(cma, "_ladder", lambda: ladders.pop(0))
    monkeypatch.setattr(cma.time, "sleep", slept.append)
    smallest = cma.LADDER_BYTES[0]
    cases = [
        ([smallest], smallest, 0),  # the smallest block at once: no second climb
        ([cma.NEVER, smallest], smallest, 1),
        ([cma.NEVER, cma.NEVER], cma.NEVER, 1),  # a machine whose rings do win says so twice
        ([64 << 10, cma.NEVER], 64 << 10, 1),
        ([1 << 20, 256 << 10], 256 << 10, 1),
    ]
    try:
        for answers, want, climbs_again in cases:
            ladders[:], slept[:] = answers, []
            cma.crossover_bytes.cache_clear()
            assert cma.crossover_bytes() == want, answers
            assert not ladders and slept == [cma._AGAIN_AFTER_S] * climbs_again, answers
    finally:
        cma.crossover_bytes.cache_clear()


@permitted
def test_the_race_runs_on_4k_pages_whatever_numpy_would_give(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel copies faster from huge pages, which np.ones gave the race's 4 MiB rung (numpy
    asks for them from 4 MiB), so that rung was a coin toss between launches: every buffer of the
    race is on 4 KiB pages now, and says so."""
    from shmcoll.shm import pages

    made: list[np.ndarray] = []
    real = pages.array

    def array(shape, dtype, kind="numpy"):  # type: ignore[no-untyped-def]
        assert kind == "small", kind
        made.append(real(shape, dtype, kind))
        return made[-1]

    monkeypatch.setattr(pages, "array", array)
    rings, kernel, _ = cma.race(4 << 20, 1, rounds=1)
    assert rings > 0 and kernel > 0 and len(made) == 6
    assert all(pages.huge_bytes(a) == 0 for a in made)


def _agreed(comm) -> tuple[int, list[str], bool]:  # type: ignore[no-untyped-def]
    """Each rank pretends to measure another crossover; rank 0 asks first, rank 1 after."""
    from shmcoll.comm import calls

    own = cma.crossover_bytes
    cma.crossover_bytes = lambda: cma.LADDER_BYTES[0] if comm.rank == 0 else cma.NEVER  # type: ignore[assignment]
    sub = comm.split(0)  # an arena of its own, which no launcher measured for
    try:
        if sub.rank == 1:
            sub.barrier()
        agreed = calls.cma_crossover(sub)
        if sub.rank == 0:
            sub.barrier()
        g = sub.allgather(np.full(32 << 10, sub.rank, np.float32))  # 256 KiB out: cma only from rank 0's crossover
        labels = [c.label for c in sub._calls.values() if c.kind == "allgather"]
        return agreed, labels, bool((g[1] == 1).all() and (g[0] == 0).all())
    finally:
        sub.close()
        cma.crossover_bytes = own  # type: ignore[method-assign]  # the pool's processes live on


@permitted
def test_ranks_take_the_first_measured_crossover() -> None:
    """Every rank takes the crossover rank 0 published, though rank 1 measured another: both
    choose cma for a 256 KiB allgather (with rank 1's figure neither would), and it runs."""
    results = run_ranks(_agreed, 2, timeout=60)
    assert [agreed for agreed, _, _ in results] == [cma.LADDER_BYTES[0]] * 2
    for _, labels, right in results:
        assert right and len(labels) == 1 and "cma" in labels[0], labels


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
    assert "against the rings" not in info.stdout
    if cma.probe()[0]:  # and where it beats the rings here, which moves auto's sizes
        info = subprocess.run([sys.executable, "-m", "shmcoll.cli", "info"], capture_output=True, text=True, timeout=60)
        line = "cross-memory attach against the rings: two cores exchange blocks "
        assert info.returncode == 0 and line in info.stdout, info.stdout
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


def _read_then_send(ctx: Any) -> None:
    """A test plan mixing the two transports: rank ``r`` reads chunk ``r`` of its next peer's
    input by cross-memory attach, combines it with its own, and hands the finished chunk to every
    peer through the rings, a slot-load at a time. (An allreduce that handed its finished parts
    back this way, pipelined, was slower than cma's writes at 2 ranks in stop 47: 1.1-1.6x of its
    time at 256 KiB-16 MiB with 64 KiB slots. So this is only a test.)"""
    from shmcoll.algos import zerocopy
    from shmcoll.plan.builder import split
    from shmcoll.plan.ir import Buf, Region

    n = ctx.world_size
    chunks = split(ctx.count, n)
    scratch = ctx.tmp(max(c for _, c in chunks))
    zerocopy.sync(ctx)
    for r in range(n):
        off, c = chunks[r]
        if c:
            ctx.copy(r, Region(Buf.IN, off, rank=(r + 1) % n), scratch, c)
            ctx.reduce_local(r, Region(Buf.IN, off), scratch, Region(Buf.OUT, off), c)
    cap = ctx.slot_capacity
    for r in range(n):
        for j in range(n):
            off, c = chunks[j]
            for q in range(off, off + c, cap):
                k = min(cap, off + c - q)
                if j == r:
                    for peer in range(n):
                        if peer != r:
                            ctx.send(r, peer, Region(Buf.OUT, q), k)
                else:
                    ctx.recv(r, j, Region(Buf.OUT, q), k)


def _mixed_transports(comm: Any, count: int) -> bool:
    # Registered in this rank process only, under a name allreduce has no algorithm for.
    alg = dataclasses.replace(registry.get("allreduce", "cma"), name="pairwise", build=_read_then_send)
    registry._REGISTRY[("allreduce", "pairwise")] = alg
    try:
        rows = [(np.arange(count, dtype=np.int64) * (j + 3)) % 1001 for j in range(comm.world_size)]
        got = comm.allreduce(rows[comm.rank], out=np.empty(count, np.int64), algorithm="pairwise")
        return bool(np.array_equal(got, sum(rows)))
    finally:
        del registry._REGISTRY[("allreduce", "pairwise")]


@permitted
def test_a_plan_may_mix_kernel_copies_and_ring_messages() -> None:
    """The engine tells a step that reaches a peer's buffer by its region code (4 and up): a
    received message's step has none (-1), and with a negative code taken for a peer's the
    engine asked the kernel for "rank -2's buffer" (found in stop 47 with a prototype plan)."""
    count = 3 * (64 << 10) // 8 + 5  # (int64: several slot-loads, the last short)
    assert run_ranks(_mixed_transports, 2, count, timeout=120) == [True, True]
