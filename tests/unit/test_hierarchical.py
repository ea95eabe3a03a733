"""hierarchical: plans verified with several group sizes, the shape of its phases, the topology
parsing against a fake /sys, the choice, the simulator's closed form, and the CLI."""

from __future__ import annotations

import os

import pytest

from shmcoll import sim, topology
from shmcoll.algos import closed_forms, registry, select
from shmcoll.algos.hierarchical import groups
from shmcoll.algos.registry import Query
from shmcoll.plan.passes import channel_skeleton, plan_call
from shmcoll.plan.verify import verify

KINDS = ("allreduce", "broadcast", "reduce")


def _group_sizes(n: int) -> list[int | None]:
    return [None, *sorted({1, 2, 3, 4, n})]


def _verify_all(kind: str, n: int, group_size: int | None, shapes) -> None:  # type: ignore[no-untyped-def]
    alg = registry.get(kind, "hierarchical")
    options = {"group_size": group_size}
    for root in range(n) if kind != "allreduce" else [0]:
        for count, slot in shapes:
            for inplace in (False, True):
                # Plans for one slot (fenced) must run on any number; plans for two on two.
                for built_for in (1, 2):
                    plan = plan_call(alg, n, count, slot, root=root, inplace=inplace, options=options, nslots=built_for)
                    for nslots in range(built_for, 3):
                        verify(plan, world_size=n, count=count, root=root, inplace=inplace, nslots=nslots)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", range(1, 17))
def test_verifier_accepts_every_group_size(kind: str, n: int) -> None:
    """Group sizes 1, 2, 3, 4, n and none; uneven last groups (n=7, g=3: 3+3+1); every root."""
    shapes = ((0, 4), (1, 4), (n + 1, 4), (13, 3), (3 * n + 2, 2))
    if kind != "allreduce":
        shapes = ((0, 4), (n + 1, 4), (3 * n + 2, 2))
    for g in _group_sizes(n):
        _verify_all(kind, n, g, shapes)


def test_uneven_groups_with_many_pieces_and_leftovers() -> None:
    for n, g in ((7, 3), (10, 4), (11, 5), (9, 2)):
        _verify_all("allreduce", n, g, ((37, 1), (64, 8), (101, 5), (g - 1, 1)))


@pytest.mark.parametrize("kind", KINDS)
def test_no_step_moves_more_than_one_slot(kind: str) -> None:
    alg = registry.get(kind, "hierarchical")
    for n, g in ((3, 2), (5, 2), (7, 3), (8, 4), (8, 3)):
        for slot in (1, 3, 7):
            for count in (0, 5, 4 * n * slot + 3):
                plan = plan_call(alg, n, count, slot, root=n - 1, options={"group_size": g})
                for part in (plan.body, plan.tail):
                    for program in part.programs if part else []:
                        for s in program:
                            if s.recv is not None or s.send is not None:
                                assert s.count <= slot, (kind, n, g, slot, count, str(s))


@pytest.mark.parametrize("kind", KINDS)
def test_in_place_never_changes_messages(kind: str) -> None:
    alg = registry.get(kind, "hierarchical")
    for n, g in ((5, 2), (7, 3), (8, 4)):
        for root in range(n):
            a, b = (
                plan_call(alg, n, 11, 2, root=root, inplace=inplace, options={"group_size": g})
                for inplace in (False, True)
            )
            for x, y in ((a.tail, b.tail), (a.body, b.body)):
                assert (x is None) == (y is None)
                if x is not None:
                    assert channel_skeleton(x) == channel_skeleton(y)  # type: ignore[arg-type]


def _traffic(plan, group_size: int) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:  # type: ignore[no-untyped-def]
    """Elements sent per (rank, peer), within groups and between them."""
    intra: dict[tuple[int, int], int] = {}
    inter: dict[tuple[int, int], int] = {}
    for r, program in enumerate(plan.programs):
        for s in program:
            if s.send is not None:
                table = intra if r // group_size == s.send // group_size else inter
                table[(r, s.send)] = table.get((r, s.send), 0) + s.count
    return intra, inter


