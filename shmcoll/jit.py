"""The one place numba's decorators are configured.

Numba's on-disk cache notices edits to a function's *own* file only: change an intrinsic in
``shm/atomics.py`` and the engine's cached machine code would still be loaded. So every jitted
function of shmcoll caches under a directory keyed on the package version plus a hash of all
jitted sources (and the numba/numpy/Python versions): any edit gives a fresh directory, and a
stale kernel can never run.

Numba picks a function's cache directory when it is decorated (``config.CACHE_DIR`` at that
moment), so :func:`jit` sets it just for the decoration and leaves the user's own setting alone.

A compile (a cache miss) takes seconds per engine dtype, during which a first run would print
nothing and look hung; so a compile says so on stderr, and processes that miss the cache
together compile one at a time, so that the others load what the first compiled instead of all
compiling it at once (:class:`_Announcer`). Loads from the cache say nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import numba
import numba.core.cpu
import numpy as np
from numba.core import event, types
from numba.core.compiler_lock import global_compiler_lock

from shmcoll import config
from shmcoll._version import __version__

F = TypeVar("F", bound=Callable[..., Any])

_HERE = os.path.dirname(os.path.abspath(__file__))
# Every file whose code ends up inside a jitted function.
_JITTED_SOURCES = (
    "jit.py",
    "shm/atomics.py",
    "kernels/scalar.py",
    "kernels/cpu.py",
    "engine/cpu.py",
    "engine/mailbox.py",
    "plan/ir.py",
    "shm/layout.py",
    "shm/liveness.py",
    "shm/arena.py",
    "shm/cma.py",
)


def _source_key() -> str:
    h = hashlib.sha256()
    for name in (__version__, numba.__version__, np.__version__, sys.version):
        h.update(name.encode())
    for rel in _JITTED_SOURCES:
        path = os.path.join(_HERE, rel)
        with open(path, "rb") as f:
            h.update(rel.encode())
            h.update(f.read())
    return h.hexdigest()[:16]


SOURCE_KEY = _source_key()
CACHE_DIR = os.path.join(config.get().cache_dir, "numba", SOURCE_KEY)


# What one compile of a kind costs on a 2-core machine (measured with an empty cache): the engine
# for one dtype (5 to 6 s each), or the small control kernels. "About" is all it claims.
ENGINE_COMPILE_S = 5
CONTROL_COMPILE_S = 1


class _Retry(Exception):
    """Raised out of a compile that waited for another process's: look in the cache again."""


class _Announcer(event.Listener):
    """Makes shmcoll's compiles say so on stderr, one process at a time.

    Numba raises ``numba:compile`` only on a cache miss, for the function called and again for
    every callee it compiles on the way; only the outermost of shmcoll's own counts. Ranks start
    together and miss the cache together; compiling the same kernels at once would cost n times
    the work on cores they share. So a compile first takes a lock file in :data:`CACHE_DIR`: the
    process that gets it at once compiles, says so (unless a marker in the cache directory says
    that kind was announced before), and holds the lock until numba has saved the result; a
    process that finds it taken waits for it, then raises :class:`_Retry`, and :func:`jit`'s
    dispatchers call numba again, which now finds the kernel in the cache if that was the one
    compiled. Loads from the cache never touch the lock. An unusable cache directory means no
    lock (and no cache either).
    """

    def __init__(self) -> None:
        self.ours: set[int] = set()  # ids of the dispatchers :func:`jit` made (they live forever)
        # Every field is touched under numba's global compiler lock (numba's events fire inside
        # it, :func:`_retrying` holds it around ``finished``), so by one thread at a time.
        self.depth = 0
        self.lock: int | None = None  # the lock file's descriptor while this process compiles
        self.kind: str | None = None  # what the compile under way is for (see :func:`payload_dtype`)
        self.busy = False  # between the outermost compile's start and its finish (on_compile)

    def on_start(self, ev: event.Event) -> None:
        if id(ev.data["dispatcher"]) not in self.ours:
            return
        self.depth += 1
        if self.depth > 1:
            return
        if not self.busy:
            self.busy = True
            _tell(True)
        try:
            os.makedirs(CACHE_DIR, exist_ok=True)
            fd = os.open(os.path.join(CACHE_DIR, "compile.lock"), os.O_CREAT | os.O_RDWR, 0o666)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fcntl.flock(fd, fcntl.LOCK_EX)  # another process compiles: wait for it to finish
                os.close(fd)
                raise _Retry() from None
            self.lock = fd
        dispatcher = ev.data["dispatcher"]
        self.kind = getattr(dispatcher, "payload", None) or (
            "bfloat16" if "bfloat16" in dispatcher.py_func.__name__ else payload_dtype(ev.data["args"])
        )
        if os.path.exists(self._marker()):
            return  # said before (another function of the same kind, or an earlier process)
        what, about = (f"kernels for {self.kind}", ENGINE_COMPILE_S) if self.kind else ("kernels", CONTROL_COMPILE_S)
        sys.stderr.write(f"shmcoll: compiling {what} (once per machine, about {about} s)...\n")
        sys.stderr.flush()

    def on_end(self, ev: event.Event) -> None:
        if id(ev.data["dispatcher"]) in self.ours:
            self.depth -= 1

    def finished(self, ok: bool) -> None:
        """A ``compile`` of one of shmcoll's dispatchers returned (or raised): once the outermost
        is done, and numba has saved what it compiled, mark the kind as said (only a finished
        compile: one killed half way says so again next time) and let the next process in."""
        if self.depth > 0:
            return
        if ok and self.kind is not None:
            with contextlib.suppress(OSError):
                os.close(os.open(self._marker(), os.O_CREAT | os.O_WRONLY, 0o666))
        self.kind = None
        if self.lock is not None:
            os.close(self.lock)  # (releases it)
            self.lock = None
        if self.busy:
            self.busy = False
            _tell(False)

    def _marker(self) -> str:
        return os.path.join(CACHE_DIR, f"announced-{self.kind or 'control'}")


