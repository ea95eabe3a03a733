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
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from shmcoll import config

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
    from shmcoll.shm.atomics import vm_copy

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
