"""``shmcoll plan show`` (print a plan's steps) and ``shmcoll plan verify`` (the symbolic verifier)."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Sequence

import click

from shmcoll import collectives
from shmcoll.units import format_size, parse_size


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _csv(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def check_name(kind: str, name: str, choices: Sequence[str], hint: str | None = None) -> None:
    """A usage error (exit 2) unless ``name`` is one of ``choices``: "unknown collective
    'allreduc'; did you mean 'allreduce'?", then the choices."""
    if name in choices:
        return
    close = difflib.get_close_matches(name, choices, n=1)
    guess = f"; did you mean {close[0]!r}?" if close else ""
    raise click.BadParameter(f"unknown {kind} {name!r}{guess} (one of: {', '.join(choices)})", param_hint=hint)


def check_algorithm(collective: str, name: str, hint: str | None = "--algorithm") -> None:
    """A usage error unless ``name`` is an algorithm registered for ``collective``: a typo gets a
    suggestion, an algorithm that exists but does not serve ``collective`` says so."""
    from shmcoll.algos import registry
    from shmcoll.algos.registry import ALGORITHM_NAMES

    served = [a.name for a in registry.algorithms(collective)]
    if name in ALGORITHM_NAMES and name not in served:
        raise click.BadParameter(
            f"algorithm {name!r} does not serve {collective} (its algorithms: {', '.join(served)})", param_hint=hint
        )
    check_name("algorithm", name, served if name in served else ALGORITHM_NAMES, hint)