_COMPILE_LISTENERS: list[Callable[[bool], None]] = []


def on_compile(listener: Callable[[bool], None]) -> None:
    """Call ``listener(True)`` when this process starts compiling one of shmcoll's kernels (or
    waiting for another process's compile of it), and ``listener(False)`` when it is done. The
    communicator uses it to tell its peers that this rank is late because it compiles, so that
    the wait does not count against their collectives' timeouts."""
    _COMPILE_LISTENERS.append(listener)


def _tell(compiling: bool) -> None:
    for listener in _COMPILE_LISTENERS:
        with contextlib.suppress(Exception):  # a compile must never fail for a listener's sake
            listener(compiling)


def payload_dtype(args: tuple[Any, ...]) -> str:
    """The dtype a compile is for: its arrays' element type other than the int64 of tables and
    control words, e.g. ``float32`` for ``execute(handles, x, out)``; ``int64`` for a function of
    three int64 arrays or more (the engine's int64 payload); "" for control kernels. (A
    dispatcher whose arguments do not say, such as ``engine.entry_at``'s, carries it as its
    ``payload`` attribute.)"""
    names = [str(a.dtype) for a in args if isinstance(a, types.Array)]
    return next((n for n in reversed(names) if n != "int64"), "int64" if len(names) >= 3 else "")


_ANNOUNCER = _Announcer()
event.register("numba:compile", _ANNOUNCER)


def _retrying(dispatcher: Any) -> None:
    """Make ``dispatcher.compile`` call numba again after a :class:`_Retry` (see
    :class:`_Announcer`); numba's ``compile`` looks in the cache before it compiles."""
    compile_here = dispatcher.compile

    def compile(sig: Any) -> Any:
        # Under numba's (reentrant) global compiler lock, which numba takes inside anyway: with
        # only numba's, a second thread's compile could start between the first one's return and
        # its ``finished``, and the two would share the announcer's depth and lock file (two
        # threads making the first call of a kernel at once: EBADF or a wait for ever).
        with global_compiler_lock:
            while True:
                try:
                    result = compile_here(sig)
                except _Retry:
                    continue
                except BaseException:
                    _ANNOUNCER.finished(ok=False)
                    raise
                _ANNOUNCER.finished(ok=True)
                return result

    dispatcher.compile = compile


NO_REFCOUNTS: dict[str, Any] = {"_nrt": False} if hasattr(numba.core.cpu.CPUTargetOptions, "_nrt") else {}
"""``jit`` options for functions that never own an array: no reference counting at all.

numba counts references to every array a function holds, and where its pruning gives up (a
large function with many branches: the engine's step) that is a pair of runtime calls per array
variable per call. The engine's arrays are all views of memory owned elsewhere (the arena, the
caller's buffers, ``carray`` views without an owner), so the counts do nothing there: an engine
call of one 8-byte local step took 104 ns with them and 54 without (1 rank, a jitted loop of 10^6
calls). A function compiled so may not allocate (numba refuses to compile one that does). Empty
where numba lacks the option (it is numba's own, unadvertised): then the counts stay."""


def jit(fn: F | None = None, **options: Any) -> Any:
    """``numba.njit(cache=True, nogil=True, ...)`` caching under :data:`CACHE_DIR`."""
    opts = {"cache": True, "nogil": True, **options}

    def decorate(f: F) -> F:
        # numba.config gains CACHE_DIR at import, which type checkers cannot see.
        saved = numba.config.CACHE_DIR  # type: ignore[attr-defined]
        numba.config.CACHE_DIR = CACHE_DIR  # type: ignore[attr-defined]
        try:
            dispatcher = numba.njit(**opts)(f)
            _ANNOUNCER.ours.add(id(dispatcher))
            _retrying(dispatcher)
            return dispatcher  # type: ignore[no-any-return]
        finally:
            numba.config.CACHE_DIR = saved  # type: ignore[attr-defined]

    return decorate(fn) if fn is not None else decorate
