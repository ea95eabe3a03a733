"""bfloat16 in pure numpy, written from the format's definition: the reference that shmcoll's
conversion kernels (``shmcoll.kernels.cpu``) and its bfloat16 collectives are checked against.

It shares no arithmetic with the kernels: values are decoded from sign, exponent and fraction,
and rounding is done in float64, where scaling by a power of two is exact and ``np.rint`` rounds
half to even. Arrays of bfloat16 are arrays of :data:`shmcoll.types.BFLOAT16`.
"""

from __future__ import annotations

import numpy as np

from shmcoll.types import BFLOAT16

_MIN_EXP = -125  # frexp's exponent of the smallest normal bfloat16 (2**-126 = 0.5 * 2**-125)
_FRACTION_BITS = 7


def decode(bits: np.ndarray) -> np.ndarray:
    """The float64 value of each bfloat16 bit pattern (uint16); NaN for every NaN."""
    b = bits.astype(np.int64)
    sign = np.where(b >> 15, -1.0, 1.0)
    exponent = (b >> 7) & 0xFF
    fraction = (b & 0x7F).astype(np.float64)
    normal = np.ldexp(1.0 + fraction / 128, exponent - 127)
    subnormal = np.ldexp(fraction, -133)  # 2**-126 * fraction / 128
    special = np.where(fraction == 0, np.inf, np.nan)
    value = np.where(exponent == 0, subnormal, np.where(exponent == 0xFF, special, normal))
    return sign * value


def to_float32(a: np.ndarray) -> np.ndarray:
    """bfloat16 array -> float32 array (exact; a NaN keeps its payload: it is the upper half)."""
    bits = a.view(np.uint16)
    wide = decode(bits).astype(np.float32)
    nan = np.isnan(wide)
    wide_bits = wide.view(np.uint32)
    wide_bits[nan] = bits[nan].astype(np.uint32) << 16
    return wide


def round_bits(x: np.ndarray) -> np.ndarray:
    """float32 array -> bfloat16 bit patterns (uint16), rounded to nearest, ties to even; a NaN
    keeps its sign and upper payload bits, made quiet."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):  # (signalling NaNs among the inputs)
        wide = x.astype(np.float64)
        finite = np.isfinite(wide)
        _, exp = np.frexp(np.where(finite, wide, 1.0))
        ulp = np.ldexp(1.0, np.maximum(exp, _MIN_EXP) - 1 - _FRACTION_BITS)
        rounded = np.rint(wide / ulp) * ulp  # exact: ulp is a power of two
    rounded = np.where(finite, rounded, wide)
    # Beyond the largest bfloat16 (and at its tie with the next power of two) lies infinity.
    rounded = np.where(np.abs(rounded) >= 2.0**128, np.copysign(np.inf, wide), rounded)
    out = (rounded.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    out[nan] = (x.view(np.uint32)[nan] >> 16).astype(np.uint16) | 0x40
    return out


def from_float32(x: np.ndarray) -> np.ndarray:
    """float32 (or anything numpy casts to it) -> bfloat16 array, rounded as :func:`round_bits`."""
    return round_bits(np.asarray(x, np.float32)).view(BFLOAT16)
