"""``torch.distributed.all_reduce`` on the shmcoll backend against gloo, and against shmcoll's own API.

One launch of ``-n`` ranks (``torch.multiprocessing.spawn``) holds all three side by side: the
default process group is shmcoll's, a second group is gloo's (``new_group(backend="gloo")``),
and the shmcoll communicator under the default group is called directly
(``comm.allreduce(tensor)``). At every size the three take turns in ``--rounds`` rounds of
timed blocks of back-to-back calls (so a slow spell of the machine hits all of them alike); a
figure is the median block time per call of the slowest rank, and the report is the median over
``--launches`` launches. float32 tensors, SUM, in place.

Run: ``python benchmarks/torch_allreduce.py -n 2 [--sizes 8,64M] [--launches 3] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shmcoll.torch  # noqa: F401  (registers the backend)
from shmcoll.units import format_size, parse_size

SIZES = "8,64,512,4K,32K,256K,2M,16M,64M,256M"
VARIANTS = ("torch+shmcoll", "torch+gloo", "shmcoll API")


def _calls_for(nbytes: int) -> int:
    """Calls per timed block: about 20 ms of work at 2 GB/s, at least 2, at most 2000."""
    return max(2, min(2000, int(20e6 / max(nbytes, 1))))


def _rank(rank: int, n: int, port: int, sizes: list[int], rounds: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("shmcoll", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    gloo = dist.new_group(backend="gloo")
    comm = dist.distributed_c10d._get_default_group().comm
    calls = {
        "torch+shmcoll": lambda t: dist.all_reduce(t),
        "torch+gloo": lambda t: dist.all_reduce(t, group=gloo),
        "shmcoll API": lambda t: comm.allreduce(t),
    }
    times: dict[str, dict[int, list[float]]] = {v: {} for v in VARIANTS}
    for nbytes in sizes:
        t = torch.ones(max(nbytes // 4, 1))
        k = _calls_for(nbytes)
        for fn in calls.values():  # warm-up: plans, buffers, first touch
            fn(t)
        for _ in range(rounds):
            for name, fn in calls.items():
                dist.barrier(group=gloo)
                t0 = time.perf_counter()
                for _ in range(k):
                    fn(t)
                times[name].setdefault(nbytes, []).append((time.perf_counter() - t0) / k)
    gathered: list[dict] = [{} for _ in range(n)]
    dist.all_gather_object(gathered, times, group=gloo)
    if rank == 0:
        out["result"] = {
            v: {s: statistics.median(max(g[v][s][i] for g in gathered) for i in range(rounds)) for s in sizes}
            for v in VARIANTS
        }
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", "--nprocs", type=int, default=2)
    p.add_argument("--sizes", default=SIZES)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    launches = []
    for _ in range(args.launches):
        out = mp.Manager().dict()
        mp.spawn(_rank, args=(args.nprocs, _free_port(), sizes, args.rounds, out), nprocs=args.nprocs)
        launches.append(out["result"])
    med = {v: {s: statistics.median(run[v][s] for run in launches) for s in sizes} for v in VARIANTS}
    print(
        f"# {args.nprocs} ranks, {args.launches} launches x {args.rounds} rounds; python {platform.python_version()}, "
        f"torch {torch.__version__}, {os.cpu_count()} cores"
    )
    print(f"{'size':>8} " + " ".join(f"{v:>15}" for v in VARIANTS) + f" {'gloo/shmcoll':>13} {'torch layer':>12}")
    for s in sizes:
        a, g, api = (med[v][s] for v in VARIANTS)
        print(
            f"{format_size(s):>8} "
            + " ".join(f"{med[v][s] * 1e6:13.1f}us" for v in VARIANTS)
            + f" {g / a:12.1f}x {(a - api) * 1e6:10.1f}us"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nprocs": args.nprocs, "launches": launches, "median": med}, f, indent=1)


if __name__ == "__main__":
    main()
