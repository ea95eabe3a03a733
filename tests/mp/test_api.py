"""The API beyond the matrix: launch modes, point to point, objects, split, argument errors."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

import shmcoll
from shmcoll import ReduceOp
from shmcoll.comm import bind

HERE = os.path.dirname(os.path.abspath(__file__))


# --- the three ways to start ranks -----------------------------------------------------------
def _quick(comm):  # type: ignore[no-untyped-def]
    x = np.arange(6, dtype=np.float64) + comm.rank
    comm.allreduce(x)
    return comm.rank, comm.world_size, x.tolist()


def test_spawn_returns_results_by_rank() -> None:
    results = shmcoll.spawn(_quick, nprocs=3, timeout=120)
    want = (np.arange(6) * 3 + 3).tolist()
    assert results == [(r, 3, want) for r in range(3)]


def _boom(comm, bad_rank):  # type: ignore[no-untyped-def]
    if comm.rank == bad_rank:
        raise KeyError("deliberate failure")
    comm.barrier()
    return comm.rank


def test_spawn_reraises_the_failing_rank() -> None:
    with pytest.raises(shmcoll.SpawnError) as info:
        shmcoll.spawn(_boom, nprocs=3, args=(1,), timeout=120)
    err = info.value
    assert err.rank == 1
    assert "deliberate failure" in str(err) and "KeyError" in str(err)
    assert "traceback of rank 1" in str(err)
    assert isinstance(err.__cause__, KeyError)


def _group_child(group, rank, queue):  # type: ignore[no-untyped-def]
    comm = group.connect(rank)
    x = np.full(4, rank + 1, dtype=np.int32)
    comm.allreduce(x, op=ReduceOp.PROD)
    queue.put((rank, x.tolist()))
    comm.close()


def test_group_with_plain_multiprocessing() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with shmcoll.Group(world_size=3, timeout=30) as group:
        procs = [ctx.Process(target=_group_child, args=(group, r, queue)) for r in range(3)]
        for p in procs:
            p.start()
        got = sorted(queue.get(timeout=120) for _ in range(3))
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    assert got == [(r, [6, 6, 6, 6]) for r in range(3)]


SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import shmcoll
    comm = shmcoll.init()
    x = np.full(5, comm.rank, dtype=np.int64)
    comm.allreduce(x)
    objs = comm.allgather_object(sys.argv[1:])
    if comm.rank == 0:
        print("RESULT", x.tolist(), objs[-1])
    if "--fail" in sys.argv and comm.rank == comm.world_size - 1:
        raise SystemExit(7)
    if "--fail-slowly" in sys.argv and comm.rank == comm.world_size - 1:
        import time
        comm.close()  # (its peers find it lost at once, and leave before it has)
        time.sleep(1.0)
        raise SystemExit(7)
    comm.barrier()
""")


