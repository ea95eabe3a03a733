"""benchmarks/gpu_bench.py under the simulator: argument parsing, the table, a tiny full run."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import gpu_bench  # noqa: E402


def test_parse_args() -> None:
    args = gpu_bench.parse_args(["--sizes", "1K,2M", "-n", "2,3", "--iters", "3"])
    assert args.sizes == [1024, 2 << 20] and args.nprocs == [2, 3] and args.iters == 3
    for bad in (["--sizes", "0"], ["--sizes", "12Q"], ["-n", "0"], ["--iters", "0"], ["--dtype", "complex64"]):
        with pytest.raises(SystemExit):
            gpu_bench.parse_args(bad)


def test_table_and_targets() -> None:
    size = gpu_bench.TARGET_BYTES
    kernel = [
        gpu_bench.KernelRow(size, copy_s=2 * size / 2000e9, reduce_s=3 * size / 1800e9, torch_s=3 * size / 1500e9)
    ]
    allreduce = [gpu_bench.AllreduceRow(size, 2, time_s=size / 1200e9, wrong=0)]
    table = gpu_bench.format_table(kernel, allreduce).splitlines()
    row = next(line for line in table if line.lstrip().startswith("256M"))
    assert row.split() == ["256M", "2000.0", "1800.0", "90.0%", "-", "1500.0", "1200.0", "0.60", "0"]
    assert table[-2].endswith("90.0% (met)")
    assert table[-1].endswith("1200.0 vs 2000.0 GB/s (met)")
    slow = [gpu_bench.AllreduceRow(size, 2, time_s=size / 900e9, wrong=0)]
    assert gpu_bench.format_table(kernel, slow).splitlines()[-1].endswith("(NOT met)")


def test_tiny_run_prints_the_table_last(capsys) -> None:  # type: ignore[no-untyped-def]
    rc = gpu_bench.main(["--sizes", "256,4K", "-n", "2", "--iters", "2", "--warmup", "1", "--timeout", "120"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert out[0].startswith("(CUDA simulator")
    rows = [line.split() for line in out if line.lstrip().startswith(("256", "4K"))]
    assert [r[0] for r in rows] == ["256", "4K"]
    assert all(r[-1] == "0" for r in rows)  # allreduce #wrong


def test_sizes_are_capped_under_the_simulator(capsys) -> None:  # type: ignore[no-untyped-def]
    assert gpu_bench.main(["--sizes", "1M"]) == 2
    assert "simulator" in capsys.readouterr().err


def test_profile_runs(capsys) -> None:  # type: ignore[no-untyped-def]
    import gpu_profile

    assert gpu_profile.main(["--sizes", "4K", "--calls", "2"]) == 0
    out = capsys.readouterr().out
    assert "=== rank 0, 4K: " in out and "=== rank 1, 4K: " in out and "Ordered by: internal time" in out
