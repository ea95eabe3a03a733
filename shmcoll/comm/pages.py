"""Page-aware choice: whether a call runs the plan for buffers on huge pages, agreed by the ranks.

(The same agreement serves the timed choice, :mod:`shmcoll.comm.timed`, where a rank's vote is
what its timings say instead of what its pages are.)

Cross-memory attach (``cma``) copies about twice as fast from a peer's huge pages as from its
4 KiB pages, and beats the rings by up to 2x from 2 MiB there while it loses to them on 4 KiB
pages (``shm/pages.py``; ``algos/cma.py``: ``huge_from``). Which pages a numpy buffer has is up to
numpy's allocator and the process's history, and each rank sees only its own. So a call shape
whose automatic choice differs by page size (``Call.huge``, made by ``calls.prepare``) decides at
every call, before it starts:

1. each rank looks at the buffers its peers will reach (``Call.reached``: the kernel pins a
   peer's pages, and copies on the caller's side from any): "huge" where at least half of their
   bytes are on huge pages (``shm.pages.huge_share``; remembered per buffer once all of it is
   present, and per call shape for the arrays of its last call, so a loop over the same arrays
   asks the kernel once);
2. it publishes that in its rank record (``layout.R_PAGES``: ``2k + 1`` for huge at its ``k``-th
   such call, ``2k`` for not);
3. a rank whose buffers are not on huge pages runs the other plan at once: the answer cannot be
   "every rank". A rank whose buffers are waits for every peer's word of call ``k`` and runs the
   huge-page plan only where all are ``2k + 1``.

Every rank runs the same plan: a rank that reads ``2k`` from a peer, or a word beyond call ``k``,
runs the other plan, and so did that peer (a peer cannot finish the huge-page plan, whose syncs
wait for every rank, before this rank has decided). That is why the huge-page plan must be one
whose syncs wait for every rank (``cma``, which ``calls.prepare`` alone makes it): a plan that
one rank can finish alone would let it publish its next call's word before a peer read this
one's. So on 4 KiB pages, the common case, no rank
waits for another: the choice costs a look at the buffers and one store. (It was first an
allreduce of one int32 before each call: that synchronised the ranks, and the calls lost the
overlap of one call's end with the next one's start, 3-8% at 2-8 MiB on the 2-core VM.) On huge
pages the ranks wait for each other here instead of at the plan's first sync.

A rank that waits does so as a call's steps do (``engine.cpu.agree_pages``, which publishes its
word and waits in one entry: spin, yield, then sleep on the word's futex, which a publish
wakes), and between time slices checks what
the run loop checks while a call waits: the abort word, lost peers, a peer already in another
call of this number (a mismatch), the deadline. Where the
kernel has no ``PAGEMAP_SCAN`` (before Linux 6.7) no call shape is page-aware and ``auto``
decides as before.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np

from shmcoll.comm import failures
from shmcoll.comm.calls import Bound
from shmcoll.engine import cpu as engine
from shmcoll.errors import ShmcollError
from shmcoll.shm import layout, pages


def _ref(a: Any) -> Any:
    return None if a is None else weakref.ref(a)


def _same(ref: Any, a: Any) -> bool:
    return a is None if ref is None else ref() is a


def local_huge(b: Bound) -> bool:
    """Whether this rank's buffers that its peers reach in the huge-page plan (``Call.reached``)
    are mostly on huge pages: the kernel pins those page by page, while this rank's own side of
    a copy is an ordinary one. True where peers reach none (a scatter's or a gather's non-root);
    False for a call whose engine arrays are made later (copies in scratch for a read-only input)."""
    call, inp, res, _, out, _, x = b
    seen = call.seen
    if seen is not None and _same(seen[0], x) and _same(seen[1], out):
        return seen[2]  # type: ignore[no-any-return]
    if inp is None:
        return False
    reach_in, reach_out = call.reached
    arrays = [a for a, reached in ((inp, reach_in), (res, reach_out)) if reached and a.size]
    if len(arrays) == 2 and res is inp:
        arrays.pop()
    huge = total = 0.0
    settled = True
    for a in arrays:
        share, final = pages.huge_share(a)
        huge += share * a.nbytes
        total += a.nbytes
        settled = settled and final
    on_huge = 2 * huge >= total
    if settled:  # (pages not yet touched are looked at again next time)
        try:
            call.seen = (_ref(x), _ref(out), on_huge)
        except TypeError:  # an array type without weak references
            call.seen = None
    return on_huge


def agreed(rt: Any, b: Bound, limit: float) -> Bound:
    """``b``, or ``b`` with its call shape's huge-page plan where every rank's buffers are on huge
    pages (see the module doc); ``limit``: seconds this rank may wait for its peers."""
    words = rt._pages_words
    if words is None:
        words = rt._pages_words = _words(rt)
    state = rt._state
    k = int(state[engine.S_PAGES_CALLS]) + 1  # (counted in the engine's state: a follower's lean entry counts too)
    state[engine.S_PAGES_CALLS] = k
    call = b[0]
    timed = call.timed
    if timed is None:
        vote = local_huge(b)
    else:
        ctrl = rt._ctrl
        if timed.leader:
            vote = timed.vote()
            if ctrl[words[2]] != vote:  # (stored only where it changes: its peers read the line at every call)
                ctrl[words[2]] = vote
        else:  # (as the leader's times last said: comm.timed)
            vote = ctrl[timed.leader_word] == 1
        if not vote and timed.paged:
            vote = local_huge(b)
    if vote:
        every = _every_peer_huge(rt, b, words[1], k, limit)
    else:
        engine.publish_word(rt._ctrl, words[0][0], 2 * k, words[0][1])
        every = False
    if timed is not None:
        timed.ran(every)
    if every is not call.agreed:
        _changed(rt, call, every)
    return (call.huge, *b[1:]) if every else b


def _changed(rt: Any, call: Any, every: bool) -> None:
    """The ranks agreed on the other plan than at the call shape's last call: log it."""
    call.agreed = every
    timed = call.timed
    chosen = call.huge if every else call
    said = "every rank's buffers are on huge pages" if timed is None else "every rank voted for cma"
    rt._log.info(
        "%s: %s: %s%s: algorithm %s%s",
        call.label,
        "pages" if timed is None else "timed",
        "" if every else "not ",
        said,
        chosen.label.rpartition("algorithm=")[2].rstrip(")"),
        _estimates(timed),
    )


