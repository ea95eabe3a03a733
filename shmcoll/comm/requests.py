"""Nonblocking operations: requests, and the progress thread that carries them.

A started operation (``comm.iallreduce(x)`` and every other ``i``-form) is a bound call put in
its communicator's **queue**; :class:`Request` is the caller's handle on it. Operations on one
communicator run one at a time, in the order they were started, blocking calls included: a
blocking call made while operations are pending joins the queue and waits for its turn.

Who runs them: a daemon **progress thread** per communicator (started with the first
nonblocking call) takes the queue's head whenever nothing is running, and runs it with the same
run loop as a blocking call. The engine waits without the GIL, so while the caller computes (in
numpy, torch, ``time.sleep``), the operation advances. A thread that waits on a request does not
just sleep either: when nothing is running it takes the head of the queue itself, so starting
an operation and waiting for it at once costs no hand-off between threads.

When the progress thread is woken matters: waking it makes it take the GIL from the caller,
which on a loaded machine costs more than a small operation (about 7 us against 2 at 2 ranks on
2 cores). So a submission wakes it only when it has been idle for a while
(``_ACTIVE_S``); while operations keep coming it polls instead (every ``_POLL_S``), and it takes
an operation only once nobody has taken it for ``_GRACE_S``: a caller that waits at once runs its
operation itself, and one that computes has it started within ``_POLL_FAST_S``. The pace is
set by who took the last operation: polls take the GIL from the caller, so while callers wait at
once (torch's synchronous calls) the thread polls every 0.5 ms, and while it runs the operations
itself (callers compute meanwhile) every 0.1 ms. Measured at 2 ranks: a 16 MiB allreduce
overlapped with computation took 1.30x the ideal time with 0.5 ms polling and 1.02-1.13x with
0.1 ms, while submit-and-wait at 8 B took 4.3 us with 0.5 ms polling and 5.6 us with 0.1 ms
(16 and 31 us through torch). The polling stops soon after the last submission (5 ms): a
blocking call made meanwhile measured 15% slower at 8 B with 100 ms of polling.

A small operation may run at its start instead (:meth:`Queue._admit`): one that finds nothing
ahead of it runs until its first wait and is then *parked* at the head of the queue, holding the
engine mid-call, for the next thread that takes the head to resume it.

Errors (a lost peer, a timeout, a mismatch) are raised by :meth:`Request.wait` and
:meth:`Request.test` with the messages of the blocking calls; the communicator is broken, so
the operations queued behind the failed one fail too, with ``CommunicatorBrokenError``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from shmcoll import config
from shmcoll.engine import cpu as engine
from shmcoll.engine.cpu import OK, WAITING

Runtime = Any  # comm.runtime.Runtime

log = logging.getLogger("shmcoll")
_PENDING, _RUNNING, _DONE = 0, 1, 2
# Every completion on every communicator is announced here, for wait_any/wait_all over requests
# of several communicators; a request's own waiters use its communicator's condition.
_POLL_S = 0.0005  # while callers take their own operations (they wait at once)
_POLL_FAST_S = 0.0001  # while this thread runs them (callers compute meanwhile)
_POLL_BUSY_S = 0.002  # while a caller runs one itself
_GRACE_S = 0.00005
_ACTIVE_S = 0.005
_ANY_DONE = threading.Condition()
_ANY_WAITERS = [0]  # threads in wait_any (completions notify _ANY_DONE only if there are some)
# Operations up to this many bytes per buffer run at their start as far as they go without
# waiting (Queue._admit). A larger one would keep the caller from its own work for longer than a
# queued start costs, so it is left to whoever waits, or the progress thread. Since that run
# holds the queue's lock instead of taking it twice more, 64 KiB gains (it was 16 KiB: at 64 KiB
# start+wait measured 3-11% slower at its start than queued). ``benchmarks/latency.py -n 2
# --launches 3``, persistent start+wait, 3 rounds alternating 16 and 64 KiB here (the blocking
# call in brackets): 32 KiB 2.57-2.58 -> 1.74-1.81 us (1.57-1.63), 64 KiB 3.68-3.75 -> 2.89-2.93
# (2.75-2.77); ``iallreduce().wait()`` 3.05-3.13 -> 2.39-2.49 and 4.19-4.25 -> 3.68-3.76. At 256
# KiB against 64 (2 rounds) start+wait won 0-5% and ``iallreduce().wait()`` lost 2-10%.
START_AT_ONCE = 64 << 10


def with_trying(lean: tuple[Any, ...], b: Any) -> tuple[Any, ...]:
    """``lean`` (entry point, record address, record: ``bind.lean_run``), and for a call ``b``
    whose buffers hold at most :data:`START_AT_ONCE` bytes the addresses of a trying record (its
    run returns at the first wait) and of a resuming one, then both records: the queue runs such
    a call at its start (:meth:`Queue._admit`)."""
    call, inp, res = b[0], b[1], b[2]
    if max(inp.nbytes, res.nbytes) > START_AT_ONCE:
        return lean
    trying = engine.record_for(call.start, inp, res, trying=True)
    resuming = engine.record_for(call.resume, inp, res)
    return (*lean, trying.ctypes.data, resuming.ctypes.data, (trying, resuming))


class Waiter(Protocol):
    """Who carries a request to its end: a communicator's queue, or its point-to-point state."""

    def wait_for(self, req: Request, timeout: float | None) -> None: ...


