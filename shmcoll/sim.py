"""Cost model and scale simulator: predicted times of the real plans, closed forms beyond them.

**The model.** A plan is simulated as a timed event schedule under an alpha-beta model:

- each rank runs its steps in order, one at a time (a rank is one CPU that does its own copies);
- a step that moves ``b`` bytes through a channel (a send, a receive, or both when fused) keeps
  its rank busy ``b / beta``; a step that only copies or reduces locally keeps it busy
  ``b / beta`` too, at the intra-group bandwidth;
- a message becomes available to its receiver ``alpha`` after the end of the step that sent it,
  so a message costs ``alpha + b / beta`` on its channel, and latency overlaps with the sender's
  next steps;
- a step starts when its rank's previous step is done, its incoming message (if any) has arrived
  and its outgoing channel (if any) has a free slot: channels hold ``nslots`` messages, a slot
  is free again when the step that received its message ends;
- optionally, ranks are in groups of ``group_size`` (several nodes): messages between ranks of
  different groups cost ``inter_alpha + b / inter_beta`` instead. ``hierarchical``'s plans are
  built for the same groups (builder option ``group_size``).

The predicted time of a call is when the last rank finishes. Step and byte counts come from the
plans themselves (``segment`` + the algorithm's builder), never from tables. A call of ``reps``
body pieces is simulated piece by piece until the schedule is periodic (every rank's piece end
times shift by the same amount), then extrapolated: exact for a periodic max-plus schedule.

**Beyond ``EXACT_LIMIT`` ranks** building every rank's plan is infeasible (ring has O(n^2)
steps in all), so the simulator uses a closed form per algorithm. The closed form is *fitted* to
plan-derived figures, the coefficients of the model's parameters in the simulated time of one
piece (``rounds``: the alpha coefficient; ``bytes``: the 1/beta coefficient per byte of the
call), of the steady per-piece increment of a many-piece call (``period_rounds``,
``period_bytes``), and the total bytes sent (``traffic``), as exact rational combinations of a
few functions of ``n`` (1, n, 1/n, n^2, ceil/floor log2 n, ...). A fit is accepted only if it
reproduces the plan-derived figure exactly at every fitted and checked ``n``;
:func:`validate_closed_form` (run by the tests) compares it at every ``n`` up to the limit.
An algorithm with no such fit is reported as "n too large to simulate" above the limit.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from typing import Any

from shmcoll import collectives
from shmcoll.algos import registry
from shmcoll.algos.registry import Algorithm, Query
from shmcoll.bench import BENCH_COLLECTIVES, bus_factor
from shmcoll.plan.ir import CallPlan, Plan
from shmcoll.plan.passes import plan_call

EXACT_LIMIT = 128
"""Plans are simulated exactly up to this many ranks; closed forms are used above it."""

"""Collectives whose size (the largest per-rank buffer, as in ``bench``) is ``world_size`` blocks."""

SIMULATED_COLLECTIVES = BENCH_COLLECTIVES


# --- units -------------------------------------------------------------------------------------
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_BW_UNITS = {"": 1.0, "b": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30}
_BW_UNITS["ti"] = 2.0**40


def parse_time(text: str | float) -> float:
    """``"5us"`` -> 5e-6 seconds; units s, ms, us (or µs), ns; a bare number is seconds."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:[eE][-+]?[0-9]+)?)\s*([a-zµ]*)\s*", text.lower())
        if m is None or m.group(2) not in _TIME_UNITS:
            raise ValueError(f"not a time: {text!r} (expected e.g. 5us, 1.5ms, 2e-6)")
        value = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"time must be finite and >= 0: {text!r}")
    return value


def parse_bandwidth(text: str | float) -> float:
    """``"25GB/s"`` -> 25e9 bytes/s. K/M/G/T are decimal (as in nccl-tests), Ki/Mi/Gi binary."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:[eE][-+]?[0-9]+)?)\s*([kmgt]i?)?b?(?:/s|ps)?\s*", text.lower())
        if m is None:
            raise ValueError(f"not a bandwidth: {text!r} (expected e.g. 25GB/s, 10GiB/s, 1e9)")
        value = float(m.group(1)) * _BW_UNITS[m.group(2) or ""]
    if not value > 0:
        raise ValueError(f"bandwidth must be > 0: {text!r}")
    return value


def format_time(seconds: float) -> str:
    """Seconds in the unit that keeps 3-4 significant digits readable: ``12.5 us``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds / 1e-9:.4g} ns"


