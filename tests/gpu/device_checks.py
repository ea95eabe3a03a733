"""Checks shared by the simulator tests and the real-GPU tests: kernel cases with numpy's
answers, a foreign device array type, and device versions of the correctness-matrix calls.

Importing this module imports ``numba.cuda``: only the test modules that run under
``NUMBA_ENABLE_CUDASIM=1`` (in a subprocess) or on a real GPU import it.
"""

from __future__ import annotations

import hashlib
import traceback
from typing import Any

import numpy as np
from cases import REDUCING, Case, _values, expected, inputs, reduce_ref
from numba import cuda

from shmcoll import ReduceOp, device
from shmcoll.kernels import cuda as kernels
from shmcoll.types import FOLD_UFUNC, engine_types, supports

SEED = 20261123


# --- a device array from "another library" ------------------------------------------------------
class ForeignArray:
    """A third-party device array (think CuPy): it exposes only ``__cuda_array_interface__``, so
    calls on it go through ``Communicator._foreign`` as a CuPy array's would. ``base`` holds the
    memory: a numba device array, or under the simulator a simulated one, whose interface then
    points at host memory (simulated device memory is host memory)."""

    def __init__(self, base: Any, readonly: bool = False) -> None:
        self.base = base
        self.readonly = readonly

    @classmethod
    def of(cls, host: np.ndarray, readonly: bool = False) -> ForeignArray:
        return cls(cuda.to_device(np.ascontiguousarray(host)), readonly)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if kernels.SIMULATOR:
            h = self.base._ary
            ptr, shape, strides = h.__array_interface__["data"][0], h.shape, h.strides
            contiguous, typestr = h.flags.c_contiguous, h.dtype.str
        else:
            cai = self.base.__cuda_array_interface__
            ptr, shape, strides, typestr = cai["data"][0], cai["shape"], cai["strides"], cai["typestr"]
            contiguous = strides is None or self.base.is_c_contiguous()
        return {
            "shape": tuple(shape),
            "typestr": typestr,
            "data": (ptr, self.readonly),
            "strides": None if contiguous else tuple(strides),
            "version": 3,
        }

    def __getitem__(self, idx: Any) -> ForeignArray:
        return ForeignArray(self.base[idx], self.readonly)

    def reshape(self, *shape: Any) -> ForeignArray:
        return ForeignArray(self.base.reshape(*shape), self.readonly)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    def copy_to_host(self) -> np.ndarray:
        return self.base.copy_to_host()

    def copy_to_device(self, host: np.ndarray) -> None:
        self.base.copy_to_device(np.ascontiguousarray(host))


def to_host(a: Any) -> np.ndarray:
    return a.copy_to_host()


# --- kernels ------------------------------------------------------------------------------------
def ordered_reference(xs: list[np.ndarray], op: int) -> np.ndarray:
    """numpy's answer for ``((x0 op x1) op x2) ...`` (AVG: then divided by len(xs)), in the CPU
    engine's types: every step is one IEEE operation, so float results are bitwise comparable."""
    dtype = xs[0].dtype
    n = len(xs)
    if dtype == np.bool_:
        return reduce_ref(op, np.stack(xs), n)
    work = [x.astype(np.float32) for x in xs] if dtype == np.float16 else [x.copy() for x in xs]
    wdt = work[0].dtype
    ufunc = FOLD_UFUNC[ReduceOp(op)]
    acc = work[0]
    with np.errstate(over="ignore", invalid="ignore"):
        for w in work[1:]:
            acc = _rounded_product(acc, w) if wdt.kind == "c" and op == ReduceOp.PROD else ufunc(acc, w).astype(wdt)
        if op == ReduceOp.AVG:
            if wdt.kind in "iu":
                acc = np.floor_divide(acc, wdt.type(n))
            elif wdt.kind == "c":
                wide = acc.astype(np.complex128)
                acc = (wide.real / n + 1j * (wide.imag / n)).astype(wdt)
            else:
                acc = (acc.astype(np.float64) / n).astype(wdt)
    return acc.astype(dtype)


