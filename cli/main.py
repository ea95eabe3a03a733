"""The ``shmcoll`` command: parse, call the library, print. Heavy imports stay inside commands."""

from __future__ import annotations

import os
import sys

import click

from shmcoll._version import __version__
from shmcoll.cli.plan import plan
from shmcoll.cli.simulate import simulate
from shmcoll.cli.train import train
from shmcoll.cli.tune import tune
from shmcoll.units import format_size, parse_size


class _Size(click.ParamType):
    name = "size"

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


SIZE = _Size()


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="shmcoll")
def main() -> None:
    """Collective communication for processes on one machine, over shared memory."""


# --- bench --------------------------------------------------------------------------------------
@main.command()
@click.option("-n", "--nprocs", type=int, default=None, help="Ranks to start (default: min(4, cores), at least 2).")
@click.option(
    "-c", "--collective", default="allreduce", show_default=True, help="A collective, a comma-separated list, or 'all'."
)
@click.option(
    "-a",
    "--algorithm",
    default="auto",
    show_default=True,
    help="'auto', an algorithm name, a comma-separated list, or 'all' (every registered one).",
)
@click.option("-b", "--min-bytes", type=SIZE, default="8", show_default=True, help="Smallest size (K/M/G suffixes).")
@click.option("-e", "--max-bytes", type=SIZE, default="64M", show_default=True, help="Largest size.")
@click.option("-f", "--step-factor", type=float, default=2.0, show_default=True, help="Multiply the size by this.")
@click.option("--dtype", default="float32", show_default=True, help="numpy dtype name, or bfloat16.")
@click.option(
    "--op", default="sum", show_default=True, help="Reduction op (sum, prod, min, max, avg, band, bor, bxor)."
)
@click.option("--root", type=int, default=0, show_default=True, help="Root of rooted collectives.")
@click.option("--iters", type=int, default=20, show_default=True, help="Timed iterations per size.")
@click.option("--warmup", type=int, default=5, show_default=True, help="Untimed iterations per size.")
@click.option("--check/--no-check", default=True, show_default=True, help="Count wrong result elements.")
@click.option("--in-place", "mode", flag_value="in-place", help="Only in-place calls.")
@click.option("--out-of-place", "mode", flag_value="out-of-place", help="Only out-of-place calls.")
@click.option("--both", "mode", flag_value="both", default=True, help="Both (default).")
@click.option("--registered", is_flag=True, help="Use buffers from comm.alloc (zero-copy shared memory).")
@click.option("--stats", is_flag=True, help="Also print p10/p90 times.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the rows as JSON.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), help="Write the rows as CSV.")
@click.option(
    "--plot", "plot_path", type=click.Path(dir_okay=False), help="Plot busbw vs size to a PNG (needs the plot extra)."
)
@click.option("--inject-error", is_flag=True, hidden=True, help="Corrupt one result element (tests #wrong).")
@click.option("--quiet", is_flag=True, help="No progress line on stderr.")
def bench(
    nprocs,
    collective,
    algorithm,
    min_bytes,
    max_bytes,
    step_factor,
    dtype,
    op,
    root,
    iters,
    warmup,
    check,  # type: ignore[no-untyped-def]
    mode,
    registered,
    stats,
    json_path,
    csv_path,
    plot_path,
    inject_error,
    quiet,
) -> None:
    """Bandwidth and latency sweep, printed as nccl-tests' table.

    With no options: allreduce of float32 from 8 B to 64 MiB on min(4, cores) ranks.
    Exits non-zero if any result element is wrong.
    """
    from shmcoll import bench

    collectives = bench.BENCH_COLLECTIVES if collective == "all" else _csv(collective)
    modes = ("out-of-place", "in-place") if mode in (None, "both") else (mode,)
    cfg = bench.BenchConfig(
        collectives=tuple(collectives),
        algorithms=_csv(algorithm),
        nprocs=nprocs or bench.default_nprocs(),
        min_bytes=min_bytes,
        max_bytes=max_bytes,
        step_factor=step_factor,
        dtype=dtype,
        op=op,
        root=root,
        iters=iters,
        warmup=warmup,
        check=check,
        modes=modes,
        registered=registered,
        inject_error=inject_error,
        progress=not quiet,
    )
    try:
        bench.validate(cfg)
    except (ValueError, TypeError) as exc:
        raise click.UsageError(str(exc)) from None
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError("--plot needs matplotlib: pip install 'shmcoll[plot]'") from None
    rows = bench.run(cfg)
    click.echo(bench.format_table(rows, stats=stats))
    meta = {"nprocs": cfg.nprocs, "cores": len(os.sched_getaffinity(0)), "version": __version__}
    if json_path:
        bench.write_json(rows, json_path, meta)
    if csv_path:
        bench.write_csv(rows, csv_path)
    if plot_path:
        series: dict[str, list] = {}  # type: ignore[type-arg]
        for r in rows:
            series.setdefault(f"{r.collective} {r.algorithm}", []).append(r)
        bench.plot(series, plot_path, title=f"shmcoll, {cfg.nprocs} ranks, {cfg.dtype}")
    if any(r.wrong > 0 for r in rows):
        sys.exit(1)


# --- run ----------------------------------------------------------------------------------------
@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-n", "--nprocs", type=int, required=True, help="Number of ranks.")
@click.option("-m", "--module", default=None, help="Run a module (like python -m) instead of a script.")
@click.option("--timeout", type=float, default=None, help="Kill every rank after this many seconds.")
@click.option("--comm-timeout", type=float, default=None, help="Each collective's timeout (SHMCOLL_TIMEOUT).")
@click.option("--slot-bytes", type=SIZE, default=None, help="Ring slot payload size.")
@click.option("--nslots", type=int, default=None, help="Slots per ring.")
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
def run(nprocs, module, timeout, comm_timeout, slot_bytes, nslots, argv) -> None:  # type: ignore[no-untyped-def]
    """Run SCRIPT [ARGS] as NPROCS ranks; each calls shmcoll.init().

    Exits with the first failing rank's code (128 + signal if it was killed).
    """
    from shmcoll.launch import run_script

    if module:
        argv = ("-m", module, *argv)
    if not argv:
        raise click.UsageError("give a script (or -m MODULE) to run")
    if nprocs < 1:
        raise click.UsageError("--nprocs must be >= 1")
    from shmcoll.errors import ShmcollError

    try:
        code = run_script(
            nprocs, list(argv), timeout=timeout, comm_timeout=comm_timeout, slot_bytes=slot_bytes, nslots=nslots
        )
    except (ShmcollError, ValueError, TypeError) as exc:
        click.echo(f"shmcoll run: {exc}", err=True)
        sys.exit(1)
    sys.exit(code)


# --- info and cleanup -----------------------------------------------------------------------------
@main.command()
def info() -> None:
    """What shmcoll sees on this machine."""
    import shutil

    import numba
    import numpy

    from shmcoll import config
    from shmcoll.jit import CACHE_DIR
    from shmcoll.shm.layout import footprint_bytes

    cfg = config.get()
    shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    click.echo(
        f"shmcoll {__version__} (numba {numba.__version__}, numpy {numpy.__version__}, Python {sys.version.split()[0]})"
    )
    click.echo(f"cores usable: {len(os.sched_getaffinity(0))}")
    if shm:
        click.echo(f"/dev/shm: {shm.total / 2**30:.1f} GiB, {shm.free / 2**30:.1f} GiB free")
    click.echo(
        f"rings: {cfg.nslots} slots x {format_size(cfg.slot_bytes)}; arena footprint: "
        + ", ".join(f"{n} ranks {footprint_bytes(n, cfg.nslots, cfg.slot_bytes) / 2**20:.1f} MiB" for n in (2, 4, 8))
    )
    click.echo(f"timeout: {cfg.timeout_s:g}s; kernel cache: {CACHE_DIR}")
    try:
        from shmcoll.engine import cuda as gpu

        click.echo(f"gpu: {gpu.describe()}")
    except ImportError:
        click.echo("gpu: not available (numba-cuda is not installed: pip install 'shmcoll[cuda]')")


@main.command()
@click.option("--dry-run", is_flag=True, help="List what would be removed.")
@click.option("--min-age", type=float, default=0.0, show_default=True, help="Only segments older than this (s).")
def cleanup(dry_run, min_age) -> None:  # type: ignore[no-untyped-def]
    """Remove shmcoll segments in /dev/shm whose job is provably gone (never a live job's).

    A segment whose creator cannot be checked from here (it ran in another PID namespace, say
    another container sharing /dev/shm) is kept, and listed with the reason.
    """
    from shmcoll.shm.cleanup import survey
    from shmcoll.shm.segment import SHM_DIR, unlink_path

    verdicts = survey(min_age)
    verb = "would remove" if dry_run else "removed"
    stale = [v for v in verdicts if v.state == "stale"]
    for v in stale:
        if not dry_run:
            unlink_path(os.path.join(SHM_DIR, v.name))
        click.echo(f"{verb} /dev/shm/{v.name} ({v.reason})")
    unknown = [v for v in verdicts if v.state == "unknown"]
    for v in unknown:
        click.echo(f"kept /dev/shm/{v.name}: {v.reason}")
    live = sum(v.state == "live" for v in verdicts)
    click.echo(f"{verb} {len(stale)} stale segment(s); {live} belong to live jobs; {len(unknown)} kept unjudged")


# --- commands in their own modules ----------------------------------------------------------
main.add_command(plan)
main.add_command(simulate)
main.add_command(train)
main.add_command(tune)

if __name__ == "__main__":
    main()
