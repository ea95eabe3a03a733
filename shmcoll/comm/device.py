"""Device (CUDA) arrays in the Communicator's methods: bound by the same binders, with the same
checks and messages as numpy arrays, and run by the device engine (:mod:`shmcoll.engine.cuda`).

Every method accepts device arrays (numba device arrays, CuPy arrays, torch CUDA tensors:
anything with ``__cuda_array_interface__``) where it accepts numpy arrays::

    x = cupy.arange(10, dtype=cupy.float32)
    comm.allreduce(x)                        # in place on the device; returns x
    g = comm.allgather(x)                    # a new device array, shape (world_size, 10)

Arrays the call allocates (``out=None``) are numba device arrays; ``cupy.asarray(r)`` or
``torch.as_tensor(r, device="cuda")`` wrap them without a copy. Arrays must be C-contiguous and
on the current CUDA device; a call returns once its results are on the device, and it first
waits for all device work this process queued before it.

A device call is several CPU collectives of the communicator (the handshake, barriers, or the
staging path's numpy collective), so it runs as a nested call: no other thread's call can
interleave, and an exception half way breaks the communicator on every rank. The engine
returns statuses; this module exchanges what the ranks need and raises. Importing this module
does not import CUDA; the first device call does.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np

from shmcoll.collectives import Collective
from shmcoll.comm import arrays
from shmcoll.errors import CollectiveMismatchError, UnsupportedError
from shmcoll.types import BFLOAT16, ReduceOp

_ENGINES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_SETTINGS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def is_device(a: Any) -> bool:
    """Whether ``a`` is a device array (the simulator's have no interface, only ``__cuda_ndarray__``)."""
    return hasattr(a, "__cuda_array_interface__") or bool(getattr(a, "__cuda_ndarray__", False))


def describe(a: Any, name: str) -> Any:
    """A device array as an ``engine.cuda.DeviceBuffer``; TypeError for anything else."""
    from shmcoll.engine.cuda_memory import as_device

    buf = as_device(a)
    if buf is None:
        raise TypeError(
            f"{name} must be a device array (with __cuda_array_interface__) like the other arguments, "
            f"got {type(a).__name__}"
        )
    return buf


def _check_dtype(dtype: np.dtype) -> None:
    arrays.check_dtype(dtype)
    if dtype == BFLOAT16:  # the device kernels have no bfloat16 conversions
        raise TypeError("bfloat16 device arrays are not supported: pass a host array, or convert to float32 first")


def _engine(comm: Any) -> Any:
    eng = _ENGINES.get(comm)
    if eng is None:
        from shmcoll.engine.cuda import DeviceEngine

        eng = DeviceEngine(comm.rank, comm.world_size, comm.handle.token)
        eng.configure(**_SETTINGS.get(comm, {}))
        _ENGINES[comm] = eng
    return eng


# --- binding: the same binders as numpy arrays, with this kind ----------------------------------
class DeviceShape:
    """A device call's shape, validated like a numpy call shape (the device engine plans by itself)."""

    __slots__ = ("coll", "dtype", "count", "op", "root", "algorithm")

    def __init__(self, coll: Collective, dtype: np.dtype, count: int, op: ReduceOp, root: int, algorithm: str) -> None:
        self.coll, self.dtype, self.count, self.op, self.root, self.algorithm = coll, dtype, count, op, root, algorithm


class DeviceBound:
    """One device call, ready to run: :meth:`run` is what the run loop calls for it."""

    __slots__ = ("comm", "shape", "x", "out", "result")

    def __init__(self, comm: Any, shape: DeviceShape, x: Any, out: Any, result: Any) -> None:
        self.comm, self.shape, self.x, self.out, self.result = comm, shape, x, out, result

    def run(self, timeout: float | None) -> Any:
        _collective(self.comm, self.shape, self.x, self.out, timeout)
        return self.result


class DeviceKind:
    """What the binders in :mod:`shmcoll.comm.bind` need to know of device arrays."""

    @staticmethod
    def describe(a: Any, name: str) -> Any:
        return None if a is None else describe(a, name)

    @staticmethod
    def new(shape: tuple[int, ...], dtype: np.dtype) -> Any:
        from shmcoll.engine.cuda_memory import as_device, device_array

        return as_device(device_array(shape, dtype))

    @staticmethod
    def shape(
        rt: Any,
        coll: Collective,
        dtype: np.dtype,
        count: int,
        op: Any,
        algorithm: str,
        inplace: bool,
        root: Any,
        _: bool,
    ) -> DeviceShape:
        rt._check_usable()
        _check_dtype(dtype)
        if coll.rooted:
            arrays.check_root(root, rt.world_size)
        reduce_op = arrays.check_op(op, dtype) if coll.reducing else ReduceOp.SUM
        arrays.check_algorithm(algorithm)
        return DeviceShape(coll, dtype, count, reduce_op, int(root), algorithm)

    @staticmethod
    def bind(
        rt: Any, shape: DeviceShape, x: Any, out: Any, result: Any, placement: Any, writeable: bool
    ) -> DeviceBound:
        return DeviceBound(rt, shape, x, out, None if result is None else result.obj)


DEVICE = DeviceKind()


# --- running ------------------------------------------------------------------------------------
def _left(deadline: float) -> float:
    # A spent deadline still calls the CPU collective, with a token timeout, so that the timeout
    # is raised (and peers aborted) by the communicator exactly as on the numpy path.
    return max(deadline - time.monotonic(), 1e-3)


def _collective(comm: Any, shape: DeviceShape, x: Any, out: Any, timeout: float | None) -> None:
    from shmcoll.engine import cuda as dev

    eng = _engine(comm)
    kind, count, dtype, op, root = shape.coll.name, shape.count, shape.dtype, shape.op, shape.root
    agreed: Exception | None = None
    with comm._nested(f"device {kind}", timeout):
        deadline = time.monotonic() + (comm.timeout if timeout is None else float(timeout))
        row, half_needed, staged, blocker = eng.begin(kind, x, count, dtype, op, root)
        rows = comm.allgather(row, timeout=_left(deadline))
        status, path, detail = eng.decide(rows, blocker)
        if status in (dev.MISMATCH, dev.PATHS_DIFFER):
            what = "mismatched across ranks" if status == dev.MISMATCH else "configured with different paths"
            msg = (
                f"rank {comm.rank}: device collective #{eng.seq} {what} ({detail}): ranks must call the same "
                f"collectives in the same order with the same sizes, dtypes, ops, roots and shmcoll.device settings"
            )
            comm.abort(msg)
            raise CollectiveMismatchError(msg)
        if status == dev.NO_IPC:
            agreed = UnsupportedError(f"rank {comm.rank}: path='ipc' was configured but IPC is not possible: {detail}")
        else:
            if path == "ipc" and not _ensure_workspace(comm, eng, half_needed, deadline):
                path = "staging"
            if path != eng.last_path:
                comm._log.info(
                    "device collectives: %s path%s", path, f" ({blocker})" if path == "staging" and blocker else ""
                )
            eng.last_path = path
            if path == "staging":
                _staging(comm, eng, shape, x, out, deadline)
            else:
                if not bool(rows[:, dev.F_STAGED].all()):
                    if not staged:
                        eng.copy_in(kind, x, root)
                    eng.sync()
                    comm.barrier(timeout=_left(deadline))
                if eng.ipc_step(0, kind, x, out, count, dtype, op, root) == dev.MEET:
                    comm.barrier(timeout=_left(deadline))
                    eng.ipc_step(1, kind, x, out, count, dtype, op, root)
    if agreed is not None:  # every rank decided alike from the same rows: nothing is half done
        raise agreed


def _ensure_workspace(comm: Any, eng: Any, half_needed: int, deadline: float) -> bool:
    """Every rank allocates a workspace and opens every peer's; False (IPC off for this
    communicator, staging from now on) if any rank could not."""
    if eng.has_workspace(half_needed):
        return True
    _drop_workspace(comm, eng, _left(deadline))
    offer, failure = eng.offer_workspace(half_needed)
    offers = comm.allgather_object(offer, timeout=_left(deadline))
    if not failure:
        failure = eng.open_workspaces(offers)
    oks = comm.allgather(np.array([0 if failure else 1], np.int64), timeout=_left(deadline))
    return bool(eng.settle_workspaces(bool(oks.all()), failure))


def _drop_workspace(comm: Any, eng: Any, timeout: float | None) -> None:
    if eng.close_peer_views():
        # Nobody frees memory a peer may still map: every rank has closed its mappings first.
        comm.barrier(timeout=timeout)
        eng.free_workspace()


def _staging(comm: Any, eng: Any, shape: DeviceShape, x: Any, out: Any, deadline: float) -> None:
    """The call as a numpy collective of the same communicator, through host memory."""
    hx, hout = eng.to_host(x), None if out is None else np.empty(out.shape, out.dtype)
    coll = shape.coll
    kw: dict[str, Any] = {"out": hout, "algorithm": shape.algorithm, "timeout": _left(deadline)}
    if coll.rooted:
        kw["root"] = shape.root
    if coll.reducing:
        kw["op"] = shape.op
    getattr(comm, coll.name)(hx, **kw)
    eng.to_device(hout, out)


def point_to_point(comm: Any, send: bool, buf: Any, peer: Any, tag: int, timeout: float | None) -> Any:
    """send/recv of a device array, always through host memory: a device-side rendezvous would
    make a send wait for its receiver, which the numpy ``send`` (buffered in shared memory) does
    not."""
    name = "x" if send else "buf"
    b = describe(buf, name)
    if send:
        arrays.check_read(b, name)
    else:
        arrays.check_written(b, name)
    _check_dtype(b.dtype)  # (comm.send and comm.recv check the peer and tag)
    eng = _engine(comm)
    eng.wait_for_queued_work()
    if send:
        comm.send(eng.to_host(b), int(peer), tag, timeout=timeout)
        return None
    host = np.empty(b.shape, b.dtype)
    status = comm.recv(host, peer, tag, timeout=timeout)
    eng.to_device(host, b)
    return status


# --- settings and lifetime (shmcoll.device re-exports configure and release) ---------------------
def configure(comm: Any, *, path: str | None = None, oneshot_bytes: int | None = None) -> None:
    """Choose how ``comm`` moves device arrays; every rank must configure alike (checked).

    Args:
        path: ``"auto"`` (default: CUDA IPC when every rank is on the same GPU, else staging
            through host memory; staging under the CUDA simulator), ``"ipc"`` (IPC or raise
            :class:`~shmcoll.UnsupportedError`; under the simulator, IPC simulated with shared
            memory) or ``"staging"``.
        oneshot_bytes: allreduce buffers up to this size reduce in one shot (every rank reads
            every peer's buffer); larger ones reduce-scatter then allgather. Default 512 KiB.
    """
    from shmcoll.engine.cuda import ONESHOT_BYTES, PATHS

    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if oneshot_bytes is not None and (not isinstance(oneshot_bytes, (int, np.integer)) or oneshot_bytes < 0):
        raise ValueError(f"oneshot_bytes must be a non-negative int, got {oneshot_bytes!r}")
    settings = _SETTINGS.setdefault(comm, {"path": "auto", "oneshot_bytes": ONESHOT_BYTES})
    if path is not None:
        settings["path"] = path
    if oneshot_bytes is not None:
        settings["oneshot_bytes"] = int(oneshot_bytes)
    eng = _ENGINES.get(comm)
    if eng is not None:
        eng.configure(**settings)


def release(comm: Any, *, timeout: float | None = None) -> None:
    """Free ``comm``'s device workspaces now (collective: call it on every rank). They are
    re-created by the next call that needs them."""
    eng = _ENGINES.get(comm)
    if eng is not None:
        with comm._nested("device release", timeout):
            _drop_workspace(comm, eng, timeout)
        eng.last_path = ""


def forget(comm: Any) -> None:
    """Drop ``comm``'s device engine when it closes (local: its workspaces and peer mappings are
    freed once nothing else holds them)."""
    _ENGINES.pop(comm, None)
    _SETTINGS.pop(comm, None)
