"""``shmcoll tune``: calibrate the cost model on this machine and measure every algorithm.

Per world size, ``repeat`` jobs (``shmcoll.spawn``, one launch each) run on their ranks:

1. **the link** (first launch of the first world size, ranks 0 and 1): the median one-way time
   of a small and of a large point-to-point message (ping-pong halves), and the median time of a call that
   moves nothing (a world-size-1 communicator), which every call pays whatever its algorithm.
   ``alpha`` and ``beta`` are then solved from the simulator's own figures for the two
   point-to-point plans, so the model is calibrated on the plans it predicts;
2. **the algorithms**: ``bench``'s sweep (``bench_rank``) of every registered algorithm of each
   collective at the requested sizes, out of place, results checked; the algorithms of one size
   take turns in rounds, so they are compared on the same stretch of the machine's time. Then
   the same on buffers from ``comm.alloc`` for the collectives with a ``zerocopy`` form (which
   competes only there); ``auto`` decides registered calls from those times.

The table (``config.tune_file``, JSON) holds the model, the slot size, the measured times
(launches combined by :func:`shmcoll.bench.paired_times`), and the fastest algorithm per size
with the crossovers, and is what ``algorithm="auto"`` reads (:mod:`shmcoll.algos.select`).
Entries for (collective, world size, kind of buffer) not measured in this run are kept from an
existing table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shmcoll import bench, config
from shmcoll.algos import registry
from shmcoll.algos.select import TUNE_VERSION, Measured, TuneTable
from shmcoll.plan.cost import CostModel, Costs, simulate
from shmcoll.units import format_size, format_time


@dataclasses.dataclass(frozen=True)
class TuneConfig:
    """What ``shmcoll tune`` measures (the defaults are the full tune; tests shrink them)."""

    world_sizes: tuple[int, ...] = (2,)
    collectives: tuple[str, ...] = bench.BENCH_COLLECTIVES
    min_bytes: int = 8
    max_bytes: int = 16 << 20
    step_factor: float = 4.0
    iters: int = 10
    warmup: int = 3
    repeat: int = 3  # sweeps, each in its own launch, combined by bench.paired_times
    dtype: str = "float32"
    link_small_bytes: int = 8
    link_large_bytes: int = 16 << 20
    link_iters: int = 100
    registered: bool = True  # also sweep on comm.alloc buffers, where zerocopy competes

    def validate(self) -> None:
        if not self.world_sizes or any(n < 1 for n in self.world_sizes):
            raise ValueError(f"world sizes must be >= 1, got {self.world_sizes}")
        if max(self.world_sizes) < 2:
            raise ValueError("tune needs a world size of at least 2 to measure the link")
        if self.link_iters < 3:
            raise ValueError("link iterations must be >= 3")
        if self.repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {self.repeat}")
        if self.link_large_bytes <= self.link_small_bytes:
            raise ValueError("the large link message must be larger than the small one")
        for n in self.world_sizes:
            bench.validate(self._bench(n))

    def registered_collectives(self) -> tuple[str, ...]:
        """The collectives of the sweep on registered buffers: those with a zerocopy form."""
        if not self.registered:
            return ()
        return tuple(c for c in self.collectives if any(a.name == "zerocopy" for a in registry.algorithms(c)))

    def _bench(self, n: int, registered: bool = False) -> bench.BenchConfig:
        return bench.BenchConfig(
            collectives=self.registered_collectives() if registered else self.collectives,
            registered=registered,
            algorithms=("all",),
            nprocs=n,
            min_bytes=self.min_bytes,
            max_bytes=self.max_bytes,
            step_factor=self.step_factor,
            dtype=self.dtype,
            iters=self.iters,
            warmup=self.warmup,
            check=True,
            modes=("out-of-place",),
            progress=False,
        )


@dataclasses.dataclass(frozen=True)
class Link:
    """Median seconds measured between ranks 0 and 1."""

    small_s: float
    large_s: float
    null_s: float
    small_bytes: int
    large_bytes: int


# --- on the ranks ----------------------------------------------------------------------------------
def _one_way(comm: Any, nbytes: int, iters: int) -> float:
    """Median half round trip of ``nbytes`` between ranks 0 and 1 (other ranks wait), through the
    engine's channels: a 2-rank in-place broadcast each way is one message each way, the link
    the cost model describes (point-to-point calls go through mailboxes and Python matching)."""
    pair = comm.split(color=0 if comm.rank < 2 else None)
    if pair is None:
        return 0.0
    try:
        buf = np.zeros(nbytes, np.uint8)
        times = np.empty(iters)
        for i in range(-2, iters):  # two untimed rounds build and cache the plans
            t0 = time.perf_counter()
            pair.broadcast(buf, root=0, algorithm="direct")
            pair.broadcast(buf, root=1, algorithm="direct")
            if i >= 0:
                times[i] = (time.perf_counter() - t0) / 2
        return float(np.median(times))
    finally:
        pair.close()


def _null_call(comm: Any, iters: int) -> float:
    """Median time of a call that moves nothing: what every call costs beyond its steps."""
    solo = comm.split(color=comm.rank)
    try:
        x = np.zeros(2, np.float32)
        times = np.empty(iters)
        for i in range(-2, iters):
            t0 = time.perf_counter()
            solo.allreduce(x, algorithm="direct")
            if i >= 0:
                times[i] = time.perf_counter() - t0
        return float(np.median(times))
    finally:
        solo.close()


def _tune_rank(comm: Any, cfg: TuneConfig, measure_link: bool) -> tuple[Link | None, list[bench.Row], list[bench.Row]]:
    link = None
    if measure_link:
        null_s = _null_call(comm, cfg.link_iters)
        comm.barrier()
        small = _one_way(comm, cfg.link_small_bytes, cfg.link_iters)
        large = _one_way(comm, cfg.link_large_bytes, max(3, cfg.link_iters // 10))
        link = Link(small, large, null_s, cfg.link_small_bytes, cfg.link_large_bytes)
        comm.barrier()
    rows = bench.bench_rank(comm, cfg._bench(comm.world_size))
    registered = bench.bench_rank(comm, cfg._bench(comm.world_size, True)) if cfg.registered_collectives() else []
    return (link, rows, registered) if comm.rank == 0 else (None, [], [])


# --- calibration -----------------------------------------------------------------------------------
def _p2p_coefficients(nbytes: int, slot_bytes: int, nslots: int) -> tuple[float, float]:
    """(alpha, 1/beta) coefficients of the simulated one-way time of an ``nbytes`` message."""
    from shmcoll.plan.passes import plan_call

    plan = plan_call(registry.get("broadcast", "direct"), 2, nbytes, slot_bytes, root=0, inplace=True)
    a = simulate(plan, 1, Costs(1.0, 0.0, 1.0, 0.0, None, nslots)).time_s
    b = simulate(plan, 1, Costs(0.0, 1.0, 0.0, 1.0, None, nslots)).time_s
    return a, b


def calibrate(link: Link, slot_bytes: int, nslots: int) -> CostModel:
    """Solve ``alpha`` and ``beta`` so the simulated point-to-point times match the measured ones.

    Each measured one-way time, less the cost of a call that moves nothing, is ``a alpha + b /
    beta`` with ``(a, b)`` read off the simulated p2p plan; two sizes give two equations.
    """
    a1, b1 = _p2p_coefficients(link.small_bytes, slot_bytes, nslots)
    a2, b2 = _p2p_coefficients(link.large_bytes, slot_bytes, nslots)
    t1 = max(link.small_s - link.null_s, 0.0)
    t2 = max(link.large_s - link.null_s, 0.0)
    det = a1 * b2 - a2 * b1
    inv_beta = (a1 * t2 - a2 * t1) / det
    alpha = (t1 * b2 - t2 * b1) / det
    # Noise can push a solution out of range; fall back to each size's own reading.
    if inv_beta <= 0:
        inv_beta = max(t2, 1e-12) / b2
    if alpha <= 0:
        alpha = max(t1 - b1 * inv_beta, 1e-9) / a1
    return CostModel(alpha_s=alpha, beta_Bps=1.0 / inv_beta, nslots=nslots)


def _measured(launches: Sequence[Sequence[bench.Row]], registered: bool = False) -> list[Measured]:
    """The tables of times: per (collective, algorithm, size), the launches' times compared launch
    by launch (:func:`shmcoll.bench.paired_times`)."""
    by_key: dict[tuple[str, int], dict[str, dict[int, float]]] = {}
    for (collective, n, _, size, algorithm), t in bench.paired_times(launches).items():
        by_key.setdefault((collective, n), {}).setdefault(algorithm, {})[size] = t
    out = []
    for (collective, n), per_alg in by_key.items():
        sizes = tuple(sorted({s for t in per_alg.values() for s in t}))
        times = {name: tuple(t.get(s) for s in sizes) for name, t in per_alg.items()}
        out.append(Measured(collective, n, sizes, times, registered=registered))
    return out


def fastest(m: Measured) -> list[tuple[int, str]]:
    """The fastest measured algorithm at each size of ``m``."""
    out = []
    for i, size in enumerate(m.sizes):
        timed = [(t[i], name) for name, t in m.times_s.items() if t[i] is not None]
        if timed:
            out.append((size, min(timed)[1]))
    return out


def crossovers(m: Measured) -> list[tuple[int, str, str]]:
    """``(size, before, after)`` wherever the fastest algorithm changes between measured sizes."""
    best = fastest(m)
    return [(s, a, b) for (_, a), (s, b) in zip(best, best[1:], strict=False) if a != b]


def _read_existing(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if data.get("version") == TUNE_VERSION else None
    except (OSError, ValueError):
        return None


def write_table(table: TuneTable, path: str, meta: dict[str, Any]) -> None:
    """Write the table atomically, with the fastest-per-size summary and the crossovers."""
    data = table.to_json()
    data["meta"] = meta
    data["fastest"] = [
        {
            "collective": m.collective,
            "world_size": m.world_size,
            "registered": m.registered,
            "by_size": [[s, a] for s, a in fastest(m)],
            "crossovers": [[s, a, b] for s, a, b in crossovers(m)],
        }
        for m in table.measured
    ]
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tune-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def run(
    cfg: TuneConfig,
    path: str | None = None,
    *,
    timeout: float | None = 900.0,
    progress: Callable[[str], None] | None = None,
) -> tuple[TuneTable, Link]:
    """Measure, calibrate and write the table to ``path`` (default ``config.tune_file``)."""
    from shmcoll.launch import spawn

    cfg.validate()
    conf = config.get()
    path = path or conf.tune_file
    say = progress or (lambda text: None)
    link: Link | None = None
    launches: list[list[bench.Row]] = []
    launches_registered: list[list[bench.Row]] = []
    link_n = min(n for n in cfg.world_sizes if n >= 2)
    for n in sorted(set(cfg.world_sizes)):
        # Each sweep in a launch of its own: where the kernel places the ranks on the cores
        # differs from launch to launch and, with more ranks than cores, favours different
        # algorithms; the launches averaged (bench.paired_times) are what a user's run should expect.
        for rep in range(cfg.repeat):
            say(f"tuning on {n} rank(s), sweep {rep + 1}/{cfg.repeat}")
            measure_link = n == link_n and rep == 0
            got_link, got_rows, got_registered = spawn(_tune_rank, nprocs=n, args=(cfg, measure_link), timeout=timeout)[
                0
            ]
            link = got_link or link
            launches.append(got_rows)
            launches_registered.append(got_registered)
    assert link is not None
    model = calibrate(link, conf.slot_bytes, conf.nslots)
    measured = _measured(launches) + _measured(launches_registered, registered=True)
    fresh = {m.key for m in measured}
    existing = _read_existing(path)
    if existing is not None:
        try:
            old = TuneTable.from_json(existing)
            measured = [m for m in old.measured if m.key not in fresh] + measured
        except (ValueError, KeyError, TypeError):
            pass
    table = TuneTable(model, conf.slot_bytes, tuple(measured), path)
    meta = {
        "cores": len(os.sched_getaffinity(0)),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "dtype": cfg.dtype,
        "iters": cfg.iters,
        "repeat": cfg.repeat,
        "link": dataclasses.asdict(link),
    }
    write_table(table, path, meta)
    return table, link


def summary(table: TuneTable, link: Link | None = None) -> str:
    """What tune found, for people: the model, then per (collective, world size) the winners."""
    lines = []
    if link is not None:
        lines.append(
            f"# link: one-way {format_time(link.small_s)} for {link.small_bytes} B, "
            f"{format_time(link.large_s)} for {format_size(link.large_bytes)}; a call that moves nothing "
            f"{format_time(link.null_s)}"
        )
    lines.append(f"# model: {table.model.describe()}; slot {format_size(table.slot_bytes)}")
    for m in table.measured:
        names = list(m.times_s)
        where = " on comm.alloc buffers" if m.registered else ""
        lines.append(f"# {m.collective}, {m.world_size} ranks{where}: time per call (launches compared side by side)")
        lines.append(f"  {'size':>8}  " + "  ".join(f"{name:>16}" for name in names) + "  fastest")
        for size, best in fastest(m):
            i = m.sizes.index(size)
            cells = [format_time(t) if (t := m.times_s[name][i]) else "-" for name in names]
            lines.append(f"  {format_size(size):>8}  " + "  ".join(f"{c:>16}" for c in cells) + f"  {best}")
        cross = crossovers(m)
        if cross:
            lines.append("  crossovers: " + "; ".join(f"{a} -> {b} by {format_size(s)}" for s, a, b in cross))
    return "\n".join(lines)
