"""Steady-state memory: does a rank's RSS grow over many calls?

Each rank runs ``--calls`` collectives (allreduce, allgather, broadcast, reduce_scatter, alltoall
in turn, on arrays of 8 B to 1 MiB that cycle, with ``auto`` and a few named algorithms) after a
warm-up of one full cycle, and samples its resident set size every ``--every`` calls. A leak of
even a few bytes per call shows as a slope: 10,000 calls x 100 B = 1 MB.

Run: ``python benchmarks/rss.py [-n 2] [--calls 10000] [--every 1000]``. Prints, per rank, the
RSS after warm-up, at every sample, and the growth from the first sample to the last.
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import psutil

import shmcoll

SIZES = (2, 33, 1024, 65536, 262144)  # float32 elements: 8 B, odd, 4 KiB, 256 KiB, 1 MiB
ALGOS = ("auto", "direct", "ring")


def _one_call(comm, kind: str, x: np.ndarray, bufs: dict, algorithm: str) -> None:  # type: ignore[no-untyped-def]
    if kind == "allreduce":
        comm.allreduce(x, algorithm=algorithm)
    elif kind == "allgather":
        comm.allgather(x, out=bufs[("g", x.size)])
    elif kind == "broadcast":
        comm.broadcast(x, root=0, algorithm=algorithm)
    elif kind == "reduce_scatter":
        comm.reduce_scatter(bufs[("rs", x.size)], out=x)
    else:
        comm.alltoall(bufs[("a", x.size)], out=bufs[("a2", x.size)])


def worker(comm, calls: int, every: int) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    n = comm.world_size
    arrays = {s: np.ones(s, np.float32) for s in SIZES}
    bufs: dict = {}
    for s in SIZES:
        bufs[("g", s)] = np.empty((n, s), np.float32)
        bufs[("rs", s)] = np.ones(n * s, np.float32)
        bufs[("a", s)] = np.ones((n, max(1, s // n)), np.float32)
        bufs[("a2", s)] = np.empty((n, max(1, s // n)), np.float32)
    kinds = ("allreduce", "allgather", "broadcast", "reduce_scatter", "alltoall")
    shapes = list(itertools.product(kinds, SIZES, ALGOS))
    for kind, s, alg in shapes:  # warm-up: every plan built and cached, every kernel compiled
        _one_call(comm, kind, arrays[s], bufs, alg)
    proc = psutil.Process()
    samples = [(0, proc.memory_info().rss)]
    cycle = itertools.cycle(shapes)
    for i in range(1, calls + 1):
        kind, s, alg = next(cycle)
        _one_call(comm, kind, arrays[s], bufs, alg)
        if i % every == 0:
            samples.append((i, proc.memory_info().rss))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--nprocs", type=int, default=2)
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--every", type=int, default=1000)
    args = ap.parse_args()
    results = shmcoll.spawn(worker, args.nprocs, args=(args.calls, args.every), timeout=3600)
    mib = 1 << 20
    for rank, samples in enumerate(results):
        first, last = samples[0][1], samples[-1][1]
        trail = " ".join(f"{rss / mib:.2f}" for _, rss in samples)
        print(f"rank {rank}: RSS MiB after warm-up and every {args.every} calls: {trail}")
        print(f"rank {rank}: growth over {args.calls} calls: {(last - first) / 1024:+.0f} KiB")


if __name__ == "__main__":
    main()
