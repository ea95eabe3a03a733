"""Data-parallel training of an MLP on MNIST over shmcoll: the engine behind ``shmcoll train mnist``.

Every rank holds a full replica of the model. Each step, the global batch (the same indices on
every rank, from a per-epoch permutation seeded by ``seed``) is cut into one contiguous shard per
rank; each rank computes the gradients on its shard, and one ``comm.allreduce(bucket,
op=ReduceOp.AVG)`` per bucket averages them. Every rank then applies the same update to the same
parameters, so the replicas stay bitwise identical; a digest of the parameters is allgathered
every ``check_every`` steps and any difference raises :class:`ReplicaDivergenceError`.

Why the result equals single-process training with the same global batch: rank ``r`` computes
``g_r = (world_size / B) * sum of its examples' loss gradients`` and AVG divides the sum over
ranks by ``world_size``, so every rank gets ``(1 / B) * sum over the whole batch``: the gradient
of the batch's mean loss, even when ``B`` is not a multiple of ``world_size``. Only the order of
the float32 additions differs from one process, so the loss curves agree to rounding.

The gradient bucket carries two more numbers behind the gradients, the shard's loss sum and
correct count (scaled the same way), so the same allreduce also yields the global batch's mean
loss and accuracy, with no second call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import numpy as np

import shmcoll
from shmcoll import ReduceOp
from shmcoll.train.data import Dataset, as_features, load_bundled, load_idx_dir
from shmcoll.train.mlp import MLP, SGD, warm_kernels

# Ranks are processes: a multi-threaded BLAS in each would oversubscribe the cores.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
_STATS = 2  # values carried behind the gradients in the last bucket: loss, accuracy


class ReplicaDivergenceError(RuntimeError):
    """The ranks' parameters stopped being bitwise identical."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What to train and how (see ``shmcoll train mnist --help`` for each option)."""

    nprocs: int = 2
    epochs: int = 3
    batch_size: int = 128
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    hidden: tuple[int, ...] = (256, 128)
    algorithm: str = "auto"
    bucket_mb: float = 25.0
    check_every: int = 50
    data_dir: str | None = None
    max_steps_per_epoch: int | None = None
    timeout_s: float | None = None
    slot_bytes: int | None = None  # ring slot size of the ranks' communicator (None: SHMCOLL_SLOT_BYTES)
    progress: bool = False
    inject_divergence_at: int | None = None  # tests: perturb rank 1's parameters after this step

    def validate(self) -> None:
        """Raise ``ValueError`` for settings that cannot work, before any process starts."""
        checks = [
            (self.nprocs >= 1, f"nprocs must be >= 1, got {self.nprocs}"),
            (self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (self.batch_size >= self.nprocs, f"batch size {self.batch_size} is smaller than nprocs {self.nprocs}"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}"),
            (len(self.hidden) >= 1 and all(h >= 1 for h in self.hidden), f"bad hidden sizes {self.hidden}"),
            (self.bucket_mb > 0, f"bucket size must be > 0 MiB, got {self.bucket_mb}"),
            (self.check_every >= 1, f"check_every must be >= 1, got {self.check_every}"),
            (
                self.slot_bytes is None or (self.slot_bytes >= 64 and self.slot_bytes % 64 == 0),
                f"slot size must be a multiple of 64 bytes, got {self.slot_bytes}",
            ),
            (
                self.max_steps_per_epoch is None or self.max_steps_per_epoch >= 1,
                f"max_steps_per_epoch must be >= 1, got {self.max_steps_per_epoch}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.data_dir is not None and not os.path.isdir(self.data_dir):
            raise ValueError(f"--data-dir {self.data_dir}: not a directory")
        if self.algorithm != "auto":
            from shmcoll.algos import registry

            registry.get("allreduce", self.algorithm)  # raises ValueError naming the registered ones


@dataclasses.dataclass
class EpochStats:
    """One epoch: training loss and accuracy (over its steps' global batches), held-out loss and
    accuracy after it, and its wall time."""

    epoch: int
    train_loss: float
    train_acc: float
    test_loss: float
    test_acc: float
    seconds: float


@dataclasses.dataclass
class TrainResult:
    """What a run produced, gathered from every rank."""

    config: TrainConfig
    dataset: str
    num_params: int
    buckets: int
    losses: np.ndarray  # global mean loss of every step
    epochs: list[EpochStats]
    compute_s: list[np.ndarray]  # per rank, per step: forward, backward, update, batch preparation
    comm_s: list[np.ndarray]  # per rank, per step: the allreduce calls
    digest_checks: int
    params: np.ndarray  # rank 0's final parameters
    wall_s: float

    @property
    def test_acc(self) -> float:
        return self.epochs[-1].test_acc

    def step_times(self) -> dict[str, float]:
        """Seconds per step on rank 0, over all steps but the first (it builds the plans): the mean
        and the median of compute, communication and their sum, and the slowest rank's mean."""
        skip = 1 if len(self.losses) > 1 else 0
        compute, comm = self.compute_s[0][skip:], self.comm_s[0][skip:]
        return {
            "compute": float(np.mean(compute)),
            "comm": float(np.mean(comm)),
            "total": float(np.mean(compute + comm)),
            "compute_median": float(np.median(compute)),
            "comm_median": float(np.median(comm)),
            "total_median": float(np.median(compute + comm)),
            "slowest_total": max(
                float(np.mean(c[skip:] + m[skip:])) for c, m in zip(self.compute_s, self.comm_s, strict=True)
            ),
        }


# --- the rank's side ------------------------------------------------------------------------------
def _digest(params: np.ndarray) -> np.ndarray:
    return np.frombuffer(hashlib.blake2b(params.tobytes(), digest_size=16).digest(), dtype=np.uint8).copy()


def _check_replicas(comm: shmcoll.Communicator, params: np.ndarray, step: int) -> None:
    digests = comm.allgather(_digest(params))
    differ = [r for r in range(comm.world_size) if not np.array_equal(digests[r], digests[0])]
    if differ:
        raise ReplicaDivergenceError(
            f"rank {comm.rank}: after step {step} the parameters of rank(s) {differ} differ from rank 0's "
            f"(digests {[bytes(d[:4]).hex() for d in digests]}): data-parallel replicas must stay bitwise identical"
        )


def _shard(lo: int, hi: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous part of ``[lo, hi)``; the parts differ in size by at most one."""
    n = hi - lo
    return lo + n * rank // world_size, lo + n * (rank + 1) // world_size


class _Progress:
    """A one-line progress bar on a terminal (redrawn at most every 0.1 s); elsewhere, nothing
    (the epoch summary line follows anyway)."""

    def __init__(self, stream: TextIO, total: int, label: str, enabled: bool) -> None:
        self.stream = stream
        self.total = total
        self.label = label
        self.enabled = enabled and stream.isatty()
        self.last = 0.0
        self.width = 30

    def update(self, done: int, loss: float, acc: float) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.1 and done < self.total):
            return
        self.last = now
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total}  loss {loss:.4f}  acc {acc:.3f}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * (len(self.label) + self.width + 48) + "\r")
            self.stream.flush()


def _weighted(values: np.ndarray, weights: np.ndarray) -> float:
    return float(np.dot(values, weights) / weights.sum())


@functools.lru_cache(maxsize=2)
def _load_dataset(data_dir: str | None) -> Dataset:
    return load_idx_dir(data_dir) if data_dir else load_bundled()


def _load(cfg: TrainConfig) -> Dataset:
    return _load_dataset(cfg.data_dir)


def model_sizes(cfg: TrainConfig, data: Dataset) -> tuple[int, ...]:
    """Layer widths: the image's pixels, the hidden layers, the 10 classes."""
    return (int(np.prod(data.train_images.shape[1:])), *cfg.hidden, 10)


def describe(cfg: TrainConfig) -> str:
    """One line on what a run will do (loads the data set, so a bad ``data_dir`` raises here)."""
    data = _load(cfg)
    sizes = model_sizes(cfg, data)
    num_params = sum(i * o + o for i, o in zip(sizes[:-1], sizes[1:], strict=True))
    per_rank = cfg.batch_size / cfg.nprocs
    return (
        f"{data.describe()}; MLP {'-'.join(map(str, sizes))} ({num_params:,} parameters); "
        f"{cfg.nprocs} rank(s), global batch {cfg.batch_size} ({per_rank:g} per rank), lr {cfg.lr}, "
        f"momentum {cfg.momentum}, seed {cfg.seed}"
    )


def _evaluate(comm: shmcoll.Communicator, model: MLP, images: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """Held-out loss and accuracy, each rank evaluating its share of the images."""
    lo, hi = _shard(0, len(labels), comm.rank, comm.world_size)
    loss_sum, correct = model.evaluate(as_features(images[lo:hi]), labels[lo:hi].astype(np.int64))
    totals = comm.allreduce(np.array([loss_sum, correct], dtype=np.float64))
    return float(totals[0]) / len(labels), float(totals[1]) / len(labels)


def rank_main(comm: shmcoll.Communicator, cfg: TrainConfig) -> dict[str, Any]:
    """One rank of a data-parallel run (called by :func:`train` through ``shmcoll.spawn``)."""
    data = _load(cfg)
    n_train = len(data.train_labels)
    rank, world = comm.rank, comm.world_size
    sizes = model_sizes(cfg, data)
    num_params = sum(i * o + o for i, o in zip(sizes[:-1], sizes[1:], strict=True))
    bucket = np.zeros(num_params + _STATS, dtype=np.float32)
    model = MLP(sizes, seed=cfg.seed, grad_buffer=bucket)
    comm.broadcast(model.params, root=0)  # as DDP does: replicas start from rank 0's, whatever the seed did
    opt = SGD(model.params, model.grads, cfg.lr, cfg.momentum)
    per_bucket = max(1, int(cfg.bucket_mb * 2**20) // bucket.itemsize)
    views = [bucket[i : i + per_bucket] for i in range(0, bucket.size, per_bucket)]

    steps_per_epoch = math.ceil(n_train / cfg.batch_size)
    if cfg.max_steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, cfg.max_steps_per_epoch)
    total_steps = steps_per_epoch * cfg.epochs
    losses = np.zeros(total_steps)
    accs = np.zeros(total_steps)
    compute_s = np.zeros(total_steps)
    comm_s = np.zeros(total_steps)
    sizes_seen = np.zeros(total_steps)
    epochs: list[EpochStats] = []
    checks = 0
    verbose = cfg.progress and rank == 0
    step = 0
    clock = time.perf_counter
    for epoch in range(cfg.epochs):
        started = time.monotonic()
        first = step
        order = np.random.default_rng([cfg.seed, epoch]).permutation(n_train)
        bar = _Progress(sys.stderr, steps_per_epoch, f"epoch {epoch + 1}/{cfg.epochs}", verbose)
        for i in range(steps_per_epoch):
            t0 = clock()
            lo, hi = i * cfg.batch_size, min((i + 1) * cfg.batch_size, n_train)
            mine = order[slice(*_shard(lo, hi, rank, world))]
            x = as_features(data.train_images[mine])
            y = data.train_labels[mine].astype(np.int64)
            scale = world / (hi - lo)
            loss_sum, correct = model.loss_and_grad(x, y, scale)
            bucket[-2] = loss_sum * scale
            bucket[-1] = correct * scale
            t1 = clock()
            for view in views:
                comm.allreduce(view, op=ReduceOp.AVG, algorithm=cfg.algorithm)
            t2 = clock()
            opt.step()
            t3 = clock()
            compute_s[step] = (t1 - t0) + (t3 - t2)
            comm_s[step] = t2 - t1
            losses[step], accs[step], sizes_seen[step] = bucket[-2], bucket[-1], hi - lo
            if cfg.inject_divergence_at == step and rank == min(1, world - 1):
                model.params[0] += np.float32(1e-3)
            step += 1
            if step % cfg.check_every == 0:
                _check_replicas(comm, model.params, step)
                checks += 1
            if bar.enabled:
                now = slice(first, step)
                bar.update(i + 1, _weighted(losses[now], sizes_seen[now]), _weighted(accs[now], sizes_seen[now]))
        bar.close()
        test_loss, test_acc = _evaluate(comm, model, data.test_images, data.test_labels)
        now = slice(first, step)
        stats = EpochStats(
            epoch=epoch + 1,
            train_loss=_weighted(losses[now], sizes_seen[now]),
            train_acc=_weighted(accs[now], sizes_seen[now]),
            test_loss=test_loss,
            test_acc=test_acc,
            seconds=time.monotonic() - started,
        )
        epochs.append(stats)
        if verbose:
            print(format_epoch(stats, cfg.epochs), flush=True)
    if step % cfg.check_every:
        _check_replicas(comm, model.params, step)
        checks += 1
    out: dict[str, Any] = {"compute_s": compute_s, "comm_s": comm_s}
    if rank == 0:
        out.update(
            losses=losses,
            epochs=epochs,
            params=model.params.copy(),
            checks=checks,
            num_params=num_params,
            buckets=len(views),
            dataset=data.describe(),
        )
    return out


# --- the launcher's side -------------------------------------------------------------------------
@contextlib.contextmanager
def single_threaded_children() -> Iterator[None]:
    """Set the BLAS/OpenMP/Numba thread variables to 1 while ranks start (they inherit them)."""
    saved = {k: os.environ.get(k) for k in THREAD_VARIABLES}
    os.environ.update({k: "1" for k in THREAD_VARIABLES})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def train(cfg: TrainConfig) -> TrainResult:
    """Run one data-parallel training job on ``cfg.nprocs`` ranks and gather its results.

    Raises:
        ValueError: a setting cannot work (checked before any process starts).
        shmcoll.SpawnError: a rank failed (e.g. :class:`ReplicaDivergenceError`), with its traceback.
    """
    cfg.validate()
    _load(cfg)  # a missing or malformed data set fails here, once, not on every rank
    warm_kernels()
    started = time.monotonic()
    with single_threaded_children():
        results = shmcoll.spawn(rank_main, cfg.nprocs, args=(cfg,), timeout=cfg.timeout_s, slot_bytes=cfg.slot_bytes)
    wall = time.monotonic() - started
    head = results[0]
    return TrainResult(
        config=cfg,
        dataset=head["dataset"],
        num_params=head["num_params"],
        buckets=head["buckets"],
        losses=head["losses"],
        epochs=head["epochs"],
        compute_s=[r["compute_s"] for r in results],
        comm_s=[r["comm_s"] for r in results],
        digest_checks=head["checks"],
        params=head["params"],
        wall_s=wall,
    )


@dataclasses.dataclass(frozen=True)
class Equivalence:
    """How far an N-rank run is from the single-process run with the same global batch."""

    max_loss_diff: float  # max over steps of |loss_N - loss_1|
    max_param_diff: float  # max over parameters, after training
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_loss_diff <= self.tolerance


def compare(run: TrainResult, reference: TrainResult, tolerance: float) -> Equivalence:
    """Compare two runs of the same configuration step by step."""
    if run.losses.shape != reference.losses.shape:
        raise ValueError("the runs took different numbers of steps")
    return Equivalence(
        max_loss_diff=float(np.max(np.abs(run.losses - reference.losses))),
        max_param_diff=float(np.max(np.abs(run.params.astype(np.float64) - reference.params))),
        tolerance=tolerance,
    )


# --- reporting ----------------------------------------------------------------------------------
def format_epoch(e: EpochStats, epochs: int) -> str:
    return (
        f"epoch {e.epoch}/{epochs}: loss {e.train_loss:.4f}  acc {e.train_acc:.4f}  "
        f"held-out loss {e.test_loss:.4f}  held-out acc {e.test_acc:.4f}  ({e.seconds:.2f}s)"
    )


def format_summary(result: TrainResult) -> str:
    cfg = result.config
    t = result.step_times()
    steps = len(result.losses)
    lines = [
        f"held-out accuracy {result.test_acc:.4f} after {cfg.epochs} epoch(s), {steps} steps "
        f"on {cfg.nprocs} rank(s), global batch {cfg.batch_size}",
        f"time per step, rank 0, mean (median) of {max(steps - 1, 1)} steps: "
        f"compute {t['compute'] * 1e3:.3f} ms ({t['compute_median'] * 1e3:.3f}), "
        f"communication {t['comm'] * 1e3:.3f} ms ({t['comm_median'] * 1e3:.3f}), "
        f"total {t['total'] * 1e3:.3f} ms ({t['total_median'] * 1e3:.3f}); slowest rank's mean total "
        f"{t['slowest_total'] * 1e3:.3f} ms",
        f"communication: {result.buckets} allreduce(op=AVG, algorithm={cfg.algorithm}) per step of "
        f"{(result.num_params + _STATS) * 4 / 2**20:.2f} MiB in all; replicas bitwise identical "
        f"({result.digest_checks} digest check(s)); wall time {result.wall_s:.1f}s",
    ]
    return "\n".join(lines)


def plot(runs: Sequence[TrainResult], path: str) -> None:
    """Loss per step of each run, and held-out accuracy per epoch, to a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'shmcoll[plot]'") from None
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.5))
    for run, style in zip(runs, ("-", "--", ":", "-."), strict=False):
        label = f"{run.config.nprocs} rank(s)"
        ax_loss.plot(np.arange(1, len(run.losses) + 1), run.losses, style, lw=1.2, label=label)
        ax_acc.plot([e.epoch for e in run.epochs], [e.test_acc for e in run.epochs], style, marker="o", label=label)
    ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (global batch mean)")
    ax_loss.set_yscale("log")
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("held-out accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(True, alpha=0.3)
        ax.legend()
    cfg = runs[0].config
    fig.suptitle(f"MNIST MLP {'-'.join(map(str, cfg.hidden))}, batch {cfg.batch_size}, lr {cfg.lr}, shmcoll")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
