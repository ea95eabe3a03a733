"""A parameter server over shmcoll's send/recv/iprobe: a sharded sparse embedding table.

Ranks ``0 .. S-1`` are servers, ranks ``S .. S+W-1`` workers. The table (1M rows x 16 float32 by
default) is sharded across the servers by a hash of the row id. Each step, a worker draws a batch
of samples, each naming a few rows (Zipf-distributed, so some rows are hot and many workers touch
them at once), *pulls* the rows it needs from their servers, computes the gradient of a small
regression loss, and *pushes* the updates back. The last worker is deliberately slow.

Three modes:

* ``sync``: a server applies step ``t``'s updates once every worker has pushed them, and answers
  step ``t + 1``'s pulls only after that: synchronous SGD, paced by the slowest worker.
* ``straggler``: the step proceeds once a fraction of the workers (``--fraction``) has pushed;
  a late push is applied when it arrives (one step stale), never dropped. Once that fraction
  of the workers has finished its steps, the run ends and stragglers are told to stop.
* ``async``: every push is applied on arrival and every pull answered at once (stale reads and
  writes, no waiting); the run ends like ``straggler``'s.

Checks, exact (bitwise): updates are quantised to multiples of 2^-20 and the table stays small,
so float32 sums of them are exact in any order. In every mode the final table equals the initial
table plus every update the workers pushed, each counted once (nothing lost, nothing applied
twice); in ``sync`` mode it also equals a single-process simulation of synchronous SGD.

Protocol, and why it cannot deadlock. Messages are a 4-int64 header then payloads whose sizes the
header gives. A worker talks to one server at a time: a pull is "send request, receive reply";
a push is a send. A server reads a worker's whole message before doing anything else, and only
sends to a worker that is waiting for that reply (a pull it may answer later: meanwhile the
worker waits on that server only, and the server keeps serving others). So every blocked
``send`` or ``recv`` has its peer doing the matching operation, or about to: no cycle of waits
can form, however large the messages (a send larger than the ring waits for the receiver to
drain it). Servers use ``iprobe`` to serve whichever worker has a message waiting.

Run: python examples/parameter_server.py [--servers S] [--workers W] [--rows N] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import time
from typing import Any

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy loads: ranks are processes (they inherit this)

import numpy as np  # noqa: E402

import shmcoll  # noqa: E402

MODES = ("sync", "straggler", "async")
GRID = 2.0**-20  # every value in the table is a multiple of this: sums are exact in float32
MAX_UPDATE = 2.0**-6
PULL, PUSH, DONE = 1, 2, 3  # worker -> server message kinds
GO, STOP = 0, 1  # server -> worker reply status
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


# --- the table, the data, the model (shared by ranks and the single-process reference) -----------
def mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit integer hash (multiply, xor-shift), vectorised; wraps modulo 2^64 by design."""
    with np.errstate(over="ignore"):
        h = x.astype(np.uint64) * _GOLDEN
        return h ^ (h >> np.uint64(29))


def receive(comm, shape, dtype, src):  # type: ignore[no-untyped-def]
    """The next message from ``src`` in a new array (recv fills a buffer and returns a Status)."""
    buf = np.empty(shape, dtype)
    comm.recv(buf, src=src)
    return buf


def owner(ids: np.ndarray, servers: int) -> np.ndarray:
    """Which server holds each row."""
    return (mix(ids) % np.uint64(servers)).astype(np.int64)


def initial_rows(ids: np.ndarray, dim: int) -> np.ndarray:
    """Rows' starting values: small multiples of GRID, a pure function of the row id."""
    cells = ids.astype(np.uint64)[:, None] * np.uint64(dim) + np.arange(dim, dtype=np.uint64)
    small = (mix(cells) >> np.uint64(40)) % np.uint64(2048)
    return ((small.astype(np.int64) - 1024) * GRID).astype(np.float32)


def target(ids: np.ndarray) -> np.ndarray:
    """What the model should learn: each row's sum should approach this value in [-0.25, 0.25]."""
    return ((mix(ids.astype(np.uint64) + np.uint64(7)) >> np.uint64(50)) % np.uint64(9)).astype(np.float64) / 16 - 0.25


def draw_batch(seed: int, worker: int, step: int, batch: int, per_sample: int, rows: int) -> np.ndarray:
    """A batch of samples, each naming ``per_sample`` rows; Zipf-distributed, scattered by a hash."""
    rng = np.random.default_rng([seed, worker, step])
    z = rng.zipf(1.2, size=(batch, per_sample))
    return (mix(z) % np.uint64(rows)).astype(np.int64)


