"""hierarchical at run time with several groups (SHMCOLL_GROUP_SIZE emulates several nodes)."""

from __future__ import annotations

import pytest
from cases import SAME_ON_ALL, matrix, run_cases
from harness import RankPool

from shmcoll import config

SLOT_BYTES = 64  # tiny slots: many pieces, sub-collectives cut into their own pieces
NSLOTS = 2
KINDS = ("allreduce", "broadcast", "reduce")


def _groups(comm):  # type: ignore[no-untyped-def]
    from shmcoll.comm import groups

    return groups.group_size(comm)


@pytest.mark.parametrize(("world_size", "group_size"), [(3, 2), (4, 2), (4, 3), (5, 2), (5, 3)])
def test_hierarchical_with_groups(monkeypatch, world_size: int, group_size: int) -> None:  # type: ignore[no-untyped-def]
    # Ranks are spawned: they read the environment the parent has when it starts them.
    monkeypatch.setenv("SHMCOLL_GROUP_SIZE", str(group_size))
    config.reload()
    pool = RankPool(world_size, slot_bytes=SLOT_BYTES, nslots=NSLOTS)
    try:
        assert pool.run(_groups) == [group_size] * world_size
        cases = matrix(world_size, SLOT_BYTES, algorithms={k: ["hierarchical"] for k in KINDS}, kinds=KINDS)
        results = pool.run(run_cases, cases, timeout=900)
        failures = [f for fails, _ in results for f in fails]
        assert not failures, f"{len(failures)} failures, first 20:\n" + "\n".join(failures[:20])
        for case in cases:
            if case.kind in SAME_ON_ALL:
                digests = {results[r][1].get(case.case_id) for r in range(world_size)}
                assert len(digests) == 1, f"{case.describe()}: results differ across ranks: {digests}"
    finally:
        pool.close()
        monkeypatch.delenv("SHMCOLL_GROUP_SIZE")
        config.reload()
