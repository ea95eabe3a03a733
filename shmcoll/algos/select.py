"""Which algorithm serves a call when the caller says ``algorithm="auto"``.

An explicit name must serve the call or the call fails. ``auto`` decides, in this order:

1. **override**: ``SHMCOLL_ALGO`` (``config.algo``), e.g. ``allreduce:ring,broadcast:dbtree`` or
   with size ranges ``allreduce:direct:0-64K;ring:64K-``. The first rule of the call's
   collective whose range holds the call's size wins; a rule whose algorithm cannot serve the
   call is skipped, with the reason logged.
2. **pages**: where every rank's buffers are on huge pages (``Query.huge_pages``, agreed by the
   ranks before the call: :mod:`shmcoll.comm.pages`), an algorithm that says it wins there
   (``Algorithm.auto_huge``: cma, whose copies by the kernel are twice as fast from huge pages).
3. **measured**: the table written by ``shmcoll tune`` (``config.tune_file``) holds measured
   times per (collective, world size) at a set of sizes. Each measured algorithm's time at the
   call's size is the cost model's prediction times the ratio measured/predicted, interpolated
   (log-log) between the measured sizes and held flat beyond them; the fastest wins. At a
   measured size that is the measured time itself, so auto never picks an algorithm that
   measured slower than another there.
4. **model**: the cost model (:mod:`shmcoll.plan.cost`), calibrated by the tune table, or the built-in
   :func:`default_model` without one, simulates every candidate's plan; the fastest wins.
5. **fallback**: the first registered candidate (``direct``), when nothing can predict.

Calls on buffers from ``comm.alloc`` (``Query.registered``) are decided the same way, with
``zerocopy`` among the candidates and the table's measurements taken on such buffers (``shmcoll
tune`` measures both kinds): zerocopy saves a copy on large calls but pays two or three barriers,
so it wins only from some size on.

The call's **size** is the largest per-rank buffer as ``bench`` counts it (allgather's output,
reduce_scatter's input), in the bytes that move (float16 and bfloat16 reductions move float32).

The choice runs once per call shape (the communicator caches the plan) and depends only on the
call, the environment and the tune file, never on the rank: every rank of a call chooses the
same. In-place is per rank, so candidates must support the call both in place and not, and the
model simulates the out-of-place plan (in place changes only local copies).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from typing import Any

from shmcoll import collectives, config
from shmcoll.algos import closed_forms, registry
from shmcoll.algos.registry import ALGORITHM_NAMES, Algorithm, Query
from shmcoll.collectives import COLLECTIVES
from shmcoll.errors import UnsupportedError
from shmcoll.plan import cost
from shmcoll.plan.cost import CostModel
from shmcoll.shm import layout
from shmcoll.units import format_time, parse_size

log = logging.getLogger("shmcoll")

TUNE_VERSION = 1
DEFAULT_ALPHA_S = 0.25e-6  # see docs/simulator.md, "Figures measured here"
DEFAULT_BETA_BPS = 20e9
# The built-in model's alpha where ranks outnumber the machine's cores (Query.cores): a message
# then waits for its receiver to get a core. benchmarks/handoff.py passes a token around 4 ranks
# on 2 cores in 2.1 us per hand-off (78 ns at 2 ranks), with one rank runnable at a time; in a
# collective every rank wants a core. Judged by auto_vs_best.py at 4 ranks on the 2-core Zen 5 VM
# (64 KiB-64 MiB, 6 launches, picks re-judged against the same launches' times): with 0.25 us
# 16 of 42 picks were over 10% slower than the fastest (ring's allgather and reduce_scatter at
# 64 KiB-1 MiB 1.4-1.9x direct's: three forwarding hand-offs in a row per piece), with 2 us 14,
# with 4 us 11 (geometric mean of pick/fastest 1.17 -> 1.09).
OVERSUBSCRIBED_ALPHA_S = 4e-6


# --- overrides -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Rule:
    """One choice of an override: ``algorithm`` for sizes in ``[lo, hi)`` (``hi=None``: no limit)."""

    algorithm: str
    lo: int = 0
    hi: int | None = None
    text: str = ""

    def holds(self, size: int) -> bool:
        return self.lo <= size and (self.hi is None or size < self.hi)


def _bad(part: str, why: str) -> ValueError:
    return ValueError(f"SHMCOLL_ALGO: bad part {part!r}: {why}")


@functools.lru_cache(maxsize=16)
def parse_overrides(text: str) -> dict[str, tuple[Rule, ...]]:
    """Parse ``SHMCOLL_ALGO``: ``COLLECTIVE:CHOICE[;CHOICE...][,COLLECTIVE:...]``.

    A CHOICE is ``ALGORITHM`` or ``ALGORITHM:LO-HI`` with sizes in bytes (K/M/G suffixes); ``LO``
    defaults to 0 and ``HI`` to no limit, and the range is ``LO <= size < HI``. Rules keep their
    order; a collective named twice adds rules after the first ones.

    Raises:
        ValueError: naming the bad part.
    """
    rules: dict[str, list[Rule]] = {}
    if not text.strip():
        return {}
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            raise _bad(text, "empty entry (stray comma?)")
        collective, sep, rest = entry.partition(":")
        collective = collective.strip()
        if not sep or not rest.strip():
            raise _bad(entry, "expected COLLECTIVE:ALGORITHM, e.g. allreduce:ring")
        if collective not in COLLECTIVES:
            raise _bad(entry, f"unknown collective {collective!r}; one of {', '.join(COLLECTIVES)}")
        for choice in rest.split(";"):
            choice = choice.strip()
            if not choice:
                raise _bad(entry, "empty choice (stray semicolon?)")
            name, sep, span = choice.partition(":")
            name = name.strip()
            if name not in ALGORITHM_NAMES:
                raise _bad(choice, f"unknown algorithm {name!r}; one of {', '.join(ALGORITHM_NAMES)}")
            lo, hi = 0, None
            if sep:
                lo_text, dash, hi_text = span.partition("-")
                if not dash:
                    raise _bad(choice, "a size range is LO-HI, LO- or -HI, e.g. 0-64K")
                try:
                    lo = parse_size(lo_text) if lo_text.strip() else 0
                    hi = parse_size(hi_text) if hi_text.strip() else None
                except ValueError as exc:
                    raise _bad(choice, str(exc)) from None
                if hi is not None and hi <= lo:
                    raise _bad(choice, f"empty range: {lo} >= {hi}")
            rules.setdefault(collective, []).append(Rule(name, lo, hi, choice))
    return {c: tuple(r) for c, r in rules.items()}


# --- the tune table ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Measured:
    """Measured times of one (collective, world size): ``times_s[name][i]`` at ``sizes[i]``."""

    collective: str
    world_size: int
    sizes: tuple[int, ...]
    times_s: dict[str, tuple[float | None, ...]]
    group_size: int | None = None
    registered: bool = False  # measured on buffers from comm.alloc (where zerocopy competes)

    @property
    def key(self) -> tuple[str, int, int | None, bool]:
        return (self.collective, self.world_size, self.group_size, self.registered)


@dataclasses.dataclass(frozen=True)
class TuneTable:
    """What ``shmcoll tune`` wrote: the calibrated model, the slot geometry, the measurements."""

    model: CostModel
    slot_bytes: int
    measured: tuple[Measured, ...]
    source: str = ""

    def entry(
        self, collective: str, world_size: int, group_size: int | None, registered: bool = False
    ) -> Measured | None:
        for m in self.measured:
            if m.key == (collective, world_size, group_size, registered):
                return m
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "version": TUNE_VERSION,
            "layout": layout.VERSION,
            "model": self.model.to_dict(),
            "slot_bytes": self.slot_bytes,
            "measured": [
                {
                    "collective": m.collective,
                    "world_size": m.world_size,
                    "group_size": m.group_size,
                    "registered": m.registered,
                    "sizes": list(m.sizes),
                    "times_s": {k: list(v) for k, v in m.times_s.items()},
                }
                for m in self.measured
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "") -> TuneTable:
        if data.get("version") != TUNE_VERSION:
            raise ValueError(f"tune table version {data.get('version')!r}, expected {TUNE_VERSION}")
        if data.get("layout") != layout.VERSION:
            # Times measured on other rings (layout 6 changed slots to cells) would steer auto by
            # the old engine's costs.
            raise ValueError(
                f"measured with shared-memory layout {data.get('layout')!r}, this shmcoll has {layout.VERSION}: "
                "run `shmcoll tune` again"
            )
        measured = []
        for m in data.get("measured", []):
            sizes = tuple(int(s) for s in m["sizes"])
            times = {str(k): tuple(None if t is None else float(t) for t in v) for k, v in m["times_s"].items()}
            if any(len(v) != len(sizes) for v in times.values()):
                raise ValueError(f"{m['collective']} n={m['world_size']}: times and sizes differ in length")
            measured.append(
                Measured(
                    str(m["collective"]),
                    int(m["world_size"]),
                    sizes,
                    times,
                    m.get("group_size"),
                    bool(m.get("registered", False)),
                )
            )
        return cls(CostModel.from_dict(data["model"]), int(data["slot_bytes"]), tuple(measured), source)


def default_model() -> CostModel:
    """The built-in cost model, used when no tune table exists (see ``docs/simulator.md``)."""
    cfg = config.get()
    return CostModel(DEFAULT_ALPHA_S, DEFAULT_BETA_BPS, nslots=cfg.nslots)


@functools.lru_cache(maxsize=8)
def load_table(path: str) -> TuneTable | None:
    """The tune table at ``path``, read once per process; ``None`` if absent or unreadable (logged)."""
    if not path:
        return None
    try:
        with open(path) as f:
            return TuneTable.from_json(json.load(f), path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring tune table %s (%s); using the built-in cost model", path, exc)
        return None


def reset() -> None:
    """Forget cached overrides, tables and predictions (after the environment or a file changed)."""
    parse_overrides.cache_clear()
    load_table.cache_clear()
    _decide_cached.cache_clear()
    cost.plan_time.cache_clear()


# --- the decision ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Decision:
    """The algorithm auto chose, and why: ``override``, ``pages`` (``Algorithm.auto_huge``),
    ``measured``, ``preferred`` (``Algorithm.auto_prefer``), ``model`` or ``fallback``."""

    algorithm: Algorithm
    reason: str
    detail: str = ""


def call_size(query: Query) -> int:
    """The call's size in bytes as overrides and the tune table count it (see the module doc)."""
    return collectives.get(query.collective).call_bytes(query.world_size, query.count, query.itemsize)


