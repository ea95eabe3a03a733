"""On a real CUDA GPU: CuPy arrays and torch CUDA tensors through the Communicator's methods.

Marked ``gpu`` (deselected by default); skips without a usable GPU, CuPy or torch with CUDA.
Each rank checks its results against numpy; the test checks they are identical on every rank.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import pytest

import shmcoll
from shmcoll import ReduceOp

pytestmark = pytest.mark.gpu


def _usable() -> None:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("real-GPU tests do not run under the CUDA simulator")
    cuda = pytest.importorskip("numba.cuda")
    if not cuda.is_available():
        pytest.skip("no usable CUDA GPU")
    pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")


def _libraries(comm: Any) -> list[tuple[Any, ...]]:
    import cupy
    import torch

    out = []
    r, n = comm.rank, comm.world_size
    for lib in ("cupy", "torch"):
        for count in (0, 1, 1001, 1 << 20):

            def ar(k: int, count: int = count) -> np.ndarray:
                return np.arange(count, dtype=np.float32) + k

            if lib == "cupy":
                dev, host = cupy.asarray, lambda a: cupy.asnumpy(cupy.asarray(a))
                empty = lambda count=count: cupy.empty((count,), cupy.float32)  # noqa: E731
            else:
                dev = lambda a: torch.as_tensor(a, device="cuda")  # noqa: E731
                host = lambda a: torch.as_tensor(a, device="cuda").cpu().numpy()  # noqa: E731
                empty = lambda count=count: torch.empty((count,), dtype=torch.float32, device="cuda")  # noqa: E731
            x = dev(ar(r))
            y = comm.allreduce(x)
            ok_sum = y is x and np.array_equal(host(y), sum(ar(k) for k in range(n)) if count else ar(0))
            o = empty()
            comm.allreduce(dev(ar(r)), op=ReduceOp.MAX, out=o)
            ok_max = np.array_equal(host(o), ar(n - 1))
            g = comm.allgather(dev(ar(r)))  # a new numba device array: both libraries wrap it
            ok_gather = np.array_equal(host(g).reshape(n, count), np.stack([ar(k) for k in range(n)]))
            b = dev(ar(r))
            comm.broadcast(b, root=n - 1)
            ok_bcast = np.array_equal(host(b), ar(n - 1))
            digest = hashlib.sha1(host(y).tobytes()).hexdigest()
            out.append((lib, count, ok_sum, ok_max, ok_gather, ok_bcast, digest))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_cupy_and_torch_arrays(world_size: int) -> None:
    _usable()
    results = shmcoll.spawn(_libraries, nprocs=world_size, timeout=300)
    wrong = [row[:6] for rank in results for row in rank if not all(row[2:6])]
    assert not wrong, f"(library, count, sum, max, allgather, broadcast) wrong: {wrong}"
    for i, row in enumerate(results[0]):
        assert {results[k][i][6] for k in range(world_size)} == {row[6]}, f"{row[:2]}: results differ across ranks"
