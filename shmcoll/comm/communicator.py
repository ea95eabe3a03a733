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
from shmcoll.comm.persistent import PersistentForms
from shmcoll.comm.requests import Request
from shmcoll.comm.runtime import MISS
from shmcoll.engine import cpu as engine
from shmcoll.shm import layout
from shmcoll.shm.arena import Arena
from shmcoll.shm.registered import SharedArray
from shmcoll.types import ReduceOp

_ALLREDUCE = collectives.BY_NAME["allreduce"]
_ALLREDUCE_CODE = _ALLREDUCE.code
_BARRIER_CODE = collectives.KIND_CODE["barrier"]
_OK = engine.OK
_REDUCE = collectives.BY_NAME["reduce"]
_REDUCE_CODE = _REDUCE.code
_BROADCAST = collectives.BY_NAME["broadcast"]
_BROADCAST_CODE = _BROADCAST.code
_ALLGATHER = collectives.BY_NAME["allgather"]
_ALLGATHER_CODE = _ALLGATHER.code
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


class Communicator(PersistentForms):
    """A group of ranks that run collectives together; create one with :func:`shmcoll.spawn`,
    :meth:`shmcoll.Group.connect` or :func:`shmcoll.init`.

    Every method is collective over the communicator's ranks (except :meth:`send`,
    :meth:`recv` and :meth:`probe`): every rank calls it, in the same order, with matching
    arguments. Arrays are C-contiguous numpy arrays of any shape, treated as flat (also arrays
    from :meth:`alloc`, and CUDA device arrays with the ``cuda`` extra). The collectives on
    arrays and their ``i``-forms take ``algorithm=`` (``"auto"`` or a registered name; not
    :meth:`barrier`, nor the object collectives), and every method that communicates takes
    ``timeout=`` (seconds, ``inf`` for no limit; default: the communicator's,
    ``SHMCOLL_TIMEOUT``): all but :meth:`iprobe`, :meth:`abort` and :meth:`close`.
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

        Example::

            x = np.full(4, comm.rank, np.float32)
            comm.allreduce(x)  # in place: 0 + 1 + ... + (world_size - 1) in every element
            top = comm.allreduce(x, "max", out=np.empty_like(x))  # out of place

        Args:
            x: this rank's contribution (any shape, treated as flat).
            op: a :class:`~shmcoll.ReduceOp`, its value or its name (``"sum"``, ``"max"``).
            out: where the result goes (same shape and dtype as ``x``); ``None`` or ``x`` itself: in
                place.
            algorithm: ``"auto"`` (chosen per call shape by the cost model, the ``shmcoll tune``
                table and ``SHMCOLL_ALGO``) or an algorithm's name (``"ring"``, ``"direct"``, ...:
                the README's table, ``shmcoll plan show``).
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            The result: ``out``, or ``x`` when in place (the same bits on every rank).

        Raises:
            ValueError: wrong use: a shape, size or root the call cannot take, a non-contiguous or
                read-only array where one is written, overlapping buffers, an op the dtype lacks, a
                bad timeout; :class:`~shmcoll.UnsupportedError` when ``algorithm`` cannot serve the
                call. Raised on this rank before any communication: the communicator stays usable.
            TypeError: an unsupported dtype, or ``out`` of another dtype; raised likewise.
            ShmcollError: a peer died (:class:`~shmcoll.PeerLostError`), the call timed out
                (:class:`~shmcoll.CollectiveTimeout`) or the ranks' calls differ
                (:class:`~shmcoll.CollectiveMismatchError`); raised on every rank involved, after
                which the communicator is broken.
        """
        # Runtime._again, written out here (allreduce's root is always 0): a loop of small
        # allreduces is the commonest loop there is, and the method call that this saves is 60 ns
        # of an 8-byte call's 800.
        m = self._lean[_ALLREDUCE_CODE]
        if (
            m is not None
            and m[0] is x
            and m[1] is out
            and m[2] is op
            and m[4] is algorithm
            and timeout is None
            and x.dtype is m[5]
            and (m[6] is None or m[6].flags.writeable)
            and self._nested_owner is None
            and self._broken is None
            and (self._progress is None or not self._progress.pending)
        ):
            st = m[7](m[8])
            if st != _OK:
                self._wait_or_raise(st, m[9][0], m[9][1], m[9][2], self._timeout)
            return m[9][3]  # type: ignore[no-any-return]
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

        Example::

            total = comm.reduce(x, root=0)  # an array on rank 0, None elsewhere

        Args:
            x: this rank's contribution.
            root: the rank that gets the result.
            op: a :class:`~shmcoll.ReduceOp`, its value or its name (``"sum"``, ``"max"``).
            out: the root's result array (same shape and dtype as ``x``; ``out=x``: in place);
                ``None``: a new array. Ignored on other ranks.
            algorithm: ``"auto"`` (chosen per call shape by the cost model, the ``shmcoll tune``
                table and ``SHMCOLL_ALGO``) or an algorithm's name (``"ring"``, ``"direct"``, ...:
                the README's table, ``shmcoll plan show``).
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            On ``root`` the result (``out``, or a new array); ``None`` elsewhere.

        Raises:
            ValueError: wrong use: a shape, size or root the call cannot take, a non-contiguous or
                read-only array where one is written, overlapping buffers, an op the dtype lacks, a
                bad timeout; :class:`~shmcoll.UnsupportedError` when ``algorithm`` cannot serve the
                call. Raised on this rank before any communication: the communicator stays usable.
            TypeError: an unsupported dtype, or ``out`` of another dtype; raised likewise.
            ShmcollError: a peer died (:class:`~shmcoll.PeerLostError`), the call timed out
                (:class:`~shmcoll.CollectiveTimeout`) or the ranks' calls differ
                (:class:`~shmcoll.CollectiveMismatchError`); raised on every rank involved, after
                which the communicator is broken.
        """
        m = self._lean[_REDUCE_CODE]  # Runtime._again written out, as in allreduce
        if (
            m is not None
            and m[0] is x
            and m[1] is out
            and m[2] is op
            and m[3] is root
            and m[4] is algorithm
            and timeout is None
            and x.dtype is m[5]
            and (m[6] is None or m[6].flags.writeable)
            and self._nested_owner is None
            and self._broken is None
            and (self._progress is None or not self._progress.pending)
        ):
            st = m[7](m[8])
            if st != _OK:
                self._wait_or_raise(st, m[9][0], m[9][1], m[9][2], self._timeout)
            return m[9][3]  # type: ignore[no-any-return]
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

        Example::

            w = np.empty(1000) if comm.rank else model_weights()
            comm.broadcast(w, root=0)  # every rank now holds rank 0's w

        Args:
            x: root's data; on the other ranks, the array that receives it (same shape and dtype on
                every rank).
            root: the rank whose ``x`` is sent.
            out: where to put the data instead of ``x`` (same shape and dtype); ``None``: in place.
            algorithm: ``"auto"`` (chosen per call shape by the cost model, the ``shmcoll tune``
                table and ``SHMCOLL_ALGO``) or an algorithm's name (``"ring"``, ``"direct"``, ...:
                the README's table, ``shmcoll plan show``).
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            ``x`` (or ``out``), holding root's data on every rank.

        Raises:
            ValueError: wrong use: a shape, size or root the call cannot take, a non-contiguous or
                read-only array where one is written, overlapping buffers, an op the dtype lacks, a
                bad timeout; :class:`~shmcoll.UnsupportedError` when ``algorithm`` cannot serve the
                call. Raised on this rank before any communication: the communicator stays usable.
            TypeError: an unsupported dtype, or ``out`` of another dtype; raised likewise.
            ShmcollError: a peer died (:class:`~shmcoll.PeerLostError`), the call timed out
                (:class:`~shmcoll.CollectiveTimeout`) or the ranks' calls differ
                (:class:`~shmcoll.CollectiveMismatchError`); raised on every rank involved, after
                which the communicator is broken.
        """
        # Runtime._again written out, as in allreduce: a small broadcast is mostly this call's own
        # cost, and the method call this saves was 90 ns of it (0.45 -> 0.36 us at one rank).
        m = self._lean[_BROADCAST_CODE]
        if (
            m is not None
            and m[0] is x
            and m[1] is out
            and m[3] is root
            and m[4] is algorithm
            and timeout is None
            and x.dtype is m[5]
            and (m[6] is None or m[6].flags.writeable)
            and self._nested_owner is None
            and self._broken is None
            and (self._progress is None or not self._progress.pending)
        ):
            st = m[7](m[8])
            if st != _OK:
                self._wait_or_raise(st, m[9][0], m[9][1], m[9][2], self._timeout)
            return m[9][3]  # type: ignore[no-any-return]
        return self._run(bind.elementwise(self, _BROADCAST, x, out, None, root, algorithm), timeout)  # type: ignore[no-any-return]

    def allgather(
        self, x: np.ndarray, *, out: np.ndarray | None = None, algorithm: str = "auto", timeout: float | None = None
    ) -> np.ndarray:
        """Every rank's ``x``, stacked in rank order on every rank.

        Example::

            g = comm.allgather(np.array([comm.rank]))  # [[0], [1], ...] on every rank

        Args:
            x: this rank's block (same shape and dtype on every rank).
            out: shape ``(world_size, *x.shape)``, ``x``'s dtype; ``None``: a new array. ``x`` may
                be ``out[rank]`` itself (in place).
            algorithm: ``"auto"`` (chosen per call shape by the cost model, the ``shmcoll tune``
                table and ``SHMCOLL_ALGO``) or an algorithm's name (``"ring"``, ``"direct"``, ...:
                the README's table, ``shmcoll plan show``).
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            ``out``: ``out[j]`` is rank ``j``'s ``x``.

        Raises:
            ValueError: wrong use: a shape, size or root the call cannot take, a non-contiguous or
                read-only array where one is written, overlapping buffers, an op the dtype lacks, a
                bad timeout; :class:`~shmcoll.UnsupportedError` when ``algorithm`` cannot serve the
                call. Raised on this rank before any communication: the communicator stays usable.
            TypeError: an unsupported dtype, or ``out`` of another dtype; raised likewise.
            ShmcollError: a peer died (:class:`~shmcoll.PeerLostError`), the call timed out
                (:class:`~shmcoll.CollectiveTimeout`) or the ranks' calls differ
                (:class:`~shmcoll.CollectiveMismatchError`); raised on every rank involved, after
                which the communicator is broken.
        """
        m = self._lean[_ALLGATHER_CODE]  # Runtime._again written out, as in allreduce
        if (
            m is not None
            and m[0] is x
            and m[1] is out
            and m[4] is algorithm
            and timeout is None
            and x.dtype is m[5]
            and (m[6] is None or m[6].flags.writeable)
            and self._nested_owner is None
            and self._broken is None
            and (self._progress is None or not self._progress.pending)
        ):
            st = m[7](m[8])
            if st != _OK:
                self._wait_or_raise(st, m[9][0], m[9][1], m[9][2], self._timeout)
            return m[9][3]  # type: ignore[no-any-return]
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
        """Every rank's ``x``, stacked in rank order on ``root``.

        Args:
            x: this rank's block (same shape and dtype on every rank).
            root: the rank that gets the result.
            out: the root's result, shape ``(world_size, *x.shape)``; ``None``: a new array. On the
                root ``x`` may be ``out[root]`` (in place). Ignored on other ranks.
            algorithm: ``"auto"`` (chosen per call shape by the cost model, the ``shmcoll tune``
                table and ``SHMCOLL_ALGO``) or an algorithm's name (``"ring"``, ``"direct"``, ...:
                the README's table, ``shmcoll plan show``).
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            On ``root`` the stacked blocks (``out[j]`` is rank ``j``'s ``x``); ``None`` elsewhere.

        Raises:
            ValueError: wrong use: a shape, size or root the call cannot take, a non-contiguous or
                read-only array where one is written, overlapping buffers, an op the dtype lacks, a
                bad timeout; :class:`~shmcoll.UnsupportedError` when ``algorithm`` cannot serve the
                call. Raised on this rank before any communication: the communicator stays usable.
            TypeError: an unsupported dtype, or ``out`` of another dtype; raised likewise.
            ShmcollError: a peer died (:class:`~shmcoll.PeerLostError`), the call timed out
                (:class:`~shmcoll.CollectiveTimeout`) or the ranks' calls differ
                (:class:`~shmcoll.CollectiveMismatchError`); raised on every rank involved, after
                which the communicator is broken.
        """
        r = self._again(_GATHER.code, x, out, None, root, algorithm, timeout)
        if r is MISS:
            r = self._run(bind.gathering(self, _GATHER, x, out, root, algorithm), timeout)
        return r  # type: ignore[no-any-return]

    def scatter(
        self,
        x: np.ndarray | None,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Block ``j`` of root's ``x`` to rank ``j``.

        Example::

            chunks = np.arange(12.0).reshape(comm.world_size, -1) if comm.rank == 0 else None
            mine = comm.scatter(chunks, root=0, out=np.empty(12 // comm.world_size))

        Args:
            x: on the root, shape ``(world_size, *shape)``; other ranks pass ``None``.
            root: the rank whose ``x`` is scattered.
            out: shape ``shape``, ``x``'s dtype. Required on non-root ranks (it gives the shape and
                dtype); the root may omit it (a new array) or pass ``out=x[root]`` (in place).
            algorithm: ``"auto"`` (chosen per call shape by the cost model, the ``shmcoll tune``
                table and ``SHMCOLL_ALGO``) or an algorithm's name (``"ring"``, ``"direct"``, ...:
                the README's table, ``shmcoll plan show``).
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            ``out``, holding this rank's block.

        Raises:
            ValueError: wrong use: a shape, size or root the call cannot take, a non-contiguous or
                read-only array where one is written, overlapping buffers, an op the dtype lacks, a
                bad timeout; :class:`~shmcoll.UnsupportedError` when ``algorithm`` cannot serve the
                call. Raised on this rank before any communication: the communicator stays usable.
            TypeError: an unsupported dtype, or ``out`` of another dtype; raised likewise.
            ShmcollError: a peer died (:class:`~shmcoll.PeerLostError`), the call timed out
                (:class:`~shmcoll.CollectiveTimeout`) or the ranks' calls differ
                (:class:`~shmcoll.CollectiveMismatchError`); raised on every rank involved, after
                which the communicator is broken.
        """
        r = self._again(_SCATTER.code, x, out, None, root, algorithm, timeout)
        if r is MISS:
            r = self._run(bind.scattering(self, _SCATTER, x, out, None, root, algorithm), timeout)
        return r  # type: ignore[no-any-return]

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

        Unlike ``MPI_Reduce_scatter_block`` with ``MPI_IN_PLACE`` (which leaves the result at the
        start of the buffer), an in-place call here reads and writes this rank's own block of
        ``x``, as NCCL does: pass ``out=x[rank * k:(rank + 1) * k]`` (with ``counts``, the
        ``counts[rank]`` elements of ``x`` from ``sum(counts[:rank])`` on).

        Example::

            x = np.ones((2 * comm.world_size, 4))
            mine = comm.reduce_scatter(x)  # shape (2, 4), every element world_size
            comm.reduce_scatter(x, out=x[2 * comm.rank:2 * comm.rank + 2])  # in place: block rank

        Args:
            x: this rank's contribution. Without ``counts``, ``x.shape[0]`` must be divisible by
                ``world_size``; block ``j`` is ``x[j * k:(j + 1) * k]`` with ``k = x.shape[0] //
                world_size``. With ``counts``, ``x`` is flat with ``sum(counts)`` elements.
            op: a :class:`~shmcoll.ReduceOp`, its value or its name (``"sum"``, ``"max"``).
            counts: elements per rank (the same on every rank, zeros allowed): rank ``j`` gets the
                ``counts[j]`` elements from ``sum(counts[:j])`` on. ``None``: equal blocks.
            out: this rank's block, shape ``(k, *x.shape[1:])`` (with ``counts``: ``counts[rank]``
                elements); ``None``: a new array (1-d with ``counts``). This rank's block of ``x``
                itself: in place.
            algorithm: ``"auto"`` (chosen per call shape by the cost model, the ``shmcoll tune``
                table and ``SHMCOLL_ALGO``) or an algorithm's name (``"ring"``, ``"direct"``, ...:
                the README's table, ``shmcoll plan show``).
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            ``out``: this rank's block of the reduction.

        Raises:
            ValueError: wrong use: a shape, size or root the call cannot take, a non-contiguous or
                read-only array where one is written, overlapping buffers, an op the dtype lacks, a
                bad timeout; :class:`~shmcoll.UnsupportedError` when ``algorithm`` cannot serve the
                call. Raised on this rank before any communication: the communicator stays usable.
            TypeError: an unsupported dtype, or ``out`` of another dtype; raised likewise.
            ShmcollError: a peer died (:class:`~shmcoll.PeerLostError`), the call timed out
                (:class:`~shmcoll.CollectiveTimeout`) or the ranks' calls differ
                (:class:`~shmcoll.CollectiveMismatchError`); raised on every rank involved, after
                which the communicator is broken.
        """
        r = MISS if counts is not None else self._again(_REDUCE_SCATTER.code, x, out, op, 0, algorithm, timeout)
        if r is MISS:
            r = self._run(self._bind_reduce_scatter(x, op, counts, out, algorithm), timeout)
        return r  # type: ignore[no-any-return,return-value]

    def _bind_reduce_scatter(self, x: Any, op: Any, counts: Any, out: Any, algorithm: str) -> Any:
        if counts is None:
            return bind.scattering(self, _REDUCE_SCATTER, x, out, op, 0, algorithm)
        return bind.varying(self, _REDUCE_SCATTERV, x, out, counts, op, 0, algorithm)

    def alltoall(
        self, x: np.ndarray, *, out: np.ndarray | None = None, algorithm: str = "auto", timeout: float | None = None
    ) -> np.ndarray:
        """Block ``j`` of each rank's ``x`` goes to rank ``j``: ``out[i]`` is rank ``i``'s
        ``x[rank]``.

        Example::

            x = np.full((comm.world_size, 3), comm.rank)
            y = comm.alltoall(x)  # y[i] == [i, i, i]: what rank i sent this rank

        Args:
            x: shape ``(world_size, *shape)``: row ``j`` goes to rank ``j``.
            out: same shape and dtype as ``x``; ``None``: a new array; ``out=x``: in place.
            algorithm: ``"auto"`` (chosen per call shape by the cost model, the ``shmcoll tune``
                table and ``SHMCOLL_ALGO``) or an algorithm's name (``"ring"``, ``"direct"``, ...:
                the README's table, ``shmcoll plan show``).
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            ``out``: row ``i`` is what rank ``i`` sent this rank.

        Raises:
            ValueError: wrong use: a shape, size or root the call cannot take, a non-contiguous or
                read-only array where one is written, overlapping buffers, an op the dtype lacks, a
                bad timeout; :class:`~shmcoll.UnsupportedError` when ``algorithm`` cannot serve the
                call. Raised on this rank before any communication: the communicator stays usable.
            TypeError: an unsupported dtype, or ``out`` of another dtype; raised likewise.
            ShmcollError: a peer died (:class:`~shmcoll.PeerLostError`), the call timed out
                (:class:`~shmcoll.CollectiveTimeout`) or the ranks' calls differ
                (:class:`~shmcoll.CollectiveMismatchError`); raised on every rank involved, after
                which the communicator is broken.
        """
        r = self._again(_ALLTOALL.code, x, out, None, 0, algorithm, timeout)
        if r is MISS:
            r = self._run(bind.elementwise(self, _ALLTOALL, x, out, None, 0, algorithm), timeout)
        return r  # type: ignore[no-any-return]

    def allgatherv(
        self,
        x: np.ndarray,
        counts: Counts | None = None,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Every rank's ``x`` (``counts[rank]`` elements), back to back in rank order, on
        every rank.

        Example::

            x = np.full(comm.rank + 1, comm.rank)  # ranks contribute 1, 2, 3... elements
            g = comm.allgatherv(x)  # [0, 1, 1, 2, 2, 2, ...]: the counts are learned first

        Args:
            x: this rank's block (any shape; its elements count).
            counts: elements per rank, the same on every rank (zeros allowed). ``None`` on every
                rank: the counts are learned first, with an allgather of the sizes.
            out: ``sum(counts)`` elements of ``x``'s dtype (default: a new 1-d array); ``x`` may be
                this rank's block of it (in place).
            algorithm: ``"auto"`` (chosen per call shape by the cost model, the ``shmcoll tune``
                table and ``SHMCOLL_ALGO``) or an algorithm's name (``"ring"``, ``"direct"``, ...:
                the README's table, ``shmcoll plan show``).
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            ``out``: rank ``j``'s elements from ``sum(counts[:j])`` on.

        Raises:
            ValueError: wrong use: a shape, size or root the call cannot take, a non-contiguous or
                read-only array where one is written, overlapping buffers, an op the dtype lacks, a
                bad timeout; :class:`~shmcoll.UnsupportedError` when ``algorithm`` cannot serve the
                call. Raised on this rank before any communication: the communicator stays usable.
            TypeError: an unsupported dtype, or ``out`` of another dtype; raised likewise.
            ShmcollError: a peer died (:class:`~shmcoll.PeerLostError`), the call timed out
                (:class:`~shmcoll.CollectiveTimeout`) or the ranks' calls differ
                (:class:`~shmcoll.CollectiveMismatchError`); raised on every rank involved, after
                which the communicator is broken.
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
        """Every rank's ``x`` (``counts[rank]`` elements), back to back in rank order, on
        ``root``.

        Args:
            x: this rank's block (any shape; its elements count).
            counts: elements per rank; required on the root, optional elsewhere (each rank's ``x``
                gives its count).
            root: the rank that gets the result.
            out: on the root, ``sum(counts)`` elements of ``x``'s dtype (default: a new 1-d array);
                ``x`` may be the root's block of it (in place). Ignored elsewhere.
            algorithm: ``"auto"`` (chosen per call shape by the cost model, the ``shmcoll tune``
                table and ``SHMCOLL_ALGO``) or an algorithm's name (``"ring"``, ``"direct"``, ...:
                the README's table, ``shmcoll plan show``).
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            On ``root`` the concatenated blocks; ``None`` elsewhere.

        Raises:
            ValueError: wrong use: a shape, size or root the call cannot take, a non-contiguous or
                read-only array where one is written, overlapping buffers, an op the dtype lacks, a
                bad timeout; :class:`~shmcoll.UnsupportedError` when ``algorithm`` cannot serve the
                call. Raised on this rank before any communication: the communicator stays usable.
            TypeError: an unsupported dtype, or ``out`` of another dtype; raised likewise.
            ShmcollError: a peer died (:class:`~shmcoll.PeerLostError`), the call timed out
                (:class:`~shmcoll.CollectiveTimeout`) or the ranks' calls differ
                (:class:`~shmcoll.CollectiveMismatchError`); raised on every rank involved, after
                which the communicator is broken.
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
        """Root's flat ``x`` cut in blocks of ``counts[j]`` elements: block ``j`` (from
        ``sum(counts[:j])`` on) to rank ``j``.

        Args:
            x: on the root, ``sum(counts)`` elements; other ranks pass ``None``.
            counts: elements per rank; required on the root, optional elsewhere.
            root: the rank whose ``x`` is scattered.
            out: this rank's ``counts[rank]`` elements. Required on non-root ranks (its size and
                dtype say what they receive); the root may omit it (a new 1-d array) or pass its
                block of ``x`` (in place).
            algorithm: ``"auto"`` (chosen per call shape by the cost model, the ``shmcoll tune``
                table and ``SHMCOLL_ALGO``) or an algorithm's name (``"ring"``, ``"direct"``, ...:
                the README's table, ``shmcoll plan show``).
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            ``out``, holding this rank's block.

        Raises:
            ValueError: wrong use: a shape, size or root the call cannot take, a non-contiguous or
                read-only array where one is written, overlapping buffers, an op the dtype lacks, a
                bad timeout; :class:`~shmcoll.UnsupportedError` when ``algorithm`` cannot serve the
                call. Raised on this rank before any communication: the communicator stays usable.
            TypeError: an unsupported dtype, or ``out`` of another dtype; raised likewise.
            ShmcollError: a peer died (:class:`~shmcoll.PeerLostError`), the call timed out
                (:class:`~shmcoll.CollectiveTimeout`) or the ranks' calls differ
                (:class:`~shmcoll.CollectiveMismatchError`); raised on every rank involved, after
                which the communicator is broken.
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
            x: this rank's data, flat, ``sum(send_counts)`` elements.
            send_counts: elements for each rank.
            recv_counts: elements from each rank: rank ``i``'s ``send_counts[this rank]``. ``None``:
                learned first, with an alltoall of the send counts.
            out: ``sum(recv_counts)`` elements of ``x``'s dtype, disjoint from ``x`` (default: a new
                1-d array). alltoallv never runs in place.
            algorithm: ``"auto"`` (chosen per call shape by the cost model, the ``shmcoll tune``
                table and ``SHMCOLL_ALGO``) or an algorithm's name (``"ring"``, ``"direct"``, ...:
                the README's table, ``shmcoll plan show``).
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            ``out``: rank ``i``'s elements from ``sum(recv_counts[:i])`` on.

        Raises:
            ValueError: wrong use: a shape, size or root the call cannot take, a non-contiguous or
                read-only array where one is written, overlapping buffers, an op the dtype lacks, a
                bad timeout; :class:`~shmcoll.UnsupportedError` when ``algorithm`` cannot serve the
                call. Raised on this rank before any communication: the communicator stays usable.
            TypeError: an unsupported dtype, or ``out`` of another dtype; raised likewise.
            ShmcollError: a peer died (:class:`~shmcoll.PeerLostError`), the call timed out
                (:class:`~shmcoll.CollectiveTimeout`) or the ranks' calls differ
                (:class:`~shmcoll.CollectiveMismatchError`); raised on every rank involved, after
                which the communicator is broken.
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
        element-wise, combined in rank order.

        Example::

            c = comm.scan(np.array([1]))  # rank r gets [r + 1]

        Args:
            x: this rank's contribution.
            op: any :class:`~shmcoll.ReduceOp` but ``AVG``, its value or its name.
            out: same shape and dtype as ``x``; ``None`` or ``x``: in place.
            algorithm: ``"auto"`` (chosen per call shape by the cost model, the ``shmcoll tune``
                table and ``SHMCOLL_ALGO``) or an algorithm's name (``"ring"``, ``"direct"``, ...:
                the README's table, ``shmcoll plan show``).
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            The result: ``out``, or ``x`` when in place.

        Raises:
            ValueError: wrong use: a shape, size or root the call cannot take, a non-contiguous or
                read-only array where one is written, overlapping buffers, an op the dtype lacks, a
                bad timeout; :class:`~shmcoll.UnsupportedError` when ``algorithm`` cannot serve the
                call. Raised on this rank before any communication: the communicator stays usable.
            TypeError: an unsupported dtype, or ``out`` of another dtype; raised likewise.
            ShmcollError: a peer died (:class:`~shmcoll.PeerLostError`), the call timed out
                (:class:`~shmcoll.CollectiveTimeout`) or the ranks' calls differ
                (:class:`~shmcoll.CollectiveMismatchError`); raised on every rank involved, after
                which the communicator is broken.
        """
        r = self._again(_SCAN.code, x, out, op, 0, algorithm, timeout)
        if r is MISS:
            r = self._run(bind.elementwise(self, _SCAN, x, out, op, 0, algorithm), timeout)
        return r  # type: ignore[no-any-return]

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
        leaves it undefined.

        Example::

            offset = comm.exscan(np.array([n_local]))  # where this rank's items start globally

        Args:
            x: this rank's contribution.
            op: any :class:`~shmcoll.ReduceOp` but ``AVG``, its value or its name.
            out: same shape and dtype as ``x``; ``None`` or ``x``: in place.
            algorithm: ``"auto"`` (chosen per call shape by the cost model, the ``shmcoll tune``
                table and ``SHMCOLL_ALGO``) or an algorithm's name (``"ring"``, ``"direct"``, ...:
                the README's table, ``shmcoll plan show``).
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            The result: ``out``, or ``x`` when in place.

        Raises:
            ValueError: wrong use: a shape, size or root the call cannot take, a non-contiguous or
                read-only array where one is written, overlapping buffers, an op the dtype lacks, a
                bad timeout; :class:`~shmcoll.UnsupportedError` when ``algorithm`` cannot serve the
                call. Raised on this rank before any communication: the communicator stays usable.
            TypeError: an unsupported dtype, or ``out`` of another dtype; raised likewise.
            ShmcollError: a peer died (:class:`~shmcoll.PeerLostError`), the call timed out
                (:class:`~shmcoll.CollectiveTimeout`) or the ranks' calls differ
                (:class:`~shmcoll.CollectiveMismatchError`); raised on every rank involved, after
                which the communicator is broken.
        """
        r = self._again(_EXSCAN.code, x, out, op, 0, algorithm, timeout)
        if r is MISS:
            r = self._run(bind.elementwise(self, _EXSCAN, x, out, op, 0, algorithm), timeout)
        return r  # type: ignore[no-any-return]

    def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every rank has entered the barrier.

        Args:
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Raises:
            ShmcollError: a peer died, the call timed out or the ranks' calls differ (see
                :meth:`allreduce`); the communicator is then broken.
        """
        m = self._lean[_BARRIER_CODE]  # Runtime._again's tests, for a call without arrays
        if (
            m is not None
            and m is not bind.NOT_LEAN
            and timeout is None
            and self._nested_owner is None
            and self._broken is None
            and (self._progress is None or not self._progress.pending)
        ):
            st = m[7](m[8])
            if st != _OK:
                self._wait_or_raise(st, m[9][0], m[9][1], m[9][2], self._timeout)
            return
        b = bind.barrier(self)
        self._run(b, timeout)
        if m is None:
            bind.lean_barrier(self, b)

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
        """Start :meth:`allreduce` and return at once.

        Takes :meth:`allreduce`'s arguments.
        The arrays given belong to the operation until its ``wait()`` returns: do not read its
        output or write its input before then.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns what :meth:`allreduce` returns.

        Raises:
            ValueError: wrong use, as for :meth:`allreduce`, at once (nothing is started); so is
                ``TypeError``. Errors between ranks come out of the request's ``wait()`` or
                ``test()``.
        """
        r = self._start_again(_ALLREDUCE_CODE, x, out, op, 0, algorithm, timeout, "iallreduce")
        if r is MISS:
            r = self._start(bind.elementwise(self, _ALLREDUCE, x, out, op, 0, algorithm), timeout, "iallreduce")
        return r  # type: ignore[no-any-return]

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
        """Start :meth:`reduce` and return at once.

        Takes :meth:`reduce`'s arguments.
        The arrays given belong to the operation until its ``wait()`` returns: do not read its
        output or write its input before then.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns what :meth:`reduce` returns.

        Raises:
            ValueError: wrong use, as for :meth:`reduce`, at once (nothing is started); so is
                ``TypeError``. Errors between ranks come out of the request's ``wait()`` or
                ``test()``.
        """
        r = self._start_again(_REDUCE_CODE, x, out, op, root, algorithm, timeout, "ireduce")
        if r is MISS:
            r = self._start(bind.elementwise(self, _REDUCE, x, out, op, root, algorithm), timeout, "ireduce")
        return r  # type: ignore[no-any-return]

    def ibroadcast(
        self,
        x: np.ndarray,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`broadcast` and return at once.

        Takes :meth:`broadcast`'s arguments.
        The arrays given belong to the operation until its ``wait()`` returns: do not read its
        output or write its input before then.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns what :meth:`broadcast` returns.

        Raises:
            ValueError: wrong use, as for :meth:`broadcast`, at once (nothing is started); so is
                ``TypeError``. Errors between ranks come out of the request's ``wait()`` or
                ``test()``.
        """
        r = self._start_again(_BROADCAST_CODE, x, out, None, root, algorithm, timeout, "ibroadcast")
        if r is MISS:
            r = self._start(bind.elementwise(self, _BROADCAST, x, out, None, root, algorithm), timeout, "ibroadcast")
        return r  # type: ignore[no-any-return]

    def iallgather(
        self, x: np.ndarray, *, out: np.ndarray | None = None, algorithm: str = "auto", timeout: float | None = None
    ) -> Request:
        """Start :meth:`allgather` and return at once.

        Takes :meth:`allgather`'s arguments.
        The arrays given belong to the operation until its ``wait()`` returns: do not read its
        output or write its input before then.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns what :meth:`allgather` returns.

        Raises:
            ValueError: wrong use, as for :meth:`allgather`, at once (nothing is started); so is
                ``TypeError``. Errors between ranks come out of the request's ``wait()`` or
                ``test()``.
        """
        r = self._start_again(_ALLGATHER_CODE, x, out, None, 0, algorithm, timeout, "iallgather")
        if r is MISS:
            r = self._start(bind.gathering(self, _ALLGATHER, x, out, 0, algorithm), timeout, "iallgather")
        return r  # type: ignore[no-any-return]

    def igather(
        self,
        x: np.ndarray,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`gather` and return at once.

        Takes :meth:`gather`'s arguments.
        The arrays given belong to the operation until its ``wait()`` returns: do not read its
        output or write its input before then.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns what :meth:`gather` returns.

        Raises:
            ValueError: wrong use, as for :meth:`gather`, at once (nothing is started); so is
                ``TypeError``. Errors between ranks come out of the request's ``wait()`` or
                ``test()``.
        """
        r = self._start_again(_GATHER.code, x, out, None, root, algorithm, timeout, "igather")
        if r is MISS:
            r = self._start(bind.gathering(self, _GATHER, x, out, root, algorithm), timeout, "igather")
        return r  # type: ignore[no-any-return]

    def iscatter(
        self,
        x: np.ndarray | None,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`scatter` and return at once.

        Takes :meth:`scatter`'s arguments.
        The arrays given belong to the operation until its ``wait()`` returns: do not read its
        output or write its input before then.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns what :meth:`scatter` returns.

        Raises:
            ValueError: wrong use, as for :meth:`scatter`, at once (nothing is started); so is
                ``TypeError``. Errors between ranks come out of the request's ``wait()`` or
                ``test()``.
        """
        r = self._start_again(_SCATTER.code, x, out, None, root, algorithm, timeout, "iscatter")
        if r is MISS:
            r = self._start(bind.scattering(self, _SCATTER, x, out, None, root, algorithm), timeout, "iscatter")
        return r  # type: ignore[no-any-return]

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
        """Start :meth:`reduce_scatter` and return at once.

        Takes :meth:`reduce_scatter`'s arguments.
        The arrays given belong to the operation until its ``wait()`` returns: do not read its
        output or write its input before then.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns what :meth:`reduce_scatter` returns.

        Raises:
            ValueError: wrong use, as for :meth:`reduce_scatter`, at once (nothing is started); so
                is ``TypeError``. Errors between ranks come out of the request's ``wait()`` or
                ``test()``.
        """
        r = (
            MISS
            if counts is not None
            else self._start_again(_REDUCE_SCATTER.code, x, out, op, 0, algorithm, timeout, "ireduce_scatter")
        )
        if r is MISS:
            r = self._start(self._bind_reduce_scatter(x, op, counts, out, algorithm), timeout, "ireduce_scatter")
        return r  # type: ignore[no-any-return,return-value]

    def ialltoall(
        self, x: np.ndarray, *, out: np.ndarray | None = None, algorithm: str = "auto", timeout: float | None = None
    ) -> Request:
        """Start :meth:`alltoall` and return at once.

        Takes :meth:`alltoall`'s arguments.
        The arrays given belong to the operation until its ``wait()`` returns: do not read its
        output or write its input before then.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns what :meth:`alltoall` returns.

        Raises:
            ValueError: wrong use, as for :meth:`alltoall`, at once (nothing is started); so is
                ``TypeError``. Errors between ranks come out of the request's ``wait()`` or
                ``test()``.
        """
        r = self._start_again(_ALLTOALL.code, x, out, None, 0, algorithm, timeout, "ialltoall")
        if r is MISS:
            r = self._start(bind.elementwise(self, _ALLTOALL, x, out, None, 0, algorithm), timeout, "ialltoall")
        return r  # type: ignore[no-any-return]

    def iallgatherv(
        self,
        x: np.ndarray,
        counts: Counts,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`allgatherv` and return at once.

        Takes :meth:`allgatherv`'s arguments (``counts`` required: the blocking form learns them).
        The arrays given belong to the operation until its ``wait()`` returns: do not read its
        output or write its input before then.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns what :meth:`allgatherv` returns.

        Raises:
            ValueError: wrong use, as for :meth:`allgatherv`, at once (nothing is started); so is
                ``TypeError``. Errors between ranks come out of the request's ``wait()`` or
                ``test()``.
        """
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
        """Start :meth:`gatherv` and return at once.

        Takes :meth:`gatherv`'s arguments.
        The arrays given belong to the operation until its ``wait()`` returns: do not read its
        output or write its input before then.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns what :meth:`gatherv` returns.

        Raises:
            ValueError: wrong use, as for :meth:`gatherv`, at once (nothing is started); so is
                ``TypeError``. Errors between ranks come out of the request's ``wait()`` or
                ``test()``.
        """
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
        """Start :meth:`scatterv` and return at once.

        Takes :meth:`scatterv`'s arguments.
        The arrays given belong to the operation until its ``wait()`` returns: do not read its
        output or write its input before then.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns what :meth:`scatterv` returns.

        Raises:
            ValueError: wrong use, as for :meth:`scatterv`, at once (nothing is started); so is
                ``TypeError``. Errors between ranks come out of the request's ``wait()`` or
                ``test()``.
        """
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
        """Start :meth:`alltoallv` and return at once.

        Takes :meth:`alltoallv`'s arguments (``recv_counts`` required: the blocking form learns them).
        The arrays given belong to the operation until its ``wait()`` returns: do not read its
        output or write its input before then.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns what :meth:`alltoallv` returns.

        Raises:
            ValueError: wrong use, as for :meth:`alltoallv`, at once (nothing is started); so is
                ``TypeError``. Errors between ranks come out of the request's ``wait()`` or
                ``test()``.
        """
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
        """Start :meth:`scan` and return at once.

        Takes :meth:`scan`'s arguments.
        The arrays given belong to the operation until its ``wait()`` returns: do not read its
        output or write its input before then.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns what :meth:`scan` returns.

        Raises:
            ValueError: wrong use, as for :meth:`scan`, at once (nothing is started); so is
                ``TypeError``. Errors between ranks come out of the request's ``wait()`` or
                ``test()``.
        """
        r = self._start_again(_SCAN.code, x, out, op, 0, algorithm, timeout, "iscan")
        if r is MISS:
            r = self._start(bind.elementwise(self, _SCAN, x, out, op, 0, algorithm), timeout, "iscan")
        return r  # type: ignore[no-any-return]

    def iexscan(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Request:
        """Start :meth:`exscan` and return at once.

        Takes :meth:`exscan`'s arguments.
        The arrays given belong to the operation until its ``wait()`` returns: do not read its
        output or write its input before then.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns what :meth:`exscan` returns.

        Raises:
            ValueError: wrong use, as for :meth:`exscan`, at once (nothing is started); so is
                ``TypeError``. Errors between ranks come out of the request's ``wait()`` or
                ``test()``.
        """
        r = self._start_again(_EXSCAN.code, x, out, op, 0, algorithm, timeout, "iexscan")
        if r is MISS:
            r = self._start(bind.elementwise(self, _EXSCAN, x, out, op, 0, algorithm), timeout, "iexscan")
        return r  # type: ignore[no-any-return]

    def ibarrier(self, *, timeout: float | None = None) -> Request:
        """Start :meth:`barrier` and return at once.

        Args:
            timeout: as for :meth:`barrier`.

        Returns:
            A :class:`~shmcoll.Request` that completes once every rank has entered the barrier.
        """
        return self._start(bind.barrier(self), timeout, "ibarrier")

    # --- point to point -----------------------------------------------------------------------
    # Messages travel apart from the collectives (see comm.p2p): tags, ANY_SOURCE/ANY_TAG,
    # probes that see only point-to-point messages, sends to oneself. Messages between one pair
    # of ranks with the same tag arrive in order.
    def send(self, x: np.ndarray, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send ``x`` to rank ``dst`` with ``tag``.

        Returns once the message is in shared memory (a message larger than the mailbox waits for
        the receiver to take its beginning). A rank may send to itself, any size, and receive the
        message afterwards.

        Example::

            if comm.rank == 0:
                comm.send(np.arange(4.0), dst=1, tag=7)
            elif comm.rank == 1:
                status = comm.recv(buf := np.empty(4), src=0, tag=7)

        Args:
            x: the data (any C-contiguous array; a device array is staged through the host).
            dst: the receiving rank (this rank included).
            tag: an int >= 0 the receiver can select on.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Raises:
            ValueError: ``dst`` out of range, a negative tag, a bad timeout (before anything is sent
                or received).
            TypeError: a tag that is not an int.
            ShmcollError: the peer died, the call timed out, or the communicator was aborted; the
                communicator is then broken.
        """
        p2p = self._p2p
        if p2p is not None and p2p._send_lean is not None and timeout is None and p2p.send_again(x, dst, tag):
            return  # the lean path: the same array as the last direct send (p2p.send_again)
        if type(x) is not np.ndarray:
            x = self._p2p_array(x, dst, tag, True)
            if x is None:
                return
        p2p = self._point_to_point()
        seconds = self._valid_timeout(timeout)  # (a bad timeout fails before anything is sent)
        if not p2p.send_now(x, dst, tag):
            p2p.send(x, dst, tag, seconds, True).wait()

    def recv(
        self, buf: np.ndarray, src: int = ANY_SOURCE, tag: int = ANY_TAG, *, timeout: float | None = None
    ) -> Status:
        """Receive into ``buf`` a message from ``src`` (or any rank) with ``tag`` (or any tag).

        Messages from one sender with one tag arrive in the order they were sent. A message that
        does not fit stays, to be received into a fitting buffer.

        Args:
            buf: where the message goes: its dtype, with room for the message (it may be larger;
                ``Status.count`` says how much was written).
            src: the sender's rank, or :data:`~shmcoll.ANY_SOURCE`.
            tag: the tag, or :data:`~shmcoll.ANY_TAG`.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            The message's :class:`~shmcoll.Status`: ``source``, ``tag``, ``count`` (elements).

        Raises:
            ValueError: the matching message is larger than ``buf``; ``src`` out of range.
            TypeError: the matching message has another dtype than ``buf``.
            ShmcollError: the sender died, the call timed out, or the communicator was aborted; the
                communicator is then broken.
        """
        p2p = self._p2p
        if p2p is not None and p2p._recv_lean is not None and timeout is None:
            status = p2p.recv_again(buf, src, tag)  # the lean path (p2p.recv_again)
            if status is not None:
                return status
        if type(buf) is not np.ndarray:
            status = self._p2p_array(buf, src, tag, False)
            if isinstance(status, Status):
                return status
            buf = status
        p2p = self._point_to_point()
        seconds = self._valid_timeout(timeout)
        status = p2p.recv_now(buf, src, tag, seconds)
        if status is None:
            status = p2p.recv(buf, src, tag, seconds, True).wait()
        return status  # type: ignore[no-any-return]

    def isend(self, x: np.ndarray, dst: int, tag: int = 0, *, timeout: float | None = None) -> Request:
        """Start :meth:`send` and return at once; ``x`` belongs to the send until its
        ``wait()`` returns.

        Args:
            x: the data (a host array).
            dst: the receiving rank.
            tag: an int >= 0.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns ``None`` once the message is in
            shared memory.

        Raises:
            ValueError: as :meth:`send`, at once. Errors between ranks come out of ``wait()``.
            TypeError: ``x`` is a device array (nonblocking point-to-point takes host arrays).
        """
        x = self._host_array(x, "x")
        return self._point_to_point().send(x, dst, tag, self._valid_timeout(timeout), False)

    def irecv(
        self, buf: np.ndarray, src: int = ANY_SOURCE, tag: int = ANY_TAG, *, timeout: float | None = None
    ) -> Request:
        """Start :meth:`recv` and return at once; ``buf`` belongs to the receive until its
        ``wait()`` returns.

        Args:
            buf: where the message goes (a host array).
            src: the sender's rank, or :data:`~shmcoll.ANY_SOURCE`.
            tag: the tag, or :data:`~shmcoll.ANY_TAG`.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            A :class:`~shmcoll.Request`; its ``wait()`` returns the message's
            :class:`~shmcoll.Status`.

        Raises:
            ValueError: as :meth:`recv`, at once; a message that does not fit, from ``wait()``.
            TypeError: ``buf`` is a device array.
        """
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
        """Send ``x`` to ``dst`` and receive into ``buf`` from ``src`` at once (no deadlock
        when two ranks exchange).

        Example::

            right, left = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
            comm.sendrecv(x, right, buf, left)  # a ring shift

        Args:
            x: the data to send.
            dst: the rank to send to.
            buf: where the received message goes.
            src: the rank to receive from, or :data:`~shmcoll.ANY_SOURCE`.
            sendtag: the sent message's tag.
            recvtag: the tag to receive, or :data:`~shmcoll.ANY_TAG`.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            The receive's :class:`~shmcoll.Status`.

        Raises:
            ValueError: as :meth:`send` and :meth:`recv`.
            TypeError: as :meth:`recv`.
            ShmcollError: as :meth:`send` and :meth:`recv`.
        """
        sent = self.isend(x, dst, sendtag, timeout=timeout)
        status = self.recv(buf, src, recvtag, timeout=timeout)
        sent.wait()
        return status

    def probe(self, src: int = ANY_SOURCE, tag: int = ANY_TAG, *, timeout: float | None = None) -> Status:
        """Wait until a point-to-point message from ``src`` with ``tag`` can be received, and
        return its :class:`~shmcoll.Status` without receiving it.

        Unlike MPI's, ``count`` is in elements of the sender's dtype (``Status.nbytes`` gives the
        bytes): size the buffer from it, then :meth:`recv` with the status's ``source`` and
        ``tag`` to take that very message. Collective traffic is never seen.

        Args:
            src: the sender's rank, or :data:`~shmcoll.ANY_SOURCE`.
            tag: the tag, or :data:`~shmcoll.ANY_TAG`.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            The :class:`~shmcoll.Status` of the earliest matching message.

        Raises:
            ValueError: ``src`` out of range, a bad timeout.
            ShmcollError: no message came within the timeout, a peer died, or the communicator was
                aborted; the communicator is then broken.
        """
        status = self._point_to_point().probe(src, tag, self._valid_timeout(timeout), True)
        assert status is not None
        return status

    def iprobe(self, src: int = ANY_SOURCE, tag: int = ANY_TAG) -> Status | None:
        """:meth:`probe` without waiting.

        Args:
            src: the sender's rank, or :data:`~shmcoll.ANY_SOURCE`.
            tag: the tag, or :data:`~shmcoll.ANY_TAG`.

        Returns:
            The :class:`~shmcoll.Status` of a message that can be received now, or ``None``.

        Raises:
            ValueError: ``src`` out of range.
        """
        return self._point_to_point().probe(src, tag, None, False)

    def send_object(self, obj: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send a picklable ``obj`` to ``dst`` with ``tag``; receive it with :meth:`recv_object`.

        Args:
            obj: any picklable object.
            dst: the receiving rank.
            tag: an int >= 0.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Raises:
            TypeError: ``obj`` cannot be pickled (nothing is sent).
            ValueError: as :meth:`send`.
            ShmcollError: as :meth:`send`.
        """
        try:
            payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        except Exception as exc:  # noqa: BLE001  (anything pickling raises is the caller's error)
            raise TypeError(f"send_object: cannot pickle the object: {exc}") from exc
        p2p = self._point_to_point()
        p2p.send(payload, dst, tag, self._valid_timeout(timeout), True, dtype_code=p2p_module.OBJECT_DTYPE).wait()

    def recv_object(self, src: int = ANY_SOURCE, tag: int = ANY_TAG, *, timeout: float | None = None) -> Any:
        """The next object sent with :meth:`send_object` from ``src`` with ``tag``.

        Args:
            src: the sender's rank, or :data:`~shmcoll.ANY_SOURCE`.
            tag: the tag, or :data:`~shmcoll.ANY_TAG`.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            The unpickled object.

        Raises:
            ValueError: as :meth:`recv`.
            ShmcollError: as :meth:`recv`.
        """
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

        Example::

            buf = comm.alloc((1 << 20,), np.float32)
            buf[:] = local_gradients
            comm.allreduce(buf)  # may read the peers' buf in place

        Args:
            shape: the array's shape (an int or a sequence).
            dtype: its numpy dtype.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            A :class:`~shmcoll.shm.registered.SharedArray` (a numpy array).

        Raises:
            ValueError: a bad shape, or more memory than the machine has.
            TypeError: an unsupported dtype.
            ShmcollError: a peer died, the call timed out or the ranks asked for different arrays;
                the communicator is then broken.
        """
        return registered.alloc(self, shape, dtype, timeout)

    # --- object collectives -------------------------------------------------------------------
    def broadcast_object(self, obj: Any, root: int = 0, *, timeout: float | None = None) -> Any:
        """Root's picklable ``obj`` on every rank (root gets its own object back).

        Example::

            cfg = comm.broadcast_object(load_config() if comm.rank == 0 else None, root=0)

        Args:
            obj: the root's object; ignored elsewhere.
            root: the rank whose object is sent.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            Root's object (a copy, on the other ranks).

        Raises:
            TypeError: an object cannot be pickled; raised on every rank, and the communicator stays
                usable.
            ShmcollError: a peer died, the call timed out or the ranks' calls differ (see
                :meth:`allreduce`); the communicator is then broken.
        """
        return objects.broadcast_object(self, obj, root, timeout=timeout)

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """Every rank's picklable ``obj``, as a list indexed by rank, on every rank.

        Args:
            obj: this rank's object.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            ``[obj of rank 0, obj of rank 1, ...]``.

        Raises:
            TypeError: an object cannot be pickled; raised on every rank, and the communicator stays
                usable.
            ShmcollError: a peer died, the call timed out or the ranks' calls differ (see
                :meth:`allreduce`); the communicator is then broken.
        """
        return objects.allgather_object(self, obj, timeout=timeout)

    def gather_object(self, obj: Any, root: int = 0, *, timeout: float | None = None) -> list[Any] | None:
        """Every rank's picklable ``obj`` as a list on ``root``; ``None`` elsewhere.

        Args:
            obj: this rank's object.
            root: the rank that gets the list.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            On ``root`` the list indexed by rank; ``None`` elsewhere.

        Raises:
            TypeError: an object cannot be pickled; raised on every rank, and the communicator stays
                usable.
            ShmcollError: a peer died, the call timed out or the ranks' calls differ (see
                :meth:`allreduce`); the communicator is then broken.
        """
        return objects.gather_object(self, obj, root, timeout=timeout)

    def scatter_object(self, objs: Sequence[Any] | None, root: int = 0, *, timeout: float | None = None) -> Any:
        """Element ``j`` of root's sequence ``objs`` to rank ``j``.

        Args:
            objs: on the root, ``world_size`` picklable objects; other ranks pass ``None``.
            root: the rank whose sequence is scattered.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            This rank's element.

        Raises:
            TypeError: an object cannot be pickled; raised on every rank, and the communicator stays
                usable.
            ShmcollError: a peer died, the call timed out or the ranks' calls differ (see
                :meth:`allreduce`); the communicator is then broken.
        """
        return objects.scatter_object(self, objs, root, timeout=timeout)

    def alltoall_object(self, objs: Sequence[Any], *, timeout: float | None = None) -> list[Any]:
        """Element ``j`` of this rank's sequence ``objs`` to rank ``j``.

        Args:
            objs: ``world_size`` picklable objects, one for each rank.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            The objects sent to this rank, as a list indexed by sender.

        Raises:
            TypeError: an object cannot be pickled; raised on every rank, and the communicator stays
                usable.
            ShmcollError: a peer died, the call timed out or the ranks' calls differ (see
                :meth:`allreduce`); the communicator is then broken.
        """
        return objects.alltoall_object(self, objs, timeout=timeout)

    def allreduce_object(
        self,
        obj: Any,
        op: ReduceOp | int | str | Callable[[Any, Any], Any] = ReduceOp.SUM,
        *,
        timeout: float | None = None,
    ) -> Any:
        """Every rank's picklable ``obj`` combined with ``op``, on every rank.

        Objects are combined left to right in rank order, the same way on every rank, so every rank
        gets the same result.

        Example::

            n_seen = comm.allreduce_object(len(my_items))  # the sum over ranks
            merged = comm.allreduce_object(my_set, lambda a, b: a | b)

        Args:
            op: a :class:`~shmcoll.ReduceOp` applied with Python's operators (``+``, ``*``, ``min``,
                ``max``, ``&``, ``|``, ``^``; ``AVG`` divides the sum by ``world_size``), its value
                or name, or any two-argument callable.
            obj: this rank's object.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            The combined object.

        Raises:
            TypeError: an object cannot be pickled; raised on every rank, and the communicator stays
                usable.
            ShmcollError: a peer died, the call timed out or the ranks' calls differ (see
                :meth:`allreduce`); the communicator is then broken.
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
        """:meth:`allreduce_object` onto ``root``.

        Args:
            obj: this rank's object.
            op: as for :meth:`allreduce_object`.
            root: the rank that gets the result.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            On ``root`` the combined object; ``None`` elsewhere.

        Raises:
            TypeError: an object cannot be pickled; raised on every rank, and the communicator stays
                usable.
            ShmcollError: a peer died, the call timed out or the ranks' calls differ (see
                :meth:`allreduce`); the communicator is then broken.
        """
        return objects.reduce_object(self, obj, op, root, timeout=timeout)

    # --- sub-communicators --------------------------------------------------------------------
    def split(self, color: int | None, key: int | None = None, *, timeout: float | None = None) -> Communicator | None:
        """New communicators, one per ``color``, ranked by ``(key, rank)``; collective
        (``MPI_Comm_split``, torch's ``new_group``).

        Example::

            row = comm.split(color=comm.rank // 2)  # ranks {0, 1}, {2, 3}, ...
            row.allreduce(x)
            row.close()

        Args:
            color: an int >= 0: ranks with the same color form one communicator. ``None``: take part
                in the call but get no communicator.
            key: orders the ranks of a new communicator (ties by rank); ``None``: this rank.
            timeout: seconds this call may wait for its peers (``float("inf")``: no limit); default:
                the communicator's :attr:`timeout`.

        Returns:
            This rank's new :class:`Communicator` (close it when done), or ``None`` for
            ``color=None``.

        Raises:
            ValueError: a negative or non-int ``color``.
            ShmcollError: a peer died, the call timed out, or a sub-communicator could not be
                created (every member raises it).
        """
        return groups.split(self, color, key, timeout)  # type: ignore[no-any-return]

    # --- lifetime -----------------------------------------------------------------------------
    def abort(self, reason: str = "", *, cause: BaseException | None = None) -> None:
        """Make every rank's pending and future calls fail with :class:`~shmcoll.CommunicatorBrokenError`.

        Args:
            reason: said in this rank's later errors.
            cause: the exception this rank failed with, if that is why it aborts: the peers then
                learn that this rank *failed* (as when a rank started by :func:`shmcoll.spawn`
                raises), not that it called ``abort()``.
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

        Idempotent. ``with comm:`` closes it at the end of the block; communicators from
        :func:`shmcoll.init` are closed at exit.

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
