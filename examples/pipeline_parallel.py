"""Pipeline parallelism (GPipe) over shmcoll's send/recv: an MLP's layers split across ranks.

Each rank is a *stage* holding a contiguous run of the network's layers (inter-operator model
parallelism), chosen to balance the stages' arithmetic. A training step cuts the global batch
into ``m`` micro-batches. Forward: stage ``s`` receives micro-batch ``j``'s activations from stage
``s - 1``, runs its layers and sends the result to stage ``s + 1``; the last stage computes the
loss. Backward, in reverse micro-batch order: gradients flow from stage ``s + 1`` to ``s``, and
each stage accumulates its weight gradients over the micro-batches. Then every stage applies one
SGD update (a synchronous flush, as in GPipe), so the result is exactly one step of full-batch
training, up to the order of float32 additions: the script checks the weights against a single
process training the whole model.

The bubble: with ``p`` stages of equal cost, a step takes ``m + p - 1`` micro-batch slots of which
each stage is busy ``m``, so the idle fraction is ``(p - 1) / (m + p - 1)``. The script measures, on
each stage, the time spent computing against the step's wall time, and prints the measured idle
fraction next to that theory. Communication is counted as idle here: it is time the stage does no
arithmetic. A ``send`` returns once the data is in the shared-memory ring; a message larger than
the ring (4 x 64 KiB by default) waits for the receiver to drain it, which GPipe's asynchronous
sends would hide.

Why it cannot deadlock: activations only flow to ``s + 1`` and gradients only to ``s - 1``, on
separate one-way channels; in each phase every stage handles micro-batches in the same order, so
the stage a blocked sender waits on is always receiving from it.

Run: python examples/pipeline_parallel.py [--nprocs P] [--steps S] [--quick]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

# Before numpy loads: one BLAS thread per process (ranks are processes; they inherit this), and the
# single-process reference then sums in the same order as the ranks.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # ranks are processes: one BLAS thread each (inherited by the ranks)

import numpy as np  # noqa: E402

import shmcoll  # noqa: E402

MICRO_BATCHES = (1, 2, 4, 8)


def partition(costs: list[int], parts: int) -> list[tuple[int, int]]:
    """Split ``costs`` into ``parts`` contiguous, non-empty runs minimising the largest run's sum."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} layers into {parts} stages")
    prefix = np.concatenate([[0], np.cumsum(costs)])
    inf = float("inf")
    # best[k][i]: the smallest possible max-stage cost for the first i layers in k stages
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], float(prefix[i] - prefix[j]))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = []
    i = n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


