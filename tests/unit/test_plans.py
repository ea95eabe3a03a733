"""Every registered plan verified symbolically at world sizes 1..16 and every root, no processes."""

from __future__ import annotations

import dataclasses

import pytest

from shmcoll import collectives
from shmcoll.algos import cma, registry
from shmcoll.plan import ir
from shmcoll.plan.builder import split
from shmcoll.plan.ir import Buf, Region, Step
from shmcoll.plan.passes import channel_skeleton, fuse, plan_call
from shmcoll.plan.verify import PlanError, verify

# The variable-count collectives' plans take their counts (and are one plan per call, not
# pieces): test_varying_plans.py sweeps them. Every other plan kind is swept here.
ALL = [(a.collective, a.name) for a in registry.algorithms() if not collectives.get(a.collective).varying]


def _roots(collective: str, world_size: int) -> range:
    return range(world_size) if collectives.get(collective).rooted else range(1)


@pytest.mark.parametrize(("collective", "name"), ALL)
def test_verifier_accepts_every_plan(collective: str, name: str) -> None:
    alg = registry.get(collective, name)
    for n in range(1, 17):
        for root in _roots(collective, n):
            for count, slot in ((0, 4), (1, 4), (n + 1, 4), (13, 3), (3 * n + 2, 2)):
                for inplace in (False, True):
                    plan = plan_call(alg, n, count, slot, root=root, inplace=inplace)
                    for nslots in (1, 2):
                        verify(plan, world_size=n, count=count, root=root, inplace=inplace, nslots=nslots)


@pytest.mark.parametrize(("collective", "name"), ALL)
def test_plans_for_two_slots_fuse_freely_and_verify(collective: str, name: str) -> None:
    """Built for rings of two or more slots, plans have no fences (every forward is fused);
    they must still be deadlock-free there."""
    alg = registry.get(collective, name)
    for n in range(1, 17):
        for root in _roots(collective, n):
            for count, slot in ((n + 1, 4), (3 * n + 2, 2)):
                for inplace in (False, True):
                    plan = plan_call(alg, n, count, slot, root=root, inplace=inplace, nslots=2)
                    verify(plan, world_size=n, count=count, root=root, inplace=inplace, nslots=2)


@pytest.mark.parametrize(("collective", "name"), ALL)
def test_no_step_moves_more_than_one_slot(collective: str, name: str) -> None:
    alg = registry.get(collective, name)
    for n in (1, 2, 3, 5, 8):
        for slot in (1, 3, 7):
            for count in (0, 5, 4 * n * slot + 3):
                plan = plan_call(alg, n, count, slot, root=n - 1)
                for part in (plan.body, plan.tail):
                    for r, program in enumerate(part.programs if part else []):
                        for s in program:
                            if s.recv is not None or s.send is not None:
                                assert s.count <= slot, f"{collective}/{name} n={n} rank {r}: {s} > {slot}"


@pytest.mark.parametrize(("collective", "name"), ALL)
def test_in_place_never_changes_messages(collective: str, name: str) -> None:
    """Ranks choose in place independently, so it may change only local steps."""
    alg = registry.get(collective, name)
    for n in (1, 2, 3, 5, 8):
        for root in _roots(collective, n):
            a = plan_call(alg, n, 11, 4, root=root, inplace=False)
            b = plan_call(alg, n, 11, 4, root=root, inplace=True)
            assert channel_skeleton(a.tail) == channel_skeleton(b.tail)
            if a.body is not None:
                assert b.body is not None and channel_skeleton(a.body) == channel_skeleton(b.body)


def _direct(collective: str, n: int = 3, count: int = 4, **kw):  # type: ignore[no-untyped-def]
    return plan_call(registry.get(collective, "direct"), n, count, 100, **kw)


def _mutate(plan, rank: int, index: int, **changes):  # type: ignore[no-untyped-def]
    programs = [list(p) for p in plan.tail.programs]
    programs[rank][index] = dataclasses.replace(programs[rank][index], **changes)
    return dataclasses.replace(plan, tail=dataclasses.replace(plan.tail, programs=programs))


