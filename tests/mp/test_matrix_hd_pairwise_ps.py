"""The correctness matrix restricted to halving_doubling, pairwise and ps, against numpy."""

from __future__ import annotations

import pytest
from cases import SAME_ON_ALL, matrix, run_cases

# As in test_matrix: tiny slots (64 bytes, 2 per ring) so a few dozen elements already take the
# many-piece path and overflow the whole ring.
SLOT_BYTES = 64
NSLOTS = 2
BATCH = 1500
ALGORITHMS = {
    "allreduce": ["halving_doubling", "ps"],
    "reduce_scatter": ["halving_doubling"],
    "allgather": ["halving_doubling"],
    "alltoall": ["pairwise"],
    "reduce": ["ps"],
    "broadcast": ["ps"],
}


def check(pools, world_size: int) -> int:  # type: ignore[no-untyped-def]
    pool = pools.get(world_size, slot_bytes=SLOT_BYTES, nslots=NSLOTS)
    cases = matrix(world_size, SLOT_BYTES, algorithms=ALGORITHMS, kinds=tuple(ALGORITHMS))
    for start in range(0, len(cases), BATCH):
        batch = cases[start : start + BATCH]
        results = pool.run(run_cases, batch, timeout=900)
        failures = [f for fails, _ in results for f in fails]
        assert not failures, f"{len(failures)} failures, first 20:\n" + "\n".join(failures[:20])
        for case in batch:
            if case.kind in SAME_ON_ALL:
                digests = {results[r][1].get(case.case_id) for r in range(world_size)}
                assert len(digests) == 1, f"{case.describe()}: results differ across ranks: {digests}"
    return len(cases)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, *(pytest.param(n, marks=pytest.mark.slow) for n in (5, 6, 7, 8))])
def test_matrix_hd_pairwise_ps(pools, world_size: int) -> None:  # type: ignore[no-untyped-def]
    assert check(pools, world_size) > 0
    pools.close(world_size)
