"""Collectives across machines: shmcoll's shared memory inside each node, MPI between nodes.

A :class:`MultiNodeCommunicator` is what :func:`shmcoll.init_mpi` returns when the ranks of an MPI
job sit on more than one node. It has world ranks (the MPI communicator's) and the
:class:`~shmcoll.Communicator` API; each collective is composed of calls on three kinds of
communicators:

- **the node communicator**: a shmcoll :class:`~shmcoll.Communicator` of the ranks of this node
  (``local`` rank = position among them, in world-rank order);
- **rails**: one MPI communicator per local rank index ``j``, of the ranks with local rank ``j``
  on every node (ranked by node). With ``lmin`` the smallest node's rank count, rails
  ``0 .. lmin-1`` span every node; rail 0 (the node leaders) serves the leader-based collectives;
- **control**: a duplicate of the world communicator carrying abort notices only.

Bandwidth-heavy collectives cut the data into ``lmin`` shards, one per rail, so that every rail
carries its shard across nodes at the same time (not one leader carrying everything):

- allreduce: node reduce-scatter (shard ``j`` to local rank ``j``), rail ``j`` reduce-scatters
  and allgathers its shard across nodes, node allgather. Every element is reduced by one rank
  along one path and then copied, so every rank gets the same bits.
- reduce: node reduce-scatter, rail reduce to the root's node, node gather to the root.
- reduce_scatter: the blocks put in node order, node reduce-scatter into shards, rail
  reduce-scatter of each shard to the node that owns its part, node allgather of the node's part.
- broadcast: node broadcast on the root's node, rail broadcast of each shard, node allgather.
- allgather(v): node allgather, rail allgather of each node buffer's shards, node allgather.
- alltoall: node exchange to the rank whose rail (local rank ``l % lmin``) reaches the
  destination, rail exchange across nodes, node exchange to the destination.
- gather(v), scatter(v): through the node leaders (rail 0); barrier: one MPI barrier.
- alltoallv, scan, exscan, point to point: straight over the world MPI communicator; so is
  every call of at most ``_FLAT_BYTES`` (16 KiB) per rank, where one MPI call beats three
  phases (small allreduce: one allgather, folded in rank order on every rank).

Float16 and bfloat16 reductions are widened to float32 for the whole call and rounded once at
the end (as shmcoll does on one node); AVG sums and divides once at the end.

**Failures.** Every MPI call is nonblocking and polled against the call's deadline; while
polling, a rank watches the control communicator for abort notices and checks that its node's
processes are alive. A rank that finds a failure (a dead local peer, a timeout, a broken node
communicator) sends a notice to every rank and aborts its node communicator, so every rank of
every node raises a :class:`~shmcoll.ShmcollError` naming the failure within a fraction of a
second. (A plain ``mpirun`` kills the whole job as soon as a rank dies, saying which; with
Open MPI's ``mpirun --with-ft ulfm`` the survivors live on, raise, and can report it.)

**Nonblocking forms** run the blocking call on one worker thread per communicator, in the order
they were started; a blocking call made while some are pending queues behind them.

mpi4py is imported only when a communicator is built (never by ``import shmcoll``).
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shmcoll import config
from shmcoll.comm import arrays
from shmcoll.comm.communicator import Communicator
from shmcoll.comm.p2p import ANY_SOURCE, ANY_TAG, Status
from shmcoll.comm.persistent import Persistent
from shmcoll.errors import (
    CollectiveTimeout,
    CommunicatorBrokenError,
    PeerLostError,
    ShmcollError,
    UnsupportedError,
)
from shmcoll.shm import layout
from shmcoll.types import BFLOAT16, FLOAT16, FOLD_UFUNC, ReduceOp, identity

_NOTICE_TAG = 7001
_POLL_CHECK_S = 0.02  # how often a polling rank looks for notices and dead local peers
_NOTICE_GRACE_S = 0.5  # how long a rank that sees a failure waits for a notice explaining it
_PRECONNECT_MAX = 256  # worlds up to this size connect every pair of the control communicator
_FLAT_BYTES = 16 << 10  # calls this small (per rank; allreduce: all ranks' data) skip the hierarchy
_SPIN_TESTS = 100  # MPI tests a wait makes before it starts yielding the core
_YIELD_TESTS = 5000  # ... and before it starts sleeping between tests

# Builds a node communicator from the node's MPI communicator: (communicator, closer).
NodeFactory = Callable[[Any, float | None], tuple[Communicator, Callable[[], None]]]


def _even(n: int, parts: int) -> np.ndarray:
    """Bounds of ``parts`` near-equal consecutive ranges of ``n`` elements (the first longer)."""
    q, r = divmod(n, parts)
    sizes = np.full(parts, q, dtype=np.int64)
    sizes[:r] += 1
    return np.concatenate(([0], np.cumsum(sizes)))


class Layout:
    """Which world ranks sit on which node. ``nodes[k]``: node ``k``'s world ranks, ascending;
    nodes are ordered by their lowest world rank."""

    def __init__(self, keys: Sequence[Any]) -> None:
        order: dict[Any, int] = {}
        for key in keys:
            order.setdefault(key, len(order))
        self.nodes: list[list[int]] = [[] for _ in order]
        for rank, key in enumerate(keys):
            self.nodes[order[key]].append(rank)
        self.world_size = len(keys)
        self.node_of = np.empty(self.world_size, dtype=np.int64)
        self.local_of = np.empty(self.world_size, dtype=np.int64)
        for k, ranks in enumerate(self.nodes):
            for j, r in enumerate(ranks):
                self.node_of[r] = k
                self.local_of[r] = j
        self.sizes = [len(n) for n in self.nodes]
        self.lmin = min(self.sizes)
        self.order = np.array([r for n in self.nodes for r in n], dtype=np.int64)  # node order

    @property
    def nnodes(self) -> int:
        return len(self.nodes)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (on this machine) is running: not gone, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"x")


class MultiNodeRequest:
    """A started nonblocking operation of a :class:`MultiNodeCommunicator` (run by its worker
    thread): :meth:`wait` and :meth:`test` as :class:`shmcoll.Request`'s."""

    def __init__(self, future: concurrent.futures.Future[Any], what: str) -> None:
        self._future = future
        self.what = what

    def __repr__(self) -> str:
        return f"<shmcoll.MultiNodeRequest {self.what} ({'done' if self.done else 'pending'})>"

    @property
    def done(self) -> bool:
        return self._future.done()

    def test(self) -> bool:
        """Whether it has completed, without blocking; raises its error if it failed."""
        if not self._future.done():
            return False
        self._future.result()
        return True

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for it; returns what the blocking call returns. ``TimeoutError`` after
        ``timeout`` seconds (the operation goes on)."""
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{self.what} has not completed within {timeout} s") from None


class _P2PRequest(MultiNodeRequest):
    """A point-to-point request: progressed by ``test`` and ``wait`` on the caller's thread."""

    def __init__(self, future: concurrent.futures.Future[Any], what: str, progress: Callable[[bool], None]) -> None:
        super().__init__(future, what)
        self._progress = progress

    def test(self) -> bool:
        self._progress(False)
        return super().test()

    def wait(self, timeout: float | None = None) -> Any:
        self._progress(True)
        return super().wait(timeout)