def test_allreduce_phases_n8_g4() -> None:
    """Reduce-scatter within each group of 4, then each shard (count/4) between the two ranks
    holding it (r and r + 4) only, then allgather within the group."""
    n, g, count = 8, 4, 64
    plan = plan_call(registry.get("allreduce", "hierarchical"), n, count, 1024, options={"group_size": g})
    assert plan.body is None
    intra, inter = _traffic(plan.tail, g)
    assert set(inter) == {(r, (r + 4) % 8) for r in range(n)}
    assert all(v == count // g for v in inter.values())
    # ring within a group: (g-1) chunks of count/g each way, in each of the two intra phases
    for r in range(n):
        assert sum(v for (src, _), v in intra.items() if src == r) == 2 * (g - 1) * count // g
        assert {dst for (src, dst) in intra if src == r} == {r // g * g + (r % g + 1) % g}
    # the same message pattern for every rank, whatever the group: three phases in order
    peers = [[s.send if s.send is not None else s.recv for s in p if s.count] for p in plan.tail.programs]
    for r, seq in enumerate(peers):
        outside = [i for i, p in enumerate(seq) if p // g != r // g]
        assert outside and outside == list(range(outside[0], outside[-1] + 1)), seq


def test_one_group_degenerates() -> None:
    """No group size, or one at least n: one group, never an inter-group message."""
    alg = registry.get("allreduce", "hierarchical")
    a = plan_call(alg, 6, 30, 4)
    b = plan_call(alg, 6, 30, 4, options={"group_size": 6})
    c = plan_call(alg, 6, 30, 4, options={"group_size": 9})
    assert channel_skeleton(a.tail) == channel_skeleton(b.tail) == channel_skeleton(c.tail)
    assert groups(6, None) == groups(6, 9) == [list(range(6))]
    assert groups(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError):
        groups(4, 0)


def test_broadcast_and_reduce_cross_groups_only_between_leaders() -> None:
    n, g = 9, 3
    for kind in ("broadcast", "reduce"):
        for root in range(n):
            plan = plan_call(registry.get(kind, "hierarchical"), n, 8, 1024, root=root, options={"group_size": g})
            _, inter = _traffic(plan.tail, g)
            leaders = {root} | {m[0] for m in groups(n, g) if root not in m}
            assert {r for pair in inter for r in pair} <= leaders, (kind, root, inter)


# --- topology --------------------------------------------------------------------------------------
def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def _fake_sys(root: str, nodes: list[str], packages: list[int], l3: list[str]) -> None:
    for i, cpus in enumerate(nodes):
        _write(os.path.join(root, "devices/system/node", f"node{i}", "cpulist"), cpus)
    _write(os.path.join(root, "devices/system/node/possible"), "0-1")  # not a node directory
    for cpu, package in enumerate(packages):
        base = os.path.join(root, "devices/system/cpu", f"cpu{cpu}")
        _write(os.path.join(base, "topology/physical_package_id"), str(package))
        _write(os.path.join(base, "cache/index0/level"), "1")
        _write(os.path.join(base, "cache/index0/shared_cpu_list"), str(cpu))
        _write(os.path.join(base, "cache/index3/level"), "3")
        _write(os.path.join(base, "cache/index3/shared_cpu_list"), l3[cpu])
    _write(os.path.join(root, "devices/system/cpu/cpufreq/policy0"), "x")


def test_parse_cpulist() -> None:
    assert topology.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert topology.parse_cpulist("") == frozenset()


def test_read_topology_from_a_fake_sys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # 2 sockets x 4 CPUs, one NUMA node per socket, an L3 per pair of CPUs
    l3 = ["0-1", "0-1", "2-3", "2-3", "4-5", "4-5", "6-7", "6-7"]
    _fake_sys(str(tmp_path), ["0-3", "4-7"], [0, 0, 0, 0, 1, 1, 1, 1], l3)
    topo = topology.read_topology(str(tmp_path))
    assert topo.numa == (frozenset(range(4)), frozenset(range(4, 8)))
    assert topo.socket == topo.numa
    assert topo.l3 == tuple(frozenset({2 * i, 2 * i + 1}) for i in range(4))
    pinned = [{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}]
    assert topology.group_size_for(pinned, topo) == 4  # NUMA nodes first
    assert topology.group_size_for([{0}, {1}, {4}, {5}], topo) == 2
    assert topology.group_size_for([{0}, {4}, {1}, {5}], topo) is None  # not contiguous
    assert topology.group_size_for([{0}, {1}, {2}, {4}, {5}], topo) == 3  # last group smaller
    assert topology.group_size_for([{0}, {4}, {5}, {6}], topo) is None  # first run shorter
    assert topology.group_size_for([set(range(8))] * 4, topo) is None  # unpinned: one group
    assert topology.group_size_for([{0, 1}, {2, 3}, {4, 5}, {6, 7}], topo) == 2
    # a single NUMA node and socket: grouped by L3 instead
    one = topology.Topology(numa=(frozenset(range(8)),), socket=(frozenset(range(8)),), l3=topo.l3)
    assert topology.group_size_for([{0}, {1}, {2}, {3}], one) == 2
    assert topology.group_size_for(pinned, topology.Topology()) is None


def test_read_topology_of_an_empty_sys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert topology.read_topology(str(tmp_path)) == topology.Topology()
    assert isinstance(topology.affinity(), frozenset)


def test_contiguous_group_size() -> None:
    assert topology.contiguous_group_size([0, 0, 1, 1, 2]) == 2
    assert topology.contiguous_group_size([0, 0, 0]) is None
    assert topology.contiguous_group_size([0, None]) is None
    assert topology.contiguous_group_size([0, 1, 1]) is None


# --- choice, simulator, CLI ------------------------------------------------------------------------
def test_auto_never_picks_hierarchical_on_one_group() -> None:
    select.reset()
    for n in (2, 4, 8):
        for count in (1, 1 << 12, 1 << 20):
            for g in (None, 1, n, 2 * n):
                d = select.decide(Query("allreduce", n, count, 4), group_size=g)
                assert d.algorithm.name != "hierarchical", (n, count, g, d)
    d = select.decide(Query("allreduce", 8, 1 << 20, 4), group_size=4)
    assert "hierarchical" in d.detail or d.algorithm.name == "hierarchical"
    assert select.choose(Query("allreduce", 4, 16, 4), "hierarchical").name == "hierarchical"
    select.reset()


def test_closed_form_equals_the_plans() -> None:
    form = closed_forms.closed_form("allreduce", "hierarchical", 4)
    assert form is not None and form.holds_at(4 * 1024) and not form.holds_at(4 * 3)
    assert closed_forms.validate_closed_form(form, [16, 32, 64, 128, 256]) == []
    model = sim.CostModel(5e-6, 25e9, inter_alpha_s=10e-6, inter_beta_Bps=5e9, group_size=4)
    p = sim.predict("allreduce", "hierarchical", 4 * 4096, 1 << 20, model)
    assert p.method == "closed form" and p.time_s


def test_simulated_hierarchical_uses_the_models_groups() -> None:
    """Its inter-group bytes shrink with the group (count/g per rank), the ring's do not."""
    model = sim.CostModel(5e-6, 25e9, inter_alpha_s=10e-6, inter_beta_Bps=1e9, group_size=8)
    t = {name: sim.predict("allreduce", name, 32, 1 << 26, model).time_s for name in ("ring", "hierarchical")}
    assert t["hierarchical"] < t["ring"]  # type: ignore[operator]


def test_plan_show_with_group_size() -> None:
    from click.testing import CliRunner

    from shmcoll.cli.main import main

    args = ["plan", "show", "allreduce", "--algorithm", "hierarchical", "-n", "8", "--count", "16"]
    result = CliRunner().invoke(main, [*args, "--group-size", "4"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "groups of 4" in result.output and "rank 7:" in result.output
    # rank 0 talks to rank 4 (its shard's peer in the other group), and to no other outsider
    rank0 = result.output.split("rank 0:")[1].split("rank 1:")[0]
    assert "send(4)" in rank0 and "recv(4)" in rank0
    assert not any(f"send({p})" in rank0 or f"recv({p})" in rank0 for p in (5, 6, 7))