def compute_updates(ids: np.ndarray, uniq: np.ndarray, inverse: np.ndarray, emb: np.ndarray, lr: float):  # type: ignore[no-untyped-def]
    """The loss and each pulled row's update.

    The model predicts a sample's value as the sum of its rows' entries; the loss is half the
    squared error. Each row gets the mean of its samples' errors (a per-row normalised gradient,
    so hot rows do not take steps hundreds of times larger than cold ones), times ``-lr``,
    quantised to GRID and clipped.
    """
    row_sum = emb.astype(np.float64).sum(axis=1)
    pred = row_sum[inverse].sum(axis=1)
    err = pred - target(ids).sum(axis=1)
    grad = np.zeros(len(uniq))
    np.add.at(grad, inverse.ravel(), np.repeat(err, ids.shape[1]))
    uses = np.bincount(inverse.ravel(), minlength=len(uniq))
    step = np.clip(np.round(-lr * grad / uses / GRID) * GRID, -MAX_UPDATE, MAX_UPDATE)
    updates = np.repeat(step[:, None], emb.shape[1], axis=1).astype(np.float32)
    return float(0.5 * np.mean(err**2)), updates


def digest(a: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=16).hexdigest()


# --- the server ----------------------------------------------------------------------------------
def serve(comm: shmcoll.Communicator, cfg: dict[str, Any], mode: str) -> dict[str, Any]:
    s, S, W, dim = comm.rank, cfg["servers"], cfg["workers"], cfg["dim"]
    mine = np.flatnonzero(owner(np.arange(cfg["rows"]), S) == s)
    local = np.full(cfg["rows"], -1, np.int64)
    local[mine] = np.arange(len(mine))
    table = initial_rows(mine, dim)
    workers = list(range(S, S + W))
    quorum = W if mode == "sync" else max(1, math.ceil(cfg["fraction"] * W))
    clock = 0  # updates applied: step `clock`'s pushes are being collected
    stash: list[tuple[int, np.ndarray, np.ndarray]] = []  # pushes of step `clock`, not applied yet
    waiting: list[tuple[int, int, np.ndarray]] = []  # pulls of a future step: (worker, step, ids)
    done: set[int] = set()
    applied = dict.fromkeys(workers, 0)
    late = 0
    header = np.zeros(4, np.int64)

    def apply(ids: np.ndarray, updates: np.ndarray) -> None:
        np.add.at(table, local[ids], updates)

    def reply(w: int, ids: np.ndarray) -> None:
        status = STOP if len(done) >= quorum and mode != "sync" else GO
        comm.send(np.array([status, clock, len(ids), 0], np.int64), dst=w)
        if status == GO and len(ids):
            comm.send(table[local[ids]], dst=w)

    idle = 0
    comm.barrier()
    while len(done) < W:
        progressed = False
        for w in workers:
            if w in done or comm.iprobe(w) is None:
                continue
            progressed = True
            comm.recv(header, src=w)
            kind, step, n, _ = header
            ids = receive(comm, n, np.int64, w) if kind in (PULL, PUSH) and n else np.empty(0, np.int64)
            if kind == PULL:
                if mode == "async" or step <= clock:
                    reply(w, ids)
                else:
                    waiting.append((w, step, ids))
            elif kind == PUSH:
                updates = receive(comm, (n, dim), np.float32, w) if n else np.empty((0, dim), np.float32)
                if step > clock and mode != "async":
                    raise RuntimeError(f"server {s}: push for step {step} from rank {w} before step {clock} ended")
                applied[w] += 1
                if mode == "async":
                    apply(ids, updates)
                    clock += 1
                elif step < clock:  # a straggler's push: applied now, one or more steps stale
                    apply(ids, updates)
                    late += 1
                else:
                    stash.append((w, ids, updates))
                    if len(stash) >= quorum:
                        for _, i, u in sorted(stash, key=lambda p: p[0]):
                            apply(i, u)
                        stash.clear()
                        clock += 1
                        ready = [p for p in waiting if p[1] <= clock]
                        waiting = [p for p in waiting if p[1] > clock]
                        for pw, _, pids in ready:
                            reply(pw, pids)
            elif kind == DONE:
                done.add(w)
                if mode != "sync" and len(done) >= quorum:  # the run is over: waiting pulls get STOP
                    for pw, _, pids in waiting:
                        reply(pw, pids)
                    waiting = []
            else:
                raise RuntimeError(f"server {s}: unknown message kind {kind} from rank {w}")
        if progressed:
            idle = 0
        else:
            idle += 1
            if idle < 200:
                os.sched_yield()
            else:
                time.sleep(0.0002)  # nothing to do for a while: leave the cores to the workers
    for _, i, u in stash:  # the last step's pushes, if its quorum was never reached
        apply(i, u)
    comm.barrier()
    return {"role": "server", "digest": digest(table), "applied": applied, "late": late, "clock": clock}