class Request:
    """A started operation (returned by the ``i``-forms of the Communicator's methods).

    The buffers given to the operation belong to it until :meth:`wait` returns (or :meth:`test`
    returns True): do not read an output or write an input before then.
    """

    __slots__ = (
        "_queue",
        "_bound",
        "_timeout",
        "_state",
        "_result",
        "_error",
        "what",
        "_since",
        "_callbacks",
        "_lean",
        "_parked",
    )

    def __init__(
        self, queue: Waiter, bound: Any, timeout: float | None, what: str, since: float, lean: Any = None
    ) -> None:
        self._queue = queue
        self._since = since
        self._bound = bound
        # (entry point, record address, record[, trying record's address, resume record's
        # address, those records]): see Queue._run and Queue._admit
        self._lean = lean
        self._parked = -1  # the status its first run stopped at (Queue._admit), else -1
        self._timeout = timeout
        self._state = _PENDING
        self._result: Any = None
        self._error: BaseException | None = None
        self.what = what
        self._callbacks: list[Callable[[Request], None]] | None = None

    def __repr__(self) -> str:
        state = ("pending", "running", "done")[self._state]
        return f"<shmcoll.Request {self.what} ({state})>"

    @property
    def done(self) -> bool:
        """Whether the operation has completed (successfully or not)."""
        return self._state == _DONE

    def test(self) -> bool:
        """Whether the operation has completed, without blocking; raises its error if it failed."""
        if self._state != _DONE:
            return False
        if self._error is not None:
            raise self._error
        return True

    def _on_done(self, fn: Callable[[Request], None]) -> None:
        """Call ``fn(self)`` once the operation has completed: at once if it has, else on the
        thread that completes it (the progress thread, or a waiter that ran it), outside every
        lock. For collective requests (the queue's); the torch backend completes its futures so.
        """
        # (the Queue's lock: Queue._run completes a request under it)
        with self._queue._lock:  # type: ignore[attr-defined]
            if self._state != _DONE:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def wait(self, timeout: float | None = None) -> Any:
        """Wait until the operation completes; returns what the blocking call returns.

        Args:
            timeout: seconds to wait at most (``None``: until it completes, however long the
                operation's own timeout lets it take). If it has not completed by then,
                ``TimeoutError`` is raised and the operation goes on: wait again later.
        Raises:
            ShmcollError: what the blocking call would have raised.
            TimeoutError: ``timeout`` elapsed first.
        """
        if self._state != _DONE:
            self._queue.wait_for(self, timeout)
        if self._error is not None:
            raise self._error
        return self._result