def _run_cli(tmp_path, *args, timeout=120):  # type: ignore[no-untyped-def]
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "shmcoll.cli", "run", *args[:2], str(script), *args[2:]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_shmcoll_run_and_init(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = _run_cli(tmp_path, "-n", "3", "hello")
    assert proc.returncode == 0, proc.stderr
    assert "RESULT [3, 3, 3, 3, 3] ['hello']" in proc.stdout


def test_shmcoll_run_reports_failing_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = _run_cli(tmp_path, "-n", "3", "--fail")
    assert proc.returncode == 7, proc.stderr
    assert "rank 2 exited with code 7" in proc.stderr


def test_shmcoll_run_reports_the_lost_rank_even_when_its_peers_leave_first(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The rank the others found lost is the one reported, with its exit code, even when it is
    still on its way out after they have left (a CI run saw rank 1's ``PeerLostError`` exit
    reported for rank 2's ``SystemExit(7)``)."""
    proc = _run_cli(tmp_path, "-n", "3", "--fail-slowly")
    assert proc.returncode == 7, proc.stderr
    assert "rank 2 exited with code 7" in proc.stderr


# --- point to point, barrier, objects, split --------------------------------------------------
def _p2p(comm, count):  # type: ignore[no-untyped-def]
    n, r = comm.world_size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    x = np.arange(count, dtype=np.float32) + 1000 * r
    buf = np.empty(count, np.float32)
    if r % 2 == 0:
        comm.send(x, dst=right)
        comm.recv(buf, src=left)
    else:
        comm.recv(buf, src=left)
        comm.send(x, dst=right)
    np.testing.assert_array_equal(buf, np.arange(count, dtype=np.float32) + 1000 * left)
    comm.barrier()
    return True


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_send_recv_ring(pools, world_size: int) -> None:  # type: ignore[no-untyped-def]
    pool = pools.get(world_size, slot_bytes=64, nslots=2)
    for count in (0, 1, 7, 100):
        assert pool.run(_p2p, count) == [True] * world_size


def _probe(comm):  # type: ignore[no-untyped-def]
    x = np.arange(5, dtype=np.int64)
    if comm.rank == 1:
        comm.barrier()  # rank 0's barrier message to us is consumed here; the next one is p2p
        deadline = time.monotonic() + 10
        while comm.iprobe(0) is None:
            assert time.monotonic() < deadline, "message never arrived"
            time.sleep(0.001)
        comm.recv(x, src=0)
        assert comm.iprobe(0) is None
        return x.tolist()
    comm.barrier()
    if comm.rank == 0:
        comm.send(x * 2, dst=1)
        with pytest.raises(ValueError, match="out of range"):
            comm.iprobe(comm.world_size)
    return None


def test_probe(pools) -> None:  # type: ignore[no-untyped-def]
    pool = pools.get(3, slot_bytes=64, nslots=2)
    assert pool.run(_probe)[1] == [0, 2, 4, 6, 8]


def _objects_others(comm):  # type: ignore[no-untyped-def]
    """What the other ranks see when rank 1 passes an unpicklable object."""
    if comm.rank == 1:
        with pytest.raises(TypeError, match="pickle"):
            comm.allgather_object(lambda: 1)
    else:
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\] could not pickle"):
            comm.allgather_object(comm.rank)
    # The communicator is still healthy afterwards.
    assert comm.allgather_object(comm.rank) == list(range(comm.world_size))
    return True


def test_unpicklable_object_fails_every_rank_cleanly(pools) -> None:  # type: ignore[no-untyped-def]
    pool = pools.get(3, slot_bytes=64, nslots=2)
    assert pool.run(_objects_others) == [True] * 3


def test_object_collectives_values(pools) -> None:  # type: ignore[no-untyped-def]
    pool = pools.get(3, slot_bytes=64, nslots=2)
    assert pool.run(_objects_no_errors) == [True] * 3


def _objects_no_errors(comm):  # type: ignore[no-untyped-def]
    r, n = comm.rank, comm.world_size
    assert comm.broadcast_object({"lr": 0.1} if r == 0 else None, root=0) == {"lr": 0.1}
    assert comm.allgather_object(("rank", r, "x" * r)) == [("rank", i, "x" * i) for i in range(n)]
    assert comm.gather_object({r}, root=n - 1) == ([{i} for i in range(n)] if r == n - 1 else None)
    assert comm.scatter_object([f"to {i}" for i in range(n)] if r == 0 else None, root=0) == f"to {r}"
    big = comm.broadcast_object(np.arange(10_000) if r == 1 else None, root=1)
    np.testing.assert_array_equal(big, np.arange(10_000))
    assert comm.alltoall_object([(r, j) for j in range(n)]) == [(i, r) for i in range(n)]
    assert comm.allreduce_object(r + 1) == n * (n + 1) // 2
    assert comm.allreduce_object(r + 1, "avg") == (n + 1) / 2
    assert comm.allreduce_object([r], lambda a, b: a + b) == list(range(n))  # rank order
    assert comm.allreduce_object({r}, ReduceOp.BOR) == set(range(n))
    assert comm.allreduce_object(f"{r}", max) == str(n - 1)
    assert comm.reduce_object(r, "min", root=1 % n) == (0 if r == 1 % n else None)
    return True


def _split(comm):  # type: ignore[no-untyped-def]
    r = comm.rank
    sub = comm.split(color=r % 2, key=-r)  # reversed order inside each color
    members = [i for i in range(comm.world_size) if i % 2 == r % 2][::-1]
    assert sub.world_size == len(members) and sub.rank == members.index(r)
    x = np.array([r], np.int64)
    sub.allreduce(x)
    assert x[0] == sum(members)
    nobody = comm.split(color=None if r == 0 else 1)
    assert (nobody is None) == (r == 0)
    if nobody is not None:
        assert nobody.world_size == comm.world_size - 1
        assert nobody.allgather_object(r) == list(range(1, comm.world_size))
        nobody.close()
    sub.close()
    comm.barrier()
    return True


@pytest.mark.parametrize("world_size", [1, 4, 5])
def test_split(pools, world_size: int) -> None:  # type: ignore[no-untyped-def]
    pool = pools.get(world_size, slot_bytes=64, nslots=2)
    assert pool.run(_split) == [True] * world_size


# --- wrong use fails at the call, on the rank that made it, before any communication -------------
def _bad_inputs(comm):  # type: ignore[no-untyped-def]
    n = comm.world_size
    x = np.arange(12, dtype=np.float32)
    ro = x.copy()
    ro.flags.writeable = False
    checks = [
        (lambda: comm.allreduce([1, 2, 3]), TypeError, "numpy.ndarray"),
        (lambda: comm.allreduce(x[::2]), ValueError, "C-contiguous"),
        (lambda: comm.allreduce(ro), ValueError, "read-only"),
        (lambda: comm.allreduce(x, out=np.empty(5, np.float32)), ValueError, "shape"),
        (lambda: comm.allreduce(x, out=np.empty(12, np.float64)), TypeError, "dtype"),
        (lambda: comm.allreduce(x, out=x.reshape(3, 4)), ValueError, "shape"),
        (lambda: comm.allreduce(x[:8], out=x[4:]), ValueError, "overlap"),
        (lambda: comm.allreduce(x, op=ReduceOp.BAND), ValueError, "not defined for dtype float32"),
        (lambda: comm.allreduce(np.zeros(3, np.complex64), op="min"), ValueError, "not defined"),
        (lambda: comm.allreduce(np.zeros(3, np.bool_), op=ReduceOp.AVG), ValueError, "not defined"),
        (lambda: comm.allreduce(x, op="median"), ValueError, "unknown reduction op"),
        (lambda: comm.allreduce(np.zeros(3, "U3")), TypeError, "unsupported dtype"),
        (lambda: comm.allreduce(np.zeros(3, ">f4")), TypeError, "unsupported dtype"),
        (lambda: comm.allreduce(x, algorithm="telepathy"), ValueError, "no algorithm 'telepathy'"),
        (lambda: comm.broadcast(x, root=n), ValueError, "root"),
        (lambda: comm.broadcast(x, root=-1), ValueError, "root"),
        (lambda: comm.reduce(x, root=n + 5), ValueError, "root"),
        (lambda: comm.reduce_scatter(np.zeros(n * 3 + 1, np.float32)), ValueError, "divisible"),
        (lambda: comm.alltoall(np.zeros((n + 1, 2), np.float32)), ValueError, "world_size"),
        (
            lambda: comm.scatter(None, root=0, out=None) if comm.rank != 0 else comm.scatter(np.zeros((n + 1, 2)), 0),
            ValueError,
            "out=|world_size",
        ),
        (lambda: comm.allgather(x, out=np.empty((n, 11), np.float32)), ValueError, "shape"),
        (lambda: comm.send(x, dst=-1), ValueError, "out of range"),
        (lambda: comm.send(x, dst=0, tag=-5), ValueError, "tag"),
        (lambda: comm.send(x, dst=n), ValueError, "out of range"),
        (lambda: comm.recv(ro, src=0), ValueError, "read-only"),
        (lambda: comm.split(color=-2), ValueError, "color"),
        (lambda: comm.allgatherv(x, [12] * (n + 1)), ValueError, "one count per rank"),
        (lambda: comm.allgatherv(x, [-1] + [12] * (n - 1)), ValueError, "negative"),
        (lambda: comm.allgatherv(x, [1.5] * n), TypeError, "must be an int"),
        (lambda: comm.allgatherv(x, [11] * n), ValueError, "counts"),
        (lambda: comm.allgatherv(x, [12] * n, out=np.empty(12 * n, np.float64)), TypeError, "dtype"),
        (lambda: comm.allgatherv(x, [12] * n, out=np.empty(12 * n - 1, np.float32)), ValueError, "sum"),
        (lambda: comm.gatherv(x, None, root=comm.rank), ValueError, "required on the root"),
        (lambda: comm.scatterv(None, None, root=(comm.rank + 1) % n), ValueError, "out="),
        (lambda: comm.reduce_scatter(x, "sum", [5] * n), ValueError, "sum"),
        (lambda: comm.alltoallv(x, [12] + [0] * (n - 1), [12] + [0] * (n - 1), out=x), ValueError, "in place"),
        (lambda: comm.alltoallv(x, [6] * 2 + [0] * (n - 2), [5] * n), ValueError, "recv_counts"),
        (lambda: comm.alltoallv(x, [5] * n), ValueError, "send_counts"),
        (lambda: comm.scan(x, "avg"), ValueError, "AVG"),
        (lambda: comm.iexscan(x, "avg"), ValueError, "AVG"),
        (lambda: comm.alltoall_object([1] * (n + 1)), ValueError, "world_size"),
        (lambda: comm.allreduce_object(1, "median"), ValueError, "unknown reduction op"),
    ]
    for fn, exc, pattern in checks:
        with pytest.raises(exc, match=pattern):
            fn()
    try:  # larger than the machine: refused before allocating anything (virtual memory only here)
        huge = np.empty(psutil.virtual_memory().total // 2 + 1, np.uint8)
    except MemoryError:
        huge = None
    if huge is not None and n > 1:
        with pytest.raises(ValueError, match="memory"):
            comm.allgather(huge)
        del huge
    # None of that communicated: the communicator still works, and reading a read-only input
    # where the call only reads it is fine.
    out = comm.allreduce(ro, out=np.empty_like(ro))
    np.testing.assert_array_equal(out, ro * n)
    return True


def test_bad_inputs_fail_before_communicating(pools) -> None:  # type: ignore[no-untyped-def]
    pool = pools.get(2, slot_bytes=64, nslots=2)
    assert pool.run(_bad_inputs) == [True, True]


def _large(comm):  # type: ignore[no-untyped-def]
    """Sizes far beyond the rings with the default slots, several dtypes."""
    out = []
    n = comm.world_size
    for dt in (np.float32, np.float64, np.int16, np.complex64, np.float16, np.bool_):
        op = ReduceOp.SUM if np.dtype(dt).kind == "c" else ReduceOp.MAX
        base = np.arange(300_001) % 7
        x = (base + comm.rank).astype(dt)
        y = comm.allreduce(x.copy(), op=op)
        want = (base * n + n * (n - 1) // 2) if op == ReduceOp.SUM else base + n - 1
        np.testing.assert_array_equal(y, want.astype(dt))
        g = comm.allgather(x[:1001])
        np.testing.assert_array_equal(g, np.stack([(base[:1001] + r).astype(dt) for r in range(n)]))
        out.append(g.shape)
    return out


def test_large_messages_default_slots(pools) -> None:  # type: ignore[no-untyped-def]
    pool = pools.get(3)
    assert pool.run(_large) == [[(3, 1001)] * 6] * 3


def _send_and_copy(comm):  # type: ignore[no-untyped-def]
    """Out-of-place ``direct`` allgather and broadcast run a step that sends this rank's block and
    copies it into the result (plan.passes' send-and-copy fusion): in one pass up to the engine's
    ``LATE_COPY_BYTES``, the message first above it, and per piece beyond a slot."""
    from shmcoll.engine.cpu import LATE_COPY_BYTES

    n, r = comm.world_size, comm.rank
    limit = LATE_COPY_BYTES // 4
    for count in (1, limit - 1, limit, limit + 1, 3 * limit, 16384 + 5, 3 * 16384 + 7):
        base = np.arange(count, dtype=np.float32)
        x = base + 1000 * r
        g = comm.allgather(x, out=np.empty((n, count), np.float32), algorithm="direct")
        np.testing.assert_array_equal(g, np.stack([base + 1000 * q for q in range(n)]))
        b = comm.broadcast(x, root=n - 1, out=np.empty_like(x), algorithm="direct")
        np.testing.assert_array_equal(b, base + 1000 * (n - 1))
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_send_and_copy_steps_on_both_sides_of_the_late_copy(pools, world_size: int) -> None:  # type: ignore[no-untyped-def]
    assert pools.get(world_size).run(_send_and_copy) == [True] * world_size


def _references(comm, calls):  # type: ignore[no-untyped-def]
    """The run loop's calls (a timeout given: not the lean path) hand the caller's arrays to the
    engine, parts of which are compiled without reference counting (``jit.NO_REFCOUNTS``): the
    arrays' reference counts must come back to where they were."""
    import sys

    x = np.ones(300, np.float32)
    out, g = np.empty_like(x), np.empty((comm.world_size, 300), np.float32)

    def rounds(k: int) -> list[int]:
        for _ in range(k):
            comm.allreduce(x, out=out, timeout=30)
            comm.allreduce(x, timeout=30)
            comm.allgather(x, out=g, timeout=30)
            comm.broadcast(x, 0, out=out, timeout=30)
            comm.allgather(x, out=g)  # (and the lean path, remembered from the second round on)
        return [sys.getrefcount(a) for a in (x, out, g)]

    return rounds(3), rounds(calls)  # (the calls remembered after a round are the same every round)


def test_engine_calls_leave_reference_counts_as_they_were(pools) -> None:  # type: ignore[no-untyped-def]
    for before, after in pools.get(2).run(_references, 200):
        assert after == before


# --- calls repeated with the same arrays (comm.bind._remember) -----------------------------------
def _repeated(comm):  # type: ignore[no-untyped-def]
    """A loop's repeated call is not checked again, so it must still notice every change that
    matters: another op, root or algorithm, a dtype changed in place, a buffer made read-only,
    other arrays, and results that land in the same arrays every time."""
    n, r = comm.world_size, comm.rank
    seen = []
    x = np.full(4, r + 1, np.float64)
    y = np.empty(4, np.float64)
    for _ in range(3):
        x[...] = r + 1
        comm.allreduce(x, out=y)
        seen.append(y.tolist())
        comm.allreduce(x, ReduceOp.MAX, out=y)  # another op on the same arrays
        seen.append(y.tolist())
    b = np.full(3, r, np.int32)
    for root in (0, n - 1, 0):
        b[...] = r
        comm.broadcast(b, root=root)
        seen.append(b.tolist())
    z = np.full(4, r + 1, np.int64)
    comm.allreduce(z)
    z.dtype = np.float64  # same object, same bytes, another dtype: a new call shape
    z[...] = r + 1.5
    comm.allreduce(z)
    seen.append(z.tolist())
    z[...] = r + 1.5
    comm.allreduce(z)  # made again: on the lean path when it is made read-only
    z.flags.writeable = False
    try:
        comm.allreduce(z)
        seen.append("no error")
    except ValueError as exc:
        seen.append(str(exc))
    g = np.empty((n, 2), np.float32)
    for k in range(2):
        comm.allgather(np.full(2, r + k, np.float32), out=g)  # a new x each time
        seen.append(g[:, 0].tolist())
    # broadcast and reduce write the lean path's tests out again (communicator.py): the same
    # changes must reach them.
    c, o = np.full(4, r, np.int64), np.empty(4, np.int64)
    for _ in range(3):
        comm.broadcast(c, root=n - 1, out=o)  # the lean path from its second call
    c.dtype = o.dtype = np.float64
    c[...] = r + 0.5
    comm.broadcast(c, root=n - 1, out=o)
    seen.append(o.tolist())
    comm.broadcast(c, root=n - 1, out=o)  # made again: on the lean path when it is made read-only
    o.flags.writeable = False  # on every rank, and every rank writes out: all raise, none sends
    try:
        comm.broadcast(c, root=n - 1, out=o)
        seen.append("no error")
    except ValueError as exc:
        seen.append(str(exc))
    y = np.full(4, r + 1, np.int64)
    for _ in range(3):
        comm.reduce(y, 0, out=y if r == 0 else None)
    y.dtype = np.float64
    y[...] = r + 0.25
    res = comm.reduce(y, 0, out=y if r == 0 else None)
    seen.append((res is y) if r == 0 else (res is None))
    comm.broadcast(y, root=0)
    seen.append(y.tolist())
    return seen


def _is_lean(entry) -> bool:  # type: ignore[no-untyped-def]
    """Whether a ``Runtime._lean`` entry is a call the lean path runs (not unset, not refused)."""
    return entry is not None and entry is not bind.NOT_LEAN


def _lean_loops(comm):  # type: ignore[no-untyped-def]
    """Loops of the same call on the same arrays take the lean path (Runtime._again) after their
    first call; every iteration's result must be the exact one for that iteration's data."""
    n, r = comm.world_size, comm.rank
    wrong = []
    x, y = np.empty(5, np.int64), np.empty(5, np.int64)
    blocks, mine = np.empty((n, 3), np.int32), np.empty(3, np.int32)
    stacked, a2a = np.empty((n, 3), np.int32), np.empty((n, 3), np.int32)
    row = mine[None]  # reduce_scatter's result: one of world_size rows
    # (Only a collective's last call is remembered: two allreduces taking turns would never be
    # made again, so each form gets its own loop.)
    for k in range(6):
        x[...] = r + k
        comm.allreduce(x, out=y)
        wrong += [] if (y == sum(q + k for q in range(n))).all() else [("allreduce", k, y.tolist())]
    for k in range(6):
        x[...] = r + k
        comm.allreduce(x, ReduceOp.MAX)
        wrong += [] if (x == n - 1 + k).all() else [("allreduce in place", k, x.tolist())]
    for k in range(6):
        x[...] = r * k
        res = comm.reduce(x, 1 % n, out=y if r == 1 % n else None)
        if r == 1 % n:
            wrong += [] if (y == k * sum(range(n))).all() else [("reduce", k, y.tolist())]
        elif res is not None:
            wrong.append(("reduce off root returned", res))
        mine[...] = r + 10 * k
        comm.broadcast(mine, root=n - 1)
        wrong += [] if (mine == n - 1 + 10 * k).all() else [("broadcast", k, mine.tolist())]
        mine[...] = r + 10 * k
        comm.allgather(mine, out=stacked)
        wrong += [] if (stacked[:, 0] == np.arange(n) + 10 * k).all() else [("allgather", k, stacked.tolist())]
        blocks[...] = np.arange(n)[:, None] * 100 + r + k
        comm.alltoall(blocks, out=a2a)
        wrong += [] if (a2a[:, 0] == 100 * r + np.arange(n) + k).all() else [("alltoall", k, a2a.tolist())]
        comm.reduce_scatter(blocks, out=row)
        wrong += [] if (mine == n * 100 * r + sum(range(n)) + n * k).all() else [("reduce_scatter", k, mine.tolist())]
        comm.scatter(blocks if r == 0 else None, out=mine, root=0)
        wrong += [] if (mine == 100 * r + k).all() else [("scatter", k, mine.tolist())]
    lean = [c.name for c in shmcoll.collectives.BY_NAME.values() if _is_lean(comm._lean[c.code])]
    # A call's record is made at its second call only: a call on new arrays never pays for it.
    code, z = shmcoll.collectives.BY_NAME["allreduce"].code, np.ones(3)
    comm.allreduce(z)
    once = comm._lean[code] is None
    comm.allreduce(z)
    promoted = once and _is_lean(comm._lean[code])
    # What the lean path must leave to the run loop: a timeout given, started operations first.
    x[...] = 1
    comm.allreduce(x, out=y, timeout=30)
    wrong += [] if (y == n).all() else [("with a timeout", y.tolist())]
    pending = np.full(1 << 14, r, np.float64)
    req = comm.iallreduce(pending)
    comm.allreduce(x, out=y)  # runs after the started one, in order on every rank
    req.wait()
    wrong += [] if (pending == sum(range(n))).all() and (y == n).all() else [("after a started call",)]
    return wrong, sorted(lean), promoted


def _lean_barriers(comm, flag_dir):  # type: ignore[no-untyped-def]
    """Barriers in a loop (the lean path from the second): in each round one rank sleeps, then
    writes a flag file, then enters; every rank must see that round's flag once it is through."""
    n, r = comm.world_size, comm.rank
    missed = []
    code = shmcoll.collectives.KIND_CODE["barrier"]
    lean_after = []
    for k in range(2 * n + 1):
        if r == k % n:
            time.sleep(0.05)
            with open(os.path.join(flag_dir, f"round-{k}"), "w"):
                pass
        comm.barrier()
        if not os.path.exists(os.path.join(flag_dir, f"round-{k}")):
            missed.append(k)
        lean_after.append(_is_lean(comm._lean[code]))
    return missed, lean_after


def test_lean_barriers_still_wait_for_everyone(pools, tmp_path) -> None:  # type: ignore[no-untyped-def]
    for n in (2, 3):
        flags = tmp_path / f"n{n}"
        flags.mkdir()
        for missed, lean_after in pools.get(n).run(_lean_barriers, str(flags)):
            assert missed == []
            assert all(lean_after[1:])  # the lean path from the second barrier at the latest


def test_lean_path_loops_give_every_iterations_result(pools) -> None:  # type: ignore[no-untyped-def]
    for n in (1, 2, 3):
        for wrong, lean, promoted in pools.get(n).run(_lean_loops):
            assert wrong == [], wrong
            assert promoted
            want = {"allreduce", "reduce", "broadcast", "allgather", "alltoall", "reduce_scatter", "scatter"}
            assert want <= set(lean), lean


def test_repeated_calls_notice_what_changed(pools) -> None:  # type: ignore[no-untyped-def]
    n = 3
    results = pools.get(n).run(_repeated)
    total = sum(range(1, n + 1))
    want = [[float(total)] * 4, [float(n)] * 4] * 3
    want += [[0] * 3, [n - 1] * 3, [0] * 3]
    want += [[sum(r + 1.5 for r in range(n))] * 4, "x is read-only but this call writes into it"]
    want += [[float(r) for r in range(n)], [float(r + 1) for r in range(n)]]
    want += [[n - 0.5] * 4, "out is read-only"]
    want += [True, [sum(r + 0.25 for r in range(n))] * 4]
    assert all(res == want for res in results), results
