"""Every rank gets the same, correct result or an error: the paths that once broke that promise.

One test (or more) per defect of the second reliability round: bad timeouts, two threads on one
communicator, a fork after connecting, blame for a dead rank, a dead rank between calls,
predictable names and failed segment creation, cleanup from another PID namespace, and the
smaller message defects.
"""

from __future__ import annotations

import atexit
import errno
import multiprocessing as mp
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest
from click.testing import CliRunner

import shmcoll
from shmcoll import (
    CollectiveMismatchError,
    CollectiveTimeout,
    CommunicatorBrokenError,
    PeerLostError,
    ShmcollError,
)
from shmcoll.cli.main import main as cli_main
from shmcoll.errors import ConcurrentCallError, ForkedCommunicatorError
from shmcoll.shm import segment as seg

BAD_TIMEOUTS = ["abc", [5], True, -1, 0, float("nan")]


# --- 1. timeouts --------------------------------------------------------------------------------
def _bad_timeout_on_rank0(comm, bad):  # type: ignore[no-untyped-def]
    x = np.full(4, comm.rank + 1.0)
    if comm.rank == 0:
        with pytest.raises((TypeError, ValueError), match="timeout"):
            comm.allreduce(x.copy(), timeout=bad)
    else:
        time.sleep(0.5)  # the peer is late: the bad call must not have sent anything meanwhile
    first = comm.allreduce(x.copy())
    second = comm.allreduce(np.full(4, 100.0 * (comm.rank + 1)))
    return first.tolist(), second.tolist()


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=repr)
def test_a_bad_timeout_fails_before_communicating_and_leaves_the_communicator_usable(pools, bad) -> None:  # type: ignore[no-untyped-def]
    results = pools.get(2).run(_bad_timeout_on_rank0, bad, timeout=60)
    assert results == [([3.0] * 4, [300.0] * 4)] * 2


def _every_method_rejects_bad_timeouts(comm):  # type: ignore[no-untyped-def]
    n, r = comm.world_size, comm.rank
    x = np.ones(n * 2)
    calls = {
        "allreduce": lambda t: comm.allreduce(x, timeout=t),
        "reduce": lambda t: comm.reduce(x, timeout=t),
        "broadcast": lambda t: comm.broadcast(x, timeout=t),
        "allgather": lambda t: comm.allgather(x, timeout=t),
        "gather": lambda t: comm.gather(x, timeout=t),
        "scatter": lambda t: comm.scatter(x.reshape(n, 2), out=np.empty(2), timeout=t),
        "reduce_scatter": lambda t: comm.reduce_scatter(x, timeout=t),
        "alltoall": lambda t: comm.alltoall(x.reshape(n, 2), timeout=t),
        "barrier": lambda t: comm.barrier(timeout=t),
        "send": lambda t: comm.send(x, dst=1, timeout=t),
        "recv": lambda t: comm.recv(x, src=1, timeout=t),
        "alloc": lambda t: comm.alloc(4, timeout=t),
        "broadcast_object": lambda t: comm.broadcast_object(1, timeout=t),
        "allgather_object": lambda t: comm.allgather_object(1, timeout=t),
        "gather_object": lambda t: comm.gather_object(1, timeout=t),
        "scatter_object": lambda t: comm.scatter_object([1] * n, timeout=t),
        "split": lambda t: comm.split(0, timeout=t),
    }
    rejected = []
    if r == 0:  # only rank 0 calls: had any of these sent anything, the checks below would fail
        for name, call in calls.items():
            for bad in ("abc", 0, float("nan")):
                with pytest.raises((TypeError, ValueError), match="timeout"):
                    call(bad)
            rejected.append(name)
    comm.barrier()
    y = comm.allreduce(np.full(3, r + 1.0), timeout=float("inf"))  # inf: no limit
    return rejected, y.tolist()


