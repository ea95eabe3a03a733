"""The cost model of a plan and its event simulation: how long a call takes, from its plan.

**The model** is alpha-beta per message, applied to the real steps of every rank
(:class:`CostModel`; :class:`Costs` is the same with inverse bandwidths, as the simulator uses
it):

- each rank runs its steps in order, one at a time (a rank is one CPU that does its own copies);
- a step that moves ``b`` bytes through a channel (a send, a receive, or both when fused) keeps
  its rank busy ``b / beta``; a step that only copies or reduces locally keeps it busy
  ``b / beta`` too, at the intra-group bandwidth;
- a message becomes available to its receiver ``alpha`` after the end of the step that sent it,
  so a message costs ``alpha + b / beta`` on its channel, and latency overlaps with the sender's
  next steps;
- **slots**: a step starts when its rank's previous step is done, its incoming message (if any)
  has arrived and its outgoing channel (if any) has a free slot: channels hold ``nslots``
  messages, as the engine's rings do, and a slot is free again when the step that received its
  message ends;
- optionally, ranks are in groups of ``group_size`` (several nodes): messages between ranks of
  different groups cost ``inter_alpha + b / inter_beta`` instead. ``hierarchical``'s plans are
  built for the same groups (builder option ``group_size``, see :func:`plan_options`).

The predicted time of a call is when the last rank finishes. Step and byte counts come from the
plans themselves (``plan_call`` + the algorithm's builder), never from tables:
:func:`compile_plan` reduces each step to who it hears, who it tells and how many bytes, and
:func:`run_compiled` runs the ranks against bounded FIFO channels.

**Pipelining.** A call of ``reps`` body pieces (each step moves at most one slot) overlaps its
pieces as far as slots and messages allow. :func:`simulate` runs it piece by piece until the
schedule is periodic (every rank's piece end times shift by the same amount every ``cycle``
pieces), then extrapolates: exact for a periodic max-plus schedule.

:func:`plan_time` simulates an algorithm's plan for one call shape (cached); ``call_time``
does so up to ``EXACT_LIMIT`` ranks and uses the algorithm's closed form above
(:mod:`shmcoll.algos.closed_forms`). ``algorithm="auto"`` (:mod:`shmcoll.algos.select`), ``shmcoll tune``
and the scale tool :mod:`shmcoll.sim` are built on this module.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

from shmcoll import collectives
from shmcoll.plan.algorithm import AlgorithmLike as Algorithm
from shmcoll.plan.builder import split
from shmcoll.plan.ir import CallPlan, Plan
from shmcoll.plan.passes import plan_call
from shmcoll.units import format_time

EXACT_LIMIT = 128
"""Plans are simulated exactly up to this many ranks; closed forms are used above it."""


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
    """Each rank's steps reduced to what the model charges: who it hears, who it tells, bytes.

    A step that sends and also copies what it sends into a local buffer (``plan.passes``' fusion
    of a send with the copy after it) is charged as that send and then that copy: the engine
    makes both copies, and from a few KiB publishes the message before the local one."""
    out: Compiled = []
    for program in plan.programs:
        rows = []
        for s in program:
            nbytes = s.count * itemsize
            rows.append((-1 if s.recv is None else s.recv, -1 if s.send is None else s.send, nbytes))
            if s.send is not None and s.recv is None and s.dst is not None:
                rows.append((-1, -1, nbytes))
        out.append(rows)
    return out


Timed = list[list[tuple[int, int, float, float]]]  # per rank: (in channel, out channel, busy s, latency s)


def time_programs(progs: Sequence[Compiled], costs: Costs) -> tuple[list[Timed], int]:
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


def run_timed(
    body: Timed | None, tail: Timed, reps: int, nchannels: int, nslots: int
) -> tuple[float, list[list[float]]]:
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
        (t,), m = time_programs([tail], costs)
        return run_timed(None, t, 0, m, costs.nslots)
    (b, t), m = time_programs([body, tail], costs)
    return run_timed(b, t, reps, m, costs.nslots)


def steady_period(piece_ends: list[list[float]], rel_tol: float = 1e-9) -> tuple[int, float] | None:
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
TRY_PIECES = (8, 16, 32)


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
        (tt,), m = time_programs([tail], costs)
        bt = None
    else:
        (bt, tt), m = time_programs([body, tail], costs)
    if reps <= EXACT_PIECES:
        t, _ = run_timed(bt, tt, reps, m, costs.nslots)
        return Simulated(t, traffic, reps + 1, reps + 1, True)
    last: tuple[float, list[list[float]], int] | None = None
    for k in TRY_PIECES:
        if k >= reps:
            t, _ = run_timed(bt, tt, reps, m, costs.nslots)
            return Simulated(t, traffic, reps + 1, reps + 1, True)
        t, ends = run_timed(bt, tt, k, m, costs.nslots)
        last = (t, ends, k)
        found = steady_period(ends)
        if found is not None:
            cycle, shift = found
            extra = (reps - k) % cycle
            if extra:
                # Land on the same phase of the cycle: simulate the few pieces that remain.
                k += extra
                t, _ = run_timed(bt, tt, k, m, costs.nslots)
            return Simulated(t + (reps - k) // cycle * shift, traffic, reps + 1, k + 1, True)
    # No period within the pieces tried: extrapolate with the largest mean increment (approximate).
    assert last is not None
    t, ends, k = last
    half = k // 2
    incs = [(e[-1] - e[half - 1]) / (k - half) for e in ends if e]
    mean = max(incs) if incs else 0.0
    return Simulated(t + (reps - k) * mean, traffic, reps + 1, k + 1, False)


# --- an algorithm's call ---------------------------------------------------------------------------
def plan_options(group_size: int | None) -> dict[str, object] | None:
    """Builder options for a modelled machine: ``hierarchical`` groups ranks as the model does."""
    return None if group_size is None else {"group_size": group_size}


@functools.lru_cache(maxsize=4096)
def plan_time(
    algorithm: Algorithm, world_size: int, count: int, itemsize: int, model: CostModel, slot_bytes: int, root: int = 0
) -> Simulated:
    """Simulate ``algorithm`` on a call of ``count`` elements per block (cached).

    A variable-count collective's ``count`` is the call's total (the sum of the counts; for
    alltoallv, each rank's send total, as ``bench`` sizes it); it is simulated with that total
    spread evenly over the ranks.
    """
    slot_capacity = max(1, slot_bytes // itemsize)
    options = plan_options(model.group_size)
    counts: tuple[int, ...] = ()
    matrix: tuple[tuple[int, ...], ...] = ()
    if collectives.get(algorithm.collective).varying:
        n = world_size
        if algorithm.collective == "alltoallv":
            row = tuple(c for _, c in split(count, n))
            matrix = (row,) * n
        else:
            counts = tuple(c for _, c in split(count, n))
    plan = plan_call(
        algorithm,
        world_size,
        count,
        slot_capacity,
        root=root,
        options=options,
        nslots=model.nslots,
        counts=counts,
        matrix=matrix,
    )
    return simulate(plan, itemsize, model)
