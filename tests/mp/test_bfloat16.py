"""bfloat16 through the collectives and point to point: reductions in float32, rounded once to
nearest even (against the pure-numpy reference of tests/bf16ref.py), data moved as bits, every
result bitwise identical on the ranks that share it.

Inputs are bfloat16 values with exponents in [-6, 3] (with signed zeros, infinities and a NaN at
fixed places): every float32 sum of up to three of them, and every product, is exact, so any
association an algorithm picks gives the reference's float32 result (numpy's fold in rank
order, what the float16 cases compare against too), and the test sees only the rounding.
"""

from __future__ import annotations

import hashlib

import bf16ref
import numpy as np
import pytest
from cases import reduce_ref

from shmcoll import ReduceOp, UnsupportedError
from shmcoll.types import BFLOAT16

SEED = 20260611
SIZES = (0, 1, 1001, 100_003)  # 100_003: more than one 64 KiB slot, as float32 and as bits


def _inputs(rank: int, count: int, tag: int) -> np.ndarray:
    """Rank ``rank``'s ``count`` bfloat16 values (see the module docstring)."""
    rng = np.random.default_rng([SEED, rank, count, tag])
    fraction = rng.integers(0, 128, count)
    values = (1 + fraction / 128) * 2.0 ** rng.integers(-6, 4, count) * rng.choice([-1.0, 1.0], count)
    values[rng.random(count) < 0.01] = 0.0
    specials = [-0.0, np.inf, -np.inf if rank == 1 else np.inf, np.nan if rank == 0 else 1.0]
    values[: min(count, 4)] = specials[: min(count, 4)]
    return bf16ref.from_float32(values)


def _check(got: np.ndarray | None, want: np.ndarray, what: str) -> str:
    """Bit for bit where the reference is a number, NaN where it is NaN; returns a digest."""
    assert got is not None, f"{what}: got None"
    assert got.dtype == BFLOAT16, f"{what}: dtype {got.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    got_bits, want_bits = got.reshape(-1).view(np.uint16), want.reshape(-1).view(np.uint16)
    nan = np.isnan(bf16ref.decode(want_bits))
    assert (np.isnan(bf16ref.decode(got_bits)) == nan).all(), f"{what}: NaNs differ"
    bad = np.flatnonzero((got_bits != want_bits) & ~nan)
    assert not bad.size, (
        f"{what}: {bad.size} elements differ, first at {bad[0]}: {got_bits[bad[0]]:#x} != {want_bits[bad[0]]:#x}"
    )
    return hashlib.sha1(got.tobytes()).hexdigest()


