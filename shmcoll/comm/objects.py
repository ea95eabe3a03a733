"""Object collectives: picklable Python objects, moved by a few array collectives each.

Each runs inside ``comm._nested`` so that no other thread's call interleaves with its parts.
Errors that every rank learns alike (an object that does not pickle) are raised after that
block, on every rank, and leave the communicator usable; anything else that escapes half way
breaks it.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from shmcoll.comm.arrays import check_root


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
            everything = comm.allgather(_padded(payload, int(sizes.max())), timeout=timeout)
    if failure is not None:
        raise failure
    return [
        obj if r == comm.rank else pickle.loads(everything[r, : sizes[r]].tobytes()) for r in range(comm.world_size)
    ]


def gather_object(comm: Any, obj: Any, root: int = 0, *, timeout: float | None = None) -> list[Any] | None:
    """Every rank's picklable ``obj`` as a list on ``root``; ``None`` elsewhere."""
    check_root(root, comm.world_size)
    with comm._nested("gather_object", timeout):
        payload, error = _pickle(obj)
        sizes = comm.allgather(np.array([len(payload) if error is None else -1], np.int64), timeout=timeout)[:, 0]
        failure = _pickle_failure(comm, "gather_object", sizes, error)
        if failure is None:
            everything = comm.gather(_padded(payload, int(sizes.max())), root=root, timeout=timeout)
    if failure is not None:
        raise failure
    if everything is None:
        return None
    return [
        obj if r == comm.rank else pickle.loads(everything[r, : sizes[r]].tobytes()) for r in range(comm.world_size)
    ]


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


def _pickle(obj: Any) -> tuple[bytes, Exception | None]:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as exc:  # noqa: BLE001  (anything pickling raises is the user's error)
        return b"", exc


def _padded(payload: bytes, width: int) -> np.ndarray:
    block = np.zeros(width, np.uint8)
    block[: len(payload)] = np.frombuffer(payload, np.uint8)
    return block


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
