"""The CUDA payload kernels: element-wise reductions of up to four device buffers in one pass.

Imported only when a device array reaches shmcoll (``import shmcoll`` never imports CUDA). The
arithmetic is the CPU kernels' own: every combiner comes from :mod:`shmcoll.kernels.scalar`,
whose ``@overload`` implementations numba-cuda compiles for the device, and which the CUDA
simulator runs as their numpy ufuncs.

Shape of a launch: a grid-stride loop in which each thread owns ``UNROLL`` elements spaced one
block apart (``base, base + blockDim, ...``). Consecutive threads touch consecutive elements, so
every warp-wide load and store is coalesced, and each thread issues all of its loads of an input
before it combines and stores, so ``UNROLL`` independent loads per input are in flight per
thread (memory-level parallelism is what keeps a bandwidth-bound kernel at copy speed). numba
cannot emit 128-bit vector loads for a generic element type; unrolling is the portable substitute.

One launch reads up to ``MAX_INPUTS`` inputs and writes one output (optionally a second, the
``dual`` store that lets a reduce-scatter publish its chunk and keep it in one pass). More inputs
are folded by further launches whose first input is the running result, so the order of
combination is always ``((x0 op x1) op x2) op ...``: fixed, hence bitwise identical on every rank.

Types follow the CPU engine: bool is reduced as uint8 with the logical op's bitwise twin
(:func:`shmcoll.types.engine_types`, applied by the caller), float16 is widened to float32 on
load, accumulated in float32 across launches (a float32 scratch) and rounded once on the final
store; AVG divides once, in the final launch, exactly as ``scalar.divide_count`` does on the CPU.
No fastmath: NaN semantics are numpy's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# numba-cuda up to at least 0.30.4 registers a device overload of ``np.row_stack`` when it compiles
# its first kernel; numpy 2.5 removed that alias of ``np.vstack`` (deprecated since 2.0), so every
# kernel compile there fails with "module 'numpy' has no attribute 'row_stack'" (seen on a GPU
# machine with numpy 2.5.2). Restoring the alias, only where it is missing and only once a device
# array reaches shmcoll, lets the CUDA target load; nothing in numpy's own behaviour changes.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import complex64, complex128, cuda, float32, types  # noqa: E402
from numba.extending import overload  # noqa: E402

from shmcoll.kernels.scalar import (
    AVG,
    BAND,
    BOR,
    BXOR,
    MAX,
    MIN,
    PROD,
    SUM,
    add,
    bit_and,
    bit_or,
    bit_xor,
    divide_count,
    maximum,
    minimum,
    multiply,
)

UNROLL = 4
MAX_INPUTS = 4
THREADS = 256


def _simulating() -> bool:
    try:  # numba-cuda keeps its own copy of numba's config
        from numba.cuda.core import config as cfg
    except ImportError:  # the CUDA target built into numba
        from numba.core import config as cfg
    return bool(getattr(cfg, "ENABLE_CUDASIM", False))


#: Whether numba runs CUDA kernels in its simulator (``NUMBA_ENABLE_CUDASIM=1``): kernels are
#: Python, one thread per simulated CUDA thread, and device memory is host memory.
SIMULATOR = _simulating()


def multiply_rounded(a, b):  # type: ignore[no-untyped-def]
    """``multiply`` whose complex product rounds each partial product before adding it.

    NVVM contracts ``ar * br - ai * bi`` into a fused multiply-add even without fastmath, which
    rounds once instead of twice, so a GPU's complex products differed in the last bit from the
    CPU engine's (numba compiles them unfused; seen on an H200). libdevice's ``*_rn`` products
    are never contracted: with them a step of the fold is the CPU engine's, bit for bit. Real
    types keep ``multiply`` (one product, nothing to contract). This Python form is what
    the simulator runs; ``np.multiply`` would not do, as numpy's complex loops fuse too.
    """
    if isinstance(a, np.complexfloating):
        re = a.real * b.real - a.imag * b.imag  # numpy scalars: each operation rounded on its own
        im = a.real * b.imag + a.imag * b.real
        return a.dtype.type(complex(re, im))
    return multiply(a, b)


@overload(multiply_rounded)
def _multiply_rounded(a, b):  # type: ignore[no-untyped-def]
    from numba.cuda import libdevice

    if a == types.complex64:

        def product64(a, b):  # type: ignore[no-untyped-def]
            re = libdevice.fmul_rn(a.real, b.real) - libdevice.fmul_rn(a.imag, b.imag)
            im = libdevice.fmul_rn(a.real, b.imag) + libdevice.fmul_rn(a.imag, b.real)
            return complex64(complex(re, im))  # exact: both parts are float32 values

        return product64
    if a == types.complex128:

        def product128(a, b):  # type: ignore[no-untyped-def]
            re = libdevice.dmul_rn(a.real, b.real) - libdevice.dmul_rn(a.imag, b.imag)
            im = libdevice.dmul_rn(a.real, b.imag) + libdevice.dmul_rn(a.imag, b.real)
            return complex128(complex(re, im))

        return product128
    return lambda a, b: multiply(a, b)


_COMBINERS = {
    SUM: add,
    AVG: add,
    PROD: multiply_rounded,
    MIN: minimum,
    MAX: maximum,
    BAND: bit_and,
    BOR: bit_or,
    BXOR: bit_xor,
}
_FLOAT16 = np.dtype(np.float16)
_FLOAT32 = np.dtype(np.float32)


@cuda.jit(device=True)
def _same(v):  # type: ignore[no-untyped-def]
    return v


def _build(op: int, half: bool) -> Any:
    """The kernel for one op; ``half``: inputs may be float16 and are combined in float32."""
    comb = _COMBINERS[op]
    wide = float32 if half else _same
    divides = op == AVG

    @cuda.jit(device=True)
    def finish(v, divisor):  # type: ignore[no-untyped-def]
        # AVG's one division, in the final launch only. For float16 the quotient is rounded to
        # float32 first and to float16 by the store, as the CPU path does (it divides into a
        # float32 buffer and converts that).
        if divides and divisor > 0:
            return wide(divide_count(v, divisor))
        return v

    @cuda.jit
    def reduce_kernel(dst, dst2, dual, a, b, c, d, nin, divisor):  # type: ignore[no-untyped-def]
        n = dst.size
        bdim = cuda.blockDim.x
        step = cuda.gridDim.x * bdim * UNROLL
        base = cuda.blockIdx.x * bdim * UNROLL + cuda.threadIdx.x
        while base < n:
            if base + (UNROLL - 1) * bdim < n:
                i1 = base + bdim
                i2 = i1 + bdim
                i3 = i2 + bdim
                v0 = wide(a[base])
                v1 = wide(a[i1])
                v2 = wide(a[i2])
                v3 = wide(a[i3])
                if nin > 1:
                    w0 = wide(b[base])
                    w1 = wide(b[i1])
                    w2 = wide(b[i2])
                    w3 = wide(b[i3])
                    v0 = comb(v0, w0)
                    v1 = comb(v1, w1)
                    v2 = comb(v2, w2)
                    v3 = comb(v3, w3)
                if nin > 2:
                    w0 = wide(c[base])
                    w1 = wide(c[i1])
                    w2 = wide(c[i2])
                    w3 = wide(c[i3])
                    v0 = comb(v0, w0)
                    v1 = comb(v1, w1)
                    v2 = comb(v2, w2)
                    v3 = comb(v3, w3)
                if nin > 3:
                    w0 = wide(d[base])
                    w1 = wide(d[i1])
                    w2 = wide(d[i2])
                    w3 = wide(d[i3])
                    v0 = comb(v0, w0)
                    v1 = comb(v1, w1)
                    v2 = comb(v2, w2)
                    v3 = comb(v3, w3)
                r0 = finish(v0, divisor)
                r1 = finish(v1, divisor)
                r2 = finish(v2, divisor)
                r3 = finish(v3, divisor)
                dst[base] = r0
                dst[i1] = r1
                dst[i2] = r2
                dst[i3] = r3
                if dual:
                    dst2[base] = r0
                    dst2[i1] = r1
                    dst2[i2] = r2
                    dst2[i3] = r3
            else:
                # The grid's last, partial tile: at most UNROLL elements, one at a time.
                i = base
                while i < n:
                    v = wide(a[i])
                    if nin > 1:
                        v = comb(v, wide(b[i]))
                    if nin > 2:
                        v = comb(v, wide(c[i]))
                    if nin > 3:
                        v = comb(v, wide(d[i]))
                    r = finish(v, divisor)
                    dst[i] = r
                    if dual:
                        dst2[i] = r
                    i += bdim
            base += step

    return reduce_kernel


_KERNELS: dict[tuple[int, bool], Any] = {}


def kernel(op: int, half: bool) -> Any:
    """The (lazily built) reduction kernel for engine op ``op``; ``half`` for float16 data."""
    key = (int(op), bool(half))
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = _build(*key)
    return k


def launch_shape(count: int, threads: int | None = None, max_blocks: int | None = None) -> tuple[int, int]:
    """``(blocks, threads)`` for ``count`` elements: enough blocks to cover the data once, capped
    (the grid-stride loop covers the rest) at a few waves of the device's multiprocessors."""
    if threads is None:
        threads = 8 if SIMULATOR else THREADS
    if max_blocks is None:
        if SIMULATOR:
            max_blocks = 2
        else:
            max_blocks = 8 * int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    per_block = threads * UNROLL
    return max(1, min(max_blocks, -(-count // per_block))), threads


def reduce(
    dst: Any,
    srcs: Sequence[Any],
    op: int,
    *,
    divisor: int = 0,
    dst2: Any = None,
    scratch: Any = None,
    stream: Any = 0,
    threads: int | None = None,
    max_blocks: int | None = None,
) -> None:
    """``dst = srcs[0] op srcs[1] op ...`` element-wise on the device, in that order.

    All arrays are 1-d device arrays of one length and of the engine dtype (see
    :func:`shmcoll.types.engine_types`; float16 stays float16 here and is combined in float32).
    ``divisor > 0`` divides the result once (AVG). ``dst2`` receives the same values. ``dst``
    may be ``srcs[0]`` itself but must not overlap any other input. With more than
    ``MAX_INPUTS`` float16 inputs, ``scratch`` (float32, same length) holds the running result.
    The launches are queued on ``stream``; the caller synchronises.
    """
    if not srcs:
        raise ValueError("reduce needs at least one input")
    count = dst.size
    if count == 0:
        return
    half = np.dtype(dst.dtype) == _FLOAT16
    if half and len(srcs) > MAX_INPUTS and (scratch is None or np.dtype(scratch.dtype) != _FLOAT32):
        raise ValueError("float16 reductions of more than MAX_INPUTS inputs need a float32 scratch")
    blocks, nthreads = launch_shape(count, threads, max_blocks)
    k = kernel(op, half)
    acc = scratch if half else dst
    first, rest = list(srcs[:MAX_INPUTS]), list(srcs[MAX_INPUTS:])
    pending = [first]
    while rest:
        take = rest[: MAX_INPUTS - 1]
        rest = rest[MAX_INPUTS - 1 :]
        pending.append(take)
    for n, group in enumerate(pending):
        last = n == len(pending) - 1
        inputs = group if n == 0 else [acc, *group]
        out = dst if last else acc
        pad = inputs + [inputs[-1]] * (MAX_INPUTS - len(inputs))
        second = dst2 if (last and dst2 is not None) else out
        k[blocks, nthreads, stream](
            out, second, last and dst2 is not None, pad[0], pad[1], pad[2], pad[3], len(inputs), divisor if last else 0
        )
