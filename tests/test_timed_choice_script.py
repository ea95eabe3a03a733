"""benchmarks/timed_choice.py: one real launch, below the timed floor made to time it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import scripts

from shmcoll.shm import cma


@pytest.mark.skipif(not cma.probe()[0], reason=f"cross-memory attach {cma.probe()[1]}")
def test_one_launch_reports_auto_its_pick_and_cma(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "tc.json"
    argv = ["-n", "2", "-c", "reduce", "--sizes", "64K,8K", "--from", "64K", "--no-vote"]
    argv += ["--launches", "1", "--blocks", "2", "--calls", "3", "--json", str(out)]
    script = str(scripts.BENCHMARKS / "timed_choice.py")
    proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())["results"]
    assert set(report) == {"reduce 64K", "reduce 8K"}
    # (timed from the floor given, not below it; its pick is never cma, which it is timed against)
    assert report["reduce 64K"]["timed"] and not report["reduce 8K"]["timed"]
    for entry in report.values():
        assert entry["pick"] != "cma"
        assert set(entry["median_us"]) == {"auto", "pick", "cma"} and all(t > 0 for t in entry["median_us"].values())
    assert "reduce 64K" in proc.stdout and "--no-vote" in proc.stdout
