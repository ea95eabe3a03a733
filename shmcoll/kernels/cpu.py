"""The CPU payload kernels: every byte a collective moves or combines passes through here.

All kernels take ``(array, element offset)`` pairs and slice first, then loop from zero: with
non-negative indices into fresh slices LLVM drops the bounds/wraparound checks and vectorizes
(indexing ``a[off + i]`` directly measured 10x slower). Explicit loops also beat numba's slice
assignment, which does not become a memcpy; a plain copy of 256 bytes or more calls libc's
memmove instead (``atomics.move_bytes``), which no loop here matches at large sizes.

``dual`` kernels write the same values to two destinations in one pass: a ring step that
reduces a segment both stores it in the output and forwards it to the next rank, so the
segment is read once and never re-read from the output (that re-read would cost DRAM traffic
at large sizes). The ``dual`` test is loop-invariant; LLVM unswitches it out of the loop.

Reductions are serial and never use fastmath: fastmath would let LLVM reassociate and drop
NaN semantics, and results must be bitwise identical on every rank.

bfloat16 reductions run on float32 copies (numpy has no bfloat16 to cast with):
:func:`widen_bfloat16` and :func:`narrow_bfloat16` convert at the call's boundaries, on integer
views of both buffers (uint16 for bfloat16, uint32 for float32), so that the rounding is exactly
the one written here and never a compiler's or a platform's.
"""

from __future__ import annotations

from shmcoll.jit import jit
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
from shmcoll.shm.atomics import move_bytes

# A single copy from this many bytes is libc's memmove (see ``atomics.move_bytes``); below it the
# inline loop saves the call.
_MOVE_FROM_BYTES = 256


@jit
def copy(dst, doff, dst2, d2off, dual, src, soff, count):  # type: ignore[no-untyped-def]
    """``dst[doff:+count] = src[soff:+count]`` (and the same into ``dst2`` when ``dual``)."""
    d = dst[doff : doff + count]
    s = src[soff : soff + count]
    if dual:
        d2 = dst2[d2off : d2off + count]
        for i in range(count):
            v = s[i]
            d[i] = v
            d2[i] = v
    elif count * s.itemsize >= _MOVE_FROM_BYTES:
        move_bytes(d.ctypes.data, s.ctypes.data, count * s.itemsize)
    else:
        for i in range(count):
            d[i] = s[i]


@jit(inline="always")
def _sum_loops(d, d2, dual, a, b, count, op, divisor):  # type: ignore[no-untyped-def]
    """SUM and AVG's loops, inlined into each of :func:`combine`'s call sites (one per aliasing)."""
    if op == SUM or divisor <= 0:
        if dual:
            for i in range(count):
                v = add(a[i], b[i])
                d[i] = v
                d2[i] = v
        else:
            for i in range(count):
                d[i] = add(a[i], b[i])
    elif dual:
        for i in range(count):
            v = divide_count(add(a[i], b[i]), divisor)
            d[i] = v
            d2[i] = v
    else:
        for i in range(count):
            d[i] = divide_count(add(a[i], b[i]), divisor)


@jit
def combine(dst, doff, dst2, d2off, dual, x, xoff, y, yoff, count, op, divisor):  # type: ignore[no-untyped-def]
    """``dst = x (op) y`` element-wise over ``count`` elements, ``x`` on the left.

    ``divisor > 0`` marks AVG's final combination: the sum is divided by it (once, here).

    In place, ``dst`` or ``dst2`` *is* one of the operands. LLVM cannot know that: it checks at
    run time whether the arrays overlap, finds that they do and falls back to its scalar loop
    (2.3x slower on 1 MiB of float32). So for SUM and AVG, the ops of gradient averaging, an
    operand that is a destination is passed as that destination array itself: one pointer,
    nothing to check, and the inlined loops vectorize. (Doing the same for every op tripled the engine's compile
    time; the other ops stay correct in place, only slower.)
    """
    d = dst[doff : doff + count]
    d2 = dst2[d2off : d2off + count]
    a = x[xoff : xoff + count]
    b = y[yoff : yoff + count]
    if op in (SUM, AVG):
        if count > 0 and d.ctypes.data == b.ctypes.data:
            _sum_loops(d, d2, dual, a, d, count, op, divisor)
        elif count > 0 and d.ctypes.data == a.ctypes.data:
            _sum_loops(d, d2, dual, d, b, count, op, divisor)
        # A ring step in place: the slot is ``dst``, the output (= this rank's input) ``dst2``.
        elif count > 0 and dual and d2.ctypes.data == b.ctypes.data:
            _sum_loops(d, d2, True, a, d2, count, op, divisor)
        elif count > 0 and dual and d2.ctypes.data == a.ctypes.data:
            _sum_loops(d, d2, True, d2, b, count, op, divisor)
        else:
            _sum_loops(d, d2, dual, a, b, count, op, divisor)
    elif op == PROD:
        if dual:
            for i in range(count):
                v = multiply(a[i], b[i])
                d[i] = v
                d2[i] = v
        else:
            for i in range(count):
                d[i] = multiply(a[i], b[i])
    elif op == MIN:
        if dual:
            for i in range(count):
                v = minimum(a[i], b[i])
                d[i] = v
                d2[i] = v
        else:
            for i in range(count):
                d[i] = minimum(a[i], b[i])
    elif op == MAX:
        if dual:
            for i in range(count):
                v = maximum(a[i], b[i])
                d[i] = v
                d2[i] = v
        else:
            for i in range(count):
                d[i] = maximum(a[i], b[i])
    elif op == BAND:
        if dual:
            for i in range(count):
                v = bit_and(a[i], b[i])
                d[i] = v
                d2[i] = v
        else:
            for i in range(count):
                d[i] = bit_and(a[i], b[i])
    elif op == BOR:
        if dual:
            for i in range(count):
                v = bit_or(a[i], b[i])
                d[i] = v
                d2[i] = v
        else:
            for i in range(count):
                d[i] = bit_or(a[i], b[i])
    elif op == BXOR:
        if dual:
            for i in range(count):
                v = bit_xor(a[i], b[i])
                d[i] = v
                d2[i] = v
        else:
            for i in range(count):
                d[i] = bit_xor(a[i], b[i])


@jit
def widen_bfloat16(dst, doff, src, soff, count):  # type: ignore[no-untyped-def]
    """bfloat16 to float32, exact: ``dst`` (float32 as uint32) gets each ``src`` (uint16) value's
    16 bits as its upper half, NaN payloads included."""
    d = dst[doff : doff + count]
    s = src[soff : soff + count]
    for i in range(count):
        d[i] = s[i] << 16


@jit
def narrow_bfloat16(dst, doff, src, soff, count):  # type: ignore[no-untyped-def]
    """float32 to bfloat16, rounded to nearest, ties to even: ``dst`` (uint16) gets the upper
    half of each ``src`` (float32 as uint32) value after rounding.

    Adding ``0x7FFF`` plus the kept part's lowest bit carries into the upper half exactly when
    the dropped half is above one half, or is one half and the kept part is odd. The carry runs
    on through the exponent as it should: the largest values round to infinity, subnormals to
    the smallest normal or to zero (with their sign), and an infinity (dropped half zero) stays
    one. A NaN would carry into infinity, so it keeps its upper half, made quiet (bit 0x40): a
    NaN whose payload is all in the dropped half stays a NaN.
    """
    d = dst[doff : doff + count]
    s = src[soff : soff + count]
    for i in range(count):
        bits = s[i]
        if bits & 0x7FFFFFFF > 0x7F800000:
            d[i] = (bits >> 16) | 0x40
        else:
            d[i] = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