class MultiNodeCommunicator:
    """World ranks over several nodes: shmcoll inside each node, MPI between them.

    Create it with :func:`shmcoll.init_mpi`. The methods are the :class:`~shmcoll.Communicator`'s
    (same arguments, results, errors and ``timeout=``); ``algorithm=`` is accepted and passed to
    the node communicator's calls. See the module documentation for how each collective runs.
    """

    def __init__(
        self,
        world: Any,
        layout: Layout,
        node: Communicator,
        node_mpi: Any,
        node_closer: Callable[[], None],
        factory: NodeFactory,
        timeout: float | None = None,
    ) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self._world = world
        self._layout = layout
        self._rank = world.Get_rank()
        self._world_size = world.Get_size()
        self._node_index = int(layout.node_of[self._rank])
        self._local = int(layout.local_of[self._rank])
        self._node = node
        self._node_mpi = node_mpi
        self._node_closer = node_closer
        self._factory = factory
        self._timeout = config.timeout_s(timeout) if timeout is not None else config.get().timeout_s
        self._rail = world.Split(self._local, self._node_index)
        self._ctrl = world.Dup()
        self._pids = node_mpi.allgather(os.getpid())
        if self._world_size <= _PRECONNECT_MAX:
            # open every connection of the control communicator now, so that an abort notice
            # leaves at once even for a rank that is not in MPI at the time
            self._ctrl.alltoall([0] * self._world_size)
        self._broken: str | None = None
        self._no_ulfm = False
        self._next_entry_check = 0.0
        self._closed = False
        self._notices: list[Any] = []
        self._notice_sends: list[Any] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()
        self._ops: dict[tuple[Any, ...], Any] = {}

    # --- properties ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank in the world (the MPI communicator's rank)."""
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def node(self) -> Communicator:
        """This node's shmcoll communicator (its rank is :attr:`local_rank`)."""
        return self._node

    @property
    def node_index(self) -> int:
        """This rank's node: 0 .. :attr:`nnodes` - 1, nodes ordered by their lowest world rank."""
        return self._node_index

    @property
    def nnodes(self) -> int:
        return self._layout.nnodes

    @property
    def local_rank(self) -> int:
        return self._local

    @property
    def nodes(self) -> list[list[int]]:
        """Every node's world ranks."""
        return [list(n) for n in self._layout.nodes]

    @property
    def mpi_comm(self) -> Any:
        """The world MPI communicator (a duplicate of the one given to :func:`shmcoll.init_mpi`)."""
        return self._world

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "ok")
        return (
            f"<shmcoll.MultiNodeCommunicator rank {self._rank} of {self._world_size}, node {self._node_index} "
            f"of {self.nnodes} (local rank {self._local} of {self._layout.sizes[self._node_index]}) ({state})>"
        )

    # --- failures -----------------------------------------------------------------------------
    def _where(self) -> str:
        return f"rank {self._rank} (node {self._node_index}, local rank {self._local})"

    def _describe_rank(self, r: int) -> str:
        return f"rank {r} (node {int(self._layout.node_of[r])}, local rank {int(self._layout.local_of[r])})"

    def _check_usable(self) -> None:
        if self._closed:
            raise CommunicatorBrokenError(f"{self._where()}: the communicator is closed")
        if self._broken:
            raise CommunicatorBrokenError(f"{self._where()}: the communicator is broken: {self._broken}")

    def _send_notices(self, kind: str, text: str, dead: int | None) -> None:
        notice = (kind, self._rank, dead, text)
        for r in range(self._world_size):
            if r == self._rank or (dead is not None and r == dead):
                continue
            try:
                self._notice_sends.append(self._ctrl.isend(notice, dest=r, tag=_NOTICE_TAG))
            except Exception:  # noqa: BLE001  (a rank MPI cannot reach any more)
                pass

    def _poll_notice(self) -> Any:
        MPI = self._MPI
        status = MPI.Status()
        try:
            if self._ctrl.Iprobe(MPI.ANY_SOURCE, _NOTICE_TAG, status):
                return self._ctrl.recv(source=status.Get_source(), tag=_NOTICE_TAG)
            return None
        except Exception:  # noqa: BLE001  (ULFM refuses ANY_SOURCE once a process has failed)
            pass
        for r in range(self._world_size):  # ask each rank in turn
            if r == self._rank:
                continue
            try:
                if self._ctrl.Iprobe(r, _NOTICE_TAG, status):
                    return self._ctrl.recv(source=r, tag=_NOTICE_TAG)
            except Exception:  # noqa: BLE001  (that one is gone)
                continue
        return None

    def _raise(self, kind: str, text: str, dead: int | None, notify: bool = True) -> None:
        """Mark broken, tell everyone (unless the failure came from a notice), abort the node
        communicator, raise."""
        if notify:
            self._send_notices(kind, text, dead)
        self._broken = text
        self._abort_node(text, kind, dead)
        if kind == "lost":
            raise PeerLostError(text, dead)
        if kind == "timeout":
            raise CollectiveTimeout(text)
        raise CommunicatorBrokenError(text)

    def _abort_node(self, text: str, kind: str, dead: int | None) -> None:
        """Abort the node communicator with this failure's story in its abort word: a node peer
        that finds this process gone reads there why it left (its MPI notice may never arrive:
        under ULFM a message from a process that has exited can be lost with it)."""
        code = {"lost": layout.REMOTE_LOST, "timeout": layout.REMOTE_TIMEOUT}.get(kind, layout.REMOTE_BROKEN)
        try:
            self._node._abort_remote(text, code, -1 if dead is None else dead)
        except Exception:  # noqa: BLE001
            pass

    def _from_node_story(self, what: str) -> None:
        """Raise with the story a node peer left in the node's abort word, if one did: its MPI
        notice, which says it in full (an abort's reason too), if that comes within the grace,
        else the story's kind and the rank it blames."""
        story = self._node._remote_story()
        if story is None:
            return
        origin, code, dead = story
        if origin == self._local:
            return
        self._await_notice(what)
        teller = self._describe_rank(self._layout.nodes[self._node_index][origin])
        if code == layout.REMOTE_LOST and 0 <= dead < self._world_size:
            self._raise(
                "lost",
                f"{self._where()}: {what} failed: {self._describe_rank(dead)} died (found by {teller}, "
                "which told this node)",
                dead,
            )
        how = "timed out" if code == layout.REMOTE_TIMEOUT else "failed"
        self._raise(
            "timeout" if code == layout.REMOTE_TIMEOUT else "broken",
            f"{self._where()}: {what} failed: {teller} {how} in a call across nodes (it told this node; "
            "its own error names the cause)",
            None,
        )

    def _await_notice(self, what: str) -> None:
        """Wait up to the grace for a notice that explains a failure seen here, raising with it."""
        end = time.monotonic() + _NOTICE_GRACE_S
        while time.monotonic() < end:
            notice = self._poll_notice()
            if notice is not None:
                self._from_notice(notice, what)
            time.sleep(0.005)

    def _from_notice(self, notice: Any, what: str) -> None:
        kind, origin, dead, text = notice
        self._raise(kind, f"{self._where()}: {what} failed: {text} (reported by rank {origin})", dead, notify=False)

    def _check_peers(self, what: str) -> None:
        self._from_node_story(what)
        notice = self._poll_notice()
        if notice is not None:
            self._from_notice(notice, what)
        for j, pid in enumerate(self._pids):
            if j != self._local and not _alive(pid):
                # It may have exited after raising for a failure elsewhere (it would have left
                # its story in the node's abort word, read above): its notice may say which.
                self._await_notice(what)
                dead = self._layout.nodes[self._node_index][j]
                self._raise("lost", f"{self._describe_rank(dead)} died during {what} (seen by {self._where()})", dead)

    def _wait_mpi(self, reqs: Any, deadline: float, what: str, status: Any = None) -> None:
        """Poll MPI requests until done, checking notices, local peers and the deadline
        (``status``: filled from a single request)."""
        MPI = self._MPI
        if not isinstance(reqs, list):
            reqs = [reqs]
        spins = 0
        next_check = time.monotonic() + _POLL_CHECK_S
        while True:
            try:
                if reqs[0].Test(status) if status is not None else MPI.Request.Testall(reqs):
                    return
            except MPI.Exception as e:
                self._mpi_failed(e, what)
            spins += 1
            if spins > _SPIN_TESTS:  # (a rank of this machine may need the core: yield it, then doze)
                if spins < _YIELD_TESTS:
                    os.sched_yield()
                else:
                    time.sleep(5e-5)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _POLL_CHECK_S
                self._check_peers(what)
                if now > deadline:
                    self._raise(
                        "timeout",
                        f"{what} timed out on {self._where()}: the other nodes' ranks did not arrive "
                        "within the timeout",
                        None,
                    )

    def _failed_ranks(self) -> list[int]:
        """The world ranks MPI knows to have failed (ULFM's ``MPIX_Comm_get_failed``; empty where
        the MPI lacks it)."""
        if self._no_ulfm:
            return []
        try:
            group = self._world.Get_failed()
            n = group.Get_size()
            if n == 0:
                group.Free()
                return []
            ranks = self._MPI.Group.Translate_ranks(group, list(range(n)), self._world.Get_group())
            group.Free()
            return [int(r) for r in ranks if r >= 0]
        except NotImplementedError:
            self._no_ulfm = True
            return []
        except Exception:  # noqa: BLE001
            return []

    def _mpi_failed(self, error: BaseException, what: str) -> None:
        """An MPI call failed (a peer's connection dropped): wait briefly for a notice that says
        why (the dead rank's node peers see it die), else name what MPI knows."""
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            self._check_peers(what)  # raises on a notice or a dead local peer
            time.sleep(0.01)
        failed = self._failed_ranks()
        if failed:
            names = ", ".join(self._describe_rank(r) for r in failed)
            self._raise(
                "lost",
                f"{names} died (or exited after an error of theirs) during {what} (seen by {self._where()} over MPI)",
                failed[0],
            )
        self._raise("lost", f"{self._where()}: MPI failed during {what}: {error}", None)

    def _node_call(self, fn: Callable[..., Any], what: str, deadline: float, *args: Any, **kw: Any) -> Any:
        """A call on the node communicator, with its errors turned into this communicator's."""
        remaining = max(deadline - time.monotonic(), 1e-3) if deadline != float("inf") else float("inf")
        try:
            return fn(*args, timeout=remaining, **kw)
        except (ValueError, TypeError):
            raise
        except ShmcollError as e:
            # A local peer aborted for a failure elsewhere: prefer the story it left, or its notice.
            self._from_node_story(what)
            self._await_notice(what)
            if isinstance(e, PeerLostError) and e.dead_rank is not None:
                dead = self._layout.nodes[self._node_index][e.dead_rank]
                self._raise(
                    "lost",
                    f"{self._describe_rank(dead)} died during {what} (seen by {self._where()}; on the node: {e})",
                    dead,
                )
            kind = "timeout" if isinstance(e, CollectiveTimeout) else "broken"
            self._raise(kind, f"{what} failed on {self._where()}: {e}", None)

    def _deadline(self, timeout: float | None) -> float:
        t = self._timeout if timeout is None else config.timeout_s(timeout)
        return time.monotonic() + t if t != float("inf") else float("inf")

    # --- the worker thread --------------------------------------------------------------------
    def _entry(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run one call, first making sure no failure was reported since the last one (a late
        rank must not carry on alone after its peers gave up)."""
        self._check_usable()
        now = time.monotonic()
        if now >= self._next_entry_check:  # (an MPI probe costs ~10 us: not on every call)
            self._next_entry_check = now + _POLL_CHECK_S
            notice = self._poll_notice()
            if notice is not None:
                self._from_notice(notice, what)
        failed = self._failed_ranks()
        if failed:
            names = ", ".join(self._describe_rank(r) for r in failed)
            self._raise(
                "lost", f"{names} died (or exited after an error of theirs) before {what} on {self._where()}", failed[0]
            )
        return fn(*args, **kw)

    def _do(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run a blocking call now, or behind the started operations."""
        self._check_usable()
        if self._pending and threading.current_thread() is not self._worker:
            self._pending = [f for f in self._pending if not f.done()]
            if self._pending:
                return self._start(what, fn, *args, **kw).wait()
        return self._entry(what, fn, *args, **kw)

    def _start(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> MultiNodeRequest:
        self._check_usable()
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shmcoll-multinode")
            self._worker = self._executor.submit(threading.current_thread).result()
        future = self._executor.submit(self._entry, what, fn, *args, **kw)
        self._pending = [f for f in self._pending if not f.done()] + [future]
        return MultiNodeRequest(future, what)

    # --- MPI helpers --------------------------------------------------------------------------
    def _mpi_type(self, dtype: np.dtype) -> Any:
        MPI = self._MPI
        key = ("type", dtype.str, dtype.descr.__repr__())
        if key not in self._ops:
            try:
                if dtype.fields is not None or dtype == FLOAT16 or not dtype.isnative:
                    raise ValueError
                t = MPI.Datatype.fromcode(dtype.char)  # predefined: the built-in ops take it
            except Exception:  # noqa: BLE001  (no MPI type: move the bytes, an element at a time)
                t = MPI.BYTE.Create_contiguous(dtype.itemsize).Commit()
            self._ops[key] = t
        return self._ops[key]

    def _mpi_op(self, op: ReduceOp, dtype: np.dtype) -> Any:
        MPI = self._MPI
        if dtype.kind == "b":
            return {
                ReduceOp.SUM: MPI.LOR,
                ReduceOp.AVG: MPI.LOR,
                ReduceOp.PROD: MPI.LAND,
                ReduceOp.MIN: MPI.LAND,
                ReduceOp.MAX: MPI.LOR,
                ReduceOp.BAND: MPI.LAND,
                ReduceOp.BOR: MPI.LOR,
                ReduceOp.BXOR: MPI.LXOR,
            }[op]
        if dtype.kind == "f" and op in (ReduceOp.MIN, ReduceOp.MAX):
            # numpy's minimum/maximum (NaN propagates), which C's comparisons are not
            key = ("op", op, dtype.str)
            if key not in self._ops:
                ufunc = FOLD_UFUNC[op]

                def fold(inbuf: Any, inoutbuf: Any, datatype: Any, dt: np.dtype = dtype) -> None:
                    a = np.frombuffer(inbuf, dt)
                    b = np.frombuffer(inoutbuf, dt)
                    ufunc(a, b, out=b)

                self._ops[key] = MPI.Op.Create(fold, commute=True)
            return self._ops[key]
        return {
            ReduceOp.SUM: MPI.SUM,
            ReduceOp.AVG: MPI.SUM,
            ReduceOp.PROD: MPI.PROD,
            ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX,
            ReduceOp.BAND: MPI.BAND,
            ReduceOp.BOR: MPI.BOR,
            ReduceOp.BXOR: MPI.BXOR,
        }[op]

    @staticmethod
    def _spec(a: np.ndarray | None, t: Any, counts: Sequence[int] | np.ndarray | None = None) -> Any:
        if counts is None:
            return [a, t]
        c = np.asarray(counts, dtype=np.int64)
        d = np.concatenate(([0], np.cumsum(c)[:-1])) if len(c) else c
        return [a, (c.tolist(), d.tolist()), t]

    # --- widening -----------------------------------------------------------------------------
    @staticmethod
    def _widened(dtype: np.dtype) -> bool:
        return dtype in (FLOAT16, BFLOAT16)

    @staticmethod
    def _widen(x: np.ndarray) -> np.ndarray:
        flat = x.reshape(-1)
        if flat.dtype == FLOAT16:
            return flat.astype(np.float32)
        if flat.dtype == BFLOAT16:
            return (flat.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return flat

    @staticmethod
    def _narrow(w: np.ndarray, dest: np.ndarray) -> None:
        flat = dest.reshape(-1)
        if flat.dtype == FLOAT16:
            flat[...] = w.astype(np.float16)
        elif flat.dtype == BFLOAT16:
            from shmcoll.kernels import cpu

            cpu.narrow_bfloat16(flat.view(np.uint16), 0, w.view(np.uint32), 0, w.size)
        else:
            flat[...] = w

    def _finish_avg(self, w: np.ndarray, op: ReduceOp, n: int) -> None:
        if op != ReduceOp.AVG:
            return
        if w.dtype.kind == "c":
            w.real[...] /= n
            w.imag[...] /= n
        elif w.dtype.kind == "f":
            w /= n
        else:
            np.floor_divide(w, n, out=w)

    def _reduction(self, x: np.ndarray, op: Any) -> tuple[ReduceOp, ReduceOp, np.ndarray]:
        """(op, the op every stage applies, the flat working copy of ``x``)."""
        arrays.check_dtype(x.dtype)
        rop = arrays.check_op(op, x.dtype)
        w = self._widen(x)
        if w.dtype.kind == "b":
            stage = rop
        else:
            stage = ReduceOp.SUM if rop == ReduceOp.AVG else rop
        return rop, stage, w

    @staticmethod
    def _target(x: np.ndarray, out: np.ndarray | None, shape: tuple[int, ...] | None = None) -> np.ndarray:
        if out is None:
            return np.empty(shape if shape is not None else x.shape, dtype=x.dtype)
        if out.dtype != x.dtype:
            raise TypeError(f"out has dtype {out.dtype}, x has {x.dtype}")
        want = int(np.prod(shape if shape is not None else x.shape))
        if out.size != want:
            raise ValueError(f"out has {out.size} elements, the result has {want}")
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        return out

    @staticmethod
    def _check_array(x: Any, what: str = "x") -> np.ndarray:
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{what} must be a numpy array, got {type(x).__name__}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous")
        arrays.check_dtype(x.dtype)
        return x

    def _check_root(self, root: int) -> None:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < self._world_size:
            raise ValueError(f"root must be in [0, {self._world_size}), got {root!r}")

    # --- building blocks ----------------------------------------------------------------------
    def _node_rs(
        self, what: str, deadline: float, w: np.ndarray, op: ReduceOp, counts: list[int], out: np.ndarray
    ) -> None:
        """Node reduce-scatter of ``w`` by ``counts`` (equal blocks take the faster plain call)."""
        if len(set(counts)) == 1:
            if counts[0] == 0:
                return
            self._node_call(self._node.reduce_scatter, what, deadline, w, op, out=out)
        else:
            self._node_call(self._node.reduce_scatter, what, deadline, w, op, counts, out=out)

    def _node_ag(self, what: str, deadline: float, piece: np.ndarray, counts: list[int], out: np.ndarray) -> None:
        """Node allgather of ``piece`` by ``counts`` into flat ``out`` (equal blocks: the plain call)."""
        if len(set(counts)) == 1:
            if counts[0] == 0:
                return
            self._node_call(self._node.allgather, what, deadline, piece, out=out.reshape(len(counts), -1))
        else:
            self._node_call(self._node.allgatherv, what, deadline, piece, counts, out=out)

    def _node_counts(self, bounds: np.ndarray) -> list[int]:
        sizes = np.diff(bounds).tolist()
        return sizes + [0] * (self._layout.sizes[self._node_index] - len(sizes))

    def _rail_allreduce(self, shard: np.ndarray, stage: ReduceOp, deadline: float, what: str) -> None:
        """Rail allreduce of ``shard`` in place, as reduce-scatter + allgather, so that each
        element is reduced on one rank only and every rank gets its bits."""
        t = self._mpi_type(shard.dtype)
        mop = self._mpi_op(stage, shard.dtype)
        if self.nnodes == 2:
            # a (op) b on one rank, b (op) a on the other: the same bits (the ops commute exactly)
            self._wait_mpi(self._rail.Iallreduce(self._MPI.IN_PLACE, [shard, t], mop), deadline, what)
            return
        counts = np.diff(_even(shard.size, self.nnodes))
        piece = np.empty(int(counts[self._node_index]), dtype=shard.dtype)
        self._wait_mpi(self._rail.Ireduce_scatter([shard, t], [piece, t], counts.tolist(), mop), deadline, what)
        self._wait_mpi(self._rail.Iallgatherv([piece, t], self._spec(shard, t, counts)), deadline, what)

    def _allgather_nodes(
        self, buf: np.ndarray, node_sizes: Sequence[int], deadline: float, what: str, dest: np.ndarray | None = None
    ) -> np.ndarray:
        """Every node's ``buf`` (held by each of its ranks; ``node_sizes[k]`` elements on node
        ``k``), back to back in node order, on every rank: each rail ``j < lmin`` carries shard
        ``j`` of every node's buffer."""
        lay = self._layout
        lmin = lay.lmin
        bounds = [_even(int(s), lmin) for s in node_sizes]
        t = self._mpi_type(buf.dtype)
        if self._local < lmin:
            j = self._local
            b = bounds[self._node_index]
            counts = [int(bk[j + 1] - bk[j]) for bk in bounds]
            got = np.empty(sum(counts), dtype=buf.dtype)
            mine = np.ascontiguousarray(buf[b[j] : b[j + 1]])
            self._wait_mpi(self._rail.Iallgatherv([mine, t], self._spec(got, t, counts)), deadline, what)
        else:
            got = np.empty(0, dtype=buf.dtype)
        per_local = [sum(int(bk[j + 1] - bk[j]) for bk in bounds) for j in range(lmin)]
        per_local += [0] * (lay.sizes[self._node_index] - lmin)
        total = int(sum(node_sizes))
        full = dest if dest is not None else np.empty(total, dtype=buf.dtype)
        if lmin == 1:  # one rail: what it gathered is already in node order
            self._node_ag(what, deadline, got, per_local, full)
            return full
        mixed = np.empty(total, dtype=buf.dtype)
        self._node_ag(what, deadline, got, per_local, mixed)
        # mixed: for each rail j, for each node k, shard j of node k's buffer
        starts = np.concatenate(([0], np.cumsum(node_sizes)))
        pos = 0
        for j in range(lmin):
            for k, bk in enumerate(bounds):
                n = int(bk[j + 1] - bk[j])
                full[starts[k] + bk[j] : starts[k] + bk[j] + n] = mixed[pos : pos + n]
                pos += n
        return full

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
        """As :meth:`shmcoll.Communicator.allreduce`, over every node (see the module doc)."""
        return self._do("allreduce", self._allreduce, x, op, out, timeout)  # type: ignore[no-any-return]

    def _allreduce(self, x: np.ndarray, op: Any, out: np.ndarray | None, timeout: float | None) -> np.ndarray:
        what = "allreduce"
        x = self._check_array(x)
        target = x if out is None or out is x else self._target(x, out)
        if not target.flags.writeable:
            raise ValueError("allreduce: the result array is read-only")
        rop, stage, w = self._reduction(x, op)
        deadline = self._deadline(timeout)
        if w.nbytes * self._world_size <= _FLAT_BYTES:
            # small: everyone's data to everyone in one MPI call, folded in rank order here
            t = self._mpi_type(w.dtype)
            everyone = np.empty((self._world_size, w.size), dtype=w.dtype)
            self._wait_mpi(self._world.Iallgather([np.ascontiguousarray(w), t], [everyone, t]), deadline, what)
            full = everyone[0].copy()
            fold = FOLD_UFUNC[rop]
            for r in range(1, self._world_size):
                fold(full, everyone[r], out=full)
            self._finish_avg(full, rop, self._world_size)
            self._narrow(full, target)
            return target
        bounds = _even(w.size, self._layout.lmin)
        counts = self._node_counts(bounds)
        shard = np.empty(counts[self._local], dtype=w.dtype)
        self._node_rs(what, deadline, w, stage, counts, shard)
        if self._local < self._layout.lmin:
            self._rail_allreduce(shard, stage, deadline, what)
        full = target.reshape(-1) if w.dtype == x.dtype else np.empty(w.size, dtype=w.dtype)
        self._node_ag(what, deadline, shard, counts, full)
        self._finish_avg(full, rop, self._world_size)
        if w.dtype != x.dtype:
            self._narrow(full, target)
        return target

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
        """As :meth:`shmcoll.Communicator.reduce`: node reduce-scatter, rail reduce, node gather."""
        return self._do("reduce", self._reduce, x, root, op, out, timeout)

    def _reduce(self, x: np.ndarray, root: int, op: Any, out: np.ndarray | None, timeout: float | None) -> Any:
        what = "reduce"
        x = self._check_array(x)
        self._check_root(root)
        is_root = self._rank == root
        target = (x if out is x else self._target(x, out)) if is_root else None
        rop, stage, w = self._reduction(x, op)
        deadline = self._deadline(timeout)
        lay = self._layout
        root_node, root_local = int(lay.node_of[root]), int(lay.local_of[root])
        if w.nbytes <= _FLAT_BYTES:  # small: one MPI reduce (the result exists on the root only)
            t = self._mpi_type(w.dtype)
            full = np.empty(w.size, dtype=w.dtype) if is_root else None
            recv = [full, t] if full is not None else None
            req = self._world.Ireduce([np.ascontiguousarray(w), t], recv, self._mpi_op(stage, w.dtype), root)
            self._wait_mpi(req, deadline, what)
            if not is_root:
                return None
            assert target is not None and full is not None
            self._finish_avg(full, rop, self._world_size)
            self._narrow(full, target)
            return target
        bounds = _even(w.size, lay.lmin)
        counts = self._node_counts(bounds)
        shard = np.empty(counts[self._local], dtype=w.dtype)
        self._node_rs(what, deadline, w, stage, counts, shard)
        if self._local < lay.lmin:
            t = self._mpi_type(w.dtype)
            got = np.empty_like(shard) if self._node_index == root_node else None
            req = self._rail.Ireduce(
                [shard, t], [got, t] if got is not None else None, self._mpi_op(stage, w.dtype), root_node
            )
            self._wait_mpi(req, deadline, what)
            if got is not None:
                shard = got
        if self._node_index != root_node:
            return None
        full = np.empty(w.size, dtype=w.dtype) if self._local == root_local else None
        self._node_call(self._node.gatherv, what, deadline, shard, counts, root_local, out=full)
        if not is_root:
            return None
        assert target is not None and full is not None
        self._finish_avg(full, rop, self._world_size)
        if w.dtype != x.dtype:
            self._narrow(full, target)
        else:
            target.reshape(-1)[...] = full
        return target

    def broadcast(
        self,
        x: np.ndarray,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """As :meth:`shmcoll.Communicator.broadcast`: node broadcast on the root's node, rail
        broadcast of each shard, node allgather on the others."""
        return self._do("broadcast", self._broadcast, x, root, out, timeout)  # type: ignore[no-any-return]

    def _broadcast(self, x: np.ndarray, root: int, out: np.ndarray | None, timeout: float | None) -> np.ndarray:
        what = "broadcast"
        x = self._check_array(x)
        self._check_root(root)
        target = x if out is None or out is x else self._target(x, out)
        if target is not x and self._rank == root:
            target[...] = x
        deadline = self._deadline(timeout)
        lay = self._layout
        root_node, root_local = int(lay.node_of[root]), int(lay.local_of[root])
        flat = target.reshape(-1)
        if flat.nbytes <= _FLAT_BYTES:  # small: one MPI broadcast
            self._wait_mpi(self._world.Ibcast([flat, self._mpi_type(x.dtype)], root), deadline, what)
            return target
        if self._node_index == root_node:
            self._node_call(self._node.broadcast, what, deadline, target, root_local)
        bounds = _even(flat.size, lay.lmin)
        counts = self._node_counts(bounds)
        shard = np.empty(counts[self._local], dtype=x.dtype)
        if self._local < lay.lmin:
            if self._node_index == root_node:
                shard[...] = flat[bounds[self._local] : bounds[self._local + 1]]
            t = self._mpi_type(x.dtype)
            self._wait_mpi(self._rail.Ibcast([shard, t], root_node), deadline, what)
        if self._node_index != root_node:
            self._node_ag(what, deadline, shard, counts, flat)
        return target

    def allgather(
        self, x: np.ndarray, *, out: np.ndarray | None = None, algorithm: str = "auto", timeout: float | None = None
    ) -> np.ndarray:
        """As :meth:`shmcoll.Communicator.allgather`: node allgather, rails carry shards of each
        node's blocks, node allgather."""
        return self._do("allgather", self._allgather, x, out, timeout)  # type: ignore[no-any-return]

    def _allgather(self, x: np.ndarray, out: np.ndarray | None, timeout: float | None) -> np.ndarray:
        what = "allgather"
        x = self._check_array(x)
        target = self._target(x, out, (self._world_size, *x.shape))
        if out is not None:
            target = target.reshape(self._world_size, *x.shape)
        deadline = self._deadline(timeout)
        lay = self._layout
        m = x.size
        src = x.reshape(-1).copy()  # x may be a row of out
        if target.nbytes <= _FLAT_BYTES:  # small: one MPI allgather
            t = self._mpi_type(x.dtype)
            self._wait_mpi(self._world.Iallgather([src, t], [target.reshape(-1), t]), deadline, what)
            return target
        block = np.empty(lay.sizes[self._node_index] * m, dtype=x.dtype)
        self._node_ag(what, deadline, src, [m] * lay.sizes[self._node_index], block)
        in_order = bool((lay.order == np.arange(self._world_size)).all())
        full = self._allgather_nodes(
            block, [s * m for s in lay.sizes], deadline, what, target.reshape(-1) if in_order else None
        )
        if not in_order:
            target.reshape(self._world_size, m)[lay.order] = full.reshape(self._world_size, m)
        return target

    def allgatherv(
        self,
        x: np.ndarray,
        counts: Sequence[int] | np.ndarray | None = None,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """As :meth:`shmcoll.Communicator.allgatherv` (``counts`` required here)."""
        return self._do("allgatherv", self._allgatherv, x, counts, out, timeout)  # type: ignore[no-any-return]

    def _counts(self, counts: Any) -> np.ndarray:
        if counts is None:
            raise ValueError("counts are required on a MultiNodeCommunicator")
        c = np.asarray(counts, dtype=np.int64).reshape(-1)
        if c.size != self._world_size or (c < 0).any():
            raise ValueError(f"counts must be {self._world_size} integers >= 0, got {counts!r}")
        return c

    def _allgatherv(self, x: np.ndarray, counts: Any, out: np.ndarray | None, timeout: float | None) -> np.ndarray:
        what = "allgatherv"
        x = self._check_array(x)
        c = self._counts(counts)
        if x.size != c[self._rank]:
            raise ValueError(f"x has {x.size} elements, counts[{self._rank}] is {c[self._rank]}")
        target = self._target(x, out, (int(c.sum()),)).reshape(-1)
        deadline = self._deadline(timeout)
        lay = self._layout
        mine = [int(c[r]) for r in lay.nodes[self._node_index]]
        block = np.empty(sum(mine), dtype=x.dtype)
        self._node_call(self._node.allgatherv, what, deadline, x.reshape(-1).copy(), mine, out=block)
        node_sizes = [int(c[n].sum()) for n in lay.nodes]
        full = self._allgather_nodes(block, node_sizes, deadline, what)
        self._unpack_node_order(full, c, target)
        return target

    def _unpack_node_order(self, full: np.ndarray, c: np.ndarray, target: np.ndarray) -> None:
        """``full`` holds blocks of ``c[r]`` elements in node order; put them in rank order."""
        starts = np.concatenate(([0], np.cumsum(c)))
        pos = 0
        for r in self._layout.order:
            n = int(c[r])
            target[starts[r] : starts[r] + n] = full[pos : pos + n]
            pos += n

    def _pack_node_order(self, x: np.ndarray, c: np.ndarray) -> np.ndarray:
        if (self._layout.order == np.arange(self._world_size)).all():
            return x
        starts = np.concatenate(([0], np.cumsum(c)))
        return np.concatenate([x[starts[r] : starts[r] + c[r]] for r in self._layout.order]) if len(c) else x

    def gather(
        self,
        x: np.ndarray,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray | None:
        """As :meth:`shmcoll.Communicator.gather`: node gather to each leader, leaders gather to
        the root's node."""
        return self._do("gather", self._gatherv_any, x, None, root, out, timeout, "gather")

    def gatherv(
        self,
        x: np.ndarray,
        counts: Sequence[int] | np.ndarray | None = None,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray | None:
        """As :meth:`shmcoll.Communicator.gatherv` (``counts`` required here)."""
        return self._do("gatherv", self._gatherv_any, x, counts, root, out, timeout, "gatherv")

    def _gatherv_any(
        self, x: np.ndarray, counts: Any, root: int, out: np.ndarray | None, timeout: float | None, what: str
    ) -> Any:
        x = self._check_array(x)
        self._check_root(root)
        P = self._world_size
        c = np.full(P, x.size, dtype=np.int64) if what == "gather" else self._counts(counts)
        if x.size != c[self._rank]:
            raise ValueError(f"x has {x.size} elements, counts[{self._rank}] is {c[self._rank]}")
        is_root = self._rank == root
        shape = (P, *x.shape) if what == "gather" else (int(c.sum()),)
        target = self._target(x, out, shape).reshape(shape) if is_root else None
        deadline = self._deadline(timeout)
        lay = self._layout
        root_node, root_local = int(lay.node_of[root]), int(lay.local_of[root])
        mine = [int(c[r]) for r in lay.nodes[self._node_index]]
        block = np.empty(sum(mine), dtype=x.dtype) if self._local == 0 else None
        self._node_call(self._node.gatherv, what, deadline, x.reshape(-1).copy(), mine, 0, out=block)
        full = None
        if self._local == 0:
            assert block is not None
            t = self._mpi_type(x.dtype)
            node_sizes = [int(c[n].sum()) for n in lay.nodes]
            if self._node_index == root_node:
                full = np.empty(int(c.sum()), dtype=x.dtype)
                recv = self._spec(full, t, node_sizes)
            else:
                recv = None
            self._wait_mpi(self._rail.Igatherv([block, t], recv, root_node), deadline, what)
        if self._node_index == root_node and root_local != 0:
            if self._local == 0:
                self._node_call(self._node.send, what, deadline, full, root_local)
            elif is_root:
                full = np.empty(int(c.sum()), dtype=x.dtype)
                self._node_call(self._node.recv, what, deadline, full, 0)
        if not is_root:
            return None
        assert target is not None and full is not None
        self._unpack_node_order(full, c, target.reshape(-1))
        return target

    def scatter(
        self,
        x: np.ndarray | None,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """As :meth:`shmcoll.Communicator.scatter`: the root's node leader scatters node blocks to
        the leaders, each scatters on its node."""
        return self._do("scatter", self._scatterv_any, x, None, root, out, timeout, "scatter")  # type: ignore[no-any-return]

    def scatterv(
        self,
        x: np.ndarray | None,
        counts: Sequence[int] | np.ndarray | None = None,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """As :meth:`shmcoll.Communicator.scatterv` (``counts`` required here)."""
        return self._do("scatterv", self._scatterv_any, x, counts, root, out, timeout, "scatterv")  # type: ignore[no-any-return]

    def _scatterv_any(
        self, x: Any, counts: Any, root: int, out: np.ndarray | None, timeout: float | None, what: str
    ) -> np.ndarray:
        self._check_root(root)
        P = self._world_size
        is_root = self._rank == root
        if what == "scatter":
            if out is None:
                if not is_root:
                    raise ValueError("scatter: out is required on the ranks other than the root")
                x = self._check_array(x)
                out = np.empty(x.shape[1:], dtype=x.dtype)
            out = self._check_array(out, "out")
            c = np.full(P, out.size, dtype=np.int64)
        else:
            c = self._counts(counts)
            if out is None:
                if not is_root:
                    raise ValueError("scatterv: out is required on the ranks other than the root")
                x = self._check_array(x)
                out = np.empty(int(c[self._rank]), dtype=x.dtype)
            out = self._check_array(out, "out")
        if out.size != c[self._rank]:
            raise ValueError(f"out has {out.size} elements, this rank's block has {c[self._rank]}")
        dtype = out.dtype
        if is_root:
            x = self._check_array(x)
            if x.size != c.sum() or x.dtype != dtype:
                raise ValueError(f"x must have {int(c.sum())} elements of {dtype}")
        deadline = self._deadline(timeout)
        lay = self._layout
        root_node, root_local = int(lay.node_of[root]), int(lay.local_of[root])
        packed = None
        if is_root:
            packed = self._pack_node_order(x.reshape(-1), c)
        if self._node_index == root_node and root_local != 0:
            if is_root:
                self._node_call(self._node.send, what, deadline, packed, 0)
            elif self._local == 0:
                packed = np.empty(int(c.sum()), dtype=dtype)
                self._node_call(self._node.recv, what, deadline, packed, root_local)
        mine = [int(c[r]) for r in lay.nodes[self._node_index]]
        block = None
        if self._local == 0:
            t = self._mpi_type(dtype)
            node_sizes = [int(c[n].sum()) for n in lay.nodes]
            block = np.empty(sum(mine), dtype=dtype)
            send = self._spec(packed, t, node_sizes) if self._node_index == root_node else None
            self._wait_mpi(self._rail.Iscatterv(send, [block, t], root_node), deadline, what)
        self._node_call(self._node.scatterv, what, deadline, block, mine, 0, out=out.reshape(-1))
        return out

    def reduce_scatter(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        counts: Sequence[int] | np.ndarray | None = None,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """As :meth:`shmcoll.Communicator.reduce_scatter`: blocks in node order, node
        reduce-scatter into shards, rail reduce-scatter of each shard to the nodes, node
        allgather of each node's part."""
        return self._do("reduce_scatter", self._reduce_scatter, x, op, counts, out, timeout)  # type: ignore[no-any-return]

    def _reduce_scatter(self, x: np.ndarray, op: Any, counts: Any, out: Any, timeout: float | None) -> np.ndarray:
        what = "reduce_scatter"
        x = self._check_array(x)
        P = self._world_size
        if counts is None:
            if x.ndim == 0 or x.shape[0] % P:
                raise ValueError(f"reduce_scatter: x.shape[0] must be divisible by world_size {P}, got {x.shape}")
            shape: tuple[int, ...] = (x.shape[0] // P, *x.shape[1:])
            c = np.full(P, int(np.prod(shape)), dtype=np.int64)
        else:
            c = self._counts(counts)
            if x.size != c.sum():
                raise ValueError(f"x has {x.size} elements, counts add up to {int(c.sum())}")
            shape = (int(c[self._rank]),)
        target = self._target(x, out, shape)
        rop, stage, w = self._reduction(x, op)
        deadline = self._deadline(timeout)
        lay = self._layout
        if w.nbytes <= _FLAT_BYTES:  # small: one MPI reduce-scatter (each block reduced once)
            t = self._mpi_type(w.dtype)
            res = np.empty(int(c[self._rank]), dtype=w.dtype)
            req = self._world.Ireduce_scatter(
                [np.ascontiguousarray(w), t], [res, t], c.tolist(), self._mpi_op(stage, w.dtype)
            )
            self._wait_mpi(req, deadline, what)
            self._finish_avg(res, rop, P)
            self._narrow(res, target)
            return target
        wp = self._pack_node_order(w, c)
        region = np.array([int(c[n].sum()) for n in lay.nodes], dtype=np.int64)
        rstart = np.concatenate(([0], np.cumsum(region)))
        bounds = _even(wp.size, lay.lmin)
        counts_node = self._node_counts(bounds)
        shard = np.empty(counts_node[self._local], dtype=w.dtype)
        self._node_rs(what, deadline, wp, stage, counts_node, shard)

        def overlap(j: int, k: int) -> int:
            return max(0, min(int(bounds[j + 1]), int(rstart[k + 1])) - max(int(bounds[j]), int(rstart[k])))

        if self._local < lay.lmin:
            j = self._local
            rc = [overlap(j, k) for k in range(lay.nnodes)]
            piece = np.empty(rc[self._node_index], dtype=w.dtype)
            t = self._mpi_type(w.dtype)
            req = self._rail.Ireduce_scatter([shard, t], [piece, t], rc, self._mpi_op(stage, w.dtype))
            self._wait_mpi(req, deadline, what)
        else:
            piece = np.empty(0, dtype=w.dtype)
        k = self._node_index
        parts = [overlap(j, k) for j in range(lay.lmin)] + [0] * (lay.sizes[k] - lay.lmin)
        mine = np.empty(int(region[k]), dtype=w.dtype)
        self._node_ag(what, deadline, piece, parts, mine)
        off = int(sum(c[r] for r in lay.nodes[k][: self._local]))
        res = mine[off : off + int(c[self._rank])]
        self._finish_avg(res, rop, P)
        if w.dtype != x.dtype:
            self._narrow(res, target)
        else:
            target.reshape(-1)[...] = res
        return target

    def alltoall(
        self, x: np.ndarray, *, out: np.ndarray | None = None, algorithm: str = "auto", timeout: float | None = None
    ) -> np.ndarray:
        """As :meth:`shmcoll.Communicator.alltoall`: a node exchange gathers each block on the local
        rank whose rail leads to its destination, the rails exchange across nodes, a node exchange
        delivers."""
        return self._do("alltoall", self._alltoall, x, out, timeout)  # type: ignore[no-any-return]

    def _alltoall(self, x: np.ndarray, out: np.ndarray | None, timeout: float | None) -> np.ndarray:
        what = "alltoall"
        x = self._check_array(x)
        P = self._world_size
        if x.ndim == 0 or x.shape[0] != P:
            raise ValueError(f"alltoall: x must have shape (world_size={P}, ...), got {x.shape}")
        target = x if out is x else self._target(x, out)
        m = x.size // P
        deadline = self._deadline(timeout)
        lay = self._layout
        if x.nbytes <= _FLAT_BYTES:  # small: one MPI alltoall
            t = self._mpi_type(x.dtype)
            res = np.empty((P, m), dtype=x.dtype)
            self._wait_mpi(self._world.Ialltoall([x.reshape(P, m).copy(), t], [res, t]), deadline, what)
            target.reshape(P, m)[...] = res
            return target
        # Rails: block (a, i) -> (b, l) travels (a, i) -> (a, c) in the node, (a, c) -> (b, c) on
        # rail c = l % lmin, (b, c) -> (b, l) in the node; every local rank < lmin carries a share.
        k, me, lmin = self._node_index, self._local, lay.lmin
        sk = lay.sizes[k]
        carried = [[r for n in lay.nodes for r in n if lay.local_of[r] % lmin == c] for c in range(lmin)]
        xs = x.reshape(P, m)
        send1 = np.concatenate([xs[carried[c]] for c in range(lmin)]).reshape(-1)
        counts1 = [len(carried[c]) * m for c in range(lmin)] + [0] * (sk - lmin)
        mine = carried[me] if me < lmin else []
        recv1 = np.empty(sk * len(mine) * m, dtype=x.dtype)
        rcounts1 = [len(mine) * m] * sk
        self._node_call(self._node.alltoallv, what, deadline, send1, counts1, rcounts1, out=recv1)
        here = [r for r in mine if lay.node_of[r] == k]  # the ranks of this node rail c serves
        send3 = np.empty(len(here) * P * m, dtype=x.dtype)
        if me < lmin:
            # rail c: to node b the blocks for its ranks in `mine`, from each local rank here
            t = self._mpi_type(x.dtype)
            r1 = recv1.reshape(sk, len(mine), m)
            per_node = [[j for j, r in enumerate(mine) if lay.node_of[r] == b] for b in range(lay.nnodes)]
            send2 = np.concatenate([r1[:, idx, :].transpose(1, 0, 2).reshape(-1) for idx in per_node])
            scounts = [len(idx) * sk * m for idx in per_node]
            rcounts = [len(here) * lay.sizes[b] * m for b in range(lay.nnodes)]
            recv2 = np.empty(sum(rcounts), dtype=x.dtype)
            req = self._rail.Ialltoallv(self._spec(send2, t, scounts), self._spec(recv2, t, rcounts))
            self._wait_mpi(req, deadline, what)
            # recv2: for each source node b, [dest in `here`][source local][m] -> [dest][source in node order][m]
            parts, pos = [], 0
            for b in range(lay.nnodes):
                n = len(here) * lay.sizes[b] * m
                parts.append(recv2[pos : pos + n].reshape(len(here), lay.sizes[b], m))
                pos += n
            send3 = np.concatenate(parts, axis=1).reshape(-1) if parts else send3
        counts3 = [0] * sk
        for r in here:
            counts3[int(lay.local_of[r])] = P * m
        rcounts3 = [0] * sk
        rcounts3[me % lmin] = P * m
        res = np.empty(P * m, dtype=x.dtype)
        self._node_call(self._node.alltoallv, what, deadline, send3, counts3, rcounts3, out=res)
        target.reshape(P, m)[lay.order] = res.reshape(P, m)
        return target

    def alltoallv(
        self,
        x: np.ndarray,
        send_counts: Sequence[int] | np.ndarray,
        recv_counts: Sequence[int] | np.ndarray | None = None,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """As :meth:`shmcoll.Communicator.alltoallv`, over the world MPI communicator (not
        hierarchical)."""
        return self._do("alltoallv", self._alltoallv, x, send_counts, recv_counts, out, timeout)  # type: ignore[no-any-return]

    def _alltoallv(self, x: np.ndarray, sc: Any, rc: Any, out: Any, timeout: float | None) -> np.ndarray:
        what = "alltoallv"
        x = self._check_array(x)
        scounts = self._counts(sc)
        deadline = self._deadline(timeout)
        if rc is None:
            col = np.empty(self._world_size, dtype=np.int64)
            self._wait_mpi(
                self._world.Ialltoall([scounts, self._MPI.INT64_T], [col, self._MPI.INT64_T]), deadline, what
            )
            rcounts = col
        else:
            rcounts = self._counts(rc)
        if x.size != scounts.sum():
            raise ValueError(f"x has {x.size} elements, send_counts add up to {int(scounts.sum())}")
        target = self._target(x, out, (int(rcounts.sum()),)).reshape(-1)
        t = self._mpi_type(x.dtype)
        send = x.reshape(-1).copy()
        req = self._world.Ialltoallv(self._spec(send, t, scounts), self._spec(target, t, rcounts))
        self._wait_mpi(req, deadline, what)
        return target

    def scan(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """As :meth:`shmcoll.Communicator.scan`, over the world MPI communicator."""
        return self._do("scan", self._scan, x, op, out, timeout, False)  # type: ignore[no-any-return]

    def exscan(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """As :meth:`shmcoll.Communicator.exscan`, over the world MPI communicator (rank 0 gets
        the op's identity)."""
        return self._do("exscan", self._scan, x, op, out, timeout, True)  # type: ignore[no-any-return]

    def _scan(self, x: np.ndarray, op: Any, out: Any, timeout: float | None, exclusive: bool) -> np.ndarray:
        what = "exscan" if exclusive else "scan"
        x = self._check_array(x)
        target = x if out is None or out is x else self._target(x, out)
        rop, stage, w = self._reduction(x, op)
        if rop == ReduceOp.AVG:
            raise ValueError(f"{what}: op AVG is not a prefix reduction (use SUM and divide by the number of ranks)")
        deadline = self._deadline(timeout)
        t = self._mpi_type(w.dtype)
        res = np.empty(w.size, dtype=w.dtype)
        send = w.copy()
        mop = self._mpi_op(stage, w.dtype)
        req = (self._world.Iexscan if exclusive else self._world.Iscan)([send, t], [res, t], mop)
        self._wait_mpi(req, deadline, what)
        if exclusive and self._rank == 0:
            target[...] = identity(rop, x.dtype)
            return target
        if w.dtype != x.dtype:
            self._narrow(res, target)
        else:
            target.reshape(-1)[...] = res
        return target

    def barrier(self, *, timeout: float | None = None) -> None:
        """Every rank of every node has entered (one MPI barrier over the world)."""
        self._do("barrier", self._barrier, timeout)

    def _barrier(self, timeout: float | None) -> None:
        what = "barrier"
        deadline = self._deadline(timeout)
        self._wait_mpi(self._world.Ibarrier(), deadline, what)

    # --- nonblocking forms --------------------------------------------------------------------
    def iallreduce(
        self,
        x: np.ndarray,
        op: Any = ReduceOp.SUM,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> MultiNodeRequest:
        return self._start("iallreduce", self._allreduce, x, op, out, timeout)

    def ireduce(
        self,
        x: np.ndarray,
        root: int = 0,
        op: Any = ReduceOp.SUM,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> MultiNodeRequest:
        return self._start("ireduce", self._reduce, x, root, op, out, timeout)

    def ibroadcast(
        self, x: np.ndarray, root: int = 0, *, out: Any = None, algorithm: str = "auto", timeout: float | None = None
    ) -> MultiNodeRequest:
        return self._start("ibroadcast", self._broadcast, x, root, out, timeout)

    def iallgather(
        self, x: np.ndarray, *, out: Any = None, algorithm: str = "auto", timeout: float | None = None
    ) -> MultiNodeRequest:
        return self._start("iallgather", self._allgather, x, out, timeout)

    def iallgatherv(
        self,
        x: np.ndarray,
        counts: Any = None,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> MultiNodeRequest:
        return self._start("iallgatherv", self._allgatherv, x, counts, out, timeout)

    def igather(
        self, x: np.ndarray, root: int = 0, *, out: Any = None, algorithm: str = "auto", timeout: float | None = None
    ) -> MultiNodeRequest:
        return self._start("igather", self._gatherv_any, x, None, root, out, timeout, "gather")

    def igatherv(
        self,
        x: np.ndarray,
        counts: Any = None,
        root: int = 0,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> MultiNodeRequest:
        return self._start("igatherv", self._gatherv_any, x, counts, root, out, timeout, "gatherv")

    def iscatter(
        self, x: Any, root: int = 0, *, out: Any = None, algorithm: str = "auto", timeout: float | None = None
    ) -> MultiNodeRequest:
        return self._start("iscatter", self._scatterv_any, x, None, root, out, timeout, "scatter")

    def iscatterv(
        self,
        x: Any,
        counts: Any = None,
        root: int = 0,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> MultiNodeRequest:
        return self._start("iscatterv", self._scatterv_any, x, counts, root, out, timeout, "scatterv")

    def ireduce_scatter(
        self,
        x: np.ndarray,
        op: Any = ReduceOp.SUM,
        counts: Any = None,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> MultiNodeRequest:
        return self._start("ireduce_scatter", self._reduce_scatter, x, op, counts, out, timeout)

    def ialltoall(
        self, x: np.ndarray, *, out: Any = None, algorithm: str = "auto", timeout: float | None = None
    ) -> MultiNodeRequest:
        return self._start("ialltoall", self._alltoall, x, out, timeout)

    def ialltoallv(
        self,
        x: np.ndarray,
        send_counts: Any,
        recv_counts: Any = None,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> MultiNodeRequest:
        return self._start("ialltoallv", self._alltoallv, x, send_counts, recv_counts, out, timeout)

    def iscan(
        self,
        x: np.ndarray,
        op: Any = ReduceOp.SUM,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> MultiNodeRequest:
        return self._start("iscan", self._scan, x, op, out, timeout, False)

    def iexscan(
        self,
        x: np.ndarray,
        op: Any = ReduceOp.SUM,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> MultiNodeRequest:
        return self._start("iexscan", self._scan, x, op, out, timeout, True)

    def ibarrier(self, *, timeout: float | None = None) -> MultiNodeRequest:
        return self._start("ibarrier", self._barrier, timeout)

    # --- point to point (over the world MPI communicator) -------------------------------------
    def send(self, x: np.ndarray, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send ``x`` to world rank ``dst`` (over MPI; completes when the receiver has it)."""
        self._do("send", self._send, x, dst, tag, timeout)

    def _send(self, x: np.ndarray, dst: int, tag: int, timeout: float | None) -> None:
        x = self._check_array(x)
        self._check_root(dst)
        deadline = self._deadline(timeout)
        self._wait_mpi(self._world.Issend([x.reshape(-1), self._mpi_type(x.dtype)], dst, tag), deadline, "send")

    def recv(
        self, buf: np.ndarray, src: int = ANY_SOURCE, tag: int = ANY_TAG, *, timeout: float | None = None
    ) -> Status:
        """Receive into ``buf`` a message from world rank ``src`` (or any) with ``tag`` (or any)."""
        return self._do("recv", self._recv, buf, src, tag, timeout)  # type: ignore[no-any-return]

    def _recv(self, buf: np.ndarray, src: int, tag: int, timeout: float | None) -> Status:
        MPI = self._MPI
        buf = self._check_array(buf, "buf")
        deadline = self._deadline(timeout)
        status = MPI.Status()
        t = self._mpi_type(buf.dtype)
        req = self._world.Irecv(
            [buf.reshape(-1), t],
            MPI.ANY_SOURCE if src == ANY_SOURCE else src,
            MPI.ANY_TAG if tag == ANY_TAG else tag,
        )
        self._wait_mpi(req, deadline, "recv", status)
        n = status.Get_count(t)
        return Status(source=status.Get_source(), tag=status.Get_tag(), count=n, nbytes=n * buf.dtype.itemsize)

    def isend(self, x: np.ndarray, dst: int, tag: int = 0, *, timeout: float | None = None) -> MultiNodeRequest:
        """Start sending ``x`` to world rank ``dst`` (posted to MPI now; ``wait`` polls it)."""
        self._check_usable()
        x = self._check_array(x)
        self._check_root(dst)
        deadline = self._deadline(timeout)
        req = self._world.Isend([x.reshape(-1), self._mpi_type(x.dtype)], dst, tag)
        return self._p2p_request("isend", req, deadline, lambda status: None)

    def irecv(
        self, buf: np.ndarray, src: int = ANY_SOURCE, tag: int = ANY_TAG, *, timeout: float | None = None
    ) -> MultiNodeRequest:
        """Start receiving into ``buf``; ``wait`` returns the :class:`~shmcoll.Status`."""
        self._check_usable()
        MPI = self._MPI
        buf = self._check_array(buf, "buf")
        deadline = self._deadline(timeout)
        t = self._mpi_type(buf.dtype)
        req = self._world.Irecv(
            [buf.reshape(-1), t], MPI.ANY_SOURCE if src == ANY_SOURCE else src, MPI.ANY_TAG if tag == ANY_TAG else tag
        )

        def status_of(status: Any) -> Status:
            n = status.Get_count(t)
            return Status(source=status.Get_source(), tag=status.Get_tag(), count=n, nbytes=n * buf.dtype.itemsize)

        return self._p2p_request("irecv", req, deadline, status_of)

    def _p2p_request(self, what: str, req: Any, deadline: float, result: Callable[[Any], Any]) -> MultiNodeRequest:
        """A request whose ``wait`` polls an MPI request (with the usual failure checks)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        lock = threading.Lock()

        def progress(block: bool) -> None:
            with lock:
                if future.done():
                    return
                status = self._MPI.Status()
                try:
                    if block:
                        self._wait_mpi(req, deadline, what, status)
                    elif not req.Test(status):
                        return
                    future.set_result(result(status))
                except BaseException as e:  # noqa: BLE001  (given to the waiter)
                    future.set_exception(e)

        return _P2PRequest(future, what, progress)

    def probe(self, src: int = ANY_SOURCE, tag: int = ANY_TAG, *, timeout: float | None = None) -> Status:
        """As :meth:`shmcoll.Communicator.probe`, over MPI (``Iprobe`` polled against the deadline).

        MPI does not carry the sender's dtype, so ``count`` is in bytes here (as ``nbytes``).
        """
        return self._do("probe", self._probe, src, tag, timeout)  # type: ignore[no-any-return]

    def _probe(self, src: int, tag: int, timeout: float | None) -> Status:
        deadline = self._deadline(timeout)
        next_check = time.monotonic() + _POLL_CHECK_S
        while True:
            found = self.iprobe(src, tag)
            if found is not None:
                return found
            time.sleep(5e-5)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _POLL_CHECK_S
                self._check_peers("probe")
                if now > deadline:
                    self._raise("timeout", f"probe timed out on {self._where()}: no matching message came", None)

    def iprobe(self, src: int = ANY_SOURCE, tag: int = ANY_TAG) -> Status | None:
        """:meth:`probe` without waiting: the message's :class:`~shmcoll.Status`, or ``None``."""
        self._check_usable()
        if src != ANY_SOURCE:
            self._check_root(src)
        MPI = self._MPI
        status = MPI.Status()
        source = MPI.ANY_SOURCE if src == ANY_SOURCE else src
        if not self._world.Iprobe(source, MPI.ANY_TAG if tag == ANY_TAG else tag, status):
            return None
        nbytes = status.Get_count(MPI.BYTE)
        return Status(source=status.Get_source(), tag=status.Get_tag(), count=nbytes, nbytes=nbytes)

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
        """As :meth:`shmcoll.Communicator.sendrecv`: send ``x`` to ``dst`` and receive into ``buf``
        from ``src`` at once (no deadlock in a ring of exchanges)."""
        r = self.irecv(buf, src, recvtag, timeout=timeout)
        s = self.isend(x, dst, sendtag, timeout=timeout)
        s.wait()
        return r.wait()  # type: ignore[no-any-return]

    def send_object(self, obj: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send a picklable object to world rank ``dst``."""
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        self.send(np.array([data.size], dtype=np.int64), dst, tag, timeout=timeout)
        self.send(data.copy(), dst, tag, timeout=timeout)

    def recv_object(self, src: int = ANY_SOURCE, tag: int = ANY_TAG, *, timeout: float | None = None) -> Any:
        """Receive an object sent with :meth:`send_object`."""
        n = np.empty(1, dtype=np.int64)
        st = self.recv(n, src, tag, timeout=timeout)
        data = np.empty(int(n[0]), dtype=np.uint8)
        self.recv(data, st.source, st.tag, timeout=timeout)
        return pickle.loads(data.tobytes())

    # --- object collectives -------------------------------------------------------------------
    @staticmethod
    def _pickled(obj: Any) -> np.ndarray:
        try:
            return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8).copy()
        except Exception as e:  # noqa: BLE001
            raise TypeError(f"cannot pickle {type(obj).__name__}: {e}") from e

    def broadcast_object(self, obj: Any, root: int = 0, *, timeout: float | None = None) -> Any:
        """Root's picklable ``obj`` on every rank."""
        data = self._pickled(obj) if self._rank == root else np.empty(0, np.uint8)
        n = np.array([data.size], dtype=np.int64)
        self.broadcast(n, root, timeout=timeout)
        if self._rank != root:
            data = np.empty(int(n[0]), dtype=np.uint8)
        self.broadcast(data, root, timeout=timeout)
        return obj if self._rank == root else pickle.loads(data.tobytes())

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """Every rank's picklable ``obj``, as a list indexed by rank, on every rank."""
        data = self._pickled(obj)
        sizes = self.allgather(np.array([data.size], dtype=np.int64), timeout=timeout).reshape(-1)
        flat = self.allgatherv(data, sizes, timeout=timeout)
        starts = np.concatenate(([0], np.cumsum(sizes)))
        return [pickle.loads(flat[starts[r] : starts[r + 1]].tobytes()) for r in range(self._world_size)]

    def gather_object(self, obj: Any, root: int = 0, *, timeout: float | None = None) -> list[Any] | None:
        """Every rank's picklable ``obj`` as a list on ``root``; ``None`` elsewhere."""
        data = self._pickled(obj)
        sizes = self.allgather(np.array([data.size], dtype=np.int64), timeout=timeout).reshape(-1)
        flat = self.gatherv(data, sizes, root, timeout=timeout)
        if flat is None:
            return None
        starts = np.concatenate(([0], np.cumsum(sizes)))
        return [pickle.loads(flat[starts[r] : starts[r + 1]].tobytes()) for r in range(self._world_size)]

    def scatter_object(self, objs: Sequence[Any] | None, root: int = 0, *, timeout: float | None = None) -> Any:
        """Element ``j`` of root's sequence ``objs`` to rank ``j``."""
        if self._rank == root:
            if objs is None or len(objs) != self._world_size:
                raise ValueError(f"scatter_object: the root needs {self._world_size} objects")
            parts = [self._pickled(o) for o in objs]
            sizes = np.array([p.size for p in parts], dtype=np.int64)
            flat: np.ndarray | None = np.concatenate(parts)
        else:
            sizes = np.empty(self._world_size, dtype=np.int64)
            flat = None
        self.broadcast(sizes, root, timeout=timeout)
        mine = np.empty(int(sizes[self._rank]), dtype=np.uint8)
        self.scatterv(flat, sizes, root, out=mine, timeout=timeout)
        return pickle.loads(mine.tobytes())

    def alltoall_object(self, objs: Sequence[Any], *, timeout: float | None = None) -> list[Any]:
        """Element ``j`` of this rank's ``objs`` to rank ``j``; returns what each rank sent here."""
        if len(objs) != self._world_size:
            raise ValueError(f"alltoall_object: needs {self._world_size} objects")
        parts = [self._pickled(o) for o in objs]
        sc = np.array([p.size for p in parts], dtype=np.int64)
        got = self.alltoallv(np.concatenate(parts), sc, timeout=timeout)
        rc = self.alltoall(sc.reshape(-1, 1), timeout=timeout).reshape(-1)
        starts = np.concatenate(([0], np.cumsum(rc)))
        return [pickle.loads(got[starts[r] : starts[r + 1]].tobytes()) for r in range(self._world_size)]

    def allreduce_object(self, obj: Any, op: Any = ReduceOp.SUM, *, timeout: float | None = None) -> Any:
        """Every rank's ``obj`` combined with ``op`` left to right in rank order, on every rank."""
        return _fold(self.allgather_object(obj, timeout=timeout), op, self._world_size)

    def reduce_object(self, obj: Any, op: Any = ReduceOp.SUM, root: int = 0, *, timeout: float | None = None) -> Any:
        """:meth:`allreduce_object` onto ``root``."""
        objs = self.gather_object(obj, root, timeout=timeout)
        return None if objs is None else _fold(objs, op, self._world_size)

    # --- sub-communicators --------------------------------------------------------------------
    def split(self, color: int | None, key: int | None = None, *, timeout: float | None = None) -> Any:
        """New communicators, one per ``color``, ranked by ``(key, rank)``; each keeps this
        communicator's nodes (a plain :class:`~shmcoll.Communicator` if its ranks sit on one node)."""
        if color is not None and (isinstance(color, bool) or not isinstance(color, int) or color < 0):
            raise ValueError(f"color must be an int >= 0 or None, got {color!r}")
        self.allgather_object((color, key), timeout=timeout)  # everyone is here and alive
        MPI = self._MPI
        sub = self._world.Split(MPI.UNDEFINED if color is None else color, self._rank if key is None else key)
        if color is None:
            return None
        return build(sub, self._node_index, self._factory, timeout if timeout is not None else self._timeout)

    # --- lifetime -----------------------------------------------------------------------------
    def abort(self, reason: str = "", *, cause: BaseException | None = None) -> None:
        """Make every rank's pending and future calls fail (every node's)."""
        if self._closed or self._broken:
            return
        text = f"{self._where()} called abort()" + (f": {reason}" if reason else "")
        if cause is not None:
            text = f"{self._where()} failed: {type(cause).__name__}: {cause}"
        self._send_notices("broken", text, None)
        self._broken = text
        self._abort_node(text, "broken", None)

    def close(self) -> None:
        """Leave the communicator; idempotent."""
        if self._closed:
            return
        if self._executor is not None:
            self._executor.shutdown(wait=not self._broken)
        if not self._broken:
            try:
                self._node.barrier(timeout=min(self._timeout, 10.0))
            except ShmcollError:
                pass
        self._closed = True
        self._node.close()
        self._node_closer()
        # let the abort notices leave before the process may exit (1 s at most)
        end = time.monotonic() + 1.0
        pending = list(self._notice_sends)
        while pending and time.monotonic() < end:
            still = []
            for req in pending:
                try:
                    if not req.Test():
                        still.append(req)
                except Exception:  # noqa: BLE001  (a rank that is gone)
                    pass
            pending = still
            time.sleep(0.005)

    def __enter__(self) -> MultiNodeCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def alloc(self, *args: Any, **kw: Any) -> Any:
        raise UnsupportedError("alloc (zero-copy shared arrays) is for one node: use comm.node.alloc")


def _persistent_form(name: str) -> Callable[..., Persistent]:
    def init(self: MultiNodeCommunicator, *args: Any, **kw: Any) -> Persistent:
        begin = getattr(self, "i" + name)
        return Persistent(lambda: begin(*args, **kw), name)

    init.__name__ = init.__qualname__ = f"{name}_init"
    init.__doc__ = (
        f"As :meth:`shmcoll.Communicator.{name}_init`: a :class:`shmcoll.Persistent` whose ``start()`` "
        f"runs :meth:`i{name}` with these arguments again (checked at each start: over MPI there is "
        "no plan to keep)."
    )
    return init


_PERSISTENT = (
    "allreduce",
    "reduce",
    "broadcast",
    "allgather",
    "allgatherv",
    "gather",
    "gatherv",
    "scatter",
    "scatterv",
    "reduce_scatter",
    "alltoall",
    "alltoallv",
    "scan",
    "exscan",
    "barrier",
)
for _name in _PERSISTENT:
    setattr(MultiNodeCommunicator, f"{_name}_init", _persistent_form(_name))


def _fold(objs: list[Any], op: Any, n: int) -> Any:
    if callable(op) and not isinstance(op, (ReduceOp, int, str)):
        acc = objs[0]
        for o in objs[1:]:
            acc = op(acc, o)
        return acc
    rop = arrays.as_op(op)
    fns: dict[ReduceOp, Callable[[Any, Any], Any]] = {
        ReduceOp.SUM: lambda a, b: a + b,
        ReduceOp.AVG: lambda a, b: a + b,
        ReduceOp.PROD: lambda a, b: a * b,
        ReduceOp.MIN: min,
        ReduceOp.MAX: max,
        ReduceOp.BAND: lambda a, b: a & b,
        ReduceOp.BOR: lambda a, b: a | b,
        ReduceOp.BXOR: lambda a, b: a ^ b,
    }
    acc = objs[0]
    for o in objs[1:]:
        acc = fns[rop](acc, o)
    return acc / n if rop == ReduceOp.AVG else acc


def build(comm: Any, node_key: Any, factory: NodeFactory, timeout: float | None) -> Any:
    """The communicator of MPI communicator ``comm``'s ranks, grouped into nodes by ``node_key``
    (any picklable value; ranks with equal keys form a node, and must share memory): a plain
    :class:`~shmcoll.Communicator` when there is one node, else a :class:`MultiNodeCommunicator`.
    Collective over ``comm``."""
    from mpi4py import MPI

    world = comm.Dup()
    world.Set_errhandler(MPI.ERRORS_RETURN)
    keys = world.allgather(node_key)
    layout = Layout(keys)
    rank = world.Get_rank()
    node_mpi = world.Split(int(layout.node_of[rank]), rank)
    node, closer = factory(node_mpi, timeout)
    if layout.nnodes == 1:
        return _SingleNode.wrap(node, closer)
    return MultiNodeCommunicator(world, layout, node, node_mpi, closer, factory, timeout)


class _SingleNode:
    """Closing a one-node communicator also closes the group its node leader owns."""

    @staticmethod
    def wrap(node: Communicator, closer: Callable[[], None]) -> Communicator:
        close = node.close

        def close_all() -> None:
            close()
            closer()

        node.close = close_all  # type: ignore[method-assign]
        return node
