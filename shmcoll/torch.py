"""shmcoll as a ``torch.distributed`` backend: ``import shmcoll.torch``, then
``dist.init_process_group(backend="shmcoll")``.

Importing this module registers the backend ``"shmcoll"`` for CPU tensors. Each process group
(the default one, and every ``new_group``) is one shmcoll job: the group's rank 0 creates it and
publishes its handle in the group's torch store, the other ranks read the handle there and
connect, so whatever rendezvous the user gives torch (torchrun's environment, an
``init_method``, a ``store``) is the one shmcoll uses. ``timeout=`` given to
``init_process_group`` is each collective's timeout.

Every call starts the matching nonblocking shmcoll operation and returns a :class:`Work` at once:
its ``wait()`` carries the operation to its end in the caller's thread if nothing has started it,
and its future is completed by the communicator's progress thread, so DDP's bucketed gradient
allreduce runs while the backward pass goes on. The forms torch passes as lists of tensors
(``all_gather`` into a list, ``scatter``/``gather``/``all_to_all`` lists) run on one staging
tensor and are copied to or from the list; the single-tensor forms run on the caller's memory.

A failure (a dead peer, a timeout, a mismatched call) raises ``torch.distributed.DistBackendError``
on every rank, carrying shmcoll's own message.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from shmcoll.comm.p2p import ANY_SOURCE
from shmcoll.comm.requests import Queue, Request
from shmcoll.errors import ShmcollError
from shmcoll.launch import Group
from shmcoll.types import ReduceOp

__all__ = ["BACKEND", "ProcessGroupShmcoll", "Work"]

BACKEND = "shmcoll"
_HANDLE_KEY = "shmcoll/handle"

_OPS = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.PRODUCT: ReduceOp.PROD,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.AVG: ReduceOp.AVG,
    dist.ReduceOp.BAND: ReduceOp.BAND,
    dist.ReduceOp.BOR: ReduceOp.BOR,
    dist.ReduceOp.BXOR: ReduceOp.BXOR,
}


_SUM = dist.ReduceOp.SUM


def _op(reduce_op: Any) -> ReduceOp:
    """shmcoll's op for torch's ``ReduceOp`` (SUM first: comparing costs 0.1 us, hashing 0.3;
    SUM before the loop: 0.38 -> 0.15 us a call)."""
    if reduce_op == _SUM:
        return ReduceOp.SUM
    for theirs, ours in _OPS.items():
        if reduce_op == theirs:
            return ours
    raise ValueError(f"the shmcoll backend has no {reduce_op} (it has {', '.join(o.name for o in _OPS)})")


def _backend_error(exc: BaseException) -> BaseException:
    """shmcoll's error as torch's: ``DistBackendError`` (a RuntimeError) with shmcoll's message."""
    if isinstance(exc, ShmcollError):
        err = dist.DistBackendError(f"shmcoll: {exc}")
        err.__cause__ = exc
        return err
    return exc


