"""Private buffers on pages of a chosen size, and what backs a buffer now.

Cross-memory attach (``shm/cma.py``) makes the kernel pin the peer's pages before it copies,
page by page, so its speed depends on the page size of the peer's buffer: on the 2-core Zen 5
VM, cma's allgather at 2 ranks, 2 MiB in place, took 1.21x the rings' time on 4 KiB pages and
0.58x on huge ones, and every collective's cma was slower than the rings on 4 KiB pages and
faster from 2 MiB on huge ones (``benchmarks/RESULTS.md``, stop 37). The rings copy with the CPU
and barely notice.

Which pages a numpy array gets is not the caller's choice: numpy asks for huge pages
(``MADV_HUGEPAGE``) for allocations from 4 MiB, and the system grants them where transparent
huge pages are ``always`` or ``madvise``; a smaller array gets 4 KiB pages, unless it reuses
heap memory that an earlier large array had asked for huge pages on. So the same benchmark
gives different times for cma depending on what ran before it in the process. A buffer from
:func:`array` with ``"small"`` or ``"huge"`` is a fresh mapping of its own whose backing does
not depend on that history.
"""

from __future__ import annotations

import math
import mmap
import re

import numpy as np

PAGES = ("numpy", "small", "huge")
""":func:`array`'s choices: numpy's own allocation (``np.empty``), 4 KiB pages, huge pages."""

HUGE_BYTES = 2 << 20  # a transparent huge page on x86-64 (and on arm64 with 4 KiB pages)
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def array(shape: int | tuple[int, ...], dtype: np.dtype | type, pages: str = "numpy") -> np.ndarray:
    """An uninitialised array like ``np.empty(shape, dtype)`` on the pages ``pages`` asks for.

    ``"small"``: a private anonymous mapping that refuses huge pages (``MADV_NOHUGEPAGE``), so
    4 KiB pages whatever the system's setting. ``"huge"``: a mapping that asks for them
    (``MADV_HUGEPAGE``) with the array starting on a 2 MiB boundary, so every whole 2 MiB of it
    can have one where the system grants them (not where transparent huge pages are ``never``;
    :func:`huge_bytes` says what it got, once touched). ``"numpy"``: ``np.empty``."""
    if pages not in PAGES:
        raise ValueError(f"pages must be one of {', '.join(PAGES)}, not {pages!r}")
    dt = np.dtype(dtype)
    if pages == "numpy":
        return np.empty(shape, dt)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(dims) * dt.itemsize
    huge = pages == "huge"
    mapping = mmap.mmap(-1, nbytes + (HUGE_BYTES if huge else 0) or 1, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        mapping.madvise(advice)
    raw = np.frombuffer(mapping, np.uint8)  # (the array keeps the mapping alive through its base)
    start = (-raw.ctypes.data) % HUGE_BYTES if huge else 0
    return raw[start : start + nbytes].view(dt).reshape(dims)


def huge_bytes(a: np.ndarray) -> int:
    """How many bytes of the memory mapped around ``a``'s data are on huge pages now
    (``AnonHugePages`` of every mapping that overlaps it, in ``/proc/self/smaps``; 0 where that
    cannot be read). Slow (it reads the whole file): for
    tests and reports, never a call's path."""
    if a.nbytes == 0:
        return 0
    lo, hi = a.ctypes.data, a.ctypes.data + a.nbytes - 1
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
                if head:
                    start, end = int(head[1], 16), int(head[2], 16)
                    inside = start <= hi and lo < end
                elif inside and line.startswith("AnonHugePages:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def thp_setting() -> str:
    """The system's transparent huge page setting (``always``, ``madvise`` or ``never``), or
    ``unknown`` where it cannot be read."""
    try:
        with open(_THP_SETTING) as f:
            chosen = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return "unknown"
    return chosen[1] if chosen else "unknown"
