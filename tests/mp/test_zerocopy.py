"""Registered buffers (comm.alloc) and the zerocopy algorithm: results, rules, errors, memory."""

from __future__ import annotations

import gc
import logging
import os

import numpy as np
import pytest
from harness import run_ranks

from shmcoll import CollectiveMismatchError, ReduceOp, UnsupportedError, config
from shmcoll.algos import select
from shmcoll.shm.registered import SharedArray


def _basics(comm):  # type: ignore[no-untyped-def]
    n, r = comm.world_size, comm.rank
    x = comm.alloc(1001, np.float64)
    assert isinstance(x, SharedArray) and x.shape == (1001,) and not x.any()
    x[:] = np.arange(1001) + r
    y = comm.allreduce(x)  # in place; zero-copy or through the rings, as auto judges faster
    assert y is x
    np.testing.assert_array_equal(x, n * np.arange(1001) + n * (n - 1) // 2)
    out = comm.alloc((7, 11), np.int32)
    src = comm.alloc((7, 11), np.int32)
    src[:] = r + 1
    assert comm.allreduce(src, ReduceOp.PROD, out=out, algorithm="zerocopy") is out
    assert (out == np.prod(np.arange(1, n + 1))).all()
    # A plain out for allreduce: peers could not read it, so this goes through the rings.
    plain = comm.allreduce(src, out=np.empty((7, 11), np.int32))
    assert (plain == n * (n + 1) // 2).all()
    # Registered buffers also work with every other algorithm.
    z = comm.allreduce(src, out=out, algorithm="direct")
    assert (z == n * (n + 1) // 2).all()
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_alloc_and_zero_copy_results(pools, world_size: int) -> None:  # type: ignore[no-untyped-def]
    assert pools.get(world_size).run(_basics) == [True] * world_size


def _placement_mismatch(comm):  # type: ignore[no-untyped-def]
    buf = comm.alloc(20, np.float32)
    view = buf[0:10] if comm.rank == 0 else buf[5:15]
    with pytest.raises(CollectiveMismatchError, match="another place"):
        comm.allreduce(view, algorithm="zerocopy")
    return True


def test_buffers_at_different_places_are_a_mismatch() -> None:
    assert run_ranks(_placement_mismatch, 2) == [True, True]  # breaks its communicator: own ranks


def _mixed(comm):  # type: ignore[no-untyped-def]
    buf = comm.alloc(16, np.float32)
    x = buf if comm.rank == 0 else np.ones(16, np.float32)
    with pytest.raises(CollectiveMismatchError, match="zerocopy"):
        comm.allreduce(x, algorithm="zerocopy" if comm.rank == 0 else "auto")
    return True


def test_registered_and_plain_ranks_mismatch_clearly() -> None:
    assert run_ranks(_mixed, 2) == [True, True]


def _auto_weighs_zero_copy(comm):  # type: ignore[no-untyped-def]
    """auto takes zerocopy for a large registered call and the rings for a tiny one (the built-in
    model: two barriers cost more than the copy of 8 bytes saves); both results are right."""
    saved = {k: os.environ.get(k) for k in ("SHMCOLL_ALGO", "SHMCOLL_TUNE_FILE")}
    os.environ.pop("SHMCOLL_ALGO", None)
    os.environ["SHMCOLL_TUNE_FILE"] = os.devnull  # no table: the built-in model decides
    config.reload()
    select.reset()
    seen: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("shmcoll")
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    # A communicator of its own: its decisions are made here, not cached by an earlier test.
    sub = comm.split(color=0)
    try:
        n = sub.world_size
        for count in (2, 4 << 20):
            x = sub.alloc(count, np.float32)
            x[:] = sub.rank + 1
            sub.allreduce(x)
            assert (x == n * (n + 1) // 2).all()
            del x
    finally:
        sub.close()
        log.removeHandler(handler)
        log.setLevel(old_level)
        for k, v in saved.items():  # the pool's ranks serve later tests
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        config.reload()
        select.reset()
    picks = [m.split(" -> ")[1].split(" ")[0] for m in seen if "auto: allreduce" in m]
    return picks[0] != "zerocopy" and picks[-1] == "zerocopy", picks


def test_auto_takes_zero_copy_only_where_it_pays(pools) -> None:  # type: ignore[no-untyped-def]
    for ok, picks in pools.get(2).run(_auto_weighs_zero_copy):
        assert ok, picks


def _rules(comm):  # type: ignore[no-untyped-def]
    with pytest.raises(UnsupportedError, match="comm.alloc"):
        comm.allreduce(np.ones(4), algorithm="zerocopy")
    with pytest.raises(UnsupportedError, match="float16"):
        comm.allreduce(comm.alloc(4, np.float16), algorithm="zerocopy")
    with pytest.raises(UnsupportedError, match="out must be from comm.alloc"):
        comm.allreduce(comm.alloc(4), out=np.empty(4), algorithm="zerocopy")
    with pytest.raises(ValueError, match="same shape and dtype"):
        comm.alloc(10 + comm.rank, np.float32)
    with pytest.raises(ValueError, match="negative"):
        comm.alloc((-1, 3))
    # Zero-copy broadcast into a plain out, gather and alltoall in place, reduce_scatter in place.
    n, r = comm.world_size, comm.rank
    b = comm.alloc(5, np.int64)
    b[:] = r
    plain_out = comm.broadcast(b, root=n - 1, out=np.empty(5, np.int64))
    assert (plain_out == n - 1).all()
    a = comm.alloc((n, 3), np.uint8)
    a[:] = np.arange(n)[:, None] + 10 * r
    comm.alltoall(a, out=a)
    assert (a[:, 0] == 10 * np.arange(n) + r).all()
    rs = comm.alloc(n * 2, np.float32)
    rs[:] = 1
    comm.reduce_scatter(rs, out=rs[2 * r : 2 * r + 2])
    assert (rs[2 * r : 2 * r + 2] == n).all()
    g = comm.alloc((n, 2), np.int16)
    g[r] = r
    got = comm.allgather(g[r], out=g)  # in place: not zero-copy (rows differ by rank), still right
    assert (got[:, 0] == np.arange(n)).all()
    return True


def test_rules_and_forms(pools) -> None:  # type: ignore[no-untyped-def]
    assert pools.get(3).run(_rules) == [True] * 3


def _memory(comm):  # type: ignore[no-untyped-def]
    def segments() -> int:
        return sum(1 for fd in os.listdir("/proc/self/fd") if "buf" in os.path.realpath(f"/proc/self/fd/{fd}"))

    def mapped_bytes() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for line in f if "shmcoll-" in line and "-buf" in line)

    before = mapped_bytes()
    for _ in range(50):
        x = comm.alloc(1 << 16, np.float32)
        x[:] = 1
        comm.allreduce(x)
        del x
        gc.collect()
    comm.barrier()
    return mapped_bytes() - before, segments()


def test_dropped_arrays_release_their_memory(pools) -> None:  # type: ignore[no-untyped-def]
    for grown, fds in pools.get(2).run(_memory):
        assert grown <= 1 and fds == 0
