"""``shmcoll train``: training demos over shmcoll. Thin: parse, call :mod:`shmcoll.train`, print."""

from __future__ import annotations

import dataclasses
import os
import sys

import click


def _hidden(value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated layer widths such as 256,128, got {value!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise click.BadParameter(f"expected positive layer widths, got {value!r}")
    return sizes


@click.group()
def train() -> None:
    """Training demos: data parallelism over shmcoll's collectives."""


@train.command()
@click.option(
    "-n",
    "--nprocs",
    type=click.IntRange(min=1),
    default=None,
    help="Ranks (data-parallel replicas), >= 1. Default: min(4, cores).",
)
@click.option("--epochs", type=int, default=3, show_default=True, help="Passes over the training set.")
@click.option("--batch-size", type=int, default=128, show_default=True, help="Global batch, split across the ranks.")
@click.option("--lr", type=float, default=0.05, show_default=True, help="Learning rate.")
@click.option("--momentum", type=float, default=0.9, show_default=True, help="SGD momentum.")
@click.option("--seed", type=int, default=0, show_default=True, help="Initialisation and shuffling seed.")
@click.option("--hidden", default="256,128", show_default=True, help="Hidden layer widths, comma-separated.")
@click.option(
    "-a", "--algorithm", default="auto", show_default=True, help="Allreduce algorithm ('auto' or a registered name)."
)
@click.option(
    "--bucket-mb",
    type=float,
    default=25.0,
    show_default=True,
    help="Largest gradient bucket (MiB); a larger model is averaged with several allreduce calls.",
)
@click.option(
    "--check-every", type=int, default=50, show_default=True, help="Compare the replicas' digests every K steps."
)
@click.option(
    "--data-dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Directory with the full MNIST IDX files (train-images-idx3-ubyte[.gz], ...). Default: the bundled subset.",
)
@click.option("--steps-per-epoch", type=int, default=None, help="Stop each epoch after this many steps (quick runs).")
@click.option(
    "--check-equivalence",
    is_flag=True,
    help="Also train on 1 process with the same global batch and compare the loss curves.",
)
@click.option(
    "--tolerance",
    type=float,
    default=1e-4,
    show_default=True,
    help="Largest |loss difference| per step that --check-equivalence accepts.",
)
@click.option("--target-acc", type=float, default=None, help="Exit with status 1 if the held-out accuracy is below.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Loss curve to a PNG (the plot extra).")
@click.option(
    "--slot-bytes",
    default=None,
    help="Ring slot size of the ranks' communicator (K/M suffixes; default SHMCOLL_SLOT_BYTES or 64K). A bucket "
    "moves in pieces of at most one slot: larger slots mean fewer hand-offs between ranks.",
)
@click.option("--timeout", type=float, default=None, help="Kill the ranks after this many seconds.")
@click.option("--quiet", is_flag=True, help="Only the summary: no progress bar or per-epoch lines.")
@click.option("--inject-divergence", type=int, default=None, hidden=True, help="Perturb rank 1 after step N (tests).")
def mnist(
    nprocs: int | None,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float,
    seed: int,
    hidden: str,
    algorithm: str,
    bucket_mb: float,
    check_every: int,
    data_dir: str | None,
    steps_per_epoch: int | None,
    check_equivalence: bool,
    tolerance: float,
    target_acc: float | None,
    plot_path: str | None,
    slot_bytes: str | None,
    timeout: float | None,
    quiet: bool,
    inject_divergence: int | None,
) -> None:
    """Train an MLP on MNIST with data parallelism: gradients averaged by one allreduce per step.

    Uses the 5,000-image MNIST subset bundled with shmcoll (4,000 to train, 1,000 held out)
    unless --data-dir points at the full data set. Prints loss and accuracy per epoch, the
    held-out accuracy, and the time per step split into compute and communication.
    """
    import shmcoll
    from shmcoll.train import mnist
    from shmcoll.units import parse_size

    try:
        slot_size = None if slot_bytes is None else parse_size(slot_bytes)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--slot-bytes") from None

    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError("--plot needs matplotlib: pip install 'shmcoll[plot]'") from None
    cfg = mnist.TrainConfig(
        nprocs=nprocs or max(1, min(4, len(os.sched_getaffinity(0)))),
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        momentum=momentum,
        seed=seed,
        hidden=_hidden(hidden),
        algorithm=algorithm,
        bucket_mb=bucket_mb,
        check_every=check_every,
        data_dir=data_dir,
        max_steps_per_epoch=steps_per_epoch,
        timeout_s=timeout,
        slot_bytes=slot_size,
        progress=not quiet,
        inject_divergence_at=inject_divergence,
    )
    if check_equivalence and cfg.nprocs < 2:
        raise click.UsageError("--check-equivalence compares N ranks with 1 process: give --nprocs 2 or more")
    try:
        cfg.validate()
        click.echo(mnist.describe(cfg))
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None

    runs = [cfg]
    if check_equivalence:
        runs.append(dataclasses.replace(cfg, nprocs=1, inject_divergence_at=None))
    results = []
    for run_cfg in runs:
        if check_equivalence:
            click.echo(f"--- {run_cfg.nprocs} rank(s) ---")
        try:
            result = mnist.train(run_cfg)
        except shmcoll.SpawnError as exc:
            click.echo(f"training failed: {exc}", err=True)
            sys.exit(1)
        click.echo(mnist.format_summary(result))
        results.append(result)

    failed = False
    if check_equivalence:
        eq = mnist.compare(results[0], results[1], tolerance)
        verdict = "OK" if eq.ok else "FAILED"
        click.echo(
            f"equivalence: {cfg.nprocs} ranks vs 1 process, same global batch: max |loss difference| over "
            f"{len(results[0].losses)} steps {eq.max_loss_diff:.3g} (tolerance {tolerance:g}): {verdict}; "
            f"max |parameter difference| after training {eq.max_param_diff:.3g}"
        )
        failed |= not eq.ok
    if plot_path:
        mnist.plot(results, plot_path)
        click.echo(f"wrote {plot_path}")
    if target_acc is not None and results[0].test_acc < target_acc:
        click.echo(f"held-out accuracy {results[0].test_acc:.4f} is below the target {target_acc}", err=True)
        failed = True
    if failed:
        sys.exit(1)
