"""Nothing outlives a job: /dev/shm and file descriptors after kills and Ctrl-C; job isolation."""

from __future__ import annotations

import errno
import gc
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import shmcoll
from shmcoll.errors import ShmcollError
from shmcoll.shm import segment as seg
from shmcoll.shm.arena import Arena, ArenaHandle

LOOP = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import shmcoll
    comm = shmcoll.init()
    with open(sys.argv[1] + f".{comm.rank}", "w") as f:
        f.write(str(os.getpid()))
    x = np.ones(1 << 16, np.float32)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        comm.allreduce(x)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"
    except FileNotFoundError:
        return False


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _wait_for(paths: list[str], timeout: float = 60) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        texts = [_read(p) for p in paths]
        if all(texts):
            return [int(t) for t in texts]
        time.sleep(0.05)
    raise TimeoutError(f"ranks did not start: {paths}")


def _job_segments(pids: list[int]) -> list[str]:
    """Segments created by any of these processes (their pid is in the name)."""
    return [n for n in seg.list_segments() if any(f"-{p}-" in n for p in pids)]


def _start_run(tmp_path, nprocs: int = 2):  # type: ignore[no-untyped-def]
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    marker = str(tmp_path / "pid")
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmcoll.cli", "run", "-n", str(nprocs), str(script), marker],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C's default action in the launcher and so in its ranks, whatever this test run
        # inherited: a shell ignores SIGINT for its background jobs, and a Python started so
        # raises no KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    ranks = _wait_for([f"{marker}.{r}" for r in range(nprocs)])
    return proc, ranks


def test_sigkill_of_the_launcher_leaves_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc, ranks = _start_run(tmp_path)
    time.sleep(0.3)
    proc.kill()
    proc.wait(timeout=30)
    end = time.monotonic() + 10
    while time.monotonic() < end and any(_alive(p) for p in ranks):
        time.sleep(0.05)
    assert not any(_alive(p) for p in ranks), "ranks outlived their launcher"
    end = time.monotonic() + 10
    while time.monotonic() < end and _job_segments([proc.pid, *ranks]):
        time.sleep(0.05)  # the janitor runs when the launcher's pipe closes
    assert _job_segments([proc.pid, *ranks]) == []


