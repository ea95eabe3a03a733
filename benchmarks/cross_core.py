"""How fast this machine's cores hand each other freshly written data, sampled over time.

Every hand-off of shmcoll's rings, and most of a small or mid-sized call, is one core reading what
another has just written. On the 2-core Zen 5 VMs these benchmarks ran on, that speed changed by
up to 5x from minute to minute and between hosts (``benchmarks/RESULTS.md``, stops 43 and 44),
while a copy on one core, or a kernel copy from a buffer nobody was writing, barely moved; so a
figure of shmcoll's from 16 KiB to a few MiB says as much about the spell it ran in as about the
code. Run this beside a benchmark to know the spell.

One *round*: a thread on CPU ``a`` copies N bytes into a shared buffer and raises a flag; a thread
on CPU ``b`` waits for it, copies the buffer out and answers; the first waits for the answer.
Against it, the same two copies made by one thread (the *same core* column): the cost of the
copies themselves. A round's figure is the median of ``--rounds`` rounds; a *sample* runs every
size once; ``--samples`` samples are taken ``--every`` seconds apart.

Run: ``python benchmarks/cross_core.py [--sizes 4K,64K,1M] [--samples 5 --every 2] [--cpus 0,1]``.
Each line: sample, size, cross-core round (us), same-core round (us), their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import numpy as np

from shmcoll.jit import jit
from shmcoll.shm.atomics import cpu_pause, load_acquire, monotonic_ns, move_bytes, store_release
from shmcoll.units import format_size, parse_size

_FLAG, _ANSWER = 0, 8  # words of the two threads' flags, a cache line apart
_GIVE_UP_NS = 10_000_000_000  # a wait for the other thread this long: it is not running


@jit
def _wait_for(words, word, target, since):  # type: ignore[no-untyped-def]
    """Wait until ``words[word] >= target``; False if the wait outlasts :data:`_GIVE_UP_NS` from ``since``."""
    n = 0
    while load_acquire(words, word) < target:
        cpu_pause()
        n += 1
        if n % 4096 == 0 and monotonic_ns() - since > _GIVE_UP_NS:
            return False
    return True


@jit
def _side(words, me, shared, private, nbytes, rounds, times):  # type: ignore[no-untyped-def]
    """Thread ``me``'s part of ``rounds`` rounds (see the module doc); thread 0 writes each
    round's nanoseconds into ``times``. Returns -1 where the other thread never answered."""
    for r in range(1, rounds + 1):
        t0 = monotonic_ns()
        if me == 0:
            move_bytes(shared, private, nbytes)
            store_release(words, _FLAG, r)
            if not _wait_for(words, _ANSWER, r, t0):
                return -1
            times[r - 1] = monotonic_ns() - t0
        else:
            if not _wait_for(words, _FLAG, r, t0):
                return -1
            move_bytes(private, shared, nbytes)
            store_release(words, _ANSWER, r)
    return 0


@jit
def _alone(shared, private_in, private_out, nbytes, rounds, times):  # type: ignore[no-untyped-def]
    """Both copies of a round made by one thread."""
    for r in range(rounds):
        t0 = monotonic_ns()
        move_bytes(shared, private_in, nbytes)
        move_bytes(private_out, shared, nbytes)
        times[r] = monotonic_ns() - t0
    return 0


def warm() -> None:
    """Compile (or load from the cache) the rounds' code in this thread, before the two pinned
    threads call it, so that neither compiles on its one CPU while the other waits for it. (Two
    threads' first calls at once once failed in one of them, EBADF in numba's cache: fixed in
    ``shmcoll/jit.py``, whose compile bookkeeping now runs under numba's compiler lock.)"""
    words, times = np.zeros(16, np.int64), np.zeros(1, np.int64)
    _side(words, 0, 0, 0, 0, 0, times)
    _alone(0, 0, 0, 0, 0, times)


def _pinned(cpu: int, fn, *args, results: list[int] | None = None) -> int:  # type: ignore[no-untyped-def]
    """``fn(*args)`` with the calling thread on ``cpu`` alone (0: the calling thread, on Linux),
    and on its own CPUs again after; what it returned, appended to ``results`` too."""
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        got = int(fn(*args))
    finally:
        os.sched_setaffinity(0, own)
    if results is not None:
        results.append(got)
    return got


def round_us(nbytes: int, rounds: int, cpus: tuple[int, int]) -> tuple[float, float]:
    """(cross-core, same-core): median microseconds of a round of ``nbytes``."""
    warm()
    bufs = [np.ones(max(nbytes, 1), np.uint8) for _ in range(4)]  # (pages touched before timing)
    shared, a_private, b_private, spare = (b.ctypes.data for b in bufs)
    words = np.zeros(16, np.int64)
    cross = np.zeros(rounds, np.int64)
    theirs: list[int] = []
    args = (cpus[1], _side, words, 1, shared, b_private, nbytes, rounds, cross)
    other = threading.Thread(target=_pinned, args=args, kwargs={"results": theirs}, daemon=True)
    other.start()
    mine = _pinned(cpus[0], _side, words, 0, shared, a_private, nbytes, rounds, cross)
    other.join(timeout=_GIVE_UP_NS / 1e9 + 5)
    if mine != 0 or theirs != [0]:
        raise RuntimeError(
            f"cross_core.py: the thread on cpu {cpus[1]} did not answer within {_GIVE_UP_NS / 1e9:.0f} s"
        )
    same = np.zeros(rounds, np.int64)
    _alone(shared, a_private, spare, nbytes, rounds, same)
    return float(np.median(cross)) / 1e3, float(np.median(same)) / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4K,64K,1M")
    ap.add_argument("--rounds", type=int, default=2000, help="rounds per size at 4 KiB (fewer for larger sizes)")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    ap.add_argument("--cpus", default="", help="the two CPUs, e.g. 0,1 (default: the first two this process may use)")
    args = ap.parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    cpus = tuple(int(c) for c in args.cpus.split(",")) if args.cpus else tuple(allowed[:2])
    if len(cpus) != 2 or cpus[0] == cpus[1] or not set(cpus) <= set(allowed):
        print(f"cross_core.py: needs two different CPUs this process may use (it may use {allowed})", file=sys.stderr)
        return 2
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    print(f"# cpus {cpus[0]} and {cpus[1]}; a round: copy in on one, copy out on the other (median us)")
    print(f"{'sample':>6} {'size':>8} {'cross-core':>11} {'same-core':>10} {'ratio':>6}")
    per_size: dict[int, list[float]] = {}
    for sample in range(args.samples):
        if sample:
            time.sleep(args.every)
        for nbytes in sizes:
            rounds = max(20, args.rounds * 4096 // max(nbytes, 4096))
            cross, same = round_us(nbytes, rounds, cpus)  # type: ignore[arg-type]
            per_size.setdefault(nbytes, []).append(cross)
            ratio = cross / same if same > 0 else float("inf")
            print(f"{sample + 1:>6} {format_size(nbytes):>8} {cross:>11.2f} {same:>10.2f} {ratio:>6.2f}", flush=True)
    if args.samples > 1:
        for nbytes, xs in per_size.items():
            spread, mid = f"{min(xs):.2f}-{max(xs):.2f}", statistics.median(xs)
            print(f"# {format_size(nbytes)}: cross-core {spread} us over {len(xs)} samples, median {mid:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
