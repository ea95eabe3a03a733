"""Shared-memory segments: create, attach, unlink, and find stale ones.

Segments are files in ``/dev/shm`` opened with ``os.open`` and mapped with ``mmap``; Python's
``multiprocessing.shared_memory`` is not used because on 3.11 its resource tracker unlinks
segments that other processes still own and warns about leaks that are not there.

Names are ``shmcoll-<token>-<pidns>-<pid>-<what>.<random>``: the job's random token (two jobs
never meet), the creating process's PID namespace and pid (so ``shmcoll cleanup`` can tell a
live job from a dead one, and knows when it *cannot*: a pid from another namespace proves
nothing), what the segment is, and fresh random digits. Every user can list ``/dev/shm``, so a
job's token is no secret; the random part makes each name unpredictable all the same, so no one
can create a name before the job does. Files are created with mode 0600 (same user only) and
``O_EXCL``, and a segment owned by another user is never attached. Space is reserved
with ``posix_fallocate`` up front, so a too-small ``/dev/shm`` is a clear error at start-up
instead of a SIGBUS in the middle of a collective. A segment's name is unlinked as soon as every
rank has mapped it; only the mappings keep the memory alive after that, and the kernel frees it
when the last process exits, however it exits.
"""

from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import re
import secrets
import shutil

import numpy as np

from shmcoll import config
from shmcoll.errors import ShmcollError

SHM_DIR = "/dev/shm"
PREFIX = "shmcoll-"
_NAME_RE = re.compile(r"^shmcoll-(?P<token>[0-9a-f]{16})-(?P<ns>\d+)-(?P<pid>\d+)-(?P<what>[A-Za-z0-9_]+)\.[0-9a-f]+$")


def pid_namespace() -> int:
    """This process's PID namespace (the inode of ``/proc/self/ns/pid``; 0 if unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


_PID_NS = pid_namespace()  # a process never changes its own PID namespace


_ISSUED: set[str] = set()


def new_token() -> str:
    """A fresh random job token (16 hex digits), also appended to ``SHMCOLL_TOKEN_LOG`` if set."""
    token = secrets.token_hex(8)
    _ISSUED.add(token)
    log_path = config.get().token_log
    if log_path:
        try:
            with open(log_path, "a") as f:
                f.write(token + "\n")
        except OSError:
            pass
    return token


def issued_tokens() -> frozenset[str]:
    """The job tokens this process created (tests check that none of their segments remain)."""
    return frozenset(_ISSUED)


def token_of(name: str) -> str | None:
    parts = parse_name(name)
    return parts.token if parts else None


def segment_name(token: str, what: str) -> str:
    """A fresh, unpredictable name for a segment of job ``token`` created by this process."""
    return f"{PREFIX}{token}-{_PID_NS}-{os.getpid()}-{what}.{secrets.token_hex(4)}"


@dataclasses.dataclass(frozen=True)
class NameParts:
    token: str
    pid_namespace: int
    pid: int
    what: str


def parse_name(name: str) -> NameParts | None:
    """The parts of a segment name, or None if it is not one of ours."""
    m = _NAME_RE.match(name)
    if m is None:
        return None
    return NameParts(m.group("token"), int(m.group("ns")), int(m.group("pid")), m.group("what"))


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
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise ShmcollError(
                f"cannot create {path} for {what_for or 'shmcoll'}: the name already exists "
                f"(another process created it first)"
            ) from None
        except OSError as exc:
            raise ShmcollError(f"cannot create {path} for {what_for or 'shmcoll'}: {exc.strerror}") from None
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
            unlink_path(path)
            raise
        try:
            return cls(name, fd, size, owner=True)
        except BaseException:
            unlink_path(path)
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
        except OSError as exc:
            raise ShmcollError(f"cannot open shared-memory segment {name}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise ShmcollError(
                    f"segment {name} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): "
                    f"refusing to attach to it"
                )
            if st.st_size != size:
                raise ShmcollError(f"segment {name} has {st.st_size} bytes, expected {size}")
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
            unlink_path(self.path)

    def close(self) -> None:
        """Unmap. Arrays still viewing the segment keep the mapping (and its descriptor) alive
        until they are collected: owners drop their views first."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # numpy views still reference it: the mapping lives until they are gone
            self._mm = None


def unlink_path(path: str) -> None:
    """Remove a name from ``/dev/shm`` if it is still there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def unlink_job(token: str) -> list[str]:
    """Remove every segment name of the job ``token``; returns the names removed."""
    removed = []
    for entry in _entries():
        if token_of(entry) == token:
            unlink_path(os.path.join(SHM_DIR, entry))
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
