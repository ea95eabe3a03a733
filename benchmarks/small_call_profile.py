"""Where the time of a small collective goes: Python, the jitted call, or the hand-off.

An 8-byte ``comm.allreduce`` repeated on the same array takes the lean path: (a) the method's
identity tests against the remembered call (``Runtime._again``), (b) the call of
``engine.entry_at``'s compiled entry point with the call's record address, (c) the engine's
work: bookkeeping, then the hand-off through shared memory, which only exists with a peer. The
ordinary path, for comparison, goes through the run loop and numba's dispatch of
``engine.execute`` (which type-checks and unboxes its 3 array arguments). Timing the call at 1
rank (no peer) and at 2 ranks, the entry point alone, the bound call through the run loop, and
the raw dispatch of a do-nothing jitted function of 3 arrays, splits the total into those parts.

Run: ``python benchmarks/small_call_profile.py [--calls 200000] [--repeats 5]``. Prints the
median per-call time of each part over the repeats.
"""

from __future__ import annotations

import argparse
import functools
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
    comm.allreduce(x, out=y)
    comm.allreduce(x)
    comm.allreduce(x)  # made again: now on the lean path (bind._promote)
    call = next(iter(c for k, c in comm._calls.items() if k[0] == KIND_CODE["allreduce"] and k[5]))
    arrays = (call.start, x, x)
    lean = comm._lean[KIND_CODE["allreduce"]]  # the in-place call's (the last one made)
    bound = bind.elementwise(comm, collectives.get("allreduce"), x, None, shmcoll.ReduceOp.SUM, 0, "auto")
    _nothing(*arrays)
    parts = {
        "allreduce in place": lambda: comm.allreduce(x),
        "allreduce out of place": lambda: comm.allreduce(x, out=y),
        "run loop + engine (bound)": lambda: comm._run(bound, None),
        "engine.execute alone": lambda: engine.execute(*arrays),
        "entry_at entry alone": functools.partial(lean[7], lean[8]),
        "dispatch of 3 arrays": lambda: _nothing(*arrays),
    }
    if comm.world_size > 1:
        del parts["engine.execute alone"]  # alone, it would wait for the peer's half
        del parts["entry_at entry alone"]
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
