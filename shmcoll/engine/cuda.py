"""How device-array collectives move bytes: CUDA IPC workspaces, or staging through host memory.

Imported only when a device array reaches shmcoll (through :mod:`shmcoll.device`) or by
``shmcoll info``; importing it imports ``numba.cuda``.

This module moves the bytes and never communicates: :mod:`shmcoll.comm.device` exchanges what
the ranks need through the communicator and raises. Every collective call on device arrays
starts with a **handshake**: one small CPU ``allgather`` of a row per rank (call signature,
settings, device identity, whether IPC works here, whether this rank already copied its input
in), built by :meth:`DeviceEngine.begin`. Every rank sees the same rows and so makes the same
decision (:meth:`DeviceEngine.decide`: mismatched calls are a status that every rank raises
alike), and all ranks pick the same data path:

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

import importlib.metadata
import logging
from typing import Any

import numpy as np
from numba import cuda

from shmcoll import collectives
from shmcoll.collectives import KIND_CODE, PLAN_KINDS
from shmcoll.engine.cuda_memory import CudaIpcBackend, DeviceBuffer, HostShmBackend
from shmcoll.kernels import cuda as kernels
from shmcoll.types import DTYPE_CODE, FLOAT16, ReduceOp, dtype_name, engine_types

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


# --- the engine ----------------------------------------------------------------------------------
# What a decision on the handshake rows says (the API layer turns these into exceptions).
OK = 0
MISMATCH = 1  # the ranks' calls (or settings) differ
PATHS_DIFFER = 2  # ranks configured different paths
NO_IPC = 3  # path='ipc' was configured but IPC is not possible
# What a step of the IPC path asks for next.
DONE = 0
MEET = 1  # every rank must pass a barrier before the next phase


class DeviceEngine:
    """One communicator's device state: settings, stream, workspaces, and the call counter.

    Never communicates and never raises for a reason that involves other ranks: every decision
    that needs the peers takes their handshake rows or workspace offers as arguments and returns
    a status; :mod:`shmcoll.comm.device` exchanges them and raises.
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
        self._pending: Any = None  # a workspace offered but not yet opened by every rank

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

    def ipc_blocker(self) -> str | None:
        """Why this process cannot take the IPC path (None: it can)."""
        if self._ipc_failed is not None:
            return self._ipc_failed
        if SIMULATOR and self.path != "ipc":
            return "the simulator stages through host memory unless path='ipc' is configured"
        try:
            return self.backend().usable()  # type: ignore[no-any-return]
        except Exception as exc:  # noqa: BLE001  (a driver that cannot tell: no IPC)
            return f"{type(exc).__name__}: {exc}"

    def _device_key(self) -> int:
        try:
            return int(self.backend().device_key())
        except Exception:  # noqa: BLE001
            return -1

    def wait_for_queued_work(self) -> None:
        """Device work this process queued before a call (on any stream) completes first."""
        cuda.synchronize()

    # the handshake
    def begin(self, kind: str, x: DeviceBuffer | None, count: int, dtype: np.dtype, op: ReduceOp, root: int) -> Any:
        """Prepare a call and return this rank's handshake row (see the module docstring).

        Device work queued before the call (on any stream of this process) must be done before
        the call reads or writes the buffers, so this synchronises the device first. A rank that
        can already copy its input into its workspace does so now, and says so in the row.
        """
        self.wait_for_queued_work()
        need_a, need_b = self.needs(kind, count, dtype)
        half_needed = _round_up(need_a) + _round_up(need_b)
        staged = self.copies_in(kind, root) is False
        if self.last_path == "ipc" and self._views is not None and self._half >= half_needed and not staged:
            self.copy_in(kind, x, root, self.seq + 1)
            self.sync()  # "staged" in the handshake promises the bytes are there, not queued
            staged = True
        blocker = self.ipc_blocker()
        record = collectives.get(kind)
        row = np.zeros(_ROW, np.int64)
        row[F_MAGIC] = _MAGIC
        row[F_KIND] = KIND_CODE[kind]
        row[F_DTYPE] = DTYPE_CODE[dtype]
        row[F_OP] = int(op) if record.reducing else -1
        row[F_ROOT] = root if record.rooted else -1
        row[F_COUNT] = count
        row[F_ONESHOT] = self.oneshot_bytes
        row[F_PATH] = PATHS.index(self.path)
        row[F_DEVICE] = self._device_key() if blocker is None else -1
        row[F_IPC_OK] = blocker is None
        row[F_STAGED] = staged
        return row, half_needed, staged, blocker

    def decide(self, rows: np.ndarray, blocker: str | None) -> tuple[int, str, str]:
        """(status, path, detail) from every rank's handshake row: every rank decides alike."""
        self.seq += 1
        n = self.world_size
        if not (rows[:, _SIGNATURE] == rows[0, _SIGNATURE]).all():
            calls = "; ".join(f"rank {r}: {_describe_row(rows[r])}" for r in range(n))
            return MISMATCH, "", calls
        prefs = {PATHS[int(p)] for p in rows[:, F_PATH]}
        if "ipc" in prefs and "staging" in prefs:
            return PATHS_DIFFER, "", str(sorted(prefs))
        if "staging" in prefs:
            return OK, "staging", ""
        ipc_ok = bool(rows[:, F_IPC_OK].all()) and len(set(rows[:, F_DEVICE].tolist())) == 1
        if ipc_ok and (not SIMULATOR or "ipc" in prefs):
            return OK, "ipc", ""
        if "ipc" in prefs:
            return NO_IPC, "", blocker or "not every rank can use IPC, or the ranks are on different devices"
        return OK, "staging", ""

    def needs(self, kind: str, count: int, dtype: np.dtype) -> tuple[int, int]:
        """Bytes of the A and B regions a call needs (the same on every rank)."""
        block = count * dtype.itemsize
        n = self.world_size
        if collectives.get(kind).blocks_in:
            return n * block, 0
        if kind == "allreduce" and block > self.oneshot_bytes and n > 1:
            return block, block
        return block, 0

    def copies_in(self, kind: str, root: int) -> bool:
        """Whether this rank's input goes into its workspace: the root's only, in a broadcast or a
        scatter; everyone's elsewhere."""
        return kind not in ("broadcast", "scatter") or self.rank == root

    # workspaces: offered by each rank, opened by every peer (the API layer exchanges them)
    def has_workspace(self, half_needed: int) -> bool:
        return self._views is not None and self._half >= half_needed

    def offer_workspace(self, half_needed: int) -> tuple[Any, str]:
        """Allocate a workspace big enough (the old one must have been dropped); returns what the
        peers need to open it, or (None, why not)."""
        half = max(_round_up(half_needed), MIN_HALF_BYTES, 2 * self._half)
        backend = self.backend()
        try:
            local, token = backend.alloc(2 * half, f"gpuws{self.rank}")
            offer = backend.export(token)
        except Exception as exc:  # noqa: BLE001  (reported to every rank by the caller)
            return None, f"rank {self.rank} could not allocate a {2 * half:,}-byte workspace: {exc}"
        self._pending = (local, token, half)
        return offer, ""

    def open_workspaces(self, offers: list[Any]) -> str:
        """Open every peer's workspace; returns why not ("" on success)."""
        if self._pending is None:
            return "no workspace of this rank's own"
        local, token, half = self._pending
        backend = self.backend()
        views: list[Any] = []
        tokens: list[Any] = []
        for peer, handle in enumerate(offers):
            if peer == self.rank:
                views.append(local)
                continue
            if handle is None:
                return self._abandon(tokens, f"rank {peer} could not allocate its workspace")
            try:
                view, peer_token = backend.open(handle)
            except Exception as exc:  # noqa: BLE001
                return self._abandon(tokens, f"rank {self.rank} could not open rank {peer}'s workspace: {exc}")
            views.append(view)
            tokens.append(peer_token)
        self._views, self._peer_tokens = views, tokens
        return ""

    def _abandon(self, tokens: list[Any], why: str) -> str:
        for t in tokens:
            self.backend().close_peer(t)
        return why

    def settle_workspaces(self, everyone_ok: bool, failure: str) -> bool:
        """After every rank reported whether it opened every workspace: keep them (True), or free
        this rank's and remember that IPC failed here (False)."""
        backend = self.backend()
        pending, self._pending = self._pending, None
        if everyone_ok and pending is not None and self._views is not None:
            local, token, half = pending
            backend.opened_all(token)
            self._local, self._local_token, self._half = local, token, half
            return True
        for t in self._peer_tokens:
            backend.close_peer(t)
        self._views, self._peer_tokens = None, []
        if pending is not None:
            backend.free(pending[0], pending[1])
        self._ipc_failed = failure or "a peer could not set up its IPC workspace"
        log.warning("[rank %d] device IPC disabled for this communicator: %s", self.rank, self._ipc_failed)
        return False

    def close_peer_views(self) -> bool:
        """Stop using the peers' workspaces (the first half of dropping them); True if there were
        any. The caller makes every rank do so before any frees its own (``free_workspace``)."""
        if self._views is None:
            return False
        for t in self._peer_tokens:
            self.backend().close_peer(t)
        self._views, self._peer_tokens = None, []
        return True

    def free_workspace(self) -> None:
        if self._local_token is not None:
            self.backend().free(self._local, self._local_token)
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
    def sync(self) -> None:
        # timing=False: an event without timestamps is the cheap kind to synchronise on (the
        # simulator's event takes no arguments).
        ev = cuda.event() if SIMULATOR else cuda.event(timing=False)  # type: ignore[call-arg]
        ev.record(self.stream)
        ev.synchronize()

    def _copy(self, dst: Any, src: Any) -> None:
        if dst.size:
            dst.copy_to_device(src, stream=self.stream)

    def copy_in(self, kind: str, x: DeviceBuffer | None, root: int, seq: int | None = None) -> None:
        """Copy this rank's input into its workspace region A of call ``seq`` (default: this one)."""
        if not self.copies_in(kind, root) or x is None or x.nbytes == 0:
            return
        self._copy(self._region(self.rank, self.seq if seq is None else seq, 0, x.nbytes, _UINT8), x.flat(_UINT8))

    def _reduce(self, dst: Any, srcs: list[Any], engine_op: ReduceOp, op: ReduceOp, dst2: Any = None) -> None:
        divisor = self.world_size if op == ReduceOp.AVG else 0
        scratch = self._scratch_f32(dst.size) if np.dtype(dst.dtype) == FLOAT16 else None
        kernels.reduce(dst, srcs, int(engine_op), divisor=divisor, dst2=dst2, scratch=scratch, stream=self.stream)

    def ipc_step(
        self,
        phase: int,
        kind: str,
        x: DeviceBuffer | None,
        out: DeviceBuffer | None,
        count: int,
        dtype: np.dtype,
        op: ReduceOp,
        root: int,
    ) -> int:
        """Phase ``phase`` (0, then 1 after a MEET) of the IPC path, once every rank's input is in
        its workspace; returns ``MEET`` when every rank must pass a barrier before the next phase,
        else ``DONE``. Work is complete on the device when it returns."""
        n, r, seq = self.world_size, self.rank, self.seq
        block = count * dtype.itemsize
        a_bytes = block * (n if collectives.get(kind).blocks_in else 1)
        a_u8 = [self._region(j, seq, 0, a_bytes, _UINT8) for j in range(n)]
        if collectives.get(kind).reducing:
            engine_dtype, engine_op = engine_types(dtype, op)
            if dtype == FLOAT16:
                engine_dtype = FLOAT16  # the kernel widens to float32 itself
            a = [self._region(j, seq, 0, a_u8[j].size, engine_dtype) for j in range(n)]
        if kind == "allreduce":
            assert out is not None
            res = out.flat(engine_dtype)
            if block <= self.oneshot_bytes or n == 1:
                self._reduce(res, a, engine_op, op)
            else:
                # Chunk j of the result is reduced by rank j only; chunk bounds are the same on
                # every rank, so every element has exactly one reducer.
                bounds = [(j * count) // n for j in range(n + 1)]
                lo, hi = bounds[r], bounds[r + 1]
                b = [self._region(j, seq, _round_up(block), block, engine_dtype) for j in range(n)]
                if phase == 0:
                    self._reduce(res[lo:hi], [aj[lo:hi] for aj in a], engine_op, op, dst2=b[r][lo:hi])
                    self.sync()
                    return MEET
                for j in range(n):
                    if j != r:
                        self._copy(res[bounds[j] : bounds[j + 1]], b[j][bounds[j] : bounds[j + 1]])
        elif kind == "reduce":
            if r == root:
                assert out is not None
                self._reduce(out.flat(engine_dtype), a, engine_op, op)
        elif kind == "reduce_scatter":
            assert out is not None
            self._reduce(out.flat(engine_dtype), [aj[r * count : (r + 1) * count] for aj in a], engine_op, op)
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
        self.sync()
        return DONE

    # staging through host memory
    def to_host(self, buf: DeviceBuffer | None) -> np.ndarray | None:
        if buf is None:
            return None
        host = np.empty(buf.shape, buf.dtype)
        if buf.nbytes:
            buf.array.copy_to_host(host, stream=self.stream)
            self.stream.synchronize()
        return host

    def to_device(self, host: np.ndarray | None, buf: DeviceBuffer | None) -> None:
        if buf is not None and host is not None and buf.nbytes:
            buf.array.copy_to_device(host, stream=self.stream)
            self.stream.synchronize()


def _describe_row(row: np.ndarray) -> str:
    if int(row[F_MAGIC]) != _MAGIC:
        return "not a device collective"
    kind = PLAN_KINDS[int(row[F_KIND])] if 0 <= row[F_KIND] < len(PLAN_KINDS) else "?"
    dtype = dtype_name(int(row[F_DTYPE]))
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
