"""How device-array collectives move bytes: CUDA IPC workspaces, or staging through host memory.

Imported only when a device array reaches shmcoll (through :mod:`shmcoll.device`) or by
``shmcoll info``; importing it imports ``numba.cuda``.

Every collective call on device arrays starts with a **handshake**: one small CPU ``allgather``
on the communicator of a row per rank (call signature, settings, device identity, whether IPC
works here, whether this rank already copied its input in). Every rank sees the same rows and
so makes the same decisions: mismatched calls raise :class:`CollectiveMismatchError` on every
rank, and all ranks pick the same data path:

* **IPC** (every rank on the same physical device, a real GPU): each rank owns one device
  *workspace*, exported once with ``cudaIpcGetMemHandle`` and opened once by every peer, so a
  rank's kernels read its peers' workspaces directly::

      rank r's workspace (device memory, opened by every peer)
      +------------------------------- half 0 ------------------------+---- half 1 ----+
      | A: this rank's input (copied in)  | B: reduced chunks (large  |  same layout   |
      |                                   |    allreduce only)        |                |
      +-----------------------------------+---------------------------+----------------+
      call k uses half k % 2

  A rank copies its input into A (device to device), the ranks meet (the handshake itself when
  everyone had copied in before it, else a barrier), and then each rank reads what it needs from
  the peers' A regions: allreduce up to ``oneshot_bytes`` reduces all of them in rank order
  (one-shot); above that rank ``j`` reduces chunk ``j`` of all of them into its own output and
  its B region in one pass (reduce-scatter), the ranks meet again, and each copies the other
  chunks out of the peers' B regions (allgather). Every element comes from one reduction in
  fixed rank order, so the result is bitwise identical on every rank.

  Why two halves: a rank may start call ``k + 1`` while slower peers still read its workspace
  for call ``k``; with two halves call ``k + 1`` writes the other one, and before any rank
  writes the half of call ``k`` again (call ``k + 2``) every rank has passed call ``k + 1``'s
  handshake, which it enters only after its call ``k`` is complete on the device. No trailing
  barrier is needed.

* **Staging** (the simulator, different devices, IPC unavailable, or asked for): copy to host,
  run the same communicator's numpy collective, copy back.

Synchronisation: device work inside a call never waits for a peer (a kernel or copy reads data
that the peer finished, as the meeting before it guarantees, and then completes), so a CUDA
event recorded after the work and synchronised on is all a rank waits for on the device. Every
wait for a *peer* is a CPU collective of the communicator, with its deadline, its abort word and
its errors; the call's ``timeout`` is one deadline across all of them. Device-side spin flags are
deliberately not used: kernels of different processes on one GPU are time-sliced, not
co-scheduled, so a kernel spinning on a peer's flag can stall the very kernel it waits for, and
it can neither time out nor see an abort.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.metadata
import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import cuda

from shmcoll import collectives
from shmcoll.collectives import KIND_CODE, PLAN_KINDS
from shmcoll.errors import CollectiveMismatchError, UnsupportedError
from shmcoll.kernels import cuda as kernels
from shmcoll.types import DTYPE_CODE, DTYPES, FLOAT16, ReduceOp, engine_types

log = logging.getLogger("shmcoll")

SIMULATOR = kernels.SIMULATOR
ALIGN_BYTES = 256
MIN_HALF_BYTES = 1 << 20
ONESHOT_BYTES = 512 << 10
PATHS = ("auto", "ipc", "staging")
_UINT8 = np.dtype(np.uint8)
_FLOAT32 = np.dtype(np.float32)

# Handshake row fields.
_MAGIC = 0x53484D4347505531  # "SHMCGPU1": a device handshake, not some other int64 allgather
(F_MAGIC, F_KIND, F_DTYPE, F_OP, F_ROOT, F_COUNT, F_ONESHOT, F_PATH, F_DEVICE, F_IPC_OK, F_STAGED) = range(11)
_ROW = 11
_SIGNATURE = slice(F_MAGIC, F_ONESHOT + 1)


def _round_up(value: int, align: int = ALIGN_BYTES) -> int:
    return -(-value // align) * align


# --- what a device array is --------------------------------------------------------------------
@dataclasses.dataclass
class DeviceBuffer:
    """A user's device array, described once: ``array`` is a numba device array (a simulator
    array under ``NUMBA_ENABLE_CUDASIM=1``) over the same memory, or None if not contiguous."""

    obj: Any
    array: Any
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    readonly: bool
    contiguous: bool

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def flat(self, dtype: np.dtype | None = None) -> Any:
        """A 1-d view of the whole buffer, reinterpreted as ``dtype`` (same memory)."""
        a = self.array.reshape(self.size)
        if dtype is not None and np.dtype(dtype) != self.dtype:
            a = a.view(dtype)
        return a


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int) -> bool:
    if strides is None:
        return True
    if 0 in shape:
        return True
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides), strict=True):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def _fake_array_type() -> Any:
    if not SIMULATOR:
        return None
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray


def as_device(obj: Any) -> DeviceBuffer | None:
    """Describe ``obj`` if it is a device array (anything with ``__cuda_array_interface__``;
    under the simulator also numba's simulated device arrays), else return None."""
    fake = _fake_array_type()
    if fake is not None and isinstance(obj, fake):
        host = obj._ary
        return DeviceBuffer(
            obj,
            obj,
            int(host.__array_interface__["data"][0]),
            tuple(host.shape),
            host.dtype,
            not host.flags.writeable,
            bool(host.flags.c_contiguous),
        )
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        return None
    shape = tuple(int(s) for s in cai["shape"])
    dtype = np.dtype(cai["typestr"])
    ptr, readonly = cai["data"]
    strides = cai.get("strides")
    contiguous = _c_contiguous(shape, None if strides is None else tuple(strides), dtype.itemsize)
    if cai.get("mask") is not None:
        raise TypeError("masked device arrays are not supported")
    array = None
    if contiguous:
        if fake is not None:
            # Under the simulator "device memory" is host memory, so the pointer is a host address.
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if nbytes and ptr:
                raw = (ctypes.c_uint8 * nbytes).from_address(int(ptr))
                host = np.frombuffer(raw, np.uint8).view(dtype).reshape(shape)
            else:
                host = np.empty(shape, dtype)
            array = fake(host)
        elif _is_numba_array(obj):
            array = obj
        else:
            array = cuda.as_cuda_array(obj)  # zero-copy; waits on the exporter's stream (CAI v3)
    return DeviceBuffer(obj, array, int(ptr or 0), shape, dtype, bool(readonly), contiguous)


def _is_numba_array(obj: Any) -> bool:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return isinstance(obj, DeviceNDArray)


def device_array(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """A new device array (numba's) for results the caller did not provide."""
    return cuda.device_array(shape, dtype=dtype)


# --- workspaces shared between processes ---------------------------------------------------------
class CudaIpcBackend:
    """Workspaces in device memory, shared with CUDA IPC (``cudaIpcGetMemHandle``/``Open``)."""

    name = "cuda-ipc"

    def device_key(self) -> int:
        ident = cuda.get_current_device().get_device_identity()  # PCI domain/bus/device: global
        return _key(repr(sorted(ident.items())))

    def usable(self) -> str | None:
        """Why IPC cannot work in this process, or None."""
        if SIMULATOR:
            return "the CUDA simulator has no IPC"
        if not cuda.is_available():
            return "no usable CUDA device"
        return None

    def alloc(self, nbytes: int, label: str) -> tuple[Any, Any]:
        local = cuda.device_array(nbytes, dtype=np.uint8)
        return local, local

    def export(self, local: Any) -> Any:
        # An IpcHandle pickles as the handle bytes, the size and the source device's identity.
        return cuda.current_context().get_ipc_handle(local.gpu_data)

    def open(self, handle: Any) -> tuple[Any, Any]:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray

        # open_direct, never numba's open(): that one silently stages through the host when the
        # source device is not peer-accessible; the handshake already required one device.
        ptr = handle.open_direct(cuda.current_context())
        return DeviceNDArray(shape=(handle.size,), strides=(1,), dtype=_UINT8, gpu_data=ptr), handle

    def opened_all(self, local_token: Any) -> None:
        pass

    def close_peer(self, token: Any) -> None:
        token.close()

    def free(self, local: Any, local_token: Any) -> None:
        pass  # dropping the last reference frees it (numba's deallocation queue)


_WORKSPACE_NUMBERS = itertools.count(1)


class HostShmBackend:
    """The simulator's IPC: simulated device memory is host memory, so workspaces are POSIX
    shared-memory segments that every rank maps. It runs the IPC protocol unchanged, which is
    how that protocol is tested without a GPU (``shmcoll.device.configure(comm, path="ipc")``)."""

    name = "simulated-ipc"

    def __init__(self, token: str, rank: int) -> None:
        self._token = token
        self._rank = rank

    def device_key(self) -> int:
        return _key(f"simulator:{os.uname().nodename}")

    def usable(self) -> str | None:
        return None if SIMULATOR else "host shared memory stands in for IPC only under the simulator"

    def alloc(self, nbytes: int, label: str) -> tuple[Any, Any]:
        from shmcoll.shm.segment import Segment, segment_name

        # Names carry the job token and this pid; the process-wide counter keeps the workspaces of
        # a communicator and of its sub-communicators (same token, same process) apart.
        name = segment_name(self._token, f"gpuws{self._rank}n{next(_WORKSPACE_NUMBERS)}")
        seg = Segment.create(name, nbytes, "a device workspace")
        fake = _fake_array_type()
        assert fake is not None
        return fake(seg.array(np.uint8)), seg

    def open(self, handle: Any) -> tuple[Any, Any]:
        from shmcoll.shm.segment import Segment

        name, nbytes = handle
        seg = Segment.attach(name, nbytes)
        fake = _fake_array_type()
        assert fake is not None
        return fake(seg.array(np.uint8)), seg

    def export(self, seg: Any) -> Any:
        return (seg.name, seg.size)

    def opened_all(self, local_token: Any) -> None:
        local_token.unlink()

    def close_peer(self, token: Any) -> None:
        token.close()

    def free(self, local: Any, local_token: Any) -> None:
        local_token.unlink()
        local_token.close()


def _key(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


# --- the engine ----------------------------------------------------------------------------------
class DeviceEngine:
    """One communicator's device state: settings, stream, workspaces, and the call counter.

    Holds no reference to the communicator (it is passed to every call), so a communicator that
    is dropped takes its engine with it.
    """

    def __init__(self, rank: int, world_size: int, token: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.path = "auto"
        self.oneshot_bytes = ONESHOT_BYTES
        self.seq = 0
        self.last_path = ""
        self._token = token
        self._backend: Any = None
        self._ipc_failed: str | None = None
        self._stream: Any = None
        self._half = 0
        self._local: Any = None
        self._local_token: Any = None
        self._views: list[Any] | None = None
        self._peer_tokens: list[Any] = []
        self._scratch: Any = None

    # settings
    def configure(self, path: str | None = None, oneshot_bytes: int | None = None) -> None:
        if path is not None:
            if path not in PATHS:
                raise ValueError(f"path must be one of {PATHS}, got {path!r}")
            self.path = path
        if oneshot_bytes is not None:
            if not isinstance(oneshot_bytes, (int, np.integer)) or oneshot_bytes < 0:
                raise ValueError(f"oneshot_bytes must be a non-negative int, got {oneshot_bytes!r}")
            self.oneshot_bytes = int(oneshot_bytes)

    @property
    def stream(self) -> Any:
        if self._stream is None:
            self._stream = cuda.stream()
        return self._stream

    def backend(self) -> Any:
        if self._backend is None:
            self._backend = HostShmBackend(self._token, self.rank) if SIMULATOR else CudaIpcBackend()
        return self._backend

    def _ipc_blocker(self) -> str | None:
        if self._ipc_failed is not None:
            return self._ipc_failed
        if SIMULATOR and self.path != "ipc":
            return "the simulator stages through host memory unless path='ipc' is configured"
        try:
            return self.backend().usable()
        except Exception as exc:  # noqa: BLE001  (a driver that cannot tell: no IPC)
            return f"{type(exc).__name__}: {exc}"

    def _device_key(self) -> int:
        try:
            return int(self.backend().device_key())
        except Exception:  # noqa: BLE001
            return -1

    # the call
    def collective(
        self,
        comm: Any,
        kind: str,
        x: DeviceBuffer | None,
        out: DeviceBuffer | None,
        *,
        count: int,
        dtype: np.dtype,
        op: ReduceOp,
        root: int,
        algorithm: str,
        timeout: float | None,
    ) -> None:
        """Run one collective. ``x``/``out`` are None where this rank has none (non-root outputs,
        non-root scatter input). ``count`` is the element count of one rank's block."""
        deadline = time.monotonic() + (comm.timeout if timeout is None else float(timeout))
        # Device work queued before the call (on any stream of this process) must be done
        # before we read or write the buffers.
        cuda.synchronize()
        need_a, need_b = self._needs(kind, count, dtype)
        half_needed = _round_up(need_a) + _round_up(need_b)
        staged = self._copies_in(kind, root) is False
        if self.last_path == "ipc" and self._views is not None and self._half >= half_needed and not staged:
            self._copy_in(kind, x, root, self.seq + 1)
            self._sync()  # "staged" in the handshake promises the bytes are there, not queued
            staged = True
        blocker = self._ipc_blocker()
        row = np.zeros(_ROW, np.int64)
        row[F_MAGIC] = _MAGIC
        row[F_KIND] = KIND_CODE[kind]
        row[F_DTYPE] = DTYPE_CODE[dtype]
        record = collectives.get(kind)
        row[F_OP] = int(op) if record.reducing else -1
        row[F_ROOT] = root if record.rooted else -1
        row[F_COUNT] = count
        row[F_ONESHOT] = self.oneshot_bytes
        row[F_PATH] = PATHS.index(self.path)
        row[F_DEVICE] = self._device_key() if blocker is None else -1
        row[F_IPC_OK] = blocker is None
        row[F_STAGED] = staged
        rows = comm.allgather(row, timeout=_left(deadline))
        self.seq += 1
        path = self._decide(comm, rows, blocker)
        if path == "ipc" and not self._ensure_workspace(comm, half_needed, deadline):
            path = "staging"
        if path != self.last_path:
            log.info(
                "[rank %d] device collectives: %s path%s",
                self.rank,
                path,
                f" ({blocker})" if path == "staging" and blocker else "",
            )
        self.last_path = path
        if path == "staging":
            self._staging(comm, kind, x, out, op, root, algorithm, deadline)
            return
        if not bool(rows[:, F_STAGED].all()):
            if not staged:
                self._copy_in(kind, x, root, self.seq)
            self._sync()
            comm.barrier(timeout=_left(deadline))
        self._ipc(comm, kind, x, out, count, dtype, op, root, deadline)

    def p2p(self, comm: Any, send: bool, buf: DeviceBuffer, peer: int, timeout: float | None) -> None:
        """send/recv always stage through host memory: a device-side rendezvous would make a send
        wait for its receiver, which the numpy ``send`` (buffered in shared memory) does not."""
        cuda.synchronize()
        s = self.stream
        if send:
            host = np.empty(buf.shape, buf.dtype)
            if buf.nbytes:
                buf.array.copy_to_host(host, stream=s)
                s.synchronize()
            comm.send(host, peer, timeout=timeout)
        else:
            host = np.empty(buf.shape, buf.dtype)
            comm.recv(host, peer, timeout=timeout)
            if buf.nbytes:
                buf.array.copy_to_device(host, stream=s)
                s.synchronize()

    def release(self, comm: Any, timeout: float | None = None) -> None:
        """Free the workspaces (collective: every rank first stops using every peer's)."""
        self._drop_workspace(comm, timeout)
        self.last_path = ""

    # decisions
    def _decide(self, comm: Any, rows: np.ndarray, blocker: str | None) -> str:
        n = self.world_size
        if not (rows[:, _SIGNATURE] == rows[0, _SIGNATURE]).all():
            calls = "; ".join(f"rank {r}: {_describe_row(rows[r])}" for r in range(n))
            msg = (
                f"rank {self.rank}: device collective #{self.seq} mismatched across ranks ({calls}): ranks must "
                f"call the same collectives in the same order with the same sizes, dtypes, ops, roots and "
                f"shmcoll.device settings"
            )
            comm.abort(msg)
            raise CollectiveMismatchError(msg)
        prefs = {PATHS[int(p)] for p in rows[:, F_PATH]}
        if "ipc" in prefs and "staging" in prefs:
            msg = f"rank {self.rank}: ranks configured different device paths ({sorted(prefs)})"
            comm.abort(msg)
            raise CollectiveMismatchError(msg)
        if "staging" in prefs:
            return "staging"
        ipc_ok = bool(rows[:, F_IPC_OK].all()) and len(set(rows[:, F_DEVICE].tolist())) == 1
        if ipc_ok and (not SIMULATOR or "ipc" in prefs):
            return "ipc"
        if "ipc" in prefs:
            why = blocker or "not every rank can use IPC, or the ranks are on different devices"
            raise UnsupportedError(f"rank {self.rank}: path='ipc' was configured but IPC is not possible: {why}")
        return "staging"

    def _needs(self, kind: str, count: int, dtype: np.dtype) -> tuple[int, int]:
        """Bytes of the A and B regions a call needs (the same on every rank)."""
        block = count * dtype.itemsize
        n = self.world_size
        if kind in ("scatter", "reduce_scatter", "alltoall"):
            return n * block, 0
        if kind == "allreduce" and block > self.oneshot_bytes and n > 1:
            return block, block
        return block, 0

    def _copies_in(self, kind: str, root: int) -> bool:
        return kind not in ("broadcast", "scatter") or self.rank == root

    # workspaces
    def _ensure_workspace(self, comm: Any, half_needed: int, deadline: float) -> bool:
        if self._views is not None and self._half >= half_needed:
            return True
        half = max(_round_up(half_needed), MIN_HALF_BYTES, 2 * self._half)
        self._drop_workspace(comm, _left(deadline))
        backend = self.backend()
        failure = ""
        local = token = None
        try:
            local, token = backend.alloc(2 * half, f"gpuws{self.rank}")
            offer = backend.export(token)
        except Exception as exc:  # noqa: BLE001  (reported to every rank below)
            failure = f"rank {self.rank} could not allocate a {2 * half:,}-byte workspace: {exc}"
            offer = None
        offers = comm.allgather_object(offer, timeout=_left(deadline))
        views: list[Any] = []
        tokens: list[Any] = []
        if not failure:
            for peer, handle in enumerate(offers):
                if peer == self.rank:
                    views.append(local)
                    continue
                if handle is None:
                    failure = f"rank {peer} could not allocate its workspace"
                    break
                try:
                    view, peer_token = backend.open(handle)
                except Exception as exc:  # noqa: BLE001
                    failure = f"rank {self.rank} could not open rank {peer}'s workspace: {exc}"
                    break
                views.append(view)
                tokens.append(peer_token)
        oks = comm.allgather(np.array([0 if failure else 1], np.int64), timeout=_left(deadline))
        if token is not None and not failure:
            backend.opened_all(token)
        if failure or not oks.all():
            for t in tokens:
                backend.close_peer(t)
            if token is not None:
                backend.free(local, token)
            self._ipc_failed = failure or "a peer could not set up its IPC workspace"
            log.warning("[rank %d] device IPC disabled for this communicator: %s", self.rank, self._ipc_failed)
            return False
        self._local, self._local_token, self._views, self._peer_tokens, self._half = local, token, views, tokens, half
        return True

    def _drop_workspace(self, comm: Any, timeout: float | None) -> None:
        if self._views is None:
            return
        backend = self.backend()
        for t in self._peer_tokens:
            backend.close_peer(t)
        self._views, self._peer_tokens = None, []
        # Nobody frees memory a peer may still map: every rank has closed its mappings first.
        comm.barrier(timeout=timeout)
        backend.free(self._local, self._local_token)
        self._local = self._local_token = None
        self._half = 0

    def _region(self, peer: int, seq: int, byte_offset: int, nbytes: int, dtype: np.dtype) -> Any:
        assert self._views is not None
        start = (seq % 2) * self._half + byte_offset
        return self._views[peer][start : start + nbytes].view(dtype)

    def _scratch_f32(self, count: int) -> Any:
        if self._scratch is None or self._scratch.size < count:
            self._scratch = cuda.device_array(max(count, 1), dtype=_FLOAT32)
        return self._scratch[:count]

    # data movement
    def _sync(self) -> None:
        # timing=False: an event without timestamps is the cheap kind to synchronise on (the
        # simulator's event takes no arguments).
        ev = cuda.event() if SIMULATOR else cuda.event(timing=False)  # type: ignore[call-arg]
        ev.record(self.stream)
        ev.synchronize()

    def _copy(self, dst: Any, src: Any) -> None:
        if dst.size:
            dst.copy_to_device(src, stream=self.stream)

    def _copy_in(self, kind: str, x: DeviceBuffer | None, root: int, seq: int) -> None:
        if not self._copies_in(kind, root) or x is None or x.nbytes == 0:
            return
        self._copy(self._region(self.rank, seq, 0, x.nbytes, _UINT8), x.flat(_UINT8))

    def _reduce(self, dst: Any, srcs: list[Any], eop: ReduceOp, op: ReduceOp, dst2: Any = None) -> None:
        divisor = self.world_size if op == ReduceOp.AVG else 0
        scratch = self._scratch_f32(dst.size) if np.dtype(dst.dtype) == FLOAT16 else None
        kernels.reduce(dst, srcs, int(eop), divisor=divisor, dst2=dst2, scratch=scratch, stream=self.stream)

    def _ipc(
        self,
        comm: Any,
        kind: str,
        x: DeviceBuffer | None,
        out: DeviceBuffer | None,
        count: int,
        dtype: np.dtype,
        op: ReduceOp,
        root: int,
        deadline: float,
    ) -> None:
        n, r, seq = self.world_size, self.rank, self.seq
        block = count * dtype.itemsize
        a_bytes = block * (n if kind in ("scatter", "reduce_scatter", "alltoall") else 1)
        a_u8 = [self._region(j, seq, 0, a_bytes, _UINT8) for j in range(n)]
        if collectives.get(kind).reducing:
            edt, eop = engine_types(dtype, op)
            if dtype == FLOAT16:
                edt = FLOAT16  # the kernel widens to float32 itself
            a = [self._region(j, seq, 0, a_u8[j].size, edt) for j in range(n)]
        if kind == "allreduce":
            assert out is not None
            res = out.flat(edt)
            if block <= self.oneshot_bytes or n == 1:
                self._reduce(res, a, eop, op)
            else:
                # Chunk j of the result is reduced by rank j only; chunk bounds are the same on
                # every rank, so every element has exactly one reducer.
                bounds = [(j * count) // n for j in range(n + 1)]
                lo, hi = bounds[r], bounds[r + 1]
                b = [self._region(j, seq, _round_up(block), block, edt) for j in range(n)]
                self._reduce(res[lo:hi], [aj[lo:hi] for aj in a], eop, op, dst2=b[r][lo:hi])
                self._sync()
                comm.barrier(timeout=_left(deadline))
                for j in range(n):
                    if j != r:
                        self._copy(res[bounds[j] : bounds[j + 1]], b[j][bounds[j] : bounds[j + 1]])
        elif kind == "reduce":
            if r == root:
                assert out is not None
                self._reduce(out.flat(edt), a, eop, op)
        elif kind == "reduce_scatter":
            assert out is not None
            self._reduce(out.flat(edt), [aj[r * count : (r + 1) * count] for aj in a], eop, op)
        elif kind == "broadcast":
            assert out is not None
            if r != root:
                self._copy(out.flat(_UINT8), a_u8[root])
            elif x is not None and out.ptr != x.ptr:
                self._copy(out.flat(_UINT8), x.flat(_UINT8))
        elif kind in ("allgather", "gather"):
            if out is not None:
                dst = out.flat(_UINT8)
                for j in range(n):
                    self._copy(dst[j * block : (j + 1) * block], a_u8[j])
        elif kind == "scatter":
            assert out is not None
            self._copy(out.flat(_UINT8), a_u8[root][r * block : (r + 1) * block])
        elif kind == "alltoall":
            assert out is not None
            dst = out.flat(_UINT8)
            for j in range(n):
                self._copy(dst[j * block : (j + 1) * block], a_u8[j][r * block : (r + 1) * block])
        else:
            raise ValueError(f"unknown collective {kind!r}")
        self._sync()

    def _staging(
        self,
        comm: Any,
        kind: str,
        x: DeviceBuffer | None,
        out: DeviceBuffer | None,
        op: ReduceOp,
        root: int,
        algorithm: str,
        deadline: float,
    ) -> None:
        s = self.stream
        hx = None
        if x is not None:
            hx = np.empty(x.shape, x.dtype)
            if x.nbytes:
                x.array.copy_to_host(hx, stream=s)
                s.synchronize()
        hout = None if out is None else np.empty(out.shape, out.dtype)
        kw = {"algorithm": algorithm, "timeout": _left(deadline)}
        calls: dict[str, Callable[[], Any]] = {
            "allreduce": lambda: comm.allreduce(hx, op, out=hout, **kw),
            "reduce": lambda: comm.reduce(hx, root, op, out=hout, **kw),
            "broadcast": lambda: comm.broadcast(hx if hx is not None else hout, root, out=hout, **kw),
            "allgather": lambda: comm.allgather(hx, out=hout, **kw),
            "gather": lambda: comm.gather(hx, root, out=hout, **kw),
            "scatter": lambda: comm.scatter(hx, root, out=hout, **kw),
            "reduce_scatter": lambda: comm.reduce_scatter(hx, op, out=hout, **kw),
            "alltoall": lambda: comm.alltoall(hx, out=hout, **kw),
        }
        calls[kind]()
        if out is not None and hout is not None and out.nbytes:
            out.array.copy_to_device(hout, stream=s)
            s.synchronize()


def _left(deadline: float) -> float:
    # A spent deadline still calls the CPU collective, with a token timeout, so that the timeout
    # is raised (and peers aborted) by the communicator exactly as on the numpy path.
    return max(deadline - time.monotonic(), 1e-3)


def _describe_row(row: np.ndarray) -> str:
    if int(row[F_MAGIC]) != _MAGIC:
        return "not a device collective"
    kind = PLAN_KINDS[int(row[F_KIND])] if 0 <= row[F_KIND] < len(PLAN_KINDS) else "?"
    dtype = DTYPES[int(row[F_DTYPE])].name if 0 <= row[F_DTYPE] < len(DTYPES) else "?"
    parts = [f"{kind} {dtype} count={int(row[F_COUNT])}"]
    if row[F_OP] >= 0:
        parts.append(ReduceOp(int(row[F_OP])).name)
    if row[F_ROOT] >= 0:
        parts.append(f"root={int(row[F_ROOT])}")
    parts.append(f"oneshot_bytes={int(row[F_ONESHOT])}")
    return " ".join(parts)


# --- shmcoll info --------------------------------------------------------------------------------
def _implementation() -> str:
    impl = getattr(cuda, "implementation", "")
    if impl == "NVIDIA":
        try:
            return f"numba-cuda {importlib.metadata.version('numba-cuda')}"
        except importlib.metadata.PackageNotFoundError:
            return "numba-cuda"
    return "numba's built-in CUDA target (install numba-cuda: pip install 'shmcoll[cuda]')"


def describe() -> str:
    """One line: which CUDA target numba uses, and whether a GPU (or the simulator) is usable."""
    impl = _implementation()
    if SIMULATOR:
        return (
            f"CUDA simulator (NUMBA_ENABLE_CUDASIM=1) via {impl}: kernels run as Python and device "
            f"collectives stage through host memory"
        )
    try:
        if not cuda.is_available():
            return f"{impl}, but no usable CUDA GPU or driver"
        devices = []
        for dev in cuda.gpus:
            with dev:
                d = cuda.get_current_device()
                name = d.name.decode() if isinstance(d.name, bytes) else str(d.name)
                devices.append(f"{d.id}: {name} (sm_{d.compute_capability[0]}{d.compute_capability[1]})")
        return f"{impl}; {len(devices)} GPU(s): {', '.join(devices)}; device collectives use CUDA IPC"
    except Exception as exc:  # noqa: BLE001  (a broken driver is a description, not a crash)
        return f"{impl}, but the CUDA driver failed: {type(exc).__name__}: {exc}"