def format_bytes(nbytes: float) -> str:
    """Decimal-prefixed bytes with 3 significant digits: ``1.57 GB``."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


# --- the model ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CostModel:
    """Parameters of the alpha-beta model (see the module docstring).

    Attributes:
        alpha_s: latency of one message between ranks of one group, in seconds.
        beta_Bps: bandwidth of one rank's copies within a group, in bytes per second.
        inter_alpha_s: latency between ranks of different groups (default: ``alpha_s``).
        inter_beta_Bps: bandwidth between ranks of different groups (default: ``beta_Bps``).
        group_size: ranks per group (rank ``r`` is in group ``r // group_size``); ``None``: one group.
        nslots: slots per channel.
    """

    alpha_s: float
    beta_Bps: float
    inter_alpha_s: float | None = None
    inter_beta_Bps: float | None = None
    group_size: int | None = None
    nslots: int = 4

    def __post_init__(self) -> None:
        for name in ("alpha_s", "inter_alpha_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
        for name in ("beta_Bps", "inter_beta_Bps"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if (self.inter_alpha_s is not None or self.inter_beta_Bps is not None) and self.group_size is None:
            raise ValueError("inter-group alpha/beta need a group size")
        if self.nslots < 1:
            raise ValueError(f"nslots must be >= 1, got {self.nslots}")

    def costs(self) -> Costs:
        return Costs(
            alpha=self.alpha_s,
            inv_beta=1.0 / self.beta_Bps,
            inter_alpha=self.alpha_s if self.inter_alpha_s is None else self.inter_alpha_s,
            inter_inv_beta=1.0 / (self.beta_Bps if self.inter_beta_Bps is None else self.inter_beta_Bps),
            group_size=self.group_size,
            nslots=self.nslots,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"unknown cost model fields {sorted(unknown)}")
        return cls(**data)

    def describe(self) -> str:
        text = f"alpha {format_time(self.alpha_s)}, beta {self.beta_Bps / 1e9:.4g} GB/s"
        if self.group_size is not None:
            c = self.costs()
            text += (
                f"; groups of {self.group_size}: inter-group alpha {format_time(c.inter_alpha)}, "
                f"beta {1 / c.inter_inv_beta / 1e9:.4g} GB/s"
            )
        return text + f"; {self.nslots} slots per channel"


@dataclasses.dataclass(frozen=True)
class Costs:
    """The model as the simulator uses it: inverse bandwidths, so a probe can set one to 1 or 0."""

    alpha: float
    inv_beta: float
    inter_alpha: float
    inter_inv_beta: float
    group_size: int | None
    nslots: int


# --- simulating a plan ----------------------------------------------------------------------------
Compiled = list[list[tuple[int, int, int]]]  # per rank: (recv peer or -1, send peer or -1, nbytes)


def compile_plan(plan: Plan, itemsize: int) -> Compiled:
    """Each rank's steps reduced to what the model charges: who it hears, who it tells, bytes."""
    return [
        [(-1 if s.recv is None else s.recv, -1 if s.send is None else s.send, s.count * itemsize) for s in program]
        for program in plan.programs
    ]


Timed = list[list[tuple[int, int, float, float]]]  # per rank: (in channel, out channel, busy s, latency s)


def _timed(progs: Sequence[Compiled], costs: Costs) -> tuple[list[Timed], int]:
    """Apply the costs: each step's incoming and outgoing channel (dense ids, -1 for none), how
    long it keeps its rank busy, and the latency of its outgoing message. One id space for all
    ``progs`` (a body and a tail share channels)."""
    n = len(progs[0])
    g = costs.group_size
    group = [r // g for r in range(n)] if g else [0] * n
    ids: dict[int, int] = {}
    out: list[Timed] = []
    for prog in progs:
        timed: Timed = []
        for r, steps in enumerate(prog):
            gr = group[r]
            rows = []
            for rv, sd, nbytes in steps:
                cin = cout = -1
                busy = lat = 0.0
                if rv >= 0:
                    cin = ids.setdefault(rv * n + r, len(ids))
                    busy = nbytes * (costs.inv_beta if group[rv] == gr else costs.inter_inv_beta)
                if sd >= 0:
                    cout = ids.setdefault(r * n + sd, len(ids))
                    same = group[sd] == gr
                    busy = max(busy, nbytes * (costs.inv_beta if same else costs.inter_inv_beta))
                    lat = costs.alpha if same else costs.inter_alpha
                elif rv < 0:
                    busy = nbytes * costs.inv_beta
                rows.append((cin, cout, busy, lat))
            timed.append(rows)
        out.append(timed)
    return out, len(ids)


def _run(body: Timed | None, tail: Timed, reps: int, nchannels: int, nslots: int) -> tuple[float, list[list[float]]]:
    """Simulate ``reps`` runs of ``body`` then ``tail``; the finish time and each rank's body piece ends.

    Like the verifier, ranks advance as far as their messages and slots allow, sweep after sweep:
    a Kahn network, so the times do not depend on the sweep order. Per channel, ``inflight`` holds
    the arrival times of messages not yet received and ``free`` the times its free slots were
    released (``nslots`` in all, free at time 0 to begin with).
    """
    n = len(tail)
    inflight: list[collections.deque[float]] = [collections.deque() for _ in range(nchannels)]
    free: list[collections.deque[float]] = [collections.deque([0.0] * nslots) for _ in range(nchannels)]
    clock = [0.0] * n
    pcs = [0] * n
    bodies = body if body is not None else [[] for _ in range(n)]
    lens_body = [len(p) for p in bodies]
    totals = [reps * lens_body[r] + len(tail[r]) for r in range(n)]
    piece_ends: list[list[float]] = [[] for _ in range(n)]
    done = sum(1 for r in range(n) if totals[r] == 0)
    while done < n:
        progressed = False
        for r in range(n):
            pc, total = pcs[r], totals[r]
            if pc >= total:
                continue
            lb = lens_body[r]
            nb = reps * lb
            prog_b = bodies[r]
            prog_t = tail[r]
            ends = piece_ends[r]
            t_rank = clock[r]
            j = pc % lb if pc < nb else pc - nb
            while pc < total:
                cin, cout, busy, lat = prog_b[j] if pc < nb else prog_t[j]
                if cin >= 0:
                    q = inflight[cin]
                    if not q:
                        break
                if cout >= 0:
                    fr = free[cout]
                    if not fr:
                        break
                start = t_rank
                if cin >= 0:
                    arrival = q.popleft()
                    if arrival > start:
                        start = arrival
                if cout >= 0:
                    freed = fr.popleft()
                    if freed > start:
                        start = freed
                t_rank = start + busy
                if cin >= 0:
                    free[cin].append(t_rank)
                if cout >= 0:
                    inflight[cout].append(t_rank + lat)
                pc += 1
                j += 1
                if pc <= nb and j == lb:
                    ends.append(t_rank)
                    j = 0
            if pc != pcs[r]:
                progressed = True
                pcs[r] = pc
                clock[r] = t_rank
                if pc >= total:
                    done += 1
        if not progressed and done < n:
            stuck = [f"rank {r} at step {pcs[r]}" for r in range(n) if pcs[r] < totals[r]]
            raise RuntimeError(f"simulated plan deadlocks with {nslots} slot(s): " + "; ".join(stuck[:8]))
    return max(clock, default=0.0), piece_ends


def run_compiled(body: Compiled | None, tail: Compiled, reps: int, costs: Costs) -> tuple[float, list[list[float]]]:
    """Simulate ``reps`` body pieces then the tail, every piece (no extrapolation)."""
    if body is None:
        (t,), m = _timed([tail], costs)
        return _run(None, t, 0, m, costs.nslots)
    (b, t), m = _timed([body, tail], costs)
    return _run(b, t, reps, m, costs.nslots)


def _period(piece_ends: list[list[float]], rel_tol: float = 1e-9) -> tuple[int, float] | None:
    """``(cycle, shift)`` if the second half of every rank's piece ends repeats every ``cycle`` pieces.

    The schedule of a segmented call is a max-plus linear recurrence, which becomes periodic
    after a transient: every time shifts by the same amount every ``cycle`` pieces (with bounded
    slots, e.g., four pieces may pass a channel per latency: cycle 4). The whole second half is
    checked, not just the last pieces, so a run of equal ends inside a longer cycle is not
    mistaken for a cycle of one.
    """
    ends = [e for e in piece_ends if e]
    if not ends:
        return None
    k = len(ends[0])
    if any(len(e) != k for e in ends):
        return None
    start = k // 2
    scale = max(abs(e[-1]) for e in ends) or 1.0
    tol = rel_tol * scale
    for cycle in range(1, (k - start) // 2 + 1):
        shift = ends[0][-1] - ends[0][-1 - cycle]
        if all(abs(e[i] - e[i - cycle] - shift) <= tol for e in ends for i in range(start, k)):
            return cycle, shift
    return None


@dataclasses.dataclass(frozen=True)
class Simulated:
    """What :func:`simulate` found for one call."""

    time_s: float
    traffic_bytes: int
    pieces: int
    simulated_pieces: int
    exact: bool


EXACT_PIECES = 8
_TRY_PIECES = (8, 16, 32)


def simulate(plan: CallPlan, itemsize: int, model: CostModel | Costs) -> Simulated:
    """The predicted time of a whole call (``plan.reps`` body pieces, then the tail)."""
    costs = model.costs() if isinstance(model, CostModel) else model
    tail = compile_plan(plan.tail, itemsize)
    body = compile_plan(plan.body, itemsize) if plan.body is not None else None
    traffic = sum(s[2] for prog in tail for s in prog if s[1] >= 0)
    if body is not None:
        traffic += plan.reps * sum(s[2] for prog in body for s in prog if s[1] >= 0)
    reps = plan.reps if body is not None else 0
    if body is None:
        (tt,), m = _timed([tail], costs)
        bt = None
    else:
        (bt, tt), m = _timed([body, tail], costs)
    if reps <= EXACT_PIECES:
        t, _ = _run(bt, tt, reps, m, costs.nslots)
        return Simulated(t, traffic, reps + 1, reps + 1, True)
    last: tuple[float, list[list[float]], int] | None = None
    for k in _TRY_PIECES:
        if k >= reps:
            t, _ = _run(bt, tt, reps, m, costs.nslots)
            return Simulated(t, traffic, reps + 1, reps + 1, True)
        t, ends = _run(bt, tt, k, m, costs.nslots)
        last = (t, ends, k)
        found = _period(ends)
        if found is not None:
            cycle, shift = found
            extra = (reps - k) % cycle
            if extra:
                # Land on the same phase of the cycle: simulate the few pieces that remain.
                k += extra
                t, _ = _run(bt, tt, k, m, costs.nslots)
            return Simulated(t + (reps - k) // cycle * shift, traffic, reps + 1, k + 1, True)
    # No period within the pieces tried: extrapolate with the largest mean increment (approximate).
    assert last is not None
    t, ends, k = last
    half = k // 2
    incs = [(e[-1] - e[half - 1]) / (k - half) for e in ends if e]
    mean = max(incs) if incs else 0.0
    return Simulated(t + (reps - k) * mean, traffic, reps + 1, k + 1, False)


# --- predictions ---------------------------------------------------------------------------------
def plan_options(group_size: int | None) -> dict[str, object] | None:
    """Builder options for a modelled machine: ``hierarchical`` groups ranks as the model does."""
    return None if group_size is None else {"group_size": group_size}


def count_for(collective: str, world_size: int, size_bytes: int, itemsize: int) -> int:
    """Elements per block of a call whose size (the largest per-rank buffer) is ``size_bytes``."""
    blocks = world_size if collectives.get(collective).blocked else 1
    return size_bytes // itemsize // blocks


def size_of(collective: str, world_size: int, count: int, itemsize: int) -> int:
    """The size of a call (bench's convention: allgather's output, reduce_scatter's input)."""
    return collectives.get(collective).call_bytes(world_size, count, itemsize)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One row of the simulator's table."""

    collective: str
    algorithm: str
    world_size: int
    size_bytes: int
    time_s: float | None
    traffic_bytes: float | None
    method: str
    note: str = ""

    @property
    def algbw_GBps(self) -> float | None:
        if not self.time_s:
            return None
        return self.size_bytes / self.time_s / 1e9

    @property
    def busbw_GBps(self) -> float | None:
        algbw = self.algbw_GBps
        return None if algbw is None else algbw * bus_factor(self.collective, self.world_size)


@functools.lru_cache(maxsize=4096)
def plan_time(
    algorithm: Algorithm, world_size: int, count: int, itemsize: int, model: CostModel, slot_bytes: int, root: int = 0
) -> Simulated:
    """Simulate ``algorithm`` on a call of ``count`` elements per block (cached)."""
    slot_capacity = max(1, slot_bytes // itemsize)
    options = plan_options(model.group_size)
    plan = plan_call(algorithm, world_size, count, slot_capacity, root=root, options=options, nslots=model.nslots)
    return simulate(plan, itemsize, model)


def predict(
    collective: str,
    algorithm: str,
    world_size: int,
    size_bytes: int,
    model: CostModel,
    *,
    itemsize: int = 4,
    slot_bytes: int = 64 << 10,
    root: int = 0,
    limit: int = EXACT_LIMIT,
) -> Prediction:
    """Predicted time of one call: the real plan up to ``limit`` ranks, the closed form above.

    Raises:
        ValueError: an unknown algorithm or a bad argument.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    alg = registry.get(collective, algorithm)
    count = count_for(collective, world_size, size_bytes, itemsize)
    size = size_of(collective, world_size, count, itemsize)

    def row(time_s: float | None, traffic: float | None, method: str, note: str = "") -> Prediction:
        return Prediction(collective, algorithm, world_size, size, time_s, traffic, method, note)

    reason = alg.supports(Query(collective, world_size, count, itemsize, root=root))
    if reason is not None:
        return row(None, None, "", f"unsupported: {reason}")
    if world_size <= limit:
        sim = plan_time(alg, world_size, count, itemsize, model, slot_bytes, root)
        return row(sim.time_s, sim.traffic_bytes, "plan" if sim.exact else "plan~")
    form = closed_form(collective, algorithm, model.group_size, model.nslots)
    if form is None:
        return row(None, None, "", "n too large to simulate (no closed form)")
    if not form.holds_at(world_size):
        return row(None, None, "", f"n too large to simulate (closed form only for {form.domain})")
    t = form.time(alg, world_size, count, itemsize, max(1, slot_bytes // itemsize), model)
    return row(t, float(form.figures(world_size)["traffic"]) * size, "closed form")


def call_time(
    alg: Algorithm,
    world_size: int,
    count: int,
    itemsize: int,
    model: CostModel,
    slot_bytes: int,
    root: int = 0,
    limit: int = EXACT_LIMIT,
) -> float | None:
    """The predicted seconds of one call, or ``None`` where neither a plan nor a closed form can say.

    The caller has checked that ``alg`` supports the call.
    """
    if world_size <= limit:
        return plan_time(alg, world_size, count, itemsize, model, slot_bytes, root).time_s
    form = closed_form(alg.collective, alg.name, model.group_size, model.nslots)
    if form is None or not form.holds_at(world_size):
        return None
    return form.time(alg, world_size, count, itemsize, max(1, slot_bytes // itemsize), model)


# --- closed forms ---------------------------------------------------------------------------------
def _clog(n: int) -> int:
    return (n - 1).bit_length()


def _flog(n: int) -> int:
    return n.bit_length() - 1


BASIS: dict[str, Callable[[int], Fraction]] = {
    "1": lambda n: Fraction(1),
    "n": lambda n: Fraction(n),
    "1/n": lambda n: Fraction(1, n),
    "clog": lambda n: Fraction(_clog(n)),
    "flog": lambda n: Fraction(_flog(n)),
    "n^2": lambda n: Fraction(n * n),
    "n*clog": lambda n: Fraction(n * _clog(n)),
    "clog/n": lambda n: Fraction(_clog(n), n),
    "pow2": lambda n: Fraction(1 << _clog(n)),
}
"""Functions of ``n`` a closed form may combine; clog/flog are ceil/floor of log2 n, pow2 the
next power of two."""

_BASIS_TEXT = {
    "1": "",
    "n": "n",
    "1/n": "/n",
    "clog": "ceil(log2 n)",
    "flog": "floor(log2 n)",
    "n^2": "n^2",
    "n*clog": "n ceil(log2 n)",
    "clog/n": "ceil(log2 n)/n",
    "pow2": "2^ceil(log2 n)",
}
_TEXT_ORDER = ("n^2", "n*clog", "pow2", "n", "clog", "flog", "1", "clog/n", "1/n")
MAX_TERMS = 4
MIN_FIT_POINTS = 5


@dataclasses.dataclass(frozen=True)
class Formula:
    """An exact rational combination of :data:`BASIS` functions."""

    terms: tuple[tuple[str, Fraction], ...]

    def __call__(self, n: int) -> Fraction:
        return sum((c * BASIS[name](n) for name, c in self.terms), Fraction(0))

    def __str__(self) -> str:
        parts = []
        for name, c in sorted(self.terms, key=lambda t: _TEXT_ORDER.index(t[0])):
            if name == "1/n":
                parts.append(f"{c}/n")
            elif name == "1":
                parts.append(str(c))
            else:
                coef = "" if c == 1 else "-" if c == -1 else f"{c} "
                parts.append(coef + _BASIS_TEXT[name])
        text = " + ".join(parts) if parts else "0"
        return text.replace("+ -", "- ")


def _solve(rows: list[list[Fraction]], rhs: list[Fraction]) -> list[Fraction] | None:
    """Exact Gaussian elimination; ``None`` if singular."""
    k = len(rows)
    m = [row[:] + [r] for row, r in zip(rows, rhs, strict=True)]
    for col in range(k):
        pivot = next((i for i in range(col, k) if m[i][col] != 0), None)
        if pivot is None:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for i in range(k):
            if i != col and m[i][col] != 0:
                f = m[i][col] / m[col][col]
                m[i] = [a - f * b for a, b in zip(m[i], m[col], strict=True)]
    return [m[i][k] / m[i][i] for i in range(k)]


def _dot(xs: list[Fraction], ys: list[Fraction]) -> Fraction:
    return sum((x * y for x, y in zip(xs, ys, strict=True)), Fraction(0))


def fit(points: dict[int, Fraction], max_terms: int = MAX_TERMS) -> Formula | None:
    """The simplest combination of basis functions that equals ``points`` exactly, if any.

    Subsets of :data:`BASIS` are tried from one function up; a subset's coefficients solve the
    exact least-squares normal equations over every point, and the fit counts only if it then
    reproduces every point exactly.
    """
    ns = sorted(points)
    ys = [points[n] for n in ns]
    if all(y == 0 for y in ys):
        return Formula(())
    names = list(BASIS)
    cols = {name: [BASIS[name](n) for n in ns] for name in names}
    for size in range(1, max_terms + 1):
        if size >= len(ns):  # keep at least one point beyond the unknowns, or any fit "works"
            break
        for subset in itertools.combinations(names, size):
            a = [cols[name] for name in subset]
            normal = [[_dot(a[i], a[j]) for j in range(size)] for i in range(size)]
            rhs = [_dot(a[i], ys) for i in range(size)]
            coef = _solve(normal, rhs)
            if coef is None or any(c == 0 for c in coef):
                continue
            if all(sum(c * col[p] for c, col in zip(coef, a, strict=True)) == ys[p] for p in range(len(ns))):
                return Formula(tuple(zip(subset, coef, strict=True)))
    return None


FIT_SLOT = 20160  # elements per slot while fitting: 2^6 3^2 5 7, so chunks divide evenly
FIGURES = ("rounds", "bytes", "period_rounds", "period_bytes", "traffic")
INTER_FIGURES = ("inter_rounds", "inter_bytes", "inter_period_rounds", "inter_period_bytes")


class NoPeriod(RuntimeError):
    """A probe's schedule did not become periodic within the pieces simulated."""


def _probe(which: str, group_size: int | None, nslots: int) -> Costs:
    values = dict.fromkeys(("alpha", "inv_beta", "inter_alpha", "inter_inv_beta"), 0.0)
    values[which] = 1.0
    if group_size is None:  # one group: the inter parameters never apply, tie them to the intra ones
        values["inter_alpha"], values["inter_inv_beta"] = values["alpha"], values["inv_beta"]
    return Costs(group_size=group_size, nslots=nslots, **values)


@functools.lru_cache(maxsize=2048)
def plan_figures(
    collective: str, algorithm: str, world_size: int, group_size: int | None = None, nslots: int = 4
) -> dict[str, Fraction] | None:
    """The figures a closed form must reproduce, measured on the real plan (see the module doc).

    ``rounds``/``bytes``: the alpha and per-byte 1/beta coefficients of the simulated time of a
    call that is one piece; ``period_*``: the same for the steady increment per extra piece;
    ``traffic``: total bytes sent by all ranks per byte of the call's size; ``inter_*``: the
    coefficients of the inter-group parameters when ``group_size`` is given. Returns a dict of
    exact fractions, or ``None`` when the algorithm cannot serve this ``world_size``.
    """
    alg = registry.get(collective, algorithm)
    n = world_size
    options = plan_options(group_size)
    piece = max(1, alg.piece_count(FIT_SLOT, n, options))
    if alg.supports(Query(collective, n, piece, 1)) is not None:
        return None
    plan = plan_call(alg, n, piece, FIT_SLOT, options=options, nslots=nslots)
    prog = compile_plan(plan.tail, 1)
    size = size_of(collective, n, piece, 1)
    out: dict[str, Fraction] = {}
    probes = [("alpha", "rounds", "period_rounds"), ("inv_beta", "bytes", "period_bytes")]
    if group_size is not None:
        probes += [
            ("inter_alpha", "inter_rounds", "inter_period_rounds"),
            ("inter_inv_beta", "inter_bytes", "inter_period_bytes"),
        ]
    for which, single_name, period_name in probes:
        costs = _probe(which, group_size, nslots)
        unit = size if which.endswith("inv_beta") else 1
        (timed,), m = _timed([prog], costs)
        single, _ = _run(None, timed, 0, m, nslots)
        out[single_name] = Fraction(single) / unit
        period = None
        for k in (*_TRY_PIECES, 64):
            _, ends = _run(timed, timed, k, m, nslots)
            period = _period(ends)
            if period is not None:
                break
        if period is None:
            raise NoPeriod(f"{collective}/{algorithm} n={n}: no periodic schedule within 64 pieces")
        cycle, shift = period
        out[period_name] = Fraction(shift) / (cycle * unit)
    out["traffic"] = Fraction(sum(s[2] for p in prog for s in p if s[1] >= 0), size)
    return out


@dataclasses.dataclass(frozen=True)
class Domain:
    """The world sizes a closed form is fitted on, checked on, and claims to hold for."""

    name: str
    fit_ns: tuple[int, ...]
    check_ns: tuple[int, ...]
    member: Callable[[int], bool]


def _multiple(g: int, n: int) -> bool:
    return n % g == 0 and n >= 2 * g


def _groups_power_of_2(g: int, n: int) -> bool:
    groups, rest = divmod(n, g)
    return rest == 0 and groups >= 4 and groups & (groups - 1) == 0


def _at_least(n0: int, n: int) -> bool:
    return n >= n0


def domains(group_size: int | None) -> list[Domain]:
    """Candidate domains, widest first: every n >= n0 (n0 from 3 up to 8), multiples of the group
    size from two groups up, powers of 2 from 4, then a power of 2 of groups (from four).

    Small world sizes are often special cases of an algorithm (two ranks make a single exchange;
    a fused step may disappear at three), and never need a closed form: every n up to
    ``EXACT_LIMIT`` is simulated on its plan. So the fits start at 3, then later if need be.
    """
    points = tuple(range(3, 13)) + (16, 20, 24, 32, 48, 64)
    out = [
        Domain(f"n >= {n0}", tuple(n for n in points if n >= n0), (96,), functools.partial(_at_least, n0))
        for n0 in (3, 4, 5, 6, 8)
    ]
    if group_size is not None and group_size >= 2:
        # From two groups up: a single group has no inter-group messages at all.
        g = group_size
        if 10 * g <= 2 * EXACT_LIMIT:
            fit_ns = tuple(g * k for k in range(2, 9))
            check_ns = (9 * g, 10 * g)
            out.append(Domain(f"n a multiple of {g} >= {2 * g}", fit_ns, check_ns, functools.partial(_multiple, g)))
    out.append(Domain("n a power of 2 >= 4", (4, 8, 16, 32, 64), (128,), lambda n: n >= 4 and n & (n - 1) == 0))
    if group_size is not None and group_size >= 2 and 128 * group_size <= 8 * EXACT_LIMIT:
        # A power of two of groups, from four: trees over the groups (dbtree, and hierarchical's
        # inter-group phase) are regular only there, as dbtree's own closed form is on powers of
        # 2 (and two groups are a tree of two, each rank the other's root: a special case).
        g = group_size
        out.append(
            Domain(
                f"n = {g} x a power of 2 >= {4 * g}",
                tuple(g << k for k in range(2, 7)),
                (g << 7,),
                functools.partial(_groups_power_of_2, g),
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class ClosedForm:
    """Figures of one algorithm as formulas in ``n``, valid on ``domain``."""

    collective: str
    algorithm: str
    group_size: int | None
    nslots: int
    domain: str
    member: Callable[[int], bool]
    formulas: tuple[tuple[str, Formula], ...]

    def holds_at(self, n: int) -> bool:
        return self.member(n)

    def figures(self, n: int) -> dict[str, Fraction]:
        return {name: f(n) for name, f in self.formulas}

    def time(self, alg: Algorithm, n: int, count: int, itemsize: int, slot_capacity: int, model: CostModel) -> float:
        """Predicted time of a call: the first piece, then one period per further piece."""
        f = {k: float(v) for k, v in self.figures(n).items()}
        c = model.costs()
        piece = max(1, alg.piece_count(slot_capacity, n, plan_options(self.group_size)))

        def cost(prefix: str, elements: int) -> float:
            nbytes = size_of(self.collective, n, elements, itemsize)
            t = f[prefix + "rounds"] * c.alpha + f[prefix + "bytes"] * nbytes * c.inv_beta
            if self.group_size is not None:
                inter = "inter_" + prefix
                t += f[inter + "rounds"] * c.inter_alpha + f[inter + "bytes"] * nbytes * c.inter_inv_beta
            return t

        if count <= piece:
            return cost("", count)
        reps = (count - 1) // piece
        return cost("", piece) + (reps - 1) * cost("period_", piece) + cost("period_", count - reps * piece)


@functools.lru_cache(maxsize=256)
def closed_form(collective: str, algorithm: str, group_size: int | None = None, nslots: int = 4) -> ClosedForm | None:
    """Fit ``algorithm``'s closed form (``None`` if no domain fits every figure exactly)."""
    names = FIGURES + (INTER_FIGURES if group_size is not None else ())
    for dom in domains(group_size):
        data: dict[int, dict[str, Fraction]] = {}
        try:
            for n in dom.fit_ns + dom.check_ns:
                figs = plan_figures(collective, algorithm, n, group_size, nslots)
                if figs is not None:
                    data[n] = figs
        except NoPeriod:
            continue
        fit_ns = [n for n in dom.fit_ns if n in data]
        if len(fit_ns) < MIN_FIT_POINTS:
            continue
        formulas = []
        for name in names:
            formula = fit({n: data[n][name] for n in fit_ns})
            if formula is None or any(formula(n) != data[n][name] for n in dom.check_ns if n in data):
                break
            formulas.append((name, formula))
        else:
            return ClosedForm(collective, algorithm, group_size, nslots, dom.name, dom.member, tuple(formulas))
    return None


def validate_closed_form(form: ClosedForm, ns: Iterable[int]) -> list[str]:
    """Where ``form`` differs from the plan-derived figures, for each ``n`` of ``ns`` in its domain."""
    problems = []
    for n in ns:
        if not form.holds_at(n):
            continue
        figs = plan_figures(form.collective, form.algorithm, n, form.group_size, form.nslots)
        if figs is None:
            continue
        for name, value in form.figures(n).items():
            if figs[name] != value:
                where = f"{form.collective}/{form.algorithm} n={n}"
                problems.append(f"{where}: {name} = {figs[name]} from the plan, {value} from the closed form")
    return problems


# --- the table -----------------------------------------------------------------------------------
def sweep(
    collective: str,
    algorithms: Sequence[str],
    world_sizes: Sequence[int],
    sizes: Sequence[int],
    model: CostModel,
    *,
    itemsize: int = 4,
    slot_bytes: int = 64 << 10,
    root: int = 0,
    limit: int = EXACT_LIMIT,
) -> tuple[list[Prediction], list[str]]:
    """Predictions for every (algorithm, world size, size); names not registered become notes."""
    if collective not in SIMULATED_COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; one of {', '.join(SIMULATED_COLLECTIVES)}")
    registered = {a.name for a in registry.algorithms(collective)}
    rows: list[Prediction] = []
    notes: list[str] = []
    for name in algorithms:
        if name not in registered:
            notes.append(f"{name}: not registered for {collective}, skipped")
            continue
        for n in world_sizes:
            for size in sizes:
                r = root if collective in ("broadcast", "reduce", "gather", "scatter") else 0
                rows.append(
                    predict(
                        collective,
                        name,
                        n,
                        size,
                        model,
                        itemsize=itemsize,
                        slot_bytes=slot_bytes,
                        root=r % n,
                        limit=limit,
                    )
                )
    return rows, notes


_COLUMNS = ("algorithm", "ranks", "size", "time", "algbw (GB/s)", "busbw (GB/s)", "traffic", "method")


def _cells(p: Prediction) -> list[str]:
    from shmcoll.config import format_size

    if p.time_s is None:
        return [p.algorithm, str(p.world_size), format_size(p.size_bytes), "-", "-", "-", "-", p.note]
    return [
        p.algorithm,
        str(p.world_size),
        format_size(p.size_bytes),
        format_time(p.time_s),
        f"{p.algbw_GBps:.3g}" if p.algbw_GBps is not None else "-",
        f"{p.busbw_GBps:.3g}" if p.busbw_GBps is not None else "-",
        format_bytes(p.traffic_bytes or 0.0),
        p.method + (f" ({p.note})" if p.note else ""),
    ]


def format_table(rows: Sequence[Prediction], notes: Sequence[str] = (), *, markdown: bool = False) -> str:
    """The simulator's table, plain text (``#`` comment lines) or markdown."""
    cells = [_cells(p) for p in rows]
    lines: list[str] = []
    if markdown:
        lines.append("| " + " | ".join(_COLUMNS) + " |")
        lines.append(
            "|" + "|".join(" ---: " if i in (1, 2, 3, 4, 5, 6) else " --- " for i in range(len(_COLUMNS))) + "|"
        )
        lines.extend("| " + " | ".join(c) + " |" for c in cells)
        if notes:
            lines.append("")
            lines.extend(f"- {note}" for note in notes)
        return "\n".join(lines)
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(_COLUMNS)]
    for note in notes:
        lines.append(f"# note: {note}")
    lines.append(
        "# " + "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(_COLUMNS, widths, strict=True)))
    )
    for c in cells:
        cols = (x.rjust(w) if 0 < i < 7 else x.ljust(w) for i, (x, w) in enumerate(zip(c, widths, strict=True)))
        lines.append(("  " + "  ".join(cols)).rstrip())
    return "\n".join(lines)


def format_closed_forms(forms: dict[str, ClosedForm | None], *, markdown: bool = False) -> str:
    """Each algorithm's fitted figures as formulas in n (``None``: no closed form)."""
    names = FIGURES + next((INTER_FIGURES for f in forms.values() if f and f.group_size is not None), ())
    if markdown:
        lines = ["| algorithm | holds for | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 2)]
        for alg, form in forms.items():
            if form is None:
                lines.append(f"| {alg} | (no closed form) |" + " |" * len(names))
            else:
                figs = dict(form.formulas)
                lines.append(f"| {alg} | {form.domain} | " + " | ".join(str(figs[k]) for k in names) + " |")
        return "\n".join(lines)
    lines = []
    for alg, form in forms.items():
        if form is None:
            lines.append(f"# {alg}: no closed form")
            continue
        lines.append(f"# {alg}: closed form for {form.domain}")
        lines.extend(f"#   {k:<22} = {f}" for k, f in form.formulas)
    return "\n".join(lines)


def plot(rows: Sequence[Prediction], path: str, title: str = "") -> None:
    """Predicted time vs ranks, one panel per size, one line per algorithm (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install 'shmcoll[plot]'") from None
    sizes = sorted({p.size_bytes for p in rows})
    fig, axes = plt.subplots(1, max(1, len(sizes)), figsize=(4.5 * max(1, len(sizes)), 4), squeeze=False)
    from shmcoll.config import format_size

    for ax, size in zip(axes[0], sizes, strict=False):
        by_alg: dict[str, list[tuple[int, float]]] = {}
        for p in rows:
            if p.size_bytes == size and p.time_s:
                by_alg.setdefault(p.algorithm, []).append((p.world_size, p.time_s))
        for name, pts in by_alg.items():
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel("predicted time (s)")
        ax.set_title(f"{format_size(size)}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