def _estimates(timed: Any) -> str:
    """The leader's estimates of a timed call shape's two plans, for the log."""
    if timed is None or not timed.leader:
        return ""
    own, alt = (e / 1e3 for e in timed.estimate_ns)
    return f" (call {timed.calls}; estimates {own:.1f} us for its own plan, {alt:.1f} for cma)"


def lean(rt: Any, b: Bound, enter: Any, record: np.ndarray) -> tuple[Any, np.ndarray]:
    """The lean path's entry and record (``comm.bind._make_lean``) for a remembered call ``b``
    of a call shape whose ranks agree on their pages or their leader's times. Not for started
    operations: their first run must not wait (``Runtime._start`` leaves such calls to the run
    loop).

    A timed call shape that is not page-aware gets ``enter`` itself, with a record whose entry
    makes the agreement first (``engine.RC_AGREE``) and runs the plan agreed on, the shape's own
    or cma's: a follower's call never leaves compiled code, nor do the leader's, which follow
    its last vote (``AG_MINE``). The leader's entry times one call in ``timed.SAMPLE`` (each of
    a probe's, ``Timed.quiet_calls``) and returns ``SAMPLED``: :func:`sampled` takes the time and
    votes for the next calls. Where the leader's call must go to Python first (its first one
    here, or the one after a timed call that did not end in the entry), the entry returns
    ``VOTE`` and :func:`voted` carries the call on in Python; where a wait for
    the peers' votes for cma outlasts a slice, ``AGREEING`` and :func:`agreeing` does; where
    cma's plan waits past a slice, its status plus ``ON_CMA``, and ``Runtime._wait_or_raise``
    carries cma's plan on. (The leader's vote forced off, a timed shape's 64 KiB reduce at 4 ranks
    on 2 cores took 4.8 us longer than its plan named with the agreement in Python, 5.9 at 256
    KiB; with its followers' in compiled code, 1.8 and 5.1; with every rank's, 0.4 and 0.3: a rank
    a little late at a call's start makes its peers' waits yield and sleep. As built, with the
    leader's votes: 4.3 -> 0.6 and 4.4 -> 1.1. ``benchmarks/RESULTS.md``, stop 52.)

    A shape that is page-aware too is timed so where this rank's buffers are known for good not
    to be on huge pages (its vote is then the leader's alone); any other page-aware shape gets a
    function that agrees, then enters the engine through ``enter``
    with ``record`` or the huge-page plan's, and carries the call to its end itself (it returns
    OK or raises), with the record."""
    call = b[0]
    huge = engine.record_for(call.huge.start, b[1], b[2])
    timed = call.timed
    if timed is not None and (not timed.paged or _settled_small(b)):
        words = rt._pages_words
        if words is None:
            words = rt._pages_words = _words(rt)
        (word, waiters), ctrl = words[0], rt._ctrl
        agree = engine.agreement(ctrl, word, waiters, timed.leader_word, timed.leader, words[1], call.huge.start)
        agreeing = engine.record_for(call.start, b[1], b[2], agree=agree)
        # (what voted and agreeing need; the records and the agreement stay alive with the call shape)
        call.lean_agree = (b, enter, record.ctypes.data, huge.ctypes.data, agree, (record, huge, agreeing))
        return enter, agreeing
    addresses = (record.ctypes.data, huge.ctypes.data)
    leading = timed if timed is not None and timed.leader else None  # (a page-aware shape timed too)

    def run(_address: int) -> int:
        if leading is not None:
            t0 = time.perf_counter_ns()
        chosen = agreed(rt, b, rt._timeout)
        st = enter(addresses[chosen is not b])
        if st != engine.OK:
            rt._wait_or_raise(st, chosen[0], b[1], b[2], rt._timeout)
        if leading is not None:
            leading.took(time.perf_counter_ns() - t0)
        return engine.OK  # type: ignore[no-any-return]

    run.records = (record, huge)  # type: ignore[attr-defined]  # (alive as long as the entry)
    return run, record


