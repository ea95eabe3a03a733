"""A rank's runtime on one arena: the engine state, the call-shape cache and the run loop.

:class:`~shmcoll.comm.communicator.Communicator` is this class plus the public methods. A call
arrives here as a :class:`~shmcoll.comm.calls.Bound` (its shape, and the arrays of this call)
and goes to the jitted engine, once. Only when the engine reports something other than OK does
Python do more: resume after a time slice (checking the deadline and the peers' liveness
meanwhile), or raise through :mod:`shmcoll.comm.failures`. Any error between ranks breaks the
communicator and raises the arena's abort word, so the other ranks stop within milliseconds.

Who may call: one call at a time. The engine claims the state when a call starts, so an
overlapping call from another thread (or a signal handler) gets ``BUSY`` before it touches
anything and raises :class:`~shmcoll.ConcurrentCallError`; a call that must write shared
scratch or state before it runs (a float16 or bfloat16 reduction, a read-only input, a
zero-copy call) claims first (:meth:`Runtime._claim`). Calls made of several (object
collectives, ``alloc``, ``split``) hold the communicator for their whole length
(:meth:`Runtime._nested`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil

from shmcoll import collectives, config, jit
from shmcoll.collectives import KIND_CODE
from shmcoll.comm import calls, failures, pages
from shmcoll.comm.calls import Bound, Call
from shmcoll.comm.requests import Queue, Request, with_trying
from shmcoll.engine import cpu as engine
from shmcoll.errors import CommunicatorBrokenError, ConcurrentCallError, ForkedCommunicatorError, ShmcollError
from shmcoll.kernels.cpu import narrow_bfloat16, widen_bfloat16
from shmcoll.shm import cma, layout
from shmcoll.shm.arena import Arena, ArenaHandle
from shmcoll.shm.atomics import atomic_cas, write_word
from shmcoll.shm.registered import Allocation
from shmcoll.types import FLOAT32

log = logging.getLogger("shmcoll")
TRACE = 5
logging.addLevelName(TRACE, "TRACE")

_SLEEP_NS = 5_000_000  # longest single futex sleep: bounds how late an abort is noticed
MISS = object()
"""What :meth:`Runtime._again` returns for a call that is not a repeat it can run."""

_SLICE_NS = 100_000_000  # how long the engine waits before Python checks deadline and peers

# Every connected runtime of this process, so that a fork can disable them in the child.
_CONNECTED: weakref.WeakSet[Runtime] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for rt in list(_CONNECTED):
        rt._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _compiling(now: bool) -> None:
    """This process compiles kernels (``jit.on_compile``): say so in its rank record of every
    communicator, for the peers that wait for it (``failures.compiling_peer``)."""
    for rt in list(_CONNECTED):
        if not rt._closed and rt._pid == os.getpid():
            rt._ctrl[rt._arena.layout.rank_word(rt._rank, layout.R_COMPILING)] = int(now)


jit.on_compile(_compiling)


class _RankPrefix(logging.LoggerAdapter):  # type: ignore[type-arg]
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[rank {self.extra['rank']}] {msg}", kwargs  # type: ignore[index]


def _configure_logging(level_name: str) -> None:
    if not level_name:
        return
    level = TRACE if level_name == "TRACE" else getattr(logging, level_name, logging.INFO)
    log.setLevel(level)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("shmcoll %(levelname)s %(message)s"))
        log.addHandler(handler)


class Runtime:
    """The state behind a communicator (see the module docstring)."""

    def __init__(self, arena: Arena, rank: int, *, timeout: float | None = None) -> None:
        cfg = config.get()
        _configure_logging(cfg.debug)
        self._arena = arena
        self._rank = rank
        self._world_size = arena.layout.world_size
        self._timeout = cfg.timeout_s if timeout is None else config.timeout_s(timeout)
        self._pid = os.getpid()
        self._nested_owner: int | None = None  # the thread holding the communicator for a nested call
        self._ctrl = arena.ctrl
        oversubscribed = self._world_size > len(os.sched_getaffinity(0))
        # Busy-wait only while the peer is likely running on another core: a few microseconds
        # when ranks outnumber cores (the peer may need *this* core), tens otherwise.
        spin_us = cfg.spin if cfg.spin is not None else (1 if oversubscribed else 20)
        self._state = engine.new_state(
            arena.layout,
            rank,
            spin_ns=spin_us * 1000,
            yields=256 if oversubscribed else 32,
            sleep_ns=_SLEEP_NS,
            slice_ns=_SLICE_NS,
        )
        self._calls: dict[tuple[Any, ...], Call] = {}
        # Each collective's last bound call, by collective code, for calls repeated with the
        # same arrays (comm.bind._remember).
        self._memo: list[Any] = [None] * len(collectives.PLAN_KINDS)
        self._lean: list[Any] = [None] * len(collectives.PLAN_KINDS)  # those the lean path runs
        self._scratch: dict[tuple[str, np.dtype], np.ndarray] = {}
        # Allocations live as long as some array views them (each SharedArray holds its own).
        self._allocations: weakref.WeakSet[Allocation] = weakref.WeakSet()
        self._auto_registered_choice: dict[tuple[Any, ...], str] = {}
        self._broken: str | None = None
        self._closed = False
        self._verify = os.environ.get("SHMCOLL_VERIFY", "") == "1"
        self._groups: int | None = None
        self._groups_agreed = False
        self._cma_crossover: int | None = None  # agreed by the ranks (calls.cma_crossover), once needed
        self._pages_words: Any = None  # the arena words comm.pages publishes and waits on
        self._progress: Queue | None = None  # started operations (created by the first one)
        self._p2p: Any = None  # point-to-point state (comm.p2p, created by the first message)
        self._mem_total = psutil.virtual_memory().total
        self._log = _RankPrefix(log, {"rank": rank})
        self._trace = log.isEnabledFor(TRACE)
        arena.register(rank)
        _CONNECTED.add(self)
        self._log.info(
            "connected: world_size=%d, %d slots of %d bytes per ring, timeout %.1fs; cross-memory attach %s",
            self._world_size,
            arena.layout.nslots,
            arena.layout.slot_bytes,
            self._timeout,
            cma.probe()[1],
        )

    # --- identity -----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank, ``0 <= rank < world_size``."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self._world_size

    @property
    def timeout(self) -> float:
        """Default seconds a call may wait for its peers."""
        return self._timeout

    @property
    def handle(self) -> ArenaHandle:
        """What another process needs to attach to this communicator's arena."""
        return self._arena.handle

    # --- call shapes --------------------------------------------------------------------------
    def _shape(self, key: tuple[Any, ...], kind: str, dtype: np.dtype, count: int, **how: Any) -> Call:
        """The cached call shape ``key``, prepared on first use (see ``calls.prepare``)."""
        call = self._calls.get(key)
        if call is None:
            call = calls.prepare(self, kind, dtype, count, **how)
            if len(self._calls) >= calls.MAX_CACHED:
                # Call shapes that vary without end (sizes from data) must not grow memory
                # without end: drop the older half (dicts keep insertion order).
                for stale in list(self._calls)[: calls.MAX_CACHED // 2]:
                    del self._calls[stale]
            self._calls[key] = call
        return call

    def _scratch_array(self, what: str, dtype: np.dtype, count: int) -> np.ndarray:
        key = (what, dtype)
        arr = self._scratch.get(key)
        if arr is None or arr.size < count:
            arr = self._scratch[key] = np.empty(max(count, 0), dtype=dtype)
        return arr

    def _bind(
        self,
        call: Call,
        x: np.ndarray | None,
        out: np.ndarray | None,
        result: Any,
        placement: Any,
        x_writeable: bool = True,
    ) -> Bound:
        """The engine's arrays for one call: 1-d views of ``x`` and ``out`` in the engine dtype.

        Calls whose buffers need copies (float16 and bfloat16 reductions, read-only inputs) or a
        placement (zero-copy) get theirs in :meth:`_special_buffers`, once the call holds the
        state.
        """
        if call.special or not x_writeable:
            return (call, None, None, result, out, placement, x)
        engine_dtype = call.engine_dtype
        if x is None:
            inp = call.no_buffer
        else:
            inp = x if x.ndim == 1 else x.reshape(-1)
            if inp.dtype is not engine_dtype and inp.dtype != engine_dtype:  # (dtypes are mostly singletons)
                inp = inp.view(engine_dtype)
        if out is None:
            res = call.no_buffer
        elif out is x:
            res = inp
        else:
            res = out if out.ndim == 1 else out.reshape(-1)
            if res.dtype is not engine_dtype and res.dtype != engine_dtype:
                res = res.view(engine_dtype)
        return (call, inp, res, result, out, None, x)

    def _special_buffers(self, b: Bound) -> tuple[np.ndarray, np.ndarray]:
        """The engine's arrays for a call bound without them (see :meth:`_bind`); the caller
        holds the claim, so the shared scratch is this call's alone."""
        call, _, _, _, out, placement, x = b
        if call.registered:
            return placement.buffers(call, x, out, self._state)  # type: ignore[no-any-return]
        engine_dtype = call.engine_dtype
        if call.widened:
            inp = self._scratch_array("f16in", FLOAT32, x.size)[: x.size]  # type: ignore[union-attr]
            if call.bfloat16:
                bits = x.reshape(-1).view(np.uint16)  # type: ignore[union-attr]
                widen_bfloat16(inp.view(np.uint32), 0, bits, 0, bits.size)
            else:
                np.copyto(inp, x.reshape(-1))  # type: ignore[union-attr]
            res = self._scratch_array("f16out", FLOAT32, out.size)[: out.size] if out is not None else call.no_buffer
            return inp, res
        flat = (x if x.ndim == 1 else x.reshape(-1)).view(engine_dtype)  # type: ignore[union-attr]
        inp = self._scratch_array("ro", engine_dtype, flat.size)[: flat.size]
        np.copyto(inp, flat)
        if out is None:
            return inp, call.no_buffer
        res = out if out.ndim == 1 else out.reshape(-1)
        return inp, res if res.dtype == engine_dtype else res.view(engine_dtype)

    # --- who may call -------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._broken is None and os.getpid() != self._pid:
            self._forked()  # a fork that ran no at-fork hooks (from C)
        if self._broken is not None:
            if self._is_forked():
                raise ForkedCommunicatorError(f"rank {self._rank}: {self._broken}")
            raise CommunicatorBrokenError(f"rank {self._rank}: communicator unusable: {self._broken}")

    def _is_forked(self) -> bool:
        return os.getpid() != self._pid

    def _forked(self) -> None:
        """This process is a fork of the one that connected: never touch the shared state."""
        self._broken = (
            f"this process (pid {os.getpid()}) is a fork of the process that connected the communicator "
            f"(pid {self._pid}); a communicator belongs to the process that connected it: connect anew in "
            f"the child (group.connect(rank)) or create communicators after forking"
        )

    def _concurrent_message(self, what: str) -> str:
        return (
            f"rank {self._rank}: {what} was called while another thread (or a signal handler) is in a call on "
            f"this communicator; calls on one communicator must not overlap: give each thread its own "
            f"communicator (comm.split) or serialise the calls with a lock. Nothing was done."
        )

    def _claim(self, call: Call) -> np.ndarray:
        """Claim the state from Python for a call that writes shared scratch before it runs;
        returns the handles that start it without claiming again."""
        owner = self._nested_owner
        nested = owner is not None and owner == threading.get_ident()
        if owner is not None and not nested:
            raise ConcurrentCallError(self._concurrent_message(call.label))
        if engine.claim(self._state, 1 if nested else 0) != engine.OK:
            raise ConcurrentCallError(self._concurrent_message(call.label))
        return call.claimed

    @contextlib.contextmanager
    def _nested(self, what: str, timeout: float | None) -> Iterator[None]:
        """Hold the communicator for a call made of several collectives (object collectives,
        ``alloc``, ``split``), so that no other thread's call interleaves with its parts.

        An exception that escapes once the parts have started communicating leaves the ranks in
        different places: it breaks the communicator (and aborts the peers), unless the body
        raises it after the block, on every rank alike (an *agreed* error).
        """
        if timeout is not None:
            config.timeout_s(timeout)
        me = threading.get_ident()
        if self._nested_owner == me:  # inside one of this thread's own nested calls
            yield
            return
        self._check_usable()
        if self._progress is not None:
            self._progress.drain()  # a call made of several runs after what was started before it
        if int(atomic_cas(self._state, engine.S_NESTED, 0, 1)) != 0:
            raise ConcurrentCallError(self._concurrent_message(what))
        self._nested_owner = me
        seq = int(self._state[engine.S_SEQ])
        try:
            if int(self._state[engine.S_ACTIVE]) != 0:  # a plain call of another thread is under way
                raise ConcurrentCallError(self._concurrent_message(what))
            yield
        except BaseException as exc:
            if self._broken is None and int(self._state[engine.S_SEQ]) != seq:
                self._fail(f"{what} failed half way: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._nested_owner = None
            write_word(self._state, engine.S_NESTED, 0)

    # --- the run loop -------------------------------------------------------------------------
    def _start(self, b: Bound, timeout: float | None, what: str, lean: Any = None) -> Request:
        """A nonblocking call: queue it for the progress thread; returns its request.

        ``lean`` is the call's way into the engine without the run loop (``bind.lean_run``: a
        persistent request's own); a call the binder remembered and promoted (an ``i``-form in
        a loop) takes its lean record, so that the queue enters the engine as the blocking
        call's lean path does."""
        if timeout is not None:
            config.timeout_s(timeout)
        if self._broken is not None:  # (binding ``b`` looked for a fork: calls.prepare)
            self._check_usable()
        if self._nested_owner is not None:
            raise ConcurrentCallError(self._concurrent_message(what))
        progress = self._progress
        if progress is None:
            progress = self._progress = Queue(self)
        if lean is None and type(b) is tuple:
            code = KIND_CODE[b[0].kind]
            m = self._lean[code]
            if m is not None and len(m) > 9 and m[9] is b and b[0].huge is None:  # (see pages.lean)
                lean = m[11] if len(m) == 12 else self._queue_lean(code, m)
        return progress.submit(b, timeout, what, lean)

    def _queue_lean(self, code: int, m: tuple[Any, ...]) -> Any:
        """The queue's own records for the remembered call ``m`` (``requests.with_trying``), made
        at its first start (not every blocking call that is remembered starts too) and kept as
        ``m[11]``."""
        m = self._lean[code] = (*m, with_trying((m[7], m[8], m[10]), m[9]))
        return m[11]

    def _start_again(
        self, code: int, x: Any, out: Any, op: Any, root: Any, algorithm: str, timeout: Any, what: str
    ) -> Any:
        """The collective's last call started again with the very same arguments (an ``i``-form
        in a loop): its request, or :data:`MISS` (the caller binds and starts it as usual).

        :meth:`_again`'s tests, but pending operations do not stop it (this one joins their
        queue); what it skips is the binder and :meth:`_start`'s checks, which these tests
        settle: 8-byte ``iallreduce(x).wait()`` at one rank (where only the Python path is
        timed) 1.38-1.42 -> 1.27-1.30 us, 4 of 5 alternating rounds (the blocking call: 0.49;
        ``benchmarks/RESULTS.md``, stop 42). A call whose ranks agree on their pages first
        (``comm/pages.py``) runs through the run loop, so it is not taken here. A tensor's
        remembered call matches no call here (``bind._MATCHES_NO_CALL``): the binder checks it.
        """
        m = self._lean[code]
        if (
            m is None
            or m[0] is not x
            or m[1] is not out
            or m[2] is not op
            or m[3] is not root
            or m[4] is not algorithm
            or timeout is not None
            or (out if x is None else x).dtype is not m[5]
            or (m[6] is not None and not m[6].flags.writeable)
            or self._nested_owner is not None
            or self._broken is not None
            or m[9][0].huge is not None  # (bind.NOT_LEAN's m[0] matched no x)
        ):
            return MISS
        progress = self._progress
        if progress is None:
            progress = self._progress = Queue(self)
        return progress.submit(m[9], None, what, m[11] if len(m) == 12 else self._queue_lean(code, m))

    def _run(self, b: Bound, timeout: float | None, queued: bool = False) -> Any:
        """Run one bound call to its end (or raise); returns what the method returns.

        A blocking call made while started operations are pending joins their queue and runs
        after them (``queued``: the queue runs it now). One method, not two: a Python frame
        more costs about 30 ns of an 8-byte call that takes 1.7 us.
        """
        if not queued:
            progress = self._progress
            if progress is not None and progress.pending:
                if timeout is not None:
                    config.timeout_s(timeout)
                return progress.submit(b, timeout, "a blocking call").wait()
        if type(b) is not tuple:  # a device call: its own path (comm.device)
            return b.run(timeout)  # type: ignore[attr-defined]
        m = self._lean[KIND_CODE[b[0].kind]]
        if (
            m is not None
            and len(m) > 9
            and m[9] is b
            and timeout is None
            and self._broken is None
            and self._nested_owner is None
        ):
            # The binder has just matched this remembered call (a tensor's, whose layout the
            # methods' own lean tests cannot check: bind._promote): its record, as Runtime._again.
            st = m[7](m[8])
            if st != engine.OK:
                self._wait_or_raise(st, b[0], b[1], b[2], self._timeout)
            return b[3]
        if self._broken is not None:
            self._check_usable()
        limit = self._timeout if timeout is None else config.timeout_s(timeout)
        timed = None
        if b[0].huge is not None:  # auto's choice hinges on the ranks' pages or timings: they agree first
            if b[0].timed is not None and b[0].timed.leader:  # (it times its calls: comm.timed)
                timed = b[0].timed
                t0_ns = time.perf_counter_ns()
            b = pages.agreed(self, b, limit)
        call, inp, res, result, out, _, _ = b
        if inp is None:
            handles = self._claim(call)
            try:
                inp, res = self._special_buffers(b)
            except BaseException:
                engine.release(self._state)
                raise
        else:
            owner = self._nested_owner
            if owner is None:
                handles = call.start
            elif owner == threading.get_ident():
                handles = call.nested
            else:
                raise ConcurrentCallError(self._concurrent_message(call.label))
        if self._trace:
            t0 = time.perf_counter()
        st = engine.execute(handles, inp, res)
        if st != engine.OK:
            self._wait_or_raise(st, call, inp, res, limit)
        if timed is not None:
            timed.took(time.perf_counter_ns() - t0_ns)
        if self._trace:
            self._log.log(
                TRACE, "%s #%d took %.1f us", call.label, failures.call_number(self), (time.perf_counter() - t0) * 1e6
            )
        if call.finish:
            if call.registered:
                self._state[engine.S_PLACE] = 0
            elif call.widened and out is not None:  # a float16 or bfloat16 reduction: its float32 result back
                if call.bfloat16:
                    narrow_bfloat16(out.reshape(-1).view(np.uint16), 0, res.view(np.uint32), 0, res.size)
                else:
                    np.copyto(out.reshape(-1), res)
            if call.fill is not None:
                # (an assignment, not fill(): bfloat16's identity is a 0-d array, not a scalar)
                out.reshape(-1)[...] = call.fill  # type: ignore[union-attr]
        return result

    def _again(self, code: int, x: Any, out: Any, op: Any, root: Any, algorithm: str, timeout: Any) -> Any:
        """The collective's last call made again with the very same arguments, run at once, or
        :data:`MISS` (the caller binds and runs it as usual).

        The lean path of a program's loop: the remembered call (``comm.bind._remember``: the same
        numpy arrays, op, root and algorithm, the same dtype object, a still-writeable result)
        enters the engine through its compiled entry point with its record's address, when
        nothing else needs the run loop (no timeout given, no started operations pending, no
        nested call held, not broken; no trace: then no call is kept for it). What it skips: the
        binder, the run loop's frame, numba's dispatch and the unboxing of three arrays.
        ``allreduce``, ``allgather``, ``broadcast`` and ``reduce`` write these tests out in their own bodies (the
        method call is 60-90 ns of a 0.4 us call), and :meth:`_start_again` makes them for the
        ``i``-forms; a change here must be made there too.
        """
        m = self._lean[code]
        if (
            m is None
            or m[0] is not x
            or m[1] is not out
            or m[2] is not op
            or m[3] is not root
            or m[4] is not algorithm
            or timeout is not None
            or (out if x is None else x).dtype is not m[5]
            or (m[6] is not None and not m[6].flags.writeable)
            or self._nested_owner is not None
            or self._broken is not None
            or (self._progress is not None and self._progress.pending)
        ):
            return MISS
        st = m[7](m[8])
        b = m[9]
        if st != engine.OK:
            self._wait_or_raise(st, b[0], b[1], b[2], self._timeout)
        return b[3]

    def _wait_or_raise(self, st: int, call: Call, inp: np.ndarray, res: np.ndarray, limit: float) -> None:
        """Carry a call that did not finish in one engine run to its end, or raise.

        Whatever escapes from here once the call has started (a timeout, a peer's death, a
        KeyboardInterrupt) breaks the communicator and raises the abort word: a call is never
        left half done on one rank while the others go on.
        """
        if st == engine.BUSY:
            raise ConcurrentCallError(self._concurrent_message(call.label))
        if st >= engine.ON_CMA:  # a timed shape's lean entry agreed on cma, whose plan waits (comm.pages.lean)
            st, call = st - engine.ON_CMA, call.huge  # type: ignore[assignment]  # (a timed shape has one)
        elif st == engine.SAMPLED:  # the leader of a timed shape made a call to time: it votes
            pages.sampled(self, call)
            return
        elif st == engine.VOTE:  # the leader of a timed shape has a call to make in Python
            st, call, inp, res = pages.voted(self, call, limit)
            if st == engine.OK:
                return
        elif st == engine.AGREEING:  # a timed shape's agreement on cma waits
            st, call, inp, res = pages.agreeing(self, call, limit)
            if st == engine.OK:
                return
        started = last = time.monotonic() - _SLICE_NS / 1e9
        try:
            while st != engine.OK:
                if st == engine.WAITING:
                    if self._arena.word(layout.AB_CODE) != 0:
                        failures.fail_aborted(self, call)  # the cause is whoever aborted, not who left since
                    lost = failures.lost_peer(self, failures.call_number(self))
                    if lost is not None:
                        failures.fail_peer_lost(self, call, *lost)
                    failures.check_awaited_call(self, call)
                    now = time.monotonic()
                    if failures.compiling_peer(self) is not None:
                        started += now - last  # a peer compiling kernels is late, not stuck
                    last = now
                    if now - started > limit:
                        failures.fail_timeout(self, call, limit)
                elif st == engine.ABORTED:
                    failures.fail_aborted(self, call)
                elif st == engine.PEER_DEAD:
                    failures.fail_peer_lost(self, call, int(self._state[engine.S_ERR_PEER]), "dead")
                elif st == engine.READ_FAILED:
                    failures.fail_read(self, call)
                elif st == engine.MISMATCH:
                    if (
                        int(self._state[engine.S_ERR_SIG]) == call.sig
                        and int(self._state[engine.S_ERR_SEQ]) == failures.call_number(self)
                        and int(self._state[engine.S_ERR_PLACE]) != int(self._state[engine.S_PLACE])
                    ):
                        if call.varying:
                            failures.fail_counts(self, call)
                        failures.fail_placement(self, call)
                    failures.fail_mismatch(
                        self,
                        call,
                        int(self._state[engine.S_ERR_PEER]),
                        int(self._state[engine.S_ERR_SEQ]),
                        int(self._state[engine.S_ERR_SIG]),
                        int(self._state[engine.S_ERR_STEP]),
                    )
                st = engine.execute(call.resume, inp, res)
        except ShmcollError:
            if self._broken is None:  # a raise that did not go through failures (none should)
                self._fail(f"{call.label} failed")
            raise
        except BaseException as exc:  # KeyboardInterrupt mid-call: the call's state is half done
            self._broken = f"rank {self._rank} was interrupted in {call.label} ({type(exc).__name__})"
            self._arena.abort(
                self._rank,
                layout.ABORT_ERROR,
                -1,
                failures.call_number(self),
                call.sig,
                failures.wait_step(self),
            )
            raise

    # --- failing and leaving ------------------------------------------------------------------
    def _fail(self, detail: str) -> None:
        """This rank's own code failed: abort, so that peers raise at once instead of timing out."""
        if self._closed or self._is_forked():
            return
        self._arena.abort(self._rank, layout.ABORT_ERROR, -1, failures.call_number(self))
        self._broken = f"rank {self._rank} failed: {detail}"

    def _abort_remote(self, text: str, kind: int, blamed: int) -> None:
        """The multi-node communicator built on this one failed (``kind``: ``layout.REMOTE_*``,
        ``blamed``: the world rank it found lost, or -1): abort with that story in the abort word,
        where this node's ranks can read it after this process has exited."""
        if self._closed or self._is_forked():
            return
        self._arena.abort(self._rank, layout.ABORT_REMOTE, blamed, failures.call_number(self), 0, 0, kind)
        self._broken = text

    def _remote_story(self) -> tuple[int, int, int] | None:
        """``(origin, kind, blamed)`` when a rank of this communicator aborted it for its
        multi-node communicator's failure (see ``_abort_remote``), else None."""
        if self._closed or self._arena.word(layout.AB_CODE) != layout.ABORT_REMOTE:
            return None
        info = self._arena.abort_info()
        return info["origin"], info["detail"], info["peer"]

    def _close_runtime(self) -> None:
        """Leave the arena (see ``Communicator.close``)."""
        if self._closed:
            return
        if self._is_forked():
            self._closed = True
            self._calls.clear()
            self._memo = [None] * len(self._memo)
            self._lean = [None] * len(self._lean)
            self._broken = self._broken or "the communicator is closed"
            return
        if self._progress is not None:
            # Nothing may run while the arena is unmapped: started operations end first (each
            # within its timeout; after a failure they fail at once).
            self._progress.drain()
            self._progress.stop()
        if self._p2p is not None:
            self._p2p.stop()
        self._closed = True
        self._calls.clear()
        self._memo = [None] * len(self._memo)
        self._lean = [None] * len(self._lean)
        self._scratch.clear()
        if self._broken is None:
            failures.warn_unreceived(self)
        self._arena.deregister(self._rank, failed=self._broken is not None)
        if self._arena.segment.owner:
            self._arena.segment.unlink()
        self._ctrl = np.empty(0, np.int64)  # no view of the arena may outlive it
        for allocation in list(self._allocations):
            allocation.close()
        self._arena.close()
        self._broken = self._broken or "the communicator is closed"
