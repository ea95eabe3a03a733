"""The cost model and scale simulator: units, the event schedule, extrapolation, textbook
properties (on ``direct`` and on test-only ring, tree and parameter-server algorithms registered
here), and the closed forms that take over above ``EXACT_LIMIT``."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from shmcoll import sim, units
from shmcoll.algos import closed_forms as fit
from shmcoll.algos import registry
from shmcoll.algos.registry import Algorithm, Query
from shmcoll.collectives import UNIFORM
from shmcoll.plan import cost
from shmcoll.plan.builder import Context, accumulate_in_rank_order, split
from shmcoll.plan.ir import Buf
from shmcoll.plan.passes import plan_call
from shmcoll.plan.verify import verify

KB, MB, GB = 1 << 10, 1 << 20, 1 << 30


# --- test-only algorithms --------------------------------------------------------------------
def ring_allreduce(ctx: Context) -> None:
    """Ring: reduce-scatter then allgather, one chunk per rank, 2(n-1) rounds."""
    n, count = ctx.world_size, ctx.count
    if n == 1:
        ctx.copy(0, ctx.region(Buf.IN), ctx.region(Buf.OUT), count)
        return
    chunks = split(count, n)
    scratch = ctx.tmp(max(c for _, c in chunks))

    def at(buf: Buf, j: int) -> object:
        return ctx.region(buf, chunks[j][0])

    for r in range(n):
        right, left = (r + 1) % n, (r - 1) % n
        # Chunk j starts at rank j and is complete at rank j - 1: ((x_j op x_j+1) op ...) everywhere.
        ctx.send(r, right, at(Buf.IN, r), chunks[r][1])  # type: ignore[arg-type]
        for s in range(n - 1):
            j = (r - s - 1) % n
            last = s == n - 2
            dst = at(Buf.OUT, j) if last else scratch
            ctx.recv_reduce(r, left, at(Buf.IN, j), dst, chunks[j][1], final=last, received_left=True)  # type: ignore[arg-type]
            if not last:
                ctx.send(r, right, scratch, chunks[j][1])
        ctx.send(r, right, at(Buf.OUT, right), chunks[right][1])  # type: ignore[arg-type]
        for s in range(n - 1):
            j = (r - s) % n
            ctx.recv(r, left, at(Buf.OUT, j), chunks[j][1])  # type: ignore[arg-type]
            if s < n - 2:
                ctx.send(r, right, at(Buf.OUT, j), chunks[j][1])  # type: ignore[arg-type]


def tree_allreduce(ctx: Context) -> None:
    """Binomial tree: reduce to rank 0, then broadcast back; 2 ceil(log2 n) rounds."""
    n, count = ctx.world_size, ctx.count
    if n == 1:
        ctx.copy(0, ctx.region(Buf.IN), ctx.region(Buf.OUT), count)
        return
    inp, out = ctx.region(Buf.IN), ctx.region(Buf.OUT)
    top = 1 << ((n - 1).bit_length() - 1)  # largest distance
    for r in range(n):
        have = False
        d = 1
        while d < n:
            if r % (2 * d) == d:
                ctx.send(r, r - d, out if have else inp, count)
                break
            if r + d < n:
                final = r == 0 and d == top
                ctx.recv_reduce(r, r + d, out if have else inp, out, count, final=final)
                have = True
            d *= 2
        d = top
        while d >= 1:
            if r % (2 * d) == d:
                ctx.recv(r, r - d, out, count)
            elif r % (2 * d) == 0 and r + d < n:
                ctx.send(r, r + d, out, count)
            d //= 2


def two_hop_allreduce(ctx: Context) -> None:
    """Parameter server: everyone sends to rank 0, which reduces and sends the result back."""
    n, count = ctx.world_size, ctx.count
    for r in range(1, n):
        ctx.send(r, 0, ctx.region(Buf.IN), count)
    accumulate_in_rank_order(
        ctx, 0, ctx.region(Buf.IN), ctx.region(Buf.OUT), count, list(range(n)), acc_aliases_own=ctx.inplace
    )
    for r in range(1, n):
        ctx.send(0, r, ctx.region(Buf.OUT), count)
        ctx.recv(r, 0, ctx.region(Buf.OUT), count)


def irregular_allreduce(ctx: Context) -> None:
    """A direct allreduce preceded by 1 + n mod 3 empty rounds: no closed form in n."""
    n = ctx.world_size
    for _ in range(1 + n % 3):
        for r in range(n):
            ctx.send(r, (r + 1) % n, None, 0)
            ctx.recv(r, (r - 1) % n, None, 0)
    registry.get("allreduce", "direct").build(ctx)


def _always(query: Query) -> str | None:
    return None


TEST_ALGORITHMS = {
    "ring": (ring_allreduce, lambda slot, n: slot * n),
    "dbtree": (tree_allreduce, registry.one_slot),
    "ps": (two_hop_allreduce, registry.one_slot),
    "pairwise": (irregular_allreduce, registry.one_slot),
}


def _clear_caches() -> None:
    cost.plan_time.cache_clear()
    fit.plan_figures.cache_clear()
    fit.closed_form.cache_clear()


@pytest.fixture(scope="module")
def textbook():  # type: ignore[no-untyped-def]
    """Register the test-only allreduce algorithms under the names of the real ones, for this module.

    Module-scoped so that fitted closed forms are computed once; the registry and the caches are
    restored afterwards.
    """
    registry.algorithms()  # import the real builders first, so ours replace them for this module only
    with pytest.MonkeyPatch.context() as mp:
        for name, (build, piece) in TEST_ALGORITHMS.items():
            alg = Algorithm("allreduce", name, build, piece, _always, build.__doc__ or "")
            mp.setitem(registry._REGISTRY, ("allreduce", name), alg)
        _clear_caches()
        yield
    _clear_caches()


MODEL = cost.CostModel(alpha_s=5e-6, beta_Bps=25e9)


def _time(name: str, n: int, size: int, model: cost.CostModel = MODEL, **kw) -> float:  # type: ignore[no-untyped-def]
    p = sim.predict("allreduce", name, n, size, model, **kw)
    assert p.time_s is not None, p.note
    return p.time_s


# --- units and the model ---------------------------------------------------------------------
def test_parse_time_and_bandwidth() -> None:
    assert units.parse_time("5us") == pytest.approx(5e-6)
    assert units.parse_time("1.5 ms") == pytest.approx(1.5e-3)
    assert units.parse_time("2e-6") == pytest.approx(2e-6)
    assert units.parse_time("100ns") == pytest.approx(1e-7)
    assert units.parse_bandwidth("25GB/s") == 25e9
    assert units.parse_bandwidth("10GiB/s") == 10 * 2**30
    assert units.parse_bandwidth("500 MB/s") == 5e8
    assert units.parse_bandwidth("1e9") == 1e9
    for bad in ("fast", "5 parsecs", "-1us", ""):
        with pytest.raises(ValueError, match="time"):
            units.parse_time(bad)
    for bad in ("0GB/s", "quick", "5 GB/h"):
        with pytest.raises(ValueError, match="bandwidth"):
            units.parse_bandwidth(bad)


def test_cost_model_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="beta"):
        cost.CostModel(1e-6, 0)
    with pytest.raises(ValueError, match="alpha"):
        cost.CostModel(-1e-6, 1e9)
    with pytest.raises(ValueError, match="group size"):
        cost.CostModel(1e-6, 1e9, inter_alpha_s=1e-5)
    with pytest.raises(ValueError, match="nslots"):
        cost.CostModel(1e-6, 1e9, nslots=0)
    m = cost.CostModel(1e-6, 1e9, inter_beta_Bps=1e8, group_size=4)
    assert cost.CostModel.from_dict(m.to_dict()) == m


def test_test_only_algorithms_are_valid_plans(textbook) -> None:  # type: ignore[no-untyped-def]
    """With two slots per ring: the ring's fused receive-reduce-send needs a free slot while its
    previous message still waits on the neighbour's identical step."""
    for name in TEST_ALGORITHMS:
        alg = registry.get("allreduce", name)
        for n in range(1, 9):
            for count, slot in ((0, 4), (1, 4), (n + 1, 4), (3 * n + 2, 2)):
                for inplace in (False, True):
                    plan = plan_call(alg, n, count, slot, inplace=inplace)
                    verify(plan, world_size=n, count=count, inplace=inplace, nslots=2)


