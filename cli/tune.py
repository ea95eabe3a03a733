"""``shmcoll tune``: measure this machine and write the table ``algorithm="auto"`` reads."""

from __future__ import annotations

import click

from shmcoll.units import parse_size


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command()
@click.option(
    "-n", "--nprocs", default=None, help="World sizes to measure, comma-separated (default: 2 and min(4, cores))."
)
@click.option("-c", "--collective", default="all", show_default=True, help="Collectives (comma-separated) or 'all'.")
@click.option("-b", "--min-bytes", default="8", show_default=True, callback=_size, help="Smallest size.")
@click.option("-e", "--max-bytes", default="16M", show_default=True, callback=_size, help="Largest size.")
@click.option("-f", "--step-factor", type=float, default=4.0, show_default=True, help="Multiply the size by this.")
@click.option("--iters", type=int, default=10, show_default=True, help="Timed iterations per size.")
@click.option("--warmup", type=int, default=3, show_default=True, help="Untimed iterations per size.")
@click.option(
    "--repeat",
    type=int,
    default=3,
    show_default=True,
    help="Sweeps, each in a launch of its own, compared launch by launch and averaged.",
)
@click.option(
    "--registered/--no-registered",
    default=True,
    show_default=True,
    help="Also measure on comm.alloc buffers, where zerocopy competes.",
)
@click.option("--link-bytes", default="16M", show_default=True, callback=_size, help="Large ping-pong message.")
@click.option("--link-iters", type=int, default=100, show_default=True, help="Small ping-pong round trips.")
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False), default=None, help="Table path (default: SHMCOLL_TUNE_FILE)."
)
@click.option("--timeout", type=float, default=900.0, show_default=True, help="Seconds allowed per world size.")
def tune(
    collective,
    nprocs,
    min_bytes,
    max_bytes,
    step_factor,
    iters,
    warmup,
    repeat,
    registered,
    link_bytes,
    link_iters,
    output,
    timeout,
) -> None:  # type: ignore[no-untyped-def]
    """Calibrate the cost model (ping-pong latency and bandwidth through the engine) and time every
    registered algorithm at a set of sizes; write the table that algorithm="auto" reads."""
    from shmcoll import bench, config, tune

    try:
        sizes = tuple(int(v) for v in _csv(nprocs)) if nprocs else tuple(sorted({2, bench.default_nprocs()}))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {nprocs!r}", param_hint="--nprocs") from None
    cfg = tune.TuneConfig(
        world_sizes=sizes,
        collectives=bench.BENCH_COLLECTIVES if collective == "all" else _csv(collective),
        min_bytes=min_bytes,
        max_bytes=max_bytes,
        step_factor=step_factor,
        iters=iters,
        warmup=warmup,
        repeat=repeat,
        registered=registered,
        link_large_bytes=link_bytes,
        link_iters=link_iters,
    )
    try:
        cfg.validate()
    except (ValueError, TypeError) as exc:
        raise click.UsageError(str(exc)) from None
    path = output or config.get().tune_file
    table, link = tune.run(cfg, path, timeout=timeout, progress=lambda text: click.echo(f"# {text}", err=True))
    click.echo(tune.summary(table, link))
    click.echo(f"# wrote {path}")
