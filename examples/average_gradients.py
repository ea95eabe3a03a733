"""Data-parallel gradient averaging, ported from torch.distributed to shmcoll.

The torch.distributed tutorial's version::

    def average_gradients(model):
        size = float(dist.get_world_size())
        for param in model.parameters():
            dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
            param.grad.data /= size

In shmcoll the communicator is the API and arrays are numpy arrays: ``dist.all_reduce(t, op)``
becomes ``comm.allreduce(a, op=...)`` (in place, like torch's), ``dist.get_world_size()`` becomes
``comm.world_size``, and ``ReduceOp.AVG`` does the division inside the collective. This script
trains a small torch-style model (``parameters()`` yielding objects with ``.data`` and ``.grad``)
three ways and checks they agree:

* ``literal``: the tutorial's loop, SUM then ``/=``, one allreduce per parameter;
* ``per_param``: the same with ``op=ReduceOp.AVG``;
* ``bucketed``: all gradients copied into one flat buffer, one allreduce per step, copied back
  (what DDP's gradient buckets do; ``shmcoll.train`` goes further and keeps the gradients as
  views of the bucket, so there is nothing to copy).

Each rank computes the mean loss's gradient on its equal share of the global batch, so the
averaged gradient is the global batch's, and the trained weights match a single process
trained on the whole batch (checked here, to float32 rounding).

Run: python examples/average_gradients.py [--nprocs N] [--steps S] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

# Before numpy loads: one BLAS thread per process (ranks are processes; they inherit this), and the
# single-process reference then sums in the same order as the ranks.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # ranks are processes: one BLAS thread each (inherited by the ranks)

import numpy as np  # noqa: E402

import shmcoll  # noqa: E402
from shmcoll import ReduceOp  # noqa: E402


# --- a torch-style model in numpy -------------------------------------------------------------------
class Parameter:
    """A tensor and its gradient, like ``torch.nn.Parameter``'s ``.data`` and ``.grad``."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data.astype(np.float32)
        self.grad = np.zeros_like(self.data)


class Linear:
    def __init__(self, fan_in: int, fan_out: int, rng: np.random.Generator) -> None:
        self.weight = Parameter(rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in))
        self.bias = Parameter(np.zeros(fan_out))
        self._x = np.empty(0, np.float32)

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._x = x
        return x @ self.weight.data + self.bias.data

    def backward(self, dy: np.ndarray) -> np.ndarray:
        self.weight.grad[...] = self._x.T @ dy
        self.bias.grad[...] = dy.sum(axis=0)
        return dy @ self.weight.data.T