# --- the worker ----------------------------------------------------------------------------------
def work(comm: shmcoll.Communicator, cfg: dict[str, Any], mode: str) -> dict[str, Any]:
    S, dim, worker = cfg["servers"], cfg["dim"], comm.rank - cfg["servers"]
    slow = worker == cfg["workers"] - 1 and cfg["slow_ms"] > 0
    header = np.zeros(4, np.int64)
    pushed_ids: list[np.ndarray] = []
    pushed: list[np.ndarray] = []
    losses = []
    sent = [0] * S
    steps_done = 0
    comm.barrier()
    start = time.perf_counter()
    for t in range(cfg["steps"]):
        ids = draw_batch(cfg["seed"], worker, t, cfg["batch"], cfg["per_sample"], cfg["rows"])
        uniq, inverse = np.unique(ids, return_inverse=True)
        inverse = inverse.reshape(ids.shape)
        where = owner(uniq, S)
        emb = np.empty((len(uniq), dim), np.float32)
        stop = False
        for s in range(S):  # pull, one server at a time
            sel = where == s
            comm.send(np.array([PULL, t, sel.sum(), 0], np.int64), dst=s)
            if sel.any():
                comm.send(uniq[sel], dst=s)
            comm.recv(header, src=s)
            status, _, n, _ = header
            if status == STOP:
                stop = True
                break
            if n:
                emb[sel] = receive(comm, (n, dim), np.float32, s)
        if stop:
            break
        loss, updates = compute_updates(ids, uniq, inverse, emb, cfg["lr"])
        if slow:
            time.sleep(cfg["slow_ms"] / 1e3)
        for s in range(S):  # push
            sel = where == s
            comm.send(np.array([PUSH, t, sel.sum(), 0], np.int64), dst=s)
            if sel.any():
                comm.send(uniq[sel], dst=s)
                comm.send(np.ascontiguousarray(updates[sel]), dst=s)
            sent[s] += 1
        pushed_ids.append(uniq)
        pushed.append(updates)
        losses.append(loss)
        steps_done += 1
    for s in range(S):
        comm.send(np.array([DONE, steps_done, 0, 0], np.int64), dst=s)
    elapsed = time.perf_counter() - start
    comm.barrier()
    # Everything this worker pushed, summed per row: exact, since every update is a multiple of GRID.
    all_ids = np.concatenate(pushed_ids) if pushed_ids else np.empty(0, np.int64)
    rows, inv = np.unique(all_ids, return_inverse=True)
    total = np.zeros((len(rows), dim), np.float64)
    if len(all_ids):
        np.add.at(total, inv, np.concatenate(pushed).astype(np.float64))
    return {
        "role": "worker",
        "steps": steps_done,
        "sent": sent,
        "elapsed_s": elapsed,
        "losses": losses,
        "rows": rows,
        "sums": total,
    }


