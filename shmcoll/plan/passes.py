"""Plan passes: cut a call into pieces, and fuse a receive with the send that forwards it.

**Segmenting.** A builder writes the programs for a count whose every step fits one slot; the
call's count is cut into ``reps`` full pieces handled by one *body* plan, run once per piece by
the engine with a moving base offset, plus a *tail* plan for the remainder. Each piece is a
complete collective on its sub-range, so ranks may be one piece apart with no ordering hazard,
and the plan (and its verification) costs the same for 8 bytes as for 8 GiB.

**Fusing.** ``recv -> R`` immediately followed by ``send R`` becomes one step that reads the
incoming slot once and writes both the outgoing slot and ``R`` (dropping ``R`` when it is scratch
that nothing reads later). That is the recv-reduce-send of ring and tree pipelines: without it,
every forwarded segment would be re-read from memory. A fused step needs an incoming message and
a free outgoing slot *at once*, so in a cycle of ranks where every ring is full (one slot per
ring) fused steps can wait on each other forever; builders break such cycles with
``ctx.no_fuse(rank)``, a fence this pass respects and then removes.

``send R`` immediately followed by a local copy of the same ``R`` (``R -> D``) becomes one step
too, which writes the outgoing slot and ``D`` in one pass over ``R``: an out-of-place allgather
or broadcast sends its input and copies it into its own block of the result. A step costs the
engine its own dispatch and checks (tens of nanoseconds, a tenth of a small call's hand-off), and
the fused step reads ``R`` once. It waits for nothing the send alone did not (a free outgoing
slot), so it adds no wait to a cycle.
"""

from __future__ import annotations

import dataclasses

from shmcoll.plan.algorithm import AlgorithmLike as Algorithm
from shmcoll.plan.builder import Context
from shmcoll.plan.ir import Buf, CallPlan, Plan, Program, Region, Step


def _overlaps(a: Region | None, b: Region, count: int, a_count: int) -> bool:
    return a is not None and a.buf == b.buf and a.off < b.off + count and b.off < a.off + a_count


def _read_later(program: Program, start: int, region: Region, count: int) -> bool:
    for step in program[start:]:
        if _overlaps(step.a, region, count, step.count) or _overlaps(step.b, region, count, step.count):
            return True
    return False


def _send_then_copy(s: Step, t: Step) -> bool:
    """``s`` sends this rank's ``R`` and nothing else, and ``t`` copies that same ``R`` here."""
    return (
        s.send is not None
        and s.recv is None
        and s.dst is None
        and not s.reduce
        and s.count > 0
        and s.a is not None
        and s.a.rank is None
        and t.recv is None
        and t.send is None
        and not t.reduce
        and not t.fence
        and t.dst is not None
        and t.dst.rank is None
        and t.a == s.a
        and t.count == s.count
    )


def fuse(plan: Plan) -> Plan:
    """Fuse every ``recv -> R; send R`` and ``send R; R -> D`` pair of consecutive steps (see the
    module docstring)."""
    fused_programs = []
    for program in plan.programs:
        out: Program = []
        i = 0
        while i < len(program):
            s = program[i]
            t = program[i + 1] if i + 1 < len(program) else None
            if (
                t is not None
                and s.recv is not None
                and s.send is None
                and s.dst is not None
                and s.count > 0
                and t.recv is None
                and t.send is not None
                and not t.reduce
                and t.a == s.dst
                and t.count == s.count
                and t.tag == s.tag
            ):
                keep = s.dst.buf != Buf.TMP or _read_later(program, i + 2, s.dst, s.count)
                out.append(dataclasses.replace(s, send=t.send, dst=s.dst if keep else None))
                i += 2
                continue
            if t is not None and _send_then_copy(s, t):
                out.append(dataclasses.replace(s, dst=t.dst))
                i += 2
                continue
            if not s.fence:
                out.append(s)
            i += 1
        fused_programs.append(out)
    return dataclasses.replace(plan, programs=fused_programs)


def build_piece(
    algorithm: Algorithm,
    world_size: int,
    count: int,
    *,
    block: int,
    root: int = 0,
    inplace: bool = False,
    options: dict[str, object] | None = None,
    collective: str | None = None,
    slot_capacity: int = 0,
    nslots: int = 1,
    counts: tuple[int, ...] = (),
    matrix: tuple[tuple[int, ...] | None, ...] = (),
) -> Plan:
    """Run ``algorithm``'s builder for one piece of ``count`` elements per block, then fuse."""
    ctx = Context(
        kind=collective or algorithm.collective,
        algorithm=algorithm.name,
        world_size=world_size,
        count=count,
        root=root,
        inplace=inplace,
        block=block,
        options=dict(options or {}),
        slot_capacity=slot_capacity,
        nslots=nslots,
        counts=counts,
        matrix=matrix,
    )
    algorithm.build(ctx)
    return fuse(ctx.plan())


def plan_call(
    algorithm: Algorithm,
    world_size: int,
    count: int,
    slot_capacity: int,
    *,
    root: int = 0,
    inplace: bool = False,
    options: dict[str, object] | None = None,
    nslots: int = 1,
    counts: tuple[int, ...] = (),
    matrix: tuple[tuple[int, ...] | None, ...] = (),
) -> CallPlan:
    """The whole call: body pieces of at most one slot-load per step, then the tail.

    ``nslots`` is the number of slots per ring the plan will run with; plans for one slot keep
    some forwards apart (see ``Context.no_fuse``), so such a plan is correct for any number.
    """
    slot_capacity = max(1, slot_capacity)
    piece = max(1, algorithm.piece_count(slot_capacity, world_size, options))
    kw = dict(
        root=root,
        inplace=inplace,
        options=options,
        block=count,
        slot_capacity=slot_capacity,
        nslots=nslots,
        counts=counts,
        matrix=matrix,
    )
    if counts or matrix:
        # Variable counts: the builder cuts messages into slot-sized ones itself (pieces assume
        # every block has the same length), so the whole call is one tail plan.
        tail = build_piece(algorithm, world_size, count, **kw)  # type: ignore[arg-type]
        return CallPlan(body=None, tail=tail, reps=0, piece=max(count, 1))
    if count <= piece:
        return CallPlan(body=None, tail=build_piece(algorithm, world_size, count, **kw), reps=0, piece=piece)  # type: ignore[arg-type]
    reps = (count - 1) // piece  # the tail is never empty: it is a full piece when count divides
    body = build_piece(algorithm, world_size, piece, **kw)  # type: ignore[arg-type]
    tail = build_piece(algorithm, world_size, count - reps * piece, **kw)  # type: ignore[arg-type]
    return CallPlan(body=body, tail=tail, reps=reps, piece=piece)


def channel_skeleton(plan: Plan) -> list[list[tuple[str, int, int]]]:
    """Each rank's message events in order, ``("recv"|"send", peer, count)``, fusion undone.

    Whether a rank's buffers alias (in place) may change its local steps, never this: ranks
    choose in place independently, so their message patterns must not depend on it.
    """
    skeletons = []
    for program in plan.programs:
        events = []
        for s in program:
            if s.recv is not None:
                events.append(("recv", s.recv, s.count))
            if s.send is not None:
                events.append(("send", s.send, s.count))
        skeletons.append(events)
    return skeletons
