"""benchmarks/compare_peers.py without any peer installed: argument parsing, the peer-side sweep and
its exact checks (against a fake peer made of threads), the subprocess protocol and its deadlines,
the ratio computation, and the text / Markdown / JSON output."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scripts

from shmcoll.bench import BenchConfig, Row, bus_factor, sizes

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "compare_peers.py"
TESTS = Path(__file__).resolve().parent


cp = scripts.load("compare_peers")


# --- a fake peer: n threads, collectives computed with numpy ------------------------------------
class FakeWorld:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.gate = threading.Barrier(world_size, timeout=60)
        self.slots: list[Any] = [None] * world_size


class FakeComm:
    """The PeerComm protocol over threads; ``bug`` names a collective whose result it corrupts."""

    def __init__(self, world: FakeWorld, rank: int, bug: str | None = None) -> None:
        self.world, self.rank, self.world_size, self.bug = world, rank, world.world_size, bug

    def alloc(self, count: int, pages: str = "numpy") -> tuple[np.ndarray, Any]:
        a = cp.page_array(count, pages)
        return a, a

    def barrier(self) -> None:
        self.world.gate.wait()

    def _exchange(self, value: Any) -> list[Any]:
        self.world.slots[self.rank] = value
        self.barrier()
        values = list(self.world.slots)
        self.barrier()
        return values

    def allreduce_small(self, arr: np.ndarray, op: str) -> None:
        vals = np.stack(self._exchange(arr.copy()))
        arr[...] = vals.max(axis=0) if op == "max" else vals.sum(axis=0)

    def call(self, collective: str, x: np.ndarray, out: np.ndarray) -> None:
        vals = self._exchange(x.copy())
        n, r = self.world_size, self.rank
        total = np.sum(np.stack(vals), axis=0, dtype=np.float32)
        if collective == "allreduce":
            out[...] = total  # (out is x in place)
        elif collective == "broadcast":
            x[...] = vals[cp.ROOT]
        elif collective == "reduce":
            if r == cp.ROOT:
                x[...] = total
        elif collective == "allgather":
            out[...] = np.concatenate(vals)
        elif collective == "reduce_scatter":
            b = out.size
            out[...] = total[r * b : (r + 1) * b]
        elif collective == "alltoall":
            b = x.size // n
            out[...] = np.concatenate([v[r * b : (r + 1) * b] for v in vals])
        if collective == self.bug and r == cp.ROOT and out.size:
            out[out.size // 2] += 1


def run_threads(world_size: int, body: Callable[[FakeComm], None], bug: str | None = None) -> None:
    world = FakeWorld(world_size)
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            body(FakeComm(world, rank, bug))
        except BaseException as exc:  # re-raised in the test's thread below
            errors.append(exc)
            world.gate.abort()

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "fake peer thread hung"
    if errors:
        raise errors[0]


def fake_peer_main(plan_file: str) -> None:
    """A fake peer's worker (run by the subprocess tests): the real sweep over FakeComm threads."""
    plan = cp.Plan.from_json(Path(plan_file).read_text())
    cp.emit({"type": "meta", "version": "fake 1.0"})
    print("a line that is not a record", flush=True)
    if os.environ.get("FAKE_PEER_HANG"):
        time.sleep(120)
    run_threads(plan.world_size, lambda comm: cp.sweep(comm, plan), bug=os.environ.get("FAKE_PEER_BUG") or None)


def _plan(collective: str, world_size: int, sizes_: tuple[int, ...], iters: int = 3) -> Any:
    """A short plan; min_iteration_s so small that reps is 1 (test_time_calls covers reps)."""
    n = len(sizes_)
    return cp.Plan(collective, world_size, sizes_, (iters,) * n, (1,) * n, min_iteration_s=1e-12)


# --- parsing ------------------------------------------------------------------------------------
def test_parse_bytes() -> None:
    assert cp.parse_bytes("8") == 8
    assert cp.parse_bytes("64K") == 64 << 10
    assert cp.parse_bytes("256M") == 256 << 20
    assert cp.parse_bytes("256MiB") == 256 << 20
    assert cp.parse_bytes("1.5k") == 1536
    assert cp.parse_bytes("2G") == 2 << 30
    for bad in ("", "M", "12Q", "-3"):
        with pytest.raises(Exception, match="not a size"):
            cp.parse_bytes(bad)


def test_parse_args_defaults_and_errors() -> None:
    a = cp.parse_args([])
    assert a.nprocs == [2, 4]
    assert a.collectives == list(cp.COLLECTIVES)
    assert (a.min_bytes, a.max_bytes, a.step_factor) == (8, 256 << 20, 2.0)
    assert a.peers == ["openmpi", "mpich", "gloo"]
    assert a.probe and not a.drop_spells
    a = cp.parse_args(["--no-probe", "--drop-spells"])
    assert not a.probe and a.drop_spells
    a = cp.parse_args(["-n", "3", "-c", "allreduce,alltoall", "-e", "1M", "--peers", "", "--peer-env", "gloo=/x"])
    assert a.nprocs == [3] and a.collectives == ["allreduce", "alltoall"] and a.max_bytes == 1 << 20
    assert a.peers == [] and a.peer_env == {"gloo": Path("/x")}
    for bad in (
        ["-c", "scatter"],
        ["-n", "1"],
        ["-n", "two"],
        ["--peers", "nccl"],
        ["--peer-env", "gloo"],
        ["--mpi-args", "foo=-x"],
        ["-b", "1M", "-e", "1K"],
        ["--iters", "0"],
        ["--timeout", "0"],
    ):
        with pytest.raises(SystemExit):
            cp.parse_args(bad)


