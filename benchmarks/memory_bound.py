"""What the memory traffic of a 2-rank allreduce costs on one core, as a floor for any schedule.

For N bytes at 2 ranks, each rank must at least reduce its half (read its own and the peer's,
write: one add of N/2) and obtain the other half (one copy of N/2); the rings' schedule costs
each rank three copies and one add of N/2 (into a slot, out of a slot, for both phases). This
times numpy's copy and add of N/2 in one process (median of 7 blocks): ``python
benchmarks/memory_bound.py``. Compare with the measured allreduce (``compare_peers.py -c
allreduce -b 1M -e 4M``); see benchmarks/RESULTS.md.
"""

import numpy as np, time
from shmcoll.kernels.cpu import copy, combine
def t(f, reps=200):
    for _ in range(10): f()
    ts=[]
    for _ in range(7):
        s=time.perf_counter()
        for _ in range(reps): f()
        ts.append((time.perf_counter()-s)/reps)
    return sorted(ts)[3]*1e6
for mib in (1, 2, 4):
    n = mib*(1<<20)//4; h = n//2
    a = np.random.rand(n).astype(np.float32); b = np.random.rand(n).astype(np.float32); c = np.empty(n, np.float32)
    tc = t(lambda: np.copyto(c[:h], a[:h]))
    ta = t(lambda: np.add(a[:h], b[:h], out=a[:h]))
    tc_full = t(lambda: np.copyto(c, a))
    print(f"{mib} MiB: copy of half {tc:.1f} us, add of half (in place) {ta:.1f} us, copy of all {tc_full:.1f} us; bound copy+add of half = {tc+ta:.1f} us; ring work per rank (3 copies + 1 add of half) = {3*tc+ta:.1f} us")