# --- the event schedule ----------------------------------------------------------------------
def test_point_to_point_costs_alpha_plus_both_copies() -> None:
    """One message: the sender is busy b/beta, it arrives alpha later, the receiver copies b/beta."""
    alpha, beta, nbytes = 3e-6, 2e9, 4000
    plan = plan_call(registry.get("broadcast", "direct"), 2, nbytes, 1 << 20, root=0, inplace=True)
    got = cost.simulate(plan, 1, cost.CostModel(alpha, beta)).time_s
    assert got == pytest.approx(alpha + 2 * nbytes / beta)


def test_bounded_slots_throttle_a_latency_bound_stream() -> None:
    """With zero copy cost, a channel of k slots passes k messages per latency."""
    pieces, alpha = 40, 1e-6
    plan = plan_call(registry.get("broadcast", "direct"), 2, pieces, 1, root=0, inplace=True)
    for nslots in (1, 2, 4):
        t = cost.simulate(plan, 1, cost.CostModel(alpha, math.inf, nslots=nslots)).time_s
        assert t == pytest.approx(alpha * math.ceil(pieces / nslots), rel=1e-9)


@pytest.mark.parametrize("collective", ["allreduce", "broadcast", "reduce", "allgather", "alltoall", "gather"])
def test_extrapolated_time_equals_the_full_simulation(collective: str) -> None:
    alg = registry.get(collective, "direct")
    costs = MODEL.costs()
    for n in (2, 3, 5):
        for reps in (9, 17, 41, 97):
            plan = plan_call(alg, n, reps * 5 + 2, 5)
            assert plan.reps == reps
            full, _ = cost.run_compiled(cost.compile_plan(plan.body, 4), cost.compile_plan(plan.tail, 4), reps, costs)
            got = cost.simulate(plan, 4, costs)
            assert got.exact and (reps < 41 or got.simulated_pieces <= 33)
            assert got.time_s == pytest.approx(full, rel=1e-12)


