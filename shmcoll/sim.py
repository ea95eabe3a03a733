"""The scale tool behind ``shmcoll simulate``: predicted time and bus bandwidth of the real plans,
at any world size, as tables and plots.

The cost model and the event simulation of a plan are :mod:`shmcoll.plan.cost` (alpha-beta per
message, bounded slots, pipelined pieces extrapolated once periodic). :func:`predict` simulates an
algorithm's plan up to ``limit`` ranks (``EXACT_LIMIT``, 128, by default) and uses the
algorithm's closed form above, fitted to and checked against its plans
(:mod:`shmcoll.algos.closed_forms`); an algorithm without one is reported as "n too large to simulate".
:func:`sweep` makes the rows of a table, :func:`format_table`, :func:`format_closed_forms` and
:func:`plot` show them.

A call's size is the largest per-rank buffer, as ``bench`` counts it (allgather's output,
reduce_scatter's input); bus bandwidth uses nccl-tests' factors (:mod:`shmcoll.collectives`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from shmcoll import collectives
from shmcoll.algos import registry
from shmcoll.algos.closed_forms import FIGURES, INTER_FIGURES, ClosedForm, closed_form
from shmcoll.algos.registry import Query
from shmcoll.collectives import COLLECTIVES  # (variable counts: the total split evenly, see plan.cost)
from shmcoll.plan.cost import EXACT_LIMIT, CostModel, plan_time
from shmcoll.units import format_size, format_time, human_size


# --- predictions ---------------------------------------------------------------------------------
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
        return None if algbw is None else algbw * collectives.get(self.collective).bus_factor(self.world_size)


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
    record = collectives.get(collective)
    count = record.count_for(world_size, size_bytes, itemsize)
    size = record.call_bytes(world_size, count, itemsize)

    def row(time_s: float | None, traffic: float | None, method: str, note: str = "") -> Prediction:
        return Prediction(collective, algorithm, world_size, size, time_s, traffic, method, note)

    # (cma=True: the plan's cost, whether or not this machine permits cross-memory attach)
    reason = alg.supports(Query(collective, world_size, count, itemsize, root=root, cma=True))
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
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; one of {', '.join(COLLECTIVES)}")
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
    if p.time_s is None:
        return [p.algorithm, str(p.world_size), format_size(p.size_bytes), "-", "-", "-", "-", p.note]
    return [
        p.algorithm,
        str(p.world_size),
        format_size(p.size_bytes),
        format_time(p.time_s),
        f"{p.algbw_GBps:.3g}" if p.algbw_GBps is not None else "-",
        f"{p.busbw_GBps:.3g}" if p.busbw_GBps is not None else "-",
        human_size(p.traffic_bytes or 0.0),
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


# Each algorithm keeps its look in every panel; lines that coincide stay visible as different
# hollow markers on different dashes.
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")
_DASHES = ("-", "--", "-.", ":")


def plot(rows: Sequence[Prediction], path: str, title: str = "") -> None:
    """Predicted time vs ranks, one panel per size, one line per algorithm (needs matplotlib).

    The figure is at least wide enough for its title (wrapped when long), whatever the number of
    panels; ticks are the world sizes simulated, sizes are binary (``1 KiB``).
    """
    import textwrap

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install 'shmcoll[plot]'") from None
    sizes = sorted({p.size_bytes for p in rows})
    names = list(dict.fromkeys(p.algorithm for p in rows))
    world_sizes = sorted({p.world_size for p in rows})
    panels = max(1, len(sizes))
    width = max(8.0, 4.5 * panels)
    fig, axes = plt.subplots(1, panels, figsize=(width, 4.8), squeeze=False, layout="constrained")
    for ax, size in zip(axes[0], sizes, strict=False):
        for k, name in enumerate(names):
            pts = sorted(
                (p.world_size, p.time_s) for p in rows if p.size_bytes == size and p.algorithm == name and p.time_s
            )
            if not pts:
                continue
            ax.plot(
                [x for x, _ in pts],
                [y for _, y in pts],
                marker=_MARKERS[k % len(_MARKERS)],
                linestyle=_DASHES[k % len(_DASHES)],
                markersize=7 + 2 * (k % 3),
                markerfacecolor="none",
                label=name,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(world_sizes, [str(n) for n in world_sizes])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # (2^k labels between the ticks)
        ax.set_xlabel("ranks")
        ax.set_ylabel("predicted time (s)")
        ax.set_title(human_size(size, iec=True))
        ax.grid(True, which="major", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 6), fontsize="small")
    if title:
        # ~12 characters per inch at the default suptitle size
        fig.suptitle(textwrap.fill(title, width=int(width * 12)))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- more than one machine -----------------------------------------------------------------------
MULTINODE_COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")


@dataclasses.dataclass(frozen=True)
class NodePrediction:
    """One row of ``shmcoll simulate --nodes``: a hierarchical collective of
    :class:`shmcoll.comm.multinode.MultiNodeCommunicator` on ``nodes`` x ``ranks_per_node`` ranks."""

    collective: str
    nodes: int
    ranks_per_node: int
    size_bytes: int
    node_s: float  # the phases inside the nodes (shmcoll plans)
    inter_s: float  # the phase between nodes (the rails, over MPI)
    overhead_s: float  # fixed cost per call (Python, MPI polling), from calibration

    @property
    def time_s(self) -> float:
        return self.node_s + self.inter_s + self.overhead_s

    @property
    def busbw_GBps(self) -> float:
        n = self.nodes * self.ranks_per_node
        return self.size_bytes / self.time_s / 1e9 * collectives.get(self.collective).bus_factor(n)


def _best_node_time(
    collective: str, ranks: int, size_bytes: int, model: CostModel, itemsize: int, slot_bytes: int
) -> float:
    """The fastest registered plan's predicted time for one node's phase (0 for one rank)."""
    if ranks <= 1 or size_bytes <= 0:
        return 0.0
    best = None
    for alg in registry.algorithms(collective):
        p = predict(collective, alg.name, ranks, size_bytes, model, itemsize=itemsize, slot_bytes=slot_bytes)
        if p.time_s is not None and (best is None or p.time_s < best):
            best = p.time_s
    return best or 0.0


def predict_nodes(
    collective: str,
    nodes: int,
    ranks_per_node: int,
    size_bytes: int,
    model: CostModel,
    inter_alpha_s: float,
    inter_beta_Bps: float,
    *,
    itemsize: int = 4,
    slot_bytes: int = 64 << 10,
    overhead_s: float = 0.0,
) -> NodePrediction:
    """Predicted time of one hierarchical call over ``nodes`` nodes of ``ranks_per_node`` ranks.

    The phases inside a node are the real plans of this library simulated under ``model`` (the
    fastest registered algorithm, as ``auto`` would pick); the phase between nodes is the rails'
    MPI collective under an alpha-beta model: ``ranks_per_node`` rails at once share the node's
    link of ``inter_beta_Bps`` (so a node moves the whole payload through it), each rail's
    collective costs the textbook rounds (recursive halving/doubling: ``ceil(log2 nodes)``
    latencies per reduce-scatter or allgather half, ``(nodes-1)/nodes`` of the bytes each way).
    ``size_bytes`` is the largest per-rank buffer, as for :func:`predict`.
    """
    if collective not in MULTINODE_COLLECTIVES:
        raise ValueError(f"--nodes predicts {', '.join(MULTINODE_COLLECTIVES)}; not {collective!r}")
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError("nodes and ranks per node must be >= 1")
    L, N, S = ranks_per_node, nodes, float(size_bytes)
    rounds = math.ceil(math.log2(N)) if N > 1 else 0
    frac = (N - 1) / N
    a, b = inter_alpha_s, inter_beta_Bps

    def node(c: str, nbytes: float) -> float:
        return _best_node_time(c, L, int(nbytes), model, itemsize, slot_bytes)

    if collective == "allreduce":  # node RS, rails RS + AG, node AG
        t_node = node("reduce_scatter", S) + node("allgather", S)
        t_inter = 2 * rounds * a + 2 * frac * S / b if N > 1 else 0.0
    elif collective == "reduce_scatter":  # node RS (all), rails RS to the nodes, node AG (a node's part)
        t_node = node("reduce_scatter", S) + node("allgather", S / N)
        t_inter = rounds * a + frac * S / b if N > 1 else 0.0
    elif collective == "allgather":  # node AG (the node's blocks), rails AG of shards, node AG (all)
        t_node = node("allgather", S * L / (N * L)) + node("allgather", S)
        t_inter = rounds * a + frac * S / b if N > 1 else 0.0
    elif collective == "broadcast":  # node bcast on the root's node, rails bcast (scatter + AG), node AG
        t_node = node("broadcast", S) + node("allgather", S)
        t_inter = 2 * rounds * a + 2 * frac * S / b if N > 1 else 0.0
    else:  # reduce: node RS, rails reduce (RS + gather), node gather
        t_node = node("reduce_scatter", S) + node("gather", S)
        t_inter = 2 * rounds * a + 2 * frac * S / b if N > 1 else 0.0
    return NodePrediction(collective, N, L, int(size_bytes), t_node, t_inter, overhead_s)


def format_nodes_table(rows: Sequence[NodePrediction], *, markdown: bool = False) -> str:
    """``shmcoll simulate --nodes``' table."""
    head = ("nodes", "ranks", "size", "time", "in nodes", "between nodes", "fixed", "busbw (GB/s)")
    cells = [
        [
            str(r.nodes),
            str(r.nodes * r.ranks_per_node),
            format_size(r.size_bytes),
            format_time(r.time_s),
            format_time(r.node_s),
            format_time(r.inter_s),
            format_time(r.overhead_s),
            f"{r.busbw_GBps:.3g}",
        ]
        for r in rows
    ]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(head)]
    lines = ["# " + "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  " + "  ".join(x.rjust(w) for x, w in zip(c, widths, strict=True)) for c in cells]
    return "\n".join(lines)
