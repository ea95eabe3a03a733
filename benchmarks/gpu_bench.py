"""GPU benchmark: the reduction kernel against a device-to-device copy, and device allreduce.

Part 1, the kernel: for each size, the time of a device-to-device copy of ``size`` bytes, of
shmcoll's reduction kernel computing ``c = a + b`` over ``size``-byte buffers, and of CuPy's and
torch's own ``add`` on the same buffers when those are installed. Bandwidth counts the bytes read
plus written: ``2 * size / t`` for the copy, ``3 * size / t`` for an add.

Part 2, allreduce: ``n`` processes (2-4) share the GPU; each allreduces a ``size``-byte device
buffer out of place through CUDA IPC (``shmcoll.device.configure(comm, path="ipc")``). Time is
the slowest rank's mean per call; ``busbw = size / t * 2 (n - 1) / n`` as in nccl-tests. Results
are checked (``#wrong``).

The table printed last compares both with the copy at every size; the targets are the kernel at
>= 85 % of copy bandwidth and allreduce busbw within 2x of copy bandwidth, at 256 MiB.

Run on a machine with an NVIDIA GPU and numba-cuda (``pip install 'shmcoll[cuda]'``)::

    python benchmarks/gpu_bench.py                      # 1M..256M, 2 and 4 ranks
    python benchmarks/gpu_bench.py --sizes 256M -n 2,3,4 --iters 50

Without a GPU it exits with status 2 and says why. Under ``NUMBA_ENABLE_CUDASIM=1`` it runs
(tiny sizes only; the numbers mean nothing): that is how its code is tested without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import shmcoll
from shmcoll.units import format_size, parse_size

DEFAULT_SIZES = "1M,16M,64M,256M"
SIMULATOR_MAX_BYTES = 64 << 10
TARGET_BYTES = 256 << 20


class NoGPU(RuntimeError):
    """No usable CUDA GPU (and not the simulator)."""


@dataclasses.dataclass
class KernelRow:
    size: int
    copy_s: float
    reduce_s: float
    cupy_s: float | None = None
    torch_s: float | None = None

    @property
    def copy_gbs(self) -> float:
        return 2 * self.size / self.copy_s / 1e9

    @property
    def reduce_gbs(self) -> float:
        return 3 * self.size / self.reduce_s / 1e9


@dataclasses.dataclass
class AllreduceRow:
    size: int
    world_size: int
    time_s: float
    wrong: int

    @property
    def algbw(self) -> float:
        return self.size / self.time_s / 1e9

    @property
    def busbw(self) -> float:
        return self.algbw * 2 * (self.world_size - 1) / self.world_size


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"comma-separated sizes in bytes, K/M/G suffixes ({DEFAULT_SIZES})"
    )
    p.add_argument("-n", "--nprocs", default="2,4", help="comma-separated rank counts for allreduce (2,4)")
    p.add_argument("--dtype", default="float32", help="element type (float32)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size (20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per size (5)")
    p.add_argument("--skip-kernel", action="store_true", help="only the allreduce part")
    p.add_argument("--skip-allreduce", action="store_true", help="only the kernel part")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each multi-process run, seconds (600)")
    args = p.parse_args(argv)
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        args.nprocs = [int(v) for v in args.nprocs.split(",") if v.strip()]
    except ValueError as exc:
        p.error(str(exc))
    if not args.sizes or any(s <= 0 for s in args.sizes):
        p.error("--sizes needs positive sizes")
    if any(n < 1 for n in args.nprocs):
        p.error("-n needs rank counts >= 1")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    args.dtype = np.dtype(args.dtype)
    if args.dtype.kind not in "iuf":
        p.error("--dtype must be an integer or floating dtype")
    return args


def _cuda() -> Any:
    """numba.cuda, if a GPU (or the simulator) is usable; else NoGPU with the reason."""
    try:
        from numba import cuda
    except ImportError as exc:
        raise NoGPU(f"numba.cuda cannot be imported ({exc}); install numba-cuda: pip install 'shmcoll[cuda]'") from None
    from shmcoll.kernels import cuda as kernels

    if kernels.SIMULATOR:
        return cuda
    if not cuda.is_available():
        raise NoGPU(
            "no usable CUDA GPU (numba.cuda.is_available() is False): run this on a machine with an "
            "NVIDIA GPU, its driver and numba-cuda (pip install 'shmcoll[cuda]')"
        )
    return cuda


def _timed(cuda: Any, fn: Any, iters: int, warmup: int) -> float:
    """Mean seconds per call of ``fn`` (queued work included)."""
    from shmcoll.kernels import cuda as kernels

    for _ in range(warmup):
        fn()
    cuda.synchronize()
    if kernels.SIMULATOR:  # simulator events carry no time
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    start, end = cuda.event(), cuda.event()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return cuda.event_elapsed_time(start, end) / 1e3 / iters


def bench_kernel(args: argparse.Namespace, cuda: Any) -> list[KernelRow]:
    from shmcoll.kernels import cuda as kernels
    from shmcoll.types import ReduceOp

    rows = []
    for size in args.sizes:
        count = size // args.dtype.itemsize
        a = cuda.to_device(np.ones(count, args.dtype))
        b = cuda.to_device(np.full(count, 2, args.dtype))
        c = cuda.device_array(count, args.dtype)
        copy_s = _timed(cuda, lambda a=a, c=c: c.copy_to_device(a), args.iters, args.warmup)
        reduce_s = _timed(
            cuda, lambda a=a, b=b, c=c: kernels.reduce(c, [a, b], int(ReduceOp.SUM)), args.iters, args.warmup
        )
        assert (c.copy_to_host() == 3).all(), "the reduction kernel computed a wrong sum"
        row = KernelRow(size, copy_s, reduce_s)
        if not kernels.SIMULATOR:
            row.cupy_s = _cupy_add(cuda, a, b, c, args)
            row.torch_s = _torch_add(cuda, a, b, c, args)
        rows.append(row)
        print(
            f"kernel {format_size(size):>6}: copy {row.copy_gbs:8.1f} GB/s, reduce {row.reduce_gbs:8.1f} GB/s",
            file=sys.stderr,
        )
    return rows


def _cupy_add(cuda: Any, a: Any, b: Any, c: Any, args: argparse.Namespace) -> float | None:
    try:
        import cupy
    except ImportError:
        return None
    ca, cb, cc = cupy.asarray(a), cupy.asarray(b), cupy.asarray(c)
    return _timed(cuda, lambda: cupy.add(ca, cb, out=cc), args.iters, args.warmup)


def _torch_add(cuda: Any, a: Any, b: Any, c: Any, args: argparse.Namespace) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    ta, tb, tc = (torch.as_tensor(v, device="cuda") for v in (a, b, c))
    return _timed(cuda, lambda: torch.add(ta, tb, out=tc), args.iters, args.warmup)


def _allreduce_rank(comm: Any, sizes: list[int], dtype: str, iters: int, warmup: int) -> list[tuple[int, float, int]]:
    from numba import cuda

    from shmcoll import device
    from shmcoll.kernels import cuda as kernels

    device.configure(comm, path="ipc")
    allreduce = comm.allreduce
    if kernels.SIMULATOR:
        # The simulator's device arrays have no __cuda_array_interface__, so the Communicator
        # would not recognise them: call the device layer directly.
        allreduce = comm.allreduce
    dt = np.dtype(dtype)
    out = []
    for size in sizes:
        count = size // dt.itemsize
        x = cuda.to_device(np.full(count, comm.rank + 1, dt))
        y = cuda.device_array(count, dt)
        for _ in range(warmup):
            allreduce(x, out=y)
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            allreduce(x, out=y)
        elapsed = (time.perf_counter() - t0) / iters  # each call returns with its result on the device
        want = comm.world_size * (comm.world_size + 1) // 2
        wrong = int(np.count_nonzero(y.copy_to_host() != want))
        out.append((size, elapsed, wrong))
    return out


def bench_allreduce(args: argparse.Namespace) -> list[AllreduceRow]:
    rows = []
    for n in args.nprocs:
        per_rank = shmcoll.spawn(
            _allreduce_rank,
            nprocs=n,
            args=(args.sizes, args.dtype.name, args.iters, args.warmup),
            timeout=args.timeout,
        )
        for i, size in enumerate(args.sizes):
            time_s = max(r[i][1] for r in per_rank)
            wrong = sum(r[i][2] for r in per_rank)
            row = AllreduceRow(size, n, time_s, wrong)
            rows.append(row)
            print(
                f"allreduce n={n} {format_size(size):>6}: busbw {row.busbw:8.1f} GB/s, #wrong {wrong}", file=sys.stderr
            )
    return rows


def _gbs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(kernel: list[KernelRow], allreduce: list[AllreduceRow], simulator: bool = False) -> str:
    """The summary: one line per size, then the two targets at 256 MiB (when measured)."""
    nprocs = sorted({r.world_size for r in allreduce})
    by_size: dict[int, dict[str, Any]] = {}
    for k in kernel:
        by_size.setdefault(k.size, {})["k"] = k
    for r in allreduce:
        by_size.setdefault(r.size, {})[r.world_size] = r
    head = f"{'size':>8} {'copy GB/s':>10} {'reduce GB/s':>12} {'% of copy':>10} {'cupy add':>9} {'torch add':>10}"
    for n in nprocs:
        head += f" {f'ar{n} busbw':>10} {f'ar{n}/copy':>9} {f'ar{n} #wrong':>10}"
    lines = []
    if simulator:
        lines.append("(CUDA simulator: timings are meaningless; this run only exercises the code)")
    lines += ["bandwidths count bytes read + written; allreduce busbw follows nccl-tests", head, "-" * len(head)]
    for size in sorted(by_size):
        entry = by_size[size]
        k = entry.get("k")
        line = f"{format_size(size):>8}"
        if k is not None:
            pct = 100 * k.reduce_gbs / k.copy_gbs
            cupy = None if k.cupy_s is None else 3 * size / k.cupy_s / 1e9
            torch = None if k.torch_s is None else 3 * size / k.torch_s / 1e9
            line += f" {k.copy_gbs:>10.1f} {k.reduce_gbs:>12.1f} {pct:>9.1f}% {_gbs(cupy):>9} {_gbs(torch):>10}"
        else:
            line += f" {'-':>10} {'-':>12} {'-':>10} {'-':>9} {'-':>10}"
        for n in nprocs:
            r = entry.get(n)
            if r is None:
                line += f" {'-':>10} {'-':>9} {'-':>10}"
                continue
            ratio = f"{r.busbw / k.copy_gbs:.2f}" if k is not None else "-"
            line += f" {r.busbw:>10.1f} {ratio:>9} {r.wrong:>10}"
        lines.append(line)
    target = by_size.get(TARGET_BYTES, {})
    k = target.get("k")
    if k is not None:
        pct = 100 * k.reduce_gbs / k.copy_gbs
        lines.append(
            f"target: reduction kernel >= 85% of copy at 256M: {pct:.1f}% ({'met' if pct >= 85 else 'NOT met'})"
        )
        for n in nprocs:
            r = target.get(n)
            if r is not None:
                ok = r.busbw * 2 >= k.copy_gbs
                lines.append(
                    f"target: allreduce busbw within 2x of copy at 256M, {n} ranks: {r.busbw:.1f} vs "
                    f"{k.copy_gbs:.1f} GB/s ({'met' if ok else 'NOT met'})"
                )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cuda = _cuda()
    except NoGPU as exc:
        print(f"gpu_bench: {exc}", file=sys.stderr)
        return 2
    from shmcoll.kernels import cuda as kernels

    if kernels.SIMULATOR and max(args.sizes) > SIMULATOR_MAX_BYTES:
        print(
            f"gpu_bench: under the CUDA simulator sizes are limited to {format_size(SIMULATOR_MAX_BYTES)} "
            f"(every simulated thread is Python); got {format_size(max(args.sizes))}",
            file=sys.stderr,
        )
        return 2
    if not kernels.SIMULATOR:
        from shmcoll.engine import cuda as engine

        print(f"gpu_bench: {engine.describe()}", file=sys.stderr)
    kernel_rows = [] if args.skip_kernel else bench_kernel(args, cuda)
    allreduce_rows = [] if args.skip_allreduce else bench_allreduce(args)
    print(format_table(kernel_rows, allreduce_rows, simulator=kernels.SIMULATOR))
    wrong = sum(r.wrong for r in allreduce_rows)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
