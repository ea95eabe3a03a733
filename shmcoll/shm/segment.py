"""Shared-memory segments: create, attach, unlink, and find stale ones.

Segments are files in ``/dev/shm`` opened with ``os.open`` and mapped with ``mmap``; Python's
``multiprocessing.shared_memory`` is not used because on 3.11 its resource tracker unlinks
segments that other processes still own and warns about leaks that are not there.

Names are ``shmcoll-<token>-<pid>-<what>``: the job's random token (two jobs never meet), the
creating process's pid (so ``shmcoll cleanup`` can tell a live job from a dead one) and what the
segment is. Files are created with mode 0600 (same user only) and ``O_EXCL``. Space is reserved
with ``posix_fallocate`` up front, so a too-small ``/dev/shm`` is a clear error at start-up
instead of a SIGBUS in the middle of a collective. A segment's name is unlinked as soon as every
rank has mapped it; only the mappings keep the memory alive after that, and the kernel frees it
when the last process exits, however it exits.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import shutil
import time

import numpy as np
import psutil

from shmcoll.errors import ShmcollError

SHM_DIR = "/dev/shm"
PREFIX = "shmcoll-"
_NAME_RE = re.compile(r"^shmcoll-(?P<token>[0-9a-f]{16})-(?P<pid>\d+)-(?P<what>[A-Za-z0-9_.]+)$")


_ISSUED: set[str] = set()


def new_token() -> str:
    """A fresh random job token (16 hex digits)."""
    token = secrets.token_hex(8)
    _ISSUED.add(token)
    return token


def issued_tokens() -> frozenset[str]:
    """The job tokens this process created (tests check that none of their segments remain)."""
    return frozenset(_ISSUED)


def token_of(name: str) -> str | None:
    m = _NAME_RE.match(name)
    return m.group("token") if m else None


def segment_name(token: str, what: str, pid: int | None = None) -> str:
    return f"{PREFIX}{token}-{os.getpid() if pid is None else pid}-{what}"


class Segment:
    """One mapped shared-memory segment."""

    def __init__(self, name: str, fd: int, size: int, owner: bool) -> None:
        """Map ``fd`` and close it: the mapping keeps its own duplicate until :meth:`close`."""
        self.name = name
        self.size = size
        self.owner = owner
        try:
            self._mm: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._linked = True

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @classmethod
    def create(cls, name: str, size: int, what_for: str = "") -> Segment:
        """Create and map a new zero-filled segment of ``size`` bytes."""
        if not os.path.isdir(SHM_DIR):
            raise ShmcollError(f"{SHM_DIR} does not exist: shmcoll needs POSIX shared memory (Linux)")
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, max(size, 1))
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG):
                    free = shutil.disk_usage(SHM_DIR).free
                    raise ShmcollError(
                        f"{SHM_DIR} is too small: {what_for or name} needs {size:,} bytes, "
                        f"{free:,} are free. Lower SHMCOLL_SLOT_BYTES or SHMCOLL_NSLOTS (the "
                        f"footprint formula is in shmcoll.shm.layout), or enlarge {SHM_DIR} "
                        f"(docker: --shm-size)."
                    ) from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            _unlink_path(path)
            raise
        try:
            return cls(name, fd, size, owner=True)
        except BaseException:
            _unlink_path(path)
            raise

    @classmethod
    def attach(cls, name: str, size: int) -> Segment:
        """Map an existing segment created by another process."""
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ShmcollError(
                f"shared-memory segment {name} is gone: its job ended, or every rank already "
                f"attached and it was unlinked"
            ) from None
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise ShmcollError(f"segment {name} has {actual} bytes, expected {size}")
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, size, owner=False)

    def array(self, dtype: np.dtype | type = np.uint8) -> np.ndarray:
        """The whole segment as a 1-d numpy array of ``dtype`` (a view, no copy)."""
        assert self._mm is not None, "segment is closed"
        return np.frombuffer(self._mm, dtype=dtype)

    def unlink(self) -> None:
        """Remove the name; mappings stay valid. Idempotent."""
        if self._linked:
            self._linked = False
            _unlink_path(self.path)

    def close(self) -> None:
        """Unmap. Arrays still viewing the segment keep the mapping (and its descriptor) alive
        until they are collected: owners drop their views first."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # numpy views still reference it: the mapping lives until they are gone
            self._mm = None


def _unlink_path(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def unlink_job(token: str) -> list[str]:
    """Remove every segment name of the job ``token``; returns the names removed."""
    removed = []
    for entry in _entries():
        m = _NAME_RE.match(entry)
        if m and m.group("token") == token:
            _unlink_path(os.path.join(SHM_DIR, entry))
            removed.append(entry)
    return removed


def _entries() -> list[str]:
    try:
        return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(PREFIX))
    except FileNotFoundError:
        return []


def list_segments() -> list[str]:
    """Every ``shmcoll-*`` name in ``/dev/shm``."""
    return _entries()


def _creator_alive(pid: int, mtime: float) -> bool:
    """Whether the process that created a segment at ``mtime`` may still be running.

    A pid that now belongs to a process started after the segment was written is a reused pid:
    the creator is gone.
    """
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return proc.create_time() <= mtime + 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return False


def stale_segments(min_age_s: float = 0.0) -> list[str]:
    """Names whose creating process is gone (and older than ``min_age_s``)."""
    stale = []
    now = time.time()
    for entry in _entries():
        path = os.path.join(SHM_DIR, entry)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if st.st_uid != os.getuid() or now - st.st_mtime < min_age_s:
            continue
        m = _NAME_RE.match(entry)
        if m is None:
            continue
        if not _creator_alive(int(m.group("pid")), st.st_mtime):
            stale.append(entry)
    return stale


def cleanup_stale(min_age_s: float = 0.0) -> list[str]:
    """Unlink the stale segments (never a live job's); returns the names removed."""
    removed = stale_segments(min_age_s)
    for name in removed:
        _unlink_path(os.path.join(SHM_DIR, name))
    return removed