def _rounded_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The engines' complex product, ``(ar*br - ai*bi) + (ar*bi + ai*br)j`` with every partial
    product rounded on its own. Not ``a * b``: numpy's vectorised complex loops fuse a product into
    the sum (FMA) on CPUs that have it, so its bits depend on the CPU and differ from numpy's own
    scalar product (seen on this project's x86 machines and a GPU machine's host)."""
    out = np.empty_like(a)
    out.real = a.real * b.real - a.imag * b.imag
    out.imag = a.real * b.imag + a.imag * b.real
    return out


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal values, NaN where numpy has NaN, and identical bits everywhere else."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    np.testing.assert_array_equal(got, want, err_msg=what)
    if want.dtype.kind in "fc":
        mask = ~np.isnan(want)
        np.testing.assert_array_equal(got[mask].view(np.uint8), want[mask].view(np.uint8), err_msg=what)


def kernel_data(dtype: np.dtype, op: int, nin: int, count: int, data: str, case: int) -> list[np.ndarray]:
    out = []
    for k in range(nin):
        rng = np.random.default_rng([SEED, k, case])
        out.append(np.ascontiguousarray(_values(rng, dtype, op, count, data)))
    return out


def data_kinds(dtype: np.dtype, op: int) -> list[str]:
    kinds = ["int"]
    if dtype.kind in "fc":
        kinds.append("float")
        if op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX):
            kinds.append("nan")
    if dtype.kind in "iu" and op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.AVG):
        kinds.append("wrap")
    return kinds


def run_kernel(
    xs: list[np.ndarray], op: int, *, divide: bool, threads: int | None = None, max_blocks: int | None = None
) -> np.ndarray:
    """Reduce host arrays ``xs`` with the CUDA kernel, the way the engine calls it."""
    dtype = xs[0].dtype
    edt, eop = engine_types(dtype, ReduceOp(op))
    if dtype == np.float16:
        edt = dtype
    srcs = [cuda.to_device(x.view(edt)) for x in xs]
    dst = cuda.device_array(xs[0].size, dtype=edt)
    scratch = cuda.device_array(xs[0].size, dtype=np.float32) if dtype == np.float16 else None
    kernels.reduce(
        dst,
        srcs,
        int(eop),
        divisor=len(xs) if divide and op == ReduceOp.AVG else 0,
        scratch=scratch,
        threads=threads,
        max_blocks=max_blocks,
    )
    return dst.copy_to_host().view(dtype)


def check_kernels_for(dtype: np.dtype, count: int, nins: tuple[int, ...], **launch: Any) -> int:
    """Every op valid for ``dtype`` x input count x data kind against the ordered numpy fold."""
    checked = 0
    case = 0
    for op in ReduceOp:
        if not supports(op, dtype):
            continue
        for nin in nins:
            for data in data_kinds(dtype, op):
                case += 1
                xs = kernel_data(dtype, op, nin, count, data, case)
                got = run_kernel(xs, op, divide=True, **launch)
                assert_same(got, ordered_reference(xs, op), f"{dtype} {ReduceOp(op).name} nin={nin} data={data}")
                checked += 1
    return checked


# --- collectives --------------------------------------------------------------------------------
def dev(a: np.ndarray, foreign: bool) -> Any:
    """A device copy of ``a``: a foreign (CAI-only) array, or numba's own device array."""
    return ForeignArray.of(a) if foreign else cuda.to_device(a)


def empty(shape: tuple[int, ...], dtype: np.dtype, foreign: bool) -> Any:
    return ForeignArray.of(np.zeros(shape, dtype)) if foreign else cuda.device_array(shape, dtype=dtype)


def call_device(comm: Any, case: Case, x: np.ndarray, foreign: bool) -> np.ndarray | None:
    """``cases.call`` on device arrays, through the Communicator's methods: foreign (CAI-only)
    arrays and numba's own take the same path."""
    n, r, c, k = comm.world_size, comm.rank, case.count, case.kind

    def run(name: str, arr: Any, **kw: Any) -> Any:
        kw["algorithm"] = case.algorithm
        return getattr(comm, name)(arr, **kw)

    def back(res: Any) -> np.ndarray | None:
        return None if res is None else to_host(res).reshape(-1)

    d = dev(x, foreign)
    if k == "allreduce":
        if case.inplace:
            return back(run("allreduce", d, op=case.op))
        return back(run("allreduce", d, op=case.op, out=empty(x.shape, x.dtype, foreign)))
    if k == "broadcast":
        if case.inplace:
            return back(run("broadcast", d, root=case.root))
        return back(run("broadcast", d, root=case.root, out=empty(x.shape, x.dtype, foreign)))
    if k == "reduce":
        if case.inplace and r == case.root:
            return back(run("reduce", d, root=case.root, op=case.op, out=d))
        return back(run("reduce", d, root=case.root, op=case.op))
    if k in ("allgather", "gather"):
        at_root = k == "allgather" or r == case.root
        kw = {} if k == "allgather" else {"root": case.root}
        if case.inplace and at_root:
            out = empty((n, c), x.dtype, foreign)
            if not c:  # numba-cuda refuses any index into a zero-size device array
                return back(run(k, empty((0,), x.dtype, foreign), out=out, **kw))
            block = out[r]
            block.copy_to_device(x)
            return back(run(k, block, out=out, **kw))
        return back(run(k, d, **kw))
    if k == "scatter":
        if r == case.root:
            full = dev(x.reshape(n, c), foreign)
            if case.inplace and c:  # (no index into a zero-size device array: see above)
                return back(run("scatter", full, root=case.root, out=full[r]))
            return back(run("scatter", full, root=case.root))
        return back(run("scatter", None, root=case.root, out=empty((c,), x.dtype, foreign)))
    if k == "reduce_scatter":
        if case.inplace:
            return back(run("reduce_scatter", d, op=case.op, out=d[r * c : (r + 1) * c]))
        return back(run("reduce_scatter", d, op=case.op))
    if k == "alltoall":
        full = dev(x.reshape(n, c), foreign)
        if case.inplace:
            return back(run("alltoall", full, out=full))
        return back(run("alltoall", full))
    raise ValueError(k)