def test_verifier_catches_wrong_data() -> None:
    plan = _direct("broadcast")
    recv_step = plan.tail.programs[1][0]
    bad = _mutate(plan, 1, 0, dst=Region(Buf.OUT, 1), count=recv_step.count - 1)
    with pytest.raises(PlanError):
        verify(bad, world_size=3, count=4)


def test_every_registered_plan_is_swept() -> None:
    """Here or in test_varying_plans.py: nothing registered escapes both sweeps."""
    varying = {(a.collective, a.name) for a in registry.algorithms() if collectives.get(a.collective).varying}
    assert set(ALL) | varying == {(a.collective, a.name) for a in registry.algorithms()}
    assert {"scan", "exscan"} <= {c for c, _ in ALL}


def test_verifier_catches_size_mismatch() -> None:
    plan = _direct("allgather")
    bad = _mutate(plan, 0, 0, count=3)
    with pytest.raises(PlanError, match="receives|sent"):
        verify(bad, world_size=3, count=4)


def test_verifier_catches_deadlock() -> None:
    plan = _direct("allreduce", n=2, count=4)
    # Make both ranks receive before they send: each then waits for the other forever.
    programs = [list(reversed(p)) for p in plan.tail.programs]
    bad = dataclasses.replace(plan, tail=dataclasses.replace(plan.tail, programs=programs))
    with pytest.raises(PlanError, match="deadlock"):
        verify(bad, world_size=2, count=4, nslots=1)


def test_verifier_catches_order_difference_across_ranks() -> None:
    """Two ranks computing x0 (op) x1 and x1 (op) x0 would not be bitwise identical."""
    plan = _direct("allreduce", n=2, count=2)
    step = plan.tail.programs[1][1]
    assert step.reduce and step.recv_left
    swapped = dataclasses.replace(step, recv_left=False, a=step.b, b=None)
    bad = _mutate(plan, 1, 1, **{f.name: getattr(swapped, f.name) for f in dataclasses.fields(Step)})
    with pytest.raises(PlanError, match="differently"):
        verify(bad, world_size=2, count=2)


def test_verifier_catches_missing_final_division() -> None:
    plan = _direct("allreduce", n=3, count=2)
    last = len(plan.tail.programs[2]) - 1
    bad = _mutate(plan, 2, last, final=False)
    with pytest.raises(PlanError, match="AVG"):
        verify(bad, world_size=3, count=2)


def test_verifier_catches_leftover_message() -> None:
    plan = _direct("gather", n=3, count=2)
    programs = [list(p) for p in plan.tail.programs]
    programs[1].append(Step(count=0, send=2))
    bad = dataclasses.replace(plan, tail=dataclasses.replace(plan.tail, programs=programs))
    with pytest.raises(PlanError, match="never received"):
        verify(bad, world_size=3, count=2)


def test_barrier_must_hear_from_everyone() -> None:
    plan = plan_call(registry.get("barrier", "direct"), 5, 0, 1)
    programs = [list(p) for p in plan.tail.programs]
    # Drop the last round: ranks then leave having heard from only half the others.
    for r in range(5):
        programs[r] = programs[r][:-2]
    bad = dataclasses.replace(plan, tail=dataclasses.replace(plan.tail, programs=programs))
    with pytest.raises(PlanError, match="without hearing"):
        verify(bad, world_size=5, count=0)


def test_fuse_merges_recv_then_forward() -> None:
    steps = [Step(count=4, recv=0, dst=Region(Buf.OUT, 0)), Step(count=4, send=2, a=Region(Buf.OUT, 0))]
    fused = fuse(ir.Plan("broadcast", "direct", 3, 4, 0, False, [[], steps, []]))
    assert len(fused.programs[1]) == 1
    (step,) = fused.programs[1]
    assert step.recv == 0 and step.send == 2 and step.dst == Region(Buf.OUT, 0)