def test_plans_follow_bench_sizes_and_the_schedule() -> None:
    args = cp.parse_args(["-n", "2,4", "-b", "8", "-e", "16M", "--large-from", "1M", "--iters", "7"])
    plans = cp.build_plans(args)
    assert len(plans) == 2 * len(cp.COLLECTIVES)
    cfg = BenchConfig(min_bytes=8, max_bytes=16 << 20, step_factor=2.0, dtype="float32")
    for plan in plans:
        assert list(plan.sizes) == sizes(cfg, plan.collective, plan.world_size)
        for size, iters, warmup in zip(plan.sizes, plan.iters, plan.warmup, strict=True):
            assert (iters, warmup) == ((5, 2) if size >= 1 << 20 else (7, 5))
        assert cp.Plan.from_json(plan.to_json()) == plan
    ag4 = next(p for p in plans if p.collective == "alltoall" and p.world_size == 4)
    assert ag4.sizes[0] == 16 and all(s % 16 == 0 for s in ag4.sizes)  # whole float32 blocks per rank


def test_parse_record_ignores_other_output() -> None:
    assert cp.parse_record('[1,0]<stdout>:@@compare_peers {"type": "row", "size": 8}\n') == {"type": "row", "size": 8}
    assert cp.parse_record("Warning: something from the launcher\n") is None
    assert cp.parse_record("@@compare_peers {not json\n") is None
    assert cp.parse_record("@@compare_peers [1, 2]\n") is None


def test_short_version() -> None:
    assert (
        cp.short_version("Open MPI v5.0.11, package: Open MPI user@localhost, ident: 5.0.11\x00") == "Open MPI v5.0.11"
    )
    assert cp.short_version("MPICH Version:      5.0.2\nMPICH Release date: ...") == "MPICH 5.0.2"


# --- the peer-side sweep and its checks ---------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("collective", cp.COLLECTIVES)
def test_sweep_is_exact_with_a_correct_fake_peer(collective: str, world_size: int) -> None:
    cfg = BenchConfig(min_bytes=4, max_bytes=4096, step_factor=8.0, dtype="float32")
    plan = _plan(collective, world_size, tuple(sizes(cfg, collective, world_size)))
    rows: list[dict[str, Any]] = []
    run_threads(world_size, lambda comm: cp.sweep(comm, plan, rows.append))
    assert [r["size"] for r in rows] == list(plan.sizes)
    for r in rows:
        assert r["wrong"] == 0, r
        assert r["time_us"] > 0 and r["p10_us"] <= r["time_us"] <= r["p90_us"]
        assert r["count"] == r["size"] // 4 and r["mode"] == cp.MODES[collective]
        assert r["root"] == (0 if collective in ("broadcast", "reduce") else -1)


@pytest.mark.parametrize("pages", ["small", "huge"])
def test_every_library_can_run_on_chosen_pages(pages: str) -> None:
    """--pages: the peers' buffers come from shmcoll/shm/pages.py (loaded by path, as a peer's
    virtualenv has no shmcoll), the sweep stays exact, and the plan carries the choice to the
    workers."""
    plan = dataclasses.replace(_plan("alltoall", 3, (48, 480)), pages=pages)
    assert cp.Plan.from_json(plan.to_json()).pages == pages
    rows: list[dict[str, Any]] = []
    run_threads(3, lambda comm: cp.sweep(comm, plan, rows.append))
    assert [r["wrong"] for r in rows] == [0, 0]
    case = cp.Case(FakeComm(FakeWorld(1), 0), "allgather", 64, pages=pages)
    assert cp._pages_module().__file__ == str(SCRIPT.parent.parent / "shmcoll" / "shm" / "pages.py")
    if pages == "huge":
        assert case.x.ctypes.data % (2 << 20) == 0 and case.out.ctypes.data % (2 << 20) == 0
    assert cp.parse_args(["--pages", pages]).pages == pages


def test_out_of_place_allreduce_checks_out_and_keeps_x() -> None:
    plan = dataclasses.replace(_plan("allreduce", 3, (48, 480)), out_of_place=True)
    rows: list[dict[str, Any]] = []
    run_threads(3, lambda comm: cp.sweep(comm, plan, rows.append))
    assert [(r["wrong"], r["mode"]) for r in rows] == [(0, "out-of-place")] * 2
    case = cp.Case(FakeComm(FakeWorld(1), 0), "allreduce", 64, out_of_place=True)
    assert case.out is not case.x and case.wrong() == 0
    wrote_x = cp.Case(FakeComm(FakeWorld(1), 0), "allreduce", 64, out_of_place=True)
    wrote_x.comm.call = lambda c, x, out: None  # a peer that leaves out alone is wrong
    assert wrote_x.wrong() == 16


@pytest.mark.parametrize("collective", cp.COLLECTIVES)
def test_sweep_counts_wrong_elements_of_a_wrong_peer(collective: str) -> None:
    plan = _plan(collective, 3, (48, 480))
    rows: list[dict[str, Any]] = []
    run_threads(3, lambda comm: cp.sweep(comm, plan, rows.append), bug=collective)
    assert [r["wrong"] for r in rows] == [1, 1]


