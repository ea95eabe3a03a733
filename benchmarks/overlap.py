"""The overlap a user gets from a nonblocking allreduce: start it, compute, then wait.

Two ranks (``-n``) run, per launch, a loop of steps in three forms, taken in turn in blocks (so a
slow spell of the machine hits every form alike):

- ``blocking``: ``comm.allreduce(x)`` alone (its time ``T`` sets the sleep);
- ``serial``: ``comm.allreduce(x)`` then ``time.sleep(T)`` (no overlap: about ``2T``);
- ``overlap``: ``req = comm.iallreduce(x)``, ``time.sleep(T)``, ``req.wait()`` (ideal: ``T``).

The sleep stands for computation that releases the GIL (numpy, torch); the progress thread runs
the engine meanwhile. The report per launch is the median step time of the slowest rank per
form, and ``overlap / serial`` (1.0: no overlap; 0.5: perfect overlap of two equal parts) and
``overlap / max(T, sleep)`` (1.0: perfect). The figures are medians over launches.

Run: ``python benchmarks/overlap.py [-n 2] [--size 16M] [--launches 5] [--steps 20] [--json F]``.
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
from shmcoll.units import format_size, format_time, parse_size


def _worker(comm, nbytes: int, steps: int, blocks: int) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    x = np.ones(nbytes // 4, np.float32)
    for _ in range(3):  # warm: plans, pages
        comm.allreduce(x)
        comm.iallreduce(x).wait()
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        comm.allreduce(x)
    # Every rank sleeps the same: the slowest rank's blocking time, agreed once.
    sleep_s = float(comm.allreduce(np.array([(time.perf_counter() - t0) / steps]), op="max")[0])

    def blocking() -> None:
        comm.allreduce(x)

    def serial() -> None:
        comm.allreduce(x)
        time.sleep(sleep_s)

    def overlap() -> None:
        req = comm.iallreduce(x)
        time.sleep(sleep_s)
        req.wait()

    out: dict[str, list[float]] = {"sleep": [sleep_s]}
    for _ in range(blocks):
        for name, fn in (("blocking", blocking), ("serial", serial), ("overlap", overlap)):
            comm.barrier()
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            out.setdefault(name, []).append(statistics.median(times))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--nprocs", type=int, default=2)
    p.add_argument("--size", default="16M", help="allreduce size in bytes (float32)")
    p.add_argument("--launches", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    p.add_argument("--blocks", type=int, default=3, help="blocks per form per launch")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    nbytes = parse_size(args.size)
    per_launch: dict[str, list[float]] = {}
    for _ in range(args.launches):
        ranks = shmcoll.spawn(_worker, args.nprocs, args=(nbytes, args.steps, args.blocks), timeout=600)
        slowest = {k: max(statistics.median(r[k]) for r in ranks) for k in ranks[0]}
        slowest["overlap/serial"] = slowest["overlap"] / slowest["serial"]
        slowest["overlap/ideal"] = slowest["overlap"] / max(slowest["blocking"], slowest["sleep"])
        for k, v in slowest.items():
            per_launch.setdefault(k, []).append(v)
    med = {k: statistics.median(v) for k, v in per_launch.items()}
    print(f"# overlap: {args.nprocs} ranks, allreduce {format_size(nbytes)} float32, {args.launches} launches")
    print(f"# {platform.node()} {platform.machine()}, Python {sys.version.split()[0]}, shmcoll {shmcoll.__version__}")
    for k in ("blocking", "sleep", "serial", "overlap"):
        v = per_launch[k]
        print(f"  {k:<10} {format_time(med[k]):>10}   (launches {format_time(min(v))} - {format_time(max(v))})")
    for k in ("overlap/serial", "overlap/ideal"):
        v = per_launch[k]
        print(f"  {k:<15} {med[k]:.3f}   (launches {min(v):.3f} - {max(v):.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median": med, "launches": per_launch, "nprocs": args.nprocs, "bytes": nbytes}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
