"""Call shapes: what a call needs that does not change from one call to the next, built once.

A *call shape* is a collective with its dtype, count, op, root, algorithm, in-place mode and
buffer kind. The first call of a shape validates what depends only on the shape (dtype, op,
root, algorithm), chooses the algorithm, builds the plan, verifies it when asked, encodes this
rank's program and sizes the scratch; later calls of the shape find all of it in a dict.

A bound call (:data:`Bound`) is one call: its shape plus the arrays the engine reads and writes
this time, and what the method returns. The blocking, nonblocking and persistent forms of a method differ
only in what they do with it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import numpy as np

from shmcoll import collectives, config
from shmcoll.algos import cma as cma_plans
from shmcoll.algos import registry
from shmcoll.algos.registry import ALGORITHM_NAMES, Query
from shmcoll.algos.select import call_size, choose
from shmcoll.comm import arrays, groups, timed
from shmcoll.engine import cpu as engine
from shmcoll.plan import ir
from shmcoll.plan.passes import plan_call
from shmcoll.plan.verify import verify
from shmcoll.shm import cma, layout, pages
from shmcoll.types import BFLOAT16, BOOL, FLOAT16, ReduceOp, engine_types, identity

log = logging.getLogger("shmcoll")

MAX_CACHED = 512  # call shapes kept per communicator
_UINT16 = np.dtype(np.uint16)
_UINT8 = np.dtype(np.uint8)


class Call:
    """Everything the run loop needs for one call shape.

    The encoded program is kept once per way the engine may enter it (``ir.ENTRY_*``): ``prog``
    starts a call, ``prog_nested`` starts one inside a call made of several (which holds the
    communicator), ``prog_claimed`` starts one whose caller claimed the state already, and
    ``prog_resume`` continues a started call; only the thread that carries the call uses the
    last one (the one that started it, or for a started operation the thread that took it from
    its queue). Each has its table of handles (``engine.cpu.handles_for``), which is what the run
    loop passes to the engine: ``start``, ``nested``, ``claimed`` and ``resume``.

    ``fill`` is set where the plan leaves the result alone but the method defines it: an
    exscan's rank 0, whose result is the op's identity.

    ``huge`` is set where ``auto``'s choice depends on the page size of the ranks' buffers: the
    call shape every rank runs instead when all of them are on huge pages (the ranks agree on it
    before each call: :mod:`shmcoll.comm.pages`), ``reached`` which of this rank's buffers the
    peers reach in that plan (input, output), and ``seen`` what this rank's buffers were at its
    last call. It is also set where the ranks choose by what their calls took instead of by
    their pages (cma as ``huge``, agreed the same way), and then ``timed`` holds this rank's
    timings of both plans and its vote (:class:`shmcoll.comm.timed.Timed`).

    ``engine_dtype`` is what the engine moves and reduces (bool as uint8, float16 and bfloat16 as
    float32 when it reduces, else as uint16); ``widened`` marks a float16 or bfloat16 reduction,
    which runs on float32 copies of the buffers, and ``bfloat16`` the latter, whose copies are
    made by the conversion kernels (numpy cannot cast it); ``no_buffer`` is the empty array the
    engine gets where a rank has no input or output.
    """

    __slots__ = (
        "prog",
        "prog_resume",
        "prog_nested",
        "prog_claimed",
        "start",
        "nested",
        "claimed",
        "resume",
        "engine_dtype",
        "data",
        "tmp",
        "widened",
        "bfloat16",
        "sig",
        "kind",
        "label",
        "no_buffer",
        "count",
        "registered",
        "special",
        "varying",
        "fill",
        "finish",
        "huge",
        "reached",
        "seen",
        "agreed",
        "timed",
        "lean_agree",
    )

    def __init__(
        self,
        prog: np.ndarray,
        engine_dtype: np.dtype,
        data: np.ndarray,
        tmp: np.ndarray,
        widened: bool,
        sig: int,
        kind: str,
        label: str,
        count: int,
        registered: bool,
        ctrl: np.ndarray,
        state: np.ndarray,
        varying: bool = False,
        fill: Any = None,
        bfloat16: bool = False,
    ) -> None:
        self.prog = prog
        self.prog_resume = ir.with_entry(prog, ir.ENTRY_RESUME)
        self.prog_nested = ir.with_entry(prog, ir.ENTRY_NESTED)
        self.prog_claimed = ir.with_entry(prog, ir.ENTRY_CLAIMED)
        self.start = engine.handles_for(self.prog, tmp, data, ctrl, state)
        self.nested = engine.handles_for(self.prog_nested, tmp, data, ctrl, state)
        self.claimed = engine.handles_for(self.prog_claimed, tmp, data, ctrl, state)
        self.resume = engine.handles_for(self.prog_resume, tmp, data, ctrl, state)
        self.engine_dtype = engine_dtype
        self.data = data
        self.tmp = tmp
        self.widened = widened
        self.bfloat16 = bfloat16
        self.sig = sig
        self.kind = kind
        self.label = label
        self.no_buffer = np.empty(0, dtype=engine_dtype)
        self.count = count
        self.registered = registered
        self.special = widened or registered  # its engine arrays are made once it holds the state
        self.varying = varying  # messages are tagged with their block's count (comm.failures.fail_counts)
        self.fill = fill  # exscan's rank 0: the result is the op's identity, written after the call
        self.finish = self.special or fill is not None  # the run loop has work after the engine's
        # Where auto's choice hinges on the pages of the ranks' buffers (comm.pages): the call shape
        # to run instead when every rank's are on huge pages, and what this rank's were last time.
        self.huge: Call | None = None
        self.reached = (True, True)  # which of this rank's buffers the huge plan's peers reach (in, out)
        self.seen: Any = None
        self.agreed: bool | None = None  # what the ranks agreed at the last call (logged when it changes)
        # Where the ranks choose between this plan and ``huge`` by what their calls took instead
        # (comm.timed): this rank's timings and vote.
        self.timed: Any = None
        # A timed shape's lean entry that agrees in compiled code (comm.pages.lean): what its
        # Python side needs (comm.pages.voted, sampled, agreeing).
        self.lean_agree: Any = None


Bound = tuple
"""One call, as the binders make it: ``(call, inp, res, result, out, placement, x)``.

