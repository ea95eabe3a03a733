"""The sweep engine behind ``shmcoll bench``: timing, checking and the nccl-tests table.

Timing rule: each timed iteration runs ``reps`` back-to-back calls after a barrier (``reps`` is
chosen so an iteration lasts at least ~20 us, so tiny messages are not dominated by the barrier's
exit skew); a rank's time per call is the iteration's time divided by ``reps``; the reported
time is the **median over iterations of the slowest rank's time** (p10/p90 too, for
``--stats``). Bandwidths follow nccl-tests: ``algbw = size / time`` and ``busbw = algbw *
factor`` with factor ``2(n-1)/n`` for allreduce, ``(n-1)/n`` for allgather, reduce_scatter,
alltoall, gather and scatter, and 1 for broadcast and reduce. ``size`` is the largest per-rank
buffer of the call (allgather's output, reduce_scatter's input), as in nccl-tests. When several
algorithms are benched, they share one size's buffers and take turns in rounds (see
:func:`_time_point`), so they are compared on the same stretch of the machine's time.

Checking: inputs are a pattern whose result every rank can compute exactly by itself, so after
the timed iterations each rank runs the collective once more on fresh inputs and counts the
elements that differ (``#wrong``, summed over ranks).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shmcoll import collectives
from shmcoll.algos import registry
from shmcoll.algos.registry import Query
from shmcoll.collectives import COLLECTIVES, InPlace
from shmcoll.kernels.cpu import narrow_bfloat16
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
    inject_error: bool = False
    progress: bool = True
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
                )
                if alg.supports(q) is None and alg.name not in names:
                    names.append(alg.name)
        elif name == "auto" or any(a.name == name for a in registry.algorithms(collective)):
            if name not in names:
                names.append(name)
    return names


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
        new = (lambda shape: alloc(shape, dtype)) if alloc is not None else (lambda shape: np.empty(shape, dtype))
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
            getattr(comm, c.name)(x, **kw)
            return
        out = kw.pop("out")
        flat_x = None if x is None else x.reshape(-1)
        flat_out = None if out is None else out.reshape(-1)
        if c.name == "reduce_scatterv":
            comm.reduce_scatter(flat_x, counts=self.counts, out=flat_out, **kw)
        elif c.name == "alltoallv":
            comm.alltoallv(flat_x, self.counts, self.counts, out=flat_out, **kw)
        else:
            getattr(comm, c.name)(flat_x, self.counts, out=flat_out, **kw)

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
def _reps(comm: Any, bufs: _Buffers, algorithms: Sequence[str], cfg: BenchConfig) -> dict[str, int]:
    """Warm each algorithm up and choose its calls per timed iteration (the same on every rank)."""
    estimate = np.zeros(len(algorithms))
    for i, algorithm in enumerate(algorithms):
        bufs.algorithm = algorithm
        for _ in range(cfg.warmup):
            bufs.run()
        comm.barrier()
        t0 = time.perf_counter()
        bufs.run()
        estimate[i] = time.perf_counter() - t0
    comm.allreduce(estimate, "max")
    return {
        a: int(min(max(math.ceil(MIN_ITERATION_S / max(e, 1e-9)), 1), 1000))
        for a, e in zip(algorithms, estimate, strict=True)
    }


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
            for _ in range(share[r]):
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(reps[algorithms[i]]):
                    bufs.run()
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


def bench_rank(comm: Any, cfg: BenchConfig) -> list[Row]:
    """The whole sweep on this rank; rank 0 returns the rows (others an empty list)."""
    dtype = as_dtype(cfg.dtype)
    op = ReduceOp[cfg.op.upper()]
    n = comm.world_size
    rows: list[Row] = []
    _settle(comm, cfg.settle_s)
    points = [
        (collective, nbytes, mode)
        for collective in cfg.collectives
        for nbytes in sizes(cfg, collective, n)
        for mode in cfg.modes
        if mode == "out-of-place" or collectives.get(collective).inplace is not InPlace.NEVER  # (alltoallv)
    ]
    for done, (collective, nbytes, mode) in enumerate(points, 1):
        root = cfg.root if collectives.get(collective).rooted else -1
        algorithms = algorithms_for(cfg, collective, n, mode == "in-place")
        if cfg.progress and comm.rank == 0:
            sys.stderr.write(f"\r\033[K[{done}/{len(points)}] {collective} {nbytes} B {mode}")
            sys.stderr.flush()
        bufs = _Buffers(comm, collective, nbytes, dtype, op, max(root, 0), mode == "in-place", cfg.registered)
        timed = _time_point(comm, bufs, algorithms, cfg)
        wrong = np.full(len(algorithms), -1, np.int64)
        if cfg.check:
            for i, algorithm in enumerate(algorithms):
                bufs.algorithm = algorithm
                wrong[i] = bufs.wrong(cfg.inject_error and comm.rank == 0)
            comm.allreduce(wrong)
        for algorithm, w in zip(algorithms, wrong, strict=True):
            med, p10, p90 = timed[algorithm]
            algbw = nbytes / med / 1e9 if med > 0 else 0.0
            rows.append(
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
        del bufs
    if cfg.progress and comm.rank == 0:
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()
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


def run(cfg: BenchConfig, *, timeout: float | None = None) -> list[Row]:
    """Start ``cfg.nprocs`` ranks and run the sweep; the rows, from rank 0."""
    from shmcoll.launch import spawn

    validate(cfg)
    return spawn(bench_rank, nprocs=cfg.nprocs, args=(cfg,), timeout=timeout)[0]  # type: ignore[no-any-return]


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
    engine_types(dtype, op)


# --- output --------------------------------------------------------------------------------------
def format_table(rows: Sequence[Row], stats: bool = False) -> str:
    """nccl-tests' table: one section per (collective, algorithm), out-of-place then in-place."""
    lines: list[str] = []
    sections: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        sections.setdefault((row.collective, row.algorithm), []).append(row)
    total_wrong = 0
    busbws: list[float] = []
    for (collective, algorithm), sec in sections.items():
        modes = [m for m in ("out-of-place", "in-place") if any(r.mode == m for r in sec)]
        n = sec[0].world_size
        lines.append(f"# {collective}, algorithm {algorithm}, {n} ranks")
        cols = "     time   algbw   busbw #wrong" + ("      p10      p90" if stats else "")
        head1 = "#" + " " * 47 + "".join(f"{m:>{len(cols)}}" for m in modes)
        lines.append(head1)
        lines.append(f"# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'root':>6}" + cols * len(modes))
        units = "     (us)  (GB/s)  (GB/s)       " + ("     (us)     (us)" if stats else "")
        lines.append(f"# {'(B)':>10} {'(elements)':>12} {'':>8} {'':>6} {'':>6}" + units * len(modes))
        by_size: dict[int, dict[str, Row]] = {}
        for each in sec:
            by_size.setdefault(each.size, {})[each.mode] = each
        for size, per_mode in by_size.items():
            first = next(iter(per_mode.values()))
            text = f"  {size:>10} {first.count:>12} {first.dtype:>8} {first.op:>6} {first.root:>6}"
            for m in modes:
                cell = per_mode.get(m)
                if cell is None:
                    text += " " * len(cols)
                    continue
                wrong = "N/A" if cell.wrong < 0 else str(cell.wrong)
                text += f" {cell.time_us:>8.2f} {cell.algbw:>7.2f} {cell.busbw:>7.2f} {wrong:>6}"
                if stats:
                    text += f" {cell.p10_us:>8.2f} {cell.p90_us:>8.2f}"
                total_wrong += max(cell.wrong, 0)
                busbws.append(cell.busbw)
            lines.append(text)
    avg = sum(busbws) / len(busbws) if busbws else 0.0
    lines.append(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
    lines.append(f"# Avg bus bandwidth    : {avg:.3f} GB/s")
    return "\n".join(lines)


def write_json(rows: Sequence[Row], path: str, meta: dict[str, Any] | None = None) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta or {}, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)


def write_csv(rows: Sequence[Row], path: str) -> None:
    import csv

    with open(path, "w", newline="") as f:
        fields = [fl.name for fl in dataclasses.fields(Row)]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow(dataclasses.asdict(r))


def plot(series: Mapping[str, Sequence[Row]], path: str, title: str = "") -> None:
    """busbw vs size, one line per series (needs matplotlib: ``pip install shmcoll[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install 'shmcoll[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, rows in series.items():
        pts = sorted((r.size, r.busbw) for r in rows if r.mode == "out-of-place") or sorted(
            (r.size, r.busbw) for r in rows
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
