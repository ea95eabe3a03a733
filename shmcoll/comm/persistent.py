"""Persistent collectives, as MPI-4 has them: checked and planned once, started many times.

``req = comm.allreduce_init(x, op)`` makes every check of :meth:`Communicator.allreduce` and
finds its call shape once, without communicating; then each ``req.start()`` starts the same call
on the same buffers (a nonblocking operation, queued like the ``i``-forms), and ``req.wait()``
returns what the blocking call returns. A request may be started again once its ``wait()`` has
returned (or ``test()`` returned True). Every rank starts its persistent requests in the same
order as its other operations, as for the ``i``-forms.

The buffers belong to the request while it is started; between a ``wait()`` and the next
``start()`` the caller may read the output and write new input into the same arrays.

What a start saves: a request keeps its way into the engine (``bind.lean_run``: the entry point
and record of the blocking call's lean path), and a start after the first reuses the same
request. Measured at 2 ranks (``benchmarks/latency.py -n 2 --launches 5``, medians): start+wait
of an 8-byte allreduce 3.07 -> 1.66 us (the blocking call: 0.71, ``iallreduce().wait()`` 2.44),
64 KiB 10.59 -> 9.33 (blocking 7.55), on an Intel machine. A small request (up to
``requests.START_AT_ONCE``) that finds nothing ahead of it also runs at its start, until its
first wait (``requests.Queue._admit``): its peers get its part at once, and one whose peers
started first completes within ``start()``. On an AMD machine, 3 alternating rounds: 8 bytes
2.13-2.16 -> 1.63-1.86 us (blocking 0.84-0.98). Since that run holds the queue's lock (taken
once a start, not three times) and a wait on a request done in its start returns from here, on
the Zen 5 VM: 8 bytes 1.34-1.35 -> 0.93-0.97 us (blocking 0.71-0.73), 64 KiB, now run at its
start too, 6.50-6.87 -> 5.93-6.06 (blocking 5.25-5.74). What is left over the blocking call
(0.2 us at 8 bytes) is the queue's Python: its lock and the request's states. The blocking
call repeated on the same arrays already skips every check and all planning (``bind``'s lean
path), so a persistent request saves nothing over it here; it is the form for code written
against MPI's persistent collectives, and a start that posts this rank's part at once.

A request is *started* from ``start()`` until a ``wait()`` returns or a ``test()`` returns True
(or either raises the call's error), as in MPI, even when the call completed within its start.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shmcoll import collectives, config
from shmcoll.comm import bind
from shmcoll.comm.requests import _DONE, Request
from shmcoll.comm.runtime import Runtime
from shmcoll.types import ReduceOp

Counts = Sequence[int] | np.ndarray
_BY = collectives.BY_NAME


class Persistent:
    """A collective bound once; :meth:`start` runs it again, :meth:`wait` completes it.

    ``begin()`` starts the call and returns its request (a :class:`~shmcoll.Request`, or any
    object with ``wait``, ``test`` and ``done``: the multi-node communicator's are MPI-driven).
    """

    __slots__ = ("_begin", "what", "_active", "_rt", "_bound", "_started")

    def __init__(self, begin: Callable[[], Any], what: str, rt: Any = None, bound: Any = None) -> None:
        self._begin = begin
        self.what = what
        self._active: Any = None
        # A single-node request's runtime and bound call: a start after the first reuses its
        # request (Queue.restart), skipping what begin() would do again for nothing (the checks
        # of a usable communicator, a new request): start() took 0.93 us, 0.50 so (1 rank).
        self._rt = rt
        self._bound = bound
        # Started and not yet completed by wait() or test(), as MPI has it: a small call may be
        # done within its start (requests.Queue._admit), and is still not to be started again.
        self._started = False

    def __repr__(self) -> str:
        state = "started" if self._started else "inactive"
        return f"<shmcoll.Persistent {self.what} ({state})>"

    def start(self) -> None:
        """Start the call (returns at once); raises RuntimeError if it is started already."""
        if self._started:
            raise RuntimeError(f"{self.what} is started already: wait() for it before starting it again")
        active = self._active
        rt = self._rt
        if (
            rt is not None
            and active is not None
            and rt._broken is None
            and rt._nested_owner is None
            and active._queue is rt._progress
        ):
            self._started = True
            active._queue.restart(active, self._bound)
            return
        self._active = self._begin()
        self._started = True

    def wait(self, timeout: float | None = None) -> Any:
        """Wait until the started call completes; returns what the blocking call returns.

        Raises:
            RuntimeError: the request was never started.
            ShmcollError: what the blocking call would have raised.
            TimeoutError: ``timeout`` elapsed first (the call goes on).
        """
        active = self._active
        if active is None:
            raise RuntimeError(f"{self.what} was never started: call start() first")
        if type(active) is Request and active._state == _DONE and active._error is None:  # (done in its start)
            self._started = False
            return active._result
        try:
            return active.wait(timeout)
        finally:
            if active.done:  # (not after a TimeoutError: it goes on)
                self._started = False

    def test(self) -> bool:
        """Whether the started call has completed, without blocking; raises its error if it failed."""
        active = self._active
        if active is None:
            raise RuntimeError(f"{self.what} was never started: call start() first")
        try:
            return active.test()
        finally:
            if active.done:
                self._started = False

    @property
    def done(self) -> bool:
        """Whether the last start has completed (True before the first start)."""
        return self._active is None or self._active.done


class PersistentForms(Runtime):
    """The ``*_init`` methods of :class:`~shmcoll.Communicator` (each takes the arguments of its
    blocking method and returns a :class:`Persistent`; variable counts must be given)."""

    def _persistent(self, b: Any, timeout: float | None, what: str) -> Persistent:
        if timeout is not None:
            config.timeout_s(timeout)
        begin = functools.partial(self._start, b, timeout, what, bind.lean_run(self, b))
        return Persistent(begin, what, self if type(b) is tuple else None, b)

    def allreduce_init(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent :meth:`allreduce` (``start()``/``wait()``; see :mod:`shmcoll.comm.persistent`)."""
        b = bind.elementwise(self, _BY["allreduce"], x, out, op, 0, algorithm)
        return self._persistent(b, timeout, "allreduce_init")

    def reduce_init(
        self,
        x: np.ndarray,
        root: int = 0,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent :meth:`reduce`."""
        b = bind.elementwise(self, _BY["reduce"], x, out, op, root, algorithm)
        return self._persistent(b, timeout, "reduce_init")

    def broadcast_init(
        self,
        x: np.ndarray,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent :meth:`broadcast`."""
        b = bind.elementwise(self, _BY["broadcast"], x, out, None, root, algorithm)
        return self._persistent(b, timeout, "broadcast_init")

    def allgather_init(
        self, x: np.ndarray, *, out: np.ndarray | None = None, algorithm: str = "auto", timeout: float | None = None
    ) -> Persistent:
        """A persistent :meth:`allgather`."""
        b = bind.gathering(self, _BY["allgather"], x, out, 0, algorithm)
        return self._persistent(b, timeout, "allgather_init")

    def gather_init(
        self,
        x: np.ndarray,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent :meth:`gather`."""
        b = bind.gathering(self, _BY["gather"], x, out, root, algorithm)
        return self._persistent(b, timeout, "gather_init")

    def scatter_init(
        self,
        x: np.ndarray | None,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent :meth:`scatter`."""
        b = bind.scattering(self, _BY["scatter"], x, out, None, root, algorithm)
        return self._persistent(b, timeout, "scatter_init")

    def reduce_scatter_init(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        counts: Counts | None = None,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent :meth:`reduce_scatter` (equal blocks, or ``counts`` per rank)."""
        if counts is None:
            b = bind.scattering(self, _BY["reduce_scatter"], x, out, op, 0, algorithm)
        else:
            b = bind.varying(self, _BY["reduce_scatterv"], x, out, counts, op, 0, algorithm)
        return self._persistent(b, timeout, "reduce_scatter_init")

    def alltoall_init(
        self, x: np.ndarray, *, out: np.ndarray | None = None, algorithm: str = "auto", timeout: float | None = None
    ) -> Persistent:
        """A persistent :meth:`alltoall`."""
        b = bind.elementwise(self, _BY["alltoall"], x, out, None, 0, algorithm)
        return self._persistent(b, timeout, "alltoall_init")

    def allgatherv_init(
        self,
        x: np.ndarray,
        counts: Counts,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent :meth:`allgatherv` (``counts`` required: learning them communicates)."""
        if counts is None:
            raise ValueError("allgatherv_init: counts is required (allgatherv learns them by communicating)")
        b = bind.varying(self, _BY["allgatherv"], x, out, counts, None, 0, algorithm)
        return self._persistent(b, timeout, "allgatherv_init")

    def gatherv_init(
        self,
        x: np.ndarray,
        counts: Counts | None = None,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent :meth:`gatherv`."""
        b = bind.varying(self, _BY["gatherv"], x, out, counts, None, root, algorithm)
        return self._persistent(b, timeout, "gatherv_init")

    def scatterv_init(
        self,
        x: np.ndarray | None,
        counts: Counts | None = None,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent :meth:`scatterv`."""
        b = bind.varying(self, _BY["scatterv"], x, out, counts, None, root, algorithm)
        return self._persistent(b, timeout, "scatterv_init")

    def alltoallv_init(
        self,
        x: np.ndarray,
        send_counts: Counts,
        recv_counts: Counts,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent :meth:`alltoallv` (``recv_counts`` required)."""
        if recv_counts is None:
            raise ValueError("alltoallv_init: recv_counts is required (alltoallv learns them by communicating)")
        b = bind.varying(self, _BY["alltoallv"], x, out, send_counts, None, 0, algorithm, recv_counts)
        return self._persistent(b, timeout, "alltoallv_init")

    def scan_init(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent :meth:`scan`."""
        b = bind.elementwise(self, _BY["scan"], x, out, op, 0, algorithm)
        return self._persistent(b, timeout, "scan_init")

    def exscan_init(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent :meth:`exscan`."""
        b = bind.elementwise(self, _BY["exscan"], x, out, op, 0, algorithm)
        return self._persistent(b, timeout, "exscan_init")

    def barrier_init(self, *, timeout: float | None = None) -> Persistent:
        """A persistent :meth:`barrier`."""
        return self._persistent(bind.barrier(self), timeout, "barrier_init")
