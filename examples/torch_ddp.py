"""Data-parallel training with torch's DistributedDataParallel on shmcoll, against gloo.

A small CNN learns the bundled MNIST subset with the same seed on both backends; the script
prints both loss curves' largest difference, the time per step, and how much of it is
communication the backward pass did not hide (a step with gradient synchronisation against one
without, ``DDP.no_sync``).

    python examples/torch_ddp.py --nprocs 4              # both backends, torch.multiprocessing.spawn
    torchrun --nproc-per-node 4 examples/torch_ddp.py    # one backend (--backend), under torchrun

What makes it a shmcoll job is two lines: ``import shmcoll.torch`` and ``backend="shmcoll"``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import shmcoll.torch  # noqa: F401  (registers the "shmcoll" backend)
from shmcoll.train.data import load_bundled


class Net(nn.Module):
    """Two convolutions and two linear layers: 0.42 M parameters, in 4 DDP buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc1 = nn.Linear(32 * 7 * 7, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def train(rank: int, world_size: int, backend: str, args: argparse.Namespace) -> dict[str, object]:
    """Train on this rank's share of each global batch; returns the loss curve and the timings."""
    torch.manual_seed(args.seed)  # the same initial model on every rank and for every backend
    torch.set_num_threads(1)  # ranks share the cores: one thread each
    data = load_bundled()
    images = torch.from_numpy(data.train_images).float().div_(255).unsqueeze(1)
    labels = torch.from_numpy(data.train_labels).long()
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    per_rank = args.batch // world_size
    losses, sync_s, local_s = [], [], []
    for step in range(args.steps + args.local_steps):
        lo = (step * args.batch) % (len(labels) - args.batch) + rank * per_rank
        x, y = images[lo : lo + per_rank], labels[lo : lo + per_rank]
        synced = step < args.steps
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if synced:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        else:  # the same work without gradient synchronisation: the compute-only step time
            with model.no_sync():
                loss = F.cross_entropy(model(x), y)
                loss.backward()
        t = time.perf_counter() - t0
        if synced:
            mean = loss.detach().clone()
            dist.all_reduce(mean, op=dist.ReduceOp.SUM)  # the global batch's loss, for the curve
            losses.append(mean.item() / world_size)
            if step >= args.warmup:
                sync_s.append(t)
        else:
            local_s.append(t)
    first = next(model.parameters()).detach()
    checks = [torch.empty_like(first) for _ in range(world_size)]
    dist.all_gather(checks, first)
    same = all(torch.equal(checks[0], c) for c in checks)
    return {"losses": losses, "step_s": statistics.median(sync_s), "local_s": statistics.median(local_s), "same": same}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned(rank: int, world_size: int, backend: str, port: int, args: argparse.Namespace, results: dict) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        out = train(rank, world_size, backend, args)
        if rank == 0:
            results[backend] = out
    finally:
        dist.destroy_process_group()


def report(world_size: int, results: dict[str, dict]) -> None:
    print(f"# {world_size} ranks; median step time over the steps after warm-up")
    print(f"{'backend':<9} {'step':>9} {'compute':>9} {'comm':>9} {'comm %':>7} {'final loss':>11}  ranks agree")
    for backend, r in results.items():
        comm = max(r["step_s"] - r["local_s"], 0.0)
        print(
            f"{backend:<9} {r['step_s'] * 1e3:7.2f}ms {r['local_s'] * 1e3:7.2f}ms {comm * 1e3:7.2f}ms "
            f"{100 * comm / r['step_s']:6.1f}% {r['losses'][-1]:11.4f}  {r['same']}"
        )
    if len(results) == 2:
        a, b = (results[k]["losses"] for k in results)
        worst = max(abs(p - q) for p, q in zip(a, b, strict=True))
        print(f"largest loss difference between the backends over {len(a)} steps: {worst:.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--backend", default="shmcoll,gloo", help="comma-separated: shmcoll, gloo")
    p.add_argument("--steps", type=int, default=60, help="synchronised training steps")
    p.add_argument("--local-steps", type=int, default=20, help="steps without synchronisation, for the compute time")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=128, help="global batch (split among the ranks)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: one backend
        dist.init_process_group(backends[0])
        rank, world_size = dist.get_rank(), dist.get_world_size()
        try:
            out = train(rank, world_size, backends[0], args)
        finally:
            dist.destroy_process_group()
        if rank == 0:
            report(world_size, {backends[0]: out})
        return
    results = mp.Manager().dict()
    for backend in backends:
        mp.spawn(_spawned, args=(args.nprocs, backend, _free_port(), args, results), nprocs=args.nprocs)
    report(args.nprocs, dict(results))


if __name__ == "__main__":
    main()
