"""Process lifetime: :class:`Group`, :func:`spawn`, :func:`init` and the ``shmcoll run`` launcher.

Three ways to start ranks, one mechanism underneath: a :class:`Group` owns the job (its token
and its arena); ranks attach to it with :meth:`Group.connect`.

Nothing may outlive a job in ``/dev/shm``. The arena's name is unlinked by the last rank to
attach; until then, and for sub-communicator arenas created later by ranks, a *janitor* covers
the owner: a tiny separate process (its own session, so Ctrl-C does not reach it) that waits for
the owner's end of a pipe to close, however the owner ends (``SIGKILL`` included), then unlinks
every name carrying the job's token. Ranks started by ``spawn`` and ``shmcoll run`` also get
``PR_SET_PDEATHSIG``, so a killed launcher leaves no orphan ranks.

Joins are fail-fast: the first rank to fail aborts the communicator (the others raise within
milliseconds), survivors get a grace period to report, then their stacks are dumped
(``faulthandler`` on ``SIGUSR1``) and they are killed. Nothing waits without a deadline.

Mistakes are caught before any process starts, where they are cheap to explain: a function
``spawn``'s new processes could not import (defined in a REPL, under ``if __name__ ==
"__main__":``), a script that would start jobs again in every child, a command ``shmcoll run``
cannot find.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import ctypes
import faulthandler
import inspect
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Sequence
from typing import IO, Any

import numpy as np

from shmcoll import config
from shmcoll.comm import Communicator
from shmcoll.engine import cpu as engine
from shmcoll.engine import mailbox
from shmcoll.errors import ShmcollError, SpawnError
from shmcoll.shm import cma, layout
from shmcoll.shm.arena import Arena, ArenaHandle
from shmcoll.shm.janitor import Janitor
from shmcoll.shm.segment import new_token, unlink_job

log = logging.getLogger("shmcoll")

# Engine dtypes compiled before ranks start: the ones shmcoll's own calls need (barrier, object
# collectives, alloc, split). The others compile when a call first needs them (about 5 s each on
# a cold cache, once per machine): a rank that compiles says so in its rank record, and its
# peers' waits for it do not count against their timeouts meanwhile (jit.on_compile).
WARM_DTYPES = tuple(np.dtype(t) for t in (np.uint8, np.int64))

_GRACE_S = 5.0  # how long survivors of a failure get to report before they are killed
# How long `shmcoll run` waits for the rank its peers found lost to exit, once they have: a rank
# that closed its communicator (or raised) can take a while to leave its interpreter.
_CULPRIT_WAIT_S = 3.0


def warm_kernels(dtypes: Sequence[np.dtype] = WARM_DTYPES) -> None:
    """Compile (or load from the cache) the engine for ``dtypes`` in this process, and point to
    point's functions (a rank compiling them at its first message, on a cold cache, held its
    peers up for seconds)."""
    engine.warm(dtypes)
    cma.warm()
    mailbox.warm()


def _set_parent_death_signal() -> None:
    """Die with the launcher (Linux ``PR_SET_PDEATHSIG``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank_process_setup(parent_pid: int | None) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _set_parent_death_signal()
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the launcher died before we could ask to die with it


class Group:
    """A job of ``world_size`` ranks: owns the token and the arena; ranks call :meth:`connect`.

    Create it in the parent, pass it to child processes (it pickles as a small handle), call
    ``group.connect(rank)`` in each child, and ``group.close()`` (or use ``with``) in the parent
    when the children are done::

        with shmcoll.Group(world_size=4) as group:
            procs = [mp.Process(target=work, args=(group, r)) for r in range(4)]
            ...

    Args:
        world_size: number of ranks.
        slot_bytes: payload bytes per ring slot (default ``SHMCOLL_SLOT_BYTES``, 64 KiB).
        nslots: slots per ring (default ``SHMCOLL_NSLOTS``, 4).
        timeout: default seconds a collective waits for its peers (``SHMCOLL_TIMEOUT``; ``inf``:
            no limit).
    """

    def __init__(
        self, world_size: int, *, slot_bytes: int | None = None, nslots: int | None = None, timeout: float | None = None
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if timeout is not None:
            timeout = config.timeout_s(timeout)
        cfg = config.get()
        self.token = new_token()
        self.timeout = timeout
        # Measured here, before any rank runs, rather than by a rank among busy peers (once per
        # process: about 2 ms where the kernel wins at once, 12-35 ms through the whole ladder on a
        # 2-core VM); auto's choices of cma follow it (shm.cma.crossover_bytes). Before the janitor
        # starts: a Python interpreter starting beside the race can take a core from its rings,
        # and a race the kernel "wins" so sends every call of the launch from 32 KiB to cma,
        # 1.5-3x slower than the rings on a machine where they win (RESULTS.md, stop 35).
        crossover = cma.crossover_bytes() if world_size > 1 and cma.probe()[0] else None
        self._janitor: Janitor | None = Janitor(self.token)
        try:
            self._arena: Arena | None = Arena.create(
                world_size, nslots or cfg.nslots, slot_bytes or cfg.slot_bytes, self.token
            )
        except BaseException:
            self._janitor.close()
            raise
        self.handle: ArenaHandle = self._arena.handle
        self._owner_pid = os.getpid()
        if crossover is not None:
            self._arena.publish_cma_crossover(crossover)

    @classmethod
    def from_handle(cls, handle: ArenaHandle | str, timeout: float | None = None) -> Group:
        """A client view of an existing group (what children receive)."""
        group = cls.__new__(cls)
        group.handle = ArenaHandle.decode(handle) if isinstance(handle, str) else handle
        group.token = group.handle.token
        group.timeout = timeout
        group._janitor = None
        group._arena = None
        group._owner_pid = -1
        return group

    def __reduce__(self) -> tuple[Any, ...]:
        return (Group.from_handle, (self.handle, self.timeout))

    @property
    def world_size(self) -> int:
        return self.handle.world_size

    def connect(self, rank: int, timeout: float | None = None) -> Communicator:
        """Attach this process as ``rank`` and return its communicator."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        if timeout is not None:
            timeout = config.timeout_s(timeout)
        arena = Arena.attach(self.handle)
        try:
            return Communicator(arena, rank, timeout=timeout if timeout is not None else self.timeout)
        except BaseException:
            arena.close()
            raise

    def abort(self, failed_rank: int = -1, code: int = layout.ABORT_ERROR) -> None:
        """Abort the job's communicator from the owner (the launcher after a rank failed)."""
        if self._arena is None:
            return
        self._arena.abort(-1, code, failed_rank)

    def culprit(self) -> int | None:
        """The rank the communicator's abort word blames, if any: the one a rank found lost, or
        the one that failed by itself (owner only)."""
        if self._arena is None:
            return None
        info = self._arena.abort_info()
        if info["code"] == layout.ABORT_PEER_LOST:
            return info["peer"]
        if info["code"] == layout.ABORT_ERROR and info["origin"] >= 0:
            return info["origin"]
        return None

    def close(self) -> None:
        """Remove everything the job put in ``/dev/shm`` (owner); idempotent."""
        if self._arena is not None and os.getpid() == self._owner_pid:
            self._arena.segment.unlink()
            self._arena.close()
            self._arena = None
            unlink_job(self.token)
        if self._janitor is not None and os.getpid() == self._owner_pid:
            self._janitor.close()
            self._janitor = None

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass


# --- spawn ----------------------------------------------------------------------------------
def _rank_main(
    group: Group,
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    conn: mp.connection.Connection,
    parent_pid: int,
) -> None:
    _rank_process_setup(parent_pid)
    comm: Communicator | None = None
    failed = False
    try:
        comm = group.connect(rank)
        result = fn(comm, *args, **kwargs)
        try:
            conn.send(("ok", rank, result, None))
        except Exception as exc:  # noqa: BLE001
            failed = True
            conn.send(("error", rank, None, f"rank {rank}'s return value cannot be sent back: {exc!r}"))
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which re-raises)
        failed = True
        text = traceback.format_exc()
        if comm is not None and not isinstance(exc, ShmcollError):
            comm.abort(cause=exc)
        try:
            payload: bytes | None = pickle.dumps(exc)
        except Exception:  # noqa: BLE001
            payload = None
        try:
            conn.send(("error", rank, payload, text))
        except Exception:  # noqa: BLE001
            pass
    finally:
        if comm is not None:
            comm.close()
        conn.close()
    if failed:
        sys.stdout.flush()
        os._exit(1)


class _Failure:
    def __init__(
        self,
        rank: int,
        reason: str,
        exitcode: int | None = None,
        tb: str | None = None,
        exc: BaseException | None = None,
        secondary: bool = False,
    ) -> None:
        self.rank = rank
        self.reason = reason
        self.exitcode = exitcode
        self.tb = tb
        self.exc = exc
        self.secondary = secondary  # a consequence (peer lost, aborted), not a root cause


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
    comm_timeout: float | None = None,
    start_method: str = "spawn",
    slot_bytes: int | None = None,
    nslots: int | None = None,
) -> list[Any]:
    """Run ``fn(comm, *args, **kwargs)`` on ``nprocs`` new processes; return their results by rank.

    The new processes are fresh interpreters (``start_method="spawn"``): they import ``fn`` and
    the arguments' types by name, and re-run the main script (as ``__mp_main__``, skipping its
    ``if __name__ == "__main__":`` block) to find what it defines. So ``fn`` must be defined at
    the top level of a module or of the script, and a script calls ``spawn`` under that guard::

        def work(comm):
            return comm.allreduce(np.ones(4))

        if __name__ == "__main__":
            print(shmcoll.spawn(work, 4))

    Args:
        fn: called as ``fn(comm, *args, **kwargs)`` on every rank; its return value (picklable)
            is that rank's result.
        nprocs: the number of ranks (processes) to start.
        args: more positional arguments for ``fn`` (picklable).
        kwargs: keyword arguments for ``fn`` (picklable).
        timeout: seconds the whole run may take; at expiry every rank's Python stacks are
            dumped to stderr and the ranks are killed. ``None``: no limit.
        comm_timeout: each collective's timeout (default ``SHMCOLL_TIMEOUT``, 60 s).
        start_method: the :mod:`multiprocessing` start method. ``"fork"`` copies this process
            instead of importing anything (it works from a REPL, but is unsafe in a process
            that runs threads, such as one that initialised CUDA).
        slot_bytes: payload bytes per ring slot (default ``SHMCOLL_SLOT_BYTES``).
        nslots: slots per ring (default ``SHMCOLL_NSLOTS``).

    Returns:
        The ranks' return values, indexed by rank.

    Raises:
        SpawnError: a rank failed (raised, was killed, exited) or the run timed out; the others
            were stopped. The message names the first failing rank, with its traceback or the
            signal that killed it.
        ValueError: ``fn`` (or a type an argument uses) is defined where the new processes
            cannot import it: in a REPL, ``python -c``, a notebook, or under ``if __name__ ==
            "__main__":``. Nothing was started.
        RuntimeError: ``spawn`` was called from the main script outside ``if __name__ ==
            "__main__":``, so every new process would call it again. Nothing was started.
        TypeError: ``fn`` or an argument cannot be pickled (a lambda, a nested function, a
            lock). Nothing was started.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if timeout is not None:
        timeout = config.timeout_s(timeout, "spawn timeout")
    if comm_timeout is not None:
        comm_timeout = config.timeout_s(comm_timeout, "comm_timeout")
    _check_importable(fn, tuple(args), dict(kwargs or {}), start_method)
    warm_kernels()
    ctx = mp.get_context(start_method)
    with Group(nprocs, slot_bytes=slot_bytes, nslots=nslots, timeout=comm_timeout) as group:
        procs: list[Any] = []
        readers: list[Any] = []
        for rank in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(  # type: ignore[attr-defined]
                target=_rank_main,
                args=(group, rank, fn, tuple(args), dict(kwargs or {}), writer, os.getpid()),
                name=f"shmcoll-rank-{rank}",
            )
            try:
                p.start()  # (pickles fn and the arguments before it creates the process)
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                for started in procs:
                    started.kill()
                    started.join()
                for r in (*readers, reader):
                    r.close()
                raise TypeError(
                    f"shmcoll.spawn: cannot send fn and its arguments to the new processes: {exc}. "
                    "They are pickled: fn must be a function defined at the top level of a module "
                    "or script (not a lambda or a nested function), and args/kwargs picklable."
                ) from exc
            finally:
                writer.close()
            procs.append(p)
            readers.append(reader)
        return _join(group, procs, readers, timeout)


# --- what spawn's new processes can import ------------------------------------------------------
# A "spawn" or "forkserver" child is a fresh interpreter: it unpickles fn and the arguments by
# importing what they name, and finds what the parent's main script defines by running that
# script again as __mp_main__, without its `if __name__ == "__main__":` block (and not at all for
# a REPL, `python -c`, a notebook, or `python -m pkg` with its __main__.py). What it cannot find
# used to surface as "rank 0 exited with code 1" and a bare AttributeError from each child; it is
# cheaper to see it here, before anything starts, and say what to do.
_IMPORTING_START_METHODS = ("spawn", "forkserver")

_GUARD_HINT = 'Put the code that starts the job under `if __name__ == "__main__":`'


class _Discard:
    def write(self, data: Any) -> None:
        pass


class _MainReferences(pickle.Pickler):
    """Pickles into nothing, noting every function and class of ``__main__`` it meets (the
    things a child finds by looking them up in its own ``__main__``)."""

    def __init__(self) -> None:
        # Out-of-band buffers (numpy arrays) are not copied: only references matter here.
        super().__init__(_Discard(), protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=lambda _: None)
        self.found: list[Any] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            if not any(obj is seen for seen in self.found):
                self.found.append(obj)
        return NotImplemented


def _main_script() -> tuple[bool, str | None]:
    """Whether a new process runs the main module again, and its source file if it does
    (multiprocessing.spawn's own rule: by module name, else by path, else not at all)."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        if name == "__main__" or name.endswith(".__main__"):
            return False, None  # a package's __main__.py or a directory: never re-run
        return True, getattr(main.__spec__, "origin", None)  # type: ignore[union-attr]
    path = getattr(main, "__file__", None)
    if path is None or os.path.splitext(os.path.basename(path))[0] == "ipython":
        return False, None
    return True, os.path.abspath(path)


def _guard_blocks(path: str | None) -> list[tuple[int, int]] | None:
    """The line ranges of the top-level ``if __name__ == "__main__":`` blocks of ``path``
    (``None``: the source cannot be read or parsed)."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    blocks = []
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1:
            sides = [node.test.left, *node.test.comparators]
            names = {s.id for s in sides if isinstance(s, ast.Name)}
            values = {s.value for s in sides if isinstance(s, ast.Constant)}
            if isinstance(node.test.ops[0], ast.Eq) and names == {"__name__"} and values == {"__main__"}:
                blocks.append((node.lineno, node.end_lineno or node.lineno))
    return blocks


def _defined_at(obj: Any, path: str) -> int | None:
    """The line of ``path`` where function or class ``obj`` is defined, if known."""
    code = getattr(obj, "__code__", None)
    if code is not None:
        same = os.path.abspath(code.co_filename) == path
        return code.co_firstlineno if same else None
    try:
        if os.path.abspath(inspect.getsourcefile(obj) or "") != path:
            return None
        return inspect.getsourcelines(obj)[1]
    except (OSError, TypeError):
        return None


def _describe(obj: Any, fn: Any) -> str:
    name = getattr(obj, "__qualname__", repr(obj))
    if obj is fn:
        return f"the function `{name}`"
    kind = "class" if isinstance(obj, type) else "function"
    return f"the {kind} `{name}` (which fn or its arguments use)"


def _check_importable(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], start_method: str) -> None:
    """Raise, before anything starts, what a new process would fail on while it imports the job."""
    if getattr(mp.current_process(), "_inheriting", False):
        # This process is itself a child re-running the parent's script, which called spawn at
        # import time: the parent's check below normally stops that first.
        raise RuntimeError(
            "shmcoll.spawn() was called while a new process was importing the main script, "
            f"which starts the job again at import time. {_GUARD_HINT}."
        )
    if start_method not in _IMPORTING_START_METHODS:
        return
    rerun, path = _main_script()
    if rerun and path is not None and not os.path.exists(path):
        # `python - < job.py`: __main__ says it came from "<stdin>", which every new process
        # would try to run as a file, and fail before it ever reached fn.
        raise ValueError(
            f"shmcoll.spawn: the main program was read from {os.path.basename(path)}, not from a file, "
            "and the new processes would have to run it again to find your functions. Save it "
            'in a file and run that (with the spawn call under `if __name__ == "__main__":`), '
            'or pass start_method="fork".'
        )
    blocks = _guard_blocks(path) if rerun else None
    if rerun and blocks is not None and path is not None:
        # The main script's top-level line that led here: a child re-running the script runs it
        # again, unless it is inside the guard.
        main_globals = vars(sys.modules["__main__"])
        line = None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals is main_globals and frame.f_code.co_name == "<module>":
                line = frame.f_lineno
            frame = frame.f_back  # type: ignore[assignment]
        if line is not None and not any(a <= line <= b for a, b in blocks):
            raise RuntimeError(
                f"shmcoll.spawn: called from {os.path.basename(path)} line {line}, which is not under "
                '`if __name__ == "__main__":`. Each new process imports the script to find your '
                "functions, and would run that line again and start processes of its own. "
                f"{_GUARD_HINT}, e.g.\n\n"
                '    if __name__ == "__main__":\n'
                "        shmcoll.spawn(work, 4)\n"
            )
    refs = _MainReferences()
    with contextlib.suppress(Exception):  # unpicklable: Process.start says so, and we explain it
        refs.dump((fn, args, kwargs))
    for obj in refs.found:
        what = _describe(obj, fn)
        if not rerun:
            raise ValueError(
                f"shmcoll.spawn: {what} is defined in the __main__ module of an interactive session "
                "(a REPL, `python -c`, a notebook, stdin or a package's __main__.py), which the new "
                "processes cannot import, so they could not find it. Define it in a module or a "
                "file and import it from there (e.g. save it in work.py, then `from work import "
                f"{getattr(obj, '__qualname__', 'f')}`), or run the job as a script that defines it "
                f'at top level and calls spawn under `if __name__ == "__main__":`; or pass '
                'start_method="fork" (the children then copy this process instead of importing '
                "anything; not safe if this process runs threads)."
            )
        line = _defined_at(obj, path) if path is not None and blocks else None
        if line is not None and blocks and any(a <= line <= b for a, b in blocks):
            raise ValueError(
                f'shmcoll.spawn: {what} is defined under `if __name__ == "__main__":` in '
                f"{os.path.basename(path or '')} (line {line}), which the new processes skip when "
                "they import the script, so they could not find it. Define it at the top level of "
                "the script (or in a module), outside that block."
            )


def _join(group: Group, procs: list[Any], readers: list[Any], timeout: float | None) -> list[Any]:
    n = len(procs)
    results: dict[int, Any] = {}
    failures: list[_Failure] = []
    open_readers = {r: readers[r] for r in range(n)}
    deadline = None if timeout is None else time.monotonic() + timeout
    grace_end: float | None = None
    try:
        while True:
            alive = [p for p in procs if p.exitcode is None]
            if not alive and not open_readers:
                break
            now = time.monotonic()
            if grace_end is not None and now > grace_end:
                _dump_and_kill(alive, [procs.index(p) for p in alive], sys.stderr)
                break
            if deadline is not None and now > deadline:
                failures.append(
                    _Failure(
                        -1,
                        f"timed out after {timeout}s; ranks still running: "
                        f"{[procs.index(p) for p in alive]} (stacks dumped to stderr)",
                    )
                )
                _dump_and_kill(alive, [procs.index(p) for p in alive], sys.stderr)
                break
            waitables = [p.sentinel for p in alive] + list(open_readers.values())
            mp.connection.wait(waitables, timeout=0.05)
            for rank, reader in list(open_readers.items()):
                try:
                    if not reader.poll():
                        continue
                    msg = reader.recv()
                except (EOFError, OSError):
                    del open_readers[rank]
                    continue
                del open_readers[rank]
                kind, _, payload, text = msg
                if kind == "ok":
                    results[rank] = payload
                else:
                    exc = None
                    if isinstance(payload, bytes):
                        try:
                            exc = pickle.loads(payload)
                        except Exception:  # noqa: BLE001
                            exc = None
                    secondary = isinstance(exc, ShmcollError)
                    failures.append(
                        _Failure(
                            rank,
                            f"raised {type(exc).__name__ if exc else 'an error'}",
                            tb=text,
                            exc=exc,
                            secondary=secondary,
                        )
                    )
            for rank, p in enumerate(procs):
                if p.exitcode is not None and p.exitcode != 0 and rank not in results and rank not in open_readers:
                    if not any(f.rank == rank for f in failures):
                        failures.append(_Failure(rank, _describe_exit(p.exitcode), exitcode=p.exitcode))
            if failures and grace_end is None:
                first = next((f for f in failures if not f.secondary), failures[0])
                group.abort(first.rank, layout.ABORT_PEER_LOST if first.exitcode else layout.ABORT_ERROR)
                grace_end = time.monotonic() + _GRACE_S
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join(timeout=5)
        for r in readers:
            r.close()
    stopped = bool(failures)  # ranks still running then were killed by us: consequences, not causes
    for rank, p in enumerate(procs):
        if rank not in results and not any(f.rank == rank for f in failures) and p.exitcode not in (None, 0):
            reason = "stopped by the launcher" if stopped else _describe_exit(p.exitcode)
            failures.append(_Failure(rank, reason, exitcode=p.exitcode, secondary=stopped))
    if failures:
        raise _spawn_error(failures)
    missing = [r for r in range(n) if r not in results]
    if missing:
        raise SpawnError(f"ranks {missing} ended without reporting a result")
    return [results[r] for r in range(n)]


def _spawn_error(failures: list[_Failure]) -> SpawnError:
    primary = next((f for f in failures if not f.secondary), failures[0])
    lines = [f"rank {primary.rank} failed: {primary.reason}" if primary.rank >= 0 else primary.reason]
    if primary.exc is not None:
        lines[0] += f": {primary.exc}"
    others = [f for f in failures if f is not primary]
    for f in others:
        detail = f": {f.exc}" if f.exc is not None else ""
        lines.append(f"  then rank {f.rank}: {f.reason}{detail}")
    if primary.tb:
        lines.append(f"--- traceback of rank {primary.rank} ---\n{primary.tb.rstrip()}")
    err = SpawnError(
        "\n".join(lines),
        rank=primary.rank if primary.rank >= 0 else None,
        exitcode=primary.exitcode,
        remote_traceback=primary.tb,
    )
    if primary.exc is not None:
        err.__cause__ = primary.exc
    return err


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (the SigCgt mask of /proc/pid/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool((int(line.split()[1], 16) >> (sig - 1)) & 1)
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        pass
    return False


def _dump_and_kill(procs: Sequence[Any], ranks: Sequence[int], out: IO[str] | None = None) -> None:
    """Have every live rank dump its stacks (faulthandler on SIGUSR1), then kill them all.

    Only ranks that already handle SIGUSR1 get it: one still starting up would simply die of it.
    One rank at a time: the ranks share the launcher's stderr, and dumps written at once
    interleave line by line into something nobody can read. ``out``: where to say whose stacks
    follow (faulthandler's text does not name the rank); ``None`` when every line a rank writes
    is tagged with its rank anyway.
    """
    live = zip(ranks, procs, strict=True)
    dumping = [(r, p) for r, p in live if _poll_exit(p) is None and _catches(p.pid, signal.SIGUSR1)]
    # faulthandler writes synchronously from the signal handler, but the rank must get scheduled;
    # the whole dump stays within about 2 s however many ranks there are.
    pause = min(0.5, 2.0 / len(dumping)) if dumping else 0.0
    for rank, p in dumping:
        if out is not None:
            _say(out, f"--- Python stacks of rank {rank} (pid {p.pid}) ---")
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGUSR1)
        time.sleep(pause)
    for p in procs:
        if _poll_exit(p) is None:
            p.kill()


def _poll_exit(p: Any) -> int | None:
    return p.poll() if hasattr(p, "poll") else p.exitcode


# --- init and shmcoll run -------------------------------------------------------------------
# Other launchers' variables, read only to say what to do when one of them started this process:
# (launcher, its rank variable, its world size variable). They are not shmcoll's configuration.
_FOREIGN_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE"),
    ("mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("mpirun (MPICH, Intel MPI)", "PMI_RANK", "PMI_SIZE"),
)


def _foreign_launcher() -> tuple[str, str, str, int] | None:
    """(launcher, its variables, this rank, world size) if another launcher started this process
    as one of several ranks."""
    for launcher, rank_var, size_var in _FOREIGN_LAUNCHERS:
        try:
            size = int(os.environ.get(size_var, ""))
        except ValueError:
            continue
        if size > 1:
            return launcher, f"{rank_var}, {size_var}", os.environ.get(rank_var, "?"), size
    return None


def init(timeout: float | None = None) -> Communicator:
    """This process's communicator: its rank's in a job started by ``shmcoll run``, else a
    world of one.

    Under ``shmcoll run -n N script.py`` (``SHMCOLL_RANK``, ``SHMCOLL_WORLD_SIZE`` and
    ``SHMCOLL_HANDLE`` set), it connects this process as its rank of the job. Started any other
    way (``python script.py``), it returns the communicator of a job of one rank that this
    process owns, as ``MPI.COMM_WORLD`` is under a plain ``python``: every collective works, on
    this rank's data alone, so a script runs unchanged on one process. Everything it created
    in ``/dev/shm`` is removed when the process exits, however it exits.

    Example::

        comm = shmcoll.init()
        x = np.full(4, comm.rank, np.float32)
        comm.allreduce(x)  # under `shmcoll run -n 3`: 0 + 1 + 2 = 3 everywhere

    Args:
        timeout: each collective's default timeout in seconds (default: ``SHMCOLL_TIMEOUT``,
            which ``shmcoll run --comm-timeout`` sets; ``inf``: no limit).

    Returns:
        The :class:`Communicator`. It is closed at exit; ``comm.close()`` closes it earlier.

    Raises:
        ShmcollError: another launcher started this process as one of several ranks
            (``torchrun``: ``RANK``, ``WORLD_SIZE`` set; ``mpirun``), whose processes shmcoll
            cannot join (the message says what to use instead), or the ``SHMCOLL_*`` variables
            are incomplete or disagree.
    """
    cfg = config.get()
    if cfg.rank is None and cfg.world_size is None and not cfg.handle:
        foreign = _foreign_launcher()
        if foreign is not None and foreign[0].startswith("mpirun") and _mpi4py_speaks_for(foreign[0]):
            return init_mpi(timeout=timeout)  # type: ignore[no-any-return]
        if foreign is not None:
            launcher, variables, rank, size = foreign
            advice = (
                f"start the script with `shmcoll run -n {size} script.py` instead (it sets RANK, "
                "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT too, so torch code keeps "
                "working), or stay with torchrun and use shmcoll as torch.distributed's backend: "
                '`import shmcoll.torch` and `torch.distributed.init_process_group("shmcoll")`'
                if launcher == "torchrun"
                else f"start the script with `shmcoll run -n {size} script.py` instead of mpirun"
            )
            raise ShmcollError(
                f"shmcoll.init(): this process is rank {rank} of {size} started by {launcher} "
                f"({variables} are set), not by `shmcoll run` (SHMCOLL_HANDLE is not set), and "
                f"shmcoll cannot join another launcher's processes: {advice}"
            )
        return _world_of_one(timeout)
    if cfg.rank is None or cfg.world_size is None or not cfg.handle:
        raise ShmcollError(
            "shmcoll.init() needs all of SHMCOLL_RANK, SHMCOLL_WORLD_SIZE and SHMCOLL_HANDLE, which "
            "`shmcoll run -n N script.py` sets; only some are set here"
        )
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    group = Group.from_handle(cfg.handle)
    if group.world_size != cfg.world_size:
        raise ShmcollError(f"SHMCOLL_WORLD_SIZE={cfg.world_size} disagrees with the handle's {group.world_size}")
    comm = group.connect(cfg.rank, timeout=timeout)
    atexit.register(comm.close)
    return comm


def _mpi_library() -> str:
    """The first line of ``MPI.Get_library_version()`` of the MPI mpi4py would load ("" without
    mpi4py or a usable MPI), asked in a child process that never initializes MPI: initializing it
    here just to look would start a singleton MPI job, which (Open MPI's, at least) leaves its
    shared-memory segment in /dev/shm even after ``MPI_Finalize``."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return ""
    code = (
        "import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False\n"
        "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _mpi4py_speaks_for(launcher: str) -> bool:
    """Whether mpi4py's MPI is the family of the launcher that started this process (Open MPI's
    ``mpirun`` sets ``OMPI_*``; MPICH's and Intel MPI's set ``PMI_*``): then ``init_mpi`` joins its
    job; otherwise MPI would start a job of one, and ``init`` says what to do instead."""
    library = _mpi_library()
    if "(Open MPI)" in launcher:
        return library.startswith("Open MPI")
    return library.startswith(("MPICH", "Intel"))


def init_mpi(comm: Any = None, node_id: int | None = None, timeout: float | None = None) -> Any:
    """This process's communicator in an MPI job: shmcoll inside each node, MPI between nodes.

    Needs mpi4py (``pip install "shmcoll[mpi]"``) and a job started by an MPI launcher
    (``mpirun -n 64 --map-by node python train.py``). Collective over ``comm``: its ranks are
    grouped by node (``MPI.Comm.Split_type(COMM_TYPE_SHARED)``; ``SHMCOLL_NODE_ID``,
    ``SHMCOLL_NODE_SIZES`` or ``node_id`` split a machine into emulated nodes), each node's ranks
    join one shmcoll job, and the nodes talk over MPI. :func:`init` does this by itself when it
    finds itself started by ``mpirun`` with mpi4py installed.

    Example::

        comm = shmcoll.init_mpi()
        comm.allreduce(grads)  # node reduce-scatter, rails across nodes, node allgather

    Args:
        comm: the MPI communicator whose ranks take part (default ``MPI.COMM_WORLD``).
        node_id: this rank's node (ranks with the same id on one machine form a node).
        timeout: each collective's default timeout in seconds (default ``SHMCOLL_TIMEOUT``).

    Returns:
        With every rank on one node, a plain :class:`Communicator` (exactly today's shmcoll,
        ranked as ``comm``); else a :class:`shmcoll.comm.multinode.MultiNodeCommunicator` with
        ``comm``'s ranks and the same methods. Closed at exit.
    """
    from shmcoll import mpi

    return mpi.init_mpi(comm, node_id, timeout, group_cls=Group)


def _world_of_one(timeout: float | None) -> Communicator:
    """A job of one rank owned by this process (its janitor covers a process that is killed)."""
    group = Group(1)
    try:
        comm = group.connect(0, timeout=timeout)
    except BaseException:
        group.close()
        raise

    def finish() -> None:
        comm.close()
        group.close()

    atexit.register(finish)
    log.info("shmcoll.init(): not started by `shmcoll run`; running as a world of one")
    return comm


class _Child:
    """A rank started as a subprocess by ``shmcoll run``."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.sentinel = os.pidfd_open(popen.pid) if hasattr(os, "pidfd_open") else None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def poll(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    def close(self) -> None:
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


# The launcher's own lines and the ranks' tagged lines go to the same streams from several
# threads: each is written whole under this lock, so no two ever share a line.
_OUTPUT_LOCK = threading.Lock()
_MAX_LINE = 1 << 16  # a rank's line longer than this (no newline yet) is passed on in pieces


def _write(dest: IO[str], data: bytes) -> None:
    """Write ``data`` to a text stream, through its byte buffer when it has one (a rank's bytes
    pass as they are, whatever their encoding). Caller holds ``_OUTPUT_LOCK``."""
    buffer = getattr(dest, "buffer", None)
    if buffer is not None:
        dest.flush()  # whatever the text layer holds goes first
        buffer.write(data)
        buffer.flush()
    else:
        dest.write(data.decode(errors="replace"))
        dest.flush()


def _say(out: IO[str], text: str) -> None:
    """One line of the launcher's own, never mixed into a rank's line."""
    with _OUTPUT_LOCK:
        try:
            _write(out, (text + "\n").encode())
        except (OSError, ValueError):
            pass  # the launcher's output is gone (a closed pipe): nothing else to do with it


def _copy_tagged(rank: int, src: IO[bytes], dest: IO[str]) -> None:
    """Copy one rank's stream to ``dest`` a line at a time, each line prefixed ``[rank N] ``."""
    prefix = f"[rank {rank}] ".encode()
    broken = False
    try:
        while True:
            line = src.readline(_MAX_LINE)
            if not line:
                return
            if broken:
                continue  # keep draining, so the rank never blocks on a full pipe
            if not line.endswith(b"\n"):
                line += b"\n"  # the stream's last, unterminated line (or a piece of a huge one)
            with _OUTPUT_LOCK:
                try:
                    _write(dest, prefix + line)
                except (OSError, ValueError):
                    broken = True  # e.g. `shmcoll run ... | head` has exited
    finally:
        src.close()


def _command(argv: Sequence[str]) -> tuple[str, list[str]]:
    """The program each rank runs and its argv: ``python ARGV`` for a Python script or
    interpreter options (``script.py``, ``-m module``, ``-c code``), else the program itself.

    Raises:
        FileNotFoundError: the script or program does not exist (before any rank starts).
    """
    if not argv:
        raise ValueError("nothing to run: give a script, -m MODULE, or a program")
    first = argv[0]
    if first.startswith("-"):
        return sys.executable, [sys.executable, *argv]
    if first.endswith((".py", ".pyw", ".pyz")):
        if not os.path.exists(first):
            raise FileNotFoundError(f"no such script: {first}")
        return sys.executable, [sys.executable, *argv]
    program = shutil.which(first)
    if program is not None:
        return program, list(argv)  # (argv[0] stays as the user wrote it)
    if os.path.exists(first):  # a script without .py, a directory or zip with a __main__.py
        return sys.executable, [sys.executable, *argv]
    raise FileNotFoundError(f"cannot run {first!r}: not a file, and no such program on PATH")


def _free_port() -> int:
    """A TCP port free on the loopback now, for ``MASTER_PORT`` (torch's rank 0 binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_script(
    nprocs: int,
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    comm_timeout: float | None = None,
    slot_bytes: int | None = None,
    nslots: int | None = None,
    tag_output: bool = True,
    out: IO[str] | None = None,
) -> int:
    """Run ``argv`` as ``nprocs`` ranks (``shmcoll run``); returns the exit code to exit with.

    ``argv`` is a Python script and its arguments (``["job.py", "--lr", "0.1"]``), interpreter
    options (``["-m", "pkg.mod"]``), or any program (``["python", "-m", "pkg.mod"]``,
    ``["/bin/echo", "hi"]``). Each rank gets ``SHMCOLL_RANK``, ``SHMCOLL_WORLD_SIZE`` and
    ``SHMCOLL_HANDLE`` (for :func:`init`), the variables ``torchrun`` sets (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``,
    ``MASTER_PORT``: a free port) and, with more than one rank, ``OMP_NUM_THREADS=1`` unless it
    is set (said once on ``out``): each rank's OpenMP/BLAS pool would otherwise take every core.

    Args:
        nprocs: the number of ranks.
        argv: what to run, as above.
        timeout: seconds the whole job may take; then every rank's Python stacks are dumped and
            the ranks killed (exit code 124).
        comm_timeout: each collective's timeout (``SHMCOLL_TIMEOUT`` in the ranks).
        slot_bytes: payload bytes per ring slot.
        nslots: slots per ring.
        tag_output: prefix each line of each rank's stdout and stderr with ``[rank N] ``
            (copied a whole line at a time, so ranks' lines never merge; Python ranks get
            ``PYTHONUNBUFFERED=1`` unless it is set, so their lines come as they are printed).
            ``False``: the ranks write to the launcher's streams directly.
        out: where the launcher's own messages go (default: stderr); ranks' tagged stderr too.

    Returns:
        0 if every rank exits 0; else the first failing rank's code (128 + signal if it was
        killed), with a line on ``out`` naming it; 124 at ``timeout``; 130 after Ctrl-C, which
        stops every rank.

    Raises:
        FileNotFoundError: the script or program does not exist; nothing was started.
    """
    err: IO[str] = out or sys.stderr
    if timeout is not None:
        timeout = config.timeout_s(timeout, "--timeout")
    if comm_timeout is not None:
        comm_timeout = config.timeout_s(comm_timeout, "--comm-timeout")
    program, args = _command(argv)
    warm_kernels()
    with Group(nprocs, slot_bytes=slot_bytes, nslots=nslots, timeout=comm_timeout) as group:
        children: list[_Child] = []
        copiers: list[threading.Thread] = []
        base_env = dict(os.environ)
        base_env.update(
            SHMCOLL_WORLD_SIZE=str(nprocs),
            SHMCOLL_HANDLE=group.handle.encode(),
            WORLD_SIZE=str(nprocs),
            LOCAL_WORLD_SIZE=str(nprocs),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
        if comm_timeout is not None:
            base_env["SHMCOLL_TIMEOUT"] = str(comm_timeout)
        if nprocs > 1 and "OMP_NUM_THREADS" not in os.environ:
            base_env["OMP_NUM_THREADS"] = "1"
            _say(
                err,
                f"shmcoll run: setting OMP_NUM_THREADS=1 for each rank, so that {nprocs} ranks' "
                "OpenMP/BLAS threads do not oversubscribe the cores (set OMP_NUM_THREADS to choose another value)",
            )
        if tag_output:
            base_env.setdefault("PYTHONUNBUFFERED", "1")
        parent = os.getpid()
        pipe = subprocess.PIPE if tag_output else None
        try:
            for rank in range(nprocs):
                env = dict(base_env, SHMCOLL_RANK=str(rank), RANK=str(rank), LOCAL_RANK=str(rank))
                popen = subprocess.Popen(
                    args,
                    executable=program,
                    env=env,
                    stdout=pipe,
                    stderr=pipe,
                    preexec_fn=lambda: _set_parent_death_signal() if os.getppid() == parent else os._exit(1),
                )
                children.append(_Child(popen))
            if tag_output:
                # Started once every rank is: preexec_fn runs in a fork, where threads are unsafe.
                for rank, c in enumerate(children):
                    for src, dest in ((c.popen.stdout, sys.stdout), (c.popen.stderr, err)):
                        t = threading.Thread(target=_copy_tagged, args=(rank, src, dest), daemon=True)
                        t.start()
                        copiers.append(t)
            return _join_children(group, children, timeout, err, tagged=tag_output)
        except KeyboardInterrupt:
            for c in children:
                if c.poll() is None:
                    c.popen.send_signal(signal.SIGINT)
            end = time.monotonic() + 3
            while time.monotonic() < end and any(c.poll() is None for c in children):
                time.sleep(0.05)
            for c in children:
                c.kill()
                c.popen.wait()
            _say(err, "shmcoll run: interrupted; all ranks stopped")
            return 130
        finally:
            for c in children:
                c.kill()
                c.popen.wait()
                c.close()
            # What the ranks wrote last (a traceback, dumped stacks) is still in the pipes. A
            # process a rank started may hold a pipe open after the rank is gone: do not wait
            # for it long.
            end = time.monotonic() + 5
            for t in copiers:
                t.join(max(0.0, end - time.monotonic()))


def _join_children(group: Group, children: list[_Child], timeout: float | None, out: IO[str], tagged: bool) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    first: tuple[int, int] | None = None
    grace_end: float | None = None
    culprit_since: float | None = None  # since when the rank the others lost is awaited

    def dump_and_kill() -> None:
        alive = [(r, c) for r, c in enumerate(children) if c.poll() is None]
        _dump_and_kill([c for _, c in alive], [r for r, _ in alive], None if tagged else out)

    while True:
        codes = [c.poll() for c in children]
        now = time.monotonic()
        if first is None:
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            culprit = group.culprit() if failed else None
            if (
                culprit is not None
                and 0 <= culprit < len(codes)
                and codes[culprit] is None
                and (culprit_since is None or now - culprit_since < _CULPRIT_WAIT_S)
            ):
                # The rank the others found lost (it closed its communicator, or its peers saw it
                # go) may still be on its way out after they have left: its exit is the job's.
                # The arena's abort word has stopped the others already.
                if culprit_since is None:
                    culprit_since = now
            elif failed:
                # Several may have exited since the last look: the arena knows which one the
                # others lost, or which failed on its own; otherwise take the lowest rank.
                first = next(((r, c) for r, c in failed if r == culprit), failed[0])
                rank, code = first
                _say(out, f"shmcoll run: rank {rank} {_describe_exit(code)}; stopping the others")
                group.abort(rank, layout.ABORT_PEER_LOST if code < 0 else layout.ABORT_ERROR)
                grace_end = now + _GRACE_S
        if all(code is not None for code in codes):
            break
        if grace_end is not None and now > grace_end:
            dump_and_kill()
            break
        if deadline is not None and now > deadline:
            alive = [r for r, c in enumerate(children) if c.poll() is None]
            _say(out, f"shmcoll run: timed out after {timeout}s; ranks {alive} still running (stacks dumped)")
            dump_and_kill()
            return 124
        sentinels = [c.sentinel for c in children if c.sentinel is not None and c.poll() is None]
        if sentinels:
            mp.connection.wait(sentinels, timeout=0.05)
        else:
            time.sleep(0.02)
    if first is None:
        return 0
    code = first[1]
    return 128 - code if code < 0 else code
