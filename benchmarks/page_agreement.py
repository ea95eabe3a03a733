"""What the page-aware choice of cma costs and gains: ``auto`` with and without it, and cma.

A call shape whose automatic choice differs by page size (``comm/pages.py``) looks at this rank's
buffers before every call and publishes whether they are on huge pages; a rank whose buffers are
waits for its peers' answers. Per collective, size and page kind (``--pages``: buffers from
``shmcoll.shm.pages.array``), every rank times three cases of the same call, in blocks taken in
turn, each block preceded by two untimed calls, ``auto`` and ``unaware`` first by turns and ``cma``
last (so that a slow spell of the machine, or the caches another case left, hits the first two
alike):

- ``auto``: the call as a program makes it;
- ``unaware``: the same call shape with its huge-page plan detached for the block, so it runs its
  other plan without looking at pages: what ``auto`` ran before it knew them;
- ``cma``, named.

So on 4 KiB pages ``auto - unaware`` is what the look costs, and on huge pages ``unaware / auto``
is what it gains. A launch's figure for a case is the median block of its slowest rank; the
report is the median over launches, and the paired ratio (the median of each launch's own
ratio). Out of place (``out=`` given). A size whose call shape does not depend on pages is
reported so (``-``), its two ``auto`` cases the same.

Run: ``python benchmarks/page_agreement.py [-n 2] [-c allgather,alltoall,broadcast,allreduce]
[--sizes 2M,8M] [--pages small,huge] [--launches 3] [--json out.json]``.
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
from shmcoll.collectives import KIND_CODE
from shmcoll.shm import pages
from shmcoll.units import format_size, parse_size

COLLECTIVES = ("allgather", "alltoall", "broadcast", "allreduce", "reduce_scatter", "scatter", "gather")


def _call(comm, collective: str, nbytes: int, kind: str):  # type: ignore[no-untyped-def]
    """A function ``run(algorithm)`` making one call of ``nbytes`` (the call's size as bench
    counts it) on buffers of ``kind``, with its result checked once."""
    n, r = comm.world_size, comm.rank
    per_rank = nbytes // 4 // n  # elements of one rank's block
    whole = per_rank * n
    if collective in ("allgather", "gather"):
        x, out = pages.array(per_rank, np.float32, kind), pages.array((n, per_rank), np.float32, kind)
    elif collective in ("alltoall",):
        x, out = pages.array((n, per_rank), np.float32, kind), pages.array((n, per_rank), np.float32, kind)
    elif collective in ("scatter",):
        x, out = pages.array((n, per_rank), np.float32, kind), pages.array(per_rank, np.float32, kind)
    elif collective == "reduce_scatter":
        x, out = pages.array(whole, np.float32, kind), pages.array(per_rank, np.float32, kind)
    else:  # broadcast, allreduce: the whole size per rank
        x, out = pages.array(whole, np.float32, kind), pages.array(whole, np.float32, kind)
    x[...] = r
    out[...] = 0
    method = getattr(comm, collective)
    if collective in ("broadcast", "scatter", "gather"):
        return lambda algorithm: method(
            x, root=0, out=out if (collective != "gather" or r == 0) else None, algorithm=algorithm
        )
    return lambda algorithm: method(x, out=out, algorithm=algorithm)


def _shape(comm, collective: str, nbytes: int) -> Any:  # type: ignore[no-untyped-def]
    """The ``auto`` call shape of :func:`_call`'s call (``comm._calls``: internal, for this measurement)."""
    per_rank = nbytes // 4 // comm.world_size
    count = per_rank * comm.world_size if collective in ("broadcast", "allreduce") else per_rank
    (call,) = [
        c for k, c in comm._calls.items() if c.kind == collective and len(k) > 4 and k[4] == "auto" and c.count == count
    ]
    return call


def _algorithm(call: Any) -> str:
    return str(re.search(r"algorithm=(\w+)", call.label)[1])  # type: ignore[index]