def test_broadcast_that_never_arrives_is_wrong() -> None:
    class Lazy(FakeComm):
        def call(self, collective: str, x: np.ndarray, out: np.ndarray) -> None:
            self._exchange(None)

    world = FakeWorld(1)
    case = cp.Case(Lazy(world, 0), "broadcast", 64)
    assert case.wrong() == 0  # one rank: the root already holds the answer
    world2 = FakeWorld(2)
    got: list[int] = []
    run_threads(2, lambda comm: got.append(cp.Case(Lazy(world2, comm.rank), "broadcast", 64).wrong()))
    assert sorted(got) == [0, 16]


def test_time_calls_follows_the_bench_rule() -> None:
    calls = [0]

    def quick() -> None:
        calls[0] += 1

    def slow() -> None:
        calls[0] += 1
        time.sleep(0.002)

    comm = FakeComm(FakeWorld(1), 0)
    med, p10, p90 = cp.time_calls(comm, quick, iters=4, warmup=3, min_iteration_s=1.0)
    batches = 2 * sum(min(2**i, cp.MAX_REPS) for i in range(11))  # 1, 2, 4 ... 512, 1000 calls, twice
    assert calls[0] == 3 + batches + 4 * cp.MAX_REPS  # a call far below the minimum: reps capped at 1000
    assert 0 < p10 <= med <= p90
    calls[0] = 0
    med, _, _ = cp.time_calls(comm, slow, iters=4, warmup=2, min_iteration_s=20e-6)
    assert calls[0] == 2 + 2 + 4  # a call above the minimum: one per iteration
    assert med >= 0.002


def _calibrate(monkeypatch, module, first: float, then: float, target: float) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """``module.calls_per_iteration`` on a clock where the first call takes ``first`` seconds and
    every later one ``then``: (reps, calls made)."""
    clock = [0.0]
    made = [0]

    def run() -> None:
        clock[0] += first if made[0] == 0 else then
        made[0] += 1

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    try:
        return module.calls_per_iteration(run, lambda: None, lambda t: t, target), made[0]
    finally:
        monkeypatch.undo()


