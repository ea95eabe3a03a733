"""Object collectives: picklable Python objects, moved by a few array collectives each.

Each runs inside ``comm._nested`` so that no other thread's call interleaves with its parts.
Errors that every rank learns alike (an object that does not pickle) are raised after that
block, on every rank, and leave the communicator usable; anything else that escapes half way
breaks it.
"""

from __future__ import annotations

import operator
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shmcoll.comm.arrays import as_op, check_root
from shmcoll.types import ReduceOp


def broadcast_object(comm: Any, obj: Any, root: int = 0, *, timeout: float | None = None) -> Any:
    """Root's picklable ``obj`` on every rank (root gets its own object back)."""
    check_root(root, comm.world_size)
    with comm._nested("broadcast_object", timeout):
        payload, error = _pickle(obj) if comm.rank == root else (b"", None)
        size = np.array([len(payload) if error is None else -1], dtype=np.int64)
        comm.broadcast(size, root=root, timeout=timeout)
        if size[0] >= 0:
            if comm.rank == root:
                buf = np.frombuffer(bytearray(payload), np.uint8)
            else:
                buf = np.empty(int(size[0]), np.uint8)
            comm.broadcast(buf, root=root, timeout=timeout)
    if size[0] < 0:
        if error is not None:
            raise TypeError(f"broadcast_object: cannot pickle the object: {error}") from error
        raise ValueError(f"broadcast_object: root rank {root} could not pickle its object")
    return obj if comm.rank == root else pickle.loads(buf.tobytes())