def test_extrapolation_on_pipelined_ring(textbook) -> None:  # type: ignore[no-untyped-def]
    alg = registry.get("allreduce", "ring")
    for nslots in (2, 4):
        costs = cost.CostModel(2e-6, 1e9, nslots=nslots).costs()
        for n in (3, 6):
            plan = plan_call(alg, n, 40 * n * 3 + 7, 3)
            full, _ = cost.run_compiled(
                cost.compile_plan(plan.body, 4), cost.compile_plan(plan.tail, 4), plan.reps, costs
            )
            assert cost.simulate(plan, 4, costs).time_s == pytest.approx(full, rel=1e-12)


def test_traffic_counts_every_message() -> None:
    p = sim.predict("allreduce", "direct", 8, 1 * MB, MODEL)
    assert p.traffic_bytes == 8 * 7 * MB  # every rank sends its whole buffer to every other
    p = sim.predict("allgather", "direct", 8, 1 * MB, MODEL)
    assert p.traffic_bytes == 8 * 7 * MB // 8


# --- textbook results ------------------------------------------------------------------------
def test_ring_time_is_bandwidth_optimal_and_nearly_independent_of_n(textbook) -> None:  # type: ignore[no-untyped-def]
    big = 1 * GB
    model = cost.CostModel(alpha_s=1e-6, beta_Bps=25e9)
    times = {n: _time("ring", n, big, model, slot_bytes=16 * MB) for n in (4, 8, 16, 32)}
    for n, t in times.items():
        # Textbook: 2(n-1)/n V/beta. The model also charges the copy out of the last chunk
        # received, which the textbook leaves out: (2n-1)/n V/beta in all.
        textbook_s = 2 * (n - 1) / n * big / model.beta_Bps
        assert t == pytest.approx(textbook_s * (2 * n - 1) / (2 * n - 2), rel=0.02), (n, t, textbook_s)
    assert max(times.values()) / min(times.values()) < 1.2
    traffic = {n: sim.predict("allreduce", "ring", n, big, model).traffic_bytes for n in (4, 8, 16, 32)}
    assert traffic[32] / traffic[4] == pytest.approx((2 * 31) / (2 * 3))  # 2(n-1) V in all: grows with n


