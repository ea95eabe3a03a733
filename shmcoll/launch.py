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
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shmcoll import config
from shmcoll.comm import Communicator
from shmcoll.engine import cpu as engine
from shmcoll.errors import ShmcollError, SpawnError
from shmcoll.shm import layout
from shmcoll.shm.arena import Arena, ArenaHandle
from shmcoll.shm.janitor import Janitor
from shmcoll.shm.segment import new_token, unlink_job

log = logging.getLogger("shmcoll")

# Engine dtypes compiled before ranks start, so ranks load them from the cache instead of all
# compiling them at once (seconds per dtype, on every core at the same time).
WARM_DTYPES = tuple(np.dtype(t) for t in (np.uint8, np.int32, np.int64, np.float32, np.float64))

_GRACE_S = 5.0  # how long survivors of a failure get to report before they are killed


def warm_kernels(dtypes: Sequence[np.dtype] = WARM_DTYPES) -> None:
    """Compile (or load from the cache) the engine for ``dtypes`` in this process."""
    engine.warm(dtypes)


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

    If any rank fails (raises, is killed, exits), the others are aborted, and :class:`SpawnError`
    is raised naming the first failing rank with its traceback or exit signal. ``timeout`` bounds
    the whole run (stacks are dumped and ranks killed at expiry); ``comm_timeout`` is each
    collective's timeout.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if timeout is not None:
        timeout = config.timeout_s(timeout, "spawn timeout")
    if comm_timeout is not None:
        comm_timeout = config.timeout_s(comm_timeout, "comm_timeout")
    warm_kernels()
    ctx = mp.get_context(start_method)
    with Group(nprocs, slot_bytes=slot_bytes, nslots=nslots, timeout=comm_timeout) as group:
        procs = []
        readers = []
        for rank in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(  # type: ignore[attr-defined]
                target=_rank_main,
                args=(group, rank, fn, tuple(args), dict(kwargs or {}), writer, os.getpid()),
                name=f"shmcoll-rank-{rank}",
            )
            p.start()
            writer.close()
            procs.append(p)
            readers.append(reader)
        return _join(group, procs, readers, timeout)


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
                _dump_and_kill(alive)
                break
            if deadline is not None and now > deadline:
                failures.append(
                    _Failure(
                        -1,
                        f"timed out after {timeout}s; ranks still running: "
                        f"{[procs.index(p) for p in alive]} (stacks dumped to stderr)",
                    )
                )
                _dump_and_kill(alive)
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


def _dump_and_kill(procs: list[Any]) -> None:
    """Have every live rank dump its stacks (faulthandler on SIGUSR1), then kill them all.

    Only ranks that already handle SIGUSR1 get it: one still starting up would simply die of it.
    One rank at a time: the ranks share the launcher's stderr, and dumps written at once
    interleave line by line into something nobody can read.
    """
    dumping = [p for p in procs if _poll_exit(p) is None and _catches(p.pid, signal.SIGUSR1)]
    # faulthandler writes synchronously from the signal handler, but the rank must get scheduled;
    # the whole dump stays within about 2 s however many ranks there are.
    pause = min(0.5, 2.0 / len(dumping)) if dumping else 0.0
    for p in dumping:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGUSR1)
        time.sleep(pause)
    for p in procs:
        if _poll_exit(p) is None:
            p.kill()


def _poll_exit(p: Any) -> int | None:
    return p.poll() if hasattr(p, "poll") else p.exitcode


# --- init and shmcoll run -------------------------------------------------------------------
def init(timeout: float | None = None) -> Communicator:
    """The communicator of a rank started by ``shmcoll run`` (from ``SHMCOLL_*`` variables)."""
    cfg = config.get()
    if cfg.rank is None or cfg.world_size is None or not cfg.handle:
        raise ShmcollError(
            "shmcoll.init() needs SHMCOLL_RANK, SHMCOLL_WORLD_SIZE and SHMCOLL_HANDLE: start the "
            "script with `shmcoll run -n N script.py`, or use shmcoll.spawn / shmcoll.Group"
        )
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    group = Group.from_handle(cfg.handle)
    if group.world_size != cfg.world_size:
        raise ShmcollError(f"SHMCOLL_WORLD_SIZE={cfg.world_size} disagrees with the handle's {group.world_size}")
    comm = group.connect(cfg.rank, timeout=timeout)
    import atexit

    atexit.register(comm.close)
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


def run_script(
    nprocs: int,
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    comm_timeout: float | None = None,
    slot_bytes: int | None = None,
    nslots: int | None = None,
    out: Any = None,
) -> int:
    """Run ``python argv...`` as ``nprocs`` ranks; returns the exit code for ``shmcoll run``.

    0 if every rank exits 0; else the first failing rank's code (128 + signal if killed), and a
    line on ``out`` (stderr) naming it. Ctrl-C stops every rank and returns 130.
    """
    out = out or sys.stderr
    if timeout is not None:
        timeout = config.timeout_s(timeout, "--timeout")
    if comm_timeout is not None:
        comm_timeout = config.timeout_s(comm_timeout, "--comm-timeout")
    warm_kernels()
    with Group(nprocs, slot_bytes=slot_bytes, nslots=nslots, timeout=comm_timeout) as group:
        children: list[_Child] = []
        base_env = dict(os.environ)
        base_env["SHMCOLL_WORLD_SIZE"] = str(nprocs)
        base_env["SHMCOLL_HANDLE"] = group.handle.encode()
        if comm_timeout is not None:
            base_env["SHMCOLL_TIMEOUT"] = str(comm_timeout)
        parent = os.getpid()
        try:
            for rank in range(nprocs):
                env = dict(base_env, SHMCOLL_RANK=str(rank))
                popen = subprocess.Popen(
                    [sys.executable, *argv],
                    env=env,
                    preexec_fn=lambda: _set_parent_death_signal() if os.getppid() == parent else os._exit(1),
                )
                children.append(_Child(popen))
            return _join_children(group, children, timeout, out)
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
            print("shmcoll run: interrupted; all ranks stopped", file=out)
            return 130
        finally:
            for c in children:
                c.kill()
                c.popen.wait()
                c.close()


def _join_children(group: Group, children: list[_Child], timeout: float | None, out: Any) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    first: tuple[int, int] | None = None
    grace_end: float | None = None
    while True:
        codes = [c.poll() for c in children]
        now = time.monotonic()
        if first is None:
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                # Several may have exited since the last look: the arena knows which one the
                # others lost, or which failed on its own; otherwise take the lowest rank.
                culprit = group.culprit()
                first = next(((r, c) for r, c in failed if r == culprit), failed[0])
                rank, code = first
                print(f"shmcoll run: rank {rank} {_describe_exit(code)}; stopping the others", file=out)
                group.abort(rank, layout.ABORT_PEER_LOST if code < 0 else layout.ABORT_ERROR)
                grace_end = now + _GRACE_S
        if all(code is not None for code in codes):
            break
        if grace_end is not None and now > grace_end:
            _dump_and_kill([c for c in children if c.poll() is None])
            break
        if deadline is not None and now > deadline:
            alive = [r for r, c in enumerate(children) if c.poll() is None]
            print(f"shmcoll run: timed out after {timeout}s; ranks {alive} still running (stacks dumped)", file=out)
            _dump_and_kill([c for c in children if c.poll() is None])
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