def _world_sizes(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    """``4``, ``1,2,5`` or ``1-16``."""
    if value is None:
        return None
    out: list[int] = []
    try:
        for part in _csv(value):
            lo, dash, hi = part.partition("-")
            out.extend(range(int(lo), int(hi) + 1) if dash else [int(part)])
    except ValueError:
        raise click.BadParameter(f"expected N, N,M,... or LO-HI, got {value!r}") from None
    if not out or min(out) < 1:
        raise click.BadParameter(f"world sizes must be >= 1, got {value!r}")
    return tuple(out)


@click.group()
def plan() -> None:
    """Print and verify the plans the algorithms build (no processes)."""


@plan.command()
@click.argument("collective")
@click.option("-a", "--algorithm", default="direct", show_default=True, help="A registered algorithm.")
@click.option("-n", "--world-size", type=int, default=4, show_default=True, help="Ranks.")
@click.option("--count", type=int, default=16, show_default=True, help="Elements (per block for blocked collectives).")
@click.option("--root", type=int, default=0, show_default=True, help="Root of rooted collectives.")
@click.option("--slot-bytes", callback=_size, default=None, help="Ring slot size (default: SHMCOLL_SLOT_BYTES).")
@click.option("--dtype", default="float32", show_default=True, help="Element type (sets elements per slot).")
@click.option("--in-place", is_flag=True, help="Build the in-place variant.")
@click.option("--group-size", type=int, default=None, help="hierarchical: ranks per group (default: one group).")
@click.option(
    "--nslots", type=int, default=None, help="Slots per ring the plan is built for (default: SHMCOLL_NSLOTS)."
)
def show(collective, algorithm, world_size, count, root, slot_bytes, dtype, in_place, group_size, nslots) -> None:  # type: ignore[no-untyped-def]
    """Print every rank's steps of COLLECTIVE: the body (run once per full piece) and the tail.

    A variable-count collective gets uneven sample counts around COUNT (zeros included)."""
    import numpy as np

    from shmcoll import config
    from shmcoll.algos import registry
    from shmcoll.algos.registry import Query
    from shmcoll.plan.passes import plan_call

    check_name("collective", collective, collectives.COLLECTIVES, "COLLECTIVE")
    check_algorithm(collective, algorithm)
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:
        raise click.BadParameter(f"not a numpy dtype: {dtype!r}", param_hint="--dtype") from None
    if world_size < 1:
        raise click.BadParameter("must be >= 1", param_hint="--world-size")
    if count < 0:
        raise click.BadParameter("must be >= 0", param_hint="--count")
    if not 0 <= root < world_size:
        raise click.BadParameter(f"root {root} out of range for {world_size} ranks", param_hint="--root")
    if group_size is not None and group_size < 1:
        raise click.BadParameter("must be >= 1", param_hint="--group-size")
    options = None if group_size is None else {"group_size": group_size}
    alg = registry.get(collective, algorithm)
    reason = alg.supports(Query(collective, world_size, count, itemsize, root=root, inplace=in_place, cma=True))
    if reason is not None:
        raise click.UsageError(f"{collective}/{algorithm} cannot serve this call: {reason}")
    slot = slot_bytes or config.get().slot_bytes
    slot_capacity = max(1, slot // itemsize)
    nslots = nslots or config.get().nslots
    if nslots < 1:
        raise click.BadParameter("must be >= 1", param_hint="--nslots")
    counts, matrix = sample_counts(collective, world_size, count)
    if counts or matrix:
        count = sum(counts) + sum(map(sum, matrix))
    seg = plan_call(
        alg,
        world_size,
        count,
        slot_capacity,
        root=root,
        inplace=in_place,
        options=options,
        nslots=nslots,
        counts=counts,
        matrix=matrix,
    )
    mode = "in place" if in_place else "out of place"
    groups = f"; groups of {group_size}" if group_size is not None else ""
    click.echo(
        f"# {collective}/{algorithm}: {world_size} ranks, count {count}, root {root}, {mode}; "
        f"slot {format_size(slot)} = {slot_capacity} {dtype} elements, {nslots} per ring{groups}"
    )
    if counts:
        click.echo(f"# counts {list(counts)}")
    for i, row in enumerate(matrix):
        click.echo(f"# rank {i} sends {list(row)}")
    if seg.body is None:
        click.echo(f"# one piece of {seg.tail.count} elements (tail only); scratch {seg.tmp_count} elements")
    else:
        click.echo(
            f"# {seg.reps} body piece(s) of {seg.piece} elements, then a tail of {seg.tail.count}; "
            f"scratch {seg.tmp_count} elements"
        )
    for rank in range(world_size):
        click.echo(f"rank {rank}:")
        parts = [("body", seg.body)] if seg.body is not None else []
        for label, piece in [*parts, ("tail", seg.tail)]:
            steps = piece.programs[rank]
            reps = f" x{seg.reps}" if label == "body" else ""
            click.echo(f"  {label}{reps}: {len(steps)} step(s)")
            for i, step in enumerate(steps):
                click.echo(f"    {i:>4}  {step}")


def sample_counts(collective: str, n: int, count: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Uneven counts around ``count`` (zeros among them) for a variable-count collective: (counts,
    ()) or, for alltoallv, ((), matrix); ``((), ())`` for the others."""
    record = collectives.get(collective)
    if not record.varying:
        return (), ()
    if collective == "alltoallv":
        return (), tuple(tuple((count + 3 * i + 5 * j) % (count + 2) for j in range(n)) for i in range(n))
    return tuple((count + 3 * j) % (count + 2) for j in range(n)), ()


def _roots(collective: str, n: int) -> range:
    """The roots to verify: every one for a rooted collective."""
    return range(n) if collectives.get(collective).rooted else range(1)


def verify_algorithm(
    collective: str,
    algorithm: str,
    world_sizes: tuple[int, ...],
    nslots: tuple[int, ...],
    group_size: int | None = None,
) -> tuple[int, list[str]]:
    """Verify every plan shape of one algorithm; (plans checked, failures)."""
    from shmcoll.algos import registry
    from shmcoll.algos.registry import Query
    from shmcoll.plan.passes import plan_call
    from shmcoll.plan.verify import PlanError, verify

    alg = registry.get(collective, algorithm)
    checked = 0
    failures: list[str] = []
    modes = (False,) if collectives.get(collective).inplace == collectives.InPlace.NEVER else (False, True)
    for n in world_sizes:
        for root in _roots(collective, n):
            # count 0 and 1, around the world size, and several pieces with tiny slots
            for base, slot in ((0, 4), (1, 4), (n + 1, 4), (13, 3), (3 * n + 2, 2)):
                counts, matrix = sample_counts(collective, n, base)
                count = sum(counts) + sum(map(sum, matrix)) if counts or matrix else base
                for inplace in modes:
                    if alg.supports(Query(collective, n, count, 1, root=root, inplace=inplace, cma=True)):
                        continue
                    try:
                        options: dict[str, object] | None = {"group_size": group_size} if group_size else None
                        for ns in nslots:
                            # Built for the slots it runs with: plans for one slot carry fences.
                            seg = plan_call(
                                alg,
                                n,
                                count,
                                slot,
                                root=root,
                                inplace=inplace,
                                options=options,
                                nslots=ns,
                                counts=counts,
                                matrix=matrix,
                            )
                            verify(
                                seg,
                                world_size=n,
                                count=count,
                                root=root,
                                inplace=inplace,
                                nslots=ns,
                                counts=counts,
                                matrix=matrix,
                            )
                            checked += 1
                    except (PlanError, ValueError, IndexError, KeyError) as exc:
                        failures.append(f"n={n} root={root} count={count} slot={slot} inplace={inplace}: {exc}")
    return checked, failures


@plan.command()
@click.option("--all", "everything", is_flag=True, help="Every registered (collective, algorithm).")
@click.option("-c", "--collective", default=None, help="Only these collectives (comma-separated).")
@click.option("-a", "--algorithm", default=None, help="Only these algorithms (comma-separated).")
@click.option(
    "-n", "--world-size", "world_sizes", callback=_world_sizes, default=None, help="World sizes (default 1-16)."
)
@click.option("--nslots", default="1,2", show_default=True, help="Slots per ring to verify with (comma-separated).")
@click.option("--group-size", type=int, default=None, help="hierarchical: ranks per group (default: one group).")
def verify(everything, collective, algorithm, world_sizes, nslots, group_size) -> None:  # type: ignore[no-untyped-def]
    """Run the symbolic verifier over registered plans: every root, several counts, in and out of
    place, with 1 and 2 slots per ring. Exits non-zero on any failure."""
    from shmcoll.algos import registry

    if not (everything or collective or algorithm):
        raise click.UsageError("give --all, or narrow with --collective/--algorithm")
    try:
        slots = tuple(int(s) for s in _csv(nslots))
    except ValueError:
        raise click.BadParameter(f"expected integers, got {nslots!r}", param_hint="--nslots") from None
    if not slots or min(slots) < 1:
        raise click.BadParameter("slots per ring must be >= 1", param_hint="--nslots")
    collectives, algorithms = _csv(collective), _csv(algorithm)
    known = sorted({a.collective for a in registry.algorithms()})
    for c in collectives:
        check_name("collective", c, known, "--collective")
    for a in algorithms:
        check_name("algorithm", a, sorted({a.name for a in registry.algorithms()}), "--algorithm")
    selected = [
        a
        for a in registry.algorithms()
        if (not collectives or a.collective in collectives) and (not algorithms or a.name in algorithms)
    ]
    if not selected:
        raise click.UsageError("no registered (collective, algorithm) matches")
    ns = world_sizes or tuple(range(1, 17))
    total = 0
    failed = 0
    for alg in selected:
        checked, failures = verify_algorithm(alg.collective, alg.name, ns, slots, group_size)
        total += checked
        status = "ok  " if not failures else "FAIL"
        click.echo(f"{status} {alg.collective}/{alg.name}: {checked} plan(s) verified, {len(failures)} failure(s)")
        for f in failures[:5]:
            click.echo(f"       {f}")
        if len(failures) > 5:
            click.echo(f"       ... and {len(failures) - 5} more")
        failed += bool(failures)
    span = f"{ns[0]}..{ns[-1]}" if ns == tuple(range(ns[0], ns[-1] + 1)) else ",".join(map(str, ns))
    click.echo(
        f"# {len(selected)} algorithm(s), world sizes {span}, every root, {total} plan(s): "
        + ("all verified" if not failed else f"{failed} algorithm(s) FAILED")
    )
    if failed:
        sys.exit(1)
