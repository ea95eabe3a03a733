"""The CUDA reduction kernels under the simulator, against numpy: every dtype x op, one to six
inputs (six: more than one launch), the grid-stride loop and its partial tiles, dual stores."""

from __future__ import annotations

import numpy as np
import pytest
from device_checks import assert_same, check_kernels_for, kernel_data, ordered_reference, run_kernel
from numba import cuda

from shmcoll import ReduceOp
from shmcoll.kernels import cuda as kernels
from shmcoll.types import BFLOAT16, DTYPES

KERNEL_DTYPES = [dt for dt in DTYPES if dt != BFLOAT16]  # device arrays of bfloat16 are refused

# 4 threads x 2 blocks x UNROLL 4 = 32 elements per sweep of the grid: 75 elements take three
# sweeps, the last one a partial tile.
LAUNCH = {"threads": 4, "max_blocks": 2}


def test_simulator_is_on() -> None:
    assert kernels.SIMULATOR


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=[d.name for d in KERNEL_DTYPES])
def test_every_op_matches_numpy(dtype: np.dtype) -> None:
    assert check_kernels_for(dtype, 75, (1, 2, 3, 6), **LAUNCH) > 0


@pytest.mark.parametrize("count", [0, 1, 3, 4, 31, 32, 33, 96, 97])
def test_grid_stride_covers_every_element(count: int) -> None:
    xs = kernel_data(np.dtype(np.int32), ReduceOp.SUM, 3, count, "int", count)
    got = run_kernel(xs, ReduceOp.SUM, divide=False, **LAUNCH)
    assert_same(got, ordered_reference(xs, ReduceOp.SUM), f"count={count}")


def test_dual_store_and_in_place() -> None:
    xs = [np.arange(50, dtype=np.float64) * (k + 1) for k in range(3)]
    a, b, c = (cuda.to_device(x) for x in xs)
    dst2 = cuda.device_array(50, dtype=np.float64)
    kernels.reduce(a, [a, b, c], int(ReduceOp.SUM), dst2=dst2, **LAUNCH)  # dst is srcs[0]
    want = xs[0] + xs[1] + xs[2]
    np.testing.assert_array_equal(a.copy_to_host(), want)
    np.testing.assert_array_equal(dst2.copy_to_host(), want)


def test_float16_accumulates_in_float32_across_launches() -> None:
    # Summed in float16, 2048 + 1 rounds back to 2048 at every step; summed in float32 (over two
    # launches: eight inputs) it is 2055, which rounds once to 2056.
    xs = [np.full(8, 2048, np.float16)] + [np.ones(8, np.float16)] * 7
    got = run_kernel(xs, ReduceOp.SUM, divide=False, **LAUNCH)
    assert got.tolist() == [2056.0] * 8


def test_float16_without_scratch_is_refused() -> None:
    srcs = [cuda.to_device(np.ones(4, np.float16)) for _ in range(kernels.MAX_INPUTS + 1)]
    with pytest.raises(ValueError, match="scratch"):
        kernels.reduce(cuda.device_array(4, np.float16), srcs, int(ReduceOp.SUM))


def test_launch_shape() -> None:
    assert kernels.launch_shape(0, 256, 10) == (1, 256)
    assert kernels.launch_shape(1024, 256, 10) == (1, 256)
    assert kernels.launch_shape(1025, 256, 10) == (2, 256)
    assert kernels.launch_shape(10**9, 256, 10) == (10, 256)
