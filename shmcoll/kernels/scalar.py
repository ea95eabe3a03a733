"""One scalar combiner per reduction op, shared by the CPU loops and the CUDA kernels.

Each combiner matches the numpy ufunc element-wise, for every dtype the op is valid for:
``np.add``, ``np.multiply``, ``np.minimum``/``np.maximum`` (a NaN operand wins; otherwise the
left operand on ties, as numpy does) and the bitwise ufuncs. Integer results are stored back
into the buffer's dtype, which wraps around exactly as numpy's arithmetic does.

``divide_count`` is AVG's final step: true division for floating values, each component divided
for complex values, numpy's floor division for integers.

The engine is compiled once per dtype with every op in it, so each combiner must *type* for
every dtype; where the op is not defined for a dtype (bitwise ops on floats, order on complex)
it compiles to a placeholder that ``types.supports`` guarantees is never executed.

Jitted code (the CPU engine, and the CUDA kernels compiled by numba-cuda) uses the overloads
below. Called from plain Python, each combiner runs its numpy ufunc on numpy scalars instead:
that is what the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) executes, since it runs kernels as
Python. The two agree by construction, as the overloads implement the ufuncs' semantics.
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

SUM, PROD, MIN, MAX, AVG, BAND, BOR, BXOR = range(8)


def _python(name: str, ufunc):  # type: ignore[no-untyped-def]
    # A fresh function object per combiner: @overload keys on it.
    def fn(a, b):  # type: ignore[no-untyped-def]
        return ufunc(a, b)

    fn.__name__ = fn.__qualname__ = name
    return fn


def divide_count(value, count):  # type: ignore[no-untyped-def]
    """AVG's final step on a numpy scalar (see the module docstring)."""
    if isinstance(value, np.integer):
        return np.floor_divide(value, value.dtype.type(count))
    if isinstance(value, np.complexfloating):
        return value.dtype.type(complex(value.real / count, value.imag / count))
    return value / count


add = _python("add", np.add)
multiply = _python("multiply", np.multiply)
minimum = _python("minimum", np.minimum)
maximum = _python("maximum", np.maximum)
bit_and = _python("bit_and", np.bitwise_and)
bit_or = _python("bit_or", np.bitwise_or)
bit_xor = _python("bit_xor", np.bitwise_xor)

_ORDERED = (types.Integer, types.Float, types.Boolean)
_BITWISE = (types.Integer, types.Boolean)


def _placeholder(a, b):  # type: ignore[no-untyped-def]
    return a


# For integers the result is cast back to the operands' type at once: numba widens
# ``uint8 + uint8`` to int64, and AVG must divide the *wrapped* sum, as numpy does.
@overload(add)
def _add(a, b):  # type: ignore[no-untyped-def]
    if isinstance(a, types.Integer):
        ty = a
        return lambda a, b: ty(a + b)
    return lambda a, b: a + b


@overload(multiply)
def _multiply(a, b):  # type: ignore[no-untyped-def]
    if isinstance(a, types.Integer):
        ty = a
        return lambda a, b: ty(a * b)
    return lambda a, b: a * b


@overload(minimum)
def _minimum(a, b):  # type: ignore[no-untyped-def]
    if isinstance(a, _ORDERED):
        # (a != a) is "a is NaN"; for integers it folds to False.
        return lambda a, b: a if (a <= b or a != a) else b
    return _placeholder


@overload(maximum)
def _maximum(a, b):  # type: ignore[no-untyped-def]
    if isinstance(a, _ORDERED):
        return lambda a, b: a if (a >= b or a != a) else b
    return _placeholder


@overload(bit_and)
def _bit_and(a, b):  # type: ignore[no-untyped-def]
    return (lambda a, b: a & b) if isinstance(a, _BITWISE) else _placeholder


@overload(bit_or)
def _bit_or(a, b):  # type: ignore[no-untyped-def]
    return (lambda a, b: a | b) if isinstance(a, _BITWISE) else _placeholder


@overload(bit_xor)
def _bit_xor(a, b):  # type: ignore[no-untyped-def]
    return (lambda a, b: a ^ b) if isinstance(a, _BITWISE) else _placeholder


@overload(divide_count)
def _divide_count(value, count):  # type: ignore[no-untyped-def]
    if isinstance(value, types.Integer):
        # count in the value's own type: uint64 // int64 would go through float64 in numba.
        ty = value
        return lambda value, count: value // ty(count)
    if isinstance(value, types.Complex):
        # Each component divided by the real count: correctly rounded, unlike dividing by the
        # complex number (count + 0j), which numpy does and which can be 1 ulp off.
        return lambda value, count: complex(value.real / count, value.imag / count)
    return lambda value, count: value / count
