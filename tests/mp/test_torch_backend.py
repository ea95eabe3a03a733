"""The torch integration: tensors in the Communicator API, and the ``torch.distributed`` backend
checked against gloo on the same calls in the same processes.

Each test starts its ranks once (spawn: torch and shmcoll imported, a process group made) and
runs many checks in them, under a hard deadline; a rank that fails or hangs fails the test with
its traceback and every rank is killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import shmcoll  # noqa: E402
from shmcoll.types import BFLOAT16  # noqa: E402

# --- launching ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(fn: Any, rank: int, n: int, port: int, args: tuple, results: Any, backend: str) -> None:
    try:
        import shmcoll.torch  # noqa: F401

        torch.set_num_threads(1)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, timeout=_TIMEOUT
        )
        try:
            out = fn(rank, n, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001  (reported to the test)
        results.put((rank, "error", traceback.format_exc()))


def launch(
    fn: Any,
    n: int,
    *args: Any,
    deadline: float = 120.0,
    expect_dead: tuple[int, ...] = (),
    backend: str = "shmcoll",
) -> dict[int, Any]:
    """Run ``fn(rank, n, *args)`` on ``n`` fresh ranks in a shmcoll process group; returns each
    rank's result. Any rank's error fails at once (the others killed); so does the deadline."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, n, port, args, results, backend), daemon=True) for r in range(n)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    stop = time.monotonic() + deadline
    try:
        while len(out) < n - len(expect_dead):
            try:
                rank, status, value = results.get(timeout=max(0.1, stop - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"ranks {sorted(set(range(n)) - set(out))} did not finish within {deadline:g}s")
            if status == "error":
                pytest.fail(f"rank {rank} failed:\n{value}")
            out[rank] = value
        for p in procs:
            p.join(timeout=max(1.0, stop - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return out


_TIMEOUT = __import__("datetime").timedelta(seconds=20)

# --- tensors in the Communicator API ------------------------------------------------------------


def _api_tensors(comm: Any) -> list[Any]:
    r = comm.rank
    got = []
    x = torch.full((5,), float(r + 1))
    y = comm.allreduce(x)
    got.append(("inplace returns the tensor", y is x, x.tolist()))
    z = comm.allgather(torch.tensor([r, 10 * r], dtype=torch.int32))
    got.append(("allgather new result", type(z).__name__, z.dtype == torch.int32, z.tolist()))
    o = torch.empty(3, dtype=torch.float32)
    res = comm.iallreduce(torch.full((3,), float(r)), op="max", out=o).wait()
    got.append(("iallreduce out", res is o, o.tolist()))
    g = torch.ones(2, requires_grad=True)
    got.append(("requires_grad broadcast", comm.broadcast(g * (r + 1), root=0).tolist()))
    b = comm.allreduce(torch.tensor([1.0, 2.5, -3.0], dtype=torch.bfloat16) * (r + 1), out=None)
    got.append(("bfloat16 sum", b.dtype == torch.bfloat16, b.float().tolist()))
    errors = []
    for bad, what in (
        (lambda: comm.allreduce(torch.ones(4, 4).t()), "C-contiguous"),
        (lambda: comm.allreduce(torch.ones(3).to_sparse()), "dense"),
        (lambda: comm.allreduce(torch.ones(3, dtype=torch.int64), op="band", out=torch.ones(3)), "dtype"),
    ):
        try:
            bad()
            errors.append(f"{what}: no error")
        except (TypeError, ValueError) as exc:
            errors.append(what in str(exc) or str(exc))
    comm.barrier()  # the communicator is still usable after the refused calls
    got.append(("errors", errors))
    return got


def test_tensors_in_the_api() -> None:
    def expected(n: int) -> list[Any]:
        total = n * (n + 1) / 2
        return [
            ("inplace returns the tensor", True, [total] * 5),
            ("allgather new result", "Tensor", True, [[r, 10 * r] for r in range(n)]),
            ("iallreduce out", True, [float(n - 1)] * 3),
            ("requires_grad broadcast", [1.0, 1.0]),
            ("bfloat16 sum", True, [1.0 * total, 2.5 * total, -3.0 * total]),
            ("errors", [True, True, True]),
        ]

    for n in (1, 3):
        got = shmcoll.spawn(_api_tensors, n, timeout=120)
        assert got == [expected(n)] * n


# --- the backend against gloo -------------------------------------------------------------------


def _same(a: Any, b: Any) -> bool:
    return (
        bool(torch.equal(a, b)) if isinstance(a, torch.Tensor) else all(_same(p, q) for p, q in zip(a, b, strict=True))
    )


def _against_gloo(rank: int, n: int) -> list[str]:
    """Every call on the default (shmcoll) group and on a gloo group; returns what differed."""
    gloo = dist.new_group(backend="gloo")
    differ: list[str] = []
    gen = torch.Generator().manual_seed(1234 + rank)

    def both(name: str, make: Any, call: Any) -> None:
        ours, theirs = make(), make()
        call(ours, None)
        call(theirs, gloo)
        if not _same(ours, theirs):
            differ.append(f"{name}: shmcoll {ours} gloo {theirs}")

    for dtype in (torch.int64, torch.float32, torch.uint8):
        for count in (0, 1, 7, 100_003):
            data = torch.randint(0, 50, (count,), generator=gen).to(dtype)
            ops = [dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
            if not dtype.is_floating_point:
                ops += [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR]
            if count < 1000:
                ops.append(dist.ReduceOp.PRODUCT)
            for op in ops:
                both(
                    f"all_reduce {dtype} {count} {op}",
                    data.clone,
                    lambda t, g, op=op: dist.all_reduce(t, op=op, group=g),
                )
            root = count % n
            both(f"broadcast {dtype} {count}", data.clone, lambda t, g, root=root: dist.broadcast(t, src=root, group=g))
            both(
                f"reduce {dtype} {count}",
                data.clone,
                # (only the root's result is defined)
                lambda t, g, root=root: (dist.reduce(t, dst=root, group=g), rank == root or t.zero_()),
            )

            def gather_list(t: Any, g: Any, data: Any = data) -> None:
                dist.all_gather(t, data, group=g)

            both(
                f"all_gather {dtype} {count}", lambda data=data: [torch.zeros_like(data) for _ in range(n)], gather_list
            )
            both(
                f"all_gather_into_tensor {dtype} {count}",
                lambda count=count, dtype=dtype: torch.zeros(n * count, dtype=dtype),
                lambda t, g, data=data: dist.all_gather_into_tensor(t, data, group=g),
            )
            big = torch.randint(0, 50, (n * count,), generator=gen).to(dtype)
            both(
                f"reduce_scatter_tensor {dtype} {count}",
                lambda count=count, dtype=dtype: torch.zeros(count, dtype=dtype),
                lambda t, g, big=big: dist.reduce_scatter_tensor(t, big, group=g),
            )
            both(
                f"reduce_scatter {dtype} {count}",
                lambda count=count, dtype=dtype: torch.zeros(count, dtype=dtype),
                lambda t, g, big=big, count=count: dist.reduce_scatter(
                    t, list(big.chunk(n)) if count else [big] * n, group=g
                ),
            )
            both(
                f"all_to_all_single {dtype} {count}",
                lambda count=count, dtype=dtype: torch.zeros(n * count, dtype=dtype),
                lambda t, g, big=big: dist.all_to_all_single(t, big, group=g),
            )
            both(
                f"gather {dtype} {count}",
                lambda data=data: [torch.zeros_like(data) for _ in range(n)],
                lambda t, g, data=data, root=root: dist.gather(data, t if rank == root else None, dst=root, group=g),
            )
            both(
                f"scatter {dtype} {count}",
                lambda count=count, dtype=dtype: torch.zeros(count, dtype=dtype),
                lambda t, g, big=big, root=root, count=count: dist.scatter(
                    t, list(big.view(n, count)) if rank == root else None, src=root, group=g
                ),
            )
    # all_to_all with split sizes, and the list form with different sizes per pair
    ins = [1 + (rank + j) % 3 for j in range(n)]
    outs = [1 + (j + rank) % 3 for j in range(n)]
    src = torch.arange(sum(ins), dtype=torch.float32) + 100 * rank
    both(
        "all_to_all_single splits",
        lambda: torch.empty(sum(outs)),
        lambda t, g: dist.all_to_all_single(t, src, outs, ins, group=g),
    )
    # (gloo's list form wants equal sizes: ours is checked against its single-tensor form)
    listed, single = [torch.empty(c) for c in outs], torch.empty(sum(outs))
    dist.all_to_all(listed, list(src.split(ins)))
    dist.all_to_all_single(single, src, outs, ins, group=gloo)
    if not torch.equal(torch.cat(listed), single):
        differ.append(f"all_to_all lists {listed} {single}")
    # objects through torch's own helpers
    ours, theirs = [None] * n, [None] * n
    dist.all_gather_object(ours, {"rank": rank, "x": list(range(rank))})
    dist.all_gather_object(theirs, {"rank": rank, "x": list(range(rank))}, group=gloo)
    if ours != theirs:
        differ.append(f"all_gather_object {ours} {theirs}")
    objs = [f"from {rank}", rank]
    dist.broadcast_object_list(objs, src=n - 1)
    if objs != [f"from {n - 1}", n - 1]:
        differ.append(f"broadcast_object_list {objs}")
    # point to point, blocking and batched
    right, left = (rank + 1) % n, (rank - 1) % n
    sent = torch.full((5,), float(rank))
    got = torch.empty(5)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, right), dist.P2POp(dist.irecv, got, left)])
    for r in reqs:
        r.wait()
    if got.tolist() != [float(left)] * 5:
        differ.append(f"batch_isend_irecv {got}")
    if n > 1:
        if rank == 0:
            dist.send(torch.tensor([7.0, 8.0]), dst=n - 1, tag=3)
        elif rank == n - 1:
            t = torch.empty(2)
            dist.recv(t, src=0, tag=3)
            if t.tolist() != [7.0, 8.0]:
                differ.append(f"send/recv {t}")
    # AVG (gloo has none): the sum divided by n
    t = torch.full((3,), float(rank * 2))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    if t.tolist() != [float(n - 1)] * 3:
        differ.append(f"AVG {t}")
    # a sub-group of the even ranks, and asynchronous work with futures
    evens = list(range(0, n, 2))
    sub = dist.new_group(evens)
    if rank in evens:
        t = torch.ones(2)
        work = dist.all_reduce(t, group=sub, async_op=True)
        value = work.get_future().wait()
        if not (work.is_completed() and t.tolist() == [float(len(evens))] * 2 and value[0] is not None):
            differ.append(f"sub-group async {t} {value}")
    dist.barrier()
    return differ


@pytest.mark.parametrize("n", [2, 3, 4])
def test_backend_matches_gloo(n: int) -> None:
    results = launch(_against_gloo, n, deadline=240)
    assert results == {r: [] for r in range(n)}


# --- DDP ----------------------------------------------------------------------------------------


def _model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _batches(steps: int, batch: int) -> list[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(batch, 20, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(steps)]


def _train(model: Any, batches: Any, rank: int, n: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        per = len(y) // n
        opt.zero_grad()
        torch.nn.functional.cross_entropy(
            model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]
        ).backward()
        opt.step()


def _ddp(rank: int, n: int, steps: int) -> list[Any]:
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
    _train(ddp, _batches(steps, 24), rank, n)
    return [p.detach().numpy().copy() for p in model.parameters()]


def test_ddp_parameters_agree_and_match_one_process() -> None:
    steps, n = 5, 3
    results = launch(_ddp, n, steps, deadline=180)
    alone = _model()
    _train(alone, _batches(steps, 24), 0, 1)
    for r in range(1, n):
        for a, b in zip(results[0], results[r], strict=True):
            assert np.array_equal(a, b), "ranks' parameters differ"
    for a, b in zip(results[0], alone.parameters(), strict=True):
        np.testing.assert_allclose(a, b.detach().numpy(), rtol=1e-5, atol=1e-6)


def _fsdp2(rank: int, n: int, steps: int) -> list[float]:
    """FSDP2 (``fully_shard``, which builds a DeviceMesh on the default group) on CPU: the mean
    loss per step."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / n)
    return losses


def test_fsdp2_on_cpu_matches_gloo() -> None:
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed.fsdp")
    n, steps = 2, 4
    ours = launch(_fsdp2, n, steps, deadline=180)
    gloos = launch(_fsdp2, n, steps, deadline=180, backend="gloo")
    assert ours[0] == ours[1] == gloos[0] == gloos[1], (ours, gloos)


# --- failures -----------------------------------------------------------------------------------


def _dies(rank: int, n: int) -> str:
    t = torch.ones(1000)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
        dist.all_reduce(t)
    except dist.DistBackendError as exc:
        return f"{time.monotonic() - start:.2f} {exc}"
    return "no error"


def test_dead_rank_raises_on_every_survivor() -> None:
    results = launch(_dies, 3, deadline=60, expect_dead=(1,))
    for r in (0, 2):
        elapsed, _, message = results[r].partition(" ")
        assert message.startswith("shmcoll: "), results[r]
        assert "rank 1" in message, results[r]
        assert float(elapsed) < 5.0, results[r]


def _mismatch(rank: int, n: int) -> str:
    t = torch.ones(10)
    try:
        if rank == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=0)
    except dist.DistBackendError as exc:
        return str(exc)
    return "no error"


def test_mismatched_calls_raise_on_every_rank() -> None:
    results = launch(_mismatch, 2, deadline=60)
    for r in (0, 1):
        assert "allreduce" in results[r] and "broadcast" in results[r], results[r]


def test_bfloat16_marker_is_not_a_numeric_dtype() -> None:
    assert np.dtype(np.uint16) != BFLOAT16 and BFLOAT16.itemsize == 2


def _mixed(rank: int, n: int) -> list[Any]:
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return [dist.get_backend(), type(dist.distributed_c10d._get_default_group()).__name__, t.tolist()]


def test_device_mapped_backend_string() -> None:
    """``cpu:shmcoll,cuda:...``: CPU tensors go through shmcoll (torch gives a Python backend's
    group the whole device map; CUDA tensors would take shmcoll's device path)."""
    got = launch(_mixed, 2, deadline=60, backend="cpu:shmcoll,cuda:gloo")
    assert got == {r: ["cpu:shmcoll,cuda:gloo", "ProcessGroupShmcoll", [3.0] * 3] for r in range(2)}


def test_ddp_demo_under_torchrun() -> None:
    """The demo, unchanged but for the backend name, under torchrun (its environment rendezvous)."""
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    demo = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torch_ddp.py")
    proc = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "--master-port", str(_free_port()), demo, "--backend", "shmcoll"]
        + ["--steps", "6", "--local-steps", "2", "--warmup", "2"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "shmcoll" in proc.stdout and "True" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
