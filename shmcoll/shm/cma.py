"""Cross-memory attach: whether this process may reach its peers' memory (``process_vm_readv``
and ``process_vm_writev``).

The ``cma`` algorithm copies a block straight between the peers' own (ordinary numpy) buffers:
one copy where the rings make two. The kernel allows it only where ptrace would be allowed (same
user, and Yama's ``ptrace_scope`` permitting it) and where no seccomp filter refuses the system
calls, as some container runtimes do. :func:`probe` decides
once per process, before any call is planned:

- ``SHMCOLL_CMA=0`` turns it off;
- Yama's scope 1 ("restricted": only a tracer's descendants) is lifted for this process with
  ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``, as MPI libraries do; scope 2 or 3 refuses
  unprivileged readers, so cross-memory attach is off there;
- a read and a write of this process's own memory through the system calls catch a seccomp
  refusal or a kernel without them (both are needed: cma's plans read and write).

Every rank of a machine decides the same way (same kernel settings, same user), so the plans
they choose agree. If a peer's memory is refused anyway (a process that is not dumpable, ranks
of different users), the call fails with an error that names ``SHMCOLL_CMA=0`` as the remedy.

How fast the kernel copies differs between machines far more than a user-space copy does: on
one 2-core Intel VM a cma allreduce of 1 MiB took 64 us, on a 2-core AMD VM 100-118, where a
``process_vm_readv`` of 64 bytes takes 1.25 us and a 1 MiB one is 3.4x slower than numpy's
copy. Where cma starts to pay (``algos/cma.py``'s ``auto_from``) moves with it, so
:func:`block_ns` measures it once per process. Its answer is noisy, and the ranks of a call
must choose alike, so ranks take the time of the first of them to measure it (through the
arena, ``comm.calls.cma_block_ns``), not their own.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from shmcoll import config
from shmcoll.jit import jit
from shmcoll.shm.atomics import monotonic_ns, vm_copy

PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1 % (1 << 64))
_YAMA = "/proc/sys/kernel/yama/ptrace_scope"


def _yama_scope() -> int:
    try:
        with open(_YAMA) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0  # no Yama: plain ptrace rules (same user)


@functools.lru_cache(maxsize=1)
def probe() -> tuple[bool, str]:
    """(available, why) for this process; the answer is kept for the process's life."""
    if not config.get().cma:
        return False, "off (SHMCOLL_CMA=0)"
    scope = _yama_scope()
    if scope >= 2:
        return False, f"off: {_YAMA} is {scope} (ptrace restricted to administrators)"
    if scope == 1:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0:
            return False, f"off: prctl(PR_SET_PTRACER) failed ({os.strerror(ctypes.get_errno())})"
    src = np.arange(512, dtype=np.int64)
    dst = np.zeros_like(src)
    if not vm_copy(os.getpid(), dst.ctypes.data, src.ctypes.data, src.nbytes, False) or not np.array_equal(src, dst):
        return False, "off: process_vm_readv is refused here (a seccomp filter or an old kernel)"
    back = np.zeros_like(src)
    if not vm_copy(os.getpid(), src.ctypes.data, back.ctypes.data, src.nbytes, True) or not np.array_equal(src, back):
        return False, "off: process_vm_writev is refused here (a seccomp filter or an old kernel)"
    return True, "on: process_vm_readv/writev" + (
        " (Yama scope 1: peers allowed with PR_SET_PTRACER)" if scope == 1 else ""
    )


# The block a cma call moves at the size where ``auto`` starts to weigh it at 2 ranks (a 32 KiB
# allgather or alltoall moves 16 KiB blocks), so that the kernel's fixed cost per call counts as
# much as in such a call.
BLOCK_BYTES = 16 << 10


@jit
def _copy_ns(pid, to, frm, nbytes, reps):  # type: ignore[no-untyped-def]
    """Nanoseconds of ``reps`` cross-memory-attach copies of ``nbytes`` from address ``frm`` to
    ``to`` in process ``pid`` (addresses, not arrays: jit's compile notice would take arrays
    for a payload and announce an engine's compile)."""
    t0 = monotonic_ns()
    for _ in range(reps):
        vm_copy(pid, to, frm, nbytes, False)
    return monotonic_ns() - t0


def warm() -> None:
    """Compile (or load from the cache) what :func:`block_ns` runs, before ranks start."""
    _copy_ns(os.getpid(), 0, 0, 0, 0)


@functools.lru_cache(maxsize=1)
def block_ns() -> int:
    """Nanoseconds a cross-memory-attach copy of a 16 KiB block takes here (the best of 5
    rounds of 8 copies of this process's own memory: about 0.3 ms); 0 where cross-memory attach
    is off. The answer is kept for the process's life."""
    if not probe()[0]:
        return 0
    src = np.ones(BLOCK_BYTES, np.uint8)
    dst = np.zeros_like(src)
    where = os.getpid(), dst.ctypes.data, src.ctypes.data, BLOCK_BYTES
    _copy_ns(*where, 2)  # fault the pages in
    return max(1, min(int(_copy_ns(*where, 8)) for _ in range(5)) // 8)
