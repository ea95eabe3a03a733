"""``shmcoll simulate``: predicted time and bus bandwidth of algorithms at any scale (no processes)."""

from __future__ import annotations

import click

from shmcoll.units import format_size, parse_bandwidth, parse_size, parse_time


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _ints(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in _csv(value))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not out or min(out) < 1:
        raise click.BadParameter(f"world sizes must be >= 1, got {value!r}")
    return out


def _sizes(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        out = tuple(parse_size(v) for v in _csv(value))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if not out:
        raise click.BadParameter("give at least one size")
    return out


def _parsed(kind: str):  # type: ignore[no-untyped-def]
    def convert(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
        if value is None:
            return None
        try:
            return parse_time(value) if kind == "time" else parse_bandwidth(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None

    return convert


def names_shown(rows) -> list[str]:  # type: ignore[no-untyped-def]
    return list(dict.fromkeys(r.algorithm for r in rows))


@click.command()
@click.option("-c", "--collective", default="allreduce", show_default=True, help="The collective.")
@click.option(
    "-a", "--algorithm", default="all", show_default=True, help="Comma-separated names, or 'all' registered ones."
)
@click.option("-n", "--world-size", "world_sizes", default="8,64,1024,16384", show_default=True, callback=_ints)
@click.option("-s", "--size", "sizes", default="1K,1M,1G", show_default=True, callback=_sizes, help="Call sizes.")
@click.option("--alpha", default="5us", show_default=True, callback=_parsed("time"), help="Message latency.")
@click.option("--beta", default="25GB/s", show_default=True, callback=_parsed("bw"), help="Copy bandwidth.")
@click.option("--inter-alpha", default=None, callback=_parsed("time"), help="Latency between groups.")
@click.option("--inter-beta", default=None, callback=_parsed("bw"), help="Bandwidth between groups.")
@click.option("--group-size", type=int, default=None, help="Ranks per group (node); needed by --inter-*.")
@click.option(
    "--nodes",
    "nodes",
    default=None,
    help="Node counts (e.g. 2,64,1024): predict init_mpi's hierarchical collective over that many "
    "machines, -n ranks per node, --inter-alpha/--inter-beta between nodes (the node's link).",
)
@click.option("--overhead", default=None, callback=_parsed("time"), help="With --nodes: a fixed cost per call.")
@click.option("--slot-bytes", default="64K", show_default=True, help="Segment (ring slot) size the plans use.")
@click.option("--nslots", type=int, default=4, show_default=True, help="Slots per channel.")
@click.option("--dtype", default="float32", show_default=True, help="Element type.")
@click.option("--root", type=int, default=0, show_default=True, help="Root of rooted collectives.")
@click.option("--limit", type=int, default=None, help="Simulate plans exactly up to this many ranks (default 128).")
@click.option("--markdown", is_flag=True, help="Print a markdown table.")
@click.option("--closed-forms", is_flag=True, help="Also print each algorithm's fitted closed form.")
@click.option(
    "--plot", "plot_path", type=click.Path(dir_okay=False), help="Plot time vs ranks to a PNG, a panel per size."
)
def simulate(  # type: ignore[no-untyped-def]
    collective,
    algorithm,
    world_sizes,
    sizes,
    alpha,
    beta,
    inter_alpha,
    inter_beta,
    group_size,
    nodes,
    overhead,
    slot_bytes,
    nslots,
    dtype,
    root,
    limit,
    markdown,
    closed_forms,
    plot_path,
) -> None:
    """Predict time and bus bandwidth from the plans under an alpha-beta model.

    Plans are simulated exactly up to the limit; above it each algorithm's closed form (fitted to
    and checked against its plans) is used, or the row says "n too large to simulate".
    """
    import numpy as np

    from shmcoll import sim
    from shmcoll.algos import registry
    from shmcoll.algos.closed_forms import closed_form
    from shmcoll.algos.registry import ALGORITHM_NAMES
    from shmcoll.cli.plan import check_name
    from shmcoll.collectives import COLLECTIVES
    from shmcoll.plan.cost import EXACT_LIMIT, CostModel

    check_name("collective", collective, COLLECTIVES, "--collective")
    if nodes is not None:
        _simulate_nodes(
            collective,
            nodes,
            world_sizes,
            sizes,
            alpha,
            beta,
            inter_alpha,
            inter_beta,
            overhead,
            nslots,
            dtype,
            slot_bytes,
            markdown,
        )
        return
    if algorithm != "all":
        for name in _csv(algorithm):  # (a real one that does not serve the collective is a note)
            check_name("algorithm", name, ALGORITHM_NAMES, "--algorithm")

    try:
        model = CostModel(
            alpha_s=alpha,
            beta_Bps=beta,
            inter_alpha_s=inter_alpha,
            inter_beta_Bps=inter_beta,
            group_size=group_size,
            nslots=nslots,
        )
        itemsize = np.dtype(dtype).itemsize
        slot = parse_size(slot_bytes)
    except (ValueError, TypeError) as exc:
        raise click.UsageError(str(exc)) from None
    if slot < itemsize:
        raise click.UsageError(f"--slot-bytes must hold at least one {dtype} element")
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError("--plot needs matplotlib: pip install 'shmcoll[plot]'") from None
    names = [a.name for a in registry.algorithms(collective)] if algorithm == "all" else list(_csv(algorithm))
    try:
        rows, notes = sim.sweep(
            collective,
            names,
            world_sizes,
            sizes,
            model,
            itemsize=itemsize,
            slot_bytes=slot,
            root=root,
            limit=limit or EXACT_LIMIT,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    lim = limit or EXACT_LIMIT
    head = (
        f"{collective}, {dtype}, {model.describe()}, slot {format_size(slot)}; "
        f"plans simulated up to {lim} ranks, closed forms above"
    )
    click.echo(("**" + head + "**\n") if markdown else f"# {head}")
    click.echo(sim.format_table(rows, notes, markdown=markdown))
    if closed_forms:
        click.echo("")
        forms = {name: closed_form(collective, name, model.group_size, model.nslots) for name in names_shown(rows)}
        click.echo(sim.format_closed_forms(forms, markdown=markdown))
    if plot_path:
        sim.plot(rows, plot_path, title=head)


def _simulate_nodes(  # type: ignore[no-untyped-def]
    collective,
    nodes,
    ranks_per_node,
    sizes,
    alpha,
    beta,
    inter_alpha,
    inter_beta,
    overhead,
    nslots,
    dtype,
    slot_bytes,
    markdown,
) -> None:
    """``--nodes``: the hierarchical collective of ``shmcoll.init_mpi`` at each node count."""
    import numpy as np

    from shmcoll import sim
    from shmcoll.plan.cost import CostModel

    try:
        counts = tuple(int(v) for v in _csv(nodes))
        if not counts or min(counts) < 1:
            raise ValueError
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated node counts >= 1, got {nodes!r}", param_hint="--nodes"
        ) from None
    try:
        model = CostModel(alpha_s=alpha, beta_Bps=beta, nslots=nslots)
        itemsize = np.dtype(dtype).itemsize
        slot = parse_size(slot_bytes)
        a = alpha if inter_alpha is None else inter_alpha
        b = beta if inter_beta is None else inter_beta
        rows = [
            sim.predict_nodes(
                collective, n, rpn, size, model, a, b, itemsize=itemsize, slot_bytes=slot, overhead_s=overhead or 0.0
            )
            for rpn in ranks_per_node
            for size in sizes
            for n in counts
        ]
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    head = (
        f"{collective} over nodes (shmcoll.init_mpi), {dtype}; in a node {model.describe()}; between nodes "
        f"alpha {a * 1e6:g} us, beta {b / 1e9:g} GB/s per node link"
        + (f"; fixed {overhead * 1e6:g} us per call" if overhead else "")
    )
    click.echo(("**" + head + "**\n") if markdown else f"# {head}")
    click.echo(sim.format_nodes_table(rows, markdown=markdown))
