"""What an algorithm's builder writes into: the programs of every rank for one piece.

A builder is a pure function ``build(ctx)`` that appends steps for each rank through the helpers
below; it never touches shared memory. Regions are :class:`~shmcoll.plan.ir.Region` values;
``ctx.block_region(buf, block, off)`` addresses element ``off`` of block ``block`` of a blocked
buffer, whose blocks are ``ctx.block`` elements apart (the *call's* per-block count, not the
piece's: pieces are sub-ranges of every block).

**Composition.** :func:`compose` runs another algorithm's builder as a *sub-collective* on a
view of this one: a subset of the ranks (sub-rank ``i`` is rank ``ranks[i]``) and a placement of
its buffers in ours (its ``IN``/``OUT`` at some offset of our ``IN``, ``OUT`` or scratch, per
rank). Its steps are translated as they are emitted and land in the parent's programs, so the
sub-builder neither knows nor cares that it is not the whole call. That is how
``hierarchical`` reuses ``ring``, ``dbtree`` and the others instead of rewriting them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

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


def displs(counts: Sequence[int]) -> list[int]:
    """Where each rank's block starts in a buffer of blocks of ``counts`` elements (exclusive prefix sums)."""
    out = []
    off = 0
    for c in counts:
        out.append(off)
        off += c
    return out


def fragments(count: int, slot_capacity: int) -> list[tuple[int, int]]:
    """Cut ``count`` elements into slot-sized (offset, count) messages, the last one shorter.

    ``slot_capacity`` 0 means unbounded (one message); zero elements make no message at all.
    """
    step = slot_capacity if slot_capacity > 0 else max(count, 1)
    return [(off, min(step, count - off)) for off in range(0, count, step)]


def whole_call(slot_capacity: int, world_size: int) -> int:
    """Piece rule of builders that cut their messages themselves (the variable-count ones):
    never cut the call (``passes.plan_call`` hands them the whole call anyway)."""
    return 1 << 62


def block_counts(ctx: Context) -> tuple[int, ...]:
    """``ctx.counts`` of a variable-count collective, checked: one count per rank."""
    if len(ctx.counts) != ctx.world_size or min(ctx.counts, default=0) < 0:
        raise ValueError(f"{ctx.kind}/{ctx.algorithm} needs one count per rank (ctx.counts), got {ctx.counts!r}")
    return ctx.counts


def pair_count(ctx: Context, src: int, dst: int) -> int:
    """Elements rank ``src`` sends rank ``dst`` in an alltoallv (``ctx.matrix[src][dst]``), checked.

    A rank's program may depend only on its own row (what it sends) and column (what it
    receives): those are all it knows at run time.
    """
    row = ctx.matrix[src] if len(ctx.matrix) == ctx.world_size else None
    if row is None or len(row) != ctx.world_size:
        raise ValueError(f"{ctx.kind}/{ctx.algorithm} needs ctx.matrix[{src}]: one count per rank, got {ctx.matrix!r}")
    return row[dst]


@contextlib.contextmanager
def tagged(ctx: Context, tag: int) -> Iterator[None]:
    """Every send and receive emitted (on any rank) inside the block carries ``tag``.

    Variable-count plans tag each message with the size of its pair's whole transfer plus one
    (``Step.tag``), so that ranks that disagree on the counts fail with a mismatch. A receive
    fused with the send that forwards it has one tag for both: forward under the same tag.
    """
    start = [len(program) for program in ctx.programs]
    yield
    for rank, program in enumerate(ctx.programs):
        for i in range(start[rank], len(program)):
            step = program[i]
            if step.recv is not None or step.send is not None:
                program[i] = dataclasses.replace(step, tag=tag)


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
    options: dict[str, object] = dataclasses.field(default_factory=dict)
    nslots: int = 1  # slots per ring the plan will run with; 1 is the safe assumption
    programs: list[Program] = dataclasses.field(default_factory=list)
    tmp_count: int = 0
    slot_capacity: int = 0  # the most elements one step may move (0: not bounded); for compose
    # Variable-count collectives: ``counts[j]`` elements for rank j (allgatherv, gatherv,
    # scatterv, reduce_scatterv), or for alltoallv ``matrix[i][j]`` elements from rank i to
    # rank j, where a row the caller does not know (another rank's sends) is None.
    counts: tuple[int, ...] = ()
    matrix: tuple[tuple[int, ...] | None, ...] = ()

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
    final: bool = True,
    scratch: Region | None = None,
) -> None:
    """Reduce ``contributors``' values (own from ``own``, others received) into ``dst``.

    The expression is the same on every rank that runs this: ``((c0 (op) c1) (op) c2) ...`` in
    the given order, left-associated, with AVG's division on the last combination (none with
    ``final=False``: scans never divide). That is what makes the direct algorithms bitwise
    identical across ranks. ``acc_aliases_own`` says that writing ``dst`` destroys ``own``
    (in-place calls); then the running value is kept in scratch (``scratch``, of at least
    ``count`` elements, else newly reserved) until ``own`` has been used, if it would otherwise
    be overwritten first.
    """
    n = len(contributors)
    if n == 1:
        ctx.copy(rank, own, dst, count)
        return
    my_pos = contributors.index(rank) if rank in contributors else -1
    # Positions 0 and 1 combine in the first step; own is safe if it is used there.
    acc = dst
    if acc_aliases_own and my_pos >= 2:
        acc = scratch if scratch is not None else ctx.tmp(count)
    c0, c1 = contributors[0], contributors[1]
    target = dst if n == 2 else acc
    last = final and n == 2
    if c0 == rank:
        ctx.recv_reduce(rank, c1, own, target, count, final=last)
    elif c1 == rank:
        ctx.recv_reduce(rank, c0, own, target, count, final=last, received_left=True)
    else:
        ctx.recv(rank, c0, acc, count)
        ctx.recv_reduce(rank, c1, acc, target, count, final=last)
    for pos in range(2, n):
        target = dst if pos == n - 1 else acc
        last = final and pos == n - 1
        c = contributors[pos]
        if c == rank:
            ctx.reduce_local(rank, acc, own, target, count, final=last)
        else:
            ctx.recv_reduce(rank, c, acc, target, count, final=last)