class Work(dist.Work):
    """The started operations of one torch call, and what to do once they have completed.

    ``finish`` (copies from a staging tensor into the caller's list) runs exactly once, on the
    thread that sees the last operation complete; ``result`` is the future's value (the
    tensors the call wrote, as torch's own backends give them).
    """

    # (slots: making one took 0.71 us with attributes in a dict, 0.52 so; torch's bare Work 0.24)
    __slots__ = ("_requests", "_result", "_finish", "_lock", "_finished", "_error", "_future")

    def __init__(self, requests: Sequence[Request], result: Any, finish: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._requests = requests
        self._result = result
        self._finish = finish
        self._lock = threading.Lock()
        self._finished = False
        self._error: BaseException | None = None
        self._future: Future[Any] | None = None

    def _complete(self) -> None:
        """Run ``finish`` once every request is done (any thread); sets the future."""
        with self._lock:
            if self._finished:
                return
            for r in self._requests:  # (not all() over a generator: 0.2 us more a call)
                if not r.done:
                    return
            self._finished = True
            try:
                for r in self._requests:
                    r.test()  # raises the operation's error
                if self._finish is not None:
                    self._finish()
            except BaseException as exc:  # noqa: BLE001  (handed to wait() and the future)
                self._error = _backend_error(exc)
            future = self._future
        if future is not None:
            if self._error is not None:
                future.set_exception(self._error)
            else:
                future.set_result(self._result)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Carry the operations to their end (in this thread if none has started them)."""
        seconds = None if not timeout else timeout.total_seconds()
        try:
            for r in self._requests:
                r.wait(seconds)
        except TimeoutError as exc:
            raise dist.DistBackendError(f"shmcoll: {exc}") from None
        except ShmcollError:
            pass  # the failed request holds it: raised below, as torch's error, once all are done
        if not self._finished:  # (completed already by a callback, or an earlier wait)
            self._complete()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return all(r.done for r in self._requests)

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> Future[Any]:
        """A future completed with the written tensors once the operations complete."""
        with self._lock:
            if self._future is None:
                self._future = Future()
                if self._finished:
                    if self._error is not None:
                        self._future.set_exception(self._error)
                    else:
                        self._future.set_result(self._result)
                    return self._future
            else:
                return self._future
        if all(isinstance(r._queue, Queue) for r in self._requests):
            for r in self._requests:
                r._on_done(lambda _r: self._complete())
        else:  # point-to-point requests have no callbacks: a thread waits for them
            threading.Thread(target=self._wait_quietly, daemon=True, name="shmcoll-torch-p2p-future").start()
        return self._future

    def _wait_quietly(self) -> None:
        try:
            self.wait()
        except BaseException:  # noqa: BLE001  (the future carries it)
            pass


def _one(tensors: Sequence[Any], what: str) -> Any:
    if len(tensors) != 1:
        raise ValueError(f"the shmcoll backend takes one tensor per process in {what}, got {len(tensors)}")
    return tensors[0]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t


class ProcessGroupShmcoll(dist.ProcessGroup):
    """A ``torch.distributed`` process group whose collectives run on one shmcoll communicator."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        seconds = timeout.total_seconds() if timeout else None
        self._group: Group | None = None
        if rank == 0:
            self._group = Group(size, timeout=seconds)
            store.set(_HANDLE_KEY, self._group.handle.encode())
            handle = self._group.handle.encode()
        else:
            handle = store.get(_HANDLE_KEY).decode()
        self.comm: Any = Group.from_handle(handle, timeout=seconds).connect(rank)

    # --- what torch asks of every backend ------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802  (torch's name)
        return BACKEND

    @property
    def _backend_name(self) -> str:
        return BACKEND

    # torch names a group after creating it (``_set_group_name``) and keeps the name on the
    # group's C++ backends; a Python process group has none, so ``group_name`` would raise
    # "ProcessGroup name not set" where DeviceMesh (FSDP2's ``fully_shard``) asks for it.
    def _set_group_name(self, name: str) -> None:
        self._shmcoll_name = name

    @property
    def group_name(self) -> str:
        return getattr(self, "_shmcoll_name", "")

    def _set_group_desc(self, desc: str) -> None:
        self._shmcoll_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_shmcoll_desc", "")

    def shutdown(self) -> None:
        """Leave the communicator; the group's rank 0 also removes the job's shared memory."""
        self.comm.close()
        if self._group is not None:
            self._group.close()
            self._group = None

    def abort(self) -> None:
        self.shutdown()

    # --- collectives ---------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        t = _one(tensors, "all_reduce")
        op = _op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        return Work([self.comm.iallreduce(t, op, out=t)], [t])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        op = _op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        return Work([self.comm.iallreduce(t, op, out=t) for t in tensors], list(tensors))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        t = _one(tensors, "broadcast")
        return Work([self.comm.ibroadcast(t, opts.rootRank, out=t)], [t])

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        t = _one(tensors, "reduce")
        root = opts.rootRank
        out = t if self.rank() == root else None
        return Work([self.comm.ireduce(t, root, _op(opts.reduceOp), out=out)], [t])

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> Work:
        t = _one(input_tensors, "all_gather")
        outs = _one(output_tensors, "all_gather")
        staging = torch.empty((self.size(), t.numel()), dtype=t.dtype)

        def finish() -> None:
            for o, row in zip(outs, staging, strict=True):
                o.copy_(row.view(o.shape))

        return Work([self.comm.iallgather(_flat(t), out=staging)], outs, finish)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:  # noqa: A002
        return Work([self.comm.iallgather(_flat(input), out=output.view(self.size(), -1))], [output])

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        reqs = [
            self.comm.iallgather(_flat(i), out=o.view(self.size(), -1)) for o, i in zip(outputs, inputs, strict=True)
        ]
        return Work(reqs, list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any) -> Work:
        t = _one(input_tensors, "gather")
        root = opts.rootRank
        if self.rank() != root:
            return Work([self.comm.igather(_flat(t), root)], [])
        outs = _one(output_tensors, "gather")
        staging = torch.empty((self.size(), t.numel()), dtype=t.dtype)

        def finish() -> None:
            for o, row in zip(outs, staging, strict=True):
                o.copy_(row.view(o.shape))

        return Work([self.comm.igather(_flat(t), root, out=staging)], outs, finish)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any) -> Work:
        t = _one(output_tensors, "scatter")
        root = opts.rootRank
        staging = None
        if self.rank() == root:
            ins = _one(input_tensors, "scatter")
            staging = torch.stack([i.reshape(-1) for i in ins]) if ins else None
        return Work([self.comm.iscatter(staging, root, out=_flat(t))], [t])

    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any
    ) -> Work:
        t = _one(output_tensors, "reduce_scatter")
        ins = _one(input_tensors, "reduce_scatter")
        staging = torch.cat([i.reshape(-1) for i in ins])
        return Work([self.comm.ireduce_scatter(staging, _op(opts.reduceOp), out=_flat(t))], [t])

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Work:  # noqa: A002
        req = self.comm.ireduce_scatter(_flat(input), _op(opts.reduceOp), out=_flat(output))
        return Work([req], [output])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> Work:
        op = _op(opts.reduceOp)
        reqs = [self.comm.ireduce_scatter(_flat(i), op, out=_flat(o)) for o, i in zip(outputs, inputs, strict=True)]
        return Work(reqs, list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Work:
        n = self.size()
        if not output_split_sizes and not input_split_sizes:
            return Work([self.comm.ialltoall(input.view(n, -1), out=output.view(n, -1))], [output])
        row_in = input[0].numel() if input.dim() and input.shape[0] else 0
        row_out = output[0].numel() if output.dim() and output.shape[0] else 0
        sends = [s * row_in for s in input_split_sizes] if input_split_sizes else [input.numel() // n] * n
        recvs = [s * row_out for s in output_split_sizes] if output_split_sizes else [output.numel() // n] * n
        return Work([self.comm.ialltoallv(_flat(input), sends, recvs, out=_flat(output))], [output])

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None) -> Work:
        sends = [t.numel() for t in input_tensors]
        recvs = [t.numel() for t in output_tensors]
        dtype = input_tensors[0].dtype if input_tensors else output_tensors[0].dtype
        staging_in = torch.cat([t.reshape(-1) for t in input_tensors]) if input_tensors else torch.empty(0, dtype=dtype)
        staging_out = torch.empty(sum(recvs), dtype=dtype)

        def finish() -> None:
            offset = 0
            for o, c in zip(output_tensors, recvs, strict=True):
                o.copy_(staging_out[offset : offset + c].view(o.shape))
                offset += c

        req = self.comm.ialltoallv(staging_in, sends, recvs, out=staging_out)
        return Work([req], list(output_tensors), finish)

    def barrier(self, opts: Any = None) -> Work:
        return Work([self.comm.ibarrier()], [])

    # --- point to point ----------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work:
        t = _one(tensors, "send")
        return Work([self.comm.isend(_flat(t), dst, tag)], [t])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work:
        t = _one(tensors, "recv")
        return Work([self.comm.irecv(_flat(t), src, tag)], [t])

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        t = _one(tensors, "recv")
        return Work([self.comm.irecv(_flat(t), ANY_SOURCE, tag)], [t])


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> ProcessGroupShmcoll:
    _STARTED[0] = True
    return ProcessGroupShmcoll(store, rank, size, timeout)


# --- exit -----------------------------------------------------------------------------------------
# torch's own threads may still need the GIL when the script has ended: a gloo worker thread drops
# its last reference to a finished work object a moment after the caller's ``wait()`` returned,
# and a work object's tensors are Python tensors whose last C++ reference but one takes the GIL
# to decref the Python object (``TensorImpl::decref_pyobject``). A thread that asks for the GIL
# once the interpreter finalizes is ended with ``pthread_exit``; inside that C++ destructor the
# unwinding calls ``std::terminate`` ("terminate called without an active exception", SIGABRT).
# gloo's own teardown happened to give its workers time; shmcoll's fast one did not (about one job
# in 10 under load). So at exit, before finalization, this process waits until the threads Python
# did not start are idle, handing them the GIL meanwhile.
_QUIESCE_S = 2.0  # the longest wait at exit (a native thread that never idles)
_QUIESCE_POLL_S = 0.001


def _native_thread_busy() -> bool:
    """Whether a thread of this process that Python did not start (torch's, gloo's) is running or
    runnable now; False where ``/proc`` cannot tell."""
    # (a _DummyThread is a native thread that called into Python: it is one of them)
    python = {t.native_id for t in threading.enumerate() if not isinstance(t, threading._DummyThread)}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tids:
        if not tid.isdigit() or int(tid) in python:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # it has just ended
        state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]  # (the name may hold spaces and parentheses)
        if state == b"R":
            return True
    return False


def _quiesce_native_threads(limit_s: float = _QUIESCE_S) -> bool:
    """Wait until no native thread has run for two GIL switch intervals (a thread waiting for the
    GIL sleeps, but asks for it within one interval and gets it: this thread sleeps or runs
    bytecode meanwhile). Returns whether they went quiet within ``limit_s``."""
    window = 2 * sys.getswitchinterval()
    now = time.monotonic()
    deadline = now + limit_s
    quiet_since: float | None = None
    while now < deadline:
        if _native_thread_busy():
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= window:
            return True
        time.sleep(_QUIESCE_POLL_S)
        now = time.monotonic()
    return False


_STARTED = [False]  # a shmcoll process group was created in this process (destroyed or not)


def _at_exit() -> None:
    """(atexit, before the interpreter finalizes) If torch.distributed ran here, let its threads
    finish what they hold."""
    if _STARTED[0] or dist.is_initialized():
        _quiesce_native_threads()


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
atexit.register(_at_exit)
