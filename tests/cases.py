"""The correctness matrix: cases, their inputs, numpy's answers, and the in-rank runner.

Each rank regenerates *every* rank's input from ``np.random.default_rng([seed, rank, case])``,
so it can compute numpy's answer for itself without communicating. Reduction inputs are small
integers stored in the dtype, so every summation order is exact and results are compared with
``assert_array_equal``; one random-float case per collective is compared with a tolerance. Each
result's digest comes back to the test, which checks bitwise equality across ranks wherever the
ranks hold the same result.
"""

from __future__ import annotations

import dataclasses
import hashlib
import traceback
from typing import Any

import bf16ref
import numpy as np

from shmcoll import ReduceOp
from shmcoll.algos import registry
from shmcoll.shm import cma
from shmcoll.types import BFLOAT16, DTYPES, FLOAT32, FOLD_UFUNC, as_dtype, dtype_str, supports

SEED = 20261122
REDUCING = ("reduce", "allreduce", "reduce_scatter", "reduce_scatterv", "scan", "exscan")
PREFIX = ("scan", "exscan")
ROOTED = ("broadcast", "scatter", "gather", "reduce", "gatherv", "scatterv")
COLLECTIVES = ("broadcast", "scatter", "gather", "allgather", "reduce", "allreduce", "reduce_scatter", "alltoall")
# The variable-count collectives and the scans (host arrays only: the device matrix leaves them out).
VARYING = ("allgatherv", "gatherv", "scatterv", "reduce_scatterv", "alltoallv")
EVERY = COLLECTIVES + VARYING + PREFIX
SAME_ON_ALL = ("broadcast", "allgather", "allreduce", "allgatherv")


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str
    algorithm: str
    dtype: str
    op: int
    root: int
    count: int
    inplace: bool
    data: str  # "int" (exact), "float" (tolerance), "nan", "wrap"
    case_id: int
    shape2d: bool = False
    registered: bool = False  # buffers from comm.alloc (every rank allocates the same way)

    def describe(self) -> str:
        op = f" {ReduceOp(self.op).name}" if self.kind in REDUCING else ""
        root = f" root={self.root}" if self.kind in ROOTED else ""
        return (
            f"{self.kind}/{self.algorithm} {self.dtype}{op}{root} count={self.count}"
            f"{' in-place' if self.inplace else ''} data={self.data} [seed {SEED}, case {self.case_id}]"
        )


def make_case(**kw: Any) -> Case:
    """A case, with buffers registered (comm.alloc) for the zerocopy algorithm, which needs them.
    In-place allgather/gather have no zero-copy form (x = out[rank] sits at another place on
    every rank), so zerocopy cases of those are out of place."""
    if kw["algorithm"] == "cma" and not cma.probe()[0]:
        kw["algorithm"] = "direct"  # cross-memory attach refused on this machine (the fallback is tested apart)
    if kw["algorithm"] == "zerocopy":
        if kw["kind"] in REDUCING and kw["dtype"] in ("float16", "bfloat16"):
            kw["algorithm"] = "direct"  # they reduce through scratch: no zero-copy form
        else:
            kw["registered"] = True
            if kw["kind"] in ("allgather", "gather"):
                kw["inplace"] = False
    return Case(**kw)


def counts_for(world_size: int, slot_capacity: int) -> list[int]:
    """0, 1, world-1, world+1, a prime, and several slots' worth (more than the whole ring)."""
    return sorted({0, 1, max(world_size - 1, 0), world_size + 1, 13, 3 * slot_capacity + 5})