# --- composition -------------------------------------------------------------------------------
class SubAlgorithm(Protocol):
    """What :func:`compose` needs of an algorithm (``registry.Algorithm`` is one)."""

    @property
    def build(self) -> Callable[[Context], None]: ...

    def piece_count(self, slot_capacity: int, world_size: int, options: Mapping[str, object] | None = None) -> int: ...


Place = Callable[[int, Region], Region]
"""``place(rank, region)``: where the sub-collective's ``region`` of sub-rank ``rank`` lies in the parent."""


class _SubContext(Context):
    """A :class:`Context` whose steps go, translated, into a parent's programs."""

    def __init__(self, parent: Context, ranks: Sequence[int], place: Place, tmp_base: int, **kw: object) -> None:
        super().__init__(world_size=len(ranks), **kw)  # type: ignore[arg-type]
        self._parent = parent
        self._ranks = list(ranks)
        self._place = place
        self._tmp_base = tmp_base

    def _region(self, rank: int, region: Region | None) -> Region | None:
        if region is None:
            return None
        if region.buf == Buf.TMP:
            # Scratch is private to a rank and sub-collectives on one rank run one after the
            # other, so each gets the parent's scratch from ``tmp_base`` on.
            return Region(Buf.TMP, self._tmp_base + region.off)
        owner = rank if region.rank is None else region.rank
        placed = self._place(owner, Region(region.buf, region.off))
        return placed if region.rank is None else Region(placed.buf, placed.off, self._ranks[region.rank])

    def emit(self, rank: int, step: Step) -> None:
        def peer(p: int | None) -> int | None:
            return None if p is None else self._ranks[p]

        self._parent.emit(
            self._ranks[rank],
            dataclasses.replace(
                step,
                recv=peer(step.recv),
                send=peer(step.send),
                a=self._region(rank, step.a),
                b=self._region(rank, step.b),
                dst=self._region(rank, step.dst),
            ),
        )


def compose(
    parent: Context,
    algorithm: SubAlgorithm,
    *,
    kind: str,
    ranks: Sequence[int],
    count: int,
    place: Place,
    block: int = 0,
    root: int = 0,
    inplace: bool = False,
    tmp_base: int | None = None,
    keep_final: bool = True,
    options: Mapping[str, object] | None = None,
) -> int:
    """Run ``algorithm``'s builder for ``kind`` over ``ranks`` (a view of ``parent``); returns the
    scratch it used, from ``tmp_base`` (default: the parent's current end of scratch) on.

    ``place(sub_rank, region)`` says where the sub-collective's ``IN``/``OUT`` region of sub-rank
    ``sub_rank`` lies in the parent's buffers; ``block`` is its block stride (blocked
    collectives), ``inplace`` whether its ``IN`` and ``OUT`` alias as that collective defines.
    ``count`` is cut into the sub-algorithm's own pieces when the parent knows its slot size, so
    that no step moves more than a slot, whatever the parent's piece rule. ``keep_final=False``
    drops AVG's division from the sub-collective's steps: a reduction that is not the last of a
    composition must not divide (the engine divides by the parent's world size, once).

    With one slot per ring, every sub-collective (and each of its pieces) starts behind a fence
    on each of its ranks (``Context.no_fuse``):
    fusing the last receive of one with the first send of the next would make a step that waits
    on two sub-collectives at once, and with one slot per ring two ranks doing that towards each
    other deadlock (ring's reduce-scatter then allgather, for one). Without fusion across them,
    sub-collectives that are each deadlock-free, run in the same order on every rank, compose
    deadlock-free.
    The parent reserves the returned scratch itself (``parent.tmp_count``), so that
    sub-collectives on disjoint ranks may share it.
    """
    if count == 0:
        return 0  # a sub-collective of nothing moves nothing: not even the zero-size messages
    base = parent.tmp_count if tmp_base is None else tmp_base
    n = len(ranks)
    piece = count
    if parent.slot_capacity > 0:
        piece = max(1, algorithm.piece_count(parent.slot_capacity, n, options))
    used = 0
    target: Context = parent if keep_final else _NoFinal(parent)
    for off in range(0, count, piece):
        c = min(piece, count - off)
        for rank in ranks:
            parent.no_fuse(rank)

        def shifted(rank: int, region: Region, off: int = off) -> Region:
            # Like the engine's pieces: IN/OUT regions move with the piece, within every block.
            return place(rank, Region(region.buf, region.off + off))

        sub = _SubContext(
            target,
            ranks,
            shifted,
            base,
            kind=kind,
            algorithm=parent.algorithm,
            count=c,
            root=root,
            inplace=inplace,
            block=block or count,
            options=dict(options or {}),
            slot_capacity=parent.slot_capacity,
            nslots=parent.nslots,
        )
        algorithm.build(sub)
        used = max(used, sub.tmp_count)
    return used


class _NoFinal(Context):
    """Forwards steps to ``parent`` with AVG's division removed."""

    def __init__(self, parent: Context) -> None:
        super().__init__(kind=parent.kind, algorithm=parent.algorithm, world_size=parent.world_size, count=0)
        self._parent = parent

    def emit(self, rank: int, step: Step) -> None:
        self._parent.emit(rank, dataclasses.replace(step, final=False) if step.final else step)
