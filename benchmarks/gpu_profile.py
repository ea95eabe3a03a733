"""Where a device allreduce's time goes: 2 ranks share the GPU, out of place, float32.

For each size, every rank times 20 calls, then 20 more under cProfile; rank 0's profile (sorted by
own time) is printed. Written after the first run on a real GPU (an H200, 2026-11-27), where a
1 MiB allreduce took about 2 ms per call and a 256 MiB one 3.3 ms: a fixed cost of about 2 ms a
call that no kernel or copy accounts for. Run it on a GPU machine::

    python benchmarks/gpu_profile.py --sizes 1M,256M
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from typing import Any

import numpy as np

import shmcoll
from shmcoll.units import format_size, parse_size


def _worker(comm: Any, sizes: list[int], calls: int) -> dict[int, tuple[float, float, str]]:
    from numba import cuda

    out = {}
    for size in sizes:
        n = size // 4
        x = cuda.to_device(np.ones(n, np.float32))
        o = cuda.device_array(n, np.float32)
        for _ in range(5):
            comm.allreduce(x, out=o)
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            comm.allreduce(x, out=o)
        plain = (time.perf_counter() - t0) / calls
        comm.barrier()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(calls):
            comm.allreduce(x, out=o)
        prof.disable()
        profiled = (time.perf_counter() - t0) / calls
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        out[size] = (plain, profiled, text.getvalue())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,256M", help="comma-separated sizes in bytes, K/M/G suffixes (1M,256M)")
    p.add_argument("-n", "--nprocs", type=int, default=2, help="ranks sharing the GPU (2)")
    p.add_argument("--calls", type=int, default=20, help="timed calls per size (20)")
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    results = shmcoll.spawn(_worker, args=(sizes, args.calls), nprocs=args.nprocs, timeout=300)
    for rank, res in enumerate(results):
        for size, (plain, profiled, text) in res.items():
            ms = f"{plain * 1e3:.3f} ms per call ({profiled * 1e3:.3f} profiled)"
            print(f"=== rank {rank}, {format_size(size)}: {ms}")
            if rank == 0:
                print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
