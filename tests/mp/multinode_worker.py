"""Run under mpirun by tests/mp/test_multinode.py: every collective of init_mpi's communicator
against numpy, results compared bitwise across ranks. Prints one line per rank:
``MNRESULT <rank> OK <checks>`` or ``MNRESULT <rank> FAIL <what>``.

Modes (argv[1]): ``check`` (the matrix), ``kill`` (the last rank kills itself during an
allreduce; the others must raise a ShmcollError naming it; ``MN_DEAF_RANK`` makes one rank deaf to
MPI's news of it).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import traceback

import numpy as np

import shmcoll
from shmcoll.types import FOLD_UFUNC, ReduceOp


def data(rank: int, n: int, dtype: np.dtype, salt: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + salt)
    if dtype.kind == "f":
        # magnitudes spread over many orders: float32 sums depend on the order of additions
        return (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n)).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    return rng.integers(-50, 50, n).astype(dtype)


def digest(a: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def main() -> None:
    mode = sys.argv[1]
    rr = int(os.environ.get("MN_ROUND_ROBIN", "0"))  # node = world rank % rr, as --map-by node
    node_id = None
    if rr:
        from mpi4py import MPI

        node_id = MPI.COMM_WORLD.Get_rank() % rr
    comm = shmcoll.init_mpi(node_id=node_id, timeout=float(os.environ.get("MN_TIMEOUT", "30")))
    if rr:
        assert comm.nodes == [list(range(k, comm.world_size, rr)) for k in range(rr)], comm.nodes
    rank, P = comm.rank, comm.world_size
    checks = 0

    def same_everywhere(a: np.ndarray, what: str) -> None:
        nonlocal checks
        ds = comm.allgather_object(digest(a))
        assert len(set(ds)) == 1, f"{what}: results differ between ranks"
        checks += 1

    def close(got: np.ndarray, want: np.ndarray, what: str) -> None:
        nonlocal checks
        if got.dtype.kind == "f":
            ok = np.allclose(
                got.astype(np.float64),
                want.astype(np.float64),
                rtol=2e-3,
                atol=1e-3 * (np.abs(want).max() if want.size else 0) + 1e-30,
                equal_nan=True,
            )
        else:
            ok = np.array_equal(got, want)
        assert ok, f"{what}: wrong result on rank {rank}: {got[:5]} vs {want[:5]}"
        checks += 1

    if mode == "kill":
        if rank == int(os.environ.get("MN_DEAF_RANK", "-1")):
            # this rank hears no MPI notice and no ULFM failure list: only its node peer's story
            # (the node's abort word) can tell it who died
            comm._poll_notice = lambda: None  # type: ignore[method-assign]
            comm._failed_ranks = lambda: []  # type: ignore[method-assign]
        x = np.ones(1 << 16, np.float32)
        comm.allreduce(x)
        victim = P - 1
        t0 = time.monotonic()
        try:
            for i in range(1000000):
                if rank == victim and i == 20:
                    os.kill(os.getpid(), 9)
                comm.allreduce(x)
        except shmcoll.ShmcollError as e:
            print(f"MNRESULT {rank} RAISED {time.monotonic() - t0:.2f} {type(e).__name__}: {e}", flush=True)
            comm.close()
            os._exit(0)
        print(f"MNRESULT {rank} FAIL no error", flush=True)
        os._exit(1)

    if mode == "late":
        # the last rank arrives long after the timeout: every rank raises, none hangs
        x = np.ones(1000, np.float32)
        comm.allreduce(x)
        t0 = time.monotonic()
        try:
            if rank == P - 1:
                time.sleep(float(os.environ["MN_TIMEOUT"]) * 3)
            comm.allreduce(x)
        except shmcoll.ShmcollError as e:
            print(f"MNRESULT {rank} RAISED {time.monotonic() - t0:.2f} {type(e).__name__}: {e}", flush=True)
            comm.close()
            os._exit(0)
        print(f"MNRESULT {rank} FAIL no error", flush=True)
        os._exit(1)

    assert isinstance(comm, shmcoll.comm.multinode.MultiNodeCommunicator) or os.environ.get("MN_ONE_NODE")
    sizes = [0, 1, 7, 1000, 70001]
    for salt, n in enumerate(sizes):
        for dtype in (np.float32, np.int64):
            dt = np.dtype(dtype)
            xs = [data(r, n, dt, salt) for r in range(P)]
            mine = xs[rank].copy()
            for op in ("sum", "max") if dt.kind == "f" else ("sum", "bxor"):
                uf = FOLD_UFUNC[ReduceOp[op.upper()]]
                want = xs[0].copy()
                for r in range(1, P):
                    want = uf(want, xs[r])
                got = comm.allreduce(mine, op, out=np.empty_like(mine))
                close(got, want, f"allreduce {op} {dt} n={n}")
                same_everywhere(got, f"allreduce {op} {dt} n={n}")
                root = (salt + 1) % P
                red = comm.reduce(mine, root, op)
                if rank == root:
                    close(red, want, f"reduce {op} {dt} n={n}")
                # reduce_scatter: blocks of n rows, one per rank
                xr = np.concatenate([mine] * P) if n else np.empty(0, dt)
                wr = np.concatenate([want] * P) if n else np.empty(0, dt)
                rs = comm.reduce_scatter(xr, op)
                close(rs, wr[rank * n : (rank + 1) * n], f"reduce_scatter {op} {dt} n={n}")
            # AVG on floats
            if dt.kind == "f":
                got = comm.allreduce(mine, "avg", out=np.empty_like(mine))
                same_everywhere(got, f"allreduce avg n={n}")
                close(got, (np.sum(np.array(xs, np.float64), axis=0) / P).astype(dt) if n else got, f"avg n={n}")
            root = salt % P
            b = xs[root].copy() if rank == root else np.zeros(n, dt)
            comm.broadcast(b, root)
            close(b, xs[root], f"broadcast {dt} n={n}")
            ag = comm.allgather(mine)
            close(ag, np.array(xs).reshape(P, n), f"allgather {dt} n={n}")
            g = comm.gather(mine, root)
            if rank == root:
                close(g, np.array(xs).reshape(P, n), f"gather {dt} n={n}")
            sc_in = np.array(xs).reshape(P, n) if rank == root else None
            sc = comm.scatter(sc_in, root, out=np.empty(n, dt))
            close(
                sc,
                xs[root].reshape(-1) * 0 + np.array(xs)[rank] if False else np.array(xs).reshape(P, n)[rank],
                f"scatter {dt} n={n}",
            )
            m = max(n // P, 1)
            a2a_in = np.stack([data(rank * 100 + j, m, dt, salt) for j in range(P)])
            a2a = comm.alltoall(a2a_in)
            close(a2a, np.stack([data(i * 100 + rank, m, dt, salt) for i in range(P)]), f"alltoall {dt} n={n}")
    # float16 / bfloat16-free: float16 allreduce widened, identical everywhere
    hs = [np.random.default_rng(r).standard_normal(5000).astype(np.float16) for r in range(P)]
    got = comm.allreduce(hs[rank], out=np.empty_like(hs[rank]))
    same_everywhere(got, "allreduce float16")
    want = np.sum([h.astype(np.float32) for h in hs], axis=0)  # reduced in float32, rounded once
    assert np.array_equal(got, want.astype(np.float16)) or P > 2, "float16: not rounded once"
    close(got, want.astype(np.float16), "allreduce float16")
    # variable counts
    counts = [(r * 7 + 3) % 11 for r in range(P)]
    v = np.arange(counts[rank], dtype=np.float64) + 100 * rank
    allv = np.concatenate([np.arange(counts[r], dtype=np.float64) + 100 * r for r in range(P)])
    close(comm.allgatherv(v, counts), allv, "allgatherv")
    gv = comm.gatherv(v, counts, P - 1)
    if rank == P - 1:
        close(gv, allv, "gatherv")
    close(comm.scatterv(allv if rank == 1 else None, counts, 1, out=np.empty(counts[rank])), v, "scatterv")
    xv = np.arange(sum(counts), dtype=np.float64) * (rank + 1)
    start = sum(counts[:rank])
    close(
        comm.reduce_scatter(xv, "sum", counts),
        (np.arange(sum(counts), dtype=np.float64) * sum(range(1, P + 1)))[start : start + counts[rank]],
        "reduce_scatterv",
    )
    sc_counts = [(rank + j) % 3 for j in range(P)]
    av = comm.alltoallv(np.full(sum(sc_counts), rank, np.int32), sc_counts)
    close(av, np.concatenate([np.full((i + rank) % 3, i, np.int32) for i in range(P)]), "alltoallv")
    s = comm.scan(np.full(3, rank + 1, np.int64))
    close(s, np.full(3, sum(range(1, rank + 2)), np.int64), "scan")
    e = comm.exscan(np.full(3, rank + 1, np.int64))
    close(e, np.full(3, sum(range(1, rank + 1)), np.int64), "exscan")
    # objects
    assert comm.allgather_object({"r": rank}) == [{"r": r} for r in range(P)]
    assert comm.broadcast_object(("hi", rank), root=P - 1) == ("hi", P - 1)
    assert comm.allreduce_object(rank) == sum(range(P))
    go = comm.gather_object(rank * 2, root=0)
    assert rank != 0 or go == [r * 2 for r in range(P)]
    assert comm.scatter_object([f"o{r}" for r in range(P)] if rank == 0 else None, root=0) == f"o{rank}"
    assert comm.alltoall_object([(rank, j) for j in range(P)]) == [(i, rank) for i in range(P)]
    checks += 6
    # nonblocking: several in flight, then a blocking call behind them
    xs_nb = [np.full(1000, rank + i, np.float32) for i in range(3)]
    reqs = [comm.iallreduce(x) for x in xs_nb]
    rb = comm.ibarrier()
    total = comm.allreduce(np.ones(4, np.float32))
    for i, r in enumerate(reqs):
        close(r.wait(), np.full(1000, sum(range(P)) + P * i, np.float32), f"iallreduce {i}")
    rb.wait()
    assert rb.test()
    close(total, np.full(4, P, np.float32), "blocking behind nonblocking")
    # point to point
    if rank == 0:
        comm.send(np.arange(5.0), P - 1, tag=3)
        comm.send_object({"a": 1}, P - 1)
    if rank == P - 1:
        buf = np.empty(5)
        st = comm.recv(buf, 0, 3)
        assert st.source == 0 and st.count == 5
        close(buf, np.arange(5.0), "recv")
        assert comm.recv_object(0) == {"a": 1}
    # nonblocking point to point around a ring, and sendrecv
    right, left = (rank + 1) % P, (rank - 1) % P
    rbuf = np.empty(3, np.int64)
    rr_ = comm.irecv(rbuf, left, 9)
    sr_ = comm.isend(np.full(3, rank, np.int64), right, 9)
    sr_.wait()
    st = rr_.wait()
    assert st.source == left and (rbuf == left).all(), (st, rbuf)
    sbuf = np.empty(2, np.float32)
    st = comm.sendrecv(np.full(2, rank, np.float32), right, sbuf, left, sendtag=4, recvtag=4)
    assert st.source == left and (sbuf == left).all()
    # probe: the size of a message before receiving it (in bytes over MPI)
    if rank == 0:
        comm.send(np.arange(6, dtype=np.float64), P - 1, tag=11)
    if rank == P - 1:
        st = comm.probe(tag=11)
        assert st.source == 0 and st.tag == 11 and st.nbytes == 48, st
        got6 = np.empty(st.nbytes // 8)
        comm.recv(got6, st.source, st.tag)
        close(got6, np.arange(6, dtype=np.float64), "probe then recv")
        assert comm.iprobe(tag=11) is None
    checks += 3
    # persistent requests: the same call started again on new data in the same buffers
    px, py = np.empty(64, np.float32), np.empty(64, np.float32)
    preq = comm.allreduce_init(px, out=py)
    pb = comm.broadcast_init(py, root=P - 1)
    for i in range(3):
        px[...] = rank + i
        preq.start()
        preq.wait()
        close(py, np.full(64, sum(range(P)) + P * i, np.float32), f"persistent allreduce {i}")
        if rank == P - 1:
            py[...] = -i
        pb.start()
        pb.wait()
        close(py, np.full(64, -i, np.float32), f"persistent broadcast {i}")
    assert preq.done and pb.test()
    # split: even / odd world ranks
    sub = comm.split(rank % 2)
    sub_ranks = [r for r in range(P) if r % 2 == rank % 2]
    close(sub.allreduce(np.array([rank], np.int64)), np.array([sum(sub_ranks)], np.int64), "split allreduce")
    assert sub.rank == sub_ranks.index(rank)
    sub.close()
    comm.barrier()
    # timeout: one rank is late, everyone raises
    print(f"MNRESULT {rank} OK {checks}", flush=True)
    comm.close()


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:  # noqa: BLE001
        print(f"MNRESULT {int(os.environ.get('OMPI_COMM_WORLD_RANK', -1))} FAIL {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
