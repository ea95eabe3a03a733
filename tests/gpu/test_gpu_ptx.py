"""Every (dtype, op) reduction kernel compiles for a real GPU (PTX for sm_80), without one.

numba-cuda compiles a kernel to PTX with NVVM alone, but it asks the driver for the current
device's compute capability when it compiles the device functions a kernel calls (the shared
scalar combiners among them); the test answers that question with sm_80 instead. Needs
numba-cuda with its NVVM (``pip install 'numba-cuda[cu12]'``); skips otherwise. Marked slow:
about 100 compilations, minutes on two cores.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.slow


def test_every_kernel_compiles_to_ptx(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("the simulator compiles nothing")
    cuda = pytest.importorskip("numba.cuda")
    if getattr(cuda, "implementation", "") != "NVIDIA":
        pytest.skip("needs numba-cuda (numba's built-in CUDA target is not what shmcoll[cuda] installs)")
    from numba import types
    from numba.cuda import dispatcher
    from numba.np import numpy_support

    class _SM80:
        compute_capability = (8, 0)

    monkeypatch.setattr(dispatcher, "get_current_device", lambda: _SM80())
    from shmcoll.kernels import cuda as kernels
    from shmcoll.types import BFLOAT16, DTYPES, FLOAT16, ReduceOp, engine_types, supports

    kernel_dtypes = [dt for dt in DTYPES if dt != BFLOAT16]  # device arrays of bfloat16 are refused

    try:
        cuda.compile_ptx(lambda a: None, (types.float32[::1],), cc=(8, 0))
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"NVVM is not usable here: {type(exc).__name__}: {str(exc)[:200]}")
    compiled = 0
    for dtype in kernel_dtypes:
        for op in ReduceOp:
            if not supports(op, dtype):
                continue
            edt, eop = engine_types(dtype, op)
            half = dtype == FLOAT16
            arr = numpy_support.from_dtype(np.dtype(np.float16) if half else edt)[::1]
            rest = (arr, arr, arr, types.int64, types.int64)
            sigs = [(arr, arr, types.boolean, arr, *rest)]
            if half:  # the float32 running result: written by a first launch, read by the next
                f32 = types.float32[::1]
                sigs += [(f32, f32, types.boolean, arr, *rest), (arr, arr, types.boolean, f32, *rest)]
            for sig in sigs:
                ptx, _ = cuda.compile_ptx(kernels.kernel(eop, half).py_func, sig, cc=(8, 0))
                assert ".entry" in ptx
                # No fused multiply-add: NVVM contracts a complex product's ``ar*br - ai*bi``
                # unless each product is rounded on its own, and the result then differs from
                # numpy's in the last bit.
                assert "fma." not in ptx, f"{dtype} {op.name}: the kernel fuses a multiply-add"
            compiled += 1
    assert compiled == sum(supports(op, dt) for dt in kernel_dtypes for op in ReduceOp)