def _settled_small(b: Bound) -> bool:
    """Whether the buffers of ``b`` are known for good not to be mostly on huge pages
    (:func:`local_huge`, remembered in ``Call.seen`` once all their pages are present)."""
    seen = b[0].seen
    return not local_huge(b) and seen is not None and _same(seen[0], b[6]) and _same(seen[1], b[4])


def voted(rt: Any, call: Any, limit: float) -> tuple[int, Any, np.ndarray, np.ndarray]:
    """After a timed shape's lean entry returned ``VOTE`` for ``call`` on its leader (see
    :func:`lean`: its first call there, or the call after one it timed that did not end in the
    entry): vote, agree in Python and run the plan agreed on, timed from before the vote to the
    call's end, which this function waits for; then vote for the next calls
    (:func:`_vote_ahead`). Returns (OK, the call shape run, its engine arrays)."""
    b, enter, own, huge, agree, _ = call.lean_agree
    timed = call.timed
    t0 = time.perf_counter_ns()
    # (the calls of the last vote, all made: see _vote_ahead; a call shape remembered again in
    # the middle of them counts them all)
    timed.calls += timed.quiet
    timed.quiet = 0
    chosen = agreed(rt, b, limit)
    st = enter(huge if chosen is not b else own)
    if st != engine.OK:
        rt._wait_or_raise(st, chosen[0], b[1], b[2], limit)
    timed.took(time.perf_counter_ns() - t0)
    _vote_ahead(rt, timed, agree)
    return engine.OK, chosen[0], chosen[1], chosen[2]


def sampled(rt: Any, call: Any) -> None:
    """After a timed shape's lean entry returned ``SAMPLED`` for ``call`` on its leader: the entry
    made and timed the last call of the leader's last vote (``AG_TOOK``, ``AG_RAN``); count
    them, take the time, and vote for the next calls."""
    agree = call.lean_agree[4]
    timed = call.timed
    timed.calls += timed.quiet
    alt = bool(agree[engine.AG_RAN])
    timed.ran(alt)
    timed.took(int(agree[engine.AG_TOOK]))
    if alt is not call.agreed:
        _changed(rt, call, alt)
    _vote_ahead(rt, timed, agree)


def _vote_ahead(rt: Any, timed: Any, agree: np.ndarray) -> None:
    """The leader's vote for its next call, made as its last one ends, and how many calls after
    that one follow it without a vote (``Timed.quiet_calls``); the last of them is timed in the
    entry. The vote counts the next call; :func:`sampled` counts the others.

    Voting after the call rather than before the next keeps the vote's Python out of the calls
    it times: a vote made at a call's start made that call's peers, which had entered, wait for
    the leader, and on the 2-core VM in a slow launch, a 4-rank broadcast of 256 KiB through the
    timed shape's cma took 147-154 us on the leader (median of the calls it timed) where cma
    named took 107-113 a call, and the leader kept going back to the rings (``benchmarks/RESULTS.md``,
    stop 53)."""
    vote = timed.vote()
    word = rt._pages_words[2]
    if rt._ctrl[word] != vote:  # (its peers read the line at every call)
        rt._ctrl[word] = vote
    timed.quiet = agree[engine.AG_SKIP] = timed.quiet_calls()
    agree[engine.AG_MINE] = vote