def test_fuse_drops_dead_scratch_store() -> None:
    steps = [Step(count=4, recv=0, dst=Region(Buf.TMP, 0)), Step(count=4, send=2, a=Region(Buf.TMP, 0))]
    (step,) = fuse(ir.Plan("broadcast", "direct", 3, 4, 0, False, [[], steps, []])).programs[1]
    assert step.dst is None and step.send == 2


def test_fuse_merges_send_then_local_copy_of_the_same_region() -> None:
    send = Step(count=4, send=1, a=Region(Buf.IN, 0))
    copy = Step(count=4, a=Region(Buf.IN, 0), dst=Region(Buf.OUT, 4))
    recv = Step(count=4, recv=1, dst=Region(Buf.OUT, 0))
    (step, last) = fuse(ir.Plan("allgather", "direct", 2, 4, 0, False, [[send, copy, recv], []])).programs[0]
    assert step.send == 1 and step.recv is None and step.a == Region(Buf.IN, 0) and step.dst == Region(Buf.OUT, 4)
    assert last == recv
    # Not fused: a copy of another region, of another count, or a send that reduces.
    for second in (
        Step(count=4, a=Region(Buf.IN, 4), dst=Region(Buf.OUT, 4)),
        Step(count=2, a=Region(Buf.IN, 0), dst=Region(Buf.OUT, 4)),
    ):
        assert len(fuse(ir.Plan("allgather", "direct", 2, 4, 0, False, [[send, second], []])).programs[0]) == 2
    reducing = Step(count=4, send=1, a=Region(Buf.IN, 0), b=Region(Buf.OUT, 0), reduce=True)
    assert len(fuse(ir.Plan("allreduce", "direct", 2, 4, 0, False, [[reducing, copy], []])).programs[0]) == 2


def test_out_of_place_direct_allgather_is_one_step_per_peer() -> None:
    """The send and the local copy of a rank's own block are one step (the engine's steps cost
    tens of nanoseconds each: a small allgather's time)."""
    for n in (2, 3):
        plan = plan_call(registry.get("allgather", "direct"), n, 5, 16)
        for r, program in enumerate(plan.tail.programs):
            assert len(program) == 2 * (n - 1), (r, program)
            assert program[n - 2].dst == Region(Buf.OUT, 5 * r)


def test_segmenting_keeps_plans_small() -> None:
    alg = registry.get("allreduce", "direct")
    small = plan_call(alg, 4, 10, 16)
    huge = plan_call(alg, 4, 10**9, 16)
    assert small.body is None and small.reps == 0
    assert huge.body is not None and huge.reps * huge.piece + huge.tail.count == 10**9
    assert len(huge.body.programs[0]) == len(plan_call(alg, 4, 16, 16).tail.programs[0])


def test_signature_round_trip() -> None:
    import numpy as np

    sig = ir.pack_sig("allreduce", registry.get("allreduce", "direct").code, np.dtype(np.float32), 4, 0, 1000)
    text = ir.describe_sig(sig, registry.ALGORITHM_NAMES)
    assert text == "allreduce(count=1000, float32, AVG, algorithm=direct)"
    other = ir.pack_sig("allreduce", 0, np.dtype(np.float32), 4, 0, 1001)
    assert other != sig
    assert ir.describe_sig(ir.pack_sig("broadcast", 0, np.dtype(np.bool_), 0, 3, 0), registry.ALGORITHM_NAMES) == (
        "broadcast(count=0, bool, root=3, algorithm=direct)"
    )
    assert ir.pack_sig("broadcast", 0, np.dtype(np.bool_), 0, 0, 0) != 0


def test_step_text_is_readable() -> None:
    s = Step(count=8, recv=1, a=Region(Buf.IN, 0), dst=Region(Buf.OUT, 0), reduce=True, final=True)
    assert str(s) == "OUT[0] <- IN[0] (op) recv(1) /n  [8]"


