"""Every script in examples/ runs in its quick form and passes its own checks."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 150  # per script; each also gives its ranks a deadline through shmcoll.spawn(timeout=...)


def _example(name: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name), *args],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_quickstart() -> None:
    out = _example("quickstart.py", "--nprocs", "2")
    assert "[3.0, 3.0] (expected 3 on every rank)" in out


def test_average_gradients() -> None:
    out = _example("average_gradients.py", "--nprocs", "2", "--quick")
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.split()[:1] in (["literal"], ["per_param"], ["bucketed"])
    }
    assert set(rows) == {"literal", "per_param", "bucketed"}
    assert rows["literal"][1] == "8" and rows["bucketed"][1] == "1"  # allreduce calls per step
    assert all(float(r[-1]) <= 1e-4 for r in rows.values())  # max |w - w_1proc|
    assert "OK: replicas bitwise identical" in out


def test_pipeline_parallel() -> None:
    out = _example("pipeline_parallel.py", "--nprocs", "2", "--quick")
    assert "stage 0: layers" in out and "stage 1: layers" in out
    row = r"^\s+(\d+)\s+(\S+)\s+(\S+)\s+\S+ ms\s+(\S+) dw (\S+) dloss (\S+)$"
    table = {int(m[0]): m for m in re.findall(row, out, re.M)}
    assert sorted(table) == [1, 2, 4, 8]
    for m, (_, measured, theory, same, dw, dloss) in table.items():
        assert float(theory) == round(1 / (m + 1), 3)  # (p-1)/(m+p-1) with p = 2
        assert 0 <= float(measured) <= 1
        assert same == "bitwise"  # equal to one process accumulating the same micro-batches
        assert float(dw) <= 1e-5 and float(dloss) <= 1e-5  # and to whole-batch training, up to rounding
    assert out.rstrip().endswith("OK")


def test_parameter_server() -> None:
    out = _example("parameter_server.py", "--quick", "--servers", "2", "--workers", "2", "--fraction", "0.5")
    assert "straggler quorum 1/2" in out
    modes = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.split()[:1] in (["sync"], ["straggler"], ["async"])
    }
    assert set(modes) == {"sync", "straggler", "async"}
    assert modes["sync"][1] == "8/8"  # synchronous: every worker does every step
    assert "consistent: every pushed update applied exactly once in every mode" in out