``call`` is the call shape; ``inp``/``res`` the engine's arrays (1-d views in the engine dtype),
or None for a call that makes them only once it holds the state (copies, or a zero-copy
``placement``) from the caller's ``x`` and ``out``; ``out`` also receives a float16 or
bfloat16 reduction's result, copied back from float32; ``result`` is what the method returns.
A plain tuple because one is made per call: it costs a quarter of a slotted object.
"""


def engine_types_for(kind: str, dtype: np.dtype, op: ReduceOp) -> tuple[np.dtype, ReduceOp, bool]:
    """(engine dtype, engine op, widened) for a call of ``kind`` on ``dtype``."""
    if collectives.get(kind).reducing:
        engine_dtype, engine_op = engine_types(dtype, op)
        return engine_dtype, engine_op, dtype in (FLOAT16, BFLOAT16)
    if dtype == BOOL:
        return _UINT8, ReduceOp.SUM, False
    if dtype in (FLOAT16, BFLOAT16):  # moved as bits
        return _UINT16, ReduceOp.SUM, False
    return dtype, ReduceOp.SUM, False


def cma_crossover(rt: Any) -> int:
    """:func:`shm.cma.crossover_bytes` as the ranks of ``rt`` agree on it
    (``Query.cma_crossover``): the launcher's measurement, made before the ranks started, or else
    the first rank's to need it (the others wait for it); their own would differ by noise, and
    every rank of a call must choose alike."""
    if rt._cma_crossover is None:
        rt._cma_crossover = rt._arena.cma_crossover(cma.crossover_bytes, min(rt.timeout, 60.0))
        rt._log.info("cross-memory attach: %s", cma.describe_crossover(rt._cma_crossover))
    return rt._cma_crossover  # type: ignore[no-any-return]


def prepare(
    rt: Any,
    kind: str,
    dtype: np.dtype,
    count: int,
    *,
    op: Any = ReduceOp.SUM,
    algorithm: str = "auto",
    inplace: bool = False,
    root: int = 0,
    registered: bool = False,
    counts: tuple[int, ...] = (),
    matrix: tuple[tuple[int, ...], ...] = (),
) -> Call:
    """Validate a call shape and build, encode and size its plan (``rt``: the runtime).

    ``count`` is what the ranks agree on (the call signature's); a variable-count call's plan
    comes from ``counts`` (or alltoallv's ``matrix``: this rank's row and column, zeros
    elsewhere, which is a whole consistent matrix as far as this rank's program can tell).
    """
    rt._check_usable()
    record = collectives.get(kind)
    arrays.check_dtype(dtype)
    if record.rooted:
        arrays.check_root(root, rt.world_size)
    arrays.check_algorithm(algorithm)
    reduce_op = arrays.check_op(op, dtype) if record.reducing else ReduceOp.SUM
    if record.prefix and reduce_op == ReduceOp.AVG:
        raise ValueError(f"{kind}: op AVG is not a prefix reduction (use SUM and divide by the number of ranks)")
    engine_dtype, engine_op, widened = engine_types_for(kind, dtype, reduce_op)
    plan_count = sum(counts) + sum(map(sum, matrix)) if record.varying else count
    blocks = rt.world_size if record.blocked and not record.varying else 1
    arrays.check_fits(kind, plan_count * blocks * dtype.itemsize, rt._mem_total)
    if widened:
        inplace = False  # float16 and bfloat16 reduce through float32 scratch, never the user's buffers
    query = Query(
        kind,
        rt.world_size,
        count,
        engine_dtype.itemsize,
        root=root,
        inplace=inplace,
        registered=registered,
        cma=not registered and cma.probe()[0],
    )
    lay = rt._arena.layout
    build = functools.partial(
        _build,
        rt,
        record,
        dtype=dtype,
        count=count,
        reduce_op=reduce_op,
        engine_op=engine_op,
        engine_dtype=engine_dtype,
        widened=widened,
        inplace=inplace,
        root=root,
        counts=counts,
        matrix=matrix,
    )
    if record.internal:
        alg = registry.get(kind, "direct")
    else:
        group_size = groups.group_size(rt)
        if algorithm == "auto":
            query = dataclasses.replace(query, cores=os.cpu_count() or 0)
            if query.cma and rt.world_size > 1:
                query = dataclasses.replace(query, cma_crossover=cma_crossover(rt))
        pick = functools.partial(
            choose, slot_bytes=lay.slot_bytes, nslots=lay.nslots, group_size=group_size, logger=rt._log
        )
        if (
            algorithm == "auto"
            and query.cma
            and rt.world_size > 1
            and not record.varying
            and not widened  # (reduced through scratch: the user's pages are not what peers read)
            and pages.can_scan()
        ):
            # Decided for both page sizes; where they differ the ranks agree at every call (comm.pages).
            query, on_huge = dataclasses.replace(query, huge_pages=False), dataclasses.replace(query, huge_pages=True)
            huge_alg = pick(on_huge, algorithm, quiet=True)
            # Only cma as the huge-page plan (the only algorithm that says it wins there): the
            # agreement needs a plan whose syncs wait for every rank. A rank that finds every vote
            # for it runs it at once, and the peers read its word later; with a plan one rank can
            # finish alone (a root sending into the rings), it would go on to its next call and
            # publish that call's word first, and a peer would read that as a no and run the other
            # plan. (Stop 45's measured choice, whose other plan could be direct, did so.)
            if huge_alg.name == "cma" and huge_alg.name != pick(query, algorithm, quiet=True).name:
                pick(on_huge, algorithm, pages=" if every rank's buffers are on huge pages")
                call = build(pick(query, algorithm, pages=" if not"))
                call.huge = build(huge_alg)
                call.reached = cma_plans.reached(kind, rt.rank == root, count, rt.world_size)
                alternative = _timed_alternative(query)
                if alternative is not None and alternative.name == huge_alg.name:
                    # On ordinary pages too, where the leader's times say cma (comm.timed).
                    _time(rt, call, record.rooted, root, huge_alg, " (and by its pages)", paged=True)
                return call
        alg = pick(query, algorithm)
        if algorithm == "auto" and alg.name != "cma" and not record.varying and not widened:
            timed_alg = _timed_alternative(query)
            if timed_alg is not None:
                call = build(alg)
                call.huge = build(timed_alg)
                _time(rt, call, record.rooted, root, timed_alg, "")
                return call
    return build(alg)


_FROM_ROOT = frozenset({"broadcast", "scatter"})
"""Rooted collectives whose timed choice the rank before the root leads, not the root: the root
of a broadcast can leave a call of the rings once its data is in the slots, before its peers have
it, and its first calls of them after cma's find the slots empty. Timed by the root, a 4-rank
broadcast's choice went back and forth every 10-20 calls in the VM's slow launches, at 1.8-2.1x
cma's time at 512 KiB; timed by the rank before it, 1.14-1.26x (``benchmarks/RESULTS.md``, stop
52)."""


def _time(
    rt: Any, call: Call, rooted: bool, root: int, alternative: registry.Algorithm, also: str, paged: bool = False
) -> None:
    """Make ``call`` a timed call shape (its ``huge`` plan built already: ``alternative``'s);
    ``paged``: page-aware too (``Timed.paged``)."""
    leader = root if rooted else 0
    if call.kind in _FROM_ROOT:  # (see _FROM_ROOT)
        leader = (root + rt.world_size - 1) % rt.world_size
    word = rt._arena.layout.rank_word(leader, layout.R_TIMED)
    call.timed = timed.Timed(leader, rt.rank, paged, word)
    rt._log.info(
        "%s: timed choice between it and %s, by what rank %d's calls take%s (comm.timed)",
        call.label,
        alternative.name,
        leader,
        also,
    )


def _timed_alternative(query: Query) -> registry.Algorithm | None:
    """cma, where ``auto`` times it against its own pick at every call of this shape
    (``Algorithm.auto_timed``, :mod:`shmcoll.comm.timed`); None elsewhere. Not with
    ``SHMCOLL_ALGO`` set (the user's choice is fixed), nor where cma cannot serve the call."""
    if query.world_size < 2 or not query.cma or config.get().algo:
        return None
    try:
        alg = registry.get(query.collective, "cma")
    except ValueError:  # (no cma plan for this collective)
        return None
    size = call_size(query)
    if alg.auto_timed is None or size < timed.timed_from(query.collective, query.world_size):
        return None
    if not alg.auto_timed(query, size):
        return None
    # In place is per rank, and every rank must decide alike (as select._candidates).
    flipped = dataclasses.replace(query, inplace=not query.inplace)
    return alg if alg.supports(query) is None and alg.supports(flipped) is None else None


def _build(
    rt: Any,
    record: collectives.Collective,
    alg: registry.Algorithm,
    *,
    dtype: np.dtype,
    count: int,
    reduce_op: ReduceOp,
    engine_op: ReduceOp,
    engine_dtype: np.dtype,
    widened: bool,
    inplace: bool,
    root: int,
    counts: tuple[int, ...],
    matrix: tuple[tuple[int, ...], ...],
) -> Call:
    """The call shape that runs ``alg``: its plan built, verified when asked, encoded and sized."""
    kind = record.name
    lay = rt._arena.layout
    plan_count = sum(counts) + sum(map(sum, matrix)) if record.varying else count
    options: dict[str, object] | None = None
    if alg.name == "hierarchical":
        options = {"group_size": groups.group_size(rt)}
    slot_capacity = lay.slot_bytes // engine_dtype.itemsize
    plan = plan_call(
        alg,
        rt.world_size,
        plan_count,
        slot_capacity,
        root=root,
        inplace=inplace,
        options=options,
        nslots=lay.nslots,
        counts=counts,
        matrix=matrix,
    )
    if rt._verify:
        verify(
            plan,
            world_size=rt.world_size,
            count=plan_count,
            root=root,
            inplace=inplace,
            nslots=lay.nslots,
            counts=counts,
            matrix=matrix,
        )
    sig = ir.pack_sig(kind, alg.code, dtype, int(reduce_op), root, count)
    zero_copy = alg.peers == ir.PEERS_REGISTERED
    prog = ir.encode(plan, rt.rank, lay.channel, int(engine_op), sig, alg.peers)
    tmp = rt._scratch_array("tmp", engine_dtype, plan.tmp_count)
    label = ir.describe_sig(sig, ALGORITHM_NAMES)
    rt._log.info(
        "%s: algorithm %s, %d piece(s) of %d + tail %d, %d scratch elements",
        label,
        alg.name,
        plan.reps,
        plan.piece,
        plan.tail.count,
        plan.tmp_count,
    )
    data = rt._arena.view(engine_dtype)
    fill = None
    if kind == "exscan" and rt.rank == 0:
        fill = identity(reduce_op, dtype)
    return Call(
        prog,
        engine_dtype,
        data,
        tmp,
        widened,
        sig,
        kind,
        label,
        count,
        zero_copy,
        rt._ctrl,
        rt._state,
        varying=record.varying,
        fill=fill,
        bfloat16=widened and dtype == BFLOAT16,
    )