def test_calls_per_iteration_is_shmcoll_benchs(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The peers' copy of the calibration rule picks what shmcoll.bench's picks, call for call."""
    from shmcoll import bench

    for first, then, target in [(1e-7, 1e-7, 2e-3), (1.4e-3, 1e-6, 2e-3), (3e-5, 3e-5, 20e-6), (0.01, 0.01, 2e-3)]:
        ours = _calibrate(monkeypatch, bench, first, then, target)
        assert _calibrate(monkeypatch, cp, first, then, target) == ours, (first, then, target)


# --- comparison, ratios, output -----------------------------------------------------------------
def _row(collective: str, world: int, size: int, time_us: float, wrong: int = 0) -> Row:
    algbw = size / (time_us * 1e-6) / 1e9
    return Row(
        collective,
        "auto",
        world,
        size,
        size // 4,
        "float32",
        "sum",
        -1,
        "in-place",
        time_us,
        algbw,
        algbw * bus_factor(collective, world),
        wrong,
        time_us * 0.9,
        time_us * 1.1,
    )


def _comparison() -> Any:
    M = cp.Measurement
    ms = [
        # shmcoll: two rounds at 8 B (median 20), one at 1 MiB
        M("shmcoll", 0, _row("allreduce", 2, 8, 10.0)),
        M("shmcoll", 1, _row("allreduce", 2, 8, 30.0)),
        M("shmcoll", 0, _row("allreduce", 2, 1 << 20, 100.0)),
        M("openmpi", 0, _row("allreduce", 2, 8, 40.0)),
        M("openmpi", 0, _row("allreduce", 2, 1 << 20, 50.0)),
        M("mpich", 0, _row("allreduce", 2, 8, 5.0, wrong=3)),  # fastest but wrong
        M("mpich", 0, _row("allreduce", 2, 1 << 20, 400.0)),
        M("shmcoll", 0, _row("alltoall", 4, 64, 8.0)),
        M("gloo", 0, _row("alltoall", 4, 64, 80.0)),
    ]
    runs = [
        {"library": "gloo", "world_size": 0, "collective": "*", "round": 0, "status": "not installed"}
        | {"detail": "not installed (/nowhere/bin/python not found)", "seconds": 0.0},
        {"library": "openmpi", "world_size": 4, "collective": "alltoall", "round": 0, "status": "timed out"}
        | {"detail": "no result for 600 s", "seconds": 601.0},
    ]
    meta = {"date": "2026-01-01 00:00 UTC", "command": "python benchmarks/compare_peers.py", "cpu": "Test CPU"}
    meta |= {"cores": "2 (2 usable)", "kernel": "6.0", "python": "3.11", "numpy": "2.0", "numba": "0.60"}
    meta["libraries"] = {"openmpi": {"version": "Open MPI v5.0.11", "mpi4py": "4.1.2", "launch": "mpirun -n N"}}
    return cp.Comparison(["shmcoll", "openmpi", "mpich", "gloo"], ms, runs, meta)


def test_ratios_best_peer_and_geomeans() -> None:
    tables = cp.compare(_comparison())
    assert list(tables) == [("allreduce", 2), ("alltoall", 4)]
    small, large = tables[("allreduce", 2)]
    assert small.cells["shmcoll"].time_us == 20.0  # median over rounds
    assert small.ratios == {"openmpi": 2.0, "mpich": 0.25}
    assert small.best == "openmpi"  # mpich is faster but wrong
    assert large.ratios == {"openmpi": 0.5, "mpich": 4.0} and large.best == "openmpi"
    assert "gloo" not in small.cells and "gloo" not in small.ratios
    g, gs, gl = cp.geomeans(tables[("allreduce", 2)], "openmpi")
    assert g == pytest.approx(1.0) and gs == pytest.approx(2.0) and gl == pytest.approx(0.5)
    assert cp.geomeans(tables[("allreduce", 2)], "mpich") == (pytest.approx(4.0), None, pytest.approx(4.0))
    (only,) = tables[("alltoall", 4)]
    assert only.ratios == {"gloo": 10.0} and only.best == "gloo"
    assert only.cells["gloo"].busbw == pytest.approx(64 / 80e-6 / 1e9 * 3 / 4)


def test_paired_ratios_set_each_round_against_its_own() -> None:
    # The full side-by-side of stop 35: shmcoll's round 0 fell in a slow spell, the peer's round 2.
    M = cp.Measurement
    ms = [M("shmcoll", k, _row("alltoall", 2, 512, t)) for k, t in enumerate((7.0, 0.93, 1.59))]
    ms += [M("openmpi", k, _row("alltoall", 2, 512, t)) for k, t in enumerate((0.90, 0.94, 1.43))]
    ms += [M("shmcoll", 0, _row("alltoall", 2, 1024, 2.0)), M("openmpi", 0, _row("alltoall", 2, 1024, 1.0))]
    comp = cp.Comparison(["shmcoll", "openmpi"], ms, [], {})
    line, single = cp.compare(comp)[("alltoall", 2)]
    assert line.ratios["openmpi"] == pytest.approx(0.94 / 1.59)  # the medians: two different rounds
    ratio, rounds = line.paired["openmpi"]
    assert rounds == 3 and ratio == pytest.approx(1.43 / 1.59)  # the median of 0.13, 1.01, 0.90
    assert single.paired == {"openmpi": (0.5, 1)}
    md = cp.format_markdown(comp)
    assert "| 512 B | 1.59 | 0.94 | 0.59 | openmpi (0.59; paired 0.90) |" in md
    assert "| 1 KiB | 2.00 | 1.00 | 0.50 | openmpi (0.50) |" in md  # one round: nothing to pair
    assert cp.slower_points(comp) == [
        "alltoall, 2 ranks, 512 B: openmpi 0.59 (paired over 3 rounds: 0.90)",
        "alltoall, 2 ranks, 1 KiB: openmpi 0.50",
    ]
    assert "## Where the best peer is faster (ratio < 1)" in md
    assert "(paired 0.90)" in cp.format_text(comp)


def test_what_auto_ran_per_round_is_reported() -> None:
    """The launch's race and auto's pick per size, from rank 0's log lines as the communicator
    writes them: one line where the rounds chose alike, one per round and the sizes that differ
    where not (stop 35's slow rounds could not be told from the machine's noise without it)."""
    M = cp.Measurement
    sizes = (8, 64 << 10, 1 << 20)
    ms = [M("shmcoll", k, _row("allreduce", 2, s, 1.0)) for k in range(2) for s in sizes]
    ms += [M("shmcoll", 0, _row("alltoall", 4, 1 << 20, 9.0))]
    rings = "[rank 0] cross-memory attach: two cores exchange blocks of up to 4M faster through the rings (auto ...)"
    kernel = (
        "[rank 0] cross-memory attach: two cores exchange blocks from 16K on no slower by the kernel than "
        "through the rings (auto weighs cma for blocks from there)"
    )

    def call(collective: str, count: int, algorithm: str, dtype: str = "float32") -> str:
        label = f"{collective}(count={count}, {dtype}, SUM, algorithm={algorithm})"
        return f"[rank 0] {label}: algorithm {algorithm}, 1 piece(s) of 65536 + tail 0, 0 scratch elements"

    internal = call("allreduce", 1, "ring", dtype="float64")  # bench's own MAX of the times: not a measured size
    runs = [
        {"library": "shmcoll", "world_size": 2, "collective": "allreduce", "round": 0, "status": "ok"}
        | {"auto": [rings, internal, call("allreduce", 2, "direct"), call("allreduce", 16384, "ring")]},
        {"library": "shmcoll", "world_size": 2, "collective": "allreduce", "round": 1, "status": "ok"}
        | {
            "auto": [
                kernel,
                call("allreduce", 2, "direct"),
                call("allreduce", 16384, "cma"),
                call("allreduce", 262144, "cma"),
            ]
        },
        {"library": "shmcoll", "world_size": 4, "collective": "alltoall", "round": 0, "status": "ok"}
        | {"auto": [rings, call("alltoall", 65536, "direct")]},  # per block: 4 x 64 Ki x 4 B = 1 MiB
        {"library": "openmpi", "world_size": 2, "collective": "allreduce", "round": 0, "status": "ok"},
    ]
    comp = cp.Comparison(["shmcoll"], ms, runs, {})
    assert cp.auto_choices(comp) == [
        "allreduce, 2 ranks, rounds differ at 64 KiB, 1 MiB:",
        "  round 1: race: the rings won up to 4M; 8 B direct, 64 KiB ring",
        "  round 2: race: the kernel won from 16K; 8 B direct, 64 KiB-1 MiB cma",
        "alltoall, 4 ranks (round): race: the rings won up to 4M; 1 MiB direct",
    ]
    md = cp.format_markdown(comp)
    assert "## What `auto` ran in shmcoll's launches" in md
    assert "  - round 2: race: the kernel won from 16K; 8 B direct, 64 KiB-1 MiB cma" in md
    assert "#   alltoall, 4 ranks (round): race: the rings won up to 4M; 1 MiB direct" in cp.format_text(comp)
    runs[2]["auto"] = []  # a run from before the log was kept says nothing
    assert cp.auto_choices(cp.Comparison(["shmcoll"], ms, runs[2:], {})) == []


def test_what_auto_ran_follows_the_pages_the_ranks_agreed_on() -> None:
    """A call shape whose choice hinges on pages builds two plans and logs both; the plan the ranks
    agreed on (``comm/pages.py``'s line, when it changes) is the one reported."""
    M = cp.Measurement
    ms = [M("shmcoll", 0, _row("allgather", 2, s, 1.0)) for s in (2 << 20, 4 << 20)]
    rings = "[rank 0] cross-memory attach: two cores exchange blocks of up to 4M faster through the rings (auto ...)"

    def built(count: int, algorithm: str) -> str:
        return f"[rank 0] allgather(count={count}, float32, algorithm={algorithm}): algorithm {algorithm}, 1 piece(s)"

    def agreed(count: int, every: bool, algorithm: str) -> str:
        label = f"allgather(count={count}, float32, algorithm=direct)"
        said = f"{'' if every else 'not '}every rank's buffers are on huge pages"
        return f"[rank 0] {label}: pages: {said}: algorithm {algorithm}"

    lines = [rings, built(262144, "direct"), built(262144, "cma"), agreed(262144, False, "direct")]
    lines += [built(524288, "direct"), built(524288, "cma"), agreed(524288, True, "cma")]
    run = {"library": "shmcoll", "world_size": 2, "collective": "allgather", "round": 0, "status": "ok", "auto": lines}
    assert cp.auto_choices(cp.Comparison(["shmcoll"], ms, [run], {})) == [
        "allgather, 2 ranks (round): race: the rings won up to 4M; 2 MiB direct, 4 MiB cma"
    ]
    assert all(cp._PAGES_LINE.search(ln) for ln in (lines[3], lines[6]))
    assert not cp._CALL_LINE.search(lines[3])


def test_what_auto_ran_says_where_the_shape_was_timed() -> None:
    """A timed call shape (``comm/timed.py``) builds two plans and logs both, then says when the
    ranks' plan changes: the report names the plan that ran last and what it was timed against."""
    M = cp.Measurement
    ms = [M("shmcoll", 0, _row("reduce", 2, s, 1.0)) for s in (1 << 20, 2 << 20, 4 << 20)]
    label = "reduce(count={}, float32, SUM, root=0, algorithm={})"

    def built(count: int, algorithm: str) -> str:
        return f"[rank 0] {label.format(count, algorithm)}: algorithm {algorithm}, 1 piece(s) of 16384 + tail 0"

    def timed(count: int) -> str:
        return f"[rank 0] {label.format(count, 'direct')}: timed choice between it and cma, by what rank 0's calls take"

    def agreed(count: int, every: bool) -> str:
        said = f"{'' if every else 'not '}every rank voted for cma: algorithm {'cma' if every else 'direct'}"
        estimates = "(call 9; estimates 120.0 us for its own plan, 0.0 for cma)"
        return f"[rank 0] {label.format(count, 'direct')}: timed: {said} {estimates}"

    lines = [built(262144, "direct"), built(262144, "cma"), timed(262144), agreed(262144, True), agreed(262144, False)]
    lines += [built(524288, "direct"), built(524288, "cma"), timed(524288), agreed(524288, True)]
    lines += [built(1048576, "direct"), built(1048576, "cma"), timed(1048576)]
    run = {"library": "shmcoll", "world_size": 2, "collective": "reduce", "round": 0, "status": "ok", "auto": lines}
    assert cp.auto_choices(cp.Comparison(["shmcoll"], ms, [run], {})) == [
        "reduce, 2 ranks (round): race: -; 1 MiB direct (timed against cma), 2 MiB cma (timed against direct), "
        "4 MiB direct (timed against cma)"
    ]


def test_text_table() -> None:
    text = cp.format_text(_comparison())
    lines = text.splitlines()
    assert lines[0] == "# allreduce, 2 ranks (float32 sum, in-place)"
    head = next(ln for ln in lines if "size" in ln and "shmcoll" in ln)
    assert head.split() == [
        "#",
        "size",
        "shmcoll",
        "openmpi",
        "mpich",
        "gloo",
        "openmpi",
        "mpich",
        "gloo",
        "best",
        "peer",
    ]
    row8 = next(ln for ln in lines if ln.split() and ln.split()[0] == "8")
    assert row8.split() == ["8", "20.00", "40.00", "5.00!", "-", "2.00", "0.25", "-", "openmpi", "2.00"]
    assert "# WRONG RESULTS (marked !): mpich at 8 B" in text
    assert "openmpi 1.00 (<= 64 KiB 2.00, > 64 KiB 0.50)" in text
    assert "# gloo: not installed (/nowhere/bin/python not found)" in text
    assert "# openmpi, alltoall, 4 ranks, round 0: timed out after 601 s (no result for 600 s)" in text


def test_markdown_report() -> None:
    md = cp.format_markdown(_comparison())
    assert md.startswith("# shmcoll vs mpi4py (Open MPI, MPICH) and torch.distributed gloo")
    assert "| CPU | Test CPU |" in md and "| numba | 0.60 |" in md
    assert "| openmpi | Open MPI v5.0.11, mpi4py 4.1.2; mpirun -n N |" in md
    assert "## allreduce, 2 ranks (float32 sum, in-place)" in md
    header = "| size | shmcoll (us) | openmpi (us) | mpich (us) | gloo (us) | openmpi / shmcoll | mpich / shmcoll "
    assert header + "| gloo / shmcoll | best peer |" in md
    assert "| 8 B | 20.00 | 40.00 | 5.00! | - | 2.00 | 0.25 | - | openmpi (2.00) |" in md
    assert "| 1 MiB | 100.00 | 50.00 | 400.00 | - | 0.50 | 4.00 | - | openmpi (0.50) |" in md
    assert "> 1 means shmcoll is faster" in md
    assert "- gloo: not installed" in md
    for table in md.split("\n## ")[1:]:
        rows = [ln for ln in table.splitlines() if ln.startswith("|")]
        assert len({ln.count("|") for ln in rows}) <= 1, table  # every row has the header's columns


def test_json_roundtrip_and_report_from_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    comp = _comparison()
    path = tmp_path / "run.json"
    cp.write_json(comp, path)
    data = json.loads(path.read_text())
    assert {"library", "round", "collective", "size", "time_us", "busbw", "wrong", "p10_us"} <= set(data["rows"][0])
    again = cp.load_json([path])
    assert again.libraries == comp.libraries and again.runs == comp.runs
    assert [(m.library, m.round, m.row) for m in again.measurements] == [
        (m.library, m.round, m.row) for m in comp.measurements
    ]
    md = tmp_path / "r.md"
    assert cp.main(["--from-json", str(path), "--markdown", str(md)]) == 0
    assert capsys.readouterr().out.strip() == cp.format_text(comp)
    assert md.read_text() == cp.format_markdown(comp)
    # shmcoll's own wrong results make the exit status 1
    comp.measurements.append(cp.Measurement("shmcoll", 0, _row("allreduce", 2, 64, 1.0, wrong=1)))
    cp.write_json(comp, path)
    assert cp.main(["--from-json", str(path), "--quiet"]) == 1


def test_two_json_files_merge(tmp_path: Path) -> None:
    comp = _comparison()
    first = cp.Comparison(comp.libraries[:2], comp.measurements[:5], [], comp.meta)
    second = cp.Comparison(["shmcoll", "gloo"], comp.measurements[7:], comp.runs[:1], {"libraries": {"gloo": {}}})
    cp.write_json(first, tmp_path / "a.json")
    cp.write_json(second, tmp_path / "b.json")
    merged = cp.load_json([tmp_path / "a.json", tmp_path / "b.json"])
    assert merged.libraries == ["shmcoll", "openmpi", "gloo"]
    assert len(merged.measurements) == 7 and merged.meta["cpu"] == "Test CPU"
    assert set(merged.meta["libraries"]) == {"openmpi", "gloo"}
    assert [m.round for m in merged.measurements] == [0, 1, 0, 0, 0, 2, 2]  # b.json's rounds follow a.json's
    assert [src["path"] for src in merged.meta["sources"]] == [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    md = cp.format_markdown(merged)
    assert "Merged from 2 runs:" in md and "- Measured 2026-01-01 00:00 UTC" in md
    assert "3 round(s), median over rounds" not in md  # no schedule in these files, so no such line


def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    cp.plot(_comparison(), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- subprocesses: a fake peer, deadlines, missing peers ----------------------------------------
class FakePeer(cp.Peer):
    """Runs ``fake_peer_main`` of this file in a subprocess."""

    def __init__(self, name: str, **env: str) -> None:
        super().__init__(name)
        self.extra_env = env

    def command(self, plan_file: str, world_size: int) -> list[str]:
        code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_compare_peers as t; "
        code += "t.fake_peer_main(sys.argv[1])"
        return [sys.executable, "-c", code, plan_file]

    def env(self) -> dict[str, str]:
        return {**super().env(), **self.extra_env}


def _write_plan(tmp_path: Path, plan: Any) -> str:
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    return str(path)


def test_launch_streams_records_from_a_fake_peer(tmp_path: Path) -> None:
    plan_file = _write_plan(tmp_path, _plan("allgather", 2, (16, 160)))
    peer = FakePeer("fake")
    seen: list[dict[str, Any]] = []
    res = cp.launch(peer.command(plan_file, 2), peer.env(), timeout_s=120, stall_s=60, on_record=seen.append)
    assert res.status == "ok", res.detail
    assert [r["type"] for r in res.records] == ["meta", "row", "row"] and seen == res.records
    assert [r["size"] for r in res.records[1:]] == [16, 160]


def test_launch_stall_kills_the_group_and_keeps_records(tmp_path: Path) -> None:
    plan_file = _write_plan(tmp_path, _plan("allgather", 2, (16,)))
    peer = FakePeer("fake", FAKE_PEER_HANG="1")
    t0 = time.monotonic()
    res = cp.launch(peer.command(plan_file, 2), peer.env(), timeout_s=60, stall_s=3)
    assert time.monotonic() - t0 < 40
    assert res.status == "timed out" and "no result for 3 s" in res.detail
    assert [r["type"] for r in res.records] == ["meta"]


def test_launch_reports_failures() -> None:
    res = cp.launch([sys.executable, "-c", "import sys; sys.stderr.write('boom\\n'); sys.exit(3)"], None, 30, 30)
    assert res.status == "failed" and res.detail == "exit code 3: boom"
    res = cp.launch(["/nonexistent/mpirun", "-n", "2"], None, 30, 30)
    assert res.status == "failed" and "could not start" in res.detail
    res = cp.launch([sys.executable, "-c", "import time; time.sleep(30)"], None, 2, 30)
    assert res.status == "timed out" and "deadline" in res.detail


def test_missing_peers_are_reported() -> None:
    peers = cp.default_peers(["openmpi", "mpich", "gloo"], Path("/nonexistent/peers"), {}, {"mpich": "-v"})
    assert [p.name for p in peers] == ["openmpi", "mpich", "gloo"]
    assert all("not installed" in (p.missing() or "") for p in peers)
    assert peers[1].command("plan.json", 4)[:5] == [
        "/nonexistent/peers/mpich/bin/mpiexec",
        "-n",
        "4",
        "-launcher",
        "fork",
    ]
    assert "-v" in peers[1].command("plan.json", 4)
    ompi = peers[0].command("plan.json", 1)
    assert ompi[ompi.index("btl") + 1] == "self,sm" and "--oversubscribe" not in ompi
    assert "--oversubscribe" in peers[0].command("plan.json", len(os.sched_getaffinity(0)) + 1)
    assert peers[2].command("plan.json", 2)[0] == "/nonexistent/peers/torch/bin/python"


def test_run_comparison_with_fake_wrong_and_missing_peers(tmp_path: Path) -> None:
    args = cp.parse_args(["-n", "2", "-c", "reduce_scatter,broadcast", "-b", "8", "-e", "512", "-f", "8"])
    args.iters, args.warmup, args.json = 2, 1, str(tmp_path / "out.json")
    peers = [
        FakePeer("shmcoll"),
        FakePeer("openmpi", FAKE_PEER_BUG="broadcast"),
        *cp.default_peers(["gloo"], tmp_path / "none", {}, {}),
    ]
    logs: list[str] = []
    comp = cp.run_comparison(args, peers, logs.append)
    assert any("gloo: not installed" in line for line in logs)
    assert {(r["library"], r["status"]) for r in comp.runs} == {
        ("gloo", "not installed"),
        ("shmcoll", "ok"),
        ("openmpi", "ok"),
    }
    tables = cp.compare(comp)
    assert set(tables) == {("reduce_scatter", 2), ("broadcast", 2)}
    for (collective, _), lines in tables.items():
        assert [ln.size for ln in lines] == [8, 64, 512]
        for ln in lines:
            assert set(ln.cells) == {"shmcoll", "openmpi"} and set(ln.ratios) == {"openmpi"}
            assert ln.cells["shmcoll"].wrong == 0
            assert ln.cells["openmpi"].wrong == (1 if collective == "broadcast" else 0)
            assert ln.best == (None if collective == "broadcast" else "openmpi")
    assert comp.meta["libraries"]["openmpi"]["version"] == "fake 1.0"
    assert len(cp.load_json([args.json]).measurements) == len(comp.measurements) == 12
    # every launch was probed before and after, and the probes are in the JSON
    ran = [r for r in comp.runs if r["status"] == "ok"]
    if len(os.sched_getaffinity(0)) < 2:  # (no two CPUs to hand data between: no probe)
        assert ran and not any("probe" in r for r in ran)
        return
    assert ran and all(set(r["probe"]) == {"before", "after"} for r in ran)
    assert [r.get("probe") for r in cp.load_json([args.json]).runs if r["status"] == "ok"] == [r["probe"] for r in ran]


def test_real_shmcoll_worker_with_no_peers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    argv = ["-n", "2", "-c", "allreduce", "-b", "8", "-e", "512", "-f", "8", "--iters", "2", "--warmup", "1"]
    assert cp.main([*argv, "--peers", "", "--quiet", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# allreduce, 2 ranks (float32 sum, in-place)")
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["library"], r["size"], r["wrong"], r["mode"]) for r in rows] == [
        ("shmcoll", s, 0, "in-place") for s in (8, 64, 512)
    ]
    # rank 0's log of auto, read from the communicator's own lines: a pick for every size
    (choice,) = cp.auto_choices(cp.load_json([out]))
    assert choice.startswith("allreduce, 2 ranks (round): race: ")
    from shmcoll.shm import cma

    if cma.probe()[0]:  # (where the kernel's copy is refused, no race is run)
        assert re.search(r"race: the (rings|kernel) won (up to|from) \w+;", choice), choice
    assert re.search(r"; 8 B-512 B \w+$|; 8 B \w+, ", choice), choice


def test_auto_log_keeps_info_and_shows_only_warnings(capfd: pytest.CaptureFixture[str]) -> None:
    """A logger with no handler of its own (no SHMCOLL_DEBUG): the INFO lines about auto are kept,
    not shown, and a warning is still shown on stderr."""
    import logging

    logger = logging.getLogger("shmcoll-compare-test")
    watch = cp._AutoLog(logger)
    try:
        call = "[rank 0] allreduce(count=2, float32, SUM, algorithm=direct): algorithm direct, 1 piece(s)"
        logger.info(call)
        logger.info("[rank 0] connected: world_size=2")  # not about auto: not kept
        logger.warning("[rank 0] a warning")
        assert watch.lines == [call]
        err = capfd.readouterr().err
        assert "shmcoll INFO" not in err and "connected" not in err  # the log was kept, not shown
        assert "shmcoll WARNING [rank 0] a warning" in err
        watch.send()
        assert cp.parse_record(capfd.readouterr().out) == {"type": "auto", "line": call}
        assert watch.lines == []
    finally:
        for h in list(logger.handlers):
            logger.removeHandler(h)


# --- the spell probe ----------------------------------------------------------------------------
def test_handoff_probe_times_both_sizes() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        assert cp.handoff_probe() is None
        return
    probe = cp.handoff_probe()
    assert probe is not None and set(probe) == set(cp.PROBE_SIZES)
    assert 0 < probe["64 B"] < probe["64 KiB"] < 10_000  # us: a round moves the bytes twice


def _probed(slow: set[tuple[str, int]]) -> Any:
    """Three rounds of one size, shmcoll and openmpi; the launches in ``slow`` (library, round) had
    a probe 3x the others' before or after them, the others 1.1x or less."""
    M = cp.Measurement
    ms = [M("shmcoll", k, _row("broadcast", 2, 8, t)) for k, t in enumerate((1.0, 5.0, 1.1))]
    ms += [M("openmpi", k, _row("broadcast", 2, 8, t)) for k, t in enumerate((1.2, 1.3, 1.0))]
    runs = []
    for lib in ("shmcoll", "openmpi"):
        for k in range(3):
            fast = {"64 B": 0.12 + 0.01 * k, "64 KiB": 10.0}
            late = {"64 B": 0.36, "64 KiB": 10.5} if (lib, k) in slow else fast
            run = {"library": lib, "world_size": 2, "collective": "broadcast", "round": k, "status": "ok"}
            runs.append(run | {"detail": "", "seconds": 1.0, "probe": {"before": fast, "after": late}})
    return cp.Comparison(["shmcoll", "openmpi"], ms, runs, {})


def test_spells_name_the_launches_whose_probe_was_slow() -> None:
    comp = _probed({("shmcoll", 1)})
    slow = cp.spells(comp)
    assert list(slow) == [("shmcoll", "broadcast", 2, 1)]
    assert slow[("shmcoll", "broadcast", 2, 1)] == "hand-off 64 B 0.36 us (median 0.13)"
    assert cp.spells(comp, factor=3.0) == {}  # (0.36 is under 3x the median of 0.13)
    # shmcoll's median is its slow round's 1.1 against openmpi's 1.2; shown beside the spell
    (line,) = cp.compare(comp)[("broadcast", 2)]
    assert line.ratios["openmpi"] == pytest.approx(1.2 / 1.1)
    text, md = cp.format_text(comp), cp.format_markdown(comp)
    assert "#   shmcoll, broadcast, 2 ranks, round 2: hand-off 64 B 0.36 us (median 0.13)" in text
    assert "## Launches in a slow spell" in md
    assert "- shmcoll, broadcast, 2 ranks, round 2: hand-off 64 B 0.36 us (median 0.13)" in md
    # no probes (an older JSON, --no-probe): no spells, nothing said
    bare = dataclasses.replace(comp, runs=[{k: v for k, v in r.items() if k != "probe"} for r in comp.runs])
    assert cp.spells(bare) == {} and "slow spell" not in cp.format_text(bare) + cp.format_markdown(bare)


def test_slower_points_say_which_launches_were_in_a_spell() -> None:
    comp = _probed({("shmcoll", 1), ("openmpi", 2)})
    comp.measurements[1] = cp.Measurement("shmcoll", 1, _row("broadcast", 2, 8, 5.0))
    comp.measurements[2] = cp.Measurement("shmcoll", 2, _row("broadcast", 2, 8, 1.5))  # median 1.5
    (point,) = cp.slower_points(comp)
    assert point == (
        "broadcast, 2 ranks, 8 B: openmpi 0.80 (paired over 3 rounds: 0.67); in a slow spell: "
        "openmpi round 3, shmcoll round 2"
    )


def test_drop_spells_leaves_those_launches_out_of_the_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    comp = _probed({("shmcoll", 1)})
    kept = cp.without_spells(comp)
    assert len(kept.measurements) == 5 and all((m.library, m.round) != ("shmcoll", 1) for m in kept.measurements)
    (line,) = cp.compare(kept)[("broadcast", 2)]
    assert line.cells["shmcoll"].time_us == pytest.approx(1.05)  # the median of rounds 1 and 3
    assert line.paired["openmpi"][1] == 2  # the dropped round pairs with nothing
    md = cp.format_markdown(kept)
    assert "- left out of the tables: shmcoll, broadcast, 2 ranks, round 2: hand-off 64 B 0.36 us" in md
    assert comp.measurements and len(comp.measurements) == 6  # the original is untouched
    # from the command line, on a saved run
    path = tmp_path / "run.json"
    cp.write_json(comp, path)
    assert cp.main(["--from-json", str(path), "--drop-spells"]) == 0
    assert "left out of the tables: shmcoll, broadcast, 2 ranks, round 2" in capsys.readouterr().out
