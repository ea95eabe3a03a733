"""algorithm="auto": SHMCOLL_ALGO overrides, the tune table (measured beats model, the 10% rule),
the cost model, the fallback, and the logging, with test-only algorithms registered here."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import pytest

from shmcoll import config
from shmcoll.algos import closed_forms, registry, select
from shmcoll.algos.registry import Algorithm, Query
from shmcoll.algos.select import Measured, Rule, TuneTable, decide, parse_overrides
from shmcoll.errors import UnsupportedError
from shmcoll.plan import cost
from shmcoll.plan.builder import Context, accumulate_in_rank_order
from shmcoll.plan.ir import Buf
from shmcoll.shm import layout

KB, MB = 1 << 10, 1 << 20
MODEL = cost.CostModel(alpha_s=2e-6, beta_Bps=4e9)


def two_hop(ctx: Context) -> None:
    """Deliberately slow: everyone sends to rank 0, which reduces and sends the result back."""
    n, count = ctx.world_size, ctx.count
    for r in range(1, n):
        ctx.send(r, 0, ctx.region(Buf.IN), count)
    accumulate_in_rank_order(
        ctx, 0, ctx.region(Buf.IN), ctx.region(Buf.OUT), count, list(range(n)), acc_aliases_own=ctx.inplace
    )
    for r in range(1, n):
        ctx.send(0, r, ctx.region(Buf.OUT), count)
        ctx.recv(r, 0, ctx.region(Buf.OUT), count)


def _always(query: Query) -> str | None:
    return None


def _two_ranks_only(query: Query) -> str | None:
    return None if query.world_size <= 2 else "serves at most 2 ranks"


def _out_of_place_only(query: Query) -> str | None:
    return "needs separate buffers" if query.inplace else None


@pytest.fixture
def algos(monkeypatch):  # type: ignore[no-untyped-def]
    """direct plus test-only allreduce algorithms: ps (slow, two hops), pairwise (n <= 2 only),
    hierarchical (out of place only). The registry and caches are restored afterwards."""
    registry.algorithms()
    for name, supports in (("ps", _always), ("pairwise", _two_ranks_only), ("hierarchical", _out_of_place_only)):
        alg = Algorithm("allreduce", name, two_hop, registry.one_slot, supports, "")
        monkeypatch.setitem(registry._REGISTRY, ("allreduce", name), alg)
    for name in ("ring", "dbtree", "halving_doubling"):  # real ones, once merged, stay out of these tests
        monkeypatch.delitem(registry._REGISTRY, ("allreduce", name), raising=False)
    select.reset()
    yield
    select.reset()


@pytest.fixture
def env(monkeypatch):  # type: ignore[no-untyped-def]
    """Set SHMCOLL_* variables for one test; the configuration is re-read and restored after."""

    def setenv(**values: str) -> None:
        for key, value in values.items():
            monkeypatch.setenv(f"SHMCOLL_{key.upper()}", value)
        config.reload()
        select.reset()

    yield setenv
    monkeypatch.undo()
    config.reload()
    select.reset()


def q(count: int, n: int = 4, collective: str = "allreduce", inplace: bool = False) -> Query:
    return Query(collective, n, count, 4, inplace=inplace)


# --- overrides ---------------------------------------------------------------------------------
def test_parse_overrides() -> None:
    assert parse_overrides("") == {}
    got = parse_overrides("allreduce:ring, broadcast:dbtree")
    assert got == {"allreduce": (Rule("ring", 0, None, "ring"),), "broadcast": (Rule("dbtree", 0, None, "dbtree"),)}
    got = parse_overrides("allreduce:direct:0-64K;ring:64K-,allreduce:ps:-1")
    assert [(r.algorithm, r.lo, r.hi) for r in got["allreduce"]] == [
        ("direct", 0, 64 * KB),
        ("ring", 64 * KB, None),
        ("ps", 0, 1),
    ]
    rule = got["allreduce"][0]
    assert rule.holds(0) and rule.holds(64 * KB - 1) and not rule.holds(64 * KB)


@pytest.mark.parametrize(
    ("text", "part", "why"),
    [
        ("allreduce", "allreduce", "COLLECTIVE:ALGORITHM"),
        ("allreduce:", "allreduce:", "COLLECTIVE:ALGORITHM"),
        ("allreduc:ring", "allreduc:ring", "unknown collective"),
        ("allreduce:rings", "rings", "unknown algorithm"),
        ("allreduce:ring:64K", "ring:64K", "LO-HI"),
        ("allreduce:ring:1M-1K", "ring:1M-1K", "empty range"),
        ("allreduce:ring:lots-", "ring:lots-", "not a size"),
        ("allreduce:ring,,broadcast:direct", "allreduce:ring,,broadcast:direct", "stray comma"),
        ("allreduce:ring;", "allreduce:ring;", "stray semicolon"),
    ],
)
def test_bad_overrides_name_the_bad_part(text: str, part: str, why: str) -> None:
    with pytest.raises(ValueError, match="SHMCOLL_ALGO") as info:
        parse_overrides(text)
    assert repr(part) in str(info.value) and why in str(info.value)


def test_override_wins_in_its_size_range(algos) -> None:  # type: ignore[no-untyped-def]
    text = "allreduce:ps:0-1K;direct:1K-"
    small, large = decide(q(16), overrides=text), decide(q(1024), overrides=text)
    assert (small.algorithm.name, small.reason) == ("ps", "override")
    assert (large.algorithm.name, large.reason) == ("direct", "override")
    assert decide(q(16, collective="broadcast"), overrides=text).reason != "override"


def test_override_that_cannot_serve_is_skipped_with_a_reason(algos, caplog) -> None:  # type: ignore[no-untyped-def]
    with caplog.at_level(logging.WARNING, logger="shmcoll"):
        d = decide(q(16, n=4), overrides="allreduce:pairwise;ps")
    assert (d.algorithm.name, d.reason) == ("ps", "override")
    assert "'pairwise' skipped: serves at most 2 ranks" in caplog.text
    with caplog.at_level(logging.WARNING, logger="shmcoll"):
        d = decide(q(16, n=4), overrides="allreduce:halving_doubling")
    assert d.reason == "model" and "not registered for allreduce" in caplog.text
    assert decide(q(16, n=2), overrides="allreduce:pairwise").algorithm.name == "pairwise"


def test_explicit_algorithm_beats_the_environment(algos, env) -> None:  # type: ignore[no-untyped-def]
    env(algo="allreduce:ps")
    assert select.choose(q(16), "auto").name == "ps"
    assert select.choose(q(16), "direct").name == "direct"
    with pytest.raises(UnsupportedError, match="at most 2 ranks"):
        select.choose(q(16, n=4), "pairwise")


def test_bad_environment_fails_the_call_clearly(algos, env) -> None:  # type: ignore[no-untyped-def]
    env(algo="allreduce:warp")
    with pytest.raises(ValueError, match="unknown algorithm 'warp'"):
        select.choose(q(16), "auto")


# --- the model ---------------------------------------------------------------------------------
def test_model_picks_the_fastest_predicted(algos) -> None:  # type: ignore[no-untyped-def]
    table = TuneTable(MODEL, 64 * KB, ())
    for count in (1, 1000, 1 << 20):
        d = decide(q(count), table=table, slot_bytes=64 * KB)
        times = {
            a: closed_forms.call_time(registry.get("allreduce", a), 4, count, 4, MODEL, 64 * KB)
            for a in ("direct", "ps")
        }
        assert d.reason == "model" and d.algorithm.name == min(times, key=times.get)  # type: ignore[arg-type]


def test_two_hops_lose_to_one_for_small_messages(algos) -> None:  # type: ignore[no-untyped-def]
    """Latency-bound: direct is one message deep, the two-hop parameter server two."""
    d = decide(q(2, n=4), table=TuneTable(MODEL, 64 * KB, ()))
    assert d.algorithm.name == "direct"


def test_built_in_default_without_a_table(algos, env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env(tune_file=str(tmp_path / "absent.json"))
    d = select._decide_cached(q(256), "", config.get().tune_file, None, None, None)
    assert d.reason == "model" and "built-in model" in d.detail
    assert select.default_model().alpha_s == select.DEFAULT_ALPHA_S


def test_in_place_never_changes_the_choice(algos) -> None:  # type: ignore[no-untyped-def]
    """Ranks choose in place independently; an algorithm that serves only one mode is not a candidate."""
    for count in (1, 5000, 1 << 20):
        a = decide(q(count, inplace=False), overrides="allreduce:hierarchical")
        b = decide(q(count, inplace=True), overrides="allreduce:hierarchical")
        assert a == b and a.algorithm.name != "hierarchical"


def test_fallback_when_nothing_can_predict(algos, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(closed_forms, "call_time", lambda *args, **kw: None)
    d = decide(q(16))
    assert (d.algorithm.name, d.reason) == ("direct", "fallback")


def deadlocks_with_one_slot(ctx: Context) -> None:
    """Every rank sends twice before receiving: needs two slots per ring."""
    n, count = ctx.world_size, ctx.count
    for r in range(n):
        for _ in range(2):
            ctx.send(r, (r + 1) % n, ctx.region(Buf.IN), count)
        ctx.recv(r, (r - 1) % n, ctx.region(Buf.OUT), count)
        ctx.recv(r, (r - 1) % n, ctx.region(Buf.OUT), count)


def test_a_plan_that_deadlocks_is_never_chosen(algos, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    bad = Algorithm("allreduce", "ps", deadlocks_with_one_slot, registry.one_slot, _always, "")
    monkeypatch.setitem(registry._REGISTRY, ("allreduce", "ps"), bad)
    with caplog.at_level(logging.WARNING, logger="shmcoll"):
        d = decide(q(4, n=3), nslots=1, table=TuneTable(cost.CostModel(1e-6, 1e9, nslots=1), 64 * KB, ()))
    assert d.algorithm.name == "direct" and "ps not considered: simulated plan deadlocks" in caplog.text


def test_no_algorithm_serves(algos, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    direct = registry.get("allreduce", "direct")
    monkeypatch.setitem(
        registry._REGISTRY,
        ("allreduce", "direct"),
        Algorithm("allreduce", "direct", direct.build, direct.piece, _two_ranks_only, ""),
    )
    monkeypatch.setitem(
        registry._REGISTRY,
        ("allreduce", "ps"),
        Algorithm("allreduce", "ps", two_hop, registry.one_slot, _two_ranks_only, ""),
    )
    monkeypatch.delitem(registry._REGISTRY, ("allreduce", "hierarchical"))
    with pytest.raises(UnsupportedError, match="no registered algorithm"):
        decide(q(16, n=3))


# --- the tune table ----------------------------------------------------------------------------
def _table(times: dict[str, list[float]], sizes: list[int], n: int = 4, model: cost.CostModel = MODEL) -> TuneTable:
    entry = Measured("allreduce", n, tuple(sizes), {k: tuple(v) for k, v in times.items()})
    return TuneTable(model, 64 * KB, (entry,), "synthetic")


def test_measured_table_decides_at_measured_sizes(algos) -> None:  # type: ignore[no-untyped-def]
    sizes = [8, 1 * KB, 64 * KB, 1 * MB]
    table = _table({"direct": [9e-6, 9e-6, 50e-6, 900e-6], "ps": [5e-6, 8e-6, 60e-6, 700e-6]}, sizes)
    picks = [decide(q(s // 4), table=table).algorithm.name for s in sizes]
    assert picks == ["ps", "ps", "direct", "ps"]
    d = decide(q(64 * KB // 4), table=table)
    assert d.reason == "measured" and d.detail.startswith("measured 50 us vs ps 60 us")


def test_ten_percent_rule(algos) -> None:  # type: ignore[no-untyped-def]
    """Whatever the model says, auto never picks an algorithm that measured >10% slower at a
    measured size: here the model prefers ps, the measurements direct."""
    sizes = [8, 512, 4 * KB, 32 * KB, 256 * KB, 2 * MB]
    slow_model = cost.CostModel(alpha_s=1e-3, beta_Bps=1e6)  # direct's n-1 copies look terrible
    model_pick = {s: decide(q(s // 4), table=TuneTable(slow_model, 64 * KB, ())).algorithm.name for s in sizes}
    assert "ps" in model_pick.values()
    direct = [1e-6 * (1 + s / 1000) for s in sizes]
    table = _table({"direct": direct, "ps": [1.15 * t for t in direct]}, sizes, model=slow_model)
    for i, s in enumerate(sizes):
        d = decide(q(s // 4), table=table)
        measured = dict(zip(("direct", "ps"), (direct[i], 1.15 * direct[i]), strict=True))
        assert measured[d.algorithm.name] <= 1.10 * min(measured.values()), (s, d)


def test_model_interpolates_between_measured_sizes(algos) -> None:  # type: ignore[no-untyped-def]
    """Between measured sizes the model's prediction is scaled by the measured/model ratio,
    interpolated: with measurements exactly k times the model, the choice is the model's with
    each algorithm's time times its k."""
    sizes = [1 * KB, 64 * KB, 4 * MB]
    factor = {"direct": 3.0, "ps": 1.0}

    def model_s(name: str, nbytes: int) -> float:
        return closed_forms.call_time(registry.get("allreduce", name), 4, nbytes // 4, 4, MODEL, 64 * KB)  # type: ignore[return-value]

    table = _table({a: [factor[a] * model_s(a, s) for s in sizes] for a in factor}, sizes)
    for nbytes in (4 * KB, 200 * KB, 1 * MB, 16 * MB):
        d = decide(q(nbytes // 4), table=table, slot_bytes=64 * KB)
        want = min(factor, key=lambda a: factor[a] * model_s(a, nbytes))
        assert d.algorithm.name == want and "model-interpolated" in d.detail


def test_registered_calls_use_their_own_measurements(algos) -> None:  # type: ignore[no-untyped-def]
    """On comm.alloc buffers zerocopy competes, judged by what was measured on such buffers;
    plain calls never see it, and the plain measurements do not decide registered calls."""
    sizes = (4 * KB, 16 * MB)
    plain = Measured("allreduce", 4, sizes, {"direct": (9e-6, 9e-3), "ps": (5e-6, 8e-3)})
    times = {"direct": (9e-6, 9e-3), "ps": (6e-6, 8e-3), "zerocopy": (30e-6, 4e-3)}
    on_alloc = Measured("allreduce", 4, sizes, times, registered=True)
    table = TuneTable(MODEL, 64 * KB, (plain, on_alloc), "synthetic")

    def registered(nbytes: int) -> Query:
        return dataclasses.replace(q(nbytes // 4), registered=True)

    assert decide(registered(4 * KB), table=table).algorithm.name == "ps"  # zerocopy measured 5x slower
    assert decide(registered(16 * MB), table=table).algorithm.name == "zerocopy"
    assert decide(q(16 * MB // 4), table=table).algorithm.name == "ps"
    only_plain = TuneTable(MODEL, 64 * KB, (plain,), "synthetic")
    assert decide(registered(16 * MB), table=only_plain).reason == "model"
    assert TuneTable.from_json(table.to_json()).measured == table.measured


def test_unmeasured_world_size_uses_the_model(algos) -> None:  # type: ignore[no-untyped-def]
    table = _table({"direct": [1.0], "ps": [2.0]}, [1 * KB], n=8)
    assert decide(q(256, n=4), table=table).reason == "model"
    assert decide(q(256, n=8), table=table).reason == "measured"


def test_table_round_trip_and_bad_files(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    table = _table({"direct": [1e-6, None], "ps": [2e-6, 3e-6]}, [8, 1 * KB])  # type: ignore[list-item]
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(table.to_json()))
    select.reset()
    loaded = select.load_table(str(path))
    assert loaded is not None and loaded.measured == table.measured and loaded.model == table.model
    assert select.load_table(str(tmp_path / "nope.json")) is None
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "model": {"alpha_s": -1, "beta_Bps": 1}, "slot_bytes": 1, "measured": []}')
    with caplog.at_level(logging.WARNING, logger="shmcoll"):
        assert select.load_table(str(bad)) is None
    assert "ignoring tune table" in caplog.text
    # A table measured on another shared-memory layout (older rings) is not believed.
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({**table.to_json(), "layout": layout.VERSION - 1}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shmcoll"):
        assert select.load_table(str(stale)) is None
    assert f"layout {layout.VERSION - 1}" in caplog.text and "run `shmcoll tune` again" in caplog.text
    select.reset()


def test_auto_reads_the_tune_file_and_logs_why(algos, env, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    table = _table({"direct": [9e-6], "ps": [5e-6]}, [4 * KB])
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(table.to_json()))
    env(tune_file=str(path), debug="INFO")
    with caplog.at_level(logging.INFO, logger="shmcoll"):
        assert select.choose(q(1024), "auto").name == "ps"
        assert select.choose(q(1024, inplace=True), "auto").name == "ps"
    assert "auto: allreduce n=4 4096 B -> ps (measured: measured 5 us vs direct 9 us)" in caplog.text
    env(algo="allreduce:direct")
    with caplog.at_level(logging.INFO, logger="shmcoll"):
        assert select.choose(q(1024), "auto").name == "direct"
    assert "(override: SHMCOLL_ALGO 'direct')" in caplog.text


def test_an_algorithm_the_table_never_measured_still_competes() -> None:
    """A tune table older than cma (or made where it was refused) has no times for it: it is
    judged by the model scaled like the measured algorithms, and measured times win over that."""
    n, sizes = 2, (256 * KB, 16 * MB)

    def model_s(name: str, nbytes: int) -> float:
        return closed_forms.call_time(registry.get("allgather", name), n, nbytes // 4 // n, 4, MODEL, 64 * KB)  # type: ignore[return-value]

    rings = {a: tuple(1.5 * model_s(a, s) for s in sizes) for a in ("direct", "ring")}
    table = TuneTable(MODEL, 64 * KB, (Measured("allgather", n, sizes, rings),), "synthetic")
    query = Query("allgather", n, 16 * MB // 4 // n, 4, cma=True)
    assert model_s("cma", 16 * MB) < min(model_s(a, 16 * MB) for a in rings)
    assert decide(query, table=table, slot_bytes=64 * KB).algorithm.name == "cma"
    slow = {**rings, "cma": tuple(3 * t for t in rings["ring"])}
    table = TuneTable(MODEL, 64 * KB, (Measured("allgather", n, sizes, slow),), "synthetic")
    assert decide(query, table=table, slot_bytes=64 * KB).algorithm.name != "cma"


@pytest.mark.parametrize("collective", ["broadcast", "reduce", "allreduce"])
def test_dbtree_waits_for_large_calls_at_two_ranks(collective: str) -> None:
    """At 2 ranks dbtree's two trees are one link and it sends two messages where direct sends
    one: auto must not take it for small calls there (the model alone preferred it by 0.2 ns);
    at 3 ranks and more its threshold is 0."""
    for nbytes in (8, 256, 4 * KB, 16 * KB - 4):
        picked = decide(Query(collective, 2, nbytes // 4, 4), slot_bytes=64 * KB).algorithm.name
        assert picked != "dbtree", (nbytes, picked)
    assert registry.get(collective, "dbtree").auto_from(2) == 16 * KB
    assert registry.get(collective, "dbtree").auto_from(3) == 0


def test_allreduce_at_two_ranks_runs_direct_unless_cma_prefers_it() -> None:
    """At 2 ranks one round of whole pieces beat the rings' two rounds of halves at every size
    measured (the built-in model took the rings from 16 KiB): where cma is not weighed (not
    permitted, or the launch's race saw the rings win), ``direct`` runs at every size; where cma
    is weighed it prefers the call from its 64 KiB and wins over direct's claim. 3 ranks and a
    tune table's measurements are untouched."""
    from shmcoll.shm.cma import NEVER

    sizes = (8, 4 * KB, 16 * KB, 64 * KB - 4, 64 * KB, 1 << 20, 16 << 20, 256 << 20)
    for nbytes in sizes:
        for query in (
            Query("allreduce", 2, nbytes // 4, 4),
            Query("allreduce", 2, nbytes // 4, 4, cma=True, cma_crossover=NEVER),
            Query("allreduce", 2, nbytes // 4, 4, inplace=True, cma=True, cma_crossover=NEVER, cores=2),
        ):
            decision = decide(query, slot_bytes=64 * KB)
            assert (decision.algorithm.name, decision.reason) == ("direct", "preferred"), (nbytes, query)
    for crossover in (0, 16 * KB):  # not measured, or the kernel won from 16 KiB blocks
        for nbytes, expected in ((16 * KB, "direct"), (64 * KB, "cma"), (16 << 20, "cma")):
            query = Query("allreduce", 2, nbytes // 4, 4, cma=True, cma_crossover=crossover)
            assert decide(query, slot_bytes=64 * KB).algorithm.name == expected, (crossover, nbytes)
    assert decide(Query("allreduce", 3, 32 * KB // 4, 4), slot_bytes=64 * KB).reason != "preferred"
    assert decide(Query("allreduce", 4, 1 << 18, 4), slot_bytes=64 * KB).algorithm.name != "direct"
    # buffers from comm.alloc: zerocopy, which copies nothing, is the model's to weigh from 64 KiB
    assert decide(Query("allreduce", 2, 2, 4, registered=True), slot_bytes=64 * KB).algorithm.name == "direct"
    large = decide(Query("allreduce", 2, 4 << 20, 4, registered=True), slot_bytes=64 * KB)
    assert (large.algorithm.name, large.reason) == ("zerocopy", "model")
    sizes = (16 * KB,)
    ring_faster = {"direct": (9e-6,), "ring": (4e-6,)}
    table = TuneTable(MODEL, 64 * KB, (Measured("allreduce", 2, sizes, ring_faster),), "synthetic")
    assert decide(Query("allreduce", 2, 16 * KB // 4, 4), table=table, slot_bytes=64 * KB).algorithm.name == "ring"


def test_scan_runs_the_chain_where_ranks_outnumber_cores() -> None:
    """Where ranks outnumber cores, scan and exscan run ``ring``'s chain at every size (the
    built-in model, which prices ``direct``'s one round as one hand-off, took ``direct`` below
    128-512 KiB); with a core per rank or unknown cores the model decides as before, and a tune
    table's measurements still decide."""
    for collective in ("scan", "exscan"):
        for n in (3, 4, 8):
            for nbytes in (8, 2 * KB, 32 * KB, 128 * KB, 2 << 20):
                for inplace in (False, True):
                    query = Query(collective, n, nbytes // 4, 4, inplace=inplace, cores=2)
                    decision = decide(query, overrides="", slot_bytes=64 * KB)
                    assert (decision.algorithm.name, decision.reason) == ("ring", "preferred"), (collective, n, nbytes)
        for cores in (0, 4, 8):
            small = decide(Query(collective, 4, 2, 4, cores=cores), overrides="", slot_bytes=64 * KB)
            assert (small.algorithm.name, small.reason) == ("direct", "model"), (collective, cores)
        direct_faster = {"direct": (1e-6,), "ring": (2e-6,)}
        table = TuneTable(MODEL, 64 * KB, (Measured(collective, 4, (8,), direct_faster),), "synthetic")
        measured = decide(Query(collective, 4, 2, 4, cores=2), overrides="", table=table, slot_bytes=64 * KB)
        assert (measured.algorithm.name, measured.reason) == ("direct", "measured")


def test_allgatherv_leaves_the_ring_where_ranks_outnumber_cores() -> None:
    """Where ranks outnumber cores, allgatherv runs ``direct`` at every size (the built-in model,
    with the two within a few percent, took the ring at blocks of 256-512 KiB at 4 ranks, where it
    measured 1.3-1.7x slower); with a core per rank, or unknown cores, the model decides as before."""

    def pick(n: int, nbytes: int, cores: int) -> str:
        query = Query("allgatherv", n, nbytes // 4 // n, 4, cores=cores)
        return decide(query, overrides="", slot_bytes=64 * KB).algorithm.name

    for n in (3, 4, 8):
        for nbytes in (16 * KB, 256 * KB, 1 << 20, 2 << 20, 16 << 20):
            assert pick(n, nbytes, cores=2) == "direct", (n, nbytes)
    assert "ring" in {pick(4, nbytes, cores) for nbytes in (1 << 20, 2 << 20) for cores in (0, 4)}
    assert pick(2, 4 << 20, cores=2) == "ring"  # (a core per rank: the model, which ties them)
    assert pick(4, 1 << 20, cores=2) != pick(4, 1 << 20, cores=4)


def test_reduce_leaves_the_chain_where_ranks_outnumber_cores() -> None:
    """Where ranks outnumber cores at most twice over, reduce runs no chain below 16 MiB (the
    built-in model took ``ring``'s chain from 128 KiB at 3-4 ranks on 2 cores, where ``dbtree``
    measured up to 1.7x faster), nor at any size where they are fewer than twice the cores; from
    16 MiB at twice the cores, at three ranks a core or more, and with a core per rank or unknown
    cores, the model decides as before."""

    def pick(n: int, nbytes: int, cores: int, inplace: bool = False) -> str:
        query = Query("reduce", n, nbytes // 4, 4, inplace=inplace, cores=cores)
        return decide(query, overrides="", slot_bytes=64 * KB).algorithm.name

    for n in (3, 4):
        for nbytes in (64 * KB, 256 * KB, 1 << 20, 4 << 20, 8 << 20):
            for inplace in (False, True):
                assert pick(n, nbytes, 2, inplace) != "ring", (n, nbytes, inplace)
    assert pick(4, 1 << 20, cores=2) == "dbtree"
    assert pick(8, 1 << 20, cores=4) == "dbtree"
    assert {pick(4, 1 << 20, cores) for cores in (0, 4)} == {"ring"}  # (the model, as before)
    assert pick(8, 1 << 20, cores=2) == "ring"  # (four ranks a core: the model)
    assert pick(4, 16 << 20, cores=2) == "ring"
    for nbytes in (16 << 20, 64 << 20):  # fewer than twice the cores: at every size
        assert pick(3, nbytes, cores=2) != "ring"


def test_ranks_outnumbering_cores_pay_a_longer_hand_off() -> None:
    """Where ranks outnumber the machine's cores (``Query.cores``), the built-in model's alpha is
    ``OVERSUBSCRIBED_ALPHA_S``: a chain of forwarding hand-offs (ring's allgather) then loses to
    ``direct``'s one hand-off per block. With a core per rank, or unknown cores, nothing changes,
    and a tune table's calibrated model is left as it is."""

    def pick(cores: int, collective: str = "allgather", nbytes: int = 256 << 10, table: Any = None) -> str:
        return decide(Query(collective, 4, nbytes // 4 // 4, 4, cores=cores), overrides="", table=table).algorithm.name

    assert pick(2) == "direct" and pick(2, nbytes=64 << 10) == "direct"
    assert pick(0) == pick(8) == pick(4) == "ring"
    assert pick(2, "allreduce", 16 << 20) == "ring"  # bandwidth still decides large calls
    table = select.TuneTable(cost.CostModel(select.DEFAULT_ALPHA_S, select.DEFAULT_BETA_BPS), 64 << 10, ())
    assert pick(2, table=table) == "ring"