def test_tree_latency_grows_with_log_n(textbook) -> None:  # type: ignore[no-untyped-def]
    tiny = 8
    times = {n: _time("dbtree", n, tiny) for n in (4, 8, 16, 32, 64)}
    steps = [times[2 * n] - times[n] for n in (4, 8, 16, 32)]
    for s in steps:  # one more level per doubling: 2 alpha (up and down) each time
        assert s == pytest.approx(2 * MODEL.alpha_s, rel=0.01)
    ring = {n: _time("ring", n, tiny) for n in (4, 64)}
    assert ring[64] - ring[4] == pytest.approx(2 * 60 * MODEL.alpha_s, rel=0.01)  # linear in n


def test_parameter_server_time_grows_with_n_at_the_root(textbook) -> None:  # type: ignore[no-untyped-def]
    size = 64 * MB
    times = {n: _time("ps", n, size, slot_bytes=size) for n in (4, 8, 16, 32)}
    for n in (4, 8, 16):
        # The root receives n-1 buffers and sends n-1, its last receive fused with its first
        # send; with the first buffer's way in and the last one's copy out: (2n-1) V / beta.
        assert times[2 * n] / times[n] == pytest.approx((4 * n - 1) / (2 * n - 1), rel=0.02)
    assert times[32] > 10 * _time("ring", 32, size)


def test_trees_beat_rings_for_small_messages_or_many_ranks(textbook) -> None:  # type: ignore[no-untyped-def]
    assert _time("dbtree", 8, 1 * KB) < _time("ring", 8, 1 * KB)
    assert _time("ring", 8, 256 * MB) < _time("dbtree", 8, 256 * MB)
    # at a fixed medium size, the ring's 2(n-1) latencies overtake the tree's extra bandwidth
    size = 256 * KB
    assert _time("ring", 8, size) < _time("dbtree", 8, size)
    assert _time("dbtree", 128, size) < _time("ring", 128, size)


def test_direct_costs_grow_linearly_with_n() -> None:
    """direct allreduce: every rank copies its buffer out n-1 times and n-1 buffers in."""
    big = 64 * MB
    t = {n: _time("direct", n, big, slot_bytes=big) for n in (4, 8, 16)}
    assert t[16] / t[8] == pytest.approx((2 * 16 - 1) / (2 * 8 - 1), rel=0.02)
    assert t[8] / t[4] == pytest.approx((2 * 8 - 1) / (2 * 4 - 1), rel=0.02)


def test_slow_links_between_groups(textbook) -> None:  # type: ignore[no-untyped-def]
    flat = cost.CostModel(alpha_s=1e-6, beta_Bps=25e9)
    nodes = cost.CostModel(alpha_s=1e-6, beta_Bps=25e9, inter_alpha_s=10e-6, inter_beta_Bps=5e9, group_size=4)
    one_node = _time("ring", 4, 16 * MB, nodes)
    assert one_node == pytest.approx(_time("ring", 4, 16 * MB, flat))  # no inter-group message at all
    assert _time("ring", 16, 16 * MB, nodes) > 3 * _time("ring", 16, 16 * MB, flat)


# --- closed forms ----------------------------------------------------------------------------
def test_fit_recovers_formulas_and_refuses_others() -> None:
    ns = range(3, 20)
    cases = {
        "2 n - 2": lambda n: Fraction(2 * n - 2),
        "2 - 2/n": lambda n: 2 - Fraction(2, n),
        "2 ceil(log2 n)": lambda n: Fraction(2 * (n - 1).bit_length()),
        "n^2 - n": lambda n: Fraction(n * n - n),
    }
    for text, f in cases.items():
        formula = fit.fit({n: f(n) for n in ns})
        assert formula is not None and str(formula) == text
        assert all(formula(n) == f(n) for n in (100, 1000, 12345))
    assert fit.fit({n: Fraction(bin(n).count("1")) for n in ns}) is None
    assert fit.fit({3: Fraction(1), 4: Fraction(7)}) is None  # too few points to trust any fit


def _validation_ns(limit: int) -> list[int]:
    return list(range(3, limit + 1))


def _check_every_registered_closed_form(limit: int, collectives: tuple[str, ...]) -> int:
    checked = 0
    for alg in registry.algorithms():
        if alg.collective not in collectives:
            continue
        form = fit.closed_form(alg.collective, alg.name)
        if form is None:
            continue
        assert fit.validate_closed_form(form, range(3, limit + 1)) == []
        checked += 1
    return checked


