"""Which names in ``/dev/shm`` belong to dead jobs: what ``shmcoll cleanup`` may remove.

A name is removed only when shmcoll can *prove* its job is gone; whatever it cannot judge stays.
``/dev/shm`` may be shared by processes in other PID namespaces (containers run with
``--ipc=host``), where a pid means another process or nothing at all, so a pid is evidence only
when the segment's creator ran in this namespace (the name records which). The evidence:

1. An arena (it carries its ranks' liveness mutexes, :mod:`shmcoll.shm.liveness`) with a rank
   holding its mutex is alive, in whatever namespace; one whose every attached rank the kernel
   marked dead, or that closed, is dead.
2. Otherwise, for a creator in this namespace: alive while a process with its pid exists, is not a
   zombie and started before the segment was written (a later one reuses the pid); else dead.
3. Otherwise (another namespace, no arena evidence): unknown, and kept.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import time

import numpy as np
import psutil

from shmcoll.shm import layout, liveness
from shmcoll.shm.segment import SHM_DIR, list_segments, parse_name, pid_namespace, unlink_path


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What is known of one segment: ``state`` is ``"stale"``, ``"live"`` or ``"unknown"``."""

    name: str
    state: str
    reason: str


def _creator_alive(pid: int, mtime: float) -> bool:
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return proc.create_time() <= mtime + 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return False


def _arena_evidence(path: str) -> str | None:
    """``"alive"``, ``"dead"`` or None (no evidence: not an arena, or no rank ever attached)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size < layout.LINE * 3:
            return None
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            words = np.frombuffer(mm, np.int64)
            try:
                if int(words[layout.H_MAGIC]) != layout.MAGIC or int(words[layout.H_VERSION]) != layout.VERSION:
                    return None
                n = int(words[layout.H_WORLD_SIZE])
                if not 1 <= n <= 1 << 16 or int(words[layout.H_TOTAL]) != size:
                    return None
                lay = layout.Layout(n, int(words[layout.H_NSLOTS]), int(words[layout.H_SLOT_BYTES]))
                attached = gone = 0
                for rank in range(n):
                    if int(words[lay.rank_word(rank, layout.R_PID)]) == 0:
                        continue
                    attached += 1
                    lock = liveness.state(int(words[lay.live_word(rank)]) & 0xFFFFFFFF)
                    if lock == "held":
                        return "alive"
                    closed = int(words[lay.rank_word(rank, layout.R_STATE)]) in (
                        layout.STATE_EXITED,
                        layout.STATE_FAILED,
                    )
                    if lock == "died" or closed:
                        gone += 1
                return "dead" if attached and gone == attached else None
            finally:
                del words
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def judge(name: str) -> Verdict:
    """The evidence about one ``shmcoll-*`` name (see the module docstring)."""
    path = os.path.join(SHM_DIR, name)
    parts = parse_name(name)
    if parts is None:
        return Verdict(name, "unknown", "not a name this version of shmcoll writes")
    try:
        mtime = os.stat(path).st_mtime
    except FileNotFoundError:
        return Verdict(name, "live", "removed meanwhile")
    evidence = _arena_evidence(path)
    if evidence == "alive":
        return Verdict(name, "live", "a rank holds its liveness lock")
    if evidence == "dead":
        return Verdict(name, "stale", "every rank that attached has died or left")
    here = pid_namespace()
    if parts.pid_namespace == here and here != 0:
        if _creator_alive(parts.pid, mtime):
            return Verdict(name, "live", f"its creator (pid {parts.pid}) is running")
        return Verdict(name, "stale", f"its creator (pid {parts.pid}) is gone")
    why = f"created in another PID namespace ({parts.pid_namespace}): its creator cannot be seen from here"
    return Verdict(name, "unknown", why)


def survey(min_age_s: float = 0.0) -> list[Verdict]:
    """A verdict on every ``shmcoll-*`` name of this user older than ``min_age_s``."""
    out = []
    now = time.time()
    for name in list_segments():
        try:
            st = os.stat(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            continue
        if st.st_uid != os.getuid() or now - st.st_mtime < min_age_s:
            continue
        out.append(judge(name))
    return out


def stale_segments(min_age_s: float = 0.0) -> list[str]:
    """Names whose job is provably gone (and older than ``min_age_s``)."""
    return [v.name for v in survey(min_age_s) if v.state == "stale"]


def cleanup_stale(min_age_s: float = 0.0) -> list[str]:
    """Unlink the stale segments (never a live job's, never one it cannot judge); returns them."""
    removed = stale_segments(min_age_s)
    for name in removed:
        unlink_path(os.path.join(SHM_DIR, name))
    return removed
