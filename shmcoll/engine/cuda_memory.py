"""Device memory for the device engine: what a device array is, and workspaces that several
processes map (CUDA IPC on a GPU; POSIX shared memory standing in for it under the simulator).

Imported only with :mod:`shmcoll.engine.cuda` (it imports ``numba.cuda``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import itertools
import os
from typing import Any

import numpy as np
from numba import cuda

from shmcoll.kernels import cuda as kernels

SIMULATOR = kernels.SIMULATOR
_UINT8 = np.dtype(np.uint8)


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
