"""One-way hand-off latency of the engine, and of the Python API on top of it.

Engine: a token goes round a ring of ranks, ``laps`` times, inside ONE engine call per rank
(a hand-written plan: rank 0 sends then receives, every other rank receives then forwards), so
the figure is the engine's own cost per hand-off: wait, tag check, counter release, wake-up.
API: the same ring driven by ``comm.send``/``comm.recv`` from Python, one call per hop.

Run: ``python benchmarks/handoff.py [--laps 20000] [--repeats 5] [-n 2,4]``. Reports the median
over repeats of the per-hand-off time (each repeat's time divided by laps x world_size).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import shmcoll
from shmcoll.engine import cpu as engine
from shmcoll.plan import ir
from shmcoll.plan.ir import CallPlan, Plan, Step


def _ring_plan(world_size: int, laps: int) -> CallPlan:
    programs: list[list[Step]] = []
    for r in range(world_size):
        right, left = (r + 1) % world_size, (r - 1) % world_size
        send, recv = Step(count=0, send=right), Step(count=0, recv=left)
        programs.append(([send, recv] if r == 0 else [recv, send]) * laps)
    plan = Plan("barrier", "direct", world_size, 0, 0, False, programs)
    return CallPlan(body=None, tail=plan, reps=0, piece=1)


def _engine_ring(comm, laps: int, repeats: int) -> list[float]:  # type: ignore[no-untyped-def]
    n = comm.world_size
    plan = _ring_plan(n, laps)
    sig = ir.pack_sig("barrier", 0, np.dtype(np.uint8), 0, 0, laps)
    prog = ir.encode(plan, comm.rank, comm._arena.layout.channel, 0, sig)
    data = comm._arena.view(np.dtype(np.uint8))
    dummy = np.empty(0, np.uint8)
    resume = ir.with_entry(prog, ir.ENTRY_RESUME)
    start = engine.handles_for(prog, dummy, data, comm._ctrl, comm._state)
    again = engine.handles_for(resume, dummy, data, comm._ctrl, comm._state)
    times = []
    for _ in range(repeats + 1):
        comm.barrier()
        t0 = time.perf_counter()
        st = engine.execute(start, dummy, dummy)
        while st == engine.WAITING:
            st = engine.execute(again, dummy, dummy)
        assert st == engine.OK, st
        times.append((time.perf_counter() - t0) / (laps * n))
    return times[1:]


def _api_ring(comm, laps: int, repeats: int) -> list[float]:  # type: ignore[no-untyped-def]
    n, r = comm.world_size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    token = np.zeros(1, np.int64)
    times = []
    for _ in range(repeats + 1):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(laps):
            if r == 0:
                comm.send(token, right)
                comm.recv(token, left)
            else:
                comm.recv(token, left)
                comm.send(token, right)
        times.append((time.perf_counter() - t0) / (laps * n))
    return times[1:]


def _worker(comm, laps: int, repeats: int):  # type: ignore[no-untyped-def]
    return {"engine": _engine_ring(comm, laps, repeats), "api": _api_ring(comm, max(laps // 10, 100), repeats)}


def measure(world_size: int, laps: int = 20000, repeats: int = 5) -> dict[str, float]:
    """Median per-hand-off seconds for the engine ring and the API ring."""
    res = shmcoll.spawn(_worker, nprocs=world_size, args=(laps, repeats), timeout=600)[0]
    return {k: float(np.median(v)) for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", default="2,4", help="world sizes, comma-separated")
    ap.add_argument("--laps", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"# one-way hand-off latency, median of {args.repeats} repeats; {len(os.sched_getaffinity(0))} cores")
    print(f"# {'ranks':>5} {'engine (ns)':>12} {'API send/recv (ns)':>20}")
    for n in (int(v) for v in args.n.split(",")):
        m = measure(n, args.laps, args.repeats)
        print(f"  {n:>5} {m['engine'] * 1e9:>12.0f} {m['api'] * 1e9:>20.0f}")


if __name__ == "__main__":
    main()
