"""The symbolic verifier: run a plan without processes and check it does what it claims.

Every buffer element holds a symbolic value: ``("x", rank, index)`` for an input element,
``("op", left, right)`` for a combination (operand order kept) and ``("avg", value)`` for AVG's
final division. The ranks' programs run against bounded FIFO channels of ``nslots`` messages,
the least an engine ring holds (it holds more small ones); a step waits for its incoming
message and room for its outgoing one, then acts, as in the engine. Ranks are sequential and
every channel has one writer and one reader, so the run is a Kahn network with bounded buffers:
whether it deadlocks does not depend on the schedule, one schedule decides it, and a network
that does not deadlock with these capacities does not with larger ones.

Checked: every receive meets a send of the same count and tag (``Step.tag``; every message of a
variable-count plan must carry one); nothing blocks forever (deadlock); no message is left over;
no step reaches outside its buffer; an out-of-place call leaves its input as it was; the
collective's postcondition on every rank that has an output; every reduced element is a
combination of each rank's contribution exactly once, divided once; and every rank holding an
element of an allreduce holds the *same expression* for it, operand order included, so results
are bitwise identical across ranks. Scans and reduce_scatterv must hold exactly the rank-order
fold ``((x0 (op) x1) (op) ...)``; exscan must leave rank 0's output alone. A barrier must leave
every rank having heard, directly or transitively, from every other. Plans that read peers' buffers in place
(registered buffers) are also checked for races with vector clocks (see :class:`_Clocks`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from shmcoll import collectives
from shmcoll.errors import PlanError
from shmcoll.plan.ir import Buf, CallPlan, Plan, Region, Step

Value = Any


@dataclasses.dataclass(frozen=True)
class _Shape:
    """The call's sizes: ``count`` per block, or the variable counts (see ``collectives``)."""

    kind: str
    world_size: int
    count: int
    root: int
    counts: tuple[int, ...] = ()
    matrix: tuple[tuple[int, ...], ...] = ()

    def block(self, j: int) -> tuple[int, int]:
        """(offset, count) of block ``j`` of a blocked buffer (uniform or ``counts``)."""
        if collectives.get(self.kind).varying:
            return sum(self.counts[:j]), self.counts[j]
        return j * self.count, self.count

    def sizes(self, rank: int) -> tuple[int, int]:
        """Elements of ``rank``'s IN and OUT."""
        n, record = self.world_size, collectives.get(self.kind)
        if self.kind == "alltoallv":
            return sum(self.matrix[rank]), sum(row[rank] for row in self.matrix)
        if record.varying:
            total, mine = sum(self.counts), self.counts[rank]
            return (total if record.blocks_in else mine), (total if record.blocks_out else mine)
        return (n * self.count if record.blocks_in else self.count), (
            n * self.count if record.blocks_out else self.count
        )


def _shape(
    kind: str, world_size: int, count: int, root: int, counts: tuple[int, ...], matrix: tuple[tuple[int, ...], ...]
) -> _Shape:
    """The call's shape, with the variable counts checked against the collective."""
    n = world_size
    if kind == "alltoallv":
        if len(matrix) != n or any(row is None or len(row) != n or min(row) < 0 for row in matrix):
            raise PlanError(f"alltoallv needs an {n} x {n} matrix of counts, got {matrix!r}")
        return _Shape(kind, n, count, root, (), tuple(tuple(row) for row in matrix))
    if collectives.get(kind).varying:
        if len(counts) != n or min(counts) < 0:
            raise PlanError(f"{kind} needs {n} counts (one per rank), got {counts!r}")
        return _Shape(kind, n, count, root, tuple(counts))
    return _Shape(kind, n, count, root)


