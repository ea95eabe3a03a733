"""What an algorithm's builder writes into: the programs of every rank for one piece.

A builder is a pure function ``build(ctx)`` that appends steps for each rank through the helpers
below; it never touches shared memory. Regions are :class:`~shmcoll.plan.ir.Region` values;
``ctx.block_region(buf, block, off)`` addresses element ``off`` of block ``block`` of a blocked
buffer, whose blocks are ``ctx.block`` elements apart (the *call's* per-block count, not the
piece's: pieces are sub-ranges of every block).
"""

from __future__ import annotations

import dataclasses

from shmcoll.plan.ir import Buf, Plan, Program, Region, Step


def split(count: int, parts: int) -> list[tuple[int, int]]:
    """Cut ``count`` elements into ``parts`` contiguous (offset, count) chunks, sizes within 1."""
    base, extra = divmod(count, parts)
    out = []
    off = 0
    for i in range(parts):
        c = base + (1 if i < extra else 0)
        out.append((off, c))
        off += c
    return out


@dataclasses.dataclass
class Context:
    """A builder's view of the call: who, how much, and the programs being written."""

    kind: str
    algorithm: str
    world_size: int
    count: int
    root: int = 0
    inplace: bool = False
    block: int = 0
    peer: int = 0
    options: dict[str, object] = dataclasses.field(default_factory=dict)
    nslots: int = 1  # slots per ring the plan will run with; 1 is the safe assumption
    programs: list[Program] = dataclasses.field(default_factory=list)
    tmp_count: int = 0

    def __post_init__(self) -> None:
        if not self.programs:
            self.programs = [[] for _ in range(self.world_size)]
        if self.block == 0:
            self.block = self.count

    # --- regions ---------------------------------------------------------------------------
    @staticmethod
    def region(buf: Buf, off: int = 0) -> Region:
        return Region(buf, off)

    def block_region(self, buf: Buf, block: int, off: int = 0) -> Region:
        return Region(buf, block * self.block + off)

    def tmp(self, count: int) -> Region:
        """Reserve ``count`` elements of scratch (shared by all ranks' programs: same offsets)."""
        region = Region(Buf.TMP, self.tmp_count)
        self.tmp_count += count
        return region

    # --- steps -----------------------------------------------------------------------------
    def emit(self, rank: int, step: Step) -> None:
        self.programs[rank].append(step)

    def send(self, rank: int, peer: int, src: Region | None, count: int) -> None:
        self.emit(rank, Step(count=count, send=peer, a=src))

    def recv(self, rank: int, peer: int, dst: Region | None, count: int) -> None:
        self.emit(rank, Step(count=count, recv=peer, dst=dst))

    def copy(self, rank: int, src: Region, dst: Region, count: int) -> None:
        if src != dst and count > 0:
            self.emit(rank, Step(count=count, a=src, dst=dst))

    def recv_reduce(
        self,
        rank: int,
        peer: int,
        local: Region,
        dst: Region,
        count: int,
        *,
        final: bool = False,
        received_left: bool = False,
    ) -> None:
        """``dst = local (op) received`` (or ``received (op) local`` with ``received_left``)."""
        if received_left:
            step = Step(count=count, recv=peer, b=local, dst=dst, reduce=True, final=final, recv_left=True)
        else:
            step = Step(count=count, recv=peer, a=local, dst=dst, reduce=True, final=final)
        self.emit(rank, step)

    def reduce_local(self, rank: int, x: Region, y: Region, dst: Region, count: int, *, final: bool = False) -> None:
        """``dst = x (op) y`` from this rank's own buffers."""
        self.emit(rank, Step(count=count, a=x, b=y, dst=dst, reduce=True, final=final))

    def no_fuse(self, rank: int) -> None:
        """Keep ``rank``'s previous step and its next one apart when rings have one slot.

        The fuse pass will not merge a receive with the send that follows a fence. A fused step
        needs an incoming message and a free outgoing slot at once, so a cycle of fused steps
        deadlocks when every ring in it is full, which one slot per ring makes possible (see
        ``passes.fuse``). With two or more slots the cycle always has room, so no fence is
        emitted and every forward stays one step: an unfused forward costs a second copy of the
        chunk, and in a ring the split travels with the data, so it would be paid on every hop.
        The verifier checks both cases.
        """
        if self.nslots < 2:
            self.emit(rank, Step(count=0, fence=True))

    def plan(self) -> Plan:
        return Plan(
            kind=self.kind,
            algorithm=self.algorithm,
            world_size=self.world_size,
            count=self.count,
            root=self.root,
            inplace=self.inplace,
            programs=self.programs,
            tmp_count=self.tmp_count,
        )


def accumulate_in_rank_order(
    ctx: Context,
    rank: int,
    own: Region,
    dst: Region,
    count: int,
    contributors: list[int],
    *,
    acc_aliases_own: bool,
) -> None:
    """Reduce ``contributors``' values (own from ``own``, others received) into ``dst``.

    The expression is the same on every rank that runs this: ``((c0 (op) c1) (op) c2) ...`` in
    the given order, left-associated, with AVG's division on the last combination. That is what
    makes the direct algorithms bitwise identical across ranks. ``acc_aliases_own`` says that
    writing ``dst`` destroys ``own`` (in-place calls); then the running value is kept in scratch
    until ``own`` has been used, if it would otherwise be overwritten first.
    """
    n = len(contributors)
    if n == 1:
        ctx.copy(rank, own, dst, count)
        return
    my_pos = contributors.index(rank) if rank in contributors else -1
    # Positions 0 and 1 combine in the first step; own is safe if it is used there.
    acc = ctx.tmp(count) if (acc_aliases_own and my_pos >= 2) else dst
    c0, c1 = contributors[0], contributors[1]
    last = n == 2
    target = dst if last else acc
    if c0 == rank:
        ctx.recv_reduce(rank, c1, own, target, count, final=last)
    elif c1 == rank:
        ctx.recv_reduce(rank, c0, own, target, count, final=last, received_left=True)
    else:
        ctx.recv(rank, c0, acc, count)
        ctx.recv_reduce(rank, c1, acc, target, count, final=last)
    for pos in range(2, n):
        last = pos == n - 1
        target = dst if last else acc
        c = contributors[pos]
        if c == rank:
            ctx.reduce_local(rank, acc, own, target, count, final=last)
        else:
            ctx.recv_reduce(rank, c, acc, target, count, final=last)
