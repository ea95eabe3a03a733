"""Every collective x algorithm x world size x root x dtype x op x count, against numpy."""

from __future__ import annotations

import pytest
from cases import EVERY, SAME_ON_ALL, matrix, run_cases

# Tiny slots (64 bytes, 2 per ring) so that counts of a few dozen elements already run the
# many-piece path and exceed the whole ring.
SLOT_BYTES = 64
NSLOTS = 2
BATCH = 1500


def check_matrix(pools, world_size: int, kinds=None, algorithms=None, nslots: int = NSLOTS) -> int:  # type: ignore[no-untyped-def]
    pool = pools.get(world_size, slot_bytes=SLOT_BYTES, nslots=nslots)
    cases = matrix(world_size, SLOT_BYTES, algorithms=algorithms, kinds=kinds or EVERY)
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


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 7, 8])
def test_matrix(pools, world_size: int) -> None:  # type: ignore[no-untyped-def]
    check_matrix(pools, world_size)
    pools.close(world_size)


# Plans built for one slot per ring keep some forwards unfused (fences) so that no cycle of
# fused steps can deadlock; the main matrix runs two slots, so those plans run here.
ONE_SLOT = {
    "allreduce": ["ring", "dbtree", "halving_doubling"],
    "allgather": ["ring", "halving_doubling"],
    "reduce_scatter": ["ring", "halving_doubling"],
    "broadcast": ["dbtree"],
    "reduce": ["dbtree"],
}


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_matrix_one_slot(pools, world_size: int) -> None:  # type: ignore[no-untyped-def]
    check_matrix(pools, world_size, kinds=tuple(ONE_SLOT), algorithms=ONE_SLOT, nslots=1)
    pools.close(world_size)
