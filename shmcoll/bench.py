"""The sweep engine behind ``shmcoll bench``: timing, checking and the nccl-tests table.

Timing rule: each timed iteration runs ``reps`` back-to-back calls after a barrier (``reps`` is
chosen by :func:`calls_per_iteration` so an iteration lasts at least ~20 us, 2 ms when ranks
outnumber cores, so tiny messages are not dominated by the barrier's exit skew); a rank's time
per call is the iteration's time divided by ``reps``; the reported time is the **median over
iterations of the slowest rank's time** (p10/p90 too, for ``--stats``). Bandwidths follow
nccl-tests: ``algbw = size / time`` and ``busbw = algbw * factor`` with factor ``2(n-1)/n`` for
allreduce, ``(n-1)/n`` for allgather, reduce_scatter, alltoall, gather and scatter, and 1 for
broadcast and reduce. ``size`` is the largest per-rank
buffer of the call (allgather's output, reduce_scatter's input), as in nccl-tests. When several
algorithms are benched, they share one size's buffers and take turns in rounds (see
:func:`_time_point`), so they are compared on the same stretch of the machine's time.

Checking: inputs are a pattern whose result every rank can compute exactly by itself, so after
the timed iterations each rank runs the collective once more on fresh inputs and counts the
elements that differ (``#wrong``, summed over ranks).

Streaming: :func:`run` has rank 0 send each point's rows to the launching process as soon as
they are measured (a pipe, read by a thread), so the caller can print them at once
(:class:`Table` prints nccl-tests' table a line at a time), show progress and an ETA
(:class:`Progress`), and keep what was measured when the user presses Ctrl-C
(:class:`Interrupted`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from shmcoll import collectives
from shmcoll.algos import registry
from shmcoll.algos.registry import Query
from shmcoll.collectives import COLLECTIVES, InPlace
from shmcoll.kernels.cpu import narrow_bfloat16
from shmcoll.shm import cma
from shmcoll.shm import pages as page_backing
from shmcoll.types import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    FOLD_UFUNC,
    ReduceOp,
    as_dtype,
    dtype_str,
    engine_types,
    identity,
    supports,
)

BENCH_COLLECTIVES = COLLECTIVES
MIN_ITERATION_S = 20e-6
# Ranks that outnumber the cores leave a barrier at times a scheduler slice apart (a rank that was
# switched out runs again only when another yields): an iteration must be long enough to average
# that out, or it measures the barrier's exit rather than the calls (4 ranks on 2 cores, 8 B
# broadcast: 12.6 us per call with 20 us iterations, 3.0 us with 2 ms ones and in a plain loop).
MIN_ITERATION_OVERSUBSCRIBED_S = 2e-3
MAX_REPS = 1000  # calls per timed iteration at most


def min_iteration_s(world_size: int) -> float:
    """How long a timed iteration lasts at least, for ``world_size`` ranks on this machine."""
    return MIN_ITERATION_OVERSUBSCRIBED_S if world_size > len(os.sched_getaffinity(0)) else MIN_ITERATION_S


def calls_per_iteration(
    run: Callable[[], Any], barrier: Callable[[], Any], slowest: Callable[[float], float], target_s: float
) -> int:
    """How many calls of ``run`` a timed iteration makes so it lasts ``target_s``: the same on every
    rank (``slowest`` gives the largest of the ranks' values, ``barrier`` lines them up).

    Batches of 1, 2, 4... calls, each timed after as many untimed calls following a barrier,
    until two batches in a row last a quarter of the target on the slowest rank (or one lasts
    ten targets); the faster of the two sets the count. One call is no estimate where ranks
    outnumber cores: a rank switched out for a scheduler slice made one 8-byte broadcast at 4
    ranks take 1.4 ms and an 8-byte allreduce 2.6 ms, which made 1- and 2-call iterations that
    timed the barrier again (14-23 us per call, against 1.6 and 6.6 us at the next size).
    """
    k = 1
    confirmed = 0.0  # the per-call time of the last batch that lasted target_s / 4, or 0
    while True:
        barrier()
        for _ in range(k):  # untimed: the ranks leave a barrier apart, and the first call waits for that
            run()
        t0 = time.perf_counter()
        for _ in range(k):
            run()
        took = slowest(time.perf_counter() - t0)
        per_call = max(took, 1e-12) / k
        if took >= 10 * target_s or k >= MAX_REPS:  # (no scheduler slice is that long)
            return int(min(max(math.ceil(target_s / per_call), 1), MAX_REPS))
        if took >= target_s / 4:
            if confirmed:  # two long batches in a row: one slowed by a slice is not believed alone
                return int(min(max(math.ceil(target_s / min(confirmed, per_call)), 1), MAX_REPS))
            confirmed = per_call
        else:
            confirmed = 0.0
        k = min(2 * k, MAX_REPS)


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus bandwidth factor."""
    return collectives.get(collective).bus_factor(world_size)


def default_nprocs() -> int:
    return max(2, min(4, len(os.sched_getaffinity(0))))


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    collectives: tuple[str, ...] = ("allreduce",)
    algorithms: tuple[str, ...] = ("auto",)
    nprocs: int = 2
    min_bytes: int = 8
    max_bytes: int = 64 << 20
    step_factor: float = 2.0
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0
    iters: int = 20
    warmup: int = 5
    check: bool = True
    modes: tuple[str, ...] = ("out-of-place", "in-place")
    registered: bool = False
    pages: str = "numpy"  # what backs ordinary buffers: shm.pages.PAGES (cross-memory attach depends on it)
    inject_error: bool = False
    progress: bool = True  # a progress line on stderr while :func:`run` runs (a terminal only)
    settle_s: float = 0.3  # untimed collectives first, so the scheduler has spread the ranks
    rounds: int = 5  # the iterations of the algorithms of one size take turns in this many rounds


@dataclasses.dataclass
class Row:
    collective: str
    algorithm: str
    world_size: int
    size: int
    count: int
    dtype: str
    op: str
    root: int
    mode: str
    time_us: float
    algbw: float
    busbw: float
    wrong: int
    p10_us: float
    p90_us: float


def sizes(cfg: BenchConfig, collective: str, world_size: int) -> list[int]:
    """The byte sizes of the sweep: min, min*f, ... up to max; rounded so every rank gets whole
    elements (blocked collectives need a multiple of world_size elements)."""
    itemsize = as_dtype(cfg.dtype).itemsize
    unit = itemsize * (world_size if collectives.get(collective).blocked else 1)
    out: list[int] = []
    size = float(max(cfg.min_bytes, 1))
    while size <= cfg.max_bytes * 1.0000001:
        nbytes = max(unit, int(size) // unit * unit)
        if not out or nbytes != out[-1]:
            out.append(nbytes)
        if cfg.step_factor <= 1:
            break
        size *= cfg.step_factor
    return out


def algorithms_for(cfg: BenchConfig, collective: str, world_size: int, inplace: bool = False) -> list[str]:
    """The algorithms ``cfg`` asks for that can serve ``collective`` (``all``: every registered one)."""
    names: list[str] = []
    for name in cfg.algorithms:
        if name == "all":
            for alg in registry.algorithms(collective):
                if (
                    alg.name == "zerocopy"
                    and inplace
                    and collectives.get(collective).blocks_out
                    and not collectives.get(collective).blocks_in
                ):
                    continue  # x = out[rank] sits at a different place on every rank
                q = Query(
                    collective,
                    world_size,
                    1024,
                    as_dtype(cfg.dtype).itemsize,
                    root=cfg.root,
                    inplace=inplace,
                    registered=cfg.registered,
                    cma=not cfg.registered and cma.probe()[0],
                )
                if alg.supports(q) is None and alg.name not in names:
                    names.append(alg.name)
        elif name == "auto" or any(a.name == name for a in registry.algorithms(collective)):
            if name not in names:
                names.append(name)
    return names


@dataclasses.dataclass(frozen=True)
class Point:
    """One size of one collective in one mode: what the sweep measures at a time, every
    algorithm of it together (their rows arrive together)."""

    collective: str
    nbytes: int
    mode: str
    algorithms: tuple[str, ...]


def points(cfg: BenchConfig, world_size: int) -> list[Point]:
    """The sweep's points in the order it measures them: per collective, per size, per mode."""
    return [
        Point(collective, nbytes, mode, tuple(algorithms_for(cfg, collective, world_size, mode == "in-place")))
        for collective in cfg.collectives
        for nbytes in sizes(cfg, collective, world_size)
        for mode in cfg.modes
        if mode == "out-of-place" or collectives.get(collective).inplace is not InPlace.NEVER  # (alltoallv)
    ]


# --- inputs and expected results ---------------------------------------------------------------
def _as(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``values.astype(dtype)``, also for bfloat16 (rounded from float32 by shmcoll's kernel)."""
    if dtype != BFLOAT16:
        return values.astype(dtype)
    wide = values.astype(FLOAT32)
    out = np.empty(wide.size, np.uint16)
    narrow_bfloat16(out, 0, wide.view(np.uint32), 0, wide.size)
    return out.view(BFLOAT16)


def _pattern(tag: int, count: int, dtype: np.dtype, op: ReduceOp) -> np.ndarray:
    i = np.arange(count, dtype=np.int64)
    if op == ReduceOp.PROD:
        v = (tag + i) % 2 + 1
    elif op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        v = (tag * 37 + i * 11) % 127
    else:
        v = (tag * 3 + i) % 7
    if dtype.kind == "b":
        return (v % 2).astype(bool)
    return _as(v, dtype)


def _reduced(world_size: int, count: int, dtype: np.dtype, op: ReduceOp, lo: int, hi: int) -> np.ndarray:
    """Elements [lo, hi) of the reduction over ranks ``0 .. world_size - 1`` of the rank patterns."""
    ufunc = FOLD_UFUNC[op]
    work = FLOAT32 if dtype in (FLOAT16, BFLOAT16) else dtype
    if world_size == 0:  # an exscan's rank 0: the op's identity
        return np.full(hi - lo, identity(op, dtype), dtype)
    acc = _pattern(0, count, work, op)[lo:hi]
    for r in range(1, world_size):
        acc = ufunc(acc, _pattern(r, count, work, op)[lo:hi]).astype(work)
    if op == ReduceOp.AVG:
        if work.kind in "iu":
            acc = acc // work.type(world_size)
        else:
            acc = (acc.astype(np.float64) / world_size).astype(work)
    return _as(acc, dtype)


class _Buffers:
    """One collective's buffers at one size on this rank, and how to call and check it.

    Everything follows from the collective's record: a blocked input holds ``world_size``
    blocks, rank ``r``'s block ``j`` filled with pattern ``r * world_size + j`` (an unblocked
    input, or a reduction's: pattern ``r``), so every element of every result is known exactly
    (see :meth:`wrong`). In place is the record's in-place form. One buffer set serves every
    algorithm of a size (the caller sets :attr:`algorithm` before each run).

    A variable-count collective runs with equal counts on its uniform form's buffers, flat, so
    that its times compare with the uniform form's; alltoallv is never in place.
    """

    def __init__(
        self,
        comm: Any,
        collective: str,
        nbytes: int,
        dtype: np.dtype,
        op: ReduceOp,
        root: int,
        inplace: bool,
        registered: bool,
        pages: str = "numpy",
    ) -> None:
        n, r = comm.world_size, comm.rank
        self.coll = collectives.get(collective)
        c = self.shaped = collectives.get(self.coll.uniform) if self.coll.varying else self.coll
        inplace = inplace and self.coll.inplace is not InPlace.NEVER
        self.comm, self.dtype, self.op, self.root = comm, dtype, op, root
        self.inplace = inplace
        self.algorithm = "auto"  # set by the caller before each run: one buffer set serves all algorithms
        total = self.count = nbytes // dtype.itemsize
        b = self.block = total // n if c.blocked else total
        self.counts = [b] * n
        alloc = getattr(comm, "alloc", None) if registered else None

        def new(shape: tuple[int, ...]) -> Any:
            return alloc(shape, dtype) if alloc is not None else page_backing.array(shape, dtype, pages)

        # Every rank allocates the same buffers in the same order (comm.alloc is collective).
        # A reduction's blocked input is flat (its result is one block, not a row of blocks).
        in_shape = ((n * b,) if c.reducing else (n, b)) if c.blocks_in else (b,)
        out_shape = (n, b) if c.blocks_out else (b,)
        if c.inplace is InPlace.INPUT_IS_MY_BLOCK:  # x = out[rank]
            self.out = new(out_shape)
            self.x = self.out[r] if inplace else new(in_shape)
        else:
            self.x = new(in_shape)
            own = new(out_shape) if not (inplace and c.inplace is InPlace.SAME) else None
            if inplace and c.inplace is InPlace.SAME:
                self.out = self.x
            elif inplace and c.inplace is InPlace.OUTPUT_IS_MY_BLOCK and (not c.input_at_root or r == root):
                self.out = self.x.reshape(n, b)[r]
            else:
                self.out = own
        self.fill()

    def _tag(self, rank: int, block: int | None) -> int:
        return rank * self.comm.world_size + block if block is not None else rank

    def fill(self) -> None:
        n, r, b = self.comm.world_size, self.comm.rank, self.block
        if self.shaped.blocks_in and not self.shaped.reducing:
            blocks = self.x.reshape(n, b)
            for j in range(n):
                blocks[j] = _pattern(self._tag(r, j), b, self.dtype, self.op)
        else:  # a reduction's input is one pattern per rank, reduced element by element
            self.x[...] = _pattern(r, self.x.size, self.dtype, self.op).reshape(self.x.shape)

    def run(self) -> None:
        self.call()()

    def call(self) -> Any:
        """One call of the current algorithm, as a function of no arguments made once per
        timed iteration: the loop then costs what a user's loop of the same call costs."""
        c, comm, r = self.coll, self.comm, self.comm.rank
        kw: dict[str, Any] = {"algorithm": self.algorithm}
        if c.rooted:
            kw["root"] = self.root
        if c.reducing:
            kw["op"] = self.op
        if c.result_at_root and r != self.root:
            kw["out"] = None
        else:
            kw["out"] = None if (self.inplace and c.out_none_in_place) else self.out
        x = None if (c.input_at_root and r != self.root) else self.x
        if not c.varying:
            return functools.partial(getattr(comm, c.name), x, **kw)
        out = kw.pop("out")
        flat_x = None if x is None else x.reshape(-1)
        flat_out = None if out is None else out.reshape(-1)
        if c.name == "reduce_scatterv":
            return functools.partial(comm.reduce_scatter, flat_x, counts=self.counts, out=flat_out, **kw)
        if c.name == "alltoallv":
            return functools.partial(comm.alltoallv, flat_x, self.counts, self.counts, out=flat_out, **kw)
        return functools.partial(getattr(comm, c.name), flat_x, self.counts, out=flat_out, **kw)

    def wrong(self, corrupt: bool) -> int:
        """Run once on fresh inputs and count the elements that differ from the exact answer."""
        self.fill()
        self.run()
        c, n, r, b = self.shaped, self.comm.world_size, self.comm.rank, self.block
        if c.result_at_root and r != self.root:
            return 0
        if c.prefix:  # scan: ranks 0..r; exscan: ranks 0..r-1
            want = _reduced(r + 1 if c.name == "scan" else r, b, self.dtype, self.op, 0, b)
        elif c.reducing:
            lo, hi = (r * b, (r + 1) * b) if c.blocks_in else (0, b)
            want = _reduced(n, b * (n if c.blocks_in else 1), self.dtype, self.op, lo, hi)
        elif c.blocks_out:  # block i of the result is rank i's (block r of its) input
            want = np.stack(
                [_pattern(self._tag(i, r if c.blocks_in else None), b, self.dtype, self.op) for i in range(n)]
            )
        else:  # broadcast, scatter: the root's (block r of its) input
            want = _pattern(self._tag(self.root, r if c.blocks_in else None), b, self.dtype, self.op)
        got = self.out.reshape(-1)
        if corrupt and got.size:
            if self.dtype == BFLOAT16:  # (no arithmetic on it: flip its lowest bit)
                got.view(np.uint16)[got.size // 2] ^= 1
            else:
                got[got.size // 2] = got[got.size // 2] + 1 if self.dtype.kind != "b" else not got[got.size // 2]
        return int(np.count_nonzero(got != want.reshape(-1)))


# --- the sweep, run on every rank ----------------------------------------------------------------
def _slowest(comm: Any, seconds: float) -> float:
    took = np.array([seconds])
    comm.allreduce(took, "max")
    return float(took[0])


def _reps(comm: Any, bufs: _Buffers, algorithms: Sequence[str], cfg: BenchConfig) -> dict[str, int]:
    """Warm each algorithm up and choose its calls per timed iteration (the same on every rank)."""
    reps = {}
    for algorithm in algorithms:
        bufs.algorithm = algorithm
        for _ in range(cfg.warmup):
            bufs.run()
        reps[algorithm] = calls_per_iteration(
            bufs.run, comm.barrier, lambda t: _slowest(comm, t), min_iteration_s(comm.world_size)
        )
    return reps


def _time_point(
    comm: Any, bufs: _Buffers, algorithms: Sequence[str], cfg: BenchConfig
) -> dict[str, tuple[float, float, float]]:
    """(median, p10, p90) seconds per call of each algorithm on the same buffers.

    The iterations are dealt out in ``cfg.rounds`` rounds, and in each round every algorithm runs
    its share, starting with a different algorithm each round. This machine's slow spells last
    seconds to minutes, longer than a round, so they land on every algorithm alike: the comparison between
    algorithms stays fair even when the absolute times drift.
    """
    reps = _reps(comm, bufs, algorithms, cfg)
    rounds = max(1, min(cfg.rounds, cfg.iters))
    share = [cfg.iters // rounds + (r < cfg.iters % rounds) for r in range(rounds)]
    times = np.empty((len(algorithms), cfg.iters), np.float64)
    done = [0] * len(algorithms)
    for r in range(rounds):
        for k in range(len(algorithms)):
            i = (r + k) % len(algorithms)
            bufs.algorithm = algorithms[i]
            call = bufs.call()
            for _ in range(share[r]):
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(reps[algorithms[i]]):
                    call()
                times[i, done[i]] = (time.perf_counter() - t0) / reps[algorithms[i]]
                done[i] += 1
    comm.allreduce(times, "max")  # slowest rank, per iteration
    return {
        a: (float(np.median(t)), float(np.percentile(t, 10)), float(np.percentile(t, 90)))
        for a, t in zip(algorithms, times, strict=True)
    }


def _settle(comm: Any, seconds: float) -> None:
    """Run untimed collectives for ``seconds``: right after start-up, ranks may share a core until
    the kernel's load balancer spreads them, and the first sizes measured would pay for it (a
    third slower here, on whichever algorithm happens to run first)."""
    settle_until = time.perf_counter() + seconds
    while seconds > 0:
        comm.barrier()
        flag = np.array([time.perf_counter() < settle_until], np.uint8)
        comm.allreduce(flag, op=ReduceOp.BAND)
        if not flag[0]:
            break


def bench_rank(comm: Any, cfg: BenchConfig, sink: Any = None) -> list[Row]:
    """The whole sweep on this rank; rank 0 returns the rows (others an empty list).

    With a ``sink`` (the writing end of a pipe), rank 0 also sends ``("point", i)`` before it
    measures point ``i`` of :func:`points` and ``("rows", rows)`` once that point is measured.
    """
    dtype = as_dtype(cfg.dtype)
    op = ReduceOp[cfg.op.upper()]
    n = comm.world_size
    rows: list[Row] = []
    tell = sink.send if sink is not None and comm.rank == 0 else None
    _settle(comm, cfg.settle_s)
    for index, point in enumerate(points(cfg, n)):
        collective, nbytes, mode, algorithms = point.collective, point.nbytes, point.mode, point.algorithms
        root = cfg.root if collectives.get(collective).rooted else -1
        if tell is not None:
            tell(("point", index))
        inplace = mode == "in-place"
        bufs = _Buffers(comm, collective, nbytes, dtype, op, max(root, 0), inplace, cfg.registered, cfg.pages)
        timed = _time_point(comm, bufs, algorithms, cfg)
        wrong = np.full(len(algorithms), -1, np.int64)
        if cfg.check:
            for i, algorithm in enumerate(algorithms):
                bufs.algorithm = algorithm
                wrong[i] = bufs.wrong(cfg.inject_error and comm.rank == 0)
            comm.allreduce(wrong)
        measured = []
        for algorithm, w in zip(algorithms, wrong, strict=True):
            med, p10, p90 = timed[algorithm]
            algbw = nbytes / med / 1e9 if med > 0 else 0.0
            measured.append(
                Row(
                    collective,
                    algorithm,
                    n,
                    nbytes,
                    bufs.count,
                    dtype_str(dtype),
                    cfg.op.lower() if collectives.get(collective).reducing else "none",
                    root,
                    mode,
                    med * 1e6,
                    algbw,
                    algbw * bus_factor(collective, n),
                    int(w),
                    p10 * 1e6,
                    p90 * 1e6,
                )
            )
        rows.extend(measured)
        if tell is not None:
            tell(("rows", measured))
        del bufs
    return rows if comm.rank == 0 else []


TRIM = 0.1  # the share of launches dropped at each end when launches are averaged


def _trimmed_mean(values: Sequence[float]) -> float:
    x = sorted(values)
    k = int(len(x) * TRIM)
    x = x[k : len(x) - k]
    return sum(x) / len(x)


def paired_times(launches: Sequence[Sequence[Row]]) -> dict[tuple[str, int, str, int, str], float]:
    """Per-call seconds of each algorithm from several launches' rows, compared launch by launch.

    Keys are ``(collective, world_size, mode, size, algorithm)``. A launch can be slower than
    another as a whole (a slow spell of the machine), which would swamp the differences between
    algorithms if raw times were pooled. So within a launch each time is divided by that point's
    geometric mean over its algorithms; those ratios are averaged over launches as logs (a
    geometric mean, the lowest and highest tenth dropped so one wild launch cannot move it); and
    the result is scaled back by the launches' geometric means averaged the same way.

    The mean rather than the median: with more ranks than cores, where the kernel happens to
    place the ranks favours some algorithms in one launch and others in the next, so the ratios
    cluster in modes and a median jumps between them (benchmarks/RESULTS.md has the cross-check
    on 30 launches at 4 ranks on 2 cores that chose this).
    """
    logs: dict[tuple[str, int, str, int], dict[str, list[float]]] = {}
    scales: dict[tuple[str, int, str, int], list[float]] = {}
    for rows in launches:
        by_point: dict[tuple[str, int, str, int], dict[str, float]] = {}
        for r in rows:
            if r.time_us > 0:
                by_point.setdefault((r.collective, r.world_size, r.mode, r.size), {})[r.algorithm] = r.time_us * 1e-6
        for point, times in by_point.items():
            scale = sum(math.log(t) for t in times.values()) / len(times)
            scales.setdefault(point, []).append(scale)
            for algorithm, t in times.items():
                logs.setdefault(point, {}).setdefault(algorithm, []).append(math.log(t) - scale)
    return {
        (*point, algorithm): math.exp(_trimmed_mean(ls) + _trimmed_mean(scales[point]))
        for point, per_alg in logs.items()
        for algorithm, ls in per_alg.items()
    }


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run`: the ranks are stopped; :attr:`rows` holds what was measured."""

    def __init__(self, rows: list[Row]) -> None:
        super().__init__(f"interrupted after {len(rows)} row(s)")
        self.rows = rows


def run(
    cfg: BenchConfig,
    *,
    timeout: float | None = None,
    on_point: Callable[[int, Point], None] | None = None,
    on_rows: Callable[[list[Row]], None] | None = None,
) -> list[Row]:
    """Start ``cfg.nprocs`` ranks and run the sweep; the rows, from rank 0.

    ``on_point(i, point)`` is called as point ``i`` of :func:`points` starts, ``on_rows(rows)``
    as soon as a point's rows are measured (both from a thread of this process). Without
    ``on_point``, ``cfg.progress`` draws a :class:`Progress` line when stderr is a terminal.

    Raises:
        Interrupted: Ctrl-C (``KeyboardInterrupt``); the ranks are stopped, and the exception's
            ``rows`` are the rows measured until then.
    """
    import multiprocessing as mp
    import threading

    from shmcoll.launch import spawn

    validate(cfg)
    sweep = points(cfg, cfg.nprocs)
    progress = Progress(sweep) if on_point is None and cfg.progress else None
    if progress is not None:
        on_point = progress.point
    received: list[Row] = []
    # The ranks are started with "spawn" (launch.spawn's default); the writing end travels to
    # them as an argument, and this process's copy is closed once they are gone, which ends the
    # reader (also when a killed rank 0 left half a message in the pipe).
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    failed: list[BaseException] = []

    def listen() -> None:
        while True:
            try:
                kind, payload = reader.recv()
            except (EOFError, OSError):
                return
            if kind == "rows":
                received.extend(payload)
            # A failing callback (stdout closed under `| head`) must not stop the reading: rank 0
            # would block on a full pipe. It is re-raised here once the ranks are done.
            try:
                if failed:
                    continue
                if kind == "point" and on_point is not None:
                    on_point(payload, sweep[payload])
                elif kind == "rows" and on_rows is not None:
                    on_rows(payload)
            except BaseException as exc:  # noqa: BLE001
                failed.append(exc)

    thread = threading.Thread(target=listen, name="shmcoll-bench-rows", daemon=True)
    thread.start()
    interrupted = False
    try:
        spawn(bench_rank, nprocs=cfg.nprocs, args=(cfg, writer), timeout=timeout)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        writer.close()
        thread.join()
        reader.close()
        if progress is not None:
            progress.clear()
    if interrupted:
        raise Interrupted(received)
    if failed:
        raise failed[0]
    return received


def validate(cfg: BenchConfig) -> None:
    """Reject a configuration before starting any process."""
    dtype = as_dtype(cfg.dtype)
    try:
        op = ReduceOp[cfg.op.upper()]
    except KeyError:
        raise ValueError(f"unknown op {cfg.op!r}; one of {', '.join(o.name.lower() for o in ReduceOp)}") from None
    for c in cfg.collectives:
        if c not in BENCH_COLLECTIVES:
            raise ValueError(f"unknown collective {c!r}; one of {', '.join(BENCH_COLLECTIVES)}")
        if collectives.get(c).reducing and not supports(op, dtype):
            raise ValueError(f"op {op.name} is not defined for {dtype_str(dtype)}")
        if collectives.get(c).prefix and op == ReduceOp.AVG:
            raise ValueError(f"op AVG has no prefix form ({c}); use sum")
        if not algorithms_for(cfg, c, cfg.nprocs):
            raise ValueError(f"none of the algorithms {list(cfg.algorithms)} serves {c}")
    if not 0 <= cfg.root < cfg.nprocs:
        raise ValueError(f"root {cfg.root} out of range for {cfg.nprocs} ranks")
    if cfg.min_bytes > cfg.max_bytes:
        raise ValueError("min bytes is larger than max bytes")
    if cfg.iters < 1:
        raise ValueError("iters must be >= 1")
    if cfg.pages not in page_backing.PAGES:
        raise ValueError(f"unknown pages {cfg.pages!r}; one of {', '.join(page_backing.PAGES)}")
    if cfg.registered and cfg.pages != "numpy":
        raise ValueError("buffers from comm.alloc are shmcoll's shared memory: pages applies to ordinary buffers")
    engine_types(dtype, op)


# --- output --------------------------------------------------------------------------------------
def describe(cfg: BenchConfig) -> dict[str, Any]:
    """What a reader of the results needs to reproduce them: the parameters, the versions, the
    date and the machine (no host name). The JSON's ``meta`` and the table's header."""
    import datetime
    import platform

    import numba

    from shmcoll._version import __version__

    return {
        "version": __version__,
        "numba": numba.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cores": len(os.sched_getaffinity(0)),
        "machine": platform.machine(),
        "nprocs": cfg.nprocs,
        "collectives": list(cfg.collectives),
        "algorithms": list(cfg.algorithms),
        "dtype": cfg.dtype,
        "op": cfg.op.lower(),
        "root": cfg.root,
        "modes": list(cfg.modes),
        "min_bytes": cfg.min_bytes,
        "max_bytes": cfg.max_bytes,
        "step_factor": cfg.step_factor,
        "iters": cfg.iters,
        "warmup": cfg.warmup,
        "check": cfg.check,
        "registered": cfg.registered,
        "pages": cfg.pages,
        "thp": page_backing.thp_setting(),
    }


def format_header(meta: Mapping[str, Any]) -> str:
    """The ``#`` lines above the table: the parameters of :func:`describe`, nccl-tests style."""
    from shmcoll.units import format_size

    return "\n".join(
        (
            f"# shmcoll {meta['version']} bench (numba {meta['numba']}, numpy {meta['numpy']}, "
            f"Python {meta['python']}); {meta['date']}; {meta['cores']} cores ({meta['machine']})",
            f"# ranks {meta['nprocs']}, collectives {','.join(meta['collectives'])}, "
            f"algorithms {','.join(meta['algorithms'])}, dtype {meta['dtype']}, op {meta['op']}, root {meta['root']}",
            f"# sizes {format_size(meta['min_bytes'])} to {format_size(meta['max_bytes'])} x{meta['step_factor']:g}, "
            f"iters {meta['iters']}, warmup {meta['warmup']}, modes {','.join(meta['modes'])}, "
            f"check {'on' if meta['check'] else 'off'}, buffers {_buffers_text(meta)}",
        )
    )


def _buffers_text(meta: Mapping[str, Any]) -> str:
    """What backed the buffers, for the header (results written before ``pages`` say numpy)."""
    if meta["registered"]:
        return "comm.alloc"
    pages = meta.get("pages", "numpy")
    what = {"numpy": "numpy", "small": "4 KiB pages", "huge": "huge pages"}.get(pages, pages)
    return f"{what} (transparent huge pages: {meta['thp']})" if "thp" in meta else what


_MODES = ("out-of-place", "in-place")


class Table:
    """nccl-tests' table, written a line at a time as rows arrive: one section per (collective,
    algorithm), a line per size with its out-of-place and in-place cells.

    ``expected`` says what will arrive, in order: ``(collective, algorithm, size, mode)`` for
    every cell. A line is written as soon as its cells and everything above it are in; a
    section whose algorithm is measured alongside another's (``-a all``) follows once that
    one's section is complete. :meth:`finish` writes what is left (lines missing a cell keep it
    blank: an interrupted sweep) and the footer.
    """

    def __init__(
        self,
        expected: Sequence[tuple[str, str, int, str]],
        world_size: int,
        write: Callable[[str], None],
        *,
        stats: bool = False,
    ) -> None:
        self.total = len(expected)
        self._world_size = world_size
        self._write = write
        self._stats = stats
        self._sections: dict[tuple[str, str], tuple[list[int], list[str]]] = {}
        for collective, algorithm, size, mode in expected:
            sizes_, modes = self._sections.setdefault((collective, algorithm), ([], []))
            if size not in sizes_:
                sizes_.append(size)
            if mode not in modes:
                modes.append(mode)
        for _, modes in self._sections.values():
            modes.sort(key=_MODES.index)
        self._order = list(self._sections)
        self._cells: dict[tuple[str, str, int, str], Row] = {}
        self._section = 0  # the cursor: the next line to write is this section's size self._line
        self._line = 0
        self._headed = False  # whether this section's header is written
        self._wrong = 0
        self._busbws: list[float] = []
        self._cols = "     time   algbw   busbw #wrong" + ("      p10      p90" if stats else "")

    @classmethod
    def of(cls, cfg: BenchConfig, write: Callable[[str], None], *, stats: bool = False) -> Table:
        """The table of ``cfg``'s sweep."""
        expected = [(p.collective, a, p.nbytes, p.mode) for p in points(cfg, cfg.nprocs) for a in p.algorithms]
        return cls(expected, cfg.nprocs, write, stats=stats)

    def add(self, rows: Sequence[Row]) -> None:
        """Take rows as they are measured; write every line that is now complete."""
        for r in rows:
            self._cells[(r.collective, r.algorithm, r.size, r.mode)] = r
        self._advance(final=False)

    def finish(self, note: str = "") -> None:
        """Write the lines not written yet, a ``# note`` line if given, and the footer."""
        self._advance(final=True)
        if note:
            self._write(f"# {note}")
        self._write(f"# Out of bounds values : {self._wrong} {'OK' if self._wrong == 0 else 'FAILED'}")
        avg = sum(self._busbws) / len(self._busbws) if self._busbws else 0.0
        self._write(f"# Avg bus bandwidth    : {avg:.3f} GB/s")

    def _advance(self, final: bool) -> None:
        while self._section < len(self._order):
            key = self._order[self._section]
            sizes_, modes = self._sections[key]
            while self._line < len(sizes_):
                cells = [self._cells.get((*key, sizes_[self._line], m)) for m in modes]
                if None in cells and not final:
                    return
                if any(c is not None for c in cells):
                    if not self._headed:
                        self._header(key, modes)
                    self._row(cells)
                self._line += 1
            self._section += 1
            self._line = 0
            self._headed = False

    def _header(self, key: tuple[str, str], modes: list[str]) -> None:
        collective, algorithm = key
        self._headed = True
        self._write(f"# {collective}, algorithm {algorithm}, {self._world_size} ranks")
        self._write("#" + " " * 47 + "".join(f"{m:>{len(self._cols)}}" for m in modes))
        self._write(f"# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'root':>6}" + self._cols * len(modes))
        units = "     (us)  (GB/s)  (GB/s)       " + ("     (us)     (us)" if self._stats else "")
        self._write(f"# {'(B)':>10} {'(elements)':>12} {'':>8} {'':>6} {'':>6}" + units * len(modes))

    def _row(self, cells: list[Row | None]) -> None:
        first = next(c for c in cells if c is not None)
        text = f"  {first.size:>10} {first.count:>12} {first.dtype:>8} {first.op:>6} {first.root:>6}"
        for cell in cells:
            if cell is None:
                text += " " * len(self._cols)
                continue
            wrong = "N/A" if cell.wrong < 0 else str(cell.wrong)
            text += f" {cell.time_us:>8.2f} {cell.algbw:>7.2f} {cell.busbw:>7.2f} {wrong:>6}"
            if self._stats:
                text += f" {cell.p10_us:>8.2f} {cell.p90_us:>8.2f}"
            self._wrong += max(cell.wrong, 0)
            self._busbws.append(cell.busbw)
        self._write(text)


def format_table(rows: Sequence[Row], stats: bool = False) -> str:
    """nccl-tests' table of finished rows: one section per (collective, algorithm), out-of-place
    then in-place (what :class:`Table` writes line by line)."""
    lines: list[str] = []
    expected = [(r.collective, r.algorithm, r.size, r.mode) for r in rows]
    table = Table(expected, rows[0].world_size if rows else 0, lines.append, stats=stats)
    table.add(rows)
    table.finish()
    return "\n".join(lines)


class Progress:
    """A progress line on stderr while :func:`run` runs: ``[3/40] allreduce 64M in-place, ETA 1m12s``.

    Drawn only on a terminal (``\\r`` and the erase-line escape rewrite it in place, which a log
    file would keep as garbage). The ETA weighs each point by its algorithms times its size, at
    least 64 KiB: below that a point's time is mostly fixed costs (barriers, at least 20 us per
    timed iteration).
    """

    FLOOR_BYTES = 64 << 10

    def __init__(self, sweep: Sequence[Point], stream: Any = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self._stream, "isatty", lambda: False)())
        self._weights = [len(p.algorithms) * max(p.nbytes, self.FLOOR_BYTES) for p in sweep]
        self._points = sweep
        self._started: float | None = None
        self._shown = ""

    def text(self, index: int, now: float | None = None) -> str:
        """The line for point ``index`` starting now (without escapes)."""
        from shmcoll.units import human_size

        p = self._points[index]
        line = f"[{index + 1}/{len(self._points)}] {p.collective} {human_size(p.nbytes)} {p.mode}"
        now = time.monotonic() if now is None else now
        if self._started is None or index == 0:
            self._started = now
            return line
        done = sum(self._weights[:index])
        eta = (now - self._started) / done * sum(self._weights[index:])
        return f"{line}, ETA {_duration(eta)}"

    def point(self, index: int, point: Point | None = None) -> None:
        """Show that point ``index`` starts (a :func:`run` ``on_point`` callback)."""
        self._shown = self.text(index)
        self.redraw()

    def redraw(self) -> None:
        """Draw the line again (after something else was written to the terminal)."""
        if self.enabled and self._shown:
            self._stream.write(f"\r\033[K{self._shown}")
            self._stream.flush()

    def clear(self) -> None:
        """Erase the line (before writing anything else to the terminal)."""
        if self.enabled and self._shown:
            self._stream.write("\r\033[K")
            self._stream.flush()


def _duration(seconds: float) -> str:
    """``75`` -> ``1m15s``; ``3725`` -> ``1h02m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _open_output(path: str, newline: str | None = None) -> Any:
    """``path`` opened for writing; ``-`` is stdout (left open)."""
    import contextlib

    if path == "-":
        return contextlib.nullcontext(sys.stdout)
    return open(path, "w", newline=newline)


def write_json(rows: Sequence[Row], path: str, meta: dict[str, Any] | None = None) -> None:
    """``{"meta": ..., "rows": [...]}`` to ``path`` (``-``: stdout); ``meta`` as :func:`describe`."""
    with _open_output(path) as f:
        json.dump({"meta": meta or {}, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
        f.write("\n")


def write_csv(rows: Sequence[Row], path: str) -> None:
    """One line per row, :class:`Row`'s fields as the header, to ``path`` (``-``: stdout)."""
    import csv

    with _open_output(path, newline="") as f:
        fields = [fl.name for fl in dataclasses.fields(Row)]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow(dataclasses.asdict(r))


def plot(series: Mapping[str, Sequence[Row]], path: str, title: str = "") -> None:
    """busbw vs size, one colour per series and one line per mode measured, out-of-place solid and
    in-place dashed, each named in the legend; sizes in binary units (needs matplotlib:
    ``pip install shmcoll[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install 'shmcoll[plot]'") from None
    from shmcoll.units import human_size

    fig, ax = plt.subplots(figsize=(9, 5.5), layout="constrained")
    dashes = {"out-of-place": "-", "in-place": "--"}
    all_sizes: set[int] = set()
    for k, (label, rows) in enumerate(series.items()):
        colour = f"C{k % 10}"
        for mode in _MODES:
            pts = sorted((r.size, r.busbw) for r in rows if r.mode == mode)
            if pts:
                all_sizes.update(p[0] for p in pts)
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=colour,
                    linestyle=dashes[mode],
                    marker="o" if mode == "out-of-place" else "s",
                    markerfacecolor="none" if mode == "in-place" else colour,
                    ms=4,
                    label=f"{label}, {mode}",
                )
    ax.set_xscale("log", base=2)
    if all_sizes:
        # Powers of two, at most about a dozen of them, labelled 16 B, 1 KiB, 64 MiB.
        lo, hi = (max(0, math.floor(math.log2(min(all_sizes)))), math.ceil(math.log2(max(all_sizes))))
        step = max(1, math.ceil((hi - lo + 1) / 12))
        ax.xaxis.set_major_locator(FixedLocator([2.0**e for e in range(lo, hi + 1, step)]))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human_size(x, iec=True)))
    ax.set_xlabel("size")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)
    plt.close(fig)
