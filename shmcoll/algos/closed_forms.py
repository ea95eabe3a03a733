"""Closed forms of the plans' cost figures, for world sizes too large to simulate.

Beyond :data:`~shmcoll.plan.cost.EXACT_LIMIT` ranks building every rank's plan is infeasible
(ring has O(n^2) steps in all), so the cost model uses a closed form per algorithm. The closed
form is *fitted* to plan-derived figures (:func:`plan_figures`): the coefficients of the model's
parameters in the simulated time of one piece (``rounds``: the alpha coefficient; ``bytes``: the
1/beta coefficient per byte of the call), of the steady per-piece increment of a many-piece call
(``period_rounds``, ``period_bytes``), and the total bytes sent (``traffic``); with groups, the
same for the inter-group parameters (``inter_*``). Each is measured by simulating the real plan
under a *probe* model where one parameter is 1 and the others are 0.

:func:`fit` writes a figure as an exact rational combination of a few functions of ``n``
(:data:`BASIS`: 1, n, 1/n, n^2, ceil/floor log2 n, ...). :func:`closed_form` tries the
:func:`domains` of world sizes, widest first, and accepts a fit only if it reproduces the
plan-derived figure exactly at every fitted and checked ``n``; :func:`validate_closed_form` (run
by the tests) compares it at every ``n`` up to the limit. An algorithm with no such fit is
reported as "n too large to simulate" above the limit. :meth:`ClosedForm.time` turns the figures
into the predicted time of a call: the first piece, then one period per further piece.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable
from fractions import Fraction

from shmcoll import collectives
from shmcoll.algos import registry
from shmcoll.algos.registry import Algorithm, Query
from shmcoll.plan.cost import (
    EXACT_LIMIT,
    TRY_PIECES,
    CostModel,
    Costs,
    compile_plan,
    plan_options,
    plan_time,
    run_timed,
    steady_period,
    time_programs,
)
from shmcoll.plan.passes import plan_call


# --- formulas in n ----------------------------------------------------------------------------------
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


# --- figures measured on the plans -------------------------------------------------------------
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
    if alg.supports(Query(collective, n, piece, 1, cma=True)) is not None:
        return None
    plan = plan_call(alg, n, piece, FIT_SLOT, options=options, nslots=nslots)
    prog = compile_plan(plan.tail, 1)
    size = collectives.get(collective).call_bytes(n, piece, 1)
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
        (timed,), m = time_programs([prog], costs)
        single, _ = run_timed(None, timed, 0, m, nslots)
        out[single_name] = Fraction(single) / unit
        period = None
        for k in (*TRY_PIECES, 64):
            _, ends = run_timed(timed, timed, k, m, nslots)
            period = steady_period(ends)
            if period is not None:
                break
        if period is None:
            raise NoPeriod(f"{collective}/{algorithm} n={n}: no periodic schedule within 64 pieces")
        cycle, shift = period
        out[period_name] = Fraction(shift) / (cycle * unit)
    out["traffic"] = Fraction(sum(s[2] for p in prog for s in p if s[1] >= 0), size)
    return out


# --- fitting ---------------------------------------------------------------------------------------
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
            nbytes = collectives.get(self.collective).call_bytes(n, elements, itemsize)
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
    """Fit ``algorithm``'s closed form (``None`` if no domain fits every figure exactly).

    Variable-count collectives have none: their plans depend on the counts, not on one size.
    """
    if collectives.get(collective).varying:
        return None
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