def _candidates(query: Query) -> tuple[list[Algorithm], dict[str, str]]:
    """Algorithms that serve the call whether or not this rank is in place, and why others don't."""
    flipped = dataclasses.replace(query, inplace=not query.inplace)
    ok, why = [], {}
    for alg in registry.algorithms(query.collective):
        reason = alg.supports(query) or alg.supports(flipped)
        if reason is None:
            ok.append(alg)
        else:
            why[alg.name] = reason
    return ok, why


def _fmt(seconds: float) -> str:
    return format_time(seconds)


def _log_interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear interpolation of ``log y`` over ``log x``, held flat outside ``xs``."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    lx = math.log(x)
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1 = math.log(xs[i - 1]), math.log(xs[i])
            w = (lx - x0) / (x1 - x0)
            return math.exp((1 - w) * math.log(ys[i - 1]) + w * math.log(ys[i]))
    return ys[-1]


def decide(
    query: Query,
    *,
    overrides: str = "",
    table: TuneTable | None = None,
    slot_bytes: int | None = None,
    nslots: int | None = None,
    group_size: int | None = None,
) -> Decision:
    """The auto choice for ``query`` given the override text and tune table (pure: no environment).

    Raises:
        UnsupportedError: no registered algorithm serves the call.
        ValueError: a malformed override.
    """
    rules = parse_overrides(overrides).get(query.collective, ())
    candidates, why_not = _candidates(query)
    if not candidates:
        raise UnsupportedError(f"no registered algorithm serves {query}: {why_not}")
    by_name = {a.name: a for a in candidates}
    size = call_size(query)
    # Algorithms with a per-call cost the model does not see (cma's system calls) wait for
    # calls large enough to pay it; an override may still name them.
    candidates = [a for a in candidates if a.for_auto(query, size)] or candidates
    what = f"{query.collective} n={query.world_size} {size} B"
    for rule in rules:
        if not rule.holds(size):
            continue
        if rule.algorithm in by_name:
            return Decision(by_name[rule.algorithm], "override", f"SHMCOLL_ALGO {rule.text!r}")
        reason = why_not.get(rule.algorithm, f"not registered for {query.collective}")
        log.warning("%s: SHMCOLL_ALGO rule %r skipped: %s", what, rule.text, reason)

    # Before the tune table: its times were measured on buffers whose pages nobody knew, and on
    # huge pages cma's copies run twice as fast as on 4 KiB ones (shm/pages.py).
    if query.huge_pages:
        for alg in candidates:
            if alg.auto_huge is not None and alg.auto_huge(query, size):
                return Decision(alg, "pages", f"{alg.name}'s measured advantage on huge pages at this size")

    # hierarchical only pays off with several groups of several ranks; with one group (or one
    # rank per group) it is its own sub-algorithms with extra steps, and it must never win a
    # tie or a model quirk there. An explicit request (or override) may still run it, and so
    # may a measurement: what tune timed on this machine beats any reasoning about it.
    grouped = group_size is not None and 2 <= group_size < query.world_size
    measured = candidates
    if not grouped and len(candidates) > 1:
        candidates = [a for a in candidates if a.name != "hierarchical"]
    model = table.model if table is not None else default_model()
    if table is None and query.cores and query.world_size > query.cores:
        model = dataclasses.replace(model, alpha_s=OVERSUBSCRIBED_ALPHA_S)
    if nslots is not None and nslots != model.nslots:
        model = dataclasses.replace(model, nslots=nslots)
    if grouped and model.group_size != group_size:
        # The model's groups are the ones hierarchical plans are built for (the cost model passes them on).
        model = dataclasses.replace(model, group_size=group_size)
    slot = slot_bytes or (table.slot_bytes if table is not None else config.get().slot_bytes)
    root = query.root if collectives.get(query.collective).rooted else 0

    def predicted(alg: Algorithm, nbytes: int) -> float | None:
        count = collectives.get(query.collective).count_for(query.world_size, nbytes, query.itemsize)
        try:
            return closed_forms.call_time(alg, query.world_size, count, query.itemsize, model, slot, root)
        except RuntimeError as exc:  # the plan cannot run with these slots: never choose it
            log.warning("%s: %s not considered: %s", what, alg.name, exc)
            return None

    # Registered buffers have their own measurements: zerocopy competes there, and the other
    # algorithms run on the same buffers. Without them, the model decides for such calls.
    entry = table.entry(query.collective, query.world_size, group_size, query.registered) if table is not None else None
    if entry is not None:
        estimates: dict[str, float] = {}
        for alg in measured:
            points = [(s, t) for s, t in zip(entry.sizes, entry.times_s.get(alg.name, ()), strict=False) if t]
            if not points:
                continue
            if size in entry.sizes and dict(points).get(size):
                estimates[alg.name] = dict(points)[size]
                continue
            here = predicted(alg, size)
            ratios = [(s, t / p) for s, t in points if (p := predicted(alg, s))]
            if here is None or not ratios:
                continue
            estimates[alg.name] = here * _log_interp(max(size, 1), [s for s, _ in ratios], [r for _, r in ratios])
        # A candidate the table never measured (an algorithm newer than the table, or one the
        # machine did not permit when tune ran): the model's time, scaled the way this machine's
        # measurements depart from the model at this size (the median over measured algorithms).
        scales = sorted(estimates[a.name] / p for a in measured if a.name in estimates and (p := predicted(a, size)))
        for alg in candidates:
            if alg.name not in estimates and scales and (p := predicted(alg, size)) is not None:
                estimates[alg.name] = p * scales[len(scales) // 2]
        if estimates:
            # Ties go to the earlier algorithm in registry order (min over an ordered list).
            best = min((a for a in measured if a.name in estimates), key=lambda a: estimates[a.name])
            others = ", ".join(f"{k} {_fmt(v)}" for k, v in estimates.items() if k != best.name)
            how = "measured" if size in entry.sizes else "measured, model-interpolated"
            return Decision(
                best, "measured", f"{how} {_fmt(estimates[best.name])}" + (f" vs {others}" if others else "")
            )

    # (From what every rank of the call knows alike: every rank decides alike.) Where two prefer the call,
    # the one weighed from the larger size is the narrower claim and wins: cma's reductions over
    # direct's allreduce at 2 ranks, which holds at every size only where cma is not weighed.
    preferred = [a for a in candidates if a.auto_prefer is not None and a.auto_prefer(query, size)]
    preferred.sort(key=lambda a: -a.auto_from(query.world_size))
    if preferred:
        return Decision(preferred[0], "preferred", f"{preferred[0].name}'s measured advantage at this size")
    times = {a.name: predicted(a, size) for a in candidates}
    known = [a for a in candidates if times[a.name] is not None]
    if known:
        best = min(known, key=lambda a: times[a.name])  # type: ignore[arg-type,return-value]
        others = ", ".join(f"{k} {_fmt(v)}" for k, v in times.items() if k != best.name and v is not None)
        src = f"model from {table.source}" if table is not None else "built-in model"
        return Decision(best, "model", f"{src}: {_fmt(times[best.name])}" + (f" vs {others}" if others else ""))  # type: ignore[arg-type]
    return Decision(candidates[0], "fallback", "no prediction for any candidate")


@functools.lru_cache(maxsize=4096)
def _decide_cached(
    query: Query, overrides: str, tune_file: str, slot_bytes: int | None, nslots: int | None, group_size: int | None
) -> Decision:
    return decide(
        query,
        overrides=overrides,
        table=load_table(tune_file),
        slot_bytes=slot_bytes,
        nslots=nslots,
        group_size=group_size,
    )


def choose(
    query: Query,
    requested: str = "auto",
    *,
    slot_bytes: int | None = None,
    nslots: int | None = None,
    group_size: int | None = None,
    logger: Any = None,
    quiet: bool = False,
    pages: str = "",
) -> Algorithm:
    """The algorithm for ``query``; raises :class:`UnsupportedError` for an unusable request.

    ``logger`` gets the ``auto:`` line (a communicator passes its rank-prefixed one), unless
    ``quiet``; ``pages`` qualifies it (the call's buffers' pages where the choice hinges on them).

    ``slot_bytes``/``nslots`` describe the communicator's rings (default: the configuration's),
    ``group_size`` its ranks per group (default: ``SHMCOLL_GROUP_SIZE``; ``None``: one group).
    """
    if requested != "auto":
        alg = registry.get(query.collective, requested)
        reason = alg.supports(query)
        if reason is not None:
            raise UnsupportedError(f"algorithm {requested!r} cannot serve this {query.collective}: {reason}")
        return alg
    cfg = config.get()
    # In place is per rank; the decision must not depend on it.
    key = dataclasses.replace(query, inplace=False)
    groups = cfg.group_size if group_size is None else group_size
    decision = _decide_cached(key, cfg.algo, cfg.tune_file, slot_bytes, nslots, groups)
    if quiet:
        return decision.algorithm
    (log if logger is None else logger).info(
        "auto: %s n=%d %d B%s -> %s (%s: %s)",
        query.collective,
        query.world_size,
        call_size(query),
        pages,
        decision.algorithm.name,
        decision.reason,
        decision.detail,
    )
    return decision.algorithm
