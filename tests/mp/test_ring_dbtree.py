"""The correctness matrix for the ring and dbtree algorithms only, against numpy, on real ranks."""

from __future__ import annotations

import pytest
from cases import SAME_ON_ALL, matrix, run_cases

# As in test_matrix: tiny slots (64 bytes, 2 per ring) so that a few dozen elements already run
# the many-piece path and overflow the ring.
SLOT_BYTES = 64
NSLOTS = 2
BATCH = 1500
ALGORITHMS = {
    "allreduce": ["ring", "dbtree"],
    "reduce": ["ring", "dbtree"],
    "broadcast": ["ring", "dbtree"],
    "allgather": ["ring"],
    "reduce_scatter": ["ring"],
}


def check(pools, world_size: int) -> int:  # type: ignore[no-untyped-def]
    pool = pools.get(world_size, slot_bytes=SLOT_BYTES, nslots=NSLOTS)
    cases = matrix(world_size, SLOT_BYTES, algorithms=ALGORITHMS, kinds=tuple(ALGORITHMS))
    assert {c.algorithm for c in cases} == {"ring", "dbtree"}
    for start in range(0, len(cases), BATCH):
        batch = cases[start : start + BATCH]
        results = pool.run(run_cases, batch, timeout=900)
        failures = [f for fails, _ in results for f in fails]
        assert not failures, f"{len(failures)} failures, first 20:\n" + "\n".join(failures[:20])
        for case in batch:
            if case.kind not in SAME_ON_ALL:
                continue
            digests = {results[r][1].get(case.case_id) for r in range(world_size)}
            assert len(digests) == 1, f"{case.describe()}: results differ across ranks: {digests}"
    return len(cases)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4] + [pytest.param(n, marks=pytest.mark.slow) for n in (5, 6, 7, 8)])
def test_ring_dbtree_matrix(pools, world_size: int) -> None:  # type: ignore[no-untyped-def]
    check(pools, world_size)
    pools.close(world_size)
