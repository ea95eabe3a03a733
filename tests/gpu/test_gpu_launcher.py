"""GPU support as seen from the default test run: the simulator suite (in a subprocess, so this
process never switches numba to simulator mode), imports, ``describe()``, and the benchmark's
refusal to run without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import shmcoll

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SIM_TESTS = ["test_sim_kernels.py", "test_sim_collectives.py", "test_sim_bench.py"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    # The subprocess imports the same shmcoll as this process.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(shmcoll.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def _python(code: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=_env(**extra), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(900)
def test_simulator_suite() -> None:
    probe = _python("from numba import cuda; cuda.to_device([1.0])", NUMBA_ENABLE_CUDASIM="1")
    if probe.returncode != 0:
        pytest.skip(f"numba's CUDA simulator is not importable here: {probe.stderr.strip().splitlines()[-1:]}")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(os.path.join(HERE, t) for t in SIM_TESTS)]
    proc = subprocess.run(
        cmd, env=_env(NUMBA_ENABLE_CUDASIM="1"), cwd=ROOT, capture_output=True, text=True, timeout=840
    )
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    assert proc.returncode == 0, f"simulator suite failed (rc {proc.returncode}):\n{tail}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail


def test_import_shmcoll_does_not_import_cuda() -> None:
    proc = _python(
        "import sys, shmcoll, shmcoll.device, shmcoll.cli.main\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('numba.cuda', 'numba_cuda', 'cupy', 'torch')))\n"
        "assert not loaded, loaded\n"
        "print('ok')"
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_describe_is_one_line_without_gpu() -> None:
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on GPU machines too.
    proc = _python("from shmcoll.engine import cuda\nprint(cuda.describe())", CUDA_VISIBLE_DEVICES="")
    if proc.returncode != 0 and "ImportError" in proc.stderr:
        pytest.skip("numba.cuda is not importable here")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "no usable CUDA GPU" in lines[0], lines


def test_info_has_a_gpu_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "shmcoll.cli", "info"],
        env=_env(CUDA_VISIBLE_DEVICES=""),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("gpu: ")], proc.stdout


def test_benchmark_without_gpu_fails_clearly() -> None:
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_bench.py"), "--sizes", "1K"],
        env=_env(CUDA_VISIBLE_DEVICES=""),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "gpu_bench:" in proc.stderr and ("no usable CUDA GPU" in proc.stderr or "numba-cuda" in proc.stderr)
    assert proc.stdout == ""
