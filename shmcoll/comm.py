"""The Communicator: the API users call, and the only place status codes become exceptions.

A call goes: check the arguments at the boundary (cheap checks on every call; the expensive
ones, dtype/op/root/algorithm, once per call shape, when its plan is built and cached), look up
the encoded plan by a cached key, run the jitted engine, and return. Only when the engine
reports something other than OK does Python do more: resume after a time slice (checking the
deadline and the peers' liveness meanwhile), or raise with the rank, the peer, the collective,
its sequence number and the step in the message. Any error between ranks breaks the
communicator and raises the arena's abort word, so the other ranks stop within milliseconds
instead of waiting for their own timeouts.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import psutil

from shmcoll import collectives, config, topology
from shmcoll.algos import registry
from shmcoll.algos.registry import ALGORITHM_NAMES, Query
from shmcoll.algos.select import choose
from shmcoll.collectives import KIND_CODE
from shmcoll.engine import cpu as engine
from shmcoll.errors import (
    CollectiveMismatchError,
    CollectiveTimeout,
    CommunicatorBrokenError,
    ConcurrentCallError,
    ForkedCommunicatorError,
    PeerLostError,
    ShmcollError,
    UnsupportedError,
)
from shmcoll.plan import ir
from shmcoll.plan.passes import plan_call
from shmcoll.plan.verify import verify
from shmcoll.shm import layout as L
from shmcoll.shm.arena import Arena, ArenaHandle, proc_stat
from shmcoll.shm.atomics import atomic_cas, write_word
from shmcoll.shm.registered import Allocation, SharedArray, region_bytes
from shmcoll.shm.segment import Segment, segment_name
from shmcoll.types import (
    BOOL,
    DTYPE_CODE,
    FLOAT16,
    FLOAT32,
    ReduceOp,
    engine_types,
    supports,
    valid_ops,
)

log = logging.getLogger("shmcoll")
TRACE = 5
logging.addLevelName(TRACE, "TRACE")

_SLEEP_NS = 5_000_000  # longest single futex sleep: bounds how late an abort is noticed
_SLICE_NS = 100_000_000  # how long the engine waits before Python checks deadline and peers
_UINT16 = np.dtype(np.uint16)
_UINT8 = np.dtype(np.uint8)
_P2P_KIND = KIND_CODE["p2p"]
_NOT_ZERO_COPY = frozenset({"scatter", "send", "recv"})
_ALLOCATIONS = itertools.count()  # segment names of alloc() calls, unique in this process
_MAX_CACHED_CALLS = 512  # plans kept per communicator
_ABORT_REASONS = {
    L.ABORT_USER: "abort() was called",
    L.ABORT_TIMEOUT: "a collective timed out",
    L.ABORT_PEER_LOST: "a peer process died",
    L.ABORT_MISMATCH: "ranks called mismatched collectives",
    L.ABORT_ERROR: "failed (an error on that rank, in its own code or its device work)",
}


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


def _as_op(op: ReduceOp | int | str) -> ReduceOp:
    if isinstance(op, str):
        try:
            return ReduceOp[op.upper()]
        except KeyError:
            raise ValueError(f"unknown reduction op {op!r}; one of {[o.name for o in ReduceOp]}") from None
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(f"unknown reduction op {op!r}; one of {[o.name for o in ReduceOp]}") from None


def _not_array(name: str, value: object) -> TypeError:
    return TypeError(f"{name} must be a numpy.ndarray, got {type(value).__name__}")


class _Placement:
    """Where a zero-copy call's buffers sit: allocations and byte offsets in this rank's region."""

    __slots__ = ("a_in", "shift_in", "a_out", "shift_out", "tag")

    def __init__(
        self, a_in: Allocation, shift_in: int, a_out: Allocation | None, shift_out: int, out_read: bool
    ) -> None:
        self.a_in, self.shift_in, self.a_out, self.shift_out = a_in, shift_in, a_out, shift_out
        # Every message of the call carries this tag of where the buffers that *peers read* sit
        # (the output too, where peers read it: allreduce); a peer whose sit elsewhere mismatches.
        tag = (a_in.ident & 0xFFFF, shift_in)
        if out_read:
            tag += (a_in.ident & 0xFFFF, shift_in) if a_out is None else (a_out.ident & 0xFFFF, shift_out)
        self.tag = hash(tag) & 0x7FFF_FFFF_FFFF_FFFF


# Every connected communicator of this process, so that a fork can disable them in the child.
_CONNECTED: weakref.WeakSet[Communicator] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for comm in list(_CONNECTED):
        comm._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Call:
    """Everything the hot path needs for one call shape, built once and cached.

    The encoded program is kept three times, one per way the engine may enter it (``ir.ENTRY_*``):
    ``prog`` starts a call, ``prog_nested`` starts one inside a call made of several (which
    holds the communicator), and ``prog_resume`` continues a started call; only the thread that
    started a call ever uses the last one.
    """

    __slots__ = (
        "prog",
        "prog_resume",
        "prog_nested",
        "edt",
        "data",
        "tmp",
        "f16",
        "sig",
        "kind",
        "label",
        "dummy",
        "count",
        "registered",
    )

    def __init__(
        self,
        prog: np.ndarray,
        edt: np.dtype,
        data: np.ndarray,
        tmp: np.ndarray,
        f16: bool,
        sig: int,
        kind: str,
        label: str,
        count: int,
    ) -> None:
        self.prog = prog
        self.prog_resume = ir.with_entry(prog, ir.ENTRY_RESUME)
        self.prog_nested = ir.with_entry(prog, ir.ENTRY_NESTED)
        self.edt = edt
        self.data = data
        self.tmp = tmp
        self.f16 = f16
        self.sig = sig
        self.kind = kind
        self.label = label
        self.dummy = np.empty(0, dtype=edt)
        self.count = count
        self.registered = False


class Communicator:
    """A group of ranks that run collectives together; create one with :func:`shmcoll.spawn`,
    :meth:`shmcoll.Group.connect` or :func:`shmcoll.init`.

    Every method is collective over the communicator's ranks (except :meth:`send` and
    :meth:`recv`), takes ``algorithm=`` (``"auto"`` or a registered name) and ``timeout=``
    (seconds, ``inf`` for no limit; default: the communicator's, ``SHMCOLL_TIMEOUT``), and works
    on C-contiguous numpy arrays of any shape, treated as flat. Results are bitwise identical on
    every rank.

    **Threads and processes.** Calls on one communicator must not overlap: a call made while
    another thread (or a signal handler) is in one raises :class:`ConcurrentCallError` at once,
    before it does anything. A communicator belongs to the process that connected it: in a
    forked child every call (and ``close``) raises :class:`ForkedCommunicatorError` and leaves the
    shared state alone.
    """

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
        cores = len(os.sched_getaffinity(0))
        oversubscribed = self._world_size > cores
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
        self._calls: dict[tuple[Any, ...], _Call] = {}
        self._auto_registered_choice: dict[tuple[Any, ...], str] = {}  # per call shape, like _calls
        # Allocations live as long as some array views them (each SharedArray holds its own):
        # dropping the arrays releases the memory, with no collective call needed.
        self._allocations: weakref.WeakSet[Allocation] = weakref.WeakSet()
        self._registration: _Placement | None = None  # set only for the duration of a zero-copy call
        self._allocation_ids = itertools.count()  # the same on every rank: alloc is collective
        self._scratch: dict[tuple[str, np.dtype], np.ndarray] = {}
        self._broken: str | None = None
        self._closed = False
        self._verify = os.environ.get("SHMCOLL_VERIFY", "") == "1"
        self._groups: int | None = None
        self._groups_agreed = False
        self._mem_total = psutil.virtual_memory().total
        self._log = _RankPrefix(log, {"rank": rank})
        self._trace = log.isEnabledFor(TRACE)
        arena.register(rank)
        _CONNECTED.add(self)
        self._log.info(
            "connected: world_size=%d, %d slots of %d bytes per ring, timeout %.1fs",
            self._world_size,
            arena.layout.nslots,
            arena.layout.slot_bytes,
            self._timeout,
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
        return self._arena.handle

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "ok")
        return f"<shmcoll.Communicator rank {self._rank} of {self._world_size} ({state})>"

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
        """Combine ``x`` element-wise across ranks; every rank gets the result.

        In place (the result overwrites ``x``) unless ``out`` is given. Returns the result.
        """
        if type(x) is not np.ndarray:
            return self._foreign("allreduce", x, op=op, out=out, algorithm=algorithm, timeout=timeout)  # type: ignore[no-any-return]
        inplace = out is None or out is x
        key = ("allreduce", x.dtype, x.size, op, algorithm, inplace)
        call = self._calls.get(key)
        if call is None:
            call = self._prepare(key, "allreduce", x.dtype, x.size, op=op, algorithm=algorithm, inplace=inplace)
        if inplace:
            self._check_written(x, "x")
            out = x
        else:
            self._check_read(x, "x")
            self._check_out(out, x.shape, x.dtype)
            self._check_disjoint(x, out)
        self._run(call, x, out, timeout)
        return out  # type: ignore[return-value]

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
        """Combine ``x`` element-wise across ranks onto ``root``.

        Returns the result on ``root`` (in ``out`` if given, else a new array; ``out=x`` reduces
        in place) and ``None`` elsewhere.
        """
        if type(x) is not np.ndarray:
            return self._foreign("reduce", x, root=root, op=op, out=out, algorithm=algorithm, timeout=timeout)  # type: ignore[no-any-return]
        self._check_read(x, "x")
        at_root = self._rank == root
        inplace = at_root and out is x
        key = ("reduce", x.dtype, x.size, op, algorithm, inplace, root)
        call = self._calls.get(key)
        if call is None:
            call = self._prepare(key, "reduce", x.dtype, x.size, op=op, algorithm=algorithm, inplace=inplace, root=root)
        if at_root:
            if out is None:
                out = np.empty_like(x)
            elif not inplace:
                self._check_out(out, x.shape, x.dtype)
                self._check_disjoint(x, out)
            else:
                self._check_written(x, "x")
            self._run(call, x, out, timeout)
            return out
        self._run(call, x, None, timeout)
        return None

    def broadcast(
        self,
        x: np.ndarray,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Copy root's ``x`` to every rank: in place in ``x`` (or into ``out``). Returns it."""
        if type(x) is not np.ndarray:
            return self._foreign("broadcast", x, root=root, out=out, algorithm=algorithm, timeout=timeout)  # type: ignore[no-any-return]
        inplace = out is None or out is x
        key = ("broadcast", x.dtype, x.size, None, algorithm, inplace, root)
        call = self._calls.get(key)
        if call is None:
            call = self._prepare(key, "broadcast", x.dtype, x.size, algorithm=algorithm, inplace=inplace, root=root)
        if inplace:
            out = x
            if self._rank == root:
                self._check_read(x, "x")
            else:
                self._check_written(x, "x")
        else:
            self._check_read(x, "x")
            self._check_out(out, x.shape, x.dtype)
            self._check_disjoint(x, out)
        self._run(call, x, out, timeout)
        return out  # type: ignore[return-value]

    def allgather(
        self, x: np.ndarray, *, out: np.ndarray | None = None, algorithm: str = "auto", timeout: float | None = None
    ) -> np.ndarray:
        """Every rank's ``x``, stacked: shape ``(world_size, *x.shape)`` on every rank.

        ``x`` may be ``out[rank]`` itself (in place).
        """
        if type(x) is not np.ndarray:
            return self._foreign("allgather", x, out=out, algorithm=algorithm, timeout=timeout)  # type: ignore[no-any-return]
        self._check_read(x, "x")
        shape = (self._world_size, *x.shape)
        if out is None:
            out = self._new_output("allgather", shape, x.dtype)
            inplace = False
        else:
            self._check_out(out, shape, x.dtype)
            inplace = self._is_block_of(x, out, self._rank)
        key = ("allgather", x.dtype, x.size, None, algorithm, inplace)
        call = self._calls.get(key)
        if call is None:
            call = self._prepare(key, "allgather", x.dtype, x.size, algorithm=algorithm, inplace=inplace)
        self._run(call, x, out, timeout)
        return out

    def gather(
        self,
        x: np.ndarray,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray | None:
        """Every rank's ``x`` stacked on ``root`` (shape ``(world_size, *x.shape)``); ``None``
        elsewhere."""
        if type(x) is not np.ndarray:
            return self._foreign("gather", x, root=root, out=out, algorithm=algorithm, timeout=timeout)  # type: ignore[no-any-return]
        self._check_read(x, "x")
        at_root = self._rank == root
        inplace = False
        if at_root:
            shape = (self._world_size, *x.shape)
            if out is None:
                out = self._new_output("gather", shape, x.dtype)
            else:
                self._check_out(out, shape, x.dtype)
                inplace = self._is_block_of(x, out, root)
        key = ("gather", x.dtype, x.size, None, algorithm, inplace, root)
        call = self._calls.get(key)
        if call is None:
            call = self._prepare(key, "gather", x.dtype, x.size, algorithm=algorithm, inplace=inplace, root=root)
        self._run(call, x, out if at_root else None, timeout)
        return out if at_root else None

    def scatter(
        self,
        x: np.ndarray | None,
        root: int = 0,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Block ``j`` of root's ``x`` (shape ``(world_size, *shape)``) to rank ``j``.

        Non-root ranks pass ``x=None`` and must give ``out`` (it fixes the shape and dtype);
        the root may omit it. Returns ``out``.
        """
        at_root = self._rank == root
        inplace = False
        if at_root:
            if type(x) is not np.ndarray:
                return self._foreign("scatter", x, root=root, out=out, algorithm=algorithm, timeout=timeout)  # type: ignore[no-any-return]
            self._check_read(x, "x")
            if x.ndim == 0 or x.shape[0] != self._world_size:
                raise ValueError(
                    f"scatter: root's x must have shape (world_size={self._world_size}, ...), got {x.shape}"
                )
            if out is None:
                out = np.empty(x.shape[1:], dtype=x.dtype)
            else:
                self._check_out(out, x.shape[1:], x.dtype)
                inplace = self._is_block_of(out, x, root)
            dtype, count = x.dtype, out.size
        else:
            if out is None:
                raise ValueError("scatter: non-root ranks must pass out= (it gives the shape and dtype)")
            if type(out) is not np.ndarray:
                return self._foreign("scatter", x, root=root, out=out, algorithm=algorithm, timeout=timeout)  # type: ignore[no-any-return]
            self._check_written(out, "out")
            dtype, count = out.dtype, out.size
        key = ("scatter", dtype, count, None, algorithm, inplace, root)
        call = self._calls.get(key)
        if call is None:
            call = self._prepare(key, "scatter", dtype, count, algorithm=algorithm, inplace=inplace, root=root)
        self._run(call, x if at_root else None, out, timeout)
        return out

    def reduce_scatter(
        self,
        x: np.ndarray,
        op: ReduceOp | int | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Combine ``x`` across ranks and give rank ``j`` block ``j`` of the result.

        ``x.shape[0]`` must be divisible by ``world_size``; the result has shape
        ``(x.shape[0] // world_size, *x.shape[1:])``.
        """
        if type(x) is not np.ndarray:
            return self._foreign("reduce_scatter", x, op=op, out=out, algorithm=algorithm, timeout=timeout)  # type: ignore[no-any-return]
        self._check_read(x, "x")
        n = self._world_size
        if x.ndim == 0 or x.shape[0] % n:
            raise ValueError(f"reduce_scatter: x.shape[0] must be divisible by world_size={n}, got shape {x.shape}")
        shape = (x.shape[0] // n, *x.shape[1:])
        if out is None:
            out = np.empty(shape, dtype=x.dtype)
            inplace = False
        else:
            self._check_out(out, shape, x.dtype)
            inplace = self._is_block_of(out, x, self._rank)
        key = ("reduce_scatter", x.dtype, out.size, op, algorithm, inplace)
        call = self._calls.get(key)
        if call is None:
            call = self._prepare(key, "reduce_scatter", x.dtype, out.size, op=op, algorithm=algorithm, inplace=inplace)
        self._run(call, x, out, timeout)
        return out

    def alltoall(
        self, x: np.ndarray, *, out: np.ndarray | None = None, algorithm: str = "auto", timeout: float | None = None
    ) -> np.ndarray:
        """Block ``j`` of each rank's ``x`` goes to rank ``j``: ``out[i]`` = rank ``i``'s
        ``x[rank]``. ``x.shape[0]`` must be ``world_size``; ``out=x`` works in place."""
        if type(x) is not np.ndarray:
            return self._foreign("alltoall", x, out=out, algorithm=algorithm, timeout=timeout)  # type: ignore[no-any-return]
        n = self._world_size
        if x.ndim == 0 or x.shape[0] != n:
            raise ValueError(f"alltoall: x must have shape (world_size={n}, ...), got {x.shape}")
        inplace = out is x
        if inplace:
            self._check_written(x, "x")
        else:
            self._check_read(x, "x")
            if out is None:
                out = np.empty_like(x)
            else:
                self._check_out(out, x.shape, x.dtype)
                self._check_disjoint(x, out)
        count = x.size // n
        key = ("alltoall", x.dtype, count, None, algorithm, inplace)
        call = self._calls.get(key)
        if call is None:
            call = self._prepare(key, "alltoall", x.dtype, count, algorithm=algorithm, inplace=inplace)
        self._run(call, x, out, timeout)
        return out  # type: ignore[return-value]

    def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every rank has entered the barrier."""
        key = ("barrier",)
        call = self._calls.get(key)
        if call is None:
            call = self._prepare(key, "barrier", _UINT8, 0, algorithm="direct")
        self._run(call, None, None, timeout)

    # --- point to point -----------------------------------------------------------------------
    def send(self, x: np.ndarray, dst: int, *, timeout: float | None = None) -> None:
        """Send ``x`` to rank ``dst``; returns once the data is in shared memory.

        Sends and receives between two ranks share the ordered channels that collectives use:
        interleave them in the same order on both ranks.
        """
        if type(x) is not np.ndarray:
            return self._foreign("send", x, dst=dst, timeout=timeout)  # type: ignore[no-any-return]
        self._check_read(x, "x")
        key = ("send", x.dtype, x.size, dst)
        call = self._calls.get(key)
        if call is None:
            self._check_peer(dst, "dst")
            call = self._prepare(
                key, "p2p", x.dtype, x.size, algorithm="direct", root=self._rank, peer=dst, p2p_peer=dst, p2p_send=True
            )
        self._run(call, x, None, timeout)

    def recv(self, buf: np.ndarray, src: int, *, timeout: float | None = None) -> np.ndarray:
        """Receive into ``buf`` what rank ``src`` sent (same size and dtype); returns ``buf``."""
        if type(buf) is not np.ndarray:
            return self._foreign("recv", buf, src=src, timeout=timeout)  # type: ignore[no-any-return]
        self._check_written(buf, "buf")
        key = ("recv", buf.dtype, buf.size, src)
        call = self._calls.get(key)
        if call is None:
            self._check_peer(src, "src")
            call = self._prepare(
                key,
                "p2p",
                buf.dtype,
                buf.size,
                algorithm="direct",
                root=src,
                peer=self._rank,
                p2p_peer=src,
                p2p_send=False,
            )
        self._run(call, None, buf, timeout)
        return buf

    def probe(self, src: int) -> bool:
        """Whether a message from rank ``src`` is waiting (non-blocking; like ``MPI_Iprobe``).

        True means the next ``recv(..., src=src)`` will not wait for ``src`` to send. Channels are
        ordered and shared with collectives, so only probe where the next message from ``src``
        is a point-to-point one.
        """
        self._check_usable()
        self._check_peer(src, "src")
        lay = self._arena.layout
        ch = lay.channel(src, self._rank)
        head = self._arena.word(lay.channel_word(ch, L.C_HEAD))
        return head > int(self._ctrl[lay.channel_word(ch, L.C_TAIL)])

    # --- registered buffers ---------------------------------------------------------------------
    def alloc(
        self, shape: int | Sequence[int], dtype: Any = np.float64, *, timeout: float | None = None
    ) -> SharedArray:
        """A zero-filled array in shared memory that every rank maps (collective).

        Every rank must call it with the same shape and dtype, in the same order. Collectives on
        such arrays can read the peers' data in place (algorithm ``zerocopy``) when every rank
        passes its array from the same allocation, at the same place (``comm.allreduce(buf)``
        with ``buf = comm.alloc(...)`` on every rank); ``auto`` takes it where it is the faster
        choice (large calls: it saves a copy but costs barriers). The memory is released once no
        array views it any longer on any rank (or when the communicator closes).
        """
        self._check_usable()
        dims = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        dt = np.dtype(dtype)
        if any(d < 0 for d in dims):
            raise ValueError(f"alloc: negative dimension in shape {dims}")
        if dt not in DTYPE_CODE:
            raise TypeError(f"alloc: unsupported dtype {dt}")
        nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
        rb = region_bytes(nbytes)
        if rb * self._world_size > self._mem_total:
            raise ValueError(f"alloc: {rb * self._world_size:,} bytes of shared memory is more than this machine has")
        error: Exception | None = None
        segment = None
        with self._nested("alloc", timeout):
            asked = self.allgather_object((dims, dt.str), timeout=timeout)
            if any(a != asked[self._rank] for a in asked):
                error = ValueError(f"alloc must get the same shape and dtype on every rank; got {asked}")
            else:
                name_part = f"buf{next(_ALLOCATIONS)}"
                segment, error = self._shared_segment("alloc", name_part, rb * self._world_size, timeout)
        if error is not None:  # the same on every rank: raised after the block, it breaks nothing
            raise error
        assert segment is not None
        allocation = Allocation(next(self._allocation_ids), segment, self._world_size, rb)
        self._allocations.add(allocation)
        return allocation.region(self._rank, dims, dt)

    def _shared_segment(
        self, what: str, name_part: str, nbytes: int, timeout: float | None
    ) -> tuple[Segment | None, Exception | None]:
        """Rank 0 creates a segment, every rank maps it, rank 0 unlinks its name (collective).

        Returns the segment, or the error that every rank raises alike: a failure to create it on
        rank 0 or to map it on any rank becomes an error on every rank (never a hang, never one
        rank with memory its peers lack).
        """
        offer: Any = None
        segment: Segment | None = None
        if self._rank == 0:
            try:
                segment = Segment.create(
                    segment_name(self._arena.handle.token, name_part), nbytes, what_for=f"{what} ({nbytes:,} bytes)"
                )
                offer = segment.name
            except Exception as exc:  # noqa: BLE001  (every rank must learn it)
                offer = ("error", f"{type(exc).__name__}: {exc}")
        offer = self.broadcast_object(offer, timeout=timeout)
        if isinstance(offer, tuple):
            return None, ShmcollError(f"{what}: rank 0 could not create the shared memory: {offer[1]}")
        failure = None
        try:
            if segment is None:
                segment = Segment.attach(offer, nbytes)
        except Exception as exc:  # noqa: BLE001
            failure = f"{type(exc).__name__}: {exc}"
        failures = self.allgather_object(failure, timeout=timeout)  # all mapped (or failed): unlink
        if self._rank == 0 and segment is not None:
            segment.unlink()
        failed = {r: f for r, f in enumerate(failures) if f is not None}
        if failed:
            if segment is not None:
                segment.close()
            return None, ShmcollError(f"{what}: rank(s) {sorted(failed)} could not map the shared memory: {failed}")
        return segment, None

    def _call_registered(self, name: str, x: Any, **kwargs: Any) -> Any:
        """A call on arrays from :meth:`alloc`: zero-copy where possible, else the usual path."""
        out = kwargs.get("out")
        plain_x = x.view(np.ndarray) if isinstance(x, SharedArray) else x
        if out is x:
            plain_out = plain_x  # in place stays in place
        else:
            plain_out = out.view(np.ndarray) if isinstance(out, SharedArray) else out
        args = dict(kwargs)
        if "out" in kwargs:
            args["out"] = plain_out
        algorithm = kwargs.get("algorithm", "auto")
        chosen = algorithm
        if algorithm == "auto" and name not in _NOT_ZERO_COPY and isinstance(x, np.ndarray):
            chosen = self._auto_registered(name, x, kwargs.get("root", 0))
            if chosen != "zerocopy":  # it measured (or is modelled) slower at this size
                args["algorithm"] = chosen
        placement = self._placement(name, x, out) if chosen in ("auto", "zerocopy") else "not asked for"
        if isinstance(placement, str):
            if algorithm == "zerocopy":
                raise UnsupportedError(f"{name}: algorithm 'zerocopy' cannot serve this call: {placement}")
            result = getattr(self, name)(plain_x, **args)
        else:
            args["algorithm"] = "zerocopy"
            self._registration = placement
            self._state[engine.S_PLACE] = placement.tag
            try:
                result = getattr(self, name)(plain_x, **args)
            finally:
                self._registration = None
                self._state[engine.S_PLACE] = 0
        if result is plain_x and plain_x is not x:
            return x
        if result is plain_out and plain_out is not out:
            return out
        return result

    def _auto_registered(self, name: str, x: np.ndarray, root: Any) -> str:
        """What ``auto`` runs for a call that could go zero-copy: ``zerocopy`` saves a copy but
        pays two or three barriers, so the selection weighs it against the other algorithms on
        such buffers (measured by ``shmcoll tune``, else modelled). Every rank of a valid call
        asks the same question, so every rank gets the same answer."""
        n = self._world_size
        if name not in ("broadcast", "reduce", "gather"):
            root = 0
        elif not isinstance(root, (int, np.integer)) or not 0 <= root < n:
            return "zerocopy"  # the call's own checks reject it, with the usual message
        key = (name, x.size, x.dtype.itemsize, root)
        chosen = self._auto_registered_choice.get(key)
        if chosen is None:
            count = x.size // n if name in ("reduce_scatter", "alltoall") else x.size
            query = Query(name, n, count, x.dtype.itemsize, root=int(root), registered=True)
            lay = self._arena.layout
            groups = self._group_size()
            chosen = choose(query, "auto", slot_bytes=lay.slot_bytes, nslots=lay.nslots, group_size=groups).name
            if len(self._auto_registered_choice) >= _MAX_CACHED_CALLS:
                self._auto_registered_choice.clear()
            self._auto_registered_choice[key] = chosen
        return chosen

    def _placement(self, name: str, x: Any, out: Any) -> _Placement | str:
        """Where this call's registered buffers are, or why the call cannot go zero-copy."""
        if name in _NOT_ZERO_COPY:
            return f"{name} has no zero-copy form"
        if not isinstance(x, SharedArray) or x._allocation not in self._allocations:
            return "this rank's buffer is not from comm.alloc on this communicator"
        if collectives.get(name).reducing and x.dtype == FLOAT16:
            return "float16 reduces through float32 scratch, which peers cannot read"
        a_in = x._allocation
        shift_in = a_in.placement(x, self._rank) if a_in is not None else None
        if shift_in is None or not x.flags.c_contiguous:
            return "the buffer is not a contiguous part of its allocation"
        a_out, shift_out = None, 0
        if isinstance(out, SharedArray) and out._allocation in self._allocations and out.flags.c_contiguous:
            a_out = out._allocation
            shift_out = a_out.placement(out, self._rank) if a_out is not None else None
            if shift_out is None:
                a_out, shift_out = None, 0
        if name == "allreduce" and not (out is None or out is x or a_out is not None):
            return "peers read each other's allreduce output: out must be from comm.alloc too, or x itself"
        if name in ("allgather", "gather") and out is not None and np.may_share_memory(x, out):
            return "in place, x = out[rank] sits at a different place on every rank"
        return _Placement(a_in, shift_in, a_out, shift_out or 0, out_read=name == "allreduce")

    def _registered_buffers(self, call: _Call, x: Any, out: Any) -> tuple[np.ndarray, np.ndarray]:
        """The arrays and placement a zero-copy call gives the engine: whole allocations, with
        this call's offsets in the engine state."""
        reg = self._registration
        assert reg is not None, "a zero-copy plan ran outside a registered call"
        item = call.edt.itemsize
        st = self._state
        inp = reg.a_in.view(call.edt)
        st[engine.S_IN_SHIFT] = reg.shift_in // item
        st[engine.S_IN_STRIDE] = reg.a_in.region_bytes // item
        out_alloc, out_shift = (reg.a_in, reg.shift_in) if out is x else (reg.a_out, reg.shift_out)
        if out is None:
            res = call.dummy
            st[engine.S_OUT_SHIFT] = st[engine.S_OUT_STRIDE] = 0
        elif out_alloc is not None:
            res = out_alloc.view(call.edt)
            st[engine.S_OUT_SHIFT] = out_shift // item
            st[engine.S_OUT_STRIDE] = out_alloc.region_bytes // item
        else:  # a plain local output, which only this rank writes and reads
            res = out if out.ndim == 1 else out.reshape(-1)
            if res.dtype != call.edt:
                res = res.view(call.edt)
            st[engine.S_OUT_SHIFT] = st[engine.S_OUT_STRIDE] = 0
        return inp, res

    # --- object collectives -------------------------------------------------------------------
    # Each is a few array collectives held together by _nested. Errors that every rank learns
    # alike (an object that does not pickle) are raised after the block, on every rank, and
    # leave the communicator usable; anything else that escapes half way breaks it.
    def broadcast_object(self, obj: Any, root: int = 0, *, timeout: float | None = None) -> Any:
        """Root's picklable ``obj`` on every rank (root gets its own object back)."""
        self._check_root(root)
        with self._nested("broadcast_object", timeout):
            payload, error = self._pickle(obj) if self._rank == root else (b"", None)
            size = np.array([len(payload) if error is None else -1], dtype=np.int64)
            self.broadcast(size, root=root, timeout=timeout)
            if size[0] >= 0:
                if self._rank == root:
                    buf = np.frombuffer(bytearray(payload), np.uint8)
                else:
                    buf = np.empty(int(size[0]), np.uint8)
                self.broadcast(buf, root=root, timeout=timeout)
        if size[0] < 0:
            if error is not None:
                raise TypeError(f"broadcast_object: cannot pickle the object: {error}") from error
            raise ValueError(f"broadcast_object: root rank {root} could not pickle its object")
        return obj if self._rank == root else pickle.loads(buf.tobytes())

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """Every rank's picklable ``obj``, as a list indexed by rank, on every rank."""
        with self._nested("allgather_object", timeout):
            payload, error = self._pickle(obj)
            sizes = self.allgather(np.array([len(payload) if error is None else -1], np.int64), timeout=timeout)[:, 0]
            failure = self._pickle_failure("allgather_object", sizes, error)
            if failure is None:
                everything = self.allgather(self._padded(payload, int(sizes.max())), timeout=timeout)
        if failure is not None:
            raise failure
        return [
            obj if r == self._rank else pickle.loads(everything[r, : sizes[r]].tobytes())
            for r in range(self._world_size)
        ]

    def gather_object(self, obj: Any, root: int = 0, *, timeout: float | None = None) -> list[Any] | None:
        """Every rank's picklable ``obj`` as a list on ``root``; ``None`` elsewhere."""
        self._check_root(root)
        with self._nested("gather_object", timeout):
            payload, error = self._pickle(obj)
            sizes = self.allgather(np.array([len(payload) if error is None else -1], np.int64), timeout=timeout)[:, 0]
            failure = self._pickle_failure("gather_object", sizes, error)
            if failure is None:
                everything = self.gather(self._padded(payload, int(sizes.max())), root=root, timeout=timeout)
        if failure is not None:
            raise failure
        if everything is None:
            return None
        return [
            obj if r == self._rank else pickle.loads(everything[r, : sizes[r]].tobytes())
            for r in range(self._world_size)
        ]

    def scatter_object(self, objs: Sequence[Any] | None, root: int = 0, *, timeout: float | None = None) -> Any:
        """Element ``j`` of root's sequence ``objs`` to rank ``j``."""
        self._check_root(root)
        error: Exception | None = None
        payloads: list[bytes] = []
        if self._rank == root:
            if objs is None or len(objs) != self._world_size:
                got = "None" if objs is None else f"{len(objs)} objects"
                error = ValueError(
                    f"scatter_object: root needs a sequence of world_size={self._world_size} objects, got {got}"
                )
            else:
                for o in objs:
                    p, pickle_error = self._pickle(o)
                    if pickle_error is not None:
                        error = TypeError(f"scatter_object: cannot pickle an object: {pickle_error}")
                        error.__cause__ = pickle_error
                        break
                    payloads.append(p)
        with self._nested("scatter_object", timeout):
            if self._rank == root and error is None:
                sizes = np.array([len(p) for p in payloads], np.int64)
            else:
                sizes = np.full(self._world_size, -1, np.int64)  # non-roots: overwritten by the broadcast
            self.broadcast(sizes, root=root, timeout=timeout)
            if sizes[0] >= 0:
                width = int(sizes.max()) if len(sizes) else 0
                blocks = np.zeros((self._world_size, width), np.uint8)
                if self._rank == root:
                    for r, p in enumerate(payloads):
                        blocks[r, : len(p)] = np.frombuffer(p, np.uint8)
                mine = np.empty(width, np.uint8)
                self.scatter(blocks if self._rank == root else None, root=root, out=mine, timeout=timeout)
        if sizes[0] < 0:
            if error is not None:
                raise error
            raise ValueError(f"scatter_object: root rank {root} could not scatter its objects (see its error)")
        if self._rank == root:
            return objs[root]  # type: ignore[index]
        return pickle.loads(mine[: sizes[self._rank]].tobytes())

    @staticmethod
    def _pickle(obj: Any) -> tuple[bytes, Exception | None]:
        try:
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
        except Exception as exc:  # noqa: BLE001  (anything pickling raises is the user's error)
            return b"", exc

    @staticmethod
    def _padded(payload: bytes, width: int) -> np.ndarray:
        block = np.zeros(width, np.uint8)
        block[: len(payload)] = np.frombuffer(payload, np.uint8)
        return block

    def _pickle_failure(self, what: str, sizes: np.ndarray, error: Exception | None) -> Exception | None:
        """The error every rank raises when some rank's object did not pickle (sizes -1)."""
        failed = [int(r) for r in np.flatnonzero(sizes < 0)]
        if not failed:
            return None
        if error is not None:
            exc: Exception = TypeError(f"{what}: cannot pickle rank {self._rank}'s object: {error}")
            exc.__cause__ = error
            return exc
        return ValueError(f"{what}: rank(s) {failed} could not pickle their objects")

    # --- sub-communicators --------------------------------------------------------------------
    def split(self, color: int | None, key: int | None = None, *, timeout: float | None = None) -> Communicator | None:
        """New communicators, one per ``color``, ranked by ``(key, rank)``; collective.

        Ranks passing ``color=None`` take part but get ``None``. Close the result when done.
        """
        if color is not None and (not isinstance(color, (int, np.integer)) or color < 0):
            raise ValueError(f"split: color must be a non-negative int or None, got {color!r}")
        key = self._rank if key is None else int(key)
        sub: Communicator | None = None
        error: Exception | None = None
        with self._nested("split", timeout):
            infos = self.allgather_object((None if color is None else int(color), key), timeout=timeout)
            members: list[int] = []
            if color is not None:
                members = [
                    r for _, r in sorted((infos[r][1], r) for r in range(self._world_size) if infos[r][0] == color)
                ]
            arena: Arena | None = None
            offer: Any = None
            if members and members[0] == self._rank:
                try:
                    lay = self._arena.layout
                    what = f"c{self._state[engine.S_SEQ]}r{self._rank}"
                    arena = Arena.create(len(members), lay.nslots, lay.slot_bytes, self._arena.handle.token, what)
                    offer = arena.handle
                except Exception as exc:  # noqa: BLE001  (every member must learn it)
                    offer = f"{type(exc).__name__}: {exc}"
            offers = self.allgather_object(offer, timeout=timeout)
            failure = None
            if members:
                mine = offers[members[0]]
                if isinstance(mine, str):
                    failure = f"rank {members[0]} could not create the sub-communicator: {mine}"
                else:
                    try:
                        if arena is None:
                            arena = Arena.attach(mine)
                        sub = Communicator(arena, members.index(self._rank), timeout=self._timeout)
                    except Exception as exc:  # noqa: BLE001
                        failure = f"rank {self._rank} could not join: {type(exc).__name__}: {exc}"
                        if arena is not None and sub is None:
                            arena.close()
            # Everyone has attached (or failed) before the creator drops the name.
            failures = self.allgather_object(failure, timeout=timeout)
            if arena is not None and arena.segment.owner:
                arena.segment.unlink()
            ours = sorted({f for r, f in enumerate(failures) if f is not None and r in members})
            if ours:
                if sub is not None:
                    sub.close()
                    sub = None
                error = ShmcollError(f"split: {'; '.join(ours)}")
        if error is not None:  # every member of the color learnt the same failures
            raise error
        return sub

    # --- lifetime -----------------------------------------------------------------------------
    def abort(self, reason: str = "") -> None:
        """Make every rank's pending and future calls fail with :class:`CommunicatorBrokenError`."""
        if self._closed or self._is_forked():
            return
        engine.raise_abort(self._ctrl, self._state, L.ABORT_USER, -1, int(self._state[engine.S_TAG_SEQ]), 0, 0, 0, 0)
        self._broken = f"rank {self._rank} called abort()" + (f": {reason}" if reason else "")

    def _abort_for_error(self, detail: str) -> None:
        """Abort because this rank's own code failed; peers raise at once instead of timing out."""
        if self._closed or self._is_forked():
            return
        engine.raise_abort(self._ctrl, self._state, L.ABORT_ERROR, -1, self._seq(), 0, 0, 0, 0)
        self._broken = f"rank {self._rank} failed: {detail}"

    def close(self) -> None:
        """Leave the communicator (peers waiting on this rank will get :class:`PeerLostError`).

        In a forked child of the process that connected it, only this process's own view is
        dropped: the peers and the parent are not told anything.
        """
        if self._closed:
            return
        self._closed = True
        if self._is_forked():
            self._calls.clear()
            self._broken = self._broken or "the communicator is closed"
            return
        if "shmcoll.device" in sys.modules:  # never import CUDA just to close
            sys.modules["shmcoll.device"].forget(self)
        self._calls.clear()
        self._scratch.clear()
        if self._broken is None:
            self._warn_unreceived()
        self._arena.deregister(self._rank, failed=self._broken is not None)
        if self._arena.segment.owner:
            self._arena.segment.unlink()
        self._ctrl = np.empty(0, np.int64)  # no view of the arena may outlive it
        for allocation in list(self._allocations):
            allocation.close()
        self._arena.close()
        self._broken = self._broken or "the communicator is closed"

    def _warn_unreceived(self) -> None:
        """Messages sent to this rank that it never received point at mismatched calls that no
        receive got to see (say two ranks that both believed they were a broadcast's root)."""
        lay = self._arena.layout
        for peer in range(self._world_size):
            if peer == self._rank:
                continue
            ch = lay.channel(peer, self._rank)
            waiting = self._arena.word(lay.channel_word(ch, L.C_HEAD)) - int(self._ctrl[lay.channel_word(ch, L.C_TAIL)])
            if waiting > 0:
                self._log.warning(
                    "closing with %d message(s) from rank %d never received: the ranks' calls "
                    "did not match (e.g. different roots, or an extra send)",
                    waiting,
                    peer,
                )

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- arrays that are not numpy arrays ------------------------------------------------------
    def _foreign(self, name: str, x: Any, **kwargs: Any) -> Any:
        """A call whose array is not a plain numpy array: arrays from :meth:`alloc` may go zero-copy,
        GPU arrays go to :mod:`shmcoll.device` (anything with ``__cuda_array_interface__``);
        anything else is a TypeError."""
        probe = kwargs.get("out") if x is None else x
        if isinstance(probe, SharedArray):
            return self._call_registered(name, x, **kwargs)
        # Device arrays; the CUDA simulator's have no interface, only __cuda_ndarray__.
        if hasattr(probe, "__cuda_array_interface__") or getattr(probe, "__cuda_ndarray__", False):
            from shmcoll import device

            return device.call(self, name, x, **kwargs)
        raise _not_array("out" if x is None else ("buf" if name == "recv" else "x"), probe)

    # --- argument checks ----------------------------------------------------------------------
    @staticmethod
    def _check_read(a: np.ndarray, name: str) -> None:
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous (use np.ascontiguousarray)")

    @staticmethod
    def _check_written(a: np.ndarray, name: str) -> None:
        flags = a.flags
        if not flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous (use np.ascontiguousarray)")
        if not flags.writeable:
            raise ValueError(f"{name} is read-only but this call writes into it")

    @staticmethod
    def _check_out(out: Any, shape: tuple[int, ...], dtype: np.dtype) -> None:
        if not isinstance(out, np.ndarray):
            raise _not_array("out", out)
        if out.shape != shape:
            raise ValueError(f"out has shape {out.shape}, expected {shape}")
        if out.dtype != dtype:
            raise TypeError(f"out has dtype {out.dtype}, expected {dtype}")
        flags = out.flags
        if not flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        if not flags.writeable:
            raise ValueError("out is read-only")

    @staticmethod
    def _check_disjoint(x: np.ndarray, out: np.ndarray) -> None:
        if np.may_share_memory(x, out):
            raise ValueError("x and out overlap: pass out=None (or out=x) to work in place, or disjoint arrays")

    def _is_block_of(self, part: np.ndarray, whole: np.ndarray, block: int) -> bool:
        """Whether ``part`` is exactly block ``block`` of ``whole`` (the in-place form); raises
        if they overlap any other way."""
        if not np.may_share_memory(part, whole):
            return False
        block_bytes = whole.nbytes // self._world_size
        start = whole.__array_interface__["data"][0] + block * block_bytes
        if part.__array_interface__["data"][0] == start and part.nbytes == block_bytes:
            return True
        raise ValueError(f"input and output overlap, but not as block {block} (this rank's block) of the larger one")

    def _check_root(self, root: int) -> None:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self._world_size:
            raise ValueError(f"root {root!r} out of range for world_size {self._world_size}")

    def _check_peer(self, peer: int, name: str) -> None:
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self._world_size:
            raise ValueError(f"{name}={peer!r} out of range for world_size {self._world_size}")
        if peer == self._rank:
            raise ValueError(f"{name}={peer} is this rank itself")

    # --- plans --------------------------------------------------------------------------------
    def _prepare(
        self,
        key: tuple[Any, ...],
        kind: str,
        dtype: np.dtype,
        count: int,
        *,
        op: Any = ReduceOp.SUM,
        algorithm: str = "auto",
        inplace: bool = False,
        root: int = 0,
        peer: int = 0,
        p2p_peer: int = ir.NO_PEER,
        p2p_send: bool = False,
    ) -> _Call:
        """Validate a call shape once and build, encode and cache its plan."""
        self._check_usable()
        if dtype not in DTYPE_CODE:
            raise TypeError(f"unsupported dtype {dtype}; supported: {', '.join(d.name for d in DTYPE_CODE)}")
        if kind in ("broadcast", "scatter", "gather", "reduce"):
            self._check_root(root)
        if not isinstance(algorithm, str):
            raise TypeError(f"algorithm must be a string, got {algorithm!r}")
        reducing = collectives.get(kind).reducing
        f16 = False
        if reducing:
            rop = _as_op(op)
            if not supports(rop, dtype):
                valid = ", ".join(o.name for o in sorted(valid_ops(dtype)))
                raise ValueError(f"op {rop.name} is not defined for dtype {dtype} (valid: {valid})")
            edt, eop = engine_types(dtype, rop)
            f16 = dtype == FLOAT16
        else:
            rop = ReduceOp.SUM
            eop = ReduceOp.SUM
            edt = _UINT8 if dtype == BOOL else (_UINT16 if dtype == FLOAT16 else dtype)
        self._check_size(kind, count, dtype)
        if f16:
            inplace = False  # float16 runs through float32 scratch, never the user's buffers
        registered = self._registration is not None
        query = Query(kind, self._world_size, count, edt.itemsize, root=root, inplace=inplace, registered=registered)
        lay = self._arena.layout
        options: dict[str, object] | None = None
        if kind in ("barrier", "p2p"):
            alg = registry.get(kind, "direct")
        else:
            groups = self._group_size()
            alg = choose(query, algorithm, slot_bytes=lay.slot_bytes, nslots=lay.nslots, group_size=groups)
            if alg.name == "hierarchical":
                options = {"group_size": groups}
        slot_capacity = lay.slot_bytes // edt.itemsize
        n = self._world_size
        plan = plan_call(
            alg, n, count, slot_capacity, root=root, inplace=inplace, peer=peer, options=options, nslots=lay.nslots
        )
        if self._verify:
            verify(
                plan,
                world_size=self._world_size,
                count=count,
                root=root,
                inplace=inplace,
                nslots=lay.nslots,
                peer=peer,
            )
        sig = ir.pack_sig(kind, alg.code, dtype, int(rop), root if kind != "p2p" else 0, count)
        zero_copy = alg.name == "zerocopy"
        prog = ir.encode(plan, self._rank, self._arena.layout.channel, int(eop), sig, p2p_peer, p2p_send, zero_copy)
        tmp = self._scratch_array("tmp", edt, plan.tmp_count)
        label = ir.describe_sig(sig, ALGORITHM_NAMES)
        call = _Call(prog, edt, self._arena.view(edt), tmp, f16, sig, kind, label, count)
        call.registered = zero_copy
        if len(self._calls) >= _MAX_CACHED_CALLS:
            # Call shapes that vary without end (sizes from data) must not grow memory without
            # end: drop the older half (dicts keep insertion order).
            for stale in list(self._calls)[: _MAX_CACHED_CALLS // 2]:
                del self._calls[stale]
        self._calls[key] = call
        self._log.info(
            "%s: algorithm %s, %d piece(s) of %d + tail %d, %d scratch elements",
            label,
            alg.name,
            plan.reps,
            plan.piece,
            plan.tail.count,
            plan.tmp_count,
        )
        return call

    def _check_size(self, kind: str, count: int, dtype: np.dtype) -> None:
        blocks = self._world_size if kind in ("allgather", "gather", "alltoall", "scatter", "reduce_scatter") else 1
        nbytes = count * blocks * dtype.itemsize
        if nbytes > self._mem_total:
            raise ValueError(
                f"{kind} of {nbytes:,} bytes is larger than this machine's memory ({self._mem_total:,} bytes)"
            )

    def _new_output(self, kind: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes > self._mem_total:
            raise ValueError(
                f"{kind}: the result needs {nbytes:,} bytes, more than this machine's memory "
                f"({self._mem_total:,} bytes)"
            )
        return np.empty(shape, dtype=dtype)

    def _scratch_array(self, what: str, dtype: np.dtype, count: int) -> np.ndarray:
        key = (what, dtype)
        arr = self._scratch.get(key)
        if arr is None or arr.size < count:
            arr = self._scratch[key] = np.empty(max(count, 0), dtype=dtype)
        return arr

    # --- execution ----------------------------------------------------------------------------
    def _group_size(self) -> int | None:
        """Ranks per group for hierarchical plans (``None``: one group), the same on every rank.

        ``SHMCOLL_GROUP_SIZE`` if set, else what the topology gives the ranks' CPU affinities
        (read from their pids once all have attached: every rank reads the same). The signature
        has no room for it, so ranks agree on it through the arena instead: the first rank to
        need it publishes it and every other compares, and a rank that disagrees (say, another
        ``SHMCOLL_GROUP_SIZE``) fails at once, aborting the others, before any message.
        """
        if self._groups_agreed:
            return self._groups
        n = self._world_size
        cfg = config.get()
        g, source = cfg.group_size, "SHMCOLL_GROUP_SIZE"
        if g is None:
            g, source = self._topology_group_size(), "the topology"
        elif g < 1:
            raise ValueError(f"SHMCOLL_GROUP_SIZE must be >= 1, got {g}")
        mine = n if g is None or g >= n else g
        agreed = self._arena.agree_group_size(mine)
        if agreed != mine:
            msg = (
                f"rank {self._rank}: ranks disagree on the hierarchical groups: this rank has groups of "
                f"{mine} (from {source}), another rank already chose {agreed}; set SHMCOLL_GROUP_SIZE "
                "alike on every rank"
            )
            self._abort_for_error(msg)
            raise CollectiveMismatchError(msg)
        self._groups = None if mine >= n else mine
        self._groups_agreed = True
        self._log.info("hierarchical groups: %s (from %s)", self._groups or "one group", source)
        return self._groups

    def _topology_group_size(self) -> int | None:
        n = self._world_size
        if n == 1:
            return None
        deadline = time.monotonic() + self._timeout
        while self._arena.attached() < n:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.001)
        affinities = [topology.affinity(self._arena.rank_field(r, L.R_PID)) for r in range(n)]
        return topology.group_size_for(affinities, topology.machine())

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
                self._abort_for_error(f"{what} failed half way: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._nested_owner = None
            write_word(self._state, engine.S_NESTED, 0)

    def _concurrent_message(self, what: str) -> str:
        return (
            f"rank {self._rank}: {what} was called while another thread (or a signal handler) is in a call on "
            f"this communicator; calls on one communicator must not overlap: give each thread its own "
            f"communicator (comm.split) or serialise the calls with a lock. Nothing was done."
        )

    def _run(self, call: _Call, x: np.ndarray | None, out: np.ndarray | None, timeout: float | None) -> None:
        if self._broken is not None:
            self._check_usable()
        limit = self._timeout if timeout is None else config.timeout_s(timeout)
        owner = self._nested_owner
        if owner is None:
            prog = call.prog
        elif owner == threading.get_ident():
            prog = call.prog_nested
        else:
            raise ConcurrentCallError(self._concurrent_message(call.label))
        edt = call.edt
        if call.registered:
            inp, res = self._registered_buffers(call, x, out)
        elif call.f16:
            inp = self._scratch_array("f16in", FLOAT32, x.size)[: x.size]  # type: ignore[union-attr]
            np.copyto(inp, x.reshape(-1))  # type: ignore[union-attr]
            res = self._scratch_array("f16out", FLOAT32, out.size)[: out.size] if out is not None else call.dummy
        else:
            if x is None:
                inp = call.dummy
            else:
                inp = x if x.ndim == 1 else x.reshape(-1)
                if inp.dtype != edt:
                    inp = inp.view(edt)
                if not inp.flags.writeable:
                    inp = self._scratch_array("ro", edt, inp.size)[: inp.size]
                    np.copyto(inp, (x if x.ndim == 1 else x.reshape(-1)).view(edt))  # type: ignore[union-attr]
            if out is None:
                res = call.dummy
            elif out is x:
                res = inp
            else:
                res = out if out.ndim == 1 else out.reshape(-1)
                if res.dtype != edt:
                    res = res.view(edt)
        if self._trace:
            t0 = time.perf_counter()
        st = engine.execute(prog, inp, res, call.tmp, call.data, self._ctrl, self._state)
        if st != engine.OK:
            self._wait_or_raise(st, call, inp, res, limit)
        if self._trace:
            self._log.log(TRACE, "%s #%d took %.1f us", call.label, self._seq(), (time.perf_counter() - t0) * 1e6)
        if call.f16 and out is not None:
            np.copyto(out.reshape(-1), res)

    def _wait_or_raise(self, st: int, call: _Call, inp: np.ndarray, res: np.ndarray, limit: float) -> None:
        """Carry a call that did not finish in one engine run to its end, or raise.

        Whatever escapes from here once the call has started (a timeout, a peer's death, a
        KeyboardInterrupt) breaks the communicator and raises the abort word: a call is never
        left half done on one rank while the others go on.
        """
        if st == engine.BUSY:
            raise ConcurrentCallError(self._concurrent_message(call.label))
        started = time.monotonic() - _SLICE_NS / 1e9
        try:
            while st != engine.OK:
                if st == engine.WAITING:
                    if self._arena.word(L.AB_CODE) != 0:
                        self._fail_aborted(call)  # the cause is whoever aborted, not who left since
                    lost = self._lost_peer()
                    if lost is not None:
                        self._fail_peer_lost(call, *lost)
                    self._check_awaited_call(call)
                    if time.monotonic() - started > limit:
                        self._fail_timeout(call, limit)
                elif st == engine.ABORTED:
                    self._fail_aborted(call)
                elif st == engine.PEER_DEAD:
                    self._fail_peer_lost(call, int(self._state[engine.S_ERR_PEER]), "dead")
                elif st == engine.MISMATCH:
                    if (
                        int(self._state[engine.S_ERR_SIG]) == call.sig
                        and int(self._state[engine.S_ERR_SEQ]) == self._seq()
                        and int(self._state[engine.S_ERR_PLACE]) != int(self._state[engine.S_PLACE])
                    ):
                        self._fail_placement(call)
                    self._fail_mismatch(
                        call,
                        int(self._state[engine.S_ERR_PEER]),
                        int(self._state[engine.S_ERR_SEQ]),
                        int(self._state[engine.S_ERR_SIG]),
                        int(self._state[engine.S_ERR_STEP]),
                    )
                st = engine.execute(call.prog_resume, inp, res, call.tmp, call.data, self._ctrl, self._state)
        except ShmcollError:
            if self._broken is None:  # a raise that did not go through a _fail_* (none should)
                self._abort_for_error(f"{call.label} failed")
            raise
        except BaseException as exc:  # KeyboardInterrupt mid-call: the call's state is half done
            self._broken = f"rank {self._rank} was interrupted in {call.label} ({type(exc).__name__})"
            engine.raise_abort(self._ctrl, self._state, L.ABORT_ERROR, -1, self._seq(), call.sig, self._step(), 0, 0)
            raise

    def _seq(self) -> int:
        return int(self._state[engine.S_TAG_SEQ])

    def _step(self) -> int:
        return int(self._state[engine.S_WAIT_STEP])

    def _where(self, call: _Call) -> str:
        if int(self._state[engine.S_ACTIVE]) == 0:  # stopped at the start: the call has no number yet
            return f"{call.label} (call #{self._next_seq(call)}, before its first step)"
        return f"{call.label} (call #{self._seq()}, step {self._step()})"

    def _next_seq(self, call: _Call) -> int:
        """The number the call would have had, had it started."""
        if call.kind != "p2p":
            return int(self._state[engine.S_SEQ]) + 1
        head = call.prog[0]
        peer = int(head[ir.HD_P2P_PEER])
        slot = engine.S_P2P_BASE + (peer if head[ir.HD_P2P_SEND] else self._world_size + peer)
        return int(self._state[slot]) + 1

    def _lost_peer(self) -> tuple[int, str] | None:
        """A peer this rank cannot finish without: the awaited one if gone, or any that died
        in the middle of a call. A peer that left *because of an abort* is never the answer: the
        abort word names the cause, and the caller reads it first."""
        waited = int(self._state[engine.S_WAIT_PEER])
        for peer in range(self._world_size):
            if peer == self._rank:
                continue
            status = self._arena.peer_status(peer)
            if status in ("alive", "absent"):
                continue
            mid_call = self._arena.rank_field(peer, L.R_STATE) == L.STATE_IN_CALL
            if peer == waited or mid_call or status == "failed":
                # A rank raises the abort word before it marks itself failed or leaves, so having
                # seen that mark, this load sees the abort if there was one.
                if self._arena.word(L.AB_CODE) != 0:
                    return None
                return peer, status
        return None

    def _fail_peer_lost(self, call: _Call, peer: int, status: str) -> None:
        pid = self._arena.rank_field(peer, L.R_PID)
        how = {
            "dead": f"its process (pid {pid}) is gone",
            "exited": "it closed its communicator",
            "failed": "it failed and left",
        }.get(status, status)
        msg = f"rank {self._rank}: peer rank {peer} was lost during {self._where(call)}: {how}"
        engine.raise_abort(self._ctrl, self._state, L.ABORT_PEER_LOST, peer, self._seq(), call.sig, self._step(), 0, 0)
        self._broken = msg
        raise PeerLostError(msg, dead_rank=peer)

    def _activity(self, rank: int, seq: int) -> str:
        """What ``rank`` is doing, relative to this rank's call number ``seq``."""
        a = self._arena
        if a.rank_field(rank, L.R_PID) == 0:
            return f"rank {rank}: never connected"
        state = a.rank_field(rank, L.R_STATE)
        last = ir.describe_sig(a.rank_field(rank, L.R_DONE_SIG), ALGORITHM_NAMES)
        done = f"last completed {last} #{a.rank_field(rank, L.R_DONE_SEQ)}"
        if state == L.STATE_IN_CALL:
            cur = ir.describe_sig(a.rank_field(rank, L.R_CUR_SIG), ALGORITHM_NAMES)
            cur_seq, step = a.rank_field(rank, L.R_CUR_SEQ), a.rank_field(rank, L.R_CUR_STEP)
            where = "arrived" if cur_seq == seq else "not arrived"
            return f"rank {rank}: {where}, in {cur} #{cur_seq} (step {step}); {done}"
        name = {L.STATE_IDLE: "not in a call", L.STATE_EXITED: "closed", L.STATE_FAILED: "failed"}.get(state, "?")
        return f"rank {rank}: not arrived ({name}); {done}"

    def _activities(self) -> str:
        seq = self._seq()
        return "; ".join(self._activity(r, seq) for r in range(self._world_size) if r != self._rank)

    def _holdup(self, waited: int) -> tuple[int, str]:
        """The rank a timed-out call is really waiting for, and why, as far as the arena shows: a
        stopped process first (``SIGSTOP``, a debugger), else the end of the chain of ranks each
        waiting for the next, starting at the one this rank waits for."""
        for peer in range(self._world_size):
            if peer == self._rank:
                continue
            pid = self._arena.rank_field(peer, L.R_PID)
            stat = proc_stat(pid) if pid > 0 else None
            if stat is not None and stat[0] in ("T", "t"):
                return peer, f"its process (pid {pid}) is stopped (SIGSTOP, or a debugger)"
        peer, seen = waited, {self._rank}
        while 0 <= peer < self._world_size and peer not in seen:
            seen.add(peer)
            if self._arena.rank_field(peer, L.R_PID) == 0:
                return peer, "it never connected"
            if self._arena.rank_field(peer, L.R_STATE) != L.STATE_IN_CALL:
                return peer, "it has not arrived"
            nxt = self._arena.rank_field(peer, L.R_WAIT_PEER)
            if nxt < 0 or nxt in seen:
                return peer, "it is in a call and not waiting: busy, or stuck"
            peer = nxt
        return waited, ""

    def _fail_timeout(self, call: _Call, limit: float) -> None:
        waited = int(self._state[engine.S_WAIT_PEER])
        culprit, why = self._holdup(waited)
        chain = "" if culprit == waited else f" (which waits, in turn, for rank {culprit})"
        cause = f": rank {culprit} {why}" if why else ""
        peers = self._activities()
        msg = (
            f"rank {self._rank}: {self._where(call)} timed out after {limit:g}s waiting for rank {waited}"
            f"{chain}{cause}. Peers: {peers}"
        )
        engine.raise_abort(self._ctrl, self._state, L.ABORT_TIMEOUT, culprit, self._seq(), call.sig, self._step(), 0, 0)
        self._broken = msg
        raise CollectiveTimeout(msg)

    def _check_awaited_call(self, call: _Call) -> None:
        """Mismatch that no message can reveal: both ranks wait to receive (two ranks that each
        believe they are a reduce's root). Seen in the awaited peer's record: same call number,
        different call."""
        if call.kind == "p2p":
            return  # point-to-point numbers count per channel: not comparable with the record's
        peer = int(self._state[engine.S_WAIT_PEER])
        if not 0 <= peer < self._world_size or peer == self._rank:
            return
        a = self._arena
        if a.rank_field(peer, L.R_STATE) != L.STATE_IN_CALL:
            return
        their_seq, their_sig = a.rank_field(peer, L.R_CUR_SEQ), a.rank_field(peer, L.R_CUR_SIG)
        if their_seq == self._seq() and their_sig != call.sig and ir.unpack_sig(their_sig)["kind"] != _P2P_KIND:
            self._fail_mismatch(call, peer, their_seq, their_sig, self._step())

    def _fail_placement(self, call: _Call) -> None:
        peer = int(self._state[engine.S_ERR_PEER])
        msg = (
            f"rank {self._rank}: {call.label} (call #{self._seq()}): rank {peer} passed its buffer from another "
            f"place (another comm.alloc allocation, or another offset in it) than this rank did: zero-copy "
            f"collectives read each peer's buffer at the same place as their own"
        )
        engine.raise_abort(
            self._ctrl, self._state, L.ABORT_MISMATCH, peer, self._seq(), call.sig, self._step(), call.sig, self._seq()
        )
        self._broken = msg
        raise CollectiveMismatchError(msg)

    def _fail_mismatch(self, call: _Call, peer: int, their_seq: int, their_sig: int, step: int) -> None:
        theirs = ir.describe_sig(their_sig, ALGORITHM_NAMES)
        mine_seq, mine = self._seq(), call.label
        if their_seq != mine_seq:
            # Their message comes from another call number: name our own call of that number if
            # it was the last one we completed (the usual case: a mismatch only one side saw).
            done_seq = self._arena.rank_field(self._rank, L.R_DONE_SEQ)
            if done_seq == their_seq:
                mine_seq = done_seq
                mine = ir.describe_sig(self._arena.rank_field(self._rank, L.R_DONE_SIG), ALGORITHM_NAMES)
        msg = (
            f"rank {self._rank} called {mine} (call #{mine_seq}) but rank {peer} called {theirs} "
            f"(call #{their_seq}); detected in call #{self._seq()} at step {step}: ranks must call the same "
            f"collectives, in the same order, with the same sizes, dtypes, ops and roots"
        )
        mine_sig = call.sig if mine_seq == self._seq() else self._arena.rank_field(self._rank, L.R_DONE_SIG)
        engine.raise_abort(
            self._ctrl, self._state, L.ABORT_MISMATCH, peer, their_seq, their_sig, step, mine_sig, mine_seq
        )
        self._broken = msg
        raise CollectiveMismatchError(msg)

    def _fail_aborted(self, call: _Call) -> None:
        info = self._arena.abort_info()
        deadline = time.monotonic() + 1.0
        while info["code"] == -1 and time.monotonic() < deadline:  # the aborting rank is filling it
            time.sleep(0.001)
            info = self._arena.abort_info()
        code, origin, peer = info["code"], info["origin"], info["peer"]
        where = f"rank {self._rank}: {self._where(call)} aborted"
        who = f"rank {origin}" if origin >= 0 else "the launcher"
        if code == L.ABORT_PEER_LOST:
            msg = f"{where}: {who} found peer rank {peer} lost"
            self._broken = msg
            raise PeerLostError(msg, dead_rank=peer)
        if code == L.ABORT_TIMEOUT:
            msg = f"{where}: {who} timed out waiting for rank {peer}. Peers: {self._activities()}"
            self._broken = msg
            raise CollectiveTimeout(msg)
        if code == L.ABORT_MISMATCH:
            mine = ir.describe_sig(info["detail"], ALGORITHM_NAMES)
            theirs = ir.describe_sig(info["sig"], ALGORITHM_NAMES)
            msg = (
                f"{where}: mismatched collectives: rank {origin} called {mine} (call #{info['own_seq']}) "
                f"but rank {peer} called {theirs} (call #{info['seq']})"
            )
            self._broken = msg
            raise CollectiveMismatchError(msg)
        reason = _ABORT_REASONS.get(code, f"abort code {code}")
        msg = f"{where}: {who}: {reason}"
        self._broken = msg
        raise CommunicatorBrokenError(msg)
