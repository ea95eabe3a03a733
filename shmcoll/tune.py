"""``shmcoll tune``: calibrate the cost model on this machine and measure every algorithm.

Per world size, one job (``shmcoll.spawn``) runs on its ranks:

1. **the link** (first world size only, ranks 0 and 1): the median one-way time of a small and
   of a large point-to-point message (ping-pong halves), and the median time of a call that
   moves nothing (a world-size-1 communicator), which every call pays whatever its algorithm.
   ``alpha`` and ``beta`` are then solved from the simulator's own figures for the two
   point-to-point plans, so the model is calibrated on the plans it predicts;
2. **the algorithms**: ``bench``'s sweep (``bench_rank``) of every registered algorithm of each
   collective at the requested sizes, out of place, results checked.

The table (``config.tune_file``, JSON) holds the model, the slot size, the measured median
times, and the fastest algorithm per size with the crossovers, and is what ``algorithm="auto"``
reads (:mod:`shmcoll.algos.select`). Entries for (collective, world size) pairs not measured in
this run are kept from an existing table.
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
from shmcoll.sim import CostModel, Costs, simulate


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
    repeat: int = 3  # whole sweeps; each time is the median over them (drift hits every algorithm)
    dtype: str = "float32"
    link_small_bytes: int = 8
    link_large_bytes: int = 16 << 20
    link_iters: int = 100

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

    def _bench(self, n: int) -> bench.BenchConfig:
        return bench.BenchConfig(
            collectives=self.collectives,
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
    """Median half round trip of ``nbytes`` between ranks 0 and 1 (other ranks wait)."""
    buf = np.zeros(nbytes, np.uint8)
    times = np.empty(iters)
    for i in range(-2, iters):  # two untimed rounds build and cache the plans
        if comm.rank == 0:
            t0 = time.perf_counter()
            comm.send(buf, 1)
            comm.recv(buf, 1)
            if i >= 0:
                times[i] = (time.perf_counter() - t0) / 2
        elif comm.rank == 1:
            comm.recv(buf, 0)
            comm.send(buf, 0)
    return float(np.median(times))


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


def _tune_rank(comm: Any, cfg: TuneConfig, measure_link: bool) -> tuple[Link | None, list[bench.Row]]:
    link = None
    if measure_link:
        null_s = _null_call(comm, cfg.link_iters)
        comm.barrier()
        small = _one_way(comm, cfg.link_small_bytes, cfg.link_iters)
        large = _one_way(comm, cfg.link_large_bytes, max(3, cfg.link_iters // 10))
        link = Link(small, large, null_s, cfg.link_small_bytes, cfg.link_large_bytes)
        comm.barrier()
    # Whole sweeps one after another, not one size repeated: a slow spell of the machine (other
    # processes, frequency changes) then lands on different algorithms in different sweeps, and
    # the median over sweeps discards it.
    rows = []
    for _ in range(cfg.repeat):
        rows.extend(bench.bench_rank(comm, cfg._bench(comm.world_size)))
    return (link, rows) if comm.rank == 0 else (None, [])


# --- calibration -----------------------------------------------------------------------------------
def _p2p_coefficients(nbytes: int, slot_bytes: int, nslots: int) -> tuple[float, float]:
    """(alpha, 1/beta) coefficients of the simulated one-way time of an ``nbytes`` message."""
    from shmcoll.plan.passes import segment

    plan = segment(registry.get("p2p", "direct"), 2, nbytes, slot_bytes, root=0, peer=1)
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


def _measured(rows: Sequence[bench.Row]) -> list[Measured]:
    """The tables of times; a (collective, algorithm, size) measured more than once takes the median."""
    by_key: dict[tuple[str, int], dict[str, dict[int, list[float]]]] = {}
    for r in rows:
        per_alg = by_key.setdefault((r.collective, r.world_size), {}).setdefault(r.algorithm, {})
        per_alg.setdefault(r.size, []).append(r.time_us * 1e-6)
    out = []
    for (collective, n), per_alg in by_key.items():
        sizes = tuple(sorted({s for t in per_alg.values() for s in t}))
        times = {name: tuple(float(np.median(t[s])) if s in t else None for s in sizes) for name, t in per_alg.items()}
        out.append(Measured(collective, n, sizes, times))
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
    rows: list[bench.Row] = []
    link_n = min(n for n in cfg.world_sizes if n >= 2)
    for n in sorted(set(cfg.world_sizes)):
        say(f"tuning on {n} rank(s)")
        got_link, got_rows = spawn(_tune_rank, nprocs=n, args=(cfg, n == link_n), timeout=timeout)[0]
        link = got_link or link
        rows.extend(got_rows)
    assert link is not None
    model = calibrate(link, conf.slot_bytes, conf.nslots)
    measured = _measured(rows)
    fresh = {(m.collective, m.world_size, m.group_size) for m in measured}
    existing = _read_existing(path)
    if existing is not None:
        try:
            old = TuneTable.from_json(existing)
            measured = [m for m in old.measured if (m.collective, m.world_size, m.group_size) not in fresh] + measured
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
    from shmcoll.config import format_size
    from shmcoll.sim import format_time

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
        lines.append(f"# {m.collective}, {m.world_size} ranks: median time per call")
        lines.append(f"  {'size':>8}  " + "  ".join(f"{name:>16}" for name in names) + "  fastest")
        for size, best in fastest(m):
            i = m.sizes.index(size)
            cells = [format_time(t) if (t := m.times_s[name][i]) else "-" for name in names]
            lines.append(f"  {format_size(size):>8}  " + "  ".join(f"{c:>16}" for c in cells) + f"  {best}")
        cross = crossovers(m)
        if cross:
            lines.append("  crossovers: " + "; ".join(f"{a} -> {b} by {format_size(s)}" for s, a, b in cross))
    return "\n".join(lines)