def _drop_sync(collective: str, which: int):  # type: ignore[no-untyped-def]
    """A zerocopy plan with its ``which``-th sync (a dissemination round set) removed."""
    plan = plan_call(registry.get(collective, "zerocopy"), 2, 6, 100)
    programs = []
    for program in plan.tail.programs:
        syncs = [i for i, s in enumerate(program) if s.count == 0]  # 2 ranks: one send+recv per sync
        drop = set(syncs[2 * which : 2 * which + 2])
        programs.append([s for i, s in enumerate(program) if i not in drop])
    return dataclasses.replace(plan, tail=dataclasses.replace(plan.tail, programs=programs))


def test_race_check_catches_reading_before_the_peer_arrived() -> None:
    with pytest.raises(PlanError, match="missing synchronisation"):
        verify(_drop_sync("allreduce", 0), world_size=2, count=6)


def test_race_check_catches_overwriting_what_a_peer_still_reads() -> None:
    # Without the middle sync, a rank copies a peer's finished chunk before it is finished.
    with pytest.raises(PlanError, match="missing synchronisation|still"):
        verify(_drop_sync("allreduce", 1), world_size=2, count=6)


def test_verifier_catches_a_clobbered_input() -> None:
    plan = _direct("allgather", n=2, count=3)
    programs = [list(p) for p in plan.tail.programs]
    programs[0].append(Step(count=3, a=Region(Buf.OUT, 3), dst=Region(Buf.IN, 0)))
    bad = dataclasses.replace(plan, tail=dataclasses.replace(plan.tail, programs=programs))
    with pytest.raises(PlanError, match="overwrites its input"):
        verify(bad, world_size=2, count=3)


def test_race_check_catches_returning_while_a_peer_reads() -> None:
    with pytest.raises(PlanError, match="returns while"):
        verify(_drop_sync("allgather", 1), world_size=2, count=6)


@pytest.mark.parametrize("collective", ["allgather", "alltoall"])
def test_cma_writes_into_its_peers_around_the_world(collective: str) -> None:
    # Measured (cma's module doc): writing into peers' buffers beat reading from them (below
    # _READ_FROM elements), and ranks that all start at rank 0 were slower than ranks that start
    # at their neighbour.
    n = 4
    for inplace in (False, True) if collective == "allgather" else (False,):  # (alltoall in place swaps)
        plan = plan_call(registry.get(collective, "cma"), n, 8, 100, inplace=inplace)
        for rank in range(n):
            program = plan.tail.programs[rank]
            assert all(s.a is None or s.a.rank is None for s in program)  # no reads of a peer
            owners = [s.dst.rank for s in program if s.count and s.dst is not None and s.dst.rank is not None]
            assert owners == [(rank + k) % n for k in range(1, n)]


