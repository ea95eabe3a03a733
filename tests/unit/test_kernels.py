"""The payload kernels against numpy's ufuncs, edge values included (NaN, inf, -0.0, wrap)."""

from __future__ import annotations

import bf16ref
import numpy as np
import pytest

from shmcoll.kernels.cpu import combine, copy, narrow_bfloat16, widen_bfloat16
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


# --- bfloat16 conversions -------------------------------------------------------------------------
def _widen(bits: np.ndarray) -> np.ndarray:
    out = np.zeros(bits.size, np.uint32)
    widen_bfloat16(out, 0, bits, 0, bits.size)
    return out.view(np.float32)


def _narrow(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.size, np.uint16)
    narrow_bfloat16(out, 0, np.ascontiguousarray(x, np.float32).view(np.uint32), 0, x.size)
    return out


def test_bfloat16_widens_every_pattern_exactly() -> None:
    bits = np.arange(1 << 16).astype(np.uint16)
    got = _widen(bits)
    want = bf16ref.decode(bits)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert (got[~nan].astype(np.float64) == want[~nan]).all()
    assert (np.signbit(got) == (bits >> 15).astype(bool)).all()  # -0.0 and negative NaNs too
    assert (got.view(np.uint32)[nan] >> 16 == bits[nan]).all()  # NaN payloads are kept
    assert (bf16ref.to_float32(bits.view(np.uint16)).view(np.uint32) == got.view(np.uint32)).all()


# float32 bits -> bfloat16 bits, worked out by hand (and checked against the reference too).
NARROWED = {
    0x3F808000: 0x3F80,  # 1.0 + half an ulp: a tie, 0x3F80 is even
    0x3F818000: 0x3F82,  # a tie above an odd pattern: up to the even one
    0xBF818000: 0xBF82,  # the same, negative (away from zero, to the even one)
    0x3F807FFF: 0x3F80,  # just under a tie: down
    0x3F808001: 0x3F81,  # just over a tie: up
    0x3FFFFFFF: 0x4000,  # the carry runs into the exponent
    0x7F7F7FFF: 0x7F7F,  # the largest bfloat16 stays
    0x7F7F8000: 0x7F80,  # its tie with the next power of two is infinity (0x7F7F is odd)
    0x7F7FFFFF: 0x7F80,  # the largest float32 overflows to infinity
    0xFF7FFFFF: 0xFF80,
    0x7F800000: 0x7F80,  # infinities stay
    0xFF800000: 0xFF80,
    0x00010000: 0x0001,  # the smallest bfloat16 subnormal, exact
    0x00008000: 0x0000,  # a tie between 0 and it: 0
    0x00018000: 0x0002,  # a tie above an odd subnormal
    0x00000001: 0x0000,  # the smallest float32 subnormal rounds to zero
    0x80000001: 0x8000,  # ... keeping its sign
    0x007FFFFF: 0x0080,  # the largest float32 subnormal rounds to the smallest normal
    0x00000000: 0x0000,
    0x80000000: 0x8000,
    0x7FC00000: 0x7FC0,  # the quiet NaN
    0xFFC00000: 0xFFC0,  # x86's default NaN (negative)
    0x7F800001: 0x7FC0,  # a NaN whose payload lies in the dropped half: still a NaN, quiet
    0x7F812345: 0x7FC1,  # a signalling NaN: made quiet, upper payload kept
    0xFFBFFFFF: 0xFFFF,  # no carry out of a NaN into the sign
    0x7FFFFFFF: 0x7FFF,
}


def test_bfloat16_narrows_to_nearest_even() -> None:
    src = np.array(list(NARROWED), np.uint32).view(np.float32)
    want = np.array(list(NARROWED.values()), np.uint16)
    assert [hex(v) for v in _narrow(src)] == [hex(v) for v in want]
    assert [hex(v) for v in bf16ref.round_bits(src)] == [hex(v) for v in want]


def test_bfloat16_narrows_random_values_like_the_reference() -> None:
    rng = np.random.default_rng(5)
    patterns = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    normals = (rng.standard_normal(1 << 18) * 10.0 ** rng.integers(-40, 38, 1 << 18)).astype(np.float32)
    # Ties: random upper halves, dropped half exactly 0x8000 (and either side of it).
    upper = rng.integers(0, 1 << 16, 1 << 16, dtype=np.uint32) << 16
    ties = np.concatenate([upper | 0x8000, upper | 0x7FFF, upper | 0x8001]).view(np.float32)
    for x in (patterns, normals, ties):
        got, want = _narrow(x), bf16ref.round_bits(x)
        bad = np.flatnonzero(got != want)
        assert not bad.size, [
            (hex(b), hex(g), hex(w))
            for b, g, w in zip(x.view(np.uint32)[bad[:5]], got[bad[:5]], want[bad[:5]], strict=True)
        ]


def test_bfloat16_round_trip_and_offsets() -> None:
    bits = np.arange(1 << 16).astype(np.uint16)
    back = _narrow(_widen(bits))
    nan = np.isnan(bf16ref.decode(bits))
    assert (back[~nan] == bits[~nan]).all()
    assert (back[nan] == bits[nan] | 0x40).all()  # a NaN comes back quiet
    wide = np.full(10, 0xDEADBEEF, np.uint32)
    widen_bfloat16(wide, 3, np.array([0x3F80, 0xC000, 0x1234, 0x4049], np.uint16), 1, 2)
    assert [hex(v) for v in wide[2:6]] == ["0xdeadbeef", "0xc0000000", "0x12340000", "0xdeadbeef"]
    narrow = np.full(6, 0xAAAA, np.uint16)
    narrow_bfloat16(narrow, 1, np.array([1.0, 2.0, -3.0], np.float32).view(np.uint32), 1, 2)
    assert [hex(v) for v in narrow[:4]] == ["0xaaaa", "0x4000", "0xc040", "0xaaaa"]
    narrow_bfloat16(narrow, 0, wide, 0, 0)  # nothing to do


def test_bfloat16_conversions_agree_with_torch() -> None:
    """torch rounds float32 to bfloat16 to nearest even too (every NaN to one canonical NaN)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    x = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x[~np.isnan(x)]
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert (_narrow(x) == want).all()
    bits = np.arange(1 << 16).astype(np.uint16)
    wide = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    assert (_widen(bits).view(np.uint32) == wide.view(np.uint32)).all()