class _Rank:
    def __init__(self, shape: _Shape, rank: int, inplace: bool, tmp: int) -> None:
        kind, root = shape.kind, shape.root
        record = collectives.get(kind)
        in_size, out_size = shape.sizes(rank)
        # A buffer is (storage, offset into it): in-place calls make IN and OUT share storage.
        self.bufs: dict[Buf, tuple[list[Value], int]] = {}
        storage_in: list[Value] = [("x", rank, i) for i in range(in_size)]
        aliased = inplace and not (record.rooted and record.blocked and rank != root)
        if inplace and record.varying and record.inplace is collectives.InPlace.NEVER:
            raise PlanError(f"{kind} is never in place")
        if not aliased:
            self.bufs[Buf.IN] = (storage_in, 0)
            self.bufs[Buf.OUT] = ([None] * out_size, 0)
        elif record.inplace is collectives.InPlace.INPUT_IS_MY_BLOCK:  # allgather(v), gather(v)
            off, _ = shape.block(rank)
            storage = [None] * out_size
            storage[off : off + in_size] = storage_in
            self.bufs[Buf.OUT] = (storage, 0)
            self.bufs[Buf.IN] = (storage, off)
        elif record.inplace is collectives.InPlace.OUTPUT_IS_MY_BLOCK:  # (reduce_)scatter(v)
            off, _ = shape.block(root if record.rooted else rank)
            self.bufs[Buf.IN] = (storage_in, 0)
            self.bufs[Buf.OUT] = (storage_in, off)
        else:
            self.bufs[Buf.IN] = (storage_in, 0)
            self.bufs[Buf.OUT] = (storage_in, 0)
        self.bufs[Buf.TMP] = ([None] * tmp, 0)
        self.sizes = {Buf.IN: in_size, Buf.OUT: out_size, Buf.TMP: tmp}
        self.out_size = out_size
        self.initial_out = self.out()
        self.heard = {rank}

    def locate(self, region: Region, base: int, count: int) -> tuple[list[Value], int]:
        storage, off = self.bufs[region.buf]
        at = region.off + (base if region.buf != Buf.TMP else 0)
        size = self.sizes[region.buf]
        if at < 0 or at + count > size:
            raise IndexError(f"{region} + base {base} x {count} outside {region.buf.name} of {size}")
        return storage, off + at

    def out(self) -> list[Value]:
        storage, off = self.bufs[Buf.OUT]
        return storage[off : off + self.out_size]


class _Clocks:
    """Vector clocks and per-element access records: the race check for peers' regions.

    A rank's clock ticks at every step; a message carries its sender's clock and the receiver
    takes the element-wise maximum. Reading element ``e`` of rank ``p``'s buffer from rank ``q``
    is safe only if the last write of ``e`` happened before (``q``'s clock has seen it); the
    user's data counts as written when ``p`` enters the call (its first step), since before that
    ``p`` may still be filling it. ``e`` may be written again, or ``p`` return from the call
    (after which the user may write it), only after every such read happened before.

    Writing ``e`` of ``p``'s buffer from ``q`` (cma's copies into a peer's buffer) is safe only
    if every earlier access of ``e`` happened before: ``p``'s entry (until then the buffer is the
    user's), every read of it, ``p``'s own reads included, and its last write; and ``p`` may
    read ``e``, or return, only after the write happened before.
    """

    def __init__(self, world_size: int) -> None:
        self.vc = [[0] * world_size for _ in range(world_size)]
        # (storage id, index) -> (writer, clock, owner); -> [(reader, clock, owner)]
        self.writes: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.reads: dict[tuple[int, int], list[tuple[int, int, int]]] = {}

    def read(self, reader: int, owner: int, storage: list[Value], start: int, count: int, where: str) -> None:
        sid = id(storage)
        for i in range(start, start + count):
            w_writer, w_clock, _ = self.writes.get((sid, i), (owner, 1, owner))
            if self.vc[reader][w_writer] < w_clock:
                raise PlanError(
                    f"{where}: reads rank {owner}'s element {i} before rank {w_writer}'s write of it "
                    f"(clock {w_clock}) happened before: missing synchronisation"
                )
            self.reads.setdefault((sid, i), []).append((reader, self.vc[reader][reader], owner))

    def write(self, writer: int, owner: int, storage: list[Value], start: int, count: int, where: str) -> None:
        sid = id(storage)
        for i in range(start, start + count):
            for reader, clock, _ in self.reads.pop((sid, i), ()):
                if reader != writer and self.vc[writer][reader] < clock:
                    raise PlanError(f"{where}: overwrites element {i} while rank {reader} may still be reading it")
            last = self.writes.get((sid, i), (owner, 1, owner))
            if last[0] != writer and self.vc[writer][last[0]] < last[1]:
                raise PlanError(
                    f"{where}: writes rank {owner}'s element {i} before rank {last[0]}'s "
                    f"{'entry' if last[0] == owner and last[1] == 1 else 'write of it'} happened before: "
                    "missing synchronisation"
                )
            self.writes[(sid, i)] = (writer, self.vc[writer][writer], owner)

    def check_return(self, rank: int, label: str) -> None:
        """Rank ``rank`` returns: every peer's read of its buffers, and every peer's write into
        them, must have happened before."""
        for (_, i), reads in self.reads.items():
            for reader, clock, owner in reads:
                if owner == rank and reader != rank and self.vc[rank][reader] < clock:
                    raise PlanError(
                        f"{label}: rank {rank} returns while rank {reader} may still read its element "
                        f"{i}: the user could overwrite it"
                    )
        for (_, i), (writer, clock, owner) in self.writes.items():
            if owner == rank and writer != rank and self.vc[rank][writer] < clock:
                raise PlanError(
                    f"{label}: rank {rank} returns while rank {writer} may still write its element {i}: "
                    "the user could read it unfinished"
                )


