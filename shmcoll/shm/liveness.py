"""A death notice the kernel writes into shared memory: one robust mutex per rank.

Every rank holds a process-shared *robust* ``pthread_mutex_t`` in its liveness line of the
arena for as long as it is connected. When a thread dies holding a robust mutex, the kernel
itself (walking the thread's robust list at exit, ``SIGKILL`` included) stores
``FUTEX_OWNER_DIED`` in the mutex's lock word. So a peer learns that a rank died by one load of
a word that nobody writes while the rank lives: the engine checks every peer's word when a call
starts, which is how a call that involves a dead rank raises even when it would never have to
wait for it (a broadcast root only sends), at the cost of a few cached loads.

The lock word (the first 32-bit field of glibc's and musl's mutex, the low half of the line's
first int64 on a little-endian machine) reads:

- ``0``: not held: the rank has not connected yet, or it closed its communicator;
- a thread id: held by a live rank (in *its* PID namespace: the value is only compared to 0);
- ``FUTEX_OWNER_DIED`` set: the holder died without closing.

A mutex is released only by the thread that locked it, and the kernel marks it as soon as that
*thread* exits; a rank's communicator may be created on a thread that ends long before the
process does. So one daemon thread per process, the *keeper*, locks and unlocks every mutex of
that process and otherwise sleeps. glibc links held robust mutexes into a list through the
mutexes themselves, so a mutex must be unlocked before its memory is unmapped: the keeper keeps a
reference to the mapping until then.

Where the C library lacks robust mutexes, :func:`available` is False and ranks hold nothing:
dead peers are still found by the waits (``/proc``), just not at the start of a call.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("shmcoll")

OWNER_DIED = 0x40000000
TID_MASK = 0x3FFFFFFF
MUTEX_BYTES = 48  # sizeof(pthread_mutex_t): 40 on x86-64, 48 on aarch64
_PTHREAD_PROCESS_SHARED = 1
_PTHREAD_MUTEX_ROBUST = 1


def _libc() -> Any:
    vp, i = ctypes.c_void_p, ctypes.c_int
    argtypes = {
        "pthread_mutexattr_init": [vp],
        "pthread_mutexattr_setpshared": [vp, i],
        "pthread_mutexattr_setrobust": [vp, i],
        "pthread_mutex_init": [vp, vp],
        "pthread_mutex_lock": [vp],
        "pthread_mutex_unlock": [vp],
    }
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        for name, types in argtypes.items():
            getattr(libc, name).argtypes = types
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def available() -> bool:
    """Whether this process can hold a liveness mutex."""
    return _LIBC is not None


def state(word: int) -> str:
    """What a lock word says: ``"free"``, ``"held"`` or ``"died"``."""
    if word & OWNER_DIED:
        return "died"
    return "held" if word & TID_MASK else "free"


class _Keeper:
    """The thread that owns this process's liveness mutexes (see the module docstring)."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[tuple[Callable[[], int], list[Any], threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._serve, name="shmcoll-liveness", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:  # stop (at exit)
                return
            fn, result, done = item
            try:
                result.append(fn())
            except BaseException as exc:  # noqa: BLE001  (handed back to the caller)
                result.append(exc)
            done.set()

    def stop(self) -> None:
        self._requests.put(None)
        self._thread.join(timeout=1.0)

    def call(self, fn: Callable[[], int]) -> int:
        result: list[Any] = []
        done = threading.Event()
        self._requests.put((fn, result, done))
        done.wait()
        if isinstance(result[0], BaseException):
            raise result[0]
        return int(result[0])


_KEEPER: _Keeper | None = None
_KEEPER_LOCK = threading.Lock()


def _keeper() -> _Keeper:
    global _KEEPER
    with _KEEPER_LOCK:
        if _KEEPER is None:
            _KEEPER = _Keeper()
        return _KEEPER


def _forget_keeper() -> None:
    # A forked child has no keeper thread (only the forking thread survives a fork).
    global _KEEPER, _KEEPER_LOCK
    _KEEPER = None
    _KEEPER_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_keeper)


def _stop_keeper() -> None:
    """At exit (after the communicators' own exit hooks, registered later): end the keeper.

    A daemon thread still alive when the interpreter finalizes is ended with ``pthread_exit``
    the moment it wants the GIL back, which unwinds its C stack: a thread that ends cleanly
    before finalization never risks that. (The torch jobs' abort at exit that once suggested
    this was a gloo worker thread, not the keeper: see ``shmcoll.torch``'s exit hook.)
    """
    global _KEEPER
    with _KEEPER_LOCK:
        keeper, _KEEPER = _KEEPER, None
    if keeper is not None:
        keeper.stop()


atexit.register(_stop_keeper)


class Held:
    """A liveness mutex this process holds at ``address``; ``mapping`` is kept alive until it is
    released (glibc's robust list runs through the mutex: see the module docstring)."""

    def __init__(self, address: int, mapping: object) -> None:
        self.address = address
        self._mapping: object | None = mapping
        self._pid = os.getpid()

    def release(self) -> None:
        """Unlock (idempotent); a forked child never touches its parent's mutex."""
        if self._mapping is None:
            return
        if os.getpid() == self._pid and _LIBC is not None:
            address = self.address
            _keeper().call(lambda: _LIBC.pthread_mutex_unlock(ctypes.c_void_p(address)))
        self._mapping = None


def hold(address: int, mapping: object) -> Held | None:
    """Initialise the robust mutex at ``address`` (zeroed shared memory of :data:`MUTEX_BYTES`) and
    lock it on the keeper thread; ``None`` where robust mutexes are unavailable."""
    if _LIBC is None:
        return None
    libc = _LIBC

    def lock() -> int:
        attr = ctypes.create_string_buffer(16)
        if (
            libc.pthread_mutexattr_init(attr)
            or libc.pthread_mutexattr_setpshared(attr, _PTHREAD_PROCESS_SHARED)
            or libc.pthread_mutexattr_setrobust(attr, _PTHREAD_MUTEX_ROBUST)
            or libc.pthread_mutex_init(ctypes.c_void_p(address), attr)
        ):
            return -1
        return int(libc.pthread_mutex_lock(ctypes.c_void_p(address)))

    rc = _keeper().call(lock)
    if rc != 0:
        log.debug("no liveness mutex (pthread error %d): dead peers are found by waits only", rc)
        return None
    return Held(address, mapping)
