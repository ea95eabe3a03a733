"""benchmarks/copy_floor.py: one real launch; every case runs and checks its result."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import scripts

from shmcoll.shm import cma


@pytest.mark.skipif(not cma.probe()[0], reason="cross-memory attach is not permitted here")
def test_one_launch_times_the_floor_the_system_calls_and_each_algorithm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    argv = ["-n", "3", "-s", "96K,1M", "-a", "auto,cma,pairwise", "--rounds", "2"]
    argv += ["--peers", "openmpi", "--peers-dir", str(tmp_path)]  # a peer that is not installed
    script = str(scripts.BENCHMARKS / "copy_floor.py")
    proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "# openmpi: not installed" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert [tuple(r[:3]) for r in rows] == [
        (c, s, "shmcoll") for c in ("alltoall", "allgather", "broadcast") for s in ("96K", "1M")
    ], proc.stdout
    for row in rows:
        # pairwise has no allgather: left out there, not failed
        want = ["memcpy", "syscalls", "auto", "cma"] + (["pairwise"] if row[0] == "alltoall" else [])
        assert row[3::3] == want, row
        assert all(float(t) >= 0 for t in row[4::3]), row
        assert all(re.fullmatch(r"\(x\d+\.\d\d\)", x) for x in row[5::3]), row


def test_a_wrong_result_fails_the_launch() -> None:
    """The check is real: a case that leaves a wrong output fails before any timing, and the
    floor's own cases pass it (one rank: its own block)."""
    copy_floor = scripts.load("copy_floor")
    cfg = {"collectives": ["alltoall", "allgather"], "sizes": [1 << 16], "rounds": 1, "pages": "numpy"}
    got = copy_floor.measure(_OneRank(), cfg, lambda case: {"right": case.run})
    assert set(got) == {"alltoall 65536", "allgather 65536"}
    assert all(set(cases) == {"memcpy", "syscalls", "right"} for cases in got.values())
    with pytest.raises(AssertionError, match="alltoall 65536 B wrong: 16384 wrong elements"):
        copy_floor.measure(_OneRank(), cfg, lambda case: {"wrong": lambda: case.out.fill(-7)})


class _OneRank:
    """compare_peers' PeerComm for one process (one rank: no peer to read from)."""

    rank, world_size = 0, 1

    def alloc(self, count, pages="numpy"):  # type: ignore[no-untyped-def]
        a = np.empty(count, np.float32)
        return a, a

    def barrier(self) -> None:
        pass

    def allreduce_small(self, arr, op) -> None:  # type: ignore[no-untyped-def]
        pass

    def call(self, collective, x, out) -> None:  # type: ignore[no-untyped-def]
        out[...] = x  # one rank: every collective here is a copy