_Message = tuple[int, int, list[Value], frozenset[int], list[int]]  # count, tag, values, heard, clock


def _run(
    shape: _Shape,
    inplace: bool,
    nslots: int,
    programs: list[list[tuple[Step, int]]],
    tmp: int,
    label: str,
) -> list[_Rank]:
    world_size = shape.world_size
    ranks = [_Rank(shape, r, inplace, tmp) for r in range(world_size)]
    remote = any(
        reg is not None and reg.rank is not None for prog in programs for s, _ in prog for reg in (s.a, s.b, s.dst)
    )
    clocks = _Clocks(world_size) if remote else None
    channels: dict[tuple[int, int], collections.deque[_Message]] = collections.defaultdict(collections.deque)
    if collectives.get(shape.kind).varying:
        # The engine checks a message's tag only where it is not 0: a variable-count plan that
        # left one at 0 would let ranks that disagree on the counts run on with the wrong sizes.
        for r, prog in enumerate(programs):
            for i, (step, _) in enumerate(prog):
                if (step.recv is not None or step.send is not None) and step.tag <= 0:
                    raise PlanError(f"{label}: rank {r} step {i} ({step}): a message of {shape.kind} needs a tag")
    pcs = [0] * world_size
    while True:
        progressed = False
        for r in range(world_size):
            while pcs[r] < len(programs[r]):
                step, base = programs[r][pcs[r]]
                where = f"{label}: rank {r} step {pcs[r]} ({step})"
                if step.recv is not None and not channels[(step.recv, r)]:
                    break
                if step.send is not None and len(channels[(r, step.send)]) >= nslots:
                    break
                _execute(ranks, r, step, base, channels, where, clocks)
                pcs[r] += 1
                progressed = True
        if all(pcs[r] == len(programs[r]) for r in range(world_size)):
            break
        if not progressed:
            blocked = []
            for r in range(world_size):
                if pcs[r] < len(programs[r]):
                    step, _ = programs[r][pcs[r]]
                    blocked.append(f"rank {r} at step {pcs[r]} ({step})")
            raise PlanError(f"{label}: deadlock with {nslots} slot(s) per ring: " + "; ".join(blocked))
    leftover = {ch: len(q) for ch, q in channels.items() if q}
    if leftover:
        raise PlanError(f"{label}: messages never received: {leftover}")
    if clocks is not None:
        for r in range(world_size):
            clocks.check_return(r, label)
    return ranks


def _execute(
    ranks: list[_Rank], r: int, step: Step, base: int, channels: Any, where: str, clocks: _Clocks | None
) -> None:
    rank = ranks[r]
    if clocks is not None:
        clocks.vc[r][r] += 1
    slot: list[Value] | None = None
    if step.recv is not None:
        n, tag, slot, heard, sender_vc = channels[(step.recv, r)].popleft()
        if n != step.count:
            raise PlanError(f"{where}: receives {step.count} elements but rank {step.recv} sent {n}")
        if tag != step.tag:
            raise PlanError(f"{where}: expects tag {step.tag} but rank {step.recv} sent tag {tag}")
        rank.heard |= heard
        if clocks is not None:
            clocks.vc[r] = [max(a, b) for a, b in zip(clocks.vc[r], sender_vc, strict=True)]

    def read(region: Region) -> list[Value]:
        owner = r if region.rank is None else region.rank
        storage, start = ranks[owner].locate(region, base, step.count)
        if clocks is not None:  # (this rank's own reads too: a peer may write what it reads)
            clocks.read(r, owner, storage, start, step.count, where)
        return storage[start : start + step.count]

    try:
        if step.reduce:
            x = slot if (slot is not None and step.recv_left) else read(step.a)  # type: ignore[arg-type]
            y = slot if (slot is not None and not step.recv_left) else read(step.b)  # type: ignore[arg-type]
            value: list[Any] = [("op", a, b) for a, b in zip(x, y, strict=True)]
            if step.final:
                value = [("avg", v) for v in value]
        elif slot is not None:
            value = slot
        elif step.a is not None:
            value = read(step.a)
        else:
            value = [None] * step.count
        if step.send is not None:
            vc = list(clocks.vc[r]) if clocks is not None else []
            channels[(r, step.send)].append((step.count, step.tag, list(value), frozenset(rank.heard), vc))
        if step.dst is not None:
            owner = r if step.dst.rank is None else step.dst.rank
            storage, start = ranks[owner].locate(step.dst, base, step.count)
            if clocks is not None:
                clocks.write(r, owner, storage, start, step.count, where)
            storage[start : start + step.count] = list(value)
    except IndexError as exc:
        raise PlanError(f"{where}: {exc}") from None


