"""Collectives on GPU arrays: the Communicator's methods, for arrays that live on a CUDA device.

Every :class:`~shmcoll.Communicator` method accepts device arrays (numba device arrays, CuPy
arrays, torch CUDA tensors: anything with ``__cuda_array_interface__``) where it accepts numpy
arrays, with the same arguments, checks, errors and results::

    x = cupy.arange(10, dtype=cupy.float32)
    comm.allreduce(x)                        # in place on the device; returns x
    g = comm.allgather(x)                    # a new device array, shape (world_size, 10)

The communicator sends such calls here (``Communicator._foreign``). Arguments are checked first,
on the calling rank, before any communication, with the numpy methods' messages; then
:mod:`shmcoll.engine.cuda` moves the bytes: through CUDA IPC when every rank works on the same
GPU, through host memory otherwise. Arrays the call allocates (``out=None``) are numba device
arrays; ``cupy.asarray(r)`` or ``torch.as_tensor(r, device="cuda")`` wrap them without a copy.
Arrays must be C-contiguous and on the current CUDA device; a call returns once its results are
on the device, and it first waits for all device work this process queued before it.

Importing this module does not import CUDA; the first device call does.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from shmcoll.types import DTYPE_CODE, ReduceOp, supports, valid_ops

__all__ = ["call", "configure", "forget", "release"]

_ENGINES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_SETTINGS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def _engine(comm: Any) -> Any:
    eng = _ENGINES.get(comm)
    if eng is None:
        from shmcoll.engine.cuda import DeviceEngine

        eng = DeviceEngine(comm.rank, comm.world_size, comm.handle.token)
        eng.configure(**_SETTINGS.get(comm, {}))
        _ENGINES[comm] = eng
    return eng


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
        eng.release(comm, timeout)


def forget(comm: Any) -> None:
    """Drop ``comm``'s device engine when it closes (local: its workspaces and peer mappings are
    freed once nothing else holds them)."""
    _ENGINES.pop(comm, None)
    _SETTINGS.pop(comm, None)


def call(comm: Any, name: str, x: Any, **kwargs: Any) -> Any:
    """Run the Communicator method ``name`` on device arrays (see the module docstring).

    ``x`` is the method's array argument (``buf`` for ``recv``; ``None`` for a non-root
    ``scatter``), ``kwargs`` its keyword arguments. Returns what the numpy method returns:
    the device result, or ``None`` where that returns ``None``.
    """
    from shmcoll.engine import cuda as dev

    comm._check_usable()
    if name in ("send", "recv"):
        return _p2p(comm, dev, name, x, **kwargs)
    handler = _COLLECTIVES.get(name)
    if handler is None:
        raise TypeError(f"{name} does not take device arrays")
    return handler(comm, dev, x, **kwargs)


# --- argument checks, as the numpy methods make them ---------------------------------------------
def _describe(dev: Any, value: Any, name: str) -> Any:
    buf = dev.as_device(value)
    if buf is None:
        raise TypeError(
            f"{name} must be a device array (with __cuda_array_interface__) like the other arguments, "
            f"got {type(value).__name__}"
        )
    return buf


def _check_read(buf: Any, name: str) -> None:
    if not buf.contiguous:
        raise ValueError(f"{name} must be C-contiguous (use cupy.ascontiguousarray or .contiguous())")


def _check_written(buf: Any, name: str) -> None:
    _check_read(buf, name)
    if buf.readonly:
        raise ValueError(f"{name} is read-only but this call writes into it")


def _check_dtype(dtype: np.dtype) -> None:
    if dtype not in DTYPE_CODE:
        raise TypeError(f"unsupported dtype {dtype}; supported: {', '.join(d.name for d in DTYPE_CODE)}")


def _check_op(op: Any, dtype: np.dtype) -> ReduceOp:
    from shmcoll.comm import _as_op

    rop = _as_op(op)
    if not supports(rop, dtype):
        valid = ", ".join(o.name for o in sorted(valid_ops(dtype)))
        raise ValueError(f"op {rop.name} is not defined for dtype {dtype} (valid: {valid})")
    return rop


def _check_algorithm(algorithm: Any) -> None:
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a string, got {algorithm!r}")


def _check_out(dev: Any, out: Any, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    buf = _describe(dev, out, "out")
    if buf.shape != shape:
        raise ValueError(f"out has shape {buf.shape}, expected {shape}")
    if buf.dtype != dtype:
        raise TypeError(f"out has dtype {buf.dtype}, expected {dtype}")
    if not buf.contiguous:
        raise ValueError("out must be C-contiguous")
    if buf.readonly:
        raise ValueError("out is read-only")
    return buf


def _overlap(a: Any, b: Any) -> bool:
    return a.nbytes > 0 and b.nbytes > 0 and a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


def _check_disjoint(x: Any, out: Any) -> None:
    if _overlap(x, out):
        raise ValueError("x and out overlap: pass out=None (or out=x) to work in place, or disjoint arrays")


def _is_block_of(comm: Any, part: Any, whole: Any, block: int) -> bool:
    if not _overlap(part, whole):
        return False
    block_bytes = whole.nbytes // comm.world_size
    if part.ptr == whole.ptr + block * block_bytes and part.nbytes == block_bytes:
        return True
    raise ValueError(f"input and output overlap, but not as block {block} (this rank's block) of the larger one")


def _check_root(comm: Any, root: Any) -> None:
    if not isinstance(root, (int, np.integer)) or not 0 <= root < comm.world_size:
        raise ValueError(f"root {root!r} out of range for world_size {comm.world_size}")


def _check_peer(comm: Any, peer: Any, name: str) -> None:
    if not isinstance(peer, (int, np.integer)) or not 0 <= peer < comm.world_size:
        raise ValueError(f"{name}={peer!r} out of range for world_size {comm.world_size}")
    if peer == comm.rank:
        raise ValueError(f"{name}={peer} is this rank itself")


def _new(dev: Any, shape: tuple[int, ...], dtype: np.dtype) -> tuple[Any, Any]:
    arr = dev.device_array(shape, dtype)
    return arr, dev.as_device(arr)


def _run(
    comm: Any,
    dev: Any,
    kind: str,
    x: Any,
    out: Any,
    *,
    count: int,
    dtype: np.dtype,
    op: ReduceOp = ReduceOp.SUM,
    root: int = 0,
    algorithm: str,
    timeout: Any,
) -> None:
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    eng = _engine(comm)
    try:
        eng.collective(
            comm, kind, x, out, count=count, dtype=dtype, op=op, root=root, algorithm=algorithm, timeout=timeout
        )
    except BaseException as exc:
        _fail(comm, kind, exc)
        raise


def _fail(comm: Any, kind: str, exc: BaseException) -> None:
    """A device call failed part-way: unless the communicator already knows (its own errors),
    abort it so that peers stop waiting for this rank now instead of at their timeouts."""
    from shmcoll.errors import ShmcollError

    if isinstance(exc, ShmcollError):
        return
    comm._abort_for_error(f"device {kind} failed: {type(exc).__name__}: {exc}")


# --- the methods ---------------------------------------------------------------------------------
def _allreduce(
    comm: Any, dev: Any, x: Any, op: Any = ReduceOp.SUM, out: Any = None, algorithm: str = "auto", timeout: Any = None
) -> Any:
    xb = _describe(dev, x, "x")
    _check_dtype(xb.dtype)
    rop = _check_op(op, xb.dtype)
    _check_algorithm(algorithm)
    inplace = out is None or out is x
    if inplace:
        _check_written(xb, "x")
        ob, out = xb, x
    else:
        _check_read(xb, "x")
        ob = _check_out(dev, out, xb.shape, xb.dtype)
        _check_disjoint(xb, ob)
    _run(comm, dev, "allreduce", xb, ob, count=xb.size, dtype=xb.dtype, op=rop, algorithm=algorithm, timeout=timeout)
    return out


def _reduce(
    comm: Any,
    dev: Any,
    x: Any,
    root: Any = 0,
    op: Any = ReduceOp.SUM,
    out: Any = None,
    algorithm: str = "auto",
    timeout: Any = None,
) -> Any:
    xb = _describe(dev, x, "x")
    _check_dtype(xb.dtype)
    _check_root(comm, root)
    rop = _check_op(op, xb.dtype)
    _check_algorithm(algorithm)
    _check_read(xb, "x")
    ob = None
    if comm.rank == root:
        if out is None:
            out, ob = _new(dev, xb.shape, xb.dtype)
        elif out is x:
            _check_written(xb, "x")
            ob = xb
        else:
            ob = _check_out(dev, out, xb.shape, xb.dtype)
            _check_disjoint(xb, ob)
    _run(
        comm,
        dev,
        "reduce",
        xb,
        ob,
        count=xb.size,
        dtype=xb.dtype,
        op=rop,
        root=root,
        algorithm=algorithm,
        timeout=timeout,
    )
    return out if comm.rank == root else None


def _broadcast(
    comm: Any, dev: Any, x: Any, root: Any = 0, out: Any = None, algorithm: str = "auto", timeout: Any = None
) -> Any:
    xb = _describe(dev, x, "x")
    _check_dtype(xb.dtype)
    _check_root(comm, root)
    _check_algorithm(algorithm)
    inplace = out is None or out is x
    if inplace:
        if comm.rank == root:
            _check_read(xb, "x")
        else:
            _check_written(xb, "x")
        ob, out = xb, x
    else:
        _check_read(xb, "x")
        ob = _check_out(dev, out, xb.shape, xb.dtype)
        _check_disjoint(xb, ob)
    _run(comm, dev, "broadcast", xb, ob, count=xb.size, dtype=xb.dtype, root=root, algorithm=algorithm, timeout=timeout)
    return out


def _allgather(comm: Any, dev: Any, x: Any, out: Any = None, algorithm: str = "auto", timeout: Any = None) -> Any:
    xb = _describe(dev, x, "x")
    _check_dtype(xb.dtype)
    _check_algorithm(algorithm)
    _check_read(xb, "x")
    shape = (comm.world_size, *xb.shape)
    if out is None:
        out, ob = _new(dev, shape, xb.dtype)
    else:
        ob = _check_out(dev, out, shape, xb.dtype)
        _is_block_of(comm, xb, ob, comm.rank)
    _run(comm, dev, "allgather", xb, ob, count=xb.size, dtype=xb.dtype, algorithm=algorithm, timeout=timeout)
    return out


def _gather(
    comm: Any, dev: Any, x: Any, root: Any = 0, out: Any = None, algorithm: str = "auto", timeout: Any = None
) -> Any:
    xb = _describe(dev, x, "x")
    _check_dtype(xb.dtype)
    _check_root(comm, root)
    _check_algorithm(algorithm)
    _check_read(xb, "x")
    ob = None
    if comm.rank == root:
        shape = (comm.world_size, *xb.shape)
        if out is None:
            out, ob = _new(dev, shape, xb.dtype)
        else:
            ob = _check_out(dev, out, shape, xb.dtype)
            _is_block_of(comm, xb, ob, root)
    _run(comm, dev, "gather", xb, ob, count=xb.size, dtype=xb.dtype, root=root, algorithm=algorithm, timeout=timeout)
    return out if comm.rank == root else None


def _scatter(
    comm: Any, dev: Any, x: Any, root: Any = 0, out: Any = None, algorithm: str = "auto", timeout: Any = None
) -> Any:
    _check_root(comm, root)
    _check_algorithm(algorithm)
    n = comm.world_size
    xb = None
    if comm.rank == root:
        xb = _describe(dev, x, "x")
        _check_dtype(xb.dtype)
        _check_read(xb, "x")
        if len(xb.shape) == 0 or xb.shape[0] != n:
            raise ValueError(f"scatter: root's x must have shape (world_size={n}, ...), got {xb.shape}")
        if out is None:
            out, ob = _new(dev, xb.shape[1:], xb.dtype)
        else:
            ob = _check_out(dev, out, xb.shape[1:], xb.dtype)
            _is_block_of(comm, ob, xb, root)
        dtype = xb.dtype
    else:
        if out is None:
            raise ValueError("scatter: non-root ranks must pass out= (it gives the shape and dtype)")
        ob = _describe(dev, out, "out")
        _check_dtype(ob.dtype)
        _check_written(ob, "out")
        dtype = ob.dtype
    _run(comm, dev, "scatter", xb, ob, count=ob.size, dtype=dtype, root=root, algorithm=algorithm, timeout=timeout)
    return out


def _reduce_scatter(
    comm: Any, dev: Any, x: Any, op: Any = ReduceOp.SUM, out: Any = None, algorithm: str = "auto", timeout: Any = None
) -> Any:
    xb = _describe(dev, x, "x")
    _check_dtype(xb.dtype)
    rop = _check_op(op, xb.dtype)
    _check_algorithm(algorithm)
    _check_read(xb, "x")
    n = comm.world_size
    if len(xb.shape) == 0 or xb.shape[0] % n:
        raise ValueError(f"reduce_scatter: x.shape[0] must be divisible by world_size={n}, got shape {xb.shape}")
    shape = (xb.shape[0] // n, *xb.shape[1:])
    if out is None:
        out, ob = _new(dev, shape, xb.dtype)
    else:
        ob = _check_out(dev, out, shape, xb.dtype)
        _is_block_of(comm, ob, xb, comm.rank)
    _run(
        comm, dev, "reduce_scatter", xb, ob, count=ob.size, dtype=xb.dtype, op=rop, algorithm=algorithm, timeout=timeout
    )
    return out


def _alltoall(comm: Any, dev: Any, x: Any, out: Any = None, algorithm: str = "auto", timeout: Any = None) -> Any:
    xb = _describe(dev, x, "x")
    _check_dtype(xb.dtype)
    _check_algorithm(algorithm)
    n = comm.world_size
    if len(xb.shape) == 0 or xb.shape[0] != n:
        raise ValueError(f"alltoall: x must have shape (world_size={n}, ...), got {xb.shape}")
    if out is x:
        _check_written(xb, "x")
        ob = xb
    else:
        _check_read(xb, "x")
        if out is None:
            out, ob = _new(dev, xb.shape, xb.dtype)
        else:
            ob = _check_out(dev, out, xb.shape, xb.dtype)
            _check_disjoint(xb, ob)
    _run(comm, dev, "alltoall", xb, ob, count=xb.size // n, dtype=xb.dtype, algorithm=algorithm, timeout=timeout)
    return out


def _p2p(comm: Any, dev: Any, name: str, x: Any, dst: Any = None, src: Any = None, timeout: Any = None) -> Any:
    if name == "send":
        buf = _describe(dev, x, "x")
        _check_read(buf, "x")
        _check_dtype(buf.dtype)
        _check_peer(comm, dst, "dst")
        peer = dst
    else:
        buf = _describe(dev, x, "buf")
        _check_written(buf, "buf")
        _check_dtype(buf.dtype)
        _check_peer(comm, src, "src")
        peer = src
    try:
        _engine(comm).p2p(comm, name == "send", buf, int(peer), timeout)
    except BaseException as exc:
        _fail(comm, name, exc)
        raise
    return None if name == "send" else x


_COLLECTIVES: dict[str, Any] = {
    "allreduce": _allreduce,
    "reduce": _reduce,
    "broadcast": _broadcast,
    "allgather": _allgather,
    "gather": _gather,
    "scatter": _scatter,
    "reduce_scatter": _reduce_scatter,
    "alltoall": _alltoall,
}
