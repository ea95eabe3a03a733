"""benchmarks/cross_core.py: one real run; its rounds hand the bytes over, and it says where it cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import scripts

_TWO_CPUS = len(os.sched_getaffinity(0)) >= 2


@pytest.mark.skipif(not _TWO_CPUS, reason="needs two CPUs")
def test_one_run_times_every_size_in_every_sample() -> None:
    script = str(scripts.BENCHMARKS / "cross_core.py")
    argv = ["--sizes", "4K,64K", "--rounds", "50", "--samples", "2", "--every", "0"]
    proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if not line.startswith("#")][1:]
    assert [r[:2] for r in rows] == [["1", "4K"], ["1", "64K"], ["2", "4K"], ["2", "64K"]], proc.stdout
    for row in rows:
        cross, same, ratio = (float(x) for x in row[2:])
        # (the ratio is of the unrounded times: 0.10 printed may be 0.095 or 0.104)
        assert cross > 0 and same > 0 and ratio == pytest.approx(cross / same, rel=0.2, abs=0.01), row
    assert "# 64K: cross-core" in proc.stdout


@pytest.mark.skipif(not _TWO_CPUS, reason="needs two CPUs")
def test_a_round_hands_the_bytes_over() -> None:
    """The timed rounds move real data: what the first thread copies in reaches the second's buffer."""
    cross_core = scripts.load("cross_core")
    cpus = tuple(sorted(os.sched_getaffinity(0))[:2])
    words = np.zeros(16, np.int64)
    src, shared, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    times = np.zeros(3, np.int64)
    cross_core.warm()  # (compiled here, not by both threads at once)
    side, theirs = cross_core._side, []
    b = (cpus[1], side, words, 1, shared.ctypes.data, dst.ctypes.data, 4096, 3, times)
    other = threading.Thread(target=cross_core._pinned, args=b, kwargs={"results": theirs}, daemon=True)
    other.start()
    mine = cross_core._pinned(cpus[0], side, words, 0, shared.ctypes.data, src.ctypes.data, 4096, 3, times)
    other.join(timeout=30)
    assert mine == 0 and theirs == [0]
    assert np.array_equal(dst, src) and (times > 0).all()
    assert cross_core.round_us(4096, 5, cpus)[0] > 0
    assert os.sched_getaffinity(0) >= set(cpus)  # (this thread's CPUs given back)


def test_a_thread_that_never_answers_is_given_up_on() -> None:
    """A round whose other thread never runs ends (within _GIVE_UP_NS), not hangs: -1."""
    cross_core = scripts.load("cross_core")
    words, times = np.zeros(16, np.int64), np.zeros(1, np.int64)
    buf = np.zeros(64, np.uint8)
    # the other thread "answered" round 0 only: thread 0 waits for round 1's answer, from a start
    # long enough ago that the first look at the clock gives up
    assert cross_core._wait_for(words, cross_core._ANSWER, 1, -(10**12)) is False
    words[cross_core._ANSWER] = 1
    assert cross_core._side(words, 0, buf.ctypes.data, buf.ctypes.data, 64, 1, times) == 0


def test_two_cpus_it_may_not_use_are_refused() -> None:
    script = str(scripts.BENCHMARKS / "cross_core.py")
    proc = subprocess.run([sys.executable, script, "--cpus", "0,0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs two different CPUs" in proc.stderr