class Stage:
    """Layers ``[first, last)`` of a ReLU MLP, with activations kept per micro-batch."""

    def __init__(self, sizes: tuple[int, ...], first: int, last: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        all_w = [rng.standard_normal((i, o)) * np.sqrt(2.0 / i) for i, o in zip(sizes[:-1], sizes[1:], strict=True)]
        self.weights = [w.astype(np.float32) for w in all_w[first:last]]  # every stage draws all: same init
        self.biases = [np.zeros(w.shape[1], np.float32) for w in self.weights]
        self.grad_w = [np.zeros_like(w) for w in self.weights]
        self.grad_b = [np.zeros_like(b) for b in self.biases]
        self.is_last = last == len(sizes) - 1
        self.saved: dict[int, list[np.ndarray]] = {}

    def forward(self, j: int, x: np.ndarray) -> np.ndarray:
        acts = [x]
        for k, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            x = x @ w + b
            if not (self.is_last and k == len(self.weights) - 1):
                x = np.maximum(x, 0)
            acts.append(x)
        self.saved[j] = acts
        return x

    def backward(self, j: int, d: np.ndarray) -> np.ndarray:
        """Accumulates the weight gradients; returns the gradient w.r.t. the stage's input."""
        acts = self.saved.pop(j)
        for k in range(len(self.weights) - 1, -1, -1):
            if not (self.is_last and k == len(self.weights) - 1):
                d = d * (acts[k + 1] > 0)
            self.grad_w[k] += acts[k].T @ d
            self.grad_b[k] += d.sum(axis=0)
            d = d @ self.weights[k].T
        return d

    def step(self, lr: float) -> None:
        for p, g in zip(self.weights + self.biases, self.grad_w + self.grad_b, strict=True):
            p -= np.float32(lr) * g
            g[...] = 0


def softmax_xent(logits: np.ndarray, y: np.ndarray, batch: int) -> tuple[float, np.ndarray]:
    """Sum of the losses, and the gradient of (sum of the losses / batch) w.r.t. the logits."""
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = float(-np.log(p[rows, y].astype(np.float64)).sum())
    p[rows, y] -= 1
    return loss, (p / batch).astype(np.float32)


def load_batches(batch: int, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    from shmcoll.train.data import as_features, load_bundled

    data = load_bundled()
    x, y = as_features(data.train_images), data.train_labels.astype(np.int64)
    idx = [np.arange(i * batch, (i + 1) * batch) % len(y) for i in range(steps)]  # wraps around if needed
    return [(x[i], y[i]) for i in idx]


def run_stage(comm: shmcoll.Communicator, sizes: tuple[int, ...], batch: int, steps: int, lr: float) -> dict[str, Any]:
    p, s = comm.world_size, comm.rank
    costs = [i * o for i, o in zip(sizes[:-1], sizes[1:], strict=True)]
    first, last = partition(costs, p)[s]
    data = load_batches(batch, steps)
    out: dict[str, Any] = {"layers": (first, last), "runs": {}}
    for m in MICRO_BATCHES:
        stage = Stage(sizes, first, last, seed=0)
        bounds = [(batch * j // m, batch * (j + 1) // m) for j in range(m)]
        busy_s, wall_s, losses = [], [], []
        for x, y in data:
            comm.barrier()  # every stage starts the step together
            t_start = time.perf_counter()
            busy = 0.0
            loss = 0.0
            dlogits: dict[int, np.ndarray] = {}
            for j, (lo, hi) in enumerate(bounds):  # forward, micro-batch by micro-batch
                if s == 0:
                    h = x[lo:hi]
                else:
                    h = np.empty((hi - lo, sizes[first]), np.float32)
                    comm.recv(h, src=s - 1)
                t0 = time.perf_counter()
                h = stage.forward(j, h)
                if stage.is_last:
                    part, dlogits[j] = softmax_xent(h, y[lo:hi], batch)
                    loss += part
                busy += time.perf_counter() - t0
                if not stage.is_last:
                    comm.send(np.ascontiguousarray(h), dst=s + 1)
            for j in reversed(range(m)):  # backward, last micro-batch first
                lo, hi = bounds[j]
                if stage.is_last:
                    d = dlogits.pop(j)
                else:
                    d = np.empty((hi - lo, sizes[last]), np.float32)
                    comm.recv(d, src=s + 1)
                t0 = time.perf_counter()
                d = stage.backward(j, d)
                busy += time.perf_counter() - t0
                if s > 0:
                    comm.send(np.ascontiguousarray(d, dtype=np.float32), dst=s - 1)
            t0 = time.perf_counter()
            stage.step(lr)
            t_end = time.perf_counter()
            busy += t_end - t0
            busy_s.append(busy)
            wall_s.append(t_end - t_start)
            losses.append(loss / batch)
        out["runs"][m] = {
            "busy_s": busy_s,
            "wall_s": wall_s,
            "losses": losses,
            "weights": stage.weights,
            "biases": stage.biases,
        }
    return out


def single_process(
    sizes: tuple[int, ...], batch: int, steps: int, lr: float, micro_batches: int
) -> tuple[list[np.ndarray], list[float]]:
    """The whole model on one process, accumulating over micro-batches in the pipeline's order
    (all forwards, then backwards from the last micro-batch); ``micro_batches=1`` is plain
    whole-batch training."""
    stage = Stage(sizes, 0, len(sizes) - 1, seed=0)
    m = micro_batches
    bounds = [(batch * j // m, batch * (j + 1) // m) for j in range(m)]
    losses = []
    for x, y in load_batches(batch, steps):
        loss = 0.0
        grads = {}
        for j, (lo, hi) in enumerate(bounds):
            part, grads[j] = softmax_xent(stage.forward(j, x[lo:hi]), y[lo:hi], batch)
            loss += part
        for j in reversed(range(m)):
            stage.backward(j, grads.pop(j))
        stage.step(lr)
        losses.append(loss / batch)
    return stage.weights + stage.biases, losses


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(np.subtract(x, y)))) for x, y in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description="GPipe-style pipeline parallelism over shmcoll send/recv.")
    parser.add_argument("--nprocs", type=int, default=max(2, min(4, len(os.sched_getaffinity(0)))), help="stages")
    parser.add_argument("--steps", type=int, default=8, help="training steps per micro-batch count")
    parser.add_argument("--batch", type=int, default=512, help="global batch")
    parser.add_argument("--width", type=int, default=512, help="hidden layer width")
    parser.add_argument("--layers", type=int, default=8, help="dense layers")
    parser.add_argument("--quick", action="store_true", help="a small model and 3 steps (what the tests run)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch, args.width, args.layers = 3, 128, 64, 4
    if args.batch < max(MICRO_BATCHES):
        parser.error(f"--batch must be at least {max(MICRO_BATCHES)}")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step of each run is not timed)")
    sizes = (784, *([args.width] * (args.layers - 1)), 10)
    lr, p = 0.05, args.nprocs
    stages = shmcoll.spawn(run_stage, p, args=(sizes, args.batch, args.steps, lr), timeout=600)
    whole_params, whole_losses = single_process(sizes, args.batch, args.steps, lr, 1)

    print(f"MLP {'-'.join(map(str, sizes))} on {p} stages, global batch {args.batch}, {args.steps} steps per row")
    for s, st in enumerate(stages):
        first, last = st["layers"]
        print(f"  stage {s}: layers {first}..{last - 1} ({'-'.join(map(str, sizes[first : last + 1]))})")
    print(
        "bubble: idle fraction of the stages (median over steps); same order: one process accumulating the "
        "same micro-batches in the same order; whole batch: one process, no micro-batches"
    )
    header = ("micro-batches", "bubble measured", "(p-1)/(m+p-1)", "step time", "same order", "whole batch")
    print(f"{header[0]:>13} {header[1]:>16} {header[2]:>14} {header[3]:>11} {header[4]:>10} {header[5]:>21}")
    mismatched, worst = [], 0.0
    for m in MICRO_BATCHES:
        runs = [st["runs"][m] for st in stages]
        # The step's wall time is the slowest stage's; skip the first step (it builds the plans).
        wall = np.max([r["wall_s"][1:] for r in runs], axis=0)
        idle = [1 - np.asarray(r["busy_s"][1:]) / wall for r in runs]
        measured = float(np.median(np.mean(idle, axis=0)))
        params = [w for r in runs for w in r["weights"]] + [b for r in runs for b in r["biases"]]
        losses = runs[-1]["losses"]
        same_params, same_losses = single_process(sizes, args.batch, args.steps, lr, m)
        identical = _max_diff(params, same_params) == 0 and losses == same_losses
        if not identical:
            mismatched.append(m)
        dw, dloss = _max_diff(params, whole_params), _max_diff([np.array(losses)], [np.array(whole_losses)])
        worst = max(worst, dw, dloss)
        theory = (p - 1) / (m + p - 1)
        step_ms = np.median(wall) * 1e3
        verdict = "bitwise" if identical else "DIFFERS"
        print(
            f"{m:>13} {measured:>16.3f} {theory:>14.3f} {step_ms:>8.1f} ms {verdict:>10} dw {dw:.1e} dloss {dloss:.1e}"
        )
    print(
        f"every pipeline run equals one process doing the same arithmetic, bit for bit; the whole-batch run differs "
        f"by float32 rounding only (largest |dw| or |dloss| {worst:.1e})"
    )
    assert not mismatched, (
        f"the pipeline's result differs from the single-process model with {mismatched} micro-batches"
    )
    assert worst <= 1e-3, "the pipeline's result is further from whole-batch training than float32 rounding explains"
    print("OK")


if __name__ == "__main__":
    main()