def _values(rng: np.random.Generator, dtype: np.dtype, op: int, count: int, data: str) -> np.ndarray:
    if dtype == BFLOAT16:  # float32's values, rounded (small integers exactly)
        return bf16ref.from_float32(_values(rng, FLOAT32, op, count, data))
    if dtype.kind == "b":
        return rng.integers(0, 2, count).astype(bool)
    if data == "float":
        v = rng.standard_normal(count) * 10
        if dtype.kind == "c":
            v = v + 1j * rng.standard_normal(count)
        return v.astype(dtype)
    if data == "wrap" and dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.max // 2, info.max, count, endpoint=True, dtype=dtype)
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, endpoint=True, dtype=dtype)
    if op == ReduceOp.PROD:
        choices = np.array([1, 2] if dtype.kind == "u" else [-1, 1, 2])
        v = rng.choice(choices, count)
    else:
        v = rng.integers(0 if dtype.kind == "u" else -3, 4, count)
    out = v.astype(dtype)
    if dtype.kind == "c":
        out = out + 1j * rng.integers(-2, 3, count).astype(dtype)
    if data == "nan" and dtype.kind in "fc" and count:
        out[rng.integers(0, count, max(count // 3, 1))] = np.nan
    return out


def block_counts(case: Case, world_size: int) -> list[int]:
    """A variable-count case's counts: uneven, zeros among them, up to ``case.count + 1``."""
    return [(case.count + 3 * j + case.case_id) % (case.count + 2) for j in range(world_size)]


def pair_counts(case: Case, world_size: int) -> list[list[int]]:
    """An alltoallv case's matrix: ``m[i][j]`` elements from rank i to rank j."""
    n = world_size
    return [[(case.count + 3 * i + 5 * j + case.case_id) % (case.count + 2) for j in range(n)] for i in range(n)]


def _displ(counts: list[int], j: int) -> slice:
    at = sum(counts[:j])
    return slice(at, at + counts[j])


def inputs(case: Case, world_size: int) -> list[np.ndarray]:
    """Every rank's input (flat, as the collective sees it)."""
    dtype = as_dtype(case.dtype)
    n = world_size
    out = []
    for r in range(n):
        if case.kind in ("allgatherv", "gatherv"):
            size = block_counts(case, n)[r]
        elif case.kind in ("scatterv", "reduce_scatterv"):
            size = sum(block_counts(case, n))
        elif case.kind == "alltoallv":
            size = sum(pair_counts(case, n)[r])
        else:
            size = case.count * (n if case.kind in ("scatter", "reduce_scatter", "alltoall") else 1)
        rng = np.random.default_rng([SEED, r, case.case_id])
        out.append(_values(rng, dtype, case.op, size, case.data))
    return out


def identity(op: int, dtype: np.dtype) -> np.ndarray:
    """exscan's rank 0 result: the op's identity (as the API documents it), one element."""
    if dtype == BFLOAT16:
        return bf16ref.from_float32(identity(op, FLOAT32))
    op = ReduceOp(op)
    if op in (ReduceOp.SUM, ReduceOp.BOR, ReduceOp.BXOR):
        return np.zeros(1, dtype)
    if op == ReduceOp.PROD:
        return np.ones(1, dtype)
    if op == ReduceOp.BAND:
        return np.ones(1, dtype) if dtype.kind == "b" else np.full(1, -1).astype(dtype)
    if dtype.kind == "b":
        return np.array([op == ReduceOp.MIN])
    if dtype.kind == "f":
        return np.array([np.inf if op == ReduceOp.MIN else -np.inf], dtype)
    info = np.iinfo(dtype)
    return np.array([info.max if op == ReduceOp.MIN else info.min], dtype)


def reduce_ref(op: int, stacked: np.ndarray, world_size: int) -> np.ndarray:
    """numpy's answer for a reduction over axis 0 (the ranks), with shmcoll's AVG, float16 and
    bfloat16 (folded in float32 in rank order, rounded once)."""
    dtype = stacked.dtype
    if dtype == np.float16:
        return reduce_ref(op, stacked.astype(np.float32), world_size).astype(np.float16)
    if dtype == BFLOAT16:
        return bf16ref.from_float32(reduce_ref(op, bf16ref.to_float32(stacked), world_size))
    op = ReduceOp(op)
    if op == ReduceOp.AVG:
        # The sum folded in rank order, as SUM's: np.add.reduce starts from +0.0, which turns
        # a sum of -0.0s (IEEE: -0.0, and the engine's) into +0.0.
        total = reduce_ref(ReduceOp.SUM, stacked, world_size)
        if dtype.kind in "iu":
            return np.floor_divide(total, dtype.type(world_size))
        if dtype.kind == "c":
            wide = total.astype(np.complex128)
            return (wide.real / world_size + 1j * (wide.imag / world_size)).astype(dtype)
        return (total.astype(np.float64) / world_size).astype(dtype)
    ufunc = FOLD_UFUNC[op]
    if dtype.kind == "b" and op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        ufunc = {ReduceOp.BAND: np.logical_and, ReduceOp.BOR: np.logical_or, ReduceOp.BXOR: np.logical_xor}[op]
    acc = stacked[0].copy()
    for row in stacked[1:]:
        acc = ufunc(acc, row).astype(dtype)
    return acc


def expected(case: Case, xs: list[np.ndarray], rank: int) -> np.ndarray | None:
    n = len(xs)
    c = case.count
    k = case.kind
    if k == "broadcast":
        return xs[case.root]
    if k == "scatter":
        return xs[case.root].reshape(n, c)[rank]
    if k == "gather":
        return np.stack(xs) if rank == case.root else None
    if k == "allgather":
        return np.stack(xs)
    if k == "alltoall":
        return np.stack([x.reshape(n, c)[rank] for x in xs])
    if k == "reduce":
        return reduce_ref(case.op, np.stack(xs), n) if rank == case.root else None
    if k == "allreduce":
        return reduce_ref(case.op, np.stack(xs), n)
    if k == "reduce_scatter":
        return reduce_ref(case.op, np.stack(xs), n)[rank * c : (rank + 1) * c]
    if k in ("allgatherv", "gatherv"):
        everything = np.concatenate(xs)
        return everything if k == "allgatherv" or rank == case.root else None
    if k == "scatterv":
        return xs[case.root][_displ(block_counts(case, n), rank)]
    if k == "reduce_scatterv":
        return reduce_ref(case.op, np.stack(xs), n)[_displ(block_counts(case, n), rank)]
    if k == "alltoallv":
        m = pair_counts(case, n)
        return np.concatenate([xs[i][_displ(m[i], rank)] for i in range(n)])
    if k == "scan":
        return reduce_ref(case.op, np.stack(xs[: rank + 1]), rank + 1)
    if k == "exscan":
        if rank == 0:
            return np.repeat(identity(case.op, xs[0].dtype), c)
        return reduce_ref(case.op, np.stack(xs[:rank]), rank)
    raise ValueError(k)


def call(comm: Any, case: Case, x: np.ndarray) -> np.ndarray | None:
    """Run the case's collective on this rank's input, in place or not as the case says."""
    n, r, c = comm.world_size, comm.rank, case.count
    kw = {"algorithm": case.algorithm}
    k = case.kind
    if case.registered:
        # comm.alloc is collective: every rank allocates the same buffers in the same order.
        def new(shape: Any, dtype: np.dtype) -> np.ndarray:
            return comm.alloc(shape, dtype)
    else:
        new = np.empty

    def put(a: np.ndarray) -> np.ndarray:
        if not case.registered:
            return a
        b = comm.alloc(a.shape, a.dtype)
        b[...] = a
        return b

    if k == "allreduce":
        x = put(x.reshape(-1, 2) if case.shape2d else x)
        if case.inplace:
            return comm.allreduce(x, case.op, **kw).reshape(-1)
        return comm.allreduce(x, case.op, out=new(x.shape, x.dtype), **kw).reshape(-1)
    if k == "broadcast":
        x = put(x)
        if case.inplace:
            return comm.broadcast(x, root=case.root, **kw)
        return comm.broadcast(x, root=case.root, out=new(x.shape, x.dtype), **kw)
    if k == "reduce":
        x = put(x)
        if case.inplace and r == case.root:
            return comm.reduce(x, root=case.root, op=case.op, out=x, **kw)
        return comm.reduce(x, root=case.root, op=case.op, **kw)
    if k == "allgather":
        if case.inplace:
            out = new((n, c), x.dtype)
            out[r] = x
            return comm.allgather(out[r], out=out, **kw)
        return comm.allgather(put(x), **kw)
    if k == "gather":
        if case.inplace:
            out = new((n, c), x.dtype)
            out[r] = x
            if r == case.root:
                return comm.gather(out[r], root=case.root, out=out, **kw)
            return comm.gather(out[r], root=case.root, **kw)
        return comm.gather(put(x), root=case.root, **kw)
    if k == "scatter":
        if r == case.root:
            full = x.reshape(n, c)
            if case.inplace:
                return comm.scatter(full, root=case.root, out=full[r], **kw)
            return comm.scatter(full, root=case.root, **kw)
        return comm.scatter(None, root=case.root, out=np.empty(c, x.dtype), **kw)
    if k == "reduce_scatter":
        x = put(x)
        if case.inplace:
            return comm.reduce_scatter(x, case.op, out=x[r * c : (r + 1) * c], **kw).copy()
        return comm.reduce_scatter(x, case.op, **kw)
    if k == "alltoall":
        full = put(x.reshape(n, c))
        if case.inplace:
            return comm.alltoall(full, out=full, **kw)
        return comm.alltoall(full, **kw)
    if k in ("scan", "exscan"):
        fn = comm.scan if k == "scan" else comm.exscan
        x = x.reshape(-1, 2) if case.shape2d else x
        if case.inplace:
            return fn(x, case.op, **kw).reshape(-1)
        return fn(x, case.op, out=np.empty_like(x), **kw).reshape(-1)
    if k == "alltoallv":
        m = pair_counts(case, n)
        return comm.alltoallv(x, m[r], [m[i][r] for i in range(n)], **kw)
    counts = block_counts(case, n)
    mine = _displ(counts, case.root if k in ROOTED else r)
    if k == "allgatherv":
        if case.inplace:
            out = np.empty(sum(counts), x.dtype)
            out[mine] = x
            return comm.allgatherv(out[mine], counts, out=out, **kw)
        return comm.allgatherv(x, counts, **kw)
    if k == "gatherv":
        if r != case.root:  # non-roots need not know the counts; odd cases pass them anyway
            return comm.gatherv(x, counts if case.case_id % 2 else None, root=case.root, **kw)
        if case.inplace:
            out = np.empty(sum(counts), x.dtype)
            out[mine] = x
            return comm.gatherv(out[mine], counts, root=case.root, out=out, **kw)
        return comm.gatherv(x, counts, root=case.root, **kw)
    if k == "scatterv":
        if r != case.root:
            out = np.empty(counts[r], x.dtype)
            return comm.scatterv(None, counts if case.case_id % 2 else None, root=case.root, out=out, **kw)
        if case.inplace:
            return comm.scatterv(x, counts, root=case.root, out=x[mine], **kw)
        return comm.scatterv(x, counts, root=case.root, **kw)
    if k == "reduce_scatterv":
        if case.inplace:
            return comm.reduce_scatter(x, case.op, counts, out=x[mine], **kw).copy()
        return comm.reduce_scatter(x, case.op, counts, **kw)
    raise ValueError(k)


def run_cases(comm: Any, cases: list[Case]) -> tuple[list[str], dict[int, str]]:
    """Run ``cases`` in order on this rank; returns (failure messages, result digests)."""
    failures: list[str] = []
    digests: dict[int, str] = {}
    for case in cases:
        xs = inputs(case, comm.world_size)
        want = expected(case, xs, comm.rank)
        mine = xs[comm.rank].copy()
        got = call(comm, case, mine)
        try:
            if want is None:
                assert got is None, f"expected None on rank {comm.rank}, got {type(got)}"
                continue
            assert got is not None, "got None"
            got = np.asarray(got)
            assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
            got_flat, want_flat = got.reshape(-1), want.reshape(-1)
            if want.dtype == BFLOAT16:  # compared as values (NaN equal to NaN), in float32
                got_flat, want_flat = bf16ref.to_float32(got_flat), bf16ref.to_float32(want_flat)
            if case.data == "float" and case.kind in REDUCING:
                tol = {"float16": 1e-2, "bfloat16": 1e-2, "float32": 1e-5, "complex64": 1e-5}.get(
                    dtype_str(want.dtype), 1e-12
                )
                np.testing.assert_allclose(got_flat, want_flat, rtol=tol, atol=tol * 10 * comm.world_size)
            else:
                np.testing.assert_array_equal(got_flat, want_flat)
            digests[case.case_id] = hashlib.sha1(got.tobytes()).hexdigest()
        except AssertionError as exc:
            failures.append(f"rank {comm.rank}: {case.describe()}: {exc}")
        except Exception:  # noqa: BLE001
            failures.append(f"rank {comm.rank}: {case.describe()}: {traceback.format_exc()}")
    return failures, digests


def matrix(
    world_size: int,
    slot_bytes: int,
    algorithms: dict[str, list[str]] | None = None,
    kinds: tuple[str, ...] = COLLECTIVES,
) -> list[Case]:
    """The full matrix for one world size: every collective x algorithm x root x dtype x op x count."""
    cases: list[Case] = []
    cid = 0

    def add(**kw: Any) -> None:
        nonlocal cid
        cases.append(make_case(case_id=cid, **kw))
        cid += 1

    for kind in kinds:
        algs = (algorithms or {}).get(kind) or [a.name for a in registry.algorithms(kind)]
        roots = range(world_size) if kind in ROOTED else [0]
        for alg in algs:
            for root in roots:
                for dtype in DTYPES:
                    slot_capacity = max(slot_bytes // dtype.itemsize, 1)
                    counts = counts_for(world_size, slot_capacity)
                    if kind in REDUCING:
                        ops = [op for op in ReduceOp if supports(op, dtype)]
                        if kind in PREFIX:  # (AVG has no prefix form)
                            ops = [op for op in ops if op != ReduceOp.AVG]
                    else:
                        ops = [ReduceOp.SUM]
                    for op in ops:
                        for count in counts:
                            # Every root sees every count on the common dtypes; other dtypes,
                            # which differ only in the kernels, see them on root 0.
                            if root and dtype.name not in ("float32", "int8") and count not in (1, counts[-1]):
                                continue
                            add(
                                kind=kind,
                                algorithm=alg,
                                dtype=dtype_str(dtype),
                                op=int(op),
                                root=root,
                                count=count,
                                inplace=bool(count % 2),
                                data="int",
                                shape2d=count % 2 == 0 and count > 0,
                            )
                    if kind in REDUCING and root == 0:
                        if dtype.kind in "fc" or dtype == BFLOAT16:
                            add(
                                kind=kind,
                                algorithm=alg,
                                dtype=dtype_str(dtype),
                                op=int(ReduceOp.SUM),
                                root=0,
                                count=counts[-1],
                                inplace=False,
                                data="float",
                            )
                            for op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX):
                                if supports(op, dtype):
                                    add(
                                        kind=kind,
                                        algorithm=alg,
                                        dtype=dtype_str(dtype),
                                        op=int(op),
                                        root=0,
                                        count=counts[-1],
                                        inplace=False,
                                        data="nan",
                                    )
                        if dtype.kind in "iu":
                            for op in (
                                (ReduceOp.SUM, ReduceOp.PROD)
                                if kind in PREFIX
                                else (
                                    ReduceOp.SUM,
                                    ReduceOp.AVG,
                                    ReduceOp.PROD,
                                )
                            ):
                                add(
                                    kind=kind,
                                    algorithm=alg,
                                    dtype=dtype_str(dtype),
                                    op=int(op),
                                    root=0,
                                    count=counts[-1],
                                    inplace=True,
                                    data="wrap",
                                )
                if kind not in REDUCING and root == 0:
                    add(
                        kind=kind,
                        algorithm=alg,
                        dtype="float64",
                        op=int(ReduceOp.SUM),
                        root=0,
                        count=counts_for(world_size, max(slot_bytes // 8, 1))[-1],
                        inplace=False,
                        data="float",
                    )
    return cases
