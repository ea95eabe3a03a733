"""Variable-count collectives beyond the correctness matrix: counts that disagree, counts learned
by the call, buffers of other kinds."""

from __future__ import annotations

import array
import time

import numpy as np
import pytest

import shmcoll
from shmcoll import CollectiveMismatchError, CommunicatorBrokenError


def _disagreeing_counts(comm, which):  # type: ignore[no-untyped-def]
    r = comm.rank
    t0 = time.monotonic()
    errors = []
    for step in ("call", "next call"):
        try:
            if step == "next call":
                comm.barrier(timeout=5)
            elif which == "allgatherv":  # rank 1 believes rank 1 has 5 elements
                counts = [2, 5, 4] if r == 1 else [2, 3, 4]
                comm.allgatherv(np.zeros(counts[r]), counts, timeout=5)
            elif which == "alltoallv":  # rank 2 expects 2 elements from rank 1, which sends 1
                recv = [1, 2, 1] if r == 2 else [1, 1, 1]
                comm.alltoallv(np.zeros(3), [1, 1, 1], recv, timeout=5)
            else:  # gatherv: rank 2 sends 7 elements where the root's counts say 4
                x = np.zeros([2, 3, 7][r])
                comm.gatherv(x, [2, 3, 4] if r == 0 else None, timeout=5)
        except (CollectiveMismatchError, CommunicatorBrokenError) as exc:
            errors.append(str(exc))
    return errors, time.monotonic() - t0


@pytest.mark.parametrize("which", ["allgatherv", "alltoallv", "gatherv"])
def test_counts_that_disagree_fail_every_rank_with_both_counts_named(which) -> None:  # type: ignore[no-untyped-def]
    results = shmcoll.spawn(_disagreeing_counts, 3, args=(which,), timeout=60)
    for errors, elapsed in results:
        assert errors, results  # by the next call at the latest
        assert elapsed < 5, results
    text = " ".join(e for errors, _ in results for e in errors)
    if which == "allgatherv":  # the totals differ: the signatures say so
        assert "total=11" in text and "total=9" in text, text
    elif which == "alltoallv":
        assert "rank 1 sent a block of 1 element(s) where this rank's counts say 2" in text, text
        assert "send_counts[j] must equal rank j's recv_counts[i]" in text, text
    else:
        assert "rank 2 sent a block of 7 element(s) where this rank's counts say 4" in text, text


def _learned_counts_and_buffers(comm):  # type: ignore[no-untyped-def]
    n, r = comm.world_size, comm.rank
    x = np.arange(r, dtype=np.float32)  # rank r has r elements
    everything = comm.allgatherv(x)  # counts learned first
    assert everything.tolist() == [float(i) for j in range(n) for i in range(j)]
    sends = [(r + j) % 2 for j in range(n)]
    got = comm.alltoallv(np.full(sum(sends), r, np.int16), sends)  # recv_counts learned
    assert got.tolist() == [i for i in range(n) for _ in range((i + r) % 2)]
    # Buffers: bytearray in, array.array out; the result is the object given.
    counts = [3] * n
    out = array.array("B", bytes(3 * n))
    res = comm.allgatherv(bytearray([r] * 3), counts, out=out)
    assert res is out and list(out) == [j for j in range(n) for _ in range(3)]
    mine = comm.scatterv(bytes(range(3 * n)) if r == 0 else None, counts, out=bytearray(3))
    assert list(mine) == [3 * r, 3 * r + 1, 3 * r + 2]
    return True


def test_counts_are_learned_when_not_given_and_buffers_work(pools) -> None:  # type: ignore[no-untyped-def]
    assert pools.get(3).run(_learned_counts_and_buffers) == [True] * 3


def _zero_total(comm):  # type: ignore[no-untyped-def]
    n = comm.world_size
    empty = np.zeros(0, np.float64)
    assert comm.allgatherv(empty, [0] * n).shape == (0,)
    assert comm.alltoallv(empty, [0] * n, [0] * n).shape == (0,)
    assert comm.reduce_scatter(empty, "sum", [0] * n).shape == (0,)
    return True


def test_all_zero_counts(pools) -> None:  # type: ignore[no-untyped-def]
    assert pools.get(3).run(_zero_total) == [True] * 3