def test_closed_forms_equal_the_plans_for_every_registered_allreduce(textbook) -> None:  # type: ignore[no-untyped-def]
    """Every n up to 24 and allreduce only here; the slow variant does every collective up to EXACT_LIMIT."""
    assert _check_every_registered_closed_form(24, ("allreduce",)) >= 4


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("collective", UNIFORM)
def test_closed_forms_equal_the_plans_up_to_the_limit(textbook, collective: str) -> None:  # type: ignore[no-untyped-def]
    """Every registered algorithm of every uniform collective, every n from 3 to EXACT_LIMIT
    (minutes). The variable-count ones are left out: ``closed_forms.plan_figures`` builds plans
    without per-rank counts, which their builders refuse."""
    assert _check_every_registered_closed_form(cost.EXACT_LIMIT, (collective,)) >= 1


def test_textbook_closed_forms(textbook) -> None:  # type: ignore[no-untyped-def]
    forms = {name: fit.closed_form("allreduce", name) for name in ("direct", "ring", "dbtree", "ps")}
    assert all(f is not None for f in forms.values())
    figs = {name: dict((k, str(v)) for k, v in f.formulas) for name, f in forms.items()}  # type: ignore[union-attr]
    assert figs["ring"]["rounds"] == "2 n - 2"
    assert figs["dbtree"]["rounds"] == "2 floor(log2 n)"  # a binomial tree is floor(log2 n) deep
    assert figs["ps"]["rounds"] == "2"
    assert figs["direct"]["rounds"] == "1"
    assert figs["direct"]["traffic"] == "n^2 - n"


def test_validation_catches_a_wrong_closed_form(textbook) -> None:  # type: ignore[no-untyped-def]
    form = fit.closed_form("allreduce", "ring")
    assert form is not None
    wrong = tuple((k, fit.Formula((("n", Fraction(2)),))) if k == "rounds" else (k, f) for k, f in form.formulas)
    bad = fit.ClosedForm(form.collective, form.algorithm, None, form.nslots, form.domain, form.member, wrong)
    problems = fit.validate_closed_form(bad, range(3, 8))
    assert len(problems) == 5 and "rounds" in problems[0]


def test_closed_form_prediction_is_close_to_the_plan(textbook) -> None:  # type: ignore[no-untyped-def]
    for name in ("direct", "ring", "dbtree", "ps"):
        for size in (1 * KB, 1 * MB, 256 * MB):
            exact = _time(name, 32, size)
            closed = sim.predict("allreduce", name, 32, size, MODEL, limit=16)
            assert closed.method == "closed form" and closed.time_s is not None
            assert exact <= closed.time_s * (1 + 1e-9) <= 1.15 * exact, (name, size)


def test_no_closed_form_means_too_large_to_simulate(textbook) -> None:  # type: ignore[no-untyped-def]
    assert fit.closed_form("allreduce", "pairwise") is None
    p = sim.predict("allreduce", "pairwise", 1024, 1 * MB, MODEL)
    assert p.time_s is None and "n too large to simulate" in p.note
    assert sim.predict("allreduce", "pairwise", 64, 1 * MB, MODEL).time_s is not None


def test_scale_table(textbook) -> None:  # type: ignore[no-untyped-def]
    rows, notes = sim.sweep("allreduce", ["ring", "dbtree", "nope"], [8, 1024, 16384], [1 * KB, 1 * GB], MODEL)
    assert notes == ["nope: not registered for allreduce, skipped"]
    assert len(rows) == 12 and all(r.time_s for r in rows)
    by = {(r.algorithm, r.world_size, r.size_bytes): r for r in rows}
    assert by[("ring", 8, KB)].method == "plan" and by[("ring", 16384, KB)].method == "closed form"
    assert by[("dbtree", 16384, KB)].time_s < by[("ring", 16384, KB)].time_s  # type: ignore[operator]
    # the ring's busbw at 1G hardly depends on n (up to where 2(n-1) alpha starts to count)
    assert by[("ring", 1024, GB)].busbw_GBps == pytest.approx(by[("ring", 8, GB)].busbw_GBps, rel=0.25)
    text = sim.format_table(rows, notes)
    assert "# note: nope" in text and "busbw" in text and "closed form" in text
    md = sim.format_table(rows, notes, markdown=True)
    assert md.splitlines()[0].startswith("| algorithm |") and md.count("\n|") >= 13
