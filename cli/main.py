"""The ``shmcoll`` command: parse, call the library, print. Heavy imports stay inside commands."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import click

from shmcoll._version import __version__
from shmcoll.cli.plan import check_name, plan
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


# --- bench ---------------------------------------------------------------------------------------
def _output(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An output file, checked before the sweep (a bad path must not cost a whole run): ``-`` is
    stdout, else a file that can be created or overwritten."""
    if value is None or value == "-":
        return value
    path = os.path.abspath(value)
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise click.BadParameter(f"{value!r} is a directory")
    if not os.path.isdir(folder):
        raise click.BadParameter(f"{value!r}: the directory {folder} does not exist")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise click.BadParameter(f"{value!r}: not writable")
    return value


def _stderr_is_tty() -> bool:
    return sys.stderr.isatty()


class _Live:
    """bench's terminal while the sweep runs: table lines as they are measured, on stdout (or
    stderr, when stdout carries the JSON or CSV), under a progress line on stderr."""

    def __init__(self, table_err: bool, progress: bool) -> None:
        self.table_err = table_err
        self.progress = progress
        self.bar: Any = None  # a bench.Progress once the sweep is known
        self.lock = threading.Lock()  # rows and progress come from bench.run's reading thread

    def echo(self, line: str) -> None:
        with self.lock:
            if self.bar is not None:
                self.bar.clear()
            click.echo(line, err=self.table_err)
            if self.bar is not None:
                self.bar.redraw()

    def point(self, index: int, point: Any) -> None:
        with self.lock:
            if self.bar is not None:
                self.bar.point(index)

    def close(self) -> None:
        with self.lock:
            if self.bar is not None:
                self.bar.clear()
                self.bar = None


@main.command()
@click.option(
    "-n",
    "--nprocs",
    type=click.IntRange(min=1),
    default=None,
    help="Ranks to start, >= 1 (default: min(4, cores), at least 2).",
)
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
@click.option("--root", type=click.IntRange(min=0), default=0, show_default=True, help="Root of rooted collectives.")
@click.option("--iters", type=click.IntRange(min=1), default=20, show_default=True, help="Timed iterations per size.")
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True, help="Untimed iterations per size.")
@click.option("--check/--no-check", default=True, show_default=True, help="Count wrong result elements.")
@click.option("--in-place", "mode", flag_value="in-place", help="Only in-place calls.")
@click.option("--out-of-place", "mode", flag_value="out-of-place", help="Only out-of-place calls.")
@click.option("--both", "mode", flag_value="both", default=True, help="Both (default).")
@click.option("--registered", is_flag=True, help="Use buffers from comm.alloc (zero-copy shared memory).")
@click.option(
    "--pages",
    type=click.Choice(("numpy", "small", "huge")),
    default="numpy",
    show_default=True,
    help="What backs ordinary buffers: numpy's allocation (huge pages from 4 MiB where the system allows, and "
    "whatever earlier arrays left behind), 4 KiB pages, or huge pages. cma's speed depends on it.",
)
@click.option("--stats", is_flag=True, help="Also print p10/p90 times.")
@click.option(
    "--json",
    "json_path",
    callback=_output,
    help="Write the rows and the parameters as JSON to this file; '-': to stdout (the table then goes to stderr).",
)
@click.option(
    "--csv",
    "csv_path",
    callback=_output,
    help="Write the rows as CSV to this file; '-': to stdout (the table then goes to stderr).",
)
@click.option(
    "--plot",
    "plot_path",
    callback=_output,
    help="Plot busbw vs size to a PNG, every mode measured (needs matplotlib: the plot extra).",
)
@click.option("--inject-error", is_flag=True, hidden=True, help="Corrupt one result element (tests #wrong).")
@click.option("--quiet", is_flag=True, help="No progress line (drawn only when stderr is a terminal).")
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
    pages,
    stats,
    json_path,
    csv_path,
    plot_path,
    inject_error,
    quiet,
) -> None:
    """Bandwidth and latency sweep, printed as nccl-tests' table, a line as soon as it is measured.

    With no options: allreduce of float32 from 8 B to 64 MiB on min(4, cores) ranks.
    Exits 1 if any result element is wrong; on Ctrl-C, prints and writes the rows measured so
    far and exits 130.
    """
    from shmcoll import bench
    from shmcoll.algos.registry import ALGORITHM_NAMES

    if json_path == "-" and csv_path == "-":
        raise click.UsageError("--json - and --csv - would both write to stdout; send one to a file")
    if plot_path == "-":
        raise click.BadParameter("a PNG cannot go to stdout; give a file name", param_hint="--plot")
    collectives = bench.BENCH_COLLECTIVES if collective == "all" else _csv(collective)
    for c in collectives:
        check_name("collective", c, bench.BENCH_COLLECTIVES, "--collective")
    for a in _csv(algorithm):
        if a not in ("auto", "all"):
            check_name("algorithm", a, ("auto", "all", *ALGORITHM_NAMES), "--algorithm")
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
        pages=pages,
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
    live = _Live(table_err="-" in (json_path, csv_path), progress=not quiet and _stderr_is_tty())
    meta = bench.describe(cfg)
    live.echo(bench.format_header(meta))
    table = bench.Table.of(cfg, live.echo, stats=stats)
    if live.progress:
        live.bar = bench.Progress(bench.points(cfg, cfg.nprocs), sys.stderr)
    try:
        rows = bench.run(cfg, on_point=live.point, on_rows=table.add)
        interrupted = False
    except bench.Interrupted as exc:
        rows, interrupted = exc.rows, True
    live.close()
    table.finish(f"Interrupted: {len(rows)} of {table.total} rows measured" if interrupted else "")
    meta["interrupted"] = interrupted
    if json_path:
        bench.write_json(rows, json_path, meta)
    if csv_path:
        bench.write_csv(rows, csv_path)
    if plot_path:
        series: dict[str, list] = {}  # type: ignore[type-arg]
        for r in rows:
            series.setdefault(f"{r.collective} {r.algorithm}", []).append(r)
        bench.plot(series, plot_path, title=f"shmcoll bench, {cfg.nprocs} ranks, {cfg.dtype}")
    if interrupted:
        click.echo(f"shmcoll bench: interrupted; kept the {len(rows)} row(s) measured", err=True)
        sys.exit(130)
    if any(r.wrong > 0 for r in rows):
        sys.exit(1)


