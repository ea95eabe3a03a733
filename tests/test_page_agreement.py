"""benchmarks/page_agreement.py: one real launch, on both page sizes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import scripts

from shmcoll.shm import cma, pages


@pytest.mark.skipif(not (cma.probe()[0] and pages.can_scan()), reason="cross-memory attach or PAGEMAP_SCAN missing")
def test_one_launch_reports_auto_unaware_and_cma(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "pa.json"
    argv = ["-n", "2", "-c", "allgather", "--sizes", "512K,2M", "--launches", "1", "--blocks", "2", "--calls", "2"]
    script = str(scripts.BENCHMARKS / "page_agreement.py")
    proc = subprocess.run(
        [sys.executable, script, *argv, "--json", str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())["results"]
    assert set(report) == {f"{p} allgather {s}" for p in ("small", "huge") for s in ("512K", "2M")}
    for key, entry in report.items():
        plain, huge = entry["plans"]
        # from 1 MiB a call shape may have a huge-page plan (where the race does not run cma
        # anyway: on the Zen 5 VM, direct / cma); below, none
        assert huge is None if key.endswith("512K") else huge in ("cma", None), key
        assert huge is None or plain != "cma", key
        assert set(entry["median_us"]) == {"auto", "unaware", "cma"} and all(t > 0 for t in entry["median_us"].values())
    assert "huge allgather 2M" in proc.stdout
