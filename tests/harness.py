"""Multi-process test harness: persistent rank pools with hard deadlines.

Starting a rank costs about a second here (spawn, imports, loading compiled kernels), so tests
reuse rank processes: a :class:`RankPool` keeps ``world_size`` ranks connected to one group and
runs module-level functions ``fn(comm, *args)`` on all of them. Every run has a deadline. The
first rank to fail (raise or die) fails the run at once with that rank's traceback; the other
ranks get a short grace period, then have their stacks dumped (faulthandler, SIGUSR1) and are
killed, and the pool is discarded. A test can therefore never hang CI.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import time
import traceback
from typing import Any

import shmcoll
from shmcoll import config
from shmcoll.launch import _rank_process_setup
from shmcoll.shm.segment import issued_tokens, list_segments, token_of

# Every job token created by the test process or any process it starts (shmcoll run, spawned
# scripts) lands in this file, so the leak check owns exactly the segments of its own jobs.
TOKEN_LOG = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"shmcoll-test-tokens-{os.getpid()}")
if "SHMCOLL_TOKEN_LOG" not in os.environ:
    os.environ["SHMCOLL_TOKEN_LOG"] = TOKEN_LOG
    config.reload()
# Each pytest-xdist worker keeps its own log (the controller's name plus the worker's): workers
# inherit the controller's environment, and a shared log would make one worker count another's
# live segments as its test's leak. Processes a worker starts inherit the worker's name.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER and not os.environ["SHMCOLL_TOKEN_LOG"].endswith(f"-{_WORKER}"):
    os.environ["SHMCOLL_TOKEN_LOG"] += f"-{_WORKER}"
    config.reload()
TOKEN_LOG = os.environ["SHMCOLL_TOKEN_LOG"]


def owned_tokens() -> set[str]:
    """Job tokens created by this test process or by the processes it started."""
    tokens = set(issued_tokens())
    try:
        with open(TOKEN_LOG) as f:
            tokens.update(line.strip() for line in f if line.strip())
    except FileNotFoundError:
        pass
    return tokens


def owned_segments() -> set[str]:
    """Segments of jobs started by this test run; other jobs on the machine, live or dead, are
    not the tests' to count."""
    tokens = owned_tokens()
    return {name for name in list_segments() if token_of(name) in tokens}


class RankFailure(AssertionError):
    """A rank raised or died during a pool run."""


def _serve(group: shmcoll.Group, rank: int, conn: Any, parent_pid: int) -> None:
    _rank_process_setup(parent_pid)
    comm = group.connect(rank)
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, fn, args = msg
            try:
                conn.send(("ok", fn(comm, *args)))
            except BaseException:  # noqa: BLE001  (reported to the parent)
                conn.send(("error", traceback.format_exc()))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        comm.close()


class RankPool:
    """``world_size`` long-lived ranks of one group."""

    def __init__(
        self, world_size: int, *, slot_bytes: int | None = None, nslots: int | None = None, comm_timeout: float = 30.0
    ) -> None:
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        self.nslots = nslots
        self.group = shmcoll.Group(world_size, slot_bytes=slot_bytes, nslots=nslots, timeout=comm_timeout)
        ctx = mp.get_context("spawn")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.broken = False
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(
                target=_serve, args=(self.group, rank, child_end, os.getpid()), name=f"pool-rank-{rank}", daemon=True
            )
            p.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(p)

    def run(self, fn: Any, *args: Any, timeout: float = 120.0) -> list[Any]:
        """``fn(comm, *args)`` on every rank; their results by rank. Raises on any failure."""
        if self.broken:
            raise RankFailure("pool is broken")
        for c in self.conns:
            c.send(("run", fn, args))
        n = self.world_size
        results: list[Any] = [None] * n
        pending = set(range(n))
        deadline = time.monotonic() + timeout
        errors: list[str] = []
        grace_end: float | None = None
        while pending:
            now = time.monotonic()
            if grace_end is not None and now > grace_end:
                break
            if now > deadline:
                self._dump_stacks(pending)
                errors.append(
                    f"deadline of {timeout}s passed; ranks {sorted(pending)} still running (their stacks are on stderr)"
                )
                break
            waitables = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            mp.connection.wait(waitables, timeout=min(0.1, max(deadline - now, 0.001)))
            for r in sorted(pending):
                if self.conns[r].poll():
                    try:
                        kind, payload = self.conns[r].recv()
                    except EOFError:
                        kind, payload = "error", f"rank {r} closed its pipe"
                    pending.discard(r)
                    if kind == "ok":
                        results[r] = payload
                    else:
                        errors.append(f"--- rank {r} raised ---\n{payload}")
                elif self.procs[r].exitcode is not None:
                    pending.discard(r)
                    errors.append(f"--- rank {r} died (exit code {self.procs[r].exitcode}) ---")
            if errors and grace_end is None:
                grace_end = time.monotonic() + 3.0
        if errors:
            self.close(kill=True)
            raise RankFailure("\n".join(errors))
        return results

    def _dump_stacks(self, ranks: set[int]) -> None:
        for r in ranks:
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.5)

    def close(self, kill: bool = False) -> None:
        self.broken = True
        if not kill:
            for c in self.conns:
                try:
                    c.send(("stop",))
                except OSError:
                    pass
            end = time.monotonic() + 10
            for p in self.procs:
                p.join(timeout=max(end - time.monotonic(), 0.1))
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
            p.join(timeout=5)
        for c in self.conns:
            c.close()
        self.group.close()


class Pools:
    """One live pool per configuration, replaced when a test breaks it."""

    def __init__(self) -> None:
        self._pools: dict[tuple[Any, ...], RankPool] = {}

    def get(self, world_size: int, *, slot_bytes: int | None = None, nslots: int | None = None) -> RankPool:
        key = (world_size, slot_bytes, nslots)
        pool = self._pools.get(key)
        if pool is None or pool.broken:
            pool = self._pools[key] = RankPool(world_size, slot_bytes=slot_bytes, nslots=nslots)
        return pool

    def close(self, world_size: int | None = None) -> None:
        for key in list(self._pools):
            if world_size is None or key[0] == world_size:
                self._pools.pop(key).close()


def run_ranks(fn: Any, world_size: int, *args: Any, timeout: float = 120.0, **group_kw: Any) -> list[Any]:
    """One-shot: a fresh pool for ``fn``, closed afterwards."""
    pool = RankPool(world_size, **group_kw)
    try:
        return pool.run(fn, *args, timeout=timeout)
    finally:
        if not pool.broken:
            pool.close()