def run_device_cases(comm: Any, cases: list[Case], path: str, oneshot_bytes: int) -> tuple[list[str], dict[int, str]]:
    """``cases.run_cases`` for device arrays; alternates foreign and numba arrays."""
    device.configure(comm, path=path, oneshot_bytes=oneshot_bytes)
    failures: list[str] = []
    digests: dict[int, str] = {}
    for i, case in enumerate(cases):
        xs = inputs(case, comm.world_size)
        want = expected(case, xs, comm.rank)
        try:
            got = call_device(comm, case, xs[comm.rank].copy(), foreign=i % 2 == 0)
            if want is None:
                assert got is None, f"expected None on rank {comm.rank}, got {type(got)}"
                continue
            assert got is not None, "got None"
            assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
            got_flat, want_flat = got.reshape(-1), want.reshape(-1)
            if case.data == "float" and case.kind in REDUCING:
                tol = {"float16": 1e-2, "float32": 1e-5, "complex64": 1e-5}.get(want.dtype.name, 1e-12)
                np.testing.assert_allclose(got_flat, want_flat, rtol=tol, atol=tol * 10 * comm.world_size)
            else:
                np.testing.assert_array_equal(got_flat, want_flat)
            digests[case.case_id] = hashlib.sha1(got.tobytes()).hexdigest()
        except AssertionError as exc:
            failures.append(f"rank {comm.rank} [{path}]: {case.describe()}: {exc}")
        except Exception:  # noqa: BLE001
            failures.append(f"rank {comm.rank} [{path}]: {case.describe()}: {traceback.format_exc()}")
    return failures, digests


REDUCTION_PAIRS = [(np.dtype(np.float32), op) for op in ReduceOp if supports(op, np.float32)]
REDUCTION_PAIRS += [(np.dtype(np.int8), op) for op in ReduceOp]
REDUCTION_PAIRS += [(np.dtype(np.bool_), op) for op in ReduceOp if supports(op, np.bool_)]
REDUCTION_PAIRS += [
    (np.dtype(np.float16), ReduceOp.SUM),
    (np.dtype(np.float16), ReduceOp.AVG),
    (np.dtype(np.float16), ReduceOp.MAX),
    (np.dtype(np.complex64), ReduceOp.PROD),
    (np.dtype(np.complex128), ReduceOp.AVG),
    (np.dtype(np.uint64), ReduceOp.AVG),
    (np.dtype(np.uint16), ReduceOp.BXOR),
    (np.dtype(np.int64), ReduceOp.PROD),
    (np.dtype(np.float64), ReduceOp.MIN),
    (np.dtype(np.uint32), ReduceOp.SUM),
]
MOVING_DTYPES = [np.dtype(t) for t in (np.float32, np.bool_, np.float16, np.complex128, np.int64)]


def device_matrix(world_size: int) -> list[Case]:
    """A trimmed matrix: every collective, every root (on float32), every op on three dtypes
    (half of them on reduce and reduce_scatter) and samples of the rest; counts 0, 1, world+1
    and 13 spread over the pairs; one random-float case per reducing collective. Sized for the
    simulator, where each kernel thread is a Python thread."""
    counts = [1, world_size + 1, 13]
    cases: list[Case] = []

    def add(**kw: Any) -> None:
        cases.append(Case(case_id=len(cases), algorithm="auto", **kw))

    for kind in ("allreduce", "reduce", "reduce_scatter"):
        for i, (dtype, op) in enumerate(REDUCTION_PAIRS):
            # allreduce gets every pair; reduce and reduce_scatter, whose kernels are the same,
            # alternate halves of them.
            if kind == "reduce" and i % 2 or kind == "reduce_scatter" and not i % 2:
                continue
            count = counts[i % len(counts)]
            root = i % world_size if kind == "reduce" else 0
            add(kind=kind, dtype=dtype.name, op=int(op), root=root, count=count, inplace=bool(i % 2), data="int")
        add(kind=kind, dtype="float32", op=int(ReduceOp.SUM), root=0, count=0, inplace=False, data="int")
        add(kind=kind, dtype="float32", op=int(ReduceOp.SUM), root=0, count=29, inplace=False, data="float")
        add(kind=kind, dtype="float64", op=int(ReduceOp.MAX), root=0, count=17, inplace=False, data="nan")
        add(kind=kind, dtype="int16", op=int(ReduceOp.AVG), root=0, count=9, inplace=True, data="wrap")
    for kind in ("broadcast", "scatter", "gather", "allgather", "alltoall"):
        roots = range(world_size) if kind in ("broadcast", "scatter", "gather") else [0]
        for root in roots:
            add(kind=kind, dtype="float32", op=0, root=root, count=13, inplace=bool(root % 2), data="int")
        for i, dtype in enumerate(MOVING_DTYPES):
            count = [0, 1, world_size + 1, 13, 7][i]
            add(kind=kind, dtype=dtype.name, op=0, root=0, count=count, inplace=not i % 2, data="int")
    return cases
