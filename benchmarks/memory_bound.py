"""What the memory traffic of a 2-rank allreduce costs on one core.

For N bytes at 2 ranks, each rank must at least reduce its half (read its own and the peer's,
write: one add of N/2) and obtain the other half (one copy of N/2); the rings' schedule costs
each rank three copies and one add of N/2 (into a slot, out of a slot, for both phases). This
times numpy's copy and add of N/2 in one process (median of 7 blocks), first as two passes over
the whole half, then a 256 KiB part at a time (copy the part, add it), as cma's allreduce goes:
once N/2 outgrows the core's cache the whole-buffer passes pay the memory twice, so they are no
floor for a schedule that works in parts (stop 28 took them for one, and cma's allreduce at 4
MiB then ran below them). It also times the same copy of N/2 through cross-memory attach
(``process_vm_readv`` on this process's own memory, as cma's plans copy between ranks): cma's
allreduce makes two such copies per rank (read the peer's half, write the result into it), and
where the kernel's copy is slower than a copy in user space (3.6x on an AMD VM) they, not the
memory, set its time. ``python benchmarks/memory_bound.py``; compare with the measured
allreduce (``compare_peers.py -c allreduce -b 1M -e 4M``); see benchmarks/RESULTS.md.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import numpy as np

from shmcoll.shm.atomics import vm_copy


def per_call_us(fn: Callable[[], object], reps: int = 200) -> float:
    """Median over 7 blocks of ``reps`` calls, after 10 untimed ones, in microseconds per call."""
    for _ in range(10):
        fn()
    blocks = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        blocks.append((time.perf_counter() - t0) / reps)
    return float(np.median(blocks)) * 1e6


PART = 64 << 10  # float32 elements: cma's part (256 KiB)


def by_parts(parts: list[slice], src: np.ndarray, other: np.ndarray, dst: np.ndarray) -> None:
    """The same traffic as the whole passes, a part at a time: copy the peer's part, add it."""
    for p in parts:
        np.copyto(dst[p], other[p])
        np.add(src[p], dst[p], out=src[p])


def main() -> None:
    rng = np.random.default_rng(0)
    for mib in (1, 2, 4):
        n = mib * (1 << 20) // 4
        half = slice(0, n // 2)
        a = rng.random(n, dtype=np.float32)
        b = rng.random(n, dtype=np.float32)
        src, other, dst = a[half], b[half], np.empty(n // 2, np.float32)
        copy_us = per_call_us(functools.partial(np.copyto, dst, src))
        add_us = per_call_us(functools.partial(np.add, src, other, out=src))
        parts = [slice(s, s + PART) for s in range(0, n // 2, PART)]
        parts_us = per_call_us(functools.partial(by_parts, parts, src, other, dst))
        vm_us = per_call_us(
            functools.partial(vm_copy, os.getpid(), dst.ctypes.data, other.ctypes.data, dst.nbytes, False)
        )
        print(
            f"{mib} MiB: copy of half {copy_us:.1f} us, add of half {add_us:.1f} us; "
            f"whole passes (add + copy of half) {copy_us + add_us:.1f} us; "
            f"a part at a time {parts_us:.1f} us; "
            f"rings' work (add + 3 copies of half) {add_us + 3 * copy_us:.1f} us; "
            f"cross-memory attach copy of half {vm_us:.1f} us (cma's allreduce makes two)"
        )


if __name__ == "__main__":
    main()
