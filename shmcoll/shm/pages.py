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

import ctypes
import math
import mmap
import os
import re
import threading
import weakref
from typing import Any

import numpy as np

PAGES = ("numpy", "small", "huge")
""":func:`array`'s choices: numpy's own allocation (``np.empty``), 4 KiB pages, huge pages."""

HUGE_BYTES = 2 << 20  # a transparent huge page on x86-64 (and on arm64 with 4 KiB pages)
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def array(shape: int | tuple[int, ...], dtype: np.dtype | type, pages: str = "numpy") -> np.ndarray:
    """An uninitialised array like ``np.empty(shape, dtype)`` on the pages ``pages`` asks for.

    ``"small"``: a private anonymous mapping that refuses huge pages (``MADV_NOHUGEPAGE``), so
    4 KiB pages whatever the system's setting. ``"huge"``: a mapping that asks for them
    (``MADV_HUGEPAGE``) with the array starting on a 2 MiB boundary and the mapping going on to
    the next one past its end, so every 2 MiB it touches can have one (a smaller array too) where
    the system grants them (not where transparent huge pages are ``never``;
    :func:`huge_bytes` says what it got, once touched). ``"numpy"``: ``np.empty``."""
    if pages not in PAGES:
        raise ValueError(f"pages must be one of {', '.join(PAGES)}, not {pages!r}")
    dt = np.dtype(dtype)
    if pages == "numpy":
        return np.empty(shape, dt)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(dims) * dt.itemsize
    huge = pages == "huge"
    # (huge: whole huge pages past an aligned start, so that a buffer under 2 MiB has one too)
    size = -(-nbytes // HUGE_BYTES) * HUGE_BYTES + HUGE_BYTES if huge else nbytes
    mapping = mmap.mmap(-1, size or 1, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
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


# --- what backs a buffer, fast enough for a call's path (Linux 6.7+) ---------------------------
# The PAGEMAP_SCAN ioctl on /proc/self/pagemap reports runs of pages by category; the two asked
# for here are "present" and "huge" (linux/fs.h: PAGE_IS_PRESENT, PAGE_IS_HUGE). It walks the page
# table: 3-6 us for a buffer on huge pages, but 9 us for 2 MiB and 190 us for 64 MiB of 4 KiB
# pages (the Zen 5 VM, from Python), so answers are cached (:func:`huge_share`).
class _ScanArg(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "size",
            "flags",
            "start",
            "end",
            "walk_end",
            "vec",
            "vec_len",
            "max_pages",
            "category_inverted",
            "category_mask",
            "category_anyof_mask",
            "return_mask",
        )
    ]


class _Run(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArg) << 16) | (ord("f") << 8) | 16  # _IOWR('f', 16, ...)
_PRESENT, _HUGE = 1 << 3, 1 << 6
_RUNS = 64  # runs returned per ioctl; a buffer with more continues where the walk ended
_SMALL_PAGE = 4096


class _Scanner:
    """One open ``/proc/self/pagemap`` and its argument block (under a lock: communicators in
    other threads may scan at once); ``ok`` is False where the kernel has no PAGEMAP_SCAN."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.ok = False
        self.fd = -1
        try:
            self.fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            libc = ctypes.CDLL(None, use_errno=True)
            self.ioctl = libc.ioctl
            self.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
            self.ioctl.restype = ctypes.c_long
        except (OSError, AttributeError):
            return
        self.runs = (_Run * _RUNS)()
        self.arg = _ScanArg(size=ctypes.sizeof(_ScanArg), vec=ctypes.addressof(self.runs), vec_len=_RUNS)
        self.arg.return_mask = self.arg.category_anyof_mask = _PRESENT | _HUGE
        probe = np.zeros(1, np.uint8)
        self.ok = self.scan(probe.ctypes.data, 1) is not None

    def scan(self, address: int, nbytes: int) -> tuple[int, int] | None:
        """(bytes on huge pages, bytes present) of the pages that hold ``[address, address +
        nbytes)``; None where the kernel refuses."""
        lo = address & ~(_SMALL_PAGE - 1)
        hi = (address + nbytes + _SMALL_PAGE - 1) & ~(_SMALL_PAGE - 1)
        huge = present = 0
        with self.lock:
            arg, runs = self.arg, self.runs
            while lo < hi:
                arg.start, arg.end = lo, hi
                got = self.ioctl(self.fd, _PAGEMAP_SCAN, ctypes.addressof(arg))
                if got < 0:
                    return None
                for i in range(got):
                    span = runs[i].end - runs[i].start
                    if runs[i].categories & _PRESENT:
                        present += span
                    if runs[i].categories & _HUGE:
                        huge += span
                if arg.walk_end <= lo:
                    break
                lo = arg.walk_end
        return huge, present


_scanner: _Scanner | None = None
# (address, size) -> (a weak reference to the object that owns the memory, or None, share)
_SHARES: dict[tuple[int, int], tuple[Any, float]] = {}
_SHARES_MAX = 256  # buffers remembered; a program with more starts over


def scanner() -> _Scanner:
    global _scanner
    if _scanner is None or _scanner.pid != os.getpid():  # (a forked child has its own page table)
        if _scanner is not None and _scanner.fd >= 0:
            os.close(_scanner.fd)
        _scanner = _Scanner()
        _SHARES.clear()
    return _scanner


def can_scan() -> bool:
    """Whether this kernel reports page sizes cheaply (``PAGEMAP_SCAN``, Linux 6.7 and later)."""
    return scanner().ok


def _owner(a: np.ndarray) -> Any:
    """A weak reference to the object that owns ``a``'s memory (the end of its chain of bases),
    or None where it takes none."""
    owner: Any = a
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
    try:
        return weakref.ref(owner)
    except TypeError:
        return None


def huge_share(a: np.ndarray) -> tuple[float, bool]:
    """(share of ``a``'s memory on huge pages now, whether that is settled); (0.0, True) where
    it cannot be read. Settled, and remembered per buffer, once every page is present: then only
    the kernel's background collapse could change it (a stale answer costs speed, never
    correctness). Remembered by address and size, and by the object that owns the memory where
    it takes a weak reference, so that another buffer mapped where a freed one was (the common
    case for same-sized arrays) is looked at anew. A buffer not yet touched all over is looked at
    again at its next call."""
    nbytes = a.nbytes
    if nbytes <= 0:
        return 0.0, True
    address = a.ctypes.data
    key = (address, nbytes)
    owner = _owner(a)
    known = _SHARES.get(key)
    if known is not None and (known[0] is None or (owner is not None and known[0]() is owner())):
        return known[1], True
    s = scanner()
    got = s.scan(address, nbytes) if s.ok else None
    if got is None:
        return 0.0, True
    huge, present = got
    span = ((address + nbytes + _SMALL_PAGE - 1) & ~(_SMALL_PAGE - 1)) - (address & ~(_SMALL_PAGE - 1))
    share = huge / span
    if present < span:
        return share, False
    if len(_SHARES) >= _SHARES_MAX:
        _SHARES.clear()
    _SHARES[key] = (owner, share)
    return share, True
