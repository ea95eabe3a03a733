"""Where the time of a small collective goes: Python, the jitted call, or the hand-off.

An 8-byte ``comm.allreduce`` from Python is (a) the method's own Python (type check, plan-cache
lookup, argument checks), (b) numba's dispatch into ``engine.execute`` (it type-checks and
unboxes its 3 array arguments: the handle table, the input, the output), (c) the engine's
work: bookkeeping, then the hand-off through shared memory, which only exists with a peer.
Timing the same call at 1 rank (no peer) and at 2 ranks, the bound call run alone, and the raw
dispatch of a do-nothing jitted function of 3 arrays, splits the total into those parts.

Run: ``python benchmarks/small_call_profile.py [--calls 200000] [--repeats 5]``. Prints the
median per-call time of each part over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

import shmcoll
from shmcoll import collectives
from shmcoll.collectives import KIND_CODE
from shmcoll.comm import bind
from shmcoll.engine import cpu as engine


@numba.njit(cache=False, nogil=True)
def _nothing(a, b, c):  # type: ignore[no-untyped-def]
    return 0


def _per_call(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def worker(comm, calls: int, repeats: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    x = np.ones(2, np.float32)
    y = np.empty_like(x)
    comm.allreduce(x)
    comm.allreduce(x, out=y)
    call = next(iter(c for k, c in comm._calls.items() if k[0] == KIND_CODE["allreduce"] and k[5]))
    arrays = (call.start, x, x)
    bound = bind.elementwise(comm, collectives.get("allreduce"), x, None, shmcoll.ReduceOp.SUM, 0, "auto")
    _nothing(*arrays)
    parts = {
        "allreduce in place": lambda: comm.allreduce(x),
        "allreduce out of place": lambda: comm.allreduce(x, out=y),
        "run loop + engine (bound)": lambda: comm._run(bound, None),
        "engine.execute alone": lambda: engine.execute(*arrays),
        "dispatch of 3 arrays": lambda: _nothing(*arrays),
    }
    if comm.world_size > 1:
        del parts["engine.execute alone"]  # alone, it would wait for the peer's half
        del parts["dispatch of 3 arrays"]
        del parts["run loop + engine (bound)"]
    out: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(repeats):
        for name, fn in parts.items():
            comm.barrier()
            out[name].append(_per_call(fn, calls))
    return {k: statistics.median(v) * 1e6 for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    for n in (1, 2):
        res = shmcoll.spawn(worker, n, args=(args.calls if n == 1 else args.calls // 4, args.repeats), timeout=900)
        for name, us in res[0].items():
            print(f"{n} rank(s): {name:<24} {us:6.3f} us per call (median of {args.repeats})")


if __name__ == "__main__":
    main()
