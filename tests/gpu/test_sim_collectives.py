"""Device-array collectives under the CUDA simulator, across processes, against numpy.

Both data paths run: staging through host memory (what the simulator uses by default) and the
IPC protocol (workspaces, handshakes, double buffering, one-shot and reduce-scatter + allgather
allreduce) over host shared memory standing in for CUDA IPC. Half the calls pass a foreign
``__cuda_array_interface__`` array through the Communicator's own methods, the other half
numba's simulated device arrays, through the Communicator's methods too.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from cases import SAME_ON_ALL
from device_checks import ForeignArray, device_matrix, run_device_cases, to_host
from numba import cuda

import shmcoll
from shmcoll import ReduceOp, device
from shmcoll.comm import device as device_path
from shmcoll.engine import cuda as engine
from shmcoll.types import BFLOAT16

# (path, oneshot_bytes, which cases). IPC runs the whole matrix with every allreduce above 16
# bytes reduce-scattering then allgathering, and the allreduce cases again all one-shot. Staging
# is copies around the numpy path (tested by the CPU matrix): three dtypes cover its conversions.
RUNS: list[tuple[str, int, Any]] = [
    ("ipc", 16, lambda c: True),
    ("ipc", 1 << 20, lambda c: c.kind == "allreduce"),
    ("staging", 16, lambda c: c.dtype in ("float32", "bool", "float16")),
]


def _matrix(comm: Any, world_size: int) -> list[Any]:
    cases = device_matrix(world_size)
    results = []
    for path, oneshot, which in RUNS:
        chosen = [c for c in cases if which(c)]
        results.append((path, oneshot, chosen, *run_device_cases(comm, chosen, path, oneshot)))
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_matrix(pools, world_size: int) -> None:  # type: ignore[no-untyped-def]
    pool = pools.get(world_size)
    results = pool.run(_matrix, world_size, timeout=240)
    failures = [f for rank in results for (_, _, _, fails, _) in rank for f in fails]
    assert not failures, f"{len(failures)} failures, first 10:\n" + "\n".join(failures[:10])
    for run, (path, oneshot, cases, _, _) in enumerate(results[0]):
        for case in cases:
            if case.kind in SAME_ON_ALL:
                digests = {results[r][run][4].get(case.case_id) for r in range(world_size)}
                assert len(digests) == 1, f"[{path} {oneshot}] {case.describe()}: results differ across ranks"


def _grow_and_release(comm: Any) -> list[float]:
    saved = engine.MIN_HALF_BYTES
    engine.MIN_HALF_BYTES = 256  # so that small calls outgrow the workspace
    try:
        device.configure(comm, path="ipc", oneshot_bytes=64)
        sums = []
        for count in (3, 40, 700, 5, 2000):
            x = cuda.to_device(np.full(count, comm.rank + 1, np.float32))
            comm_sum = comm.allreduce(x)
            host = comm_sum.copy_to_host()
            assert (host == sum(range(1, comm.world_size + 1))).all(), host[:4]
            sums.append(float(host.sum()))
        eng = device_path._engine(comm)
        grown = eng._half
        device.release(comm)
        assert eng._views is None
        x = cuda.to_device(np.ones(10, np.float32))
        comm.allreduce(x)
        assert (x.copy_to_host() == comm.world_size).all()
        sums.append(float(grown))
        return sums
    finally:
        engine.MIN_HALF_BYTES = saved


def test_workspace_grows_and_is_released(pools) -> None:  # type: ignore[no-untyped-def]
    results = pools.get(3).run(_grow_and_release, timeout=120)
    assert results[0] == results[1] == results[2]
    assert results[0][-1] >= 2000 * 4 * 2  # the last growth fits A and B regions of 2000 floats


def _as_is(a: np.ndarray, readonly: bool = False) -> np.ndarray:
    return a


def _errors(comm: Any) -> list[str]:
    """Each wrong call on device arrays raises what the numpy method raises, before any
    communication (a call that communicated would hang or mismatch the next one)."""
    f32 = np.float32
    problems = []

    def both(name: str, fn: Any, compare_message: bool = True) -> None:
        errs = []
        for wrap in (_as_is, ForeignArray.of):
            try:
                fn(wrap)
                errs.append(None)
            except (ValueError, TypeError) as exc:
                errs.append(exc)
        want, got = errs
        if want is None or got is None or type(want) is not type(got):
            problems.append(f"{name}: numpy raised {want!r}, device raised {got!r}")
        elif compare_message and str(want) != str(got):
            problems.append(f"{name}: messages differ: {want} | {got}")

    z = np.zeros
    both("unknown op", lambda w: comm.allreduce(w(z(4, f32)), op="nope"))
    both("op for dtype", lambda w: comm.allreduce(w(z(4, f32)), op=ReduceOp.BAND))
    both("bool AVG", lambda w: comm.allreduce(w(z(4, bool)), op=ReduceOp.AVG))
    both("out shape", lambda w: comm.allreduce(w(z(4, f32)), out=w(z(3, f32))))
    both("out dtype", lambda w: comm.allreduce(w(z(4, f32)), out=w(z(4, np.float64))))
    buf = z(8, f32)
    both("overlap", lambda w: (lambda b: comm.allreduce(b[0:4], out=b[1:5]))(w(buf)))
    both("dtype", lambda w: comm.allreduce(w(z(4, np.dtype(">i4")))))
    both("algorithm type", lambda w: comm.allreduce(w(z(4, f32)), algorithm=3))
    both("reduce root", lambda w: comm.reduce(w(z(4, f32)), root=comm.world_size))
    both("broadcast root", lambda w: comm.broadcast(w(z(4, f32)), root=-1))
    both("gather root", lambda w: comm.gather(w(z(4, f32)), root=7))
    if comm.rank == 0:
        both("scatter shape", lambda w: comm.scatter(w(z((comm.world_size + 1, 2), f32)), root=0))
    both("reduce_scatter shape", lambda w: comm.reduce_scatter(w(z(comm.world_size + 1, f32))))
    both("alltoall shape", lambda w: comm.alltoall(w(z((comm.world_size, 2), f32))[:1]))
    both("allgather out", lambda w: comm.allgather(w(z(3, f32)), out=w(z((comm.world_size, 4), f32))))
    both(
        "allgather overlap",
        lambda w: (lambda b: comm.allgather(b[1:3], out=b[: 2 * comm.world_size].reshape(-1, 2)))(w(buf)),
    )
    both("send with a negative tag", lambda w: comm.send(w(z(2, f32)), dst=comm.rank, tag=-3))
    both("send out of range", lambda w: comm.send(w(z(2, f32)), dst=comm.world_size))
    both("recv out of range", lambda w: comm.recv(w(z(2, f32)), src=-2))
    ro = z(4, f32)
    ro.flags.writeable = False
    both("read-only in place", lambda w: comm.allreduce(w(ro, readonly=True)))
    both("non-contiguous", lambda w: comm.allreduce(w(z(8, f32))[::2]), compare_message=False)
    # Mixing the kinds of array is a TypeError both ways round.
    for x, out in ((z(4, f32), ForeignArray.of(z(4, f32))), (ForeignArray.of(z(4, f32)), z(4, f32))):
        try:
            comm.allreduce(x, out=out)
            problems.append(f"mixed arrays: {type(x).__name__} x with {type(out).__name__} out raised nothing")
        except TypeError:
            pass
    # Nothing above communicated: the communicator still works, on both paths.
    x = ForeignArray.of(np.ones(4, f32))
    comm.allreduce(x)
    assert (to_host(x) == comm.world_size).all()
    return problems


def test_argument_errors_match_numpy(pools) -> None:  # type: ignore[no-untyped-def]
    results = pools.get(2).run(_errors, timeout=120)
    problems = [p for rank in results for p in rank]
    assert not problems, "\n".join(problems)


def _bfloat16_refused(comm: Any) -> list[str]:
    """Device arrays of bfloat16 are refused (no device kernel converts them), before any
    communication; the numpy path takes them."""
    x = cuda.to_device(np.zeros(4, np.uint16).view(BFLOAT16))
    messages = []
    for call in (
        lambda: comm.allreduce(x),
        lambda: comm.broadcast(x),
        lambda: comm.allgather(x),
        lambda: comm.send(x, dst=comm.rank),
    ):
        with pytest.raises(TypeError, match="bfloat16 device arrays are not supported") as info:
            call()
        messages.append(str(info.value))
    assert comm.allreduce(np.zeros(4, np.uint16).view(BFLOAT16)).dtype == BFLOAT16
    return messages


def test_bfloat16_device_arrays_are_refused(pools) -> None:  # type: ignore[no-untyped-def]
    assert all(len(m) == 4 for m in pools.get(2).run(_bfloat16_refused, timeout=120))


def _p2p(comm: Any) -> list[float]:
    n, r = comm.world_size, comm.rank
    got = []
    for foreign in (True, False):
        x = np.arange(5, dtype=np.float16) + r
        if foreign:
            dx, buf = ForeignArray.of(x), ForeignArray.of(np.zeros(5, np.float16))
            send, recv = comm.send, comm.recv
        else:
            dx, buf = cuda.to_device(x), cuda.device_array(5, np.float16)
            send, recv = comm.send, comm.recv
        if r % 2 == 0:
            assert send(dx, dst=(r + 1) % n) is None
            status = recv(buf, src=(r - 1) % n)
        else:
            status = recv(buf, src=(r - 1) % n)
            send(dx, dst=(r + 1) % n)
        assert (status.source, status.tag, status.count) == ((r - 1) % n, 0, 5)
        got.append(float(to_host(buf)[0]))
    return got


def test_send_recv(pools) -> None:  # type: ignore[no-untyped-def]
    results = pools.get(3).run(_p2p, timeout=120)
    assert results == [[float((r - 1) % 3)] * 2 for r in range(3)]


def _results_are_device_arrays(comm: Any) -> bool:
    x = ForeignArray.of(np.ones(3, np.int32))
    assert comm.allreduce(x) is x
    g = comm.allgather(x)
    assert type(g) is type(cuda.device_array(1)), type(g)
    assert g.shape == (comm.world_size, 3)
    out = ForeignArray.of(np.zeros(3, np.int32))
    assert comm.allreduce(x, out=out) is out
    r = comm.reduce(x, root=1)
    if comm.rank == 1:
        assert to_host(r).tolist() == [comm.world_size**2] * 3
    else:
        assert r is None
    return True


def test_results_are_device_arrays(pools) -> None:  # type: ignore[no-untyped-def]
    assert pools.get(2).run(_results_are_device_arrays, timeout=60) == [True, True]


# --- failures: each breaks a sub-communicator of its own; the pool's stays healthy -----------------
def _in_sub(comm: Any, scenario: Any) -> str:
    sub = comm.split(color=0)
    try:
        return scenario(sub)
    finally:
        sub.close()
        comm.barrier()


def _mismatch(comm: Any) -> str:
    x = cuda.to_device(np.ones(4, np.float32))
    try:
        if comm.rank == 0:
            comm.allreduce(x)
        else:
            comm.broadcast(x, root=0)
    except shmcoll.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def test_mismatched_calls_fail_on_every_rank(pools) -> None:  # type: ignore[no-untyped-def]
    for msg in pools.get(2).run(_in_sub, _mismatch, timeout=120):
        assert "mismatched" in msg and "allreduce" in msg and "broadcast" in msg, msg


def _timeout(comm: Any) -> str:
    if comm.rank == 1:
        time.sleep(1.5)  # never makes the call
        return "slept"
    x = cuda.to_device(np.ones(4, np.float32))
    start = time.monotonic()
    try:
        comm.allreduce(x, timeout=0.5)
    except shmcoll.CollectiveTimeout:
        return f"timeout after {time.monotonic() - start:.1f}s"
    return "no error"


def test_timeout(pools) -> None:  # type: ignore[no-untyped-def]
    results = pools.get(2).run(_in_sub, _timeout, timeout=120)
    assert results[0].startswith("timeout after") and float(results[0].split()[-1][:-1]) < 5, results


def _device_failure(comm: Any) -> str:
    device.configure(comm, path="ipc", oneshot_bytes=16)  # a second meeting after the kernels
    saved = engine.kernels.reduce
    if comm.rank == 1:

        def broken(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("simulated CUDA failure")

        engine.kernels.reduce = broken
    x = cuda.to_device(np.ones(64, np.float32))
    start = time.monotonic()
    try:
        comm.allreduce(x, timeout=30)
    except shmcoll.ShmcollError as exc:  # (a RuntimeError too: first)
        return f"{type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}"
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        engine.kernels.reduce = saved
    return "no error"


def test_a_failing_rank_aborts_its_peers(pools) -> None:  # type: ignore[no-untyped-def]
    results = pools.get(2).run(_in_sub, _device_failure, timeout=120)
    assert results[1] == "RuntimeError: simulated CUDA failure"
    assert results[0].startswith("CommunicatorBrokenError after"), results[0]
    assert float(results[0].split()[2][:-2]) < 10, results[0]  # not the 30 s timeout
    assert "rank 1: failed" in results[0]


def test_describe_names_the_simulator() -> None:
    assert "simulator" in engine.describe()