def agreeing(rt: Any, call: Any, limit: float) -> tuple[int, Any, np.ndarray, np.ndarray]:
    """After a timed shape's lean entry returned ``AGREEING`` for ``call``: its agreement on cma
    (published, call ``k`` in the engine's count) waited a slice for the peers' words; wait on,
    with the run loop's checks, then run the plan agreed on. Returns (its status, the call shape
    run, its engine arrays), which ``Runtime._wait_or_raise`` carries on with."""
    b, enter, own, huge, _, _ = call.lean_agree
    k = int(rt._state[engine.S_PAGES_CALLS])
    every = _every_peer_huge(rt, b, rt._pages_words[1], k, limit)
    return enter(huge if every else own), call.huge if every else call, b[1], b[2]


def _words(rt: Any) -> tuple[tuple[int, int], np.ndarray, int]:
    """(this rank's word and its waiters' word, ``engine.agree_pages``' table: those two, the
    number of peers, then the peers' words, their waiters' words and their ranks; this rank's
    word for its timed votes, ``layout.R_TIMED``)."""
    lay, me = rt._arena.layout, rt._rank
    peers = [p for p in range(rt._world_size) if p != me]
    mine = (lay.rank_word(me, layout.R_PAGES), lay.rank_word(me, layout.R_PAGES_WAITERS))
    table = [
        *mine,
        len(peers),
        *(lay.rank_word(p, layout.R_PAGES) for p in peers),
        *(lay.rank_word(p, layout.R_PAGES_WAITERS) for p in peers),
        *peers,
    ]
    return mine, np.array(table, np.int64), lay.rank_word(me, layout.R_TIMED)


def _every_peer_huge(rt: Any, b: Bound, table: np.ndarray, k: int, limit: float) -> bool:
    """Publish huge pages for call ``k`` and wait for every peer's word of it (or for one that
    says no): True where each says huge pages."""
    ctrl, state = rt._ctrl, rt._state
    start = last = time.monotonic()
    try:
        while True:
            st = engine.agree_pages(ctrl, table, k, state)
            if st == engine.OK:
                return True
            if st == engine.NOT_EVERY:
                return False
            if st == engine.ABORTED:
                failures.fail_aborted(rt, b[0])
            now = time.monotonic()
            if failures.compiling_peer(rt) is not None:
                start += now - last  # a peer compiling kernels is late, not stuck
            last = now
            _check(rt, b, int(state[engine.S_WAIT_PEER]), now - start, limit)
    except ShmcollError:
        raise
    except BaseException as exc:  # KeyboardInterrupt: peers on 4 KiB pages have gone on into the call
        rt._broken = f"rank {rt._rank} was interrupted before {b[0].label} ({type(exc).__name__})"
        rt._arena.abort(rt._rank, layout.ABORT_ERROR, -1, failures.next_seq(rt, b[0]), b[0].sig, 0)
        raise


def _check(rt: Any, b: Bound, peer: int, waited: float, limit: float) -> None:
    """What the run loop checks while a call waits, for a call not yet started that waits for
    ``peer``'s word (``failures`` raises)."""
    call = b[0]
    if rt._arena.word(layout.AB_CODE) != 0:
        failures.fail_aborted(rt, call)
    lost = failures.lost_peer(rt, failures.next_seq(rt, call))
    if lost is not None:
        failures.fail_peer_lost(rt, call, *lost)
    a = rt._arena
    if 0 <= peer < rt._world_size and a.rank_field(peer, layout.R_STATE) == layout.STATE_IN_CALL:
        their_seq = a.rank_field(peer, layout.R_CUR_SEQ)
        # In this call's number without having said its pages for it: another call.
        k = int(rt._state[engine.S_PAGES_CALLS])
        if their_seq == failures.next_seq(rt, call) and a.rank_field(peer, layout.R_PAGES) < 2 * k:
            failures.fail_mismatch_at_entry(rt, call, peer, a.rank_field(peer, layout.R_CUR_SIG))
    if waited > limit:
        failures.fail_timeout(rt, call, limit)
