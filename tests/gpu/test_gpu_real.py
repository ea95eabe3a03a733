"""On a real CUDA GPU: the kernels' arithmetic against numpy, device collectives through CUDA IPC
across processes, and a short benchmark run. Marked ``gpu`` (deselected by default); run with::

    python -m pytest -m gpu tests/gpu/test_gpu_real.py

Each test skips when no GPU is usable (or under the simulator).
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import numpy as np
import pytest

import shmcoll

pytestmark = pytest.mark.gpu
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def checks() -> Any:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("real-GPU tests do not run under the CUDA simulator")
    cuda = pytest.importorskip("numba.cuda")
    if not cuda.is_available():
        pytest.skip("no usable CUDA GPU")
    import device_checks

    return device_checks


# Compiles every (dtype, op) kernel on its first launch: past 200 s on an H200 machine's host.
@pytest.mark.timeout(1200)
def test_kernels_match_numpy(checks: Any) -> None:
    from shmcoll.types import BFLOAT16, DTYPES

    for dtype in DTYPES:
        if dtype == BFLOAT16:  # device arrays of bfloat16 are refused
            continue
        # An odd count: full tiles, a partial tile, and several grid sweeps at the default launch.
        checks.check_kernels_for(dtype, 300_007, (1, 2, 3, 4, 5, 9))


def test_kernel_large_buffer(checks: Any) -> None:
    from shmcoll import ReduceOp

    count = 1 << 26  # 256 MiB of float32
    xs = [np.full(count, k + 1, np.float32) for k in range(3)]
    got = checks.run_kernel(xs, ReduceOp.SUM, divide=False)
    assert (got == 6).all()


def _ipc_matrix(comm: Any) -> list[Any]:
    import device_checks

    from shmcoll.comm import device as device_path

    out = []
    for path, oneshot in (("auto", 16), ("auto", 1 << 20), ("staging", 16)):
        cases = device_checks.device_matrix(comm.world_size)
        fails, digests = device_checks.run_device_cases(comm, cases, path, oneshot)
        out.append((path, oneshot, device_path._engine(comm).last_path, fails, digests))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_ipc_collectives(checks: Any, world_size: int) -> None:
    from cases import SAME_ON_ALL

    results = shmcoll.spawn(_ipc_matrix, nprocs=world_size, timeout=600)
    for run, (path, oneshot, used, _, _) in enumerate(results[0]):
        failures = [f for rank in results for f in rank[run][3]]
        assert not failures, f"[{path} {oneshot}] {len(failures)} failures:\n" + "\n".join(failures[:10])
        assert used == ("staging" if path == "staging" else "ipc"), f"{path} ran on the {used} path"
        cases = checks.device_matrix(world_size)
        for case in cases:
            if case.kind in SAME_ON_ALL:
                digests = {results[r][run][4].get(case.case_id) for r in range(world_size)}
                assert len(digests) == 1, f"[{path} {oneshot}] {case.describe()}: results differ across ranks"


def _large_allreduce(comm: Any) -> str:
    from numba import cuda

    def data(rank: int) -> np.ndarray:
        return np.random.default_rng([7, rank]).standard_normal(1 << 24).astype(np.float32)  # 64 MiB

    d = cuda.to_device(data(comm.rank))
    comm.allreduce(d)  # above oneshot_bytes: reduce-scatter + allgather
    everyone = [data(r) for r in range(comm.world_size)]
    want = everyone[0]
    for other in everyone[1:]:  # the kernel's order: rank 0, then 1, then 2; one rounding each
        want = want + other
    got = d.copy_to_host()
    np.testing.assert_array_equal(got, want)
    return hashlib.sha1(got.tobytes()).hexdigest()


def test_large_allreduce_is_bitwise_identical(checks: Any) -> None:
    digests = shmcoll.spawn(_large_allreduce, nprocs=3, timeout=600)
    assert len(set(digests)) == 1


def test_benchmark_runs(checks: Any, capsys: Any) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))
    import gpu_bench

    rc = gpu_bench.main(["--sizes", "1M,16M", "-n", "2", "--iters", "5", "--warmup", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert any("copy GB/s" in line for line in out.splitlines()), out