def rank_main(comm: shmcoll.Communicator, cfg: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for mode in cfg["modes"]:
        out[mode] = serve(comm, cfg, mode) if comm.rank < cfg["servers"] else work(comm, cfg, mode)
    return out


# --- checks, in the launching process ---------------------------------------------------------------
def expected_digests(table: np.ndarray, servers: int) -> list[str]:
    where = owner(np.arange(len(table)), servers)
    return [digest(table[where == s]) for s in range(servers)]


def sync_reference(cfg: dict[str, Any]) -> np.ndarray:
    """Synchronous SGD on one process: every worker's step t reads the table as it was after step t-1."""
    table = initial_rows(np.arange(cfg["rows"]), cfg["dim"])
    for t in range(cfg["steps"]):
        step_updates = []
        for w in range(cfg["workers"]):
            ids = draw_batch(cfg["seed"], w, t, cfg["batch"], cfg["per_sample"], cfg["rows"])
            uniq, inverse = np.unique(ids, return_inverse=True)
            _, updates = compute_updates(ids, uniq, inverse.reshape(ids.shape), table[uniq], cfg["lr"])
            step_updates.append((uniq, updates))
        for uniq, updates in step_updates:
            np.add.at(table, uniq, updates)
    return table


def check(cfg: dict[str, Any], mode: str, results: list[dict[str, Any]], initial: np.ndarray) -> list[str]:
    """Problems found in one mode's results (empty if consistent)."""
    S = cfg["servers"]
    servers, workers = results[:S], results[S:]
    problems = []
    applied = [sum(sv["applied"][S + w] for sv in servers) for w in range(len(workers))]
    sent = [sum(wk["sent"]) for wk in workers]
    if applied != sent:
        problems.append(f"pushes sent per worker {sent} but applied {applied}")
    table = initial.astype(np.float64)
    for wk in workers:
        table[wk["rows"]] += wk["sums"]
    pushed = table.astype(np.float32)
    if not np.array_equal(pushed, table):
        problems.append("the updates left the exactly representable range")
    if [sv["digest"] for sv in servers] != expected_digests(pushed, S):
        problems.append("the table differs from initial + every pushed update applied once")
    if mode == "sync" and [sv["digest"] for sv in servers] != expected_digests(sync_reference(cfg), S):
        problems.append("the table differs from the single-process synchronous SGD reference")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description="A sharded parameter server over shmcoll point-to-point messages.")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=1_000_000, help="embedding table rows")
    parser.add_argument("--dim", type=int, default=16, help="embedding width")
    parser.add_argument("--steps", type=int, default=40, help="steps per worker")
    parser.add_argument("--batch", type=int, default=256, help="samples per worker per step")
    parser.add_argument("--per-sample", type=int, default=4, help="rows named by each sample")
    parser.add_argument("--lr", type=float, default=1 / 256)
    parser.add_argument("--slow-ms", type=float, default=20.0, help="extra time per step of the last worker")
    parser.add_argument("--fraction", type=float, default=0.75, help="straggler mode: pushes needed to proceed")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small table and few steps (what the tests run)")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.steps, args.batch, args.slow_ms = 100_000, 8, 64, 5.0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: a comma-separated subset of {', '.join(MODES)}")
    if args.servers < 1 or args.workers < 1:
        parser.error("need at least one server and one worker")
    if not 0 < args.fraction <= 1:
        parser.error("--fraction must be in (0, 1]")
    cfg = {**vars(args), "modes": modes}
    del cfg["quick"]
    quorum = max(1, math.ceil(args.fraction * args.workers))
    nprocs = args.servers + args.workers
    print(
        f"table {args.rows:,} x {args.dim} float32 on {args.servers} server(s) (hash-sharded), {args.workers} "
        f"worker(s), {args.batch} samples x {args.per_sample} rows per step, {args.steps} steps; the last worker "
        f"sleeps {args.slow_ms:g} ms per step; straggler quorum {quorum}/{args.workers}"
    )
    results = shmcoll.spawn(rank_main, nprocs, args=(cfg,), timeout=600)
    initial = initial_rows(np.arange(args.rows), args.dim)
    header = ("mode", "steps per worker", "late pushes", "wall", "samples/s", "loss first->last")
    print(f"{header[0]:<10} {header[1]:>18} {header[2]:>11} {header[3]:>8} {header[4]:>10} {header[5]:>18}")
    failures = []
    for mode in modes:
        per_rank = [r[mode] for r in results]
        workers = per_rank[args.servers :]
        wall = max(w["elapsed_s"] for w in workers)
        samples = sum(w["steps"] for w in workers) * args.batch
        late = sum(sv["late"] for sv in per_rank[: args.servers])
        steps = "/".join(str(w["steps"]) for w in workers)
        first = np.mean([w["losses"][0] for w in workers if w["losses"]])
        last = np.mean([w["losses"][-1] for w in workers if w["losses"]])
        print(f"{mode:<10} {steps:>18} {late:>11} {wall:>7.2f}s {samples / wall:>10,.0f} {first:>8.4f} -> {last:.4f}")
        failures += [f"{mode}: {p}" for p in check(cfg, mode, per_rank, initial)]
    if failures:
        raise SystemExit("INCONSISTENT:\n  " + "\n  ".join(failures))
    print("consistent: every pushed update applied exactly once in every mode; sync equals the single-process SGD")


if __name__ == "__main__":
    main()