def test_every_method_validates_its_timeout_before_any_communication(pools) -> None:  # type: ignore[no-untyped-def]
    results = pools.get(2).run(_every_method_rejects_bad_timeouts, timeout=60)
    assert len(results[0][0]) == 17 and results[1][0] == []
    assert results[0][1] == results[1][1] == [3.0] * 3


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=repr)
def test_timeouts_are_validated_everywhere_they_are_given(bad, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises((TypeError, ValueError), match="timeout"):
        shmcoll.Group(2, timeout=bad)
    with pytest.raises((TypeError, ValueError), match="timeout"):
        shmcoll.spawn(len, 2, comm_timeout=bad)
    with pytest.raises((TypeError, ValueError), match="timeout"):
        shmcoll.spawn(len, 2, timeout=bad)
    if not isinstance(bad, (list, bool)):
        from shmcoll import config

        with pytest.raises(ValueError, match="SHMCOLL_TIMEOUT"):
            config.load({"SHMCOLL_TIMEOUT": str(bad)})


def _interrupted_between_parts(comm):  # type: ignore[no-untyped-def]
    """An exception that escapes half way through an object collective breaks the communicator
    on every rank, instead of leaving the ranks one call apart."""
    # Both ranks make one first, so that rank 0's next one enters its first part at once: on a
    # loaded machine the first call's setup outlasted the 0.3 s alarm, which then struck before
    # any part had started (nothing communicated: not broken, and the barrier met rank 1's call).
    comm.allgather_object("warm")
    if comm.rank == 0:

        def interrupt(signum, frame):  # type: ignore[no-untyped-def]
            raise KeyboardInterrupt

        old = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            with pytest.raises(KeyboardInterrupt):
                comm.allgather_object("x" * 100)
        finally:
            signal.signal(signal.SIGALRM, old)
        with pytest.raises(CommunicatorBrokenError):
            comm.barrier()
        return "broken"
    time.sleep(1.0)
    with pytest.raises(ShmcollError):
        comm.allgather_object("y")
    return "told"


def test_an_exception_in_the_middle_of_a_call_breaks_the_communicator_on_every_rank() -> None:
    assert shmcoll.spawn(_interrupted_between_parts, 2, timeout=120) == ["broken", "told"]


# --- 2. threads ---------------------------------------------------------------------------------
def _two_threads_one_communicator(comm, nested):  # type: ignore[no-untyped-def]
    x = np.ones(1 << 18, np.float32)
    if comm.rank == 1:
        time.sleep(0.6)
        first = comm.allgather_object(1) if nested else comm.allreduce(x.copy())[:4].tolist()
        return first, comm.allreduce(np.full(3, 5.0)).tolist(), None
    results: list[object] = []

    def first_call() -> None:
        results.append(comm.allgather_object(0) if nested else comm.allreduce(x.copy())[:4].tolist())

    t = threading.Thread(target=first_call)
    t.start()
    time.sleep(0.2)  # the first thread is waiting for rank 1 now
    errors = []
    for second in (lambda: comm.allreduce(x.copy()), lambda: comm.barrier(), lambda: comm.broadcast_object(2)):
        with pytest.raises(ConcurrentCallError, match="another thread") as info:
            second()
        errors.append(str(info.value))
    t.join(60)
    return results[0], comm.allreduce(np.full(3, 5.0)).tolist(), errors


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_a_second_thread_on_a_busy_communicator_gets_a_clear_error_and_no_wrong_result(pools, nested) -> None:  # type: ignore[no-untyped-def]
    results = pools.get(2).run(_two_threads_one_communicator, nested, timeout=60)
    expected = [0, 1] if nested else [2.0] * 4
    assert results[0][0] == results[1][0] == expected
    assert results[0][1] == results[1][1] == [10.0] * 3
    assert len(results[0][2]) == 3 and all("Nothing was done" in e for e in results[0][2])


# --- 3. fork after connect ----------------------------------------------------------------------
def _fork_after_connect(comm):  # type: ignore[no-untyped-def]
    x = np.full(4, comm.rank + 1.0)
    comm.allreduce(x)
    if comm.rank == 0:
        atexit.register(comm.close)  # as shmcoll.init() does: it must not reach the parent's state
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                comm.allreduce(np.ones(4))
                code = 1  # completed as rank 0: the defect
            except ForkedCommunicatorError:
                pass
            except BaseException:  # noqa: BLE001
                code = 2
            try:
                atexit._run_exitfuncs()  # the child's exit, without leaving this test's stack
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        atexit.unregister(comm.close)
        child = os.waitstatus_to_exitcode(status)
    else:
        child = None
        time.sleep(0.5)  # the child has come and gone by now
    y = comm.allreduce(np.full(4, 10.0 * (comm.rank + 1)))
    return child, y.tolist()


def test_a_forked_child_cannot_use_or_close_its_parents_communicator(pools) -> None:  # type: ignore[no-untyped-def]
    results = pools.get(2).run(_fork_after_connect, timeout=60)
    assert results[0][0] == 0, "the child used its parent's communicator instead of raising"
    assert results[0][1] == results[1][1] == [30.0] * 4


# --- 4. who is blamed ---------------------------------------------------------------------------
def _survivor_report(group, rank, victim, queue):  # type: ignore[no-untyped-def]
    from shmcoll.launch import _rank_process_setup

    _rank_process_setup(None)
    comm = group.connect(rank)
    x = np.ones(1 << 18, np.float32)
    comm.allreduce(x)
    outcome: tuple[object, ...] = ("no error",)
    try:
        comm.barrier()  # the victim may leave it (and die) before others have: inside the try
        if rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        for _ in range(1000):
            comm.allreduce(x)
    except PeerLostError as exc:
        outcome = ("lost", exc.dead_rank, str(exc))
    except ShmcollError as exc:
        outcome = (type(exc).__name__, None, str(exc))
    queue.put((rank, outcome))
    comm.close()


@pytest.mark.parametrize("attempt", range(2))
def test_every_survivor_blames_the_rank_that_died_at_8_ranks(attempt) -> None:  # type: ignore[no-untyped-def]
    # Ranks of a plain Group (no launcher watching, so no grace period cuts a slow survivor off).
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with shmcoll.Group(8, timeout=60) as group:
        procs = [ctx.Process(target=_survivor_report, args=(group, r, 5, queue)) for r in range(8)]
        for p in procs:
            p.start()
        try:
            got = dict(queue.get(timeout=120) for _ in range(7))
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.exitcode is None:
                    p.kill()
                    p.join()
    wrong = {rank: outcome for rank, outcome in got.items() if outcome[:2] != ("lost", 5)}
    assert sorted(got) == [0, 1, 2, 3, 4, 6, 7] and not wrong, wrong


def test_a_peer_that_left_because_of_an_abort_is_never_blamed() -> None:
    """The race behind the wrong blame, made deterministic: rank 1 aborted (it found rank 2 dead)
    and left; rank 0, waiting for rank 1, must report the abort's cause, not rank 1."""
    from shmcoll.comm import failures
    from shmcoll.engine import cpu as engine
    from shmcoll.shm import layout

    with shmcoll.Group(3) as group:
        comms = [group.connect(r) for r in range(3)]
        try:
            comms[1]._arena.abort(1, layout.ABORT_PEER_LOST, 2, 1)
            comms[1]._broken = "found rank 2 lost"
            comms[1].close()
            comms[0]._state[engine.S_WAIT_PEER] = 1
            assert failures.lost_peer(comms[0], failures.call_number(comms[0]) + 1) is None
        finally:
            for c in (comms[0], comms[2]):
                c.close()


def _mismatch_at_8(comm):  # type: ignore[no-untyped-def]
    x = np.ones(64, np.float32)
    try:
        comm.allreduce(x) if comm.rank == 0 else comm.allgather(x)
        comm.barrier()
    except ShmcollError as exc:
        return type(exc).__name__
    return "no error"


@pytest.mark.parametrize("attempt", range(2))
def test_a_mismatch_is_a_mismatch_on_every_rank_at_8_ranks(attempt) -> None:  # type: ignore[no-untyped-def]
    results = shmcoll.spawn(_mismatch_at_8, 8, timeout=180)
    assert results == [CollectiveMismatchError.__name__] * 8


# --- 5. a rank dead between calls ---------------------------------------------------------------
def _dies_between_calls(group, rank, queue):  # type: ignore[no-untyped-def]
    from shmcoll.launch import _rank_process_setup

    _rank_process_setup(None)
    comm = group.connect(rank)
    comm.barrier()
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # rank 3 is gone before anyone calls again; no launcher watches this job
    t0 = time.monotonic()
    outcomes = []
    for _ in range(2):
        try:
            comm.broadcast(np.ones(4), root=0)  # rank 0 only sends: it never waits for rank 3
            outcomes.append("completed")
        except PeerLostError as exc:
            outcomes.append(("lost", exc.dead_rank, round(time.monotonic() - t0, 2)))
            break
    queue.put((rank, outcomes))
    comm.close()


def test_a_rank_killed_between_calls_fails_the_next_call_on_every_rank() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with shmcoll.Group(4, timeout=30) as group:
        procs = [ctx.Process(target=_dies_between_calls, args=(group, r, queue)) for r in range(4)]
        for p in procs:
            p.start()
        try:
            got = dict(queue.get(timeout=90) for _ in range(3))
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.exitcode is None:
                    p.kill()
                    p.join()
    assert set(got) == {0, 1, 2}
    for rank, outcomes in got.items():
        assert len(outcomes) == 1 and outcomes[0][:2] == ("lost", 3), (rank, outcomes)
        assert outcomes[0][2] < 2.0


# --- 6. names and failed segment creation -------------------------------------------------------
def test_the_job_token_is_not_on_any_command_line() -> None:
    with shmcoll.Group(2) as group:
        children = psutil.Process().children(recursive=True)
        assert children, "no janitor process"
        for child in children:
            assert group.token not in " ".join(child.cmdline())


def test_segment_names_are_unpredictable() -> None:
    token = seg.new_token()
    names = {seg.segment_name(token, "buf0") for _ in range(100)}
    assert len(names) == 100
    assert all(seg.token_of(n) == token for n in names)


def _name_taken_on_rank0(comm, what):  # type: ignore[no-untyped-def]
    """Someone created the name the job was about to use (possible while names were derived
    from the token, which every user can read in /dev/shm): an error on every rank, no hang."""
    import shmcoll.comm.registered
    import shmcoll.shm.arena

    module = shmcoll.comm.registered if what == "alloc" else shmcoll.shm.arena
    original = module.segment_name
    taken = ""
    if comm.rank == 0:
        taken = original(comm.handle.token, "taken")
        with open(os.path.join(seg.SHM_DIR, taken), "wb") as f:
            f.write(b"x")
        module.segment_name = lambda token, part: taken
    t0 = time.monotonic()
    try:
        with pytest.raises(ShmcollError, match="could not create"):
            comm.alloc(16, timeout=10) if what == "alloc" else comm.split(0, timeout=10)
    finally:
        module.segment_name = original
        if taken:
            os.unlink(os.path.join(seg.SHM_DIR, taken))
    elapsed = time.monotonic() - t0
    buf = comm.alloc(4)  # the communicator is still usable, and creation works again
    buf[:] = comm.rank + 1
    comm.allreduce(buf)
    return elapsed, buf.tolist()


@pytest.mark.parametrize("what", ["alloc", "split"])
def test_a_name_taken_by_someone_else_is_an_error_on_every_rank(pools, what) -> None:  # type: ignore[no-untyped-def]
    results = pools.get(3).run(_name_taken_on_rank0, what, timeout=60)
    for elapsed, values in results:
        assert elapsed < 5.0
        assert values == [6.0] * 4


def _interrupted_while_mapping(comm):  # type: ignore[no-untyped-def]
    """alloc is several calls; an exception escaping between them on one rank (here while it maps
    the segment) must break the communicator everywhere, not leave the other rank with memory
    its peer never mapped."""
    import shmcoll.comm.registered

    if comm.rank == 1:

        def interrupted(name, size):  # type: ignore[no-untyped-def]
            raise KeyboardInterrupt

        original = shmcoll.comm.registered.Segment.attach
        shmcoll.comm.registered.Segment.attach = staticmethod(interrupted)  # type: ignore[method-assign]
        try:
            with pytest.raises(KeyboardInterrupt):
                comm.alloc(16)
        finally:
            shmcoll.comm.registered.Segment.attach = original  # type: ignore[method-assign]
        with pytest.raises(CommunicatorBrokenError):
            comm.barrier()
        return "broken"
    with pytest.raises(CommunicatorBrokenError, match="rank 1: failed"):
        comm.alloc(16)
    return "told"


def test_an_exception_between_the_parts_of_a_call_breaks_the_communicator_everywhere() -> None:
    assert shmcoll.spawn(_interrupted_while_mapping, 2, timeout=120) == ["told", "broken"]


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file to another user")
def test_a_segment_of_another_user_is_never_attached() -> None:
    name = seg.segment_name(seg.new_token(), "arena")
    path = os.path.join(seg.SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        os.chown(path, 65534, 65534)
        with pytest.raises(ShmcollError, match="belongs to uid 65534"):
            seg.Segment.attach(name, 4096)
    finally:
        os.unlink(path)


# --- 7. cleanup from another PID namespace ------------------------------------------------------
def _in_new_pid_namespace(*argv: str) -> subprocess.CompletedProcess[str] | None:
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0 and "unshare" in proc.stderr:
        return None  # not permitted here
    return proc


def test_cleanup_in_another_pid_namespace_keeps_a_live_jobs_segments() -> None:
    with shmcoll.Group(2) as group:  # rank 1 never connects: the arena's name stays
        comm = group.connect(0)
        try:
            path = os.path.join(seg.SHM_DIR, group.handle.name)
            proc = _in_new_pid_namespace(sys.executable, "-m", "shmcoll.cli", "cleanup")
            if proc is None:
                pytest.skip("cannot create a PID namespace here")
            assert proc.returncode == 0, proc.stderr
            assert os.path.exists(path), f"cleanup removed a live job's arena:\n{proc.stdout}"
        finally:
            comm.close()


def test_cleanup_keeps_what_it_cannot_judge_and_removes_what_is_provably_dead() -> None:
    here = seg.pid_namespace()
    dead = f"shmcoll-{seg.new_token()}-{here}-999999999-buf0.0a1b2c3d"
    foreign = f"shmcoll-{seg.new_token()}-{here + 1}-999999999-buf0.0a1b2c3d"
    live = f"shmcoll-{seg.new_token()}-{here}-{os.getpid()}-buf0.0a1b2c3d"
    for name in (dead, foreign, live):
        with open(os.path.join(seg.SHM_DIR, name), "wb") as f:
            f.write(b"x")
    try:
        result = CliRunner().invoke(cli_main, ["cleanup"])
        assert result.exit_code == 0, result.output
        assert not os.path.exists(os.path.join(seg.SHM_DIR, dead))
        assert os.path.exists(os.path.join(seg.SHM_DIR, foreign))
        assert os.path.exists(os.path.join(seg.SHM_DIR, live))
        assert f"kept /dev/shm/{foreign}: created in another PID namespace" in result.output
    finally:
        for name in (dead, foreign, live):
            if os.path.exists(os.path.join(seg.SHM_DIR, name)):
                os.unlink(os.path.join(seg.SHM_DIR, name))


# --- 8. messages, and the test suite's own leak check -------------------------------------------
def test_shmcoll_run_with_too_little_dev_shm_is_a_message_not_a_traceback(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    script = tmp_path / "s.py"
    script.write_text("import shmcoll\nshmcoll.init()\n")
    result = CliRunner().invoke(cli_main, ["run", "-n", "2", str(script)])
    assert result.exit_code == 1
    assert "/dev/shm is too small" in result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


def _frozen_rank(comm, pid_path):  # type: ignore[no-untyped-def]
    x = np.ones(1 << 16, np.float32)
    comm.allreduce(x, algorithm="ring")
    if comm.rank == 2:
        with open(pid_path, "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        with pytest.raises(ShmcollError):
            comm.barrier()
        return "resumed"
    while not os.path.exists(pid_path):
        time.sleep(0.01)
    time.sleep(0.2)
    with pytest.raises(CollectiveTimeout) as info:
        comm.allreduce(x, algorithm="ring", timeout=1.0)
    if comm.rank == 0:
        time.sleep(0.3)
        with open(pid_path) as f:
            os.kill(int(f.read()), signal.SIGCONT)
    return str(info.value)


def test_a_timeout_names_the_stopped_rank_not_a_neighbour(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = shmcoll.spawn(_frozen_rank, 3, args=(str(tmp_path / "pid"),), timeout=120)
    assert results[2] == "resumed"
    for text in results[:2]:
        assert "rank 2" in text, text
    assert any("rank 2 its process" in t and "is stopped" in t for t in results[:2]), results


def _aborted_before_first_call(comm):  # type: ignore[no-untyped-def]
    if comm.rank == 0:
        comm.abort("test")
        return ""
    time.sleep(0.3)
    with pytest.raises(CommunicatorBrokenError) as info:
        comm.barrier()
    return str(info.value)


def test_an_abort_message_never_says_call_0() -> None:
    text = shmcoll.spawn(_aborted_before_first_call, 2, timeout=60)[1]
    assert "call #0" not in text and "call #1, before its first step" in text, text


def _scatter_object_wrong_count(comm):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as info:
        comm.scatter_object([1] if comm.rank == 0 else None, root=0)
    assert comm.scatter_object(list(range(comm.world_size))) == comm.rank  # still usable
    return str(info.value)


def test_scatter_object_with_the_wrong_number_of_objects_says_so_once(pools) -> None:  # type: ignore[no-untyped-def]
    texts = pools.get(3).run(_scatter_object_wrong_count)
    assert "scatter_object: scatter_object" not in texts[0]
    assert "world_size=3 objects, got 1 objects" in texts[0]
    assert all("root rank 0" in t for t in texts[1:])


def test_the_leak_check_owns_only_its_own_jobs_segments() -> None:
    from harness import owned_segments

    here = seg.pid_namespace()
    other_jobs = f"shmcoll-{secrets.token_hex(8)}-{here}-999999999-arena.00ff00ff"  # a dead job, not ours
    path = os.path.join(seg.SHM_DIR, other_jobs)
    before = owned_segments()
    with open(path, "wb") as f:
        f.write(b"x")
    try:
        assert other_jobs not in owned_segments() - before
    finally:
        os.unlink(path)


# --- a peer that compiles kernels is late, not stuck (issue 17: kernels compile on first use) ----
def _late_peer(comm, announce: bool):  # type: ignore[no-untyped-def]
    from shmcoll import jit

    if comm.rank == 1:
        if announce:
            jit._tell(True)  # what a compile of a kernel this rank's first call needs says
        time.sleep(2.5)
        if announce:
            jit._tell(False)
    t0 = time.monotonic()
    try:
        comm.barrier()  # the communicator's timeout is 1 s
    except shmcoll.CollectiveTimeout as exc:
        return "timeout", str(exc)
    return "ok", time.monotonic() - t0


def test_waiting_for_a_compiling_peer_does_not_time_out() -> None:
    from harness import run_ranks

    waited = run_ranks(_late_peer, 2, True, comm_timeout=1.0, timeout=60)
    assert waited[0][0] == "ok" and waited[0][1] > 2.0, waited  # it waited the whole compile
    unannounced = run_ranks(_late_peer, 2, False, comm_timeout=1.0, timeout=60)  # the same delay
    assert unannounced[0][0] == "timeout" and "timed out after 1s waiting for rank 1" in unannounced[0][1]