class Queue:
    """One communicator's started operations, and the thread that runs them.

    One plain lock guards the queue; conditions on it are used only to sleep, and notified only
    when someone sleeps on them (an idle progress thread, a waiter), because waking a thread
    also makes it take the GIL back from the caller.
    """

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the progress thread sleeps on it
        self._done = threading.Condition(self._lock)  # waiters sleep on it
        self._items: collections.deque[Request] = collections.deque()
        self._running = False
        self._runner = 0  # the thread running the operation now (0: none)
        self._idle = False  # the progress thread sleeps on _work until woken
        self._active_until = 0.0  # the progress thread polls until then
        self._waiters = 0  # threads sleeping on _done
        self._stopping = False
        self.pending = 0  # started and not finished; read without the lock by the run loop
        self._thread: threading.Thread | None = None
        self._thread_id = -1
        self._fast = False

    # --- submitting ---------------------------------------------------------------------------
    def submit(self, bound: Any, timeout: float | None, what: str, lean: Any = None) -> Request:
        req = Request(self, bound, timeout, what, 0.0, lean)  # (_admit sets its time if queued)
        lock = self._lock
        lock.acquire()  # (not `with`: 0.06 us less a start)
        try:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name=f"shmcoll-progress-r{self._rt.rank}", daemon=True
                )
                self._thread.start()
            done = self._admit(req)
        finally:
            lock.release()
        if done and _ANY_WAITERS[0]:
            with _ANY_DONE:
                _ANY_DONE.notify_all()
        return req

    def restart(self, req: Request, bound: Any) -> None:
        """Start a completed request again on ``bound`` (a persistent request's; the caller
        checked that it is done, and that nothing holds or broke the communicator):
        :meth:`submit` without making a request."""
        req._bound = bound
        req._result = req._error = None
        lock = self._lock
        lock.acquire()  # (not `with`: 0.06 us less a start)
        try:
            done = self._admit(req)
        finally:
            lock.release()
        if done and _ANY_WAITERS[0]:
            with _ANY_DONE:
                _ANY_DONE.notify_all()

    def _admit(self, req: Request) -> bool:
        """Queue ``req``, or run it at its start; returns whether it completed so (call with the
        lock held; the caller then tells :func:`wait_any`'s waiters).

        A small request whose lean path has a trying record (:func:`with_trying`) and that
        finds nothing ahead of it runs at once, as far as it goes without waiting: a step that
        would wait returns instead, and the request goes to the head of the queue, *parked*,
        for the first thread that waits on it (or the progress thread, after its grace) to
        carry on from there. So a start posts what this rank sends while the caller goes on, a
        start followed by a wait costs one run and one resumption instead of the queue's
        hand-off, and a request whose peers were there already completes in its start (and
        needs no polls of the progress thread: only a queued or parked one starts them).

        The run holds the queue's lock: a trying run returns within ``engine.TRY_SPIN_NS`` of
        spinning at a wait, a thread that took the lock meanwhile could only wait for it, and
        taking the lock once instead of three times was a third of what a start cost over the
        blocking call (an uncontended ``with lock`` measured 0.12 us; ``acquire()`` and
        ``release()`` 0.06). ``benchmarks/latency.py -n 2 --launches 3``, 3 rounds alternating
        with the code before (which took the lock to admit, to complete, and to park): 8-byte
        persistent start+wait 1.34-1.35 -> 0.93-0.97 us, ``iallreduce(x).wait()`` 2.13-2.16 ->
        1.60-1.61, the blocking call 0.71-0.73 in both. No Python code runs in this thread
        until the run returns, and none can add a callback (:meth:`Request._on_done` takes the
        lock), so a request done here has none to call."""
        self.pending += 1
        lean = req._lean
        if lean is None or len(lean) < 4 or self._running or self._items:
            now = time.monotonic()
            req._since = now
            self._active_until = now + _ACTIVE_S
            req._state = _PENDING
            self._items.append(req)
            if self._idle:
                self._work.notify()
            return False
        req._state = _RUNNING  # (``done`` is read without the lock; a restarted request was done)
        st = lean[0](lean[3])
        if st == OK:
            req._result = req._bound[3]
            req._bound = None
            req._state = _DONE
            self.pending -= 1
            if self._waiters:
                self._done.notify_all()
            return True
        req._parked = st
        now = time.monotonic()
        req._since = now  # (its grace, for the progress thread, runs from here)
        self._active_until = now + _ACTIVE_S
        req._state = _PENDING
        self._items.appendleft(req)
        if self._waiters:
            self._done.notify_all()
        if self._idle:
            self._work.notify()
        return False

    # --- running ------------------------------------------------------------------------------
    def _take(self) -> Request | None:
        """The queue's head, if nothing is running (call with the lock held)."""
        if self._running or not self._items:
            return None
        req = self._items.popleft()
        req._state = _RUNNING
        self._running = True
        self._runner = threading.get_ident()
        self._fast = self._runner == self._thread_id  # who took the last one sets the pace
        return req

    def _run(self, req: Request) -> None:
        """Run ``req`` (the caller took it with :meth:`_take`) and announce its completion."""
        rt = self._rt
        lean = req._lean
        parked = req._parked
        try:
            if parked >= 0 or (lean is not None and rt._nested_owner is None and rt._broken is None):
                # The blocking call's lean path (Runtime._again), for a call that has one: the
                # run loop, numba's dispatch and the unboxing of three arrays cost 0.3 us here.
                # A parked request (see _admit) holds the engine's state mid-call: it resumes.
                if parked < 0:
                    st = lean[0](lean[1])
                else:
                    req._parked = -1
                    st = lean[0](lean[4]) if parked == WAITING else parked
                b = req._bound
                if st != OK:
                    limit = rt._timeout if req._timeout is None else config.timeout_s(req._timeout)
                    rt._wait_or_raise(st, b[0], b[1], b[2], limit)
                req._result = b[3]
            else:
                req._result = rt._run(req._bound, req._timeout, True)
        except BaseException as exc:  # noqa: BLE001  (handed to whoever waits)
            req._error = exc
        req._bound = None  # its buffers are the caller's again
        self._complete(req)

    def _complete(self, req: Request) -> None:
        """Announce that ``req``, which the calling thread ran, has completed."""
        with self._lock:
            req._state = _DONE  # (a callback added from now on runs at once: Request._on_done)
            callbacks, req._callbacks = req._callbacks, None
            self._running = False
            self._runner = 0
            self.pending -= 1
            if self._waiters:
                self._done.notify_all()
            if self._items and self._idle:
                self._work.notify()
        if callbacks is not None:
            for fn in callbacks:
                try:
                    fn(req)
                except BaseException:  # noqa: BLE001  (a callback's failure is not the operation's)
                    log.exception("a completion callback of %s failed", req.what)
        if _ANY_WAITERS[0]:
            with _ANY_DONE:
                _ANY_DONE.notify_all()

    def _serve(self) -> None:
        self._thread_id = threading.get_ident()
        woken = False
        while True:
            with self._lock:
                req = self._take_if_left(woken)
                while req is None:
                    if self._stopping and not self._items and not self._running:
                        return
                    now = time.monotonic()
                    woken = False
                    if self._items and not self._running:  # the head is young: look again after its grace
                        self._work.wait(max(self._items[0]._since + _GRACE_S - now, 1e-6))
                    elif now < self._active_until:
                        # (a caller running its own operation needs no poll: waking costs its
                        # rank's partner a time slice on a busy machine)
                        self._work.wait(_POLL_BUSY_S if self._running else _POLL_FAST_S if self._fast else _POLL_S)
                    else:
                        self._idle = True
                        woken = self._work.wait()
                        self._idle = False
                    req = self._take_if_left(woken)
            self._run(req)

    def _take_if_left(self, woken: bool) -> Request | None:
        """The head, if nothing runs and it was left to this thread: woken for it, or untaken
        for its grace (call with the lock held)."""
        if not woken and self._items and time.monotonic() - self._items[0]._since < _GRACE_S:
            return None
        return self._take()

    def wait_for(self, req: Request, timeout: float | None) -> None:
        """Wait until ``req`` is done, running queued operations meanwhile (when ``timeout`` is
        None) if nothing else runs them."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if req._state == _DONE:
                    return
                mine = self._take() if deadline is None else None
                if mine is None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(
                            f"{req.what} has not completed after {timeout:g}s; it goes on: wait again later"
                        )
                    self._waiters += 1
                    try:
                        self._done.wait(left)
                    finally:
                        self._waiters -= 1
                    continue
            self._run(mine)
            if mine is req:  # (done: no need to take the lock again to see it)
                return

    def drain(self) -> None:
        """Wait until every started operation has completed (before a call that must run alone).

        Returns at once in the thread that runs an operation now: that operation is the call
        that must run alone (a device call is several calls of its communicator)."""
        if self._runner == threading.get_ident():
            return
        while True:
            with self._lock:
                if not self.pending:
                    return
                last = self._items[-1] if self._items else None
                if last is None:  # only the running one is left
                    self._waiters += 1
                    try:
                        self._done.wait()
                    finally:
                        self._waiters -= 1
                    continue
            self.wait_for(last, None)

    def stop(self) -> None:
        """Let the progress thread end once the queue is empty (the communicator closes)."""
        with self._lock:
            self._stopping = True
            self._work.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)


def wait_all(requests: Sequence[Request], timeout: float | None = None) -> list[Any]:
    """Wait for every request; returns their results, in order.

    Raises the first failed request's error (in order) once all have completed. ``timeout``
    bounds the whole wait (``TimeoutError``; the operations go on).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    for req in requests:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            req.wait(left)
        except TimeoutError:
            raise
        except BaseException:  # noqa: BLE001  (raised below, once all are done)
            pass
    return [req.wait() for req in requests]


def wait_any(requests: Sequence[Request], timeout: float | None = None) -> int:
    """Wait until one of the requests has completed; returns its index (``req.wait()`` then
    gives its result or raises its error). Requests already done count at once."""
    if not requests:
        raise ValueError("wait_any needs at least one request")
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with _ANY_DONE:
            for i, req in enumerate(requests):
                if req.done:
                    return i
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"none of {len(requests)} requests completed within {timeout:g}s")
            _ANY_WAITERS[0] += 1
            try:  # (the short wait is a backstop for a completion announced between the check and here)
                _ANY_DONE.wait(0.05 if left is None else min(left, 0.05))
            finally:
                _ANY_WAITERS[0] -= 1