def allgather_object(comm: Any, obj: Any, *, timeout: float | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, as a list indexed by rank, on every rank."""
    with comm._nested("allgather_object", timeout):
        payload, error = _pickle(obj)
        sizes = comm.allgather(np.array([len(payload) if error is None else -1], np.int64), timeout=timeout)[:, 0]
        failure = _pickle_failure(comm, "allgather_object", sizes, error)
        if failure is None:
            everything = comm.allgatherv(np.frombuffer(payload, np.uint8), sizes, timeout=timeout)
    if failure is not None:
        raise failure
    return _unpickled(comm, obj, everything, sizes)


def gather_object(comm: Any, obj: Any, root: int = 0, *, timeout: float | None = None) -> list[Any] | None:
    """Every rank's picklable ``obj`` as a list on ``root``; ``None`` elsewhere."""
    check_root(root, comm.world_size)
    with comm._nested("gather_object", timeout):
        payload, error = _pickle(obj)
        sizes = comm.allgather(np.array([len(payload) if error is None else -1], np.int64), timeout=timeout)[:, 0]
        failure = _pickle_failure(comm, "gather_object", sizes, error)
        if failure is None:
            everything = comm.gatherv(np.frombuffer(payload, np.uint8), sizes, root=root, timeout=timeout)
    if failure is not None:
        raise failure
    if everything is None:
        return None
    return _unpickled(comm, obj, everything, sizes)


def scatter_object(comm: Any, objs: Sequence[Any] | None, root: int = 0, *, timeout: float | None = None) -> Any:
    """Element ``j`` of root's sequence ``objs`` to rank ``j``."""
    check_root(root, comm.world_size)
    error: Exception | None = None
    payloads: list[bytes] = []
    if comm.rank == root:
        if objs is None or len(objs) != comm.world_size:
            got = "None" if objs is None else f"{len(objs)} objects"
            error = ValueError(
                f"scatter_object: root needs a sequence of world_size={comm.world_size} objects, got {got}"
            )
        else:
            for o in objs:
                p, pickle_error = _pickle(o)
                if pickle_error is not None:
                    error = TypeError(f"scatter_object: cannot pickle an object: {pickle_error}")
                    error.__cause__ = pickle_error
                    break
                payloads.append(p)
    with comm._nested("scatter_object", timeout):
        if comm.rank == root and error is None:
            sizes = np.array([len(p) for p in payloads], np.int64)
        else:
            sizes = np.full(comm.world_size, -1, np.int64)  # non-roots: overwritten by the broadcast
        comm.broadcast(sizes, root=root, timeout=timeout)
        if sizes[0] >= 0:
            width = int(sizes.max()) if len(sizes) else 0
            blocks = np.zeros((comm.world_size, width), np.uint8)
            if comm.rank == root:
                for r, p in enumerate(payloads):
                    blocks[r, : len(p)] = np.frombuffer(p, np.uint8)
            mine = np.empty(width, np.uint8)
            comm.scatter(blocks if comm.rank == root else None, root=root, out=mine, timeout=timeout)
    if sizes[0] < 0:
        if error is not None:
            raise error
        raise ValueError(f"scatter_object: root rank {root} could not scatter its objects (see its error)")
    if comm.rank == root:
        return objs[root]  # type: ignore[index]
    return pickle.loads(mine[: sizes[comm.rank]].tobytes())


def alltoall_object(comm: Any, objs: Sequence[Any], *, timeout: float | None = None) -> list[Any]:
    """Element ``j`` of each rank's sequence ``objs`` to rank ``j``: a list indexed by the sender."""
    n = comm.world_size
    if isinstance(objs, (str, bytes)) or not hasattr(objs, "__len__") or len(objs) != n:
        got = f"{len(objs)} objects" if hasattr(objs, "__len__") else type(objs).__name__
        raise ValueError(f"alltoall_object: needs a sequence of world_size={n} objects, got {got}")
    payloads: list[bytes] = []
    error: Exception | None = None
    for o in objs:
        p, error = _pickle(o)
        if error is not None:
            break
        payloads.append(p)
    with comm._nested("alltoall_object", timeout):
        # A rank that cannot pickle sends -1 to everyone: every rank learns of every failure.
        sends = np.array([len(p) for p in payloads] if error is None else [-1] * n, np.int64)
        recvs = comm.alltoall(sends, timeout=timeout)
        failure = _pickle_failure(comm, "alltoall_object", recvs, error)
        if failure is None:
            flat = np.frombuffer(b"".join(payloads), np.uint8)
            everything = comm.alltoallv(flat, sends, recvs, timeout=timeout)
    if failure is not None:
        raise failure
    return _unpickled(comm, objs[comm.rank], everything, recvs)


def allreduce_object(comm: Any, obj: Any, op: Any = ReduceOp.SUM, *, timeout: float | None = None) -> Any:
    """Every rank's ``obj`` combined with ``op`` in rank order; the same result on every rank."""
    fold = _folder(op)
    return _fold(fold, comm.allgather_object(obj, timeout=timeout))


def reduce_object(comm: Any, obj: Any, op: Any = ReduceOp.SUM, root: int = 0, *, timeout: float | None = None) -> Any:
    """Every rank's ``obj`` combined with ``op`` in rank order, on ``root``; ``None`` elsewhere."""
    fold = _folder(op)
    objs = comm.gather_object(obj, root=root, timeout=timeout)
    return None if objs is None else _fold(fold, objs)


_OPERATORS: dict[ReduceOp, Callable[[Any, Any], Any]] = {
    ReduceOp.SUM: operator.add,
    ReduceOp.AVG: operator.add,  # then divided by the number of ranks
    ReduceOp.PROD: operator.mul,
    ReduceOp.MIN: min,
    ReduceOp.MAX: max,
    ReduceOp.BAND: operator.and_,
    ReduceOp.BOR: operator.or_,
    ReduceOp.BXOR: operator.xor,
}


def _folder(op: Any) -> tuple[Callable[[Any, Any], Any], bool]:
    """(the two-argument function ``op`` names, whether to divide by the count: AVG)."""
    if callable(op) and not isinstance(op, (ReduceOp, int, str)):
        return op, False
    reduce_op = as_op(op)
    return _OPERATORS[reduce_op], reduce_op == ReduceOp.AVG


def _fold(fold: tuple[Callable[[Any, Any], Any], bool], objs: list[Any]) -> Any:
    # Left to right in rank order on every rank: the same operations, so the same result.
    fn, average = fold
    acc = objs[0]
    for o in objs[1:]:
        acc = fn(acc, o)
    return acc / len(objs) if average else acc


def _unpickled(comm: Any, own: Any, flat: np.ndarray, sizes: np.ndarray) -> list[Any]:
    """The objects in ``flat`` (the payloads of ``sizes`` bytes, back to back), by rank; this
    rank's own is ``own`` itself (not a copy through pickle)."""
    out, at = [], 0
    for r, size in enumerate(sizes):
        size = int(size)
        out.append(own if r == comm.rank else pickle.loads(flat[at : at + size].tobytes()))
        at += size
    return out


def _pickle(obj: Any) -> tuple[bytes, Exception | None]:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as exc:  # noqa: BLE001  (anything pickling raises is the user's error)
        return b"", exc


def _pickle_failure(comm: Any, what: str, sizes: np.ndarray, error: Exception | None) -> Exception | None:
    """The error every rank raises when some rank's object did not pickle (sizes -1)."""
    failed = [int(r) for r in np.flatnonzero(sizes < 0)]
    if not failed:
        return None
    if error is not None:
        exc: Exception = TypeError(f"{what}: cannot pickle rank {comm.rank}'s object: {error}")
        exc.__cause__ = error
        return exc
    return ValueError(f"{what}: rank(s) {failed} could not pickle their objects")
