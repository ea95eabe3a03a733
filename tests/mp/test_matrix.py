"""Every collective x algorithm x world size x root x dtype x op x count, against numpy."""

from __future__ import annotations

import pytest
from cases import SAME_ON_ALL, matrix, run_cases

# Tiny slots (64 bytes, 2 per ring) so that counts of a few dozen elements already run the
# many-piece path and exceed the whole ring.
SLOT_BYTES = 64
NSLOTS = 2
BATCH = 1500


def check_matrix(pools, world_size: int, kinds=None) -> int:  # type: ignore[no-untyped-def]
    pool = pools.get(world_size, slot_bytes=SLOT_BYTES, nslots=NSLOTS)
    cases = matrix(world_size, SLOT_BYTES) if kinds is None else matrix(world_size, SLOT_BYTES, kinds=kinds)
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
