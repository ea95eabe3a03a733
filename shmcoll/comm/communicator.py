"""The Communicator: the methods users call. Each binds its arguments and runs the bound call.

Every method here is a few lines: a binder from :mod:`shmcoll.comm.bind` checks the arguments and
finds the call shape, and :meth:`~shmcoll.comm.runtime.Runtime._run` executes it. The facts about
each collective come from its record in :mod:`shmcoll.collectives`.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shmcoll import collectives, config
from shmcoll.comm import arrays, bind, device, failures, groups, objects, registered
from shmcoll.comm import p2p as p2p_module
from shmcoll.comm.p2p import ANY_SOURCE, ANY_TAG, Status
from shmcoll.comm.requests import Request
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
_ALLGATHERV = collectives.BY_NAME["allgatherv"]
_GATHERV = collectives.BY_NAME["gatherv"]
_SCATTERV = collectives.BY_NAME["scatterv"]
_REDUCE_SCATTERV = collectives.BY_NAME["reduce_scatterv"]
_ALLTOALLV = collectives.BY_NAME["alltoallv"]
_SCAN = collectives.BY_NAME["scan"]
_EXSCAN = collectives.BY_NAME["exscan"]


Counts = Sequence[int] | np.ndarray
"""Counts of elements, one per rank: a sequence of ints or a 1-d integer array."""


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
        counts: Counts | None = None,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Combine ``x`` across ranks and give rank ``j`` block ``j`` of the result.

        Without ``counts``, ``x.shape[0]`` must be divisible by ``world_size`` and the result
        has shape ``(x.shape[0] // world_size, *x.shape[1:])``. With ``counts`` (elements per
        rank, the same on every rank, zeros allowed), ``x`` is flat with ``sum(counts)``
        elements and rank ``j`` gets the ``counts[j]`` elements from ``sum(counts[:j])`` on (a
        1-d array unless ``out`` is given). Either way ``out`` may be this rank's block of ``x``
        (in place).
        """
        return self._run(self._bind_reduce_scatter(x, op, counts, out, algorithm), timeout)  # type: ignore[no-any-return]

    def _bind_reduce_scatter(self, x: Any, op: Any, counts: Any, out: Any, algorithm: str) -> Any:
        if counts is None:
            return bind.scattering(self, _REDUCE_SCATTER, x, out, op, 0, algorithm)
        return bind.varying(self, _REDUCE_SCATTERV, x, out, counts, op, 0, algorithm)

    def alltoall(
        self, x: np.ndarray, *, out: np.ndarray | None = None, algorithm: str = "auto", timeout: float | None = None
    ) -> np.ndarray:
        """Block ``j`` of each rank's ``x`` goes to rank ``j``: ``out[i]`` = rank ``i``'s
        ``x[rank]``. ``x.shape[0]`` must be ``world_size``; ``out=x`` works in place."""
        return self._run(bind.elementwise(self, _ALLTOALL, x, out, None, 0, algorithm), timeout)  # type: ignore[no-any-return]

    def allgatherv(
        self,
        x: np.ndarray,
        counts: Counts | None = None,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Every rank's ``x``, of ``counts[rank]`` elements, back to back in rank order on every rank.

        Args:
            x: this rank's block (any shape; its elements count).
            counts: elements per rank, the same on every rank (zeros allowed). ``None`` on every
                rank: the counts are learned first, with an allgather of the sizes.
            out: ``sum(counts)`` elements of ``x``'s dtype (default: a new 1-d array); ``x`` may
                be this rank's block of it (in place).
        Returns:
            ``out``: rank ``j``'s elements from ``sum(counts[:j])`` on.
        """
        if counts is None:
            with self._nested("allgatherv", timeout):
                counts = self._learned_counts(x, timeout)
                return self.allgatherv(x, counts, out=out, algorithm=algorithm, timeout=timeout)
        return self._run(bind.varying(self, _ALLGATHERV, x, out, counts, None, 0, algorithm), timeout)  # type: ignore[no-any-return]

    def _learned_counts(self, x: Any, timeout: float | None) -> np.ndarray:
        view = x if isinstance(x, np.ndarray) else arrays.not_host_array("x", x)
        return self.allgather(np.array([view.size], np.int64), timeout=timeout).reshape(-1)  # type: ignore[no-any-return]

    def gatherv(
        self,
        x: np.ndarray,
        counts: Counts | None = None,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray | None:
        """Every rank's ``x``, of ``counts[rank]`` elements, back to back in rank order on ``root``.

        ``counts`` is required on the root; elsewhere it may be ``None`` (each rank's ``x``
        gives its count). On the root ``out`` has ``sum(counts)`` elements (default: a new 1-d
        array) and ``x`` may be its block of it (in place). Returns the result on ``root``,
        ``None`` elsewhere.
        """
        return self._run(bind.varying(self, _GATHERV, x, out, counts, None, root, algorithm), timeout)  # type: ignore[no-any-return]

    def scatterv(
        self,
        x: np.ndarray | None,
        counts: Counts | None = None,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """The ``counts[j]`` elements of root's flat ``x`` from ``sum(counts[:j])`` on, to rank ``j``.

        ``counts`` is required on the root; elsewhere it may be ``None``. Non-root ranks pass
        ``x=None`` and must give ``out`` (its size and dtype say what they receive); the root
        may omit it (a new 1-d array) or pass its block of ``x`` (in place). Returns ``out``.
        """
        return self._run(bind.varying(self, _SCATTERV, x, out, counts, None, root, algorithm), timeout)  # type: ignore[no-any-return]

    def alltoallv(
        self,
        x: np.ndarray,
        send_counts: Counts,
        recv_counts: Counts | None = None,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Rank ``j`` gets the ``send_counts[j]`` elements of this rank's flat ``x`` from
        ``sum(send_counts[:j])`` on; ``out`` holds what each rank sent this one, in rank order.

        Args:
            send_counts: elements for each rank (``x`` has ``sum(send_counts)``).
            recv_counts: elements from each rank: rank ``i``'s ``send_counts[this rank]``.
                ``None``: learned first, with an alltoall of the send counts.
            out: ``sum(recv_counts)`` elements of ``x``'s dtype, disjoint from ``x`` (default:
                a new 1-d array). alltoallv never runs in place.
        """
        if recv_counts is None:
            sends = np.array(arrays.check_counts(send_counts, "send_counts", self._world_size), np.int64)
            view = x if isinstance(x, np.ndarray) else arrays.not_host_array("x", x)
            arrays.check_size(view, "x", int(sends.sum()), "sum(send_counts)")  # (before communicating)
            with self._nested("alltoallv", timeout):
                recv_counts = self.alltoall(sends, timeout=timeout)
                return self.alltoallv(x, sends, recv_counts, out=out, algorithm=algorithm, timeout=timeout)
        b = bind.varying(self, _ALLTOALLV, x, out, send_counts, None, 0, algorithm, recv_counts)
        return self._run(b, timeout)  # type: ignore[no-any-return]

    def scan(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Inclusive prefix reduction: rank ``r`` gets ``x_0 (op) x_1 (op) ... (op) x_r``,
        element-wise, combined in rank order. ``op`` is any op but ``AVG``; ``out=None`` or
        ``x``: in place. Returns the result."""
        return self._run(bind.elementwise(self, _SCAN, x, out, op, 0, algorithm), timeout)  # type: ignore[no-any-return]

    def exscan(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Exclusive prefix reduction: rank ``r > 0`` gets ``x_0 (op) ... (op) x_{r-1}``; rank 0
        gets the op's identity (0 for SUM, BOR, BXOR; 1 for PROD; all bits set for BAND; for
        MIN/MAX the dtype's largest/smallest value, ``inf``/``-inf`` for floats), where MPI
        leaves it undefined. ``op`` is any op but ``AVG``; ``out=None`` or ``x``: in place."""
        return self._run(bind.elementwise(self, _EXSCAN, x, out, op, 0, algorithm), timeout)  # type: ignore[no-any-return]

    def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every rank has entered the barrier."""
        self._run(bind.barrier(self), timeout)

    # --- nonblocking collectives ---------------------------------------------------------------
    # Each starts the blocking method's operation and returns a Request at once; req.wait()
    # returns what the blocking method returns. Operations complete in the order they were
    # started (blocking calls included), and the buffers given to one belong to it until its
    # wait() returns: do not read its output or write its input before then.
    def iallreduce(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`allreduce`; returns its :class:`~shmcoll.Request` (``x``, ``out`` belong
        to it until ``wait`` returns)."""
        return self._start(bind.elementwise(self, _ALLREDUCE, x, out, op, 0, algorithm), timeout, "iallreduce")

    def ireduce(
        self,
        x: np.ndarray,
        root: int = 0,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`reduce`; returns its :class:`~shmcoll.Request`."""
        return self._start(bind.elementwise(self, _REDUCE, x, out, op, root, algorithm), timeout, "ireduce")

    def ibroadcast(
        self,
        x: np.ndarray,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`broadcast`; returns its :class:`~shmcoll.Request`."""
        return self._start(bind.elementwise(self, _BROADCAST, x, out, None, root, algorithm), timeout, "ibroadcast")

    def iallgather(
        self, x: np.ndarray, *, out: np.ndarray | None = None, algorithm: str = "auto", timeout: float | None = None
    ) -> Request:
        """Start :meth:`allgather`; returns its :class:`~shmcoll.Request`."""
        return self._start(bind.gathering(self, _ALLGATHER, x, out, 0, algorithm), timeout, "iallgather")

    def igather(
        self,
        x: np.ndarray,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`gather`; returns its :class:`~shmcoll.Request`."""
        return self._start(bind.gathering(self, _GATHER, x, out, root, algorithm), timeout, "igather")

    def iscatter(
        self,
        x: np.ndarray | None,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`scatter`; returns its :class:`~shmcoll.Request`."""
        return self._start(bind.scattering(self, _SCATTER, x, out, None, root, algorithm), timeout, "iscatter")

    def ireduce_scatter(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        counts: Counts | None = None,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`reduce_scatter`; returns its :class:`~shmcoll.Request`."""
        return self._start(self._bind_reduce_scatter(x, op, counts, out, algorithm), timeout, "ireduce_scatter")

    def ialltoall(
        self, x: np.ndarray, *, out: np.ndarray | None = None, algorithm: str = "auto", timeout: float | None = None
    ) -> Request:
        """Start :meth:`alltoall`; returns its :class:`~shmcoll.Request`."""
        return self._start(bind.elementwise(self, _ALLTOALL, x, out, None, 0, algorithm), timeout, "ialltoall")

    def iallgatherv(
        self,
        x: np.ndarray,
        counts: Counts,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`allgatherv` (``counts`` required); returns its :class:`~shmcoll.Request`."""
        if counts is None:
            raise ValueError("iallgatherv: counts is required (allgatherv learns them, blocking)")
        b = bind.varying(self, _ALLGATHERV, x, out, counts, None, 0, algorithm)
        return self._start(b, timeout, "iallgatherv")

    def igatherv(
        self,
        x: np.ndarray,
        counts: Counts | None = None,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`gatherv`; returns its :class:`~shmcoll.Request`."""
        return self._start(bind.varying(self, _GATHERV, x, out, counts, None, root, algorithm), timeout, "igatherv")

    def iscatterv(
        self,
        x: np.ndarray | None,
        counts: Counts | None = None,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`scatterv`; returns its :class:`~shmcoll.Request`."""
        return self._start(bind.varying(self, _SCATTERV, x, out, counts, None, root, algorithm), timeout, "iscatterv")

    def ialltoallv(
        self,
        x: np.ndarray,
        send_counts: Counts,
        recv_counts: Counts,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`alltoallv` (``recv_counts`` required); returns its :class:`~shmcoll.Request`."""
        if recv_counts is None:
            raise ValueError("ialltoallv: recv_counts is required (alltoallv learns them, blocking)")
        b = bind.varying(self, _ALLTOALLV, x, out, send_counts, None, 0, algorithm, recv_counts)
        return self._start(b, timeout, "ialltoallv")

    def iscan(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`scan`; returns its :class:`~shmcoll.Request`."""
        return self._start(bind.elementwise(self, _SCAN, x, out, op, 0, algorithm), timeout, "iscan")

    def iexscan(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`exscan`; returns its :class:`~shmcoll.Request`."""
        return self._start(bind.elementwise(self, _EXSCAN, x, out, op, 0, algorithm), timeout, "iexscan")

    def ibarrier(self, *, timeout: float | None = None) -> Request:
        """Start :meth:`barrier`; returns its :class:`~shmcoll.Request`."""
        return self._start(bind.barrier(self), timeout, "ibarrier")

    # --- point to point -----------------------------------------------------------------------
    # Messages travel apart from the collectives (see comm.p2p): tags, ANY_SOURCE/ANY_TAG,
    # probes that see only point-to-point messages, sends to oneself. Messages between one pair
    # of ranks with the same tag arrive in order.
    def send(self, x: np.ndarray, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send ``x`` to rank ``dst`` with ``tag`` (an int >= 0); returns once the message is in
        shared memory (a message larger than the mailbox waits for the receiver to take its
        beginning)."""
        if type(x) is not np.ndarray:
            x = self._p2p_array(x, dst, tag, True)
            if x is None:
                return
        self._point_to_point().send(x, dst, tag, self._valid_timeout(timeout), True).wait()

    def recv(
        self, buf: np.ndarray, src: int = ANY_SOURCE, tag: int = ANY_TAG, *, timeout: float | None = None
    ) -> Status:
        """Receive into ``buf`` a message from ``src`` (or any rank) with ``tag`` (or any tag).

        ``buf`` must have the message's dtype and room for it (it may be larger).

        Returns:
            The message's :class:`~shmcoll.Status`: ``source``, ``tag``, ``count`` (elements).
        Raises:
            ValueError/TypeError: the matching message is larger than ``buf``, or of another
                dtype (it stays, to be received into a fitting buffer).
        """
        if type(buf) is not np.ndarray:
            status = self._p2p_array(buf, src, tag, False)
            if isinstance(status, Status):
                return status
            buf = status
        return self._point_to_point().recv(buf, src, tag, self._valid_timeout(timeout), True).wait()  # type: ignore[no-any-return]

    def isend(self, x: np.ndarray, dst: int, tag: int = 0, *, timeout: float | None = None) -> Request:
        """Start :meth:`send`; returns its :class:`~shmcoll.Request` (``x`` belongs to it until
        ``wait`` returns)."""
        x = self._host_array(x, "x")
        return self._point_to_point().send(x, dst, tag, self._valid_timeout(timeout), False)

    def irecv(
        self, buf: np.ndarray, src: int = ANY_SOURCE, tag: int = ANY_TAG, *, timeout: float | None = None
    ) -> Request:
        """Start :meth:`recv`; its :class:`~shmcoll.Request`'s ``wait`` returns the
        :class:`~shmcoll.Status` (``buf`` belongs to it until then)."""
        buf = self._host_array(buf, "buf")
        return self._point_to_point().recv(buf, src, tag, self._valid_timeout(timeout), False)

    def sendrecv(
        self,
        x: np.ndarray,
        dst: int,
        buf: np.ndarray,
        src: int = ANY_SOURCE,
        *,
        sendtag: int = 0,
        recvtag: int = ANY_TAG,
        timeout: float | None = None,
    ) -> Status:
        """Send ``x`` to ``dst`` and receive into ``buf`` from ``src`` at once (no deadlock when
        two ranks exchange); returns the receive's :class:`~shmcoll.Status`."""
        sent = self.isend(x, dst, sendtag, timeout=timeout)
        status = self.recv(buf, src, recvtag, timeout=timeout)
        sent.wait()
        return status

    def probe(self, src: int = ANY_SOURCE, tag: int = ANY_TAG, *, timeout: float | None = None) -> Status:
        """Wait until a point-to-point message from ``src`` with ``tag`` can be received, and
        return its :class:`~shmcoll.Status` without receiving it (``count`` in the sender's
        elements). Collective traffic is never seen."""
        status = self._point_to_point().probe(src, tag, self._valid_timeout(timeout), True)
        assert status is not None
        return status

    def iprobe(self, src: int = ANY_SOURCE, tag: int = ANY_TAG) -> Status | None:
        """:meth:`probe` without waiting: the :class:`~shmcoll.Status` of a message that can be
        received now, or ``None``."""
        return self._point_to_point().probe(src, tag, None, False)

    def send_object(self, obj: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send a picklable ``obj`` to ``dst`` with ``tag``."""
        try:
            payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        except Exception as exc:  # noqa: BLE001  (anything pickling raises is the caller's error)
            raise TypeError(f"send_object: cannot pickle the object: {exc}") from exc
        p2p = self._point_to_point()
        p2p.send(payload, dst, tag, self._valid_timeout(timeout), True, dtype_code=p2p_module.OBJECT_DTYPE).wait()

    def recv_object(self, src: int = ANY_SOURCE, tag: int = ANY_TAG, *, timeout: float | None = None) -> Any:
        """The next object sent with :meth:`send_object` from ``src`` with ``tag``."""
        req = self._point_to_point().recv(None, src, tag, self._valid_timeout(timeout), True, allocate=True)
        payload, _ = req.wait()
        return pickle.loads(payload.tobytes())

    def _point_to_point(self) -> p2p_module.PointToPoint:
        p2p = self._p2p
        if p2p is None:
            self._check_usable()
            p2p = self._p2p = p2p_module.PointToPoint(self)
        return p2p

    def _valid_timeout(self, timeout: float | None) -> float | None:
        return None if timeout is None else config.timeout_s(timeout)

    def _host_array(self, a: Any, name: str) -> np.ndarray:
        """A numpy view of any array point-to-point takes in a nonblocking call."""
        if type(a) is np.ndarray:
            return a
        if isinstance(a, np.ndarray):
            return a.view(np.ndarray)
        if device.is_device(a):
            raise TypeError(f"{name}: nonblocking point-to-point takes host arrays (device arrays: send/recv)")
        return arrays.not_host_array(name, a)

    def _p2p_array(self, a: Any, peer: int, tag: int, send: bool) -> Any:
        """A blocking send/recv's array that is not a plain ndarray: a device array is staged
        through host memory (and done here: returns None, or the Status); others become views."""
        if device.is_device(a):
            return device.point_to_point(self, send, a, peer, tag, None)
        return self._host_array(a, "x" if send else "buf")

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

    def alltoall_object(self, objs: Sequence[Any], *, timeout: float | None = None) -> list[Any]:
        """Element ``j`` of this rank's sequence ``objs`` (``world_size`` picklable objects) to
        rank ``j``; returns the objects sent to this rank, as a list indexed by sender."""
        return objects.alltoall_object(self, objs, timeout=timeout)

    def allreduce_object(
        self,
        obj: Any,
        op: ReduceOp | int | str | Callable[[Any, Any], Any] = ReduceOp.SUM,
        *,
        timeout: float | None = None,
    ) -> Any:
        """Every rank's picklable ``obj`` combined with ``op``, on every rank.

        ``op`` is a :class:`~shmcoll.ReduceOp` applied with Python's operators (``+``, ``*``,
        ``min``, ``max``, ``&``, ``|``, ``^``; ``AVG`` divides the sum by ``world_size``) or any
        two-argument callable. Objects are combined left to right in rank order, the same way
        on every rank, so every rank gets the same result.
        """
        return objects.allreduce_object(self, obj, op, timeout=timeout)

    def reduce_object(
        self,
        obj: Any,
        op: ReduceOp | int | str | Callable[[Any, Any], Any] = ReduceOp.SUM,
        root: int = 0,
        *,
        timeout: float | None = None,
    ) -> Any:
        """:meth:`allreduce_object` onto ``root``; ``None`` elsewhere."""
        return objects.reduce_object(self, obj, op, root, timeout=timeout)

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