def _worker(comm, collectives: list[str], sizes: list[int], kinds: list[str], calls: int, blocks: int):  # type: ignore[no-untyped-def]
    report: dict[str, dict[str, object]] = {}
    for kind in kinds:
        for collective in collectives:
            for nbytes in sizes:
                run = _call(comm, collective, nbytes, kind)
                run("auto")
                call = _shape(comm, collective, nbytes)
                huge = call.huge
                code = KIND_CODE[collective]
                cases = ("auto", "unaware", "cma") if comm.world_size > 1 else ("auto", "unaware")
                times: dict[str, list[float]] = {name: [] for name in cases}
                for block in range(-1, blocks):  # (block -1 warms plans and pages)
                    # auto and unaware take turns going first, and cma goes last: a call after
                    # another algorithm's finds the caches as that one left them.
                    for name in (cases[1], cases[0], *cases[2:]) if block % 2 else cases:
                        call.huge = None if name == "unaware" else huge
                        # (and the call bound anew: a call remembered while detached would take
                        # the lean path, which a call shape with a huge-page plan never does)
                        comm._memo[code] = comm._lean[code] = None
                        algorithm = "cma" if name == "cma" else "auto"
                        run(algorithm)  # (twice: a call repeated takes the lean path from its second)
                        run(algorithm)
                        comm.barrier()
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            run(algorithm)
                        if block >= 0:
                            times[name].append((time.perf_counter() - t0) / calls)
                call.huge = huge
                key = f"{kind} {collective} {format_size(nbytes)}"
                plans = [_algorithm(call), _algorithm(huge) if huge is not None else None]
                report[key] = {"plans": plans, "times": times}
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--nprocs", type=int, default=2)
    ap.add_argument("-c", "--collectives", default="allgather,alltoall,broadcast,allreduce")
    ap.add_argument("--sizes", default="2M,8M")
    ap.add_argument("--pages", default="small,huge")
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20, help="calls per block")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    collectives = args.collectives.split(",")
    for c in collectives:
        if c not in COLLECTIVES:
            ap.error(f"unknown collective {c!r}; one of {', '.join(COLLECTIVES)}")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    kinds = args.pages.split(",")
    per_launch: dict[str, dict[str, list[float]]] = {}
    plans: dict[str, list[str | None]] = {}
    for _ in range(args.launches):
        results = shmcoll.spawn(
            _worker, args.nprocs, args=(collectives, sizes, kinds, args.calls, args.blocks), timeout=1800
        )
        for key, entry in results[0].items():
            plans[key] = entry["plans"]
            for name in entry["times"]:
                slowest = [max(r[key]["times"][name][b] for r in results) for b in range(args.blocks)]
                per_launch.setdefault(key, {}).setdefault(name, []).append(statistics.median(slowest))
    print(
        f"# {args.nprocs} ranks, {args.launches} launches x {args.blocks} blocks of {args.calls} calls, out of place; "
        f"python {platform.python_version()}, shmcoll {shmcoll.__version__}; us per call (median over launches)"
    )
    head = ("pages collective size", "plans", "auto", "unaware", "cma", "auto - unaware", "unaware / auto")
    print(f"{head[0]:<26} {head[1]:<14} {head[2]:>8} {head[3]:>8} {head[4]:>8} {head[5]:>15} {head[6]:>15}")
    report = {}
    for key, cases in per_launch.items():
        plain, huge = plans[key]
        med = {name: statistics.median(v) * 1e6 for name, v in cases.items()}
        paired = statistics.median(u / a for u, a in zip(cases["unaware"], cases["auto"], strict=True))
        print(
            f"{key:<26} {plain + ' / ' + (huge or '-'):<14} {med['auto']:>8.1f} {med['unaware']:>8.1f} "
            f"{med.get('cma', float('nan')):>8.1f} {med['auto'] - med['unaware']:>+12.1f} us "
            f"{med['unaware'] / med['auto']:>8.2f} ({paired:.2f})"
        )
        report[key] = {"plans": plans[key], "median_us": med, "paired_unaware_over_auto": paired, "launches_s": cases}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "nprocs": args.nprocs, "results": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
