"""Reduction ops, the dtype table and which (op, dtype) pairs are valid.

Reductions follow numpy's element-wise ufuncs: SUM is ``np.add``, PROD ``np.multiply``, MIN
``np.minimum`` and MAX ``np.maximum`` (NaN propagates), BAND/BOR/BXOR the bitwise ufuncs. AVG is
SUM divided by the world size once, by whichever rank finishes each element: true division for
floating dtypes, each component divided for complex ones (correctly rounded; numpy's division by
a complex ``n + 0j`` can be 1 ulp off), numpy's floor division (``//``) of the wrapped sum for
integers.
Integers wrap around as numpy's do. float16 and bfloat16 are reduced in float32 and rounded once
at the end (to nearest, ties to even).

bfloat16 (:data:`BFLOAT16`) has no numpy dtype: its values are 2-byte patterns in a one-field
structured dtype, which numpy moves but cannot compute with, so :func:`valid_ops`,
:func:`identity` and :func:`dtype_str` know it by name, and the conversions to and from float32
are kernels (``shmcoll.kernels.cpu``), not numpy casts.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np


class ReduceOp(enum.IntEnum):
    """How a reduction combines the ranks' elements."""

    SUM = 0
    PROD = 1
    MIN = 2
    MAX = 3
    AVG = 4
    BAND = 5
    BOR = 6
    BXOR = 7


# The numpy ufunc each op folds elements with (AVG folds with add, then divides once): the
# reference the kernels must match, and what checks (bench's #wrong, the tests) compute with.
FOLD_UFUNC: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}

FLOAT16 = np.dtype(np.float16)
# bfloat16 has no numpy dtype; shmcoll marks its 2-byte values (torch.bfloat16 tensors, seen as
# numpy arrays) with a one-field structured dtype, distinct from every numeric dtype.
BFLOAT16 = np.dtype([("bfloat16", "<u2")])
FLOAT32 = np.dtype(np.float32)
UINT8 = np.dtype(np.uint8)
BOOL = np.dtype(np.bool_)

# The dtype table: code (used in call signatures, point-to-point headers) -> dtype. Codes never
# change: a new dtype goes at the end.
DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t)
    for t in (
        np.bool_,
        np.int8,
        np.uint8,
        np.int16,
        np.uint16,
        np.int32,
        np.uint32,
        np.int64,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
        BFLOAT16,
    )
)
DTYPE_CODE: dict[np.dtype, int] = {dt: code for code, dt in enumerate(DTYPES)}

_ALL_OPS = frozenset(ReduceOp)
_ARITH = frozenset({ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG})
_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})


def valid_ops(dtype: np.dtype) -> frozenset[ReduceOp]:
    """The reduction ops defined for ``dtype`` (empty for dtypes shmcoll cannot reduce)."""
    if dtype == BFLOAT16:  # (a structured dtype to numpy: its kind says nothing)
        return _ARITH
    kind = dtype.kind
    if kind == "b":
        return _ALL_OPS - {ReduceOp.AVG}
    if kind in "iu":
        return _ALL_OPS
    if kind == "f":
        return _ARITH
    if kind == "c":
        return frozenset({ReduceOp.SUM, ReduceOp.PROD, ReduceOp.AVG})
    return frozenset()


def supports(op: ReduceOp | int, dtype: np.dtype | type) -> bool:
    """Whether ``op`` is a valid reduction for ``dtype``."""
    dt = np.dtype(dtype)
    return dt in DTYPE_CODE and ReduceOp(op) in valid_ops(dt)


# bool is reduced as uint8 0/1 values, where numpy's logical meaning of each op is a bitwise one.
_BOOL_AS_UINT8 = {
    ReduceOp.SUM: ReduceOp.BOR,
    ReduceOp.PROD: ReduceOp.BAND,
    ReduceOp.MIN: ReduceOp.BAND,
    ReduceOp.MAX: ReduceOp.BOR,
    ReduceOp.BAND: ReduceOp.BAND,
    ReduceOp.BOR: ReduceOp.BOR,
    ReduceOp.BXOR: ReduceOp.BXOR,
}


def engine_types(dtype: np.dtype, op: ReduceOp) -> tuple[np.dtype, ReduceOp]:
    """The dtype the engine reduces in and the op it applies, for a user's (dtype, op).

    bool runs as uint8 with the logical op's bitwise twin; float16 and bfloat16 run in float32
    (the caller converts at the boundaries); every other dtype runs as itself.
    """
    if dtype == BOOL:
        return UINT8, _BOOL_AS_UINT8[op]
    if dtype in (FLOAT16, BFLOAT16):
        return FLOAT32, op
    return dtype, op


def dtype_str(dtype: np.dtype) -> str:
    """How messages name ``dtype``: ``bfloat16`` for :data:`BFLOAT16` (numpy would print its
    structured form), numpy's own string otherwise (``float32``, ``>f4``)."""
    return "bfloat16" if dtype == BFLOAT16 else str(dtype)


def dtype_name(code: int) -> str:
    """The name of the dtype with table code ``code`` (a signature's or a message header's)."""
    return dtype_str(DTYPES[code]) if 0 <= code < len(DTYPES) else f"dtype#{code}"


def as_dtype(spec: Any) -> np.dtype:
    """A dtype from what a user may write for one: ``"bfloat16"`` is :data:`BFLOAT16`; anything
    else goes through ``np.dtype``."""
    return BFLOAT16 if isinstance(spec, str) and spec == "bfloat16" else np.dtype(spec)


# bfloat16's identities as bits: 0, 1.0, +inf, -inf.
_BFLOAT16_IDENTITY = {ReduceOp.SUM: 0x0000, ReduceOp.PROD: 0x3F80, ReduceOp.MIN: 0x7F80, ReduceOp.MAX: 0xFF80}


def identity(op: ReduceOp, dtype: np.dtype) -> Any:
    """The value ``v`` with ``v (op) x == x`` for every ``x`` of ``dtype`` (exscan's rank 0 result).

    A scalar of ``dtype``, or for bfloat16 (no numpy scalar type) a 0-d array of it: assign it
    with ``a[...] = v``.
    """
    if dtype == BFLOAT16:
        if op not in _BFLOAT16_IDENTITY:
            raise ValueError(f"{op.name} has no identity for bfloat16")
        return np.array(_BFLOAT16_IDENTITY[op], np.uint16).view(BFLOAT16)
    if op in (ReduceOp.SUM, ReduceOp.BOR, ReduceOp.BXOR):
        return dtype.type(0)
    if op == ReduceOp.PROD:
        return dtype.type(1)
    if op == ReduceOp.BAND:
        return np.ones((), dtype=dtype) if dtype.kind == "b" else ~dtype.type(0)
    if dtype.kind == "b":
        return op == ReduceOp.MIN  # MIN is logical and (identity True), MAX logical or (False)
    if dtype.kind == "f":
        return dtype.type(np.inf if op == ReduceOp.MIN else -np.inf)
    if dtype.kind == "c":
        raise ValueError(f"{op.name} has no identity for {dtype}")
    info = np.iinfo(dtype)
    return dtype.type(info.max if op == ReduceOp.MIN else info.min)
