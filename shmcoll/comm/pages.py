"""Page-aware choice: whether a call runs the plan for buffers on huge pages, agreed by the ranks.

Cross-memory attach (``cma``) copies about twice as fast from a peer's huge pages as from its
4 KiB pages, and beats the rings by up to 2x from 2 MiB there while it loses to them on 4 KiB
pages (``shm/pages.py``, ``algos/cma.py``: ``HUGE_FROM``). Which pages a numpy buffer has is up to
numpy's allocator and the process's history, and each rank sees only its own. So a call shape
whose automatic choice differs by page size (``Call.huge``, made by ``calls.prepare``) runs two
steps at every call:

1. each rank looks at its buffers: "huge" where at least half of their bytes are on huge pages
   (``shm.pages.huge_share``; the share is remembered per buffer once all of it is present, and
   per call shape for the arrays of its last call, so a loop over the same arrays asks the kernel
   once);
2. the ranks agree: a MIN over one int32 (an allreduce of the ``direct`` algorithm on the
   runtime's own one-element buffer, made through the run loop, so that the remembered calls and
   the lean path of the program's own allreduce are left alone). Every rank then runs the huge
   plan, or every rank the other one.

It costs one small collective per call, only for these call shapes: at 2 MiB and up, where a
call takes tens of microseconds or more (measured in ``benchmarks/RESULTS.md``, stop 38). Where
the kernel has no ``PAGEMAP_SCAN`` (before Linux 6.7) no call shape is page-aware and ``auto``
decides as before.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from shmcoll.comm.calls import Bound, Call
from shmcoll.shm import pages
from shmcoll.types import ReduceOp

_INT32 = np.dtype(np.int32)


def _ref(a: Any) -> Any:
    return None if a is None else weakref.ref(a)


def _same(ref: Any, a: Any) -> bool:
    return a is None if ref is None else ref() is a


def local_huge(b: Bound) -> bool:
    """Whether this rank's buffers of the bound call ``b`` are mostly on huge pages (copies in
    scratch, made for read-only inputs, are not: the engine arrays are then made later)."""
    call, inp, res, _, out, _, x = b
    seen = call.seen
    if seen is not None and _same(seen[0], x) and _same(seen[1], out):
        return seen[2]  # type: ignore[no-any-return]
    if inp is None:
        return False
    huge = total = 0
    settled = True
    for a in (inp,) if res is inp or res.size == 0 else (inp, res) if inp.size else (res,):
        share, final = pages.huge_share(a.ctypes.data, a.nbytes)
        huge += share * a.nbytes
        total += a.nbytes
        settled = settled and final
    on_huge = total > 0 and 2 * huge >= total
    if settled:  # (pages not yet touched are looked at again next time)
        try:
            call.seen = (_ref(x), _ref(out), on_huge)
        except TypeError:  # an array type without weak references
            call.seen = None
    return on_huge


def agreed(rt: Any, b: Bound, timeout: float | None) -> Bound:
    """``b``, or ``b`` with its call shape's huge-page plan where every rank's buffers are on huge
    pages; one MIN over the ranks decides (see the module doc)."""
    flag = rt._pages_flag
    if flag is None:
        flag = rt._pages_flag = np.zeros(1, _INT32)
    flag[0] = 1 if local_huge(b) else 0
    agree = rt._shape(("pages",), "allreduce", _INT32, 1, op=ReduceOp.MIN, algorithm="direct")
    rt._run((agree, flag, flag, None, flag, None, flag), timeout, True)
    call: Call = b[0]
    if flag[0]:
        return (call.huge, *b[1:])
    return b
