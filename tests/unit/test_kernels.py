"""The payload kernels against numpy's ufuncs, edge values included (NaN, inf, -0.0, wrap)."""

from __future__ import annotations

import numpy as np
import pytest

from shmcoll.kernels.cpu import combine, copy
from shmcoll.types import DTYPES, FOLD_UFUNC, ReduceOp, engine_types, supports


def _edge_values(dt: np.dtype, rng: np.random.Generator, count: int) -> np.ndarray:
    if dt.kind in "iu":
        info = np.iinfo(dt)
        base = rng.integers(info.min, info.max, count, endpoint=True, dtype=dt)
        base[:4] = [info.min, info.max, 0, 1] if dt.kind == "i" else [0, info.max, 1, info.max - 1]
        return base
    v = rng.standard_normal(count).astype(dt)
    if dt.kind == "c":
        v = v + 1j * rng.standard_normal(count).astype(dt)
        v[:3] = [complex(np.inf, 1), complex(np.nan, 0), -0.0]
    else:
        v[:6] = [np.nan, np.inf, -np.inf, -0.0, 0.0, np.nan]
    return v


ENGINE_DTYPES = sorted({engine_types(dt, ReduceOp.SUM)[0] for dt in DTYPES if dt.kind != "b"}, key=str)


@pytest.mark.parametrize("dt", ENGINE_DTYPES, ids=str)
def test_combine_matches_numpy(dt: np.dtype) -> None:
    rng = np.random.default_rng(7)
    n = 67  # odd: exercises the vector loops' remainders
    for op in ReduceOp:
        if not supports(op, dt) or op == ReduceOp.AVG:
            continue
        x, y = _edge_values(dt, rng, n), _edge_values(dt, rng, n)
        y[3:6] = x[3:6][::-1]  # ties and signed zeros on both sides
        want = FOLD_UFUNC[op](x, y)
        got = np.zeros(n + 3, dt)
        other = np.zeros(n + 3, dt)
        combine(got, 3, other, 0, False, x, 0, y, 0, n, int(op), 0)
        if dt.kind == "c" and op == ReduceOp.PROD:
            # numpy may fuse a*c - b*d into one FMA (1 ulp apart); shmcoll never does, so its
            # product is the same on every rank and machine.
            np.testing.assert_allclose(got[3:], want, rtol=4 * np.finfo(dt).eps, err_msg=str(dt))
        else:
            np.testing.assert_array_equal(got[3:], want, err_msg=f"{dt} {op.name}")
            assert got[3:].tobytes() == want.astype(dt).tobytes(), f"{dt} {op.name}: not bitwise equal"
        combine(got, 0, other, 1, True, x, 0, y, 0, n, int(op), 0)
        assert other[1 : n + 1].tobytes() == got[:n].tobytes()


@pytest.mark.parametrize("dt", ENGINE_DTYPES, ids=str)
def test_average_final_division(dt: np.dtype) -> None:
    x = np.arange(-7, 8).astype(dt)
    y = np.arange(0, 15).astype(dt)
    got = np.zeros_like(x)
    combine(got, 0, got, 0, False, x, 0, y, 0, x.size, int(ReduceOp.AVG), 3)
    total = (x + y).astype(dt)
    if dt.kind in "iu":
        want = total // dt.type(3)
    elif dt.kind == "c":
        wide = total.astype(np.complex128)
        want = (wide.real / 3 + 1j * (wide.imag / 3)).astype(dt)
    else:
        want = (total.astype(np.float64) / 3).astype(dt)
    np.testing.assert_array_equal(got, want)


def test_copy_single_and_dual() -> None:
    src = np.arange(100, dtype=np.uint8)
    a = np.zeros(100, np.uint8)
    b = np.zeros(100, np.uint8)
    copy(a, 10, b, 20, True, src, 5, 50)
    assert (a[10:60] == src[5:55]).all() and (b[20:70] == src[5:55]).all()
    assert not a[:10].any() and not a[60:].any()


@pytest.mark.parametrize("dt", [np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.complex128)], ids=str)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX])
def test_combine_in_place_every_aliasing(dt: np.dtype, op: ReduceOp) -> None:
    """In place, a destination is one of the operands (SUM and AVG take their own loops then):
    every such aliasing, and a destination that overlaps an operand at another offset (the
    general loop), give bitwise what the kernel gives on copies (checked against numpy above)."""
    if not supports(op, dt):
        pytest.skip(f"{op.name} is not defined for {dt}")
    rng = np.random.default_rng(11)
    n, divisor = 67, (3 if op == ReduceOp.AVG else 0)
    base = _edge_values(dt, rng, n + 8) if op != ReduceOp.AVG else np.arange(n + 8).astype(dt)
    other = _edge_values(dt, rng, n + 8) if op != ReduceOp.AVG else np.arange(n + 8)[::-1].astype(dt)

    def want(left: np.ndarray, right: np.ndarray) -> np.ndarray:
        out = np.zeros(n + 3, dt)
        combine(out, 0, out, 0, False, left.copy(), 4, right.copy(), 4, n, int(op), divisor)
        return out[:n]

    cases = {  # name: (dst is, dst2 is, left operand, right operand)
        "dst is the right operand": ("own", "slot", other, "own"),
        "dst is the left operand": ("own", "slot", "own", other),
        "dst2 is the right operand": ("slot", "own", other, "own"),
        "dst2 is the left operand": ("slot", "own", "own", other),
    }
    for name, (dst, dst2, left, right) in cases.items():
        own, slot = base.copy(), np.zeros(n + 8, dt)
        arrays = {"own": own, "slot": slot}
        lhs = own if isinstance(left, str) else left
        rhs = own if isinstance(right, str) else right
        expected = want(base if isinstance(left, str) else left, base if isinstance(right, str) else right)
        for dual in (False, True):
            own[:], slot[:] = base, 0
            combine(arrays[dst], 4, arrays[dst2], 4, dual, lhs, 4, rhs, 4, n, int(op), divisor)
            first = arrays[dst][4 : 4 + n]
            assert first.tobytes() == expected.tobytes(), f"{name}, dual={dual}"
            if dual:
                assert arrays[dst2][4 : 4 + n].tobytes() == expected.tobytes(), name
    # an overlap at another offset is not an alias: the general loop, element by element in order
    own = base.copy()
    combine(own, 5, own, 5, False, own, 4, other, 4, n, int(op), divisor)
    ref = base.copy()
    for i in range(n):
        one = np.zeros(1, dt)
        combine(
            one, 0, one, 0, False, ref[4 + i : 5 + i].copy(), 0, other[4 + i : 5 + i].copy(), 0, 1, int(op), divisor
        )
        ref[5 + i] = one[0]
    assert own.tobytes() == ref.tobytes()