def test_ctrl_c_in_shmcoll_run_stops_everything(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc, ranks = _start_run(tmp_path, nprocs=3)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not any(_alive(p) for p in ranks)
    assert _job_segments([proc.pid, *ranks]) == []


SPAWNER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import shmcoll

    def work(comm, marker):
        with open(marker + f".{comm.rank}", "w") as f:
            f.write(str(os.getpid()))
        x = np.ones(1024, np.float32)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            comm.allreduce(x)

    if __name__ == "__main__":
        shmcoll.spawn(work, nprocs=2, args=(sys.argv[1],), timeout=120)
""")


def test_sigkill_of_a_spawning_parent_leaves_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNER)
    marker = str(tmp_path / "pid")
    proc = subprocess.Popen([sys.executable, str(script), marker])
    ranks = _wait_for([f"{marker}.{r}" for r in range(2)])
    proc.kill()
    proc.wait(timeout=30)
    end = time.monotonic() + 10
    while time.monotonic() < end and (any(_alive(p) for p in ranks) or _job_segments([proc.pid, *ranks])):
        time.sleep(0.05)
    assert not any(_alive(p) for p in ranks)
    assert _job_segments([proc.pid, *ranks]) == []


def _noop(comm):  # type: ignore[no-untyped-def]
    comm.allreduce(np.ones(3))
    return comm.rank


def _fds() -> int:
    gc.collect()  # garbage of earlier tests (a mapping holds a descriptor) is not this test's leak
    return len(os.listdir("/proc/self/fd"))


def test_no_file_descriptor_leaks() -> None:
    shmcoll.spawn(_noop, nprocs=2, timeout=120)  # first run: imports, caches
    before = _fds()
    for _ in range(3):
        shmcoll.spawn(_noop, nprocs=2, timeout=120)
    for _ in range(20):
        with shmcoll.Group(1) as group:
            comm = group.connect(0)
            comm.allreduce(np.ones(2))
            comm.close()
    assert _fds() == before


def test_segments_are_private_and_refuse_other_jobs() -> None:
    with shmcoll.Group(2) as group:
        path = os.path.join(seg.SHM_DIR, group.handle.name)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        wrong = ArenaHandle(
            group.handle.name, group.handle.size, 2, group.handle.nslots, group.handle.slot_bytes, "0123456789abcdef"
        )
        with pytest.raises(ShmcollError, match="job token"):
            Arena.attach(wrong)
        other = ArenaHandle(
            group.handle.name, group.handle.size, 3, group.handle.nslots, group.handle.slot_bytes, group.handle.token
        )
        with pytest.raises(ShmcollError, match="world_size|bytes"):
            Arena.attach(other)
    name = seg.segment_name(seg.new_token(), "bogus")
    with open(os.path.join(seg.SHM_DIR, name), "wb") as f:
        f.write(b"\0" * 4096)
    try:
        with pytest.raises(ShmcollError, match="magic"):
            Arena.attach(ArenaHandle(name, 4096, 1, 1, 64, name.split("-")[1]))
    finally:
        os.unlink(os.path.join(seg.SHM_DIR, name))


def test_two_jobs_side_by_side(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "job.py"
    script.write_text(
        "import numpy as np, shmcoll\ncomm = shmcoll.init()\n"
        "x = np.full(1000, comm.rank, np.int64)\n"
        "for _ in range(300):\n    comm.allreduce(x, op='max')\n"
        "if comm.rank == 0:\n    print('OK', x[0])\n"
    )
    cmd = [sys.executable, "-m", "shmcoll.cli", "run", "-n", "2", "--no-tag-output", str(script)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.strip() == "OK 1"


def test_dev_shm_too_small_is_a_clear_error(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ShmcollError) as info:
        shmcoll.Group(8, slot_bytes=1 << 20, nslots=4)
    text = str(info.value)
    assert "/dev/shm is too small" in text and "SHMCOLL_SLOT_BYTES" in text and "bytes" in text
    assert "8 ranks" in text


def test_unreceived_messages_are_reported_at_close() -> None:
    assert shmcoll.spawn(_stray_send, nprocs=2, timeout=120) == [0, 1]


def _stray_send(comm):  # type: ignore[no-untyped-def]
    import logging

    seen: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("shmcoll").addHandler(Grab())
    comm.barrier()
    if comm.rank == 0:
        comm.send(np.ones(3), dst=1)  # rank 1 never receives it
        return 0
    time.sleep(0.5)  # let it land
    comm.close()
    return sum("never received" in m for m in seen)


DEBUG_JOB = textwrap.dedent("""
    import numpy as np
    import shmcoll
    comm = shmcoll.init()
    comm.allreduce(np.ones(10, np.float32))
    comm.broadcast(np.ones(3), root=1)
""")


def test_debug_logs_are_rank_prefixed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "job.py"
    script.write_text(DEBUG_JOB)
    env = dict(os.environ, SHMCOLL_DEBUG="TRACE")
    proc = subprocess.run(
        [sys.executable, "-m", "shmcoll.cli", "run", "-n", "2", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    for rank in (0, 1):
        assert any(f"[rank {rank}]" in ln and "algorithm direct" in ln and "allreduce(count=10" in ln for ln in lines)
        assert any(f"[rank {rank}]" in ln and "TRACE" in ln and "took" in ln for ln in lines)


HANG = textwrap.dedent("""
    import time
    import numpy as np
    import shmcoll

    def stuck(comm):
        if comm.rank == 0:
            time.sleep(60)  # never joins: rank 1 waits in the allreduce
        comm.allreduce(np.ones(4))

    if __name__ == "__main__":
        shmcoll.spawn(stuck, nprocs=2, timeout=15, comm_timeout=120)
""")


def test_launcher_deadline_dumps_every_ranks_stack(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "timed out after 15" in proc.stderr
    # faulthandler's dump of each rank: rank 0 in time.sleep, rank 1 inside the allreduce.
    assert proc.stderr.count("Current thread") + proc.stderr.count("Thread 0x") >= 2, proc.stderr[-3000:]
    assert "in stuck" in proc.stderr and "allreduce" in proc.stderr