def _leaves(value: Value, out: list[tuple[int, int]], avgs: list[int], depth: int = 0) -> None:
    if value is None:
        raise ValueError("uninitialised element")
    tag = value[0]
    if tag == "x":
        out.append((value[1], value[2]))
    elif tag == "op":
        _leaves(value[1], out, avgs, depth + 1)
        _leaves(value[2], out, avgs, depth + 1)
    elif tag == "avg":
        avgs.append(depth)
        _leaves(value[1], out, avgs, depth + 1)


def _check_reduction(value: Value, expected: set[tuple[int, int]], where: str) -> None:
    leaves: list[tuple[int, int]] = []
    avgs: list[int] = []
    try:
        _leaves(value, leaves, avgs)
    except ValueError as exc:
        raise PlanError(f"{where}: {exc}") from None
    if sorted(leaves) != sorted(expected):
        raise PlanError(f"{where}: combines {sorted(leaves)}, expected each of {sorted(expected)} once")
    if len(expected) > 1 and avgs != [0]:
        raise PlanError(f"{where}: AVG's division applied {len(avgs)} times, not once at the end")


def _fold(values: list[Value]) -> Value:
    """``((v0 (op) v1) (op) v2) ...``: the rank-order expression of the direct algorithms and scans."""
    acc = values[0]
    for v in values[1:]:
        acc = ("op", acc, v)
    return acc


