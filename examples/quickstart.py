"""shmcoll in about twenty lines: start ranks, reduce, broadcast, exchange objects, send and receive.

Run: python examples/quickstart.py [--nprocs N]
"""

import argparse

import numpy as np

import shmcoll
from shmcoll import ReduceOp


def worker(comm: shmcoll.Communicator) -> float:
    x = np.full(1000, comm.rank + 1, dtype=np.float32)
    comm.allreduce(x, op=ReduceOp.SUM)  # in place: 1 + 2 + ... + world_size everywhere
    config = comm.broadcast_object({"lr": 0.1} if comm.rank == 0 else None, root=0)
    names = comm.allgather_object(f"rank {comm.rank}")
    if comm.world_size > 1:  # a ring of point-to-point messages
        token = np.array([comm.rank], dtype=np.int64)
        comm.send(token, dst=(comm.rank + 1) % comm.world_size)
        comm.recv(token, src=(comm.rank - 1) % comm.world_size)
        assert token[0] == (comm.rank - 1) % comm.world_size
    comm.barrier()
    assert config == {"lr": 0.1} and len(names) == comm.world_size
    return float(x[0])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=4)
    args = parser.parse_args()
    sums = shmcoll.spawn(worker, nprocs=args.nprocs, timeout=120)
    expected = args.nprocs * (args.nprocs + 1) / 2
    print(f"allreduce on {args.nprocs} ranks: {sums} (expected {expected:g} on every rank)")
    assert all(s == expected for s in sums)
