"""What the timed choice costs and gains: ``auto`` on a timed call shape, against its own pick
and cma named, in one launch.

A timed call shape (``comm/timed.py``) chooses between ``auto``'s pick and cma at every call by
what the leader's calls took; every rank agrees on the plan before each call (``comm/pages.py``).
Per collective and size, every rank times three cases of the same call in blocks taken in turn,
each block after two untimed calls, the first case by turns (so that a slow spell of the machine,
or the caches another case left, hits them alike):

- ``auto``: the call as a program makes it (a timed shape where the size allows);
- ``pick``: ``auto``'s own pick named (so untimed): what ``auto`` runs where the times keep it;
- ``cma``, named: what the timed choice can switch to.

A launch's figure for a case is the median block of its slowest rank; the report gives each
launch's figures (the VM's launches differ by 3-4x in the rings' speed, not in cma's:
``benchmarks/RESULTS.md``, stop 51), their median, and the paired ratio ``auto / best``, the
median of each launch's ``auto`` over the faster of ``pick`` and ``cma`` in that launch.

For measuring, not for programs:

- ``--from SIZE`` lowers the sizes from which a call shape may be timed (``timed.TIMED_FROM``,
  ``timed.PAIR_FROM`` and ``timed.BROADCAST_FROM``) in every rank;
- ``--no-vote``: the leader never votes for cma, so ``auto - pick`` is what the timed shape costs
  where its plan stays (the agreement and the leader's clock reads and bookkeeping, at every
  call: without cma's times the leader never makes calls without voting, ``Timed.quiet_calls``).

Run: ``python benchmarks/timed_choice.py [-n 4] [-c reduce] [--sizes 256K,1M] [--launches 3]
[--from 64K] [--no-vote] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from typing import Any

import numpy as np

import shmcoll
from shmcoll.units import format_size, parse_size

COLLECTIVES = ("reduce", "broadcast", "allreduce")


def _measuring(floor: int, no_vote: bool) -> None:
    """This rank's changes for the measurement (see the module doc)."""
    from shmcoll.comm import timed

    if floor:
        timed.TIMED_FROM = timed.PAIR_FROM = timed.BROADCAST_FROM = floor
    if no_vote:
        timed.Timed.vote = lambda self: False  # type: ignore[method-assign]


def _call(comm, collective: str, nbytes: int):  # type: ignore[no-untyped-def]
    """A function ``run(algorithm)`` making one call of ``nbytes`` float32 (out of place, root 0),
    with its result checked once."""
    r, n = comm.rank, comm.world_size
    x = np.full(nbytes // 4, r + 1, np.float32)
    out = np.empty_like(x)
    if collective == "reduce":

        def run(algorithm: str) -> Any:
            return comm.reduce(x, 0, out=out if r == 0 else None, algorithm=algorithm)

        expected = n * (n + 1) / 2 if r == 0 else None
    elif collective == "broadcast":

        def run(algorithm: str) -> Any:
            return comm.broadcast(x, root=0, out=out, algorithm=algorithm)

        expected = 1.0
    else:

        def run(algorithm: str) -> Any:
            return comm.allreduce(x, out=out, algorithm=algorithm)

        expected = n * (n + 1) / 2
    got = run("auto")
    if expected is not None and not (got == expected).all():
        raise AssertionError(f"{collective} of {format_size(nbytes)}: wrong result on rank {r}")
    return run


def _shape(comm, collective: str, count: int) -> Any:  # type: ignore[no-untyped-def]
    """The ``auto`` call shape of the call (``comm._calls``: internal, for this measurement)."""
    (call,) = [
        c for k, c in comm._calls.items() if c.kind == collective and len(k) > 4 and k[4] == "auto" and c.count == count
    ]
    return call


def _worker(comm, collectives, sizes, calls, blocks, floor, no_vote):  # type: ignore[no-untyped-def]
    _measuring(floor, no_vote)
    report: dict[str, dict[str, object]] = {}
    for collective in collectives:
        for nbytes in sizes:
            run = _call(comm, collective, nbytes)
            call = _shape(comm, collective, nbytes // 4)
            pick = str(re.search(r"algorithm=(\w+)", call.label)[1])  # type: ignore[index]
            cases = {"auto": "auto", "pick": pick, "cma": "cma"}
            times: dict[str, list[float]] = {name: [] for name in cases}
            order = list(cases)
            for block in range(-1, blocks):  # (block -1 warms plans and pages)
                for name in order[block % 3 :] + order[: block % 3]:
                    run(cases[name])
                    run(cases[name])
                    comm.barrier()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        run(cases[name])
                    comm.barrier()
                    if block >= 0:
                        times[name].append((time.perf_counter() - t0) / calls)
            key = f"{collective} {format_size(nbytes)}"
            report[key] = {"pick": pick, "timed": call.timed is not None, "times": times}
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--nprocs", type=int, default=4)
    ap.add_argument("-c", "--collectives", default="reduce")
    ap.add_argument("--sizes", default="4M")
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--calls", type=int, default=40, help="calls per block")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--from", dest="floor", default="", help="time call shapes from this size (measuring only)")
    ap.add_argument("--no-vote", action="store_true", help="the leader never votes for cma")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    collectives = args.collectives.split(",")
    for c in collectives:
        if c not in COLLECTIVES:
            ap.error(f"unknown collective {c!r}; one of {', '.join(COLLECTIVES)}")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    floor = parse_size(args.floor) if args.floor else 0
    per_launch: dict[str, dict[str, list[float]]] = {}
    about: dict[str, dict[str, object]] = {}
    for _ in range(args.launches):
        results = shmcoll.spawn(
            _worker,
            args.nprocs,
            args=(collectives, sizes, args.calls, args.blocks, floor, args.no_vote),
            timeout=1800,
        )
        for key, entry in results[0].items():
            about[key] = {k: entry[k] for k in ("pick", "timed")}
            for name in entry["times"]:
                slowest = [max(r[key]["times"][name][b] for r in results) for b in range(args.blocks)]
                per_launch.setdefault(key, {}).setdefault(name, []).append(statistics.median(slowest) * 1e6)
    flags = "--no-vote" if args.no_vote else ""
    print(
        f"# {args.nprocs} ranks, {args.launches} launches x {args.blocks} blocks of {args.calls} calls, out of place"
        f"{', timed from ' + args.floor if floor else ''}{' ' + flags if flags else ''}; "
        f"python {platform.python_version()}, shmcoll {shmcoll.__version__}; us per call"
    )
    report = {}
    for key, cases in per_launch.items():
        med = {name: statistics.median(v) for name, v in cases.items()}
        paired = statistics.median(
            a / min(p, c) for a, p, c in zip(cases["auto"], cases["pick"], cases["cma"], strict=True)
        )
        launches = "  ".join(
            f"{a:.1f}/{p:.1f}/{c:.1f}" for a, p, c in zip(cases["auto"], cases["pick"], cases["cma"], strict=True)
        )
        info = about[key]
        print(
            f"{key:<18} pick {info['pick']:<7} {'timed' if info['timed'] else 'untimed':<8} "
            f"auto {med['auto']:8.1f}  pick {med['pick']:8.1f}  cma {med['cma']:8.1f}  "
            f"auto/best {paired:5.2f}   launches auto/pick/cma: {launches}"
        )
        report[key] = {**info, "median_us": med, "paired_auto_over_best": paired, "launches_us": cases}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "nprocs": args.nprocs, "results": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