@pytest.mark.parametrize("collective", ["allgather", "alltoall"])
def test_cma_reads_large_blocks_from_its_peers_around_the_world(
    collective: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From ``_READ_FROM`` elements a block the rank needs is read from its peer (measured faster
    beyond the caches); the plans still verify (every read after a sync that follows the peer's
    entry, every return after a sync that follows every peer's read)."""
    monkeypatch.setattr(cma, "_READ_FROM", 5)
    monkeypatch.setattr(cma, "_ALLTOALL_READ_FROM", 5)
    for n in range(1, 7):
        for count in (4, 5, 7):
            for inplace in (False, True) if collective == "allgather" else (False,):
                plan = plan_call(registry.get(collective, "cma"), n, count, 100, inplace=inplace)
                verify(plan, world_size=n, count=count, inplace=inplace)
                for rank in range(n):
                    program = plan.tail.programs[rank]
                    read = [s.a.rank for s in program if s.count and s.a is not None and s.a.rank is not None]
                    written = [s.dst.rank for s in program if s.count and s.dst is not None and s.dst.rank is not None]
                    around = [(rank + k) % n for k in range(1, n)]
                    assert (read, written) == ((around, []) if count >= 5 else ([], around)), (n, count, rank)


def test_cma_alltoall_reads_from_smaller_blocks_above_two_ranks() -> None:
    # Measured (cma._READ_FROM): an alltoall above 2 ranks read faster from 1 MiB blocks of
    # float32 on; an allgather did not, and at 2 ranks the two tied.
    small = cma._ALLTOALL_READ_FROM
    cases = [("alltoall", 2, small, False), ("alltoall", 3, small, True), ("alltoall", 3, small - 1, False)]
    cases += [("allgather", 4, small, False), ("allgather", 4, cma._READ_FROM, True)]
    for collective, n, count, reads in cases:
        assert cma._reads(collective, count, n) is reads
        plan = plan_call(registry.get(collective, "cma"), n, count, 100)
        read = [s.a.rank for s in plan.tail.programs[0] if s.count and s.a is not None and s.a.rank is not None]
        assert bool(read) is reads, (collective, n, count)


def test_cma_alltoall_in_place_swaps_a_part_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-place alltoall swaps each pair's half-blocks a part of ``_part`` elements at a time
    through a scratch of one part (measured: a half-block's scratch outgrew the core's cache from
    16 MiB calls, and the swap lost to ``direct`` there); the plans still verify."""
    monkeypatch.setattr(cma, "_PART", 3)
    for n in range(1, 6):
        for count in (0, 1, 5, 6, 7, 13):
            plan = plan_call(registry.get("alltoall", "cma"), n, count, 100, inplace=True)
            verify(plan, world_size=n, count=count, inplace=True)
            for rank in range(n):
                moves = [s for s in plan.tail.programs[rank] if s.count]
                assert all(s.count <= 3 for s in moves), (n, count)
                halves = (-(-count // 2), count // 2)  # (the lower rank of a pair swaps the first)
                parts = sum(-(-halves[0 if rank < j else 1] // 3) for j in range(n) if j != rank)
                assert len(moves) == 3 * parts, (n, count, rank)


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter"])
def test_cma_reductions_out_of_place_read_the_first_peer_into_the_output(
    collective: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured (``cma._reduce_chunk``): out of place, the first peer's part is read straight into
    the output and combined there, 6-20% faster at 2 ranks than through scratch; in place the
    output holds the rank's own input, so every read goes through scratch. The plans verify,
    parts of 3 elements, and the rank's own part stays the left operand."""
    monkeypatch.setattr(cma, "_PART", 3)
    alg = registry.get(collective, "cma")
    for n in range(1, 6):
        for count in (0, 1, 5, 7, 13):
            for inplace in (False, True):
                plan = plan_call(alg, n, count, 100, inplace=inplace)
                verify(plan, world_size=n, count=count, inplace=inplace)
                if n == 1:
                    continue
                assert (plan.tail.tmp_count == 0) is (not inplace and n == 2 or count == 0), (n, count, inplace)
                for rank in range(n):
                    moves = [s for s in plan.tail.programs[rank] if s.count]
                    reads = [s for s in moves if s.a is not None and s.a.rank is not None]
                    # Each part reads its peers around the world, the next rank first.
                    for k, s in enumerate(reads):
                        first = k % (n - 1) == 0
                        assert s.a.rank == (rank + 1 + k % (n - 1)) % n
                        assert s.dst.buf == (Buf.OUT if first and not inplace else Buf.TMP), (n, count, rank, k)
                    for s in moves:
                        if s.reduce and s.dst == s.b and s.b.buf == Buf.OUT:  # combined in the output
                            assert s.a is not None and s.a.buf == Buf.IN and s.a.rank is None


@pytest.mark.parametrize("n", [2, 3, 4])
def test_cma_broadcast_root_writes_its_share_while_peers_read_the_rest(n: int) -> None:
    # Measured (cma's module doc): with the peers reading it all, the root's core idled
    for count in (10, cma._SHARE_FROM + 1):
        _check_broadcast_shape(n, count)


def _check_broadcast_shape(n: int, count: int) -> None:
    head = count // n
    for root in range(n):
        for inplace in (False, True):
            plan = plan_call(registry.get("broadcast", "cma"), n, count, 100, root=root, inplace=inplace)
            for rank in range(n):
                moves = [s for s in plan.tail.programs[rank] if s.count]
                if rank == root:
                    writes = [(s.dst.rank, s.a.off, s.count) for s in moves if s.dst.rank is not None]
                    assert writes == [((root + k) % n, 0, head) for k in range(1, n)]
                else:
                    reads = [(s.a.rank, s.a.off, s.dst.off, s.count) for s in moves if s.a.rank is not None]
                    assert reads == [(root, head, head, count - head)]
            if not inplace:
                # The root's own output: from _SHARE_FROM its head by the root and the rest by
                # the peers, each its share of what it has just read; below, all by the root.
                into_root = sorted(
                    (s.dst.off, s.count)
                    for rank in range(n)
                    for s in plan.tail.programs[rank]
                    if s.count and s.dst is not None and (s.dst.rank == root or rank == root and s.dst.rank is None)
                )
                if count >= cma._SHARE_FROM:
                    assert into_root == [(0, head)] + [(head + off, m) for off, m in split(count - head, n - 1)]
                else:
                    assert into_root == [(0, count)]


@pytest.mark.parametrize("n", [2, 3])
def test_cma_allreduce_writes_each_part_while_it_is_in_cache(n: int) -> None:
    # Measured (cma.allreduce's doc): writing the whole chunk after its last part read it back
    # from memory. Each part is read from every peer, then written into every peer, in turn.
    count = n * (2 * cma._PART + 7)  # two whole parts and a short one per chunk
    plan = plan_call(registry.get("allreduce", "cma"), n, count, 100)
    for rank in range(n):
        kinds = ""
        for s in plan.tail.programs[rank]:
            kind = "R" if s.count and s.a is not None and s.a.rank is not None else ""
            kind = "W" if s.count and s.dst is not None and s.dst.rank is not None else kind
            if kind and not kinds.endswith(kind):
                kinds += kind
        assert kinds == "RW" * 3
    # The part's size bounds the plan: larger chunks are the rings'.
    big = registry.Query("allreduce", 2, 2 * cma._PART * cma._MAX_PARTS + 2, 4, cma=True)
    assert "parts" in (registry.get("allreduce", "cma").supports(big) or "")


def test_cma_reduce_writes_each_finished_part_into_the_root_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """cma's reduce is allreduce's plan with each finished part written into the root's output
    alone: every rank combines its chunk, reading it from every peer; the root writes nothing into
    a peer. The plans verify for every root, in place or not, parts of 3 elements."""
    monkeypatch.setattr(cma, "_PART", 3)
    alg = registry.get("reduce", "cma")
    for n in range(1, 6):
        for count in (0, 1, 5, 7, 13):
            for root in range(n):
                for inplace in (False, True):
                    plan = plan_call(alg, n, count, 100, root=root, inplace=inplace)
                    verify(plan, world_size=n, count=count, root=root, inplace=inplace)
                    for rank in range(n):
                        program = [s for s in plan.tail.programs[rank] if s.count]
                        written = {s.dst.rank for s in program if s.dst is not None and s.dst.rank is not None}
                        owns = split(count, n)[rank][1] > 0  # (its chunk)
                        assert written == ({root} if rank != root and owns else set()), (n, count, root, rank)
    big = registry.Query("reduce", 2, 2 * cma._PART * cma._MAX_PARTS + 2, 4, cma=True)
    assert "parts" in (alg.supports(big) or "")


def _drop_cma_sync(collective: str, which: int, inplace: bool = False):  # type: ignore[no-untyped-def]
    plan = plan_call(registry.get(collective, "cma"), 2, 6, 100, inplace=inplace)
    programs = []
    for program in plan.tail.programs:
        syncs = [i for i, s in enumerate(program) if s.count == 0]
        drop = set(syncs[2 * which : 2 * which + 2])
        programs.append([s for i, s in enumerate(program) if i not in drop])
    return dataclasses.replace(plan, tail=dataclasses.replace(plan.tail, programs=programs))


@pytest.mark.parametrize("collective", ["allgather", "gather", "alltoall", "broadcast"])
@pytest.mark.parametrize("inplace", [False, True])
def test_race_check_catches_writing_into_a_peer_too_early_or_returning_too_soon(collective: str, inplace: bool) -> None:
    # (an in-place alltoall reads its peer's block, which the verifier sees written at entry)
    early = "(entry|write of it \\(clock \\d+\\)) happened before: missing synchronisation"
    with pytest.raises(PlanError, match=early):
        verify(_drop_cma_sync(collective, 0, inplace), world_size=2, count=6, inplace=inplace)
    # (broadcast's root also returns while its peer may still read: either is reported first)
    late = "may still write its element" if collective != "broadcast" else "may still (write|read) its element"
    with pytest.raises(PlanError, match=late):
        verify(_drop_cma_sync(collective, 1, inplace), world_size=2, count=6, inplace=inplace)


def test_race_check_catches_two_ranks_swapping_the_same_half(monkeypatch: pytest.MonkeyPatch) -> None:
    # In place, alltoall's pairs of ranks swap two blocks, each rank one half of them. Were both
    # to swap the same half, one would read what the other is writing.
    good = plan_call(registry.get("alltoall", "cma"), 2, 6, 100, inplace=True)
    verify(good, world_size=2, count=6, inplace=True)
    halves = cma.split
    monkeypatch.setattr(cma, "split", lambda count, parts: [(0, count)] * 2 if parts == 2 else halves(count, parts))
    bad = plan_call(registry.get("alltoall", "cma"), 2, 6, 100, inplace=True)
    with pytest.raises(PlanError, match="before rank 1's write of it"):
        verify(bad, world_size=2, count=6, inplace=True)


def test_steps_write_a_peer_only_by_copying_their_own_data() -> None:
    with pytest.raises(ValueError, match="only by copying its own data"):
        Step(count=4, a=Region(Buf.IN, 0, rank=1), dst=Region(Buf.OUT, 0, rank=1))
    with pytest.raises(ValueError, match="only by copying its own data"):
        Step(count=4, recv=1, a=Region(Buf.IN, 0), dst=Region(Buf.OUT, 0, rank=1), reduce=True)
    Step(count=4, a=Region(Buf.IN, 0), dst=Region(Buf.OUT, 0, rank=1))


def test_plans_that_name_peer_regions_come_from_algorithms_registered_with_a_peers_mode() -> None:
    """The engine reaches a peer's region only in the mode the program's header says
    (``Algorithm.peers``); under ``PEERS_NONE`` it would read the rank's own buffer there and give
    wrong results with no error. So every plan that names one comes from an algorithm that says
    its mode, and encoding such a plan without one is refused on every rank (not only on the ranks
    whose own program names a peer's region)."""
    modes = {a.peers for a in registry.algorithms()}
    assert modes == {ir.PEERS_NONE, ir.PEERS_REGISTERED, ir.PEERS_CMA}
    for a in registry.algorithms():
        assert a.peers == {"zerocopy": ir.PEERS_REGISTERED, "cma": ir.PEERS_CMA}.get(a.name, ir.PEERS_NONE), a
    channel = lambda src, dst: 0  # noqa: E731 (no rings are reached in these plans' encoding)
    names_peers = set()
    for collective, name in ALL:
        alg = registry.get(collective, name)
        for n in (2, 3, 5):
            root = n - 1 if collectives.get(collective).rooted else 0
            plan = plan_call(alg, n, 3 * n + 1, 4, root=root)
            where = ir._peer_region(plan)
            if where is None:
                continue
            names_peers.add((collective, name))
            assert alg.peers != ir.PEERS_NONE, (collective, name, n, where)
            for rank in range(n):
                ir.encode(plan, rank, channel, 0, 1, alg.peers)
                with pytest.raises(ValueError, match="names peer regions .*PEERS_NONE"):
                    ir.encode(plan, rank, channel, 0, 1)
    assert {name for _, name in names_peers} == {"zerocopy", "cma"}
