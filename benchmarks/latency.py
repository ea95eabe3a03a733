"""The cost of one call from Python: 8-byte and large allreduce, median over fresh launches.

Each launch starts ``-n`` ranks with ``shmcoll.spawn`` (kernels come from the cache), and every
rank times ``--calls`` back-to-back calls per case, in ``--blocks`` blocks taken in turn across
the cases (so a slow spell of the machine hits every case alike). A launch's figure for a case
is the median block of its slowest rank; the report is the median over launches, with the
spread (min-max) beside it. Launches matter on 2 cores: where the kernel places the ranks
changes per launch, and one launch is one sample.

Cases (``--cases``): ``inplace`` (``comm.allreduce(x)``), ``out`` (``out=y``), and ``iwait``
(``comm.iallreduce(x).wait()``, where the nonblocking layer exists) and ``persistent``
(``req.start(); req.wait()`` on ``req = comm.allreduce_init(x)``), each at every size in
``--sizes`` (float32 buffers; ``8`` = 2 elements).

Run: ``python benchmarks/latency.py [-n 2] [--launches 5] [--sizes 8,64M] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np

import shmcoll
from shmcoll.units import format_size, parse_size


def _case_fn(comm, case: str, x: np.ndarray, y: np.ndarray):  # type: ignore[no-untyped-def]
    if case == "inplace":
        return lambda: comm.allreduce(x)
    if case == "out":
        return lambda: comm.allreduce(x, out=y)
    if case == "iwait":
        return lambda: comm.iallreduce(x).wait()
    if case == "persistent":  # checked and planned once (allreduce_init), started and waited per call
        req = comm.allreduce_init(x)

        def run():  # type: ignore[no-untyped-def]
            req.start()
            return req.wait()

        return run
    raise ValueError(f"unknown case {case!r}")


def _worker(comm, sizes: list[int], cases: list[str], calls: list[int], blocks: int) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    out: dict[str, list[float]] = {}
    fns = []
    for nbytes, ncalls in zip(sizes, calls, strict=True):
        x = np.ones(max(nbytes // 4, 1), np.float32)
        y = np.empty_like(x)
        for case in cases:
            fn = _case_fn(comm, case, x, y)
            for _ in range(max(3, ncalls // 10)):  # warm: plans, pages, caches
                fn()
            fns.append((f"{case} {format_size(nbytes)}", fn, ncalls))
    for _ in range(blocks):
        for name, fn, ncalls in fns:
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(ncalls):
                fn()
            out.setdefault(name, []).append((time.perf_counter() - t0) / ncalls)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--nprocs", type=int, default=2)
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--sizes", default="8,64M")
    ap.add_argument("--cases", default="inplace,out")
    ap.add_argument("--calls", type=int, default=20000, help="calls per block at 8 bytes (fewer for larger sizes)")
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    cases = args.cases.split(",")
    # Fewer calls for larger sizes: about the same bytes per block from 8 KiB up.
    calls = [max(5, min(args.calls, args.calls * 8192 // max(s, 8192))) for s in sizes]
    per_launch: dict[str, list[float]] = {}
    for _ in range(args.launches):
        results = shmcoll.spawn(_worker, args.nprocs, args=(sizes, cases, calls, args.blocks), timeout=1800)
        for name in results[0]:
            slowest = [max(r[name][b] for r in results) for b in range(args.blocks)]
            per_launch.setdefault(name, []).append(statistics.median(slowest))
    print(
        f"# {args.nprocs} ranks, {args.launches} launches x {args.blocks} blocks; python {platform.python_version()}, "
        f"shmcoll {shmcoll.__version__}"
    )
    print(f"{'case':<16} {'median':>12} {'min':>12} {'max':>12}")
    report = {}
    for name, times in per_launch.items():
        med = statistics.median(times)
        unit, scale = ("us", 1e6) if med < 1e-3 else ("ms", 1e3)
        print(
            f"{name:<16} {med * scale:>9.3f} {unit} {min(times) * scale:>9.3f} {unit} {max(times) * scale:>9.3f} {unit}"
        )
        report[name] = {"median_s": med, "launches_s": times}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "nprocs": args.nprocs, "results": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
