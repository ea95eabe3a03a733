"""The Communicator: the methods users call. Each binds its arguments and runs the bound call.

Every method here is a few lines: a binder from :mod:`shmcoll.comm.bind` checks the arguments and
finds the call shape, and :meth:`~shmcoll.comm.runtime.Runtime._run` executes it. The facts about
each collective come from its record in :mod:`shmcoll.collectives`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from shmcoll import collectives
from shmcoll.comm import arrays, bind, device, failures, groups, objects, registered
from shmcoll.comm.runtime import Runtime
from shmcoll.shm import layout
from shmcoll.shm.arena import Arena
from shmcoll.shm.registered import SharedArray
from shmcoll.types import ReduceOp

_ALLREDUCE = collectives.BY_NAME["allreduce"]
_REDUCE = collectives.BY_NAME["reduce"]
_BROADCAST = collectives.BY_NAME["broadcast"]
_ALLGATHER = collectives.BY_NAME["allgather"]
_GATHER = collectives.BY_NAME["gather"]
_SCATTER = collectives.BY_NAME["scatter"]
_REDUCE_SCATTER = collectives.BY_NAME["reduce_scatter"]
_ALLTOALL = collectives.BY_NAME["alltoall"]


class Communicator(Runtime):
    """A group of ranks that run collectives together; create one with :func:`shmcoll.spawn`,
    :meth:`shmcoll.Group.connect` or :func:`shmcoll.init`.

    Every method is collective over the communicator's ranks (except :meth:`send`,
    :meth:`recv` and :meth:`probe`): every rank calls it, in the same order, with matching
    arguments. Arrays are C-contiguous numpy arrays of any shape, treated as flat (also arrays
    from :meth:`alloc`, and CUDA device arrays with the ``cuda`` extra). Collectives take
    ``algorithm=`` (``"auto"`` or a registered name) and every method that communicates takes
    ``timeout=`` (seconds, ``inf`` for no limit; default: the communicator's, ``SHMCOLL_TIMEOUT``).
    Results are bitwise identical on every rank.

    **Errors.** Wrong use raises ``ValueError``/``TypeError`` on the calling rank before any
    communication, and the communicator stays usable. Problems between ranks raise a
    :class:`~shmcoll.ShmcollError` on every rank involved (a dead peer, a timeout, mismatched
    calls), after which the communicator is broken.

    **Threads and processes.** Calls on one communicator must not overlap: a call made while
    another thread (or a signal handler) is in one raises :class:`~shmcoll.ConcurrentCallError`
    at once, before it does anything. A communicator belongs to the process that connected it:
    in a forked child every call (and ``close``) raises
    :class:`~shmcoll.ForkedCommunicatorError` and leaves the shared state alone.
    """

    def __init__(self, arena: Arena, rank: int, *, timeout: float | None = None) -> None:
        super().__init__(arena, rank, timeout=timeout)
        self._allocation_ids = itertools.count()  # the same on every rank: alloc is collective

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "ok")
        return f"<shmcoll.Communicator rank {self._rank} of {self._world_size} ({state})>"

    # --- collectives --------------------------------------------------------------------------
    def allreduce(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Combine ``x`` element-wise across ranks; every rank gets the result.

        Args:
            x: this rank's contribution.
            op: a :class:`~shmcoll.ReduceOp`, its value or its name (``"sum"``).
            out: where the result goes (same shape and dtype as ``x``); ``None`` or ``x``
                itself: in place.
        Returns:
            The result: ``out``, or ``x`` when in place.
        """
        return self._run(bind.elementwise(self, _ALLREDUCE, x, out, op, 0, algorithm), timeout)  # type: ignore[no-any-return]

    def reduce(
        self,
        x: np.ndarray,
        root: int = 0,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray | None:
        """Combine ``x`` element-wise across ranks onto ``root``.

        Returns:
            On ``root`` the result (in ``out`` if given, else a new array; ``out=x`` reduces in
            place); ``None`` elsewhere.
        """
        return self._run(bind.elementwise(self, _REDUCE, x, out, op, root, algorithm), timeout)  # type: ignore[no-any-return]

    def broadcast(
        self,
        x: np.ndarray,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Copy root's ``x`` to every rank: in place in ``x`` (or into ``out``).

        Returns:
            ``x`` (or ``out``), holding root's data on every rank.
        """
        return self._run(bind.elementwise(self, _BROADCAST, x, out, None, root, algorithm), timeout)  # type: ignore[no-any-return]

    def allgather(
        self, x: np.ndarray, *, out: np.ndarray | None = None, algorithm: str = "auto", timeout: float | None = None
    ) -> np.ndarray:
        """Every rank's ``x``, stacked: shape ``(world_size, *x.shape)`` on every rank.

        ``x`` may be ``out[rank]`` itself (in place).
        """
        return self._run(bind.gathering(self, _ALLGATHER, x, out, 0, algorithm), timeout)  # type: ignore[no-any-return]

    def gather(
        self,
        x: np.ndarray,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray | None:
        """Every rank's ``x`` stacked on ``root`` (shape ``(world_size, *x.shape)``); ``None``
        elsewhere. On the root, ``x`` may be ``out[root]`` (in place)."""
        return self._run(bind.gathering(self, _GATHER, x, out, root, algorithm), timeout)  # type: ignore[no-any-return]

    def scatter(
        self,
        x: np.ndarray | None,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Block ``j`` of root's ``x`` (shape ``(world_size, *shape)``) to rank ``j``.

        Non-root ranks pass ``x=None`` and must give ``out`` (it fixes the shape and dtype);
        the root may omit it, or pass ``out=x[root]`` (in place). Returns ``out``.
        """
        return self._run(bind.scattering(self, _SCATTER, x, out, None, root, algorithm), timeout)  # type: ignore[no-any-return]

    def reduce_scatter(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Combine ``x`` across ranks and give rank ``j`` block ``j`` of the result.

        ``x.shape[0]`` must be divisible by ``world_size``; the result has shape
        ``(x.shape[0] // world_size, *x.shape[1:])``. ``out=x[rank block]`` works in place.
        """
        return self._run(bind.scattering(self, _REDUCE_SCATTER, x, out, op, 0, algorithm), timeout)  # type: ignore[no-any-return]

    def alltoall(
        self, x: np.ndarray, *, out: np.ndarray | None = None, algorithm: str = "auto", timeout: float | None = None
    ) -> np.ndarray:
        """Block ``j`` of each rank's ``x`` goes to rank ``j``: ``out[i]`` = rank ``i``'s
        ``x[rank]``. ``x.shape[0]`` must be ``world_size``; ``out=x`` works in place."""
        return self._run(bind.elementwise(self, _ALLTOALL, x, out, None, 0, algorithm), timeout)  # type: ignore[no-any-return]

    def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every rank has entered the barrier."""
        self._run(bind.barrier(self), timeout)

    # --- point to point -----------------------------------------------------------------------
    def send(self, x: np.ndarray, dst: int, *, timeout: float | None = None) -> None:
        """Send ``x`` to rank ``dst``; returns once the data is in shared memory.

        Sends and receives between two ranks share the ordered channels that collectives use:
        interleave them in the same order on both ranks.
        """
        self._run(bind.point_to_point(self, True, x, dst), timeout)

    def recv(self, buf: np.ndarray, src: int, *, timeout: float | None = None) -> np.ndarray:
        """Receive into ``buf`` what rank ``src`` sent (same size and dtype); returns ``buf``."""
        return self._run(bind.point_to_point(self, False, buf, src), timeout)  # type: ignore[no-any-return]

    def probe(self, src: int) -> bool:
        """Whether a message from rank ``src`` is waiting (non-blocking; like ``MPI_Iprobe``).

        True means the next ``recv(..., src=src)`` will not wait for ``src`` to send. Channels are
        ordered and shared with collectives, so only probe where the next message from ``src``
        is a point-to-point one.
        """
        self._check_usable()
        arrays.check_peer(src, "src", self._rank, self._world_size)
        lay = self._arena.layout
        ch = lay.channel(src, self._rank)
        head = self._arena.word(lay.channel_word(ch, layout.C_HEAD))
        return head > int(self._ctrl[lay.channel_word(ch, layout.C_TAIL)])

    # --- registered buffers -------------------------------------------------------------------
    def alloc(
        self, shape: int | Sequence[int], dtype: Any = np.float64, *, timeout: float | None = None
    ) -> SharedArray:
        """A zero-filled array in shared memory that every rank maps (collective).

        Every rank must call it with the same shape and dtype, in the same order. Collectives on
        such arrays can read the peers' data in place (algorithm ``zerocopy``) when every rank
        passes its array from the same allocation, at the same place (``comm.allreduce(buf)``
        with ``buf = comm.alloc(...)`` on every rank); ``auto`` takes it where it is the faster
        choice (large calls: it saves a copy but costs barriers). The memory is released once no
        array views it any longer on any rank (or when the communicator closes).
        """
        return registered.alloc(self, shape, dtype, timeout)

    # --- object collectives -------------------------------------------------------------------
    def broadcast_object(self, obj: Any, root: int = 0, *, timeout: float | None = None) -> Any:
        """Root's picklable ``obj`` on every rank (root gets its own object back)."""
        return objects.broadcast_object(self, obj, root, timeout=timeout)

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """Every rank's picklable ``obj``, as a list indexed by rank, on every rank."""
        return objects.allgather_object(self, obj, timeout=timeout)

    def gather_object(self, obj: Any, root: int = 0, *, timeout: float | None = None) -> list[Any] | None:
        """Every rank's picklable ``obj`` as a list on ``root``; ``None`` elsewhere."""
        return objects.gather_object(self, obj, root, timeout=timeout)

    def scatter_object(self, objs: Sequence[Any] | None, root: int = 0, *, timeout: float | None = None) -> Any:
        """Element ``j`` of root's sequence ``objs`` (``world_size`` picklable objects) to rank
        ``j``; non-root ranks pass ``None``."""
        return objects.scatter_object(self, objs, root, timeout=timeout)

    # --- sub-communicators --------------------------------------------------------------------
    def split(self, color: int | None, key: int | None = None, *, timeout: float | None = None) -> Communicator | None:
        """New communicators, one per ``color``, ranked by ``(key, rank)``; collective.

        Ranks passing ``color=None`` take part but get ``None``. Close the result when done.
        """
        return groups.split(self, color, key, timeout)  # type: ignore[no-any-return]

    # --- lifetime -----------------------------------------------------------------------------
    def abort(self, reason: str = "", *, cause: BaseException | None = None) -> None:
        """Make every rank's pending and future calls fail with :class:`~shmcoll.CommunicatorBrokenError`.

        Args:
            reason: said in this rank's later errors.
            cause: the exception this rank failed with, if that is why it aborts: the peers
                then learn that this rank *failed* (as when a rank started by
                :func:`shmcoll.spawn` raises), not that it called ``abort()``.
        """
        if self._closed or self._is_forked():
            return
        if cause is not None:
            self._fail(f"{type(cause).__name__}: {cause}")
            return
        self._arena.abort(self._rank, layout.ABORT_USER, -1, failures.call_number(self))
        self._broken = f"rank {self._rank} called abort()" + (f": {reason}" if reason else "")

    def close(self) -> None:
        """Leave the communicator (peers waiting on this rank will get :class:`~shmcoll.PeerLostError`).

        In a forked child of the process that connected it, only this process's own view is
        dropped: the peers and the parent are not told anything.
        """
        if self._closed:
            return
        device.forget(self)  # (comm.device imports CUDA only when a device call needs it)
        self._close_runtime()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