class Model:
    """Linear layers with ReLU between them, softmax cross-entropy on top."""

    def __init__(self, sizes: tuple[int, ...], seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.layers = [Linear(i, o, rng) for i, o in zip(sizes[:-1], sizes[1:], strict=True)]

    def parameters(self) -> Iterator[Parameter]:
        for layer in self.layers:
            yield layer.weight
            yield layer.bias

    def loss_backward(self, x: np.ndarray, y: np.ndarray) -> float:
        """Mean cross-entropy over the batch; fills every parameter's ``.grad``."""
        hidden = []
        h = x
        for i, layer in enumerate(self.layers):
            h = layer.forward(h)
            if i < len(self.layers) - 1:
                h = np.maximum(h, 0)
                hidden.append(h)
        p = np.exp(h - h.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        rows = np.arange(len(y))
        loss = float(-np.log(p[rows, y]).mean())
        p[rows, y] -= 1
        d = p / len(y)
        for i in range(len(self.layers) - 1, -1, -1):
            d = self.layers[i].backward(d)
            if i > 0:
                d = d * (hidden[i - 1] > 0)
        return loss

    def sgd(self, lr: float) -> None:
        for p in self.parameters():
            p.data -= np.float32(lr) * p.grad

    def flat(self) -> np.ndarray:
        return np.concatenate([p.data.ravel() for p in self.parameters()])


# --- the three ways to average -------------------------------------------------------------------
def average_gradients_literal(comm: shmcoll.Communicator, model: Model) -> None:
    """The tutorial's loop, line for line."""
    size = float(comm.world_size)
    for param in model.parameters():
        comm.allreduce(param.grad, op=ReduceOp.SUM)
        param.grad /= size


def average_gradients(comm: shmcoll.Communicator, model: Model) -> None:
    """One allreduce per parameter; AVG divides by the world size inside the collective."""
    for param in model.parameters():
        comm.allreduce(param.grad, op=ReduceOp.AVG)


def average_gradients_bucketed(comm: shmcoll.Communicator, model: Model, bucket: np.ndarray) -> None:
    """All gradients in one flat buffer: one allreduce per step instead of one per parameter."""
    at = 0
    for param in model.parameters():
        bucket[at : at + param.grad.size] = param.grad.ravel()
        at += param.grad.size
    comm.allreduce(bucket[:at], op=ReduceOp.AVG)
    at = 0
    for param in model.parameters():
        param.grad[...] = bucket[at : at + param.grad.size].reshape(param.grad.shape)
        at += param.grad.size


# --- training ------------------------------------------------------------------------------------
def make_data(n: int, dim: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic classification task: labels from a fixed random linear 'teacher'."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    teacher = rng.standard_normal((dim, classes))
    return x, np.argmax(x @ teacher, axis=1)


def batches(x: np.ndarray, y: np.ndarray, batch: int, steps: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.choice(len(y), size=batch, replace=False)
        yield x[idx], y[idx]


FORMS = ("literal", "per_param", "bucketed")


def worker(comm: shmcoll.Communicator, sizes: tuple[int, ...], batch: int, steps: int, lr: float) -> dict[str, Any]:
    x, y = make_data(4096, sizes[0], sizes[-1], seed=1)
    share = batch // comm.world_size
    lo, hi = comm.rank * share, (comm.rank + 1) * share  # this rank's part of every global batch
    out: dict[str, Any] = {}
    for form in FORMS:
        model = Model(sizes, seed=0)  # the same initial weights on every rank
        bucket = np.empty(sum(p.data.size for p in model.parameters()), np.float32)
        average: Callable[[], None]
        if form == "literal":
            average = functools.partial(average_gradients_literal, comm, model)
        elif form == "per_param":
            average = functools.partial(average_gradients, comm, model)
        else:
            average = functools.partial(average_gradients_bucketed, comm, model, bucket)
        comm.barrier()
        times, losses = [], []
        for xb, yb in batches(x, y, batch, steps, seed=2):
            loss = model.loss_backward(xb[lo:hi], yb[lo:hi])
            t0 = time.perf_counter()
            average()
            times.append(time.perf_counter() - t0)
            model.sgd(lr)
            losses.append(loss)
        # Replicas must be bitwise identical: compare every rank's weights with rank 0's.
        everyone = comm.allgather(model.flat())
        assert all(np.array_equal(everyone[r], everyone[0]) for r in range(comm.world_size)), f"{form}: replicas differ"
        out[form] = {"params": everyone[0], "median_avg_s": float(np.median(times[1:] or times)), "losses": losses}
    return out


def single_process(sizes: tuple[int, ...], batch: int, steps: int, lr: float) -> np.ndarray:
    """The same training on one process, whole global batch at once: what the ranks must match."""
    x, y = make_data(4096, sizes[0], sizes[-1], seed=1)
    model = Model(sizes, seed=0)
    for xb, yb in batches(x, y, batch, steps, seed=2):
        model.loss_backward(xb, yb)
        model.sgd(lr)
    return model.flat()


def main() -> None:
    parser = argparse.ArgumentParser(description="Gradient averaging ported from torch.distributed to shmcoll.")
    parser.add_argument("--nprocs", type=int, default=max(2, min(4, len(os.sched_getaffinity(0)))))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=256, help="global batch (a multiple of --nprocs)")
    parser.add_argument("--quick", action="store_true", help="a few steps (what the tests run)")
    args = parser.parse_args()
    if args.quick:
        args.steps = 10
    if args.batch % args.nprocs:
        parser.error(f"--batch {args.batch} must be a multiple of --nprocs {args.nprocs} (equal shards)")
    sizes, lr = (32, 128, 128, 128, 4), 0.1
    results = shmcoll.spawn(worker, args.nprocs, args=(sizes, args.batch, args.steps, lr), timeout=300)[0]
    reference = single_process(sizes, args.batch, args.steps, lr)
    n_params = len(reference)
    print(
        f"{args.nprocs} ranks, {args.steps} steps, global batch {args.batch}, model {sizes} ({n_params:,} parameters)"
    )
    header = ("form", "allreduce calls/step", "averaging time/step", "final loss", "max |w - w_1proc|")
    print(f"{header[0]:<10} {header[1]:>20} {header[2]:>20} {header[3]:>11} {header[4]:>18}")
    calls = {"literal": 2 * (len(sizes) - 1), "per_param": 2 * (len(sizes) - 1), "bucketed": 1}
    worst = 0.0
    for form in FORMS:
        r = results[form]
        diff = float(np.max(np.abs(r["params"] - reference)))
        worst = max(worst, diff)
        print(
            f"{form:<10} {calls[form]:>20} {r['median_avg_s'] * 1e3:>17.3f} ms {r['losses'][-1]:>11.4f} {diff:>18.2e}"
        )
    agree = max(float(np.max(np.abs(results[f]["params"] - results["literal"]["params"]))) for f in FORMS)
    print(f"the three forms agree to {agree:.2e}; every form matches the single-process run to {worst:.2e}")
    assert agree <= 1e-5, "the averaging forms disagree"
    assert worst <= 1e-4, "data-parallel training does not match the single-process run"
    print("OK: replicas bitwise identical, same result as one process")


if __name__ == "__main__":
    main()