def _collectives(comm, count):  # type: ignore[no-untyped-def]
    """Every kind of call on ``count`` elements per rank; returns {what: digest} of results that
    every rank holds alike."""
    n, r = comm.world_size, comm.rank
    same: dict[str, str] = {}
    xs = [_inputs(j, count, 0) for j in range(n)]
    stacked = np.stack(xs)
    x = xs[r]

    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.PROD):
        want = reduce_ref(op, stacked, n)
        got = comm.allreduce(x, op, out=np.empty_like(x))
        same[f"allreduce {op.name}"] = _check(got, want, f"allreduce {op.name}")
    assert x.tobytes() == xs[r].tobytes(), "allreduce wrote into its input"
    want = reduce_ref(ReduceOp.SUM, stacked, n)
    mine = x.copy()
    assert comm.allreduce(mine) is mine  # in place
    same["allreduce in place"] = _check(mine, want, "allreduce in place")
    if count % 2 == 0:
        got = comm.allreduce(x.copy().reshape(-1, 2) if count else x.copy(), ReduceOp.SUM)
        same["allreduce 2-d"] = _check(got.reshape(-1), want, "allreduce 2-d")
    readonly = x.copy()
    readonly.flags.writeable = False
    got = comm.allreduce(readonly, out=np.empty_like(x))
    same["allreduce read-only"] = _check(got, want, "allreduce of a read-only input")
    got = comm.iallreduce(x, ReduceOp.AVG, out=np.empty_like(x)).wait()
    same["iallreduce AVG"] = _check(got, reduce_ref(ReduceOp.AVG, stacked, n), "iallreduce AVG")

    root = n - 1
    got = comm.reduce(x, root, ReduceOp.SUM)
    if r == root:
        _check(got, want, "reduce")
    else:
        assert got is None

    blocks = [_inputs(j, n * count, 1) for j in range(n)]
    full = reduce_ref(ReduceOp.SUM, np.stack(blocks), n)
    _check(comm.reduce_scatter(blocks[r].copy(), ReduceOp.SUM), full[r * count : (r + 1) * count], "reduce_scatter")
    counts = [(count + j) % (count + 2) for j in range(n)]
    uneven = [_inputs(j, sum(counts), 2) for j in range(n)]
    at = sum(counts[:r])
    _check(
        comm.reduce_scatter(uneven[r].copy(), ReduceOp.MAX, counts),
        reduce_ref(ReduceOp.MAX, np.stack(uneven), n)[at : at + counts[r]],
        "reduce_scatterv",
    )

    _check(comm.scan(x.copy(), ReduceOp.SUM), reduce_ref(ReduceOp.SUM, stacked[: r + 1], r + 1), "scan SUM")
    for op, bits in ((ReduceOp.MAX, 0xFF80), (ReduceOp.SUM, 0x0000)):  # rank 0 gets -inf, 0.0
        want_ex = reduce_ref(op, stacked[:r], r) if r else np.full(count, bits, np.uint16).view(BFLOAT16)
        _check(comm.exscan(x.copy(), op), want_ex, f"exscan {op.name}")

    # Data movement: bits, NaN payloads and all.
    same["allgather"] = _check(comm.allgather(x), stacked, "allgather")
    same["broadcast"] = _check(comm.broadcast(x.copy(), root=root), xs[root], "broadcast")
    got = comm.gather(x, root)
    if r == root:
        _check(got, stacked, "gather")
    whole = [np.stack([_inputs(j, count, 10 + i) for i in range(n)]) for j in range(n)]
    _check(comm.alltoall(whole[r]), np.stack([whole[i][r] for i in range(n)]), "alltoall")
    if r == 0:
        _check(comm.scatter(whole[0], 0), whole[0][r], "scatter")
    else:
        _check(comm.scatter(None, 0, out=np.empty(count, np.uint16).view(BFLOAT16)), whole[0][r], "scatter")
    same["allgatherv"] = _check(
        comm.allgatherv(uneven[r][: counts[r]], counts),
        np.concatenate([uneven[j][: counts[j]] for j in range(n)]),
        "allgatherv",
    )
    sends = [(count + r + j) % 3 for j in range(n)]
    recvs = [(count + j + r) % 3 for j in range(n)]
    flat = _inputs(r, sum(sends), 3)
    expected = []
    for i in range(n):
        theirs = _inputs(i, sum((count + i + j) % 3 for j in range(n)), 3)
        start = sum((count + i + j) % 3 for j in range(r))
        expected.append(theirs[start : start + recvs[i]])
    _check(comm.alltoallv(flat, sends, recvs), np.concatenate(expected), "alltoallv")

    # Point to point around the ring, and to oneself.
    dst, src = (r + 1) % n, (r - 1) % n
    req = comm.isend(x, dst, tag=7)
    buf = np.empty(count, np.uint16).view(BFLOAT16)
    status = comm.recv(buf, src, 7)
    req.wait()
    assert status.count == count and status.source == src
    _check(buf, xs[src], "send/recv")
    return same


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_bfloat16_collectives_match_the_reference_bitwise(pools, world_size: int) -> None:  # type: ignore[no-untyped-def]
    pool = pools.get(world_size)
    for count in SIZES:
        results = pool.run(_collectives, count, timeout=300)
        for what in results[0]:
            digests = {res[what] for res in results}
            assert len(digests) == 1, f"count={count}: {what} differs across ranks"


def _rules(comm):  # type: ignore[no-untyped-def]
    x = np.zeros(4, np.uint16).view(BFLOAT16)
    for call in (lambda: comm.allreduce(x, ReduceOp.BAND), lambda: comm.reduce_scatter(x, "bxor", [2, 2])):
        with pytest.raises(ValueError, match=r"op B\w+ is not defined for dtype .*bfloat16"):
            call()
    with pytest.raises(ValueError, match="AVG is not a prefix reduction"):
        comm.scan(x, ReduceOp.AVG)
    # Zero-copy: a reduction cannot (peers cannot read float32 scratch), data movement can.
    shared = comm.alloc(4, BFLOAT16)
    with pytest.raises(UnsupportedError, match="bfloat16 reduces through float32 scratch"):
        comm.allreduce(shared, algorithm="zerocopy")
    shared[...] = bf16ref.from_float32(np.arange(4) + comm.rank)
    got = comm.allreduce(shared)  # auto: not zero-copy (in place)
    assert bf16ref.to_float32(got).tolist() == [float(2 * i + 1) for i in range(4)]
    shared[...] = bf16ref.from_float32(np.arange(4) + comm.rank)
    assert bf16ref.to_float32(comm.broadcast(shared, root=1, algorithm="zerocopy")).tolist() == [1.0, 2.0, 3.0, 4.0]
    return True


def test_bfloat16_rules(pools) -> None:  # type: ignore[no-untyped-def]
    assert pools.get(2).run(_rules) == [True, True]
