"""The janitor: a tiny separate process that removes a job's names from ``/dev/shm`` when the
process that owns the job ends, however it ends (``SIGKILL`` included).

It runs in a session of its own (so Ctrl-C does not reach it) and waits for its end of a pipe
to close, which the kernel does when the owner exits; then it unlinks every name carrying the
job's token. Names are unlinked once every rank has mapped them, so this only matters for a
job that dies during start-up, or for segments created later (``split``, ``alloc``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import weakref

# The token comes through the pipe, never the command line: `ps` shows argv to every user.
_JANITOR = (
    "import os, sys\n"
    "token = sys.stdin.buffer.readline().strip().decode()\n"
    "while sys.stdin.buffer.read(65536):\n"
    "    pass\n"
    "tag = 'shmcoll-' + token + '-'\n"
    "for name in os.listdir('/dev/shm'):\n"
    "    if name.startswith(tag):\n"
    "        try:\n"
    "            os.unlink(os.path.join('/dev/shm', name))\n"
    "        except OSError:\n"
    "            pass\n"
)


class Janitor:
    """Unlinks the job's segment names when the owning process ends, however it ends."""

    def __init__(self, token: str) -> None:
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-S", "-c", _JANITOR],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write(token.encode() + b"\n")
        self._proc.stdin.flush()
        _JANITORS.add(self)

    def forget_in_child(self) -> None:
        # A forked child must not hold the janitor's pipe open: the janitor cleans up when the
        # owner ends, and would wait for the child too.
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                os.close(self._proc.stdin.fileno())
        self._proc = None

    def close(self) -> None:
        if self._proc is not None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None


_JANITORS: weakref.WeakSet[Janitor] = weakref.WeakSet()


def _forget_janitors() -> None:
    for janitor in list(_JANITORS):
        janitor.forget_in_child()


os.register_at_fork(after_in_child=_forget_janitors)