def _check(shape: _Shape, ranks: list[_Rank], label: str) -> None:
    kind, n, count, root = shape.kind, shape.world_size, shape.count, shape.root
    outs = [rk.out() for rk in ranks]
    for r, rk in enumerate(ranks):
        storage, off = rk.bufs[Buf.IN]
        if storage is not rk.bufs[Buf.OUT][0]:  # out of place: the caller's input must survive
            changed = [i for i, v in enumerate(storage[off:]) if v != ("x", r, i)]
            if changed:
                raise PlanError(f"{label}: rank {r} overwrites its input (elements {changed[:5]}) out of place")

    def expect(r: int, i: int, value: Value) -> None:
        if outs[r][i] != value:
            raise PlanError(f"{label}: rank {r} output[{i}] = {outs[r][i]}, expected {value}")

    if kind == "broadcast":
        for r in range(n):
            for i in range(count):
                expect(r, i, ("x", root, i))
    elif kind == "scatter":
        for r in range(n):
            for i in range(count):
                expect(r, i, ("x", root, r * count + i))
    elif kind == "gather":
        for j in range(n):
            for i in range(count):
                expect(root, j * count + i, ("x", j, i))
    elif kind == "allgather":
        for r in range(n):
            for j in range(n):
                for i in range(count):
                    expect(r, j * count + i, ("x", j, i))
    elif kind == "alltoall":
        for r in range(n):
            for j in range(n):
                for i in range(count):
                    expect(r, j * count + i, ("x", j, r * count + i))
    elif kind in ("reduce", "allreduce", "reduce_scatter"):
        holders = [root] if kind == "reduce" else list(range(n))
        for r in holders:
            for i in range(count):
                src = r * count + i if kind == "reduce_scatter" else i
                _check_reduction(outs[r][i], {(j, src) for j in range(n)}, f"{label}: rank {r} output[{i}]")
        if kind == "allreduce":
            for i in range(count):
                for r in range(1, n):
                    if outs[r][i] != outs[0][i]:
                        raise PlanError(
                            f"{label}: output[{i}] is computed differently on rank {r} and rank 0 "
                            f"(results would not be bitwise identical): {outs[r][i]} vs {outs[0][i]}"
                        )
    elif kind in ("allgatherv", "gatherv"):
        for r in range(n) if kind == "allgatherv" else [root]:
            for j in range(n):
                off, c = shape.block(j)
                for i in range(c):
                    expect(r, off + i, ("x", j, i))
    elif kind == "scatterv":
        for r in range(n):
            off, c = shape.block(r)
            for i in range(c):
                expect(r, i, ("x", root, off + i))
    elif kind == "reduce_scatterv":
        for r in range(n):
            off, c = shape.block(r)
            for i in range(c):
                where = f"{label}: rank {r} output[{i}]"
                _check_reduction(outs[r][i], {(j, off + i) for j in range(n)}, where)
                folded = _fold([("x", j, off + i) for j in range(n)])
                if outs[r][i] != (("avg", folded) if n > 1 else folded):
                    raise PlanError(f"{where} = {outs[r][i]}: not combined in rank order, {folded}")
    elif kind == "alltoallv":
        m = shape.matrix
        for r in range(n):
            at = 0  # where rank i's block starts in rank r's output: column r's prefix
            for i in range(n):
                src = sum(m[i][:r])  # and in rank i's input: row i's prefix
                for e in range(m[i][r]):
                    expect(r, at + e, ("x", i, src + e))
                at += m[i][r]
    elif kind in ("scan", "exscan"):
        # Every rank's result is the left fold in rank order, so any rank that computes an
        # element computes the same expression; no division (the API rejects AVG for scans).
        upto = 1 if kind == "scan" else 0
        for r in range(n):
            if r + upto == 0:
                if outs[r] != ranks[r].initial_out:
                    changed = [i for i, v in enumerate(outs[r]) if v != ranks[r].initial_out[i]]
                    raise PlanError(f"{label}: rank 0 writes its exscan output (elements {changed[:5]})")
                continue
            for i in range(count):
                expect(r, i, _fold([("x", j, i) for j in range(r + upto)]))
    elif kind == "barrier":
        for r, rk in enumerate(ranks):
            if rk.heard != set(range(n)):
                raise PlanError(f"{label}: rank {r} leaves the barrier without hearing from {set(range(n)) - rk.heard}")
    else:
        raise PlanError(f"no postcondition for {kind}")


def verify(
    plan: CallPlan,
    *,
    world_size: int,
    count: int,
    root: int = 0,
    inplace: bool = False,
    nslots: int = 1,
    counts: tuple[int, ...] = (),
    matrix: tuple[tuple[int, ...], ...] = (),
) -> None:
    """Check a whole call (``reps`` body pieces, then the tail); raises :class:`PlanError`.

    The variable-count collectives take their counts as the plan did: ``counts`` (one per
    rank) or, for alltoallv, ``matrix[i][j]`` elements from rank ``i`` to rank ``j``.
    """
    kind = plan.tail.kind
    label = f"{kind}/{plan.tail.algorithm} n={world_size} count={count} root={root}" + (" in-place" if inplace else "")
    if counts:
        label += f" counts={list(counts)}"
    if matrix:
        label += f" matrix={[list(row) for row in matrix]}"
    shape = _shape(kind, world_size, count, root, tuple(counts), tuple(matrix))
    programs: list[list[tuple[Step, int]]] = [[] for _ in range(world_size)]
    for p in range(plan.reps):
        assert plan.body is not None
        for r in range(world_size):
            programs[r].extend((s, p * plan.piece) for s in plan.body.programs[r])
    for r in range(world_size):
        programs[r].extend((s, plan.reps * plan.piece) for s in plan.tail.programs[r])
    ranks = _run(shape, inplace, nslots, programs, plan.tmp_count, label)
    _check(shape, ranks, label)


def verify_plan(
    plan: Plan,
    *,
    nslots: int = 1,
    counts: tuple[int, ...] = (),
    matrix: tuple[tuple[int, ...], ...] = (),
) -> None:
    """Check one piece's plan on its own (a call that is exactly one piece)."""
    seg = CallPlan(body=None, tail=plan, reps=0, piece=max(plan.count, 1))
    verify(
        seg,
        world_size=plan.world_size,
        count=plan.count,
        root=plan.root,
        inplace=plan.inplace,
        nslots=nslots,
        counts=counts,
        matrix=matrix,
    )