# --- run ----------------------------------------------------------------------------------------
@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-n", "--nprocs", type=int, required=True, help="Number of ranks.")
@click.option("-m", "--module", default=None, help="Run a module (like python -m) instead of a script.")
@click.option(
    "--tag-output/--no-tag-output",
    default=True,
    show_default=True,
    help="Prefix each line a rank prints with [rank N] (like mpirun --tag-output).",
)
@click.option("--timeout", type=float, default=None, help="Kill every rank after this many seconds.")
@click.option("--comm-timeout", type=float, default=None, help="Each collective's timeout (SHMCOLL_TIMEOUT).")
@click.option("--slot-bytes", type=SIZE, default=None, help="Ring slot payload size.")
@click.option("--nslots", type=int, default=None, help="Slots per ring.")
@click.argument("argv", nargs=-1, type=click.UNPROCESSED, metavar="SCRIPT.py|PROGRAM [ARGS]...")
def run(nprocs, module, tag_output, timeout, comm_timeout, slot_bytes, nslots, argv) -> None:  # type: ignore[no-untyped-def]
    """Run a Python script, module or any program as NPROCS ranks.

    \b
      shmcoll run -n 4 train.py --lr 0.1      python train.py, 4 times
      shmcoll run -n 4 -m pkg.mod             python -m pkg.mod
      shmcoll run -n 4 -- python -m pkg.mod   any program, after --
      shmcoll run -n 2 -- /bin/echo hi

    Each rank gets SHMCOLL_RANK, SHMCOLL_WORLD_SIZE and SHMCOLL_HANDLE (for
    shmcoll.init()), torchrun's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT, and OMP_NUM_THREADS=1 unless it is set. Each line
    of a rank's stdout and stderr is prefixed "[rank N] ".

    Exits with the first failing rank's code (128 + signal if it was killed), 124
    after --timeout, 127 if the script or program does not exist.
    """
    from shmcoll.launch import run_script

    if module:
        argv = ("-m", module, *argv)
    if not argv:
        raise click.UsageError("give a script, -m MODULE, or -- PROGRAM [ARGS] to run")
    if nprocs < 1:
        raise click.UsageError("--nprocs must be >= 1")
    from shmcoll.errors import ShmcollError

    try:
        code = run_script(
            nprocs,
            list(argv),
            timeout=timeout,
            comm_timeout=comm_timeout,
            slot_bytes=slot_bytes,
            nslots=nslots,
            tag_output=tag_output,
        )
    except FileNotFoundError as exc:
        click.echo(f"shmcoll run: {exc}", err=True)
        sys.exit(127)  # the shell's code for a command not found
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
    from shmcoll.shm import cma

    click.echo(f"cross-memory attach (single-copy broadcast, allgather, gather, scatter, alltoall): {cma.probe()[1]}")
    if cma.probe()[0]:
        click.echo(f"cross-memory attach against the rings: {cma.describe_crossover(cma.crossover_bytes())}")
        from shmcoll.shm import pages

        click.echo(
            f"transparent huge pages: {pages.thp_setting()} (the kernel pins a peer's buffer page by page, so "
            "cross-memory attach copies faster from buffers on huge pages; numpy asks for them from 4 MiB)"
        )
        click.echo(
            "page-aware choice of cross-memory attach: "
            + (
                "on (the ranks of a call of 1-16 MiB, and more where ranks outnumber cores, tell each other "
                "whether their buffers are on huge pages)"
                if pages.can_scan()
                else "off (this kernel has no PAGEMAP_SCAN, Linux 6.7+: auto cannot tell huge pages from 4 KiB ones)"
            )
        )
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
