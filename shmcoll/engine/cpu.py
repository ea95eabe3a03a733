"""The jitted interpreter of an encoded plan: the only code that loops over steps.

``execute(handles, inp, out)`` runs one rank's program for one call: ``inp``/``out`` are the
call's buffers and ``handles`` (:func:`handles_for`) holds the addresses and sizes of what does
not change between calls of one shape: ``prog``, the encoded table (``plan.ir``); ``tmp``, the
call's scratch; ``data``, the whole arena viewed as the call's dtype (messages are addressed
inside it); ``ctrl``, the arena viewed as int64 (control words, message headers); and
``state``, this rank's engine state (below). Taking them as one table instead of five arguments
saves numba's unboxing of four arrays on every call (about 55 ns each); the caller keeps the
arrays alive.

A step first waits until everything it needs is there: an incoming message (RECV) and free
cells for the outgoing one (SEND); only then does it touch memory, so a step either runs
completely or not at all. That makes the engine **resumable**: when a wait has lasted one time
slice (``S_SLICE_NS``) it returns ``WAITING`` with its position saved in ``state``, Python
checks the deadline and the peers' liveness (cheap there, awkward here), and calls ``execute``
again to carry on. Jitted code never raises; it returns a status and leaves details in ``state``.

Waiting, in three stages, because ranks often outnumber cores here:

1. spin with ``pause`` (for ``S_SPIN_CUR``, at most ``S_SPIN_NS``): the hand-off costs ~60 ns
   when the peer runs on another core. The budget adapts: a first ``sched_yield`` that lasted
   more than ``SWITCHED_NS`` and after which what we wait for is there ran the peer on our core,
   where it could not run while we spun, so the budget halves (down to ``MIN_SPIN_NS``); a spin
   that succeeds doubles it back. Two ranks left on one core (another process holding the
   second one) otherwise paid the whole 20 us spin at every hand-off: reduce_scatter at 2
   ranks, 23 us per call against 4.3 us adapted (1 us with a core each). A yield that ran a
   stranger instead changes nothing: yielding more would hand it our share of the core;
2. ``sched_yield`` (``S_YIELDS`` times): when the peer waits for *our* core, spinning would
   stall both until the scheduler's tick, milliseconds per hand-off;
3. sleep on the futex of the awaited counter (``S_SLEEP_NS`` at most per sleep, so the abort
   word and the slice end are still checked). A sleeper announces itself in the channel's
   waiters word first, then re-reads the counter; a publisher stores the counter then reads
   the waiters word, both sequentially consistent, so one of them always sees the other and no
   wake-up is lost. Publishers only make the futex syscall when someone sleeps.

A *trying* run (``S_TRY``, set by :func:`entry_at` for a record made with ``trying=True``)
spins for ``TRY_SPIN_NS`` at most and neither yields nor sleeps: it returns ``WAITING`` at the
first wait that outlasts the spin, as a slice's end does. A started operation's first run is one
(``requests.Queue._admit``): it posts what it can and returns to the caller, and whoever carries
the operation on resumes it. The short spin is for peers that start at the same time: without
it every start of an 8-byte allreduce at 2 ranks found its peer's part not yet there, and paid
a resumption (figures in comm/persistent.py).

Every message carries the call's tag (seq, sig) in its header, checked on receipt: a peer
in a different call is reported as ``MISMATCH`` with its tag, instead of mixing data.

**Starting a call** (the program's header says how it is entered, ``HD_ENTRY``):

- ``ENTRY_START`` claims the state with a compare-and-swap of ``S_ACTIVE`` (0 -> 1): a second
  thread (or a signal handler) entering a call on the same communicator meanwhile gets ``BUSY``,
  before it touches anything, instead of running its steps into the first call's. It also gets
  ``BUSY`` while another thread holds the communicator for a *nested* call
  (``S_NESTED``: object collectives, ``alloc`` and ``split`` are several calls that must not be
  interleaved with anyone else's);
- ``ENTRY_NESTED`` is a start made by the thread that holds ``S_NESTED``;
- ``ENTRY_CLAIMED`` is a start whose caller claimed the state already, with :func:`claim`: a
  call that must write shared scratch or state before it runs (a float16 or bfloat16
  reduction's float32 copies, a read-only input's copy, a zero-copy call's placement) claims
  first, so that an overlapping call can never write into another's buffers;
- ``ENTRY_RESUME`` continues the claimed call. Only the thread that started a call holds the
  resume copy of its program, so no other thread can continue it.

**Peers' regions.** A zero-copy plan (header ``HD_REGISTERED``) names regions on other ranks.
Over ``comm.alloc`` buffers (``PEERS_REGISTERED``) the engine got the whole allocation and places
them with the call's shifts and strides; over ordinary buffers (``PEERS_CMA``) a rank writes its
call's buffer addresses into its rank record when it enters the call, and a copy from a peer's
region is one ``process_vm_readv``, a copy into one a ``process_vm_writev`` (:func:`_peer_copy`);
a refusal either way is ``READ_FAILED``.

A started call then checks the abort word and every peer's liveness word (``shm/liveness``):
a peer the kernel has marked dead fails the call at once (``PEER_DEAD``), even when this rank
would never wait for it.
"""

from __future__ import annotations

import numpy as np
from numba import carray

from shmcoll.jit import NO_REFCOUNTS, jit
from shmcoll.kernels.cpu import combine, copy, narrow_bfloat16, widen_bfloat16
from shmcoll.plan.ir import (
    C_A_BUF,
    C_A_OFF,
    C_B_BUF,
    C_B_OFF,
    C_CH_IN,
    C_CH_OUT,
    C_COUNT,
    C_D_BUF,
    C_D_OFF,
    C_OP,
    C_PEER_IN,
    C_PEER_OUT,
    C_TAG,
    ENTRY_CLAIMED,
    ENTRY_NESTED,
    ENTRY_RESUME,
    FINAL,
    HD_ENTRY,
    HD_NBODY,
    HD_NTAIL,
    HD_OP,
    HD_PIECE,
    HD_REGISTERED,
    HD_REPS,
    HD_SIG,
    NCOLS,
    PEERS_CMA,
    PEERS_REGISTERED,
    RECV,
    RECV_LEFT,
    REDUCE,
    SEND,
    STORE,
)
from shmcoll.shm.atomics import (
    address_as_pointer,
    compare_exchange,
    cpu_pause,
    fetch_add,
    futex_wait,
    futex_wake,
    load_acquire,
    load_seqcst,
    monotonic_ns,
    sched_yield,
    store_release,
    store_seqcst,
    vm_copy,
)
from shmcoll.shm.layout import (
    AB_CODE,
    C_HEAD,
    C_HEAD_WAITERS,
    C_TAIL,
    C_TAIL_SEEN,
    C_TAIL_WAITERS,
    CELL,
    CHANNEL_WORDS,
    R_CUR_SEQ,
    R_CUR_SIG,
    R_CUR_STEP,
    R_DONE_SEQ,
    R_DONE_SIG,
    R_IN_ADDR,
    R_OUT_ADDR,
    R_PID,
    R_STATE,
    R_WAIT_PEER,
    RANK_WORDS,
    SLOT_HEADER_BYTES,
    SLOT_MSG,
    SLOT_PLACE,
    SLOT_SEQ,
    SLOT_SIG,
    STATE_IDLE,
    STATE_IN_CALL,
    WORDS_PER_LINE,
)
from shmcoll.shm.liveness import OWNER_DIED

# Status codes returned by execute.
OK = 0
WAITING = 1
ABORTED = 2
MISMATCH = 3
BUSY = 4  # another thread is in a call on this communicator: nothing was done
PEER_DEAD = 5  # a peer's liveness word says it died (S_ERR_PEER): nothing was done
READ_FAILED = 6  # cross-memory attach could not read or write a peer's buffer (S_ERR_PEER, S_ERR_STEP)
NOT_EVERY = 7  # agree_pages: a rank's buffers are not on huge pages (comm.pages)
VOTE = 8  # entry_at's agreement: a timed call shape's leader has a call to vote on (comm.pages.voted): nothing done
AGREEING = 9  # entry_at's agreement on cma outlasted a wait's slice: Python waits on (comm.pages.agreeing)
SAMPLED = 10  # entry_at made a timed shape's leader's sample call, done (AG_TOOK, AG_RAN): comm.pages.sampled votes
ON_CMA = 16  # entry_at agreed on cma and ran its plan, which did not finish: its status plus this (comm.pages.lean)

# Engine state: one int64 array per communicator, written by Python at set-up and by the engine.
(
    S_RANK,
    S_WORLD,
    S_SEQ,
    S_ACTIVE,
    S_PC,
    S_PIECE,
    S_PHASE,
    S_SPIN_NS,
    S_YIELDS,
    S_SLEEP_NS,
    S_SLICE_NS,
    S_RING_CELLS,
    S_RINGS_BASE,
    S_RING_BYTES,
    S_CHAN_BASE,
    S_RANK_WORD,
    S_NCHANNELS,
    S_WAIT_PEER,
    S_WAIT_STEP,
    S_ERR_PEER,
    S_ERR_SEQ,
    S_ERR_SIG,
    S_ERR_STEP,
    S_IN_SHIFT,
    S_IN_STRIDE,
    S_OUT_SHIFT,
    S_OUT_STRIDE,
    S_PLACE,
    S_ERR_PLACE,
    S_LIVE_BASE,
    S_NESTED,
    S_SPIN_CUR,
    S_TRY,
    S_PAGES_CALLS,  # the communicator's calls whose choice hinged on pages or times (comm.pages: their k)
) = range(34)
STATE_WORDS = 40  # (room for a few more)
MIN_SPIN_NS = 1000  # the least an adapted spin lasts (see the module doc)
SWITCHED_NS = 5000  # a sched_yield longer than this ran another task (one that ran none: < 1 us)
TRY_SPIN_NS = 2000  # the longest a trying run spins at a wait (see the module doc)

_IN, _OUT, _TMP = 0, 1, 2


LATE_COPY_BYTES = 1024
"""A fused send-and-copy step of more bytes than this publishes its message before the copy.

Below it one pass writes both (as ring's allgather always did). Measured at 2 ranks, out-of-place
allgather (one such step per call), engine time per call, alternating launches: at 8-256 B the
two orders were within 0.05 us of each other, no more than two launches of the same code differ
(one pass 0.36-0.39 us at 8 B, the message first 0.39-0.42); at 2 KiB one pass was 0.02-0.04 us
slower, the peer waiting for the copy, and a 64 KiB piece's copy would hold its message back by
microseconds."""


@jit
def _wait(ctrl, spin_word, word, target, waiters, state, peer, row):  # type: ignore[no-untyped-def]
    """Wait until ``ctrl[word] >= target``: spin, then yield, then sleep on the futex.

    The spin polls ``spin_word`` instead where it is another word that reaches ``target`` no
    later than ``word`` does (a message's MSG, before its channel's HEAD)."""
    if load_acquire(ctrl, spin_word) >= target:
        return OK
    # Spin for a bounded *time*, not a count: a pause costs 10 to 150 cycles depending on the
    # CPU, and a spin that outlasts the peer's time slice only keeps the peer off the core.
    trying = state[S_TRY] != 0
    spin_end = monotonic_ns() + (min(state[S_SPIN_CUR], TRY_SPIN_NS) if trying else state[S_SPIN_CUR])
    i = 0
    while True:
        cpu_pause()
        if load_acquire(ctrl, spin_word) >= target:
            if state[S_SPIN_CUR] < state[S_SPIN_NS]:  # the peer runs beside us: spinning pays
                state[S_SPIN_CUR] = min(2 * state[S_SPIN_CUR] + MIN_SPIN_NS, state[S_SPIN_NS])
            return OK
        i += 1
        if (i & 63) == 0:
            if monotonic_ns() >= spin_end:
                break
            if load_acquire(ctrl, AB_CODE) != 0:
                return ABORTED
    if trying:  # a started operation's first run (see entry_at): no yield, no sleep
        state[S_WAIT_PEER] = peer
        state[S_WAIT_STEP] = row
        ctrl[state[S_RANK_WORD] + R_WAIT_PEER] = peer
        return WAITING
    slice_end = monotonic_ns() + state[S_SLICE_NS]
    yields = state[S_YIELDS]
    j = 0
    while True:
        if load_acquire(ctrl, AB_CODE) != 0:
            return ABORTED
        if j < yields:
            before = monotonic_ns()
            sched_yield()
            if j == 0 and monotonic_ns() - before > SWITCHED_NS and load_acquire(ctrl, word) >= target:
                # The peer ran on our core while we yielded: it could not while we spun.
                state[S_SPIN_CUR] = max(state[S_SPIN_CUR] // 2, min(MIN_SPIN_NS, state[S_SPIN_NS]))
            j += 1
        else:
            fetch_add(ctrl, waiters, 1)
            seen = load_seqcst(ctrl, word)
            if seen < target:
                futex_wait(ctrl, word, seen, state[S_SLEEP_NS])
            fetch_add(ctrl, waiters, -1)
        if load_acquire(ctrl, word) >= target:
            return OK
        if monotonic_ns() >= slice_end:
            state[S_WAIT_PEER] = peer
            state[S_WAIT_STEP] = row
            ctrl[state[S_RANK_WORD] + R_WAIT_PEER] = peer
            return WAITING


@jit
def _publish(ctrl, word, value, waiters):  # type: ignore[no-untyped-def]
    # seq_cst store then seq_cst load: pairs with the sleeper's fetch_add + re-read in _wait.
    store_seqcst(ctrl, word, value)
    if load_seqcst(ctrl, waiters) != 0:
        futex_wake(ctrl, word)


@jit
def publish_word(ctrl, word, value, waiters):  # type: ignore[no-untyped-def]
    """Store ``value`` in ``ctrl[word]`` and wake whoever sleeps on it (counted in
    ``ctrl[waiters]``): a rank's word outside the plans (``comm.pages``)."""
    _publish(ctrl, word, value, waiters)


@jit
def agree_pages(ctrl, table, k, state):  # type: ignore[no-untyped-def]
    """A huge-page rank's side of ``comm.pages``' agreement on its ``k``-th page-aware call, in
    one entry (publishing, waiting and reading the words in three steps from Python cost 1.5-2
    us a call more): publish ``2k + 1`` in ``ctrl[table[0]]``, waking ``ctrl[table[1]]``'s
    sleepers, then wait, as a call's steps do (spin, yield, then sleep on the futex), for each of
    the ``m = table[2]`` peers' words ``table[3:3+m]`` (their waiters' words next, then their
    ranks) to reach call ``k``. OK where every peer said huge pages, NOT_EVERY where one did not,
    or WAITING / ABORTED (call again: publishing the same value again is harmless)."""
    m = table[2]
    _publish(ctrl, table[0], 2 * k + 1, table[1])
    for i in range(m):
        st = _wait(ctrl, table[3 + i], table[3 + i], 2 * k, table[3 + m + i], state, table[3 + 2 * m + i], -1)
        if st != OK:
            return st
        if load_acquire(ctrl, table[3 + i]) != 2 * k + 1:
            return NOT_EVERY
    return OK


@jit(**NO_REFCOUNTS)  # (it returns an array to _step, which counts none)
def _pick(which, inp, out, tmp):  # type: ignore[no-untyped-def]
    kind = which & 3
    if kind == _IN:
        return inp
    if kind == _OUT:
        return out
    return tmp


@jit
def _offset(prog, state, which, off, base):  # type: ignore[no-untyped-def]
    """Element offset of a region in the array the engine was given for its buffer kind."""
    kind = which & 3
    if kind == _TMP:
        return off  # scratch is per rank and reused by every piece
    if prog[0, HD_REGISTERED] != PEERS_REGISTERED:
        return off + base  # (a cma plan's peer regions are reached by _peer_copy, not through arrays)
    # Registered buffers: the engine got the whole allocation (every rank's region); place the
    # region in its owner's one.
    owner = (which >> 2) - 1
    if owner < 0:
        owner = state[S_RANK]
    if kind == _IN:
        return off + base + state[S_IN_SHIFT] + owner * state[S_IN_STRIDE]
    return off + base + state[S_OUT_SHIFT] + owner * state[S_OUT_STRIDE]


@jit
def _peer_copy(prog, row, base, mine, moff, item, ctrl, state, write):  # type: ignore[no-untyped-def]
    """A cma plan's copy between our buffer ``mine`` (at element ``moff``) and a peer's region:
    from it (the step's region A, ``process_vm_readv``) or, with ``write``, into it (region D,
    ``process_vm_writev``), at the address the peer published when it entered the call. The
    plan reaches a peer only after a sync that follows the peer's entry, and the peer leaves only
    after a sync that follows the copy."""
    which = prog[row, C_D_BUF] if write else prog[row, C_A_BUF]
    off = prog[row, C_D_OFF] if write else prog[row, C_A_OFF]
    owner = (which >> 2) - 1
    record = state[S_RANK_WORD] + (owner - state[S_RANK]) * RANK_WORDS
    start = ctrl[record + (R_IN_ADDR if (which & 3) == _IN else R_OUT_ADDR)]
    remote = start + (off + base) * item
    local = mine.ctypes.data + moff * item
    if not vm_copy(ctrl[record + R_PID], local, remote, prog[row, C_COUNT] * item, write):
        state[S_ERR_PEER] = owner
        state[S_ERR_STEP] = row
        return READ_FAILED
    return OK


@jit(**NO_REFCOUNTS)
def _late_copy(prog, row, base, inp, out, tmp, state, count):  # type: ignore[no-untyped-def]
    """The local copy of a fused send-and-copy step, after its message (see LATE_COPY_BYTES). A
    function of its own: array variables in :func:`_step` would cost every step reference counts."""
    d_which = prog[row, C_D_BUF]
    a_which = prog[row, C_A_BUF]
    dst = _pick(d_which, inp, out, tmp)
    doff = _offset(prog, state, d_which, prog[row, C_D_OFF], base)
    src = _pick(a_which, inp, out, tmp)
    copy(dst, doff, dst, doff, False, src, _offset(prog, state, a_which, prog[row, C_A_OFF], base), count)


@jit(**NO_REFCOUNTS)
def _step(prog, row, base, inp, out, tmp, data, ctrl, state):  # type: ignore[no-untyped-def]
    flags = prog[row, C_OP]
    count = prog[row, C_COUNT]
    cells = state[S_RING_CELLS]
    item = data.itemsize
    chan_base = state[S_CHAN_BASE]
    tag_seq = state[S_SEQ]
    sig = prog[0, HD_SIG]

    # Channels are rings of cells (shm/layout's module doc): a message takes whole cells, MSG
    # holds its end, and a skip in the cell where it did not fit sends the consumer to the lap's
    # first cell.
    recv = (flags & RECV) != 0
    send = (flags & SEND) != 0
    in_off = 0
    tail_word = 0
    tail_end = 0
    if recv:
        ch = prog[row, C_CH_IN]
        cw = chan_base + ch * CHANNEL_WORDS
        tail_word = cw + C_TAIL
        tail = ctrl[tail_word]  # our own counter: no other process writes it
        ring = state[S_RINGS_BASE] + ch * state[S_RING_BYTES]
        pos = tail % cells
        hdr = (ring + pos * CELL) // 8
        st = _wait(ctrl, hdr + SLOT_MSG, cw + C_HEAD, tail + 1, cw + C_HEAD_WAITERS, state, prog[row, C_PEER_IN], row)
        if st != OK:
            return st
        tail_end = load_acquire(ctrl, hdr + SLOT_MSG)
        if tail_end - tail > cells - pos:  # a skip: the message starts the next lap
            hdr = ring // 8
        expected = prog[row, C_TAG] if prog[row, C_TAG] != 0 else state[S_PLACE]
        if ctrl[hdr + SLOT_SEQ] != tag_seq or ctrl[hdr + SLOT_SIG] != sig or ctrl[hdr + SLOT_PLACE] != expected:
            state[S_ERR_PEER] = prog[row, C_PEER_IN]
            state[S_ERR_SEQ] = ctrl[hdr + SLOT_SEQ]
            state[S_ERR_SIG] = ctrl[hdr + SLOT_SIG]
            state[S_ERR_PLACE] = ctrl[hdr + SLOT_PLACE]
            state[S_ERR_STEP] = row
            return MISMATCH
        in_off = (hdr * 8 + SLOT_HEADER_BYTES) // item
    out_off = 0
    late = 0  # elements of a fused local copy made after the send's publication
    head_word = 0
    head = 0
    head_end = 0
    out_hdr = 0
    head_hdr = 0
    next_hdr = 0
    if send:
        ch = prog[row, C_CH_OUT]
        cw = chan_base + ch * CHANNEL_WORDS
        head_word = cw + C_HEAD
        head = ctrl[head_word]
        out_ring = state[S_RINGS_BASE] + ch * state[S_RING_BYTES]
        pos = head % cells
        head_hdr = (out_ring + pos * CELL) // 8
        out_hdr = head_hdr
        need = (SLOT_HEADER_BYTES + count * item + CELL - 1) // CELL
        if need > cells - pos:  # does not fit before the ring's end: the next lap's first cell
            out_hdr = out_ring // 8
            head_end = head + cells - pos + need
        else:
            head_end = head + need
        next_hdr = (out_ring + (head_end % cells) * CELL) // 8
        # The cells up to and including the one at head_end (the next header's) must be free.
        if ctrl[cw + C_TAIL_SEEN] < head_end + 1 - cells:  # full as last seen: read the consumer's TAIL
            st = _wait(
                ctrl,
                cw + C_TAIL,
                cw + C_TAIL,
                head_end + 1 - cells,
                cw + C_TAIL_WAITERS,
                state,
                prog[row, C_PEER_OUT],
                row,
            )
            if st != OK:
                return st
            ctrl[cw + C_TAIL_SEEN] = load_acquire(ctrl, cw + C_TAIL)
        out_off = (out_hdr * 8 + SLOT_HEADER_BYTES) // item

    if count > 0:
        store = (flags & STORE) != 0
        d_which = prog[row, C_D_BUF]
        dst = _pick(d_which, inp, out, tmp)
        doff = _offset(prog, state, d_which, prog[row, C_D_OFF], base)
        a_which = prog[row, C_A_BUF]
        x = _pick(a_which, inp, out, tmp)
        xoff = _offset(prog, state, a_which, prog[row, C_A_OFF], base)
        if (flags & REDUCE) != 0:
            b_which = prog[row, C_B_BUF]
            y = _pick(b_which, inp, out, tmp)
            yoff = _offset(prog, state, b_which, prog[row, C_B_OFF], base)
            if recv:
                if (flags & RECV_LEFT) != 0:
                    x = data
                    xoff = in_off
                else:
                    y = data
                    yoff = in_off
            divisor = state[S_WORLD] if (flags & FINAL) != 0 else 0
            op = prog[0, HD_OP]
            if send:
                combine(data, out_off, dst, doff, store, x, xoff, y, yoff, count, op, divisor)
            else:
                combine(dst, doff, dst, doff, False, x, xoff, y, yoff, count, op, divisor)
        else:
            if recv:
                x = data
                xoff = in_off
            if send and store and not recv and count * item > LATE_COPY_BYTES:
                # A send fused with a local copy of what it sends (plan.passes): from
                # LATE_COPY_BYTES the message first, published before the copy, so that the copy
                # does not delay the peer; below, one pass writes both.
                copy(data, out_off, dst, doff, False, x, xoff, count)
                late = count
            elif send:
                copy(data, out_off, dst, doff, store, x, xoff, count)
            # (region codes from 4 on name a peer's buffer: ir.Region.code; -1 is no region, as
            # a received message's step has for ``a``)
            elif a_which >= 4 and prog[0, HD_REGISTERED] == PEERS_CMA:
                st = _peer_copy(prog, row, base, dst, doff, item, ctrl, state, False)
                if st != OK:
                    return st
            elif d_which >= 4 and prog[0, HD_REGISTERED] == PEERS_CMA:
                st = _peer_copy(prog, row, base, x, xoff, item, ctrl, state, True)
                if st != OK:
                    return st
            elif store:
                copy(dst, doff, dst, doff, False, x, xoff, count)

    if send:
        ctrl[out_hdr + SLOT_SEQ] = tag_seq
        ctrl[out_hdr + SLOT_SIG] = sig
        ctrl[out_hdr + SLOT_PLACE] = prog[row, C_TAG] if prog[row, C_TAG] != 0 else state[S_PLACE]
        # The next message's header cell reads "not yet" before this one is published, so the
        # consumer never takes an earlier lap's payload there for a header.
        ctrl[next_hdr + SLOT_MSG] = 0
        store_release(ctrl, out_hdr + SLOT_MSG, head_end)
        if out_hdr != head_hdr:  # the skip, stored after the message
            store_release(ctrl, head_hdr + SLOT_MSG, head_end)
        cw = chan_base + prog[row, C_CH_OUT] * CHANNEL_WORDS
        _publish(ctrl, head_word, head_end, cw + C_HEAD_WAITERS)
        if late > 0:
            _late_copy(prog, row, base, inp, out, tmp, state, late)
    if recv:
        cw = chan_base + prog[row, C_CH_IN] * CHANNEL_WORDS
        _publish(ctrl, tail_word, tail_end, cw + C_TAIL_WAITERS)
    return OK


@jit
def _peers_alive(ctrl, state):  # type: ignore[no-untyped-def]
    """-1 if no peer of this call is marked dead by the kernel, else the first dead one."""
    live = state[S_LIVE_BASE]
    for peer in range(state[S_WORLD]):
        if (load_acquire(ctrl, live + peer * WORDS_PER_LINE) & OWNER_DIED) != 0:
            return peer
    return -1


_WORDS = np.int64  # (the scalar type of control words, for address_as_pointer)

# The table of fixed arrays (see the module docstring): address and element count of each.
(H_PROG, H_PROG_ROWS, H_TMP, H_TMP_LEN, H_DATA, H_DATA_LEN, H_CTRL, H_CTRL_LEN, H_STATE, H_STATE_LEN) = range(10)
HANDLE_WORDS = 10


def handles_for(prog, tmp, data, ctrl, state):  # type: ignore[no-untyped-def]
    """The table :func:`execute` takes for these arrays (which the caller must keep alive)."""
    h = np.zeros(HANDLE_WORDS, np.int64)
    for i, a in ((H_PROG, prog), (H_TMP, tmp), (H_DATA, data), (H_CTRL, ctrl), (H_STATE, state)):
        h[i] = a.ctypes.data
        h[i + 1] = a.shape[0]
    return h


@jit
def execute(handles, inp, out):  # type: ignore[no-untyped-def]
    """Start (or resume, per the program's ``HD_ENTRY``) this rank's program for one call; returns
    a status code."""
    prog = carray(address_as_pointer(handles[H_PROG], handles), (handles[H_PROG_ROWS], NCOLS))
    tmp = carray(address_as_pointer(handles[H_TMP], inp), handles[H_TMP_LEN])
    data = carray(address_as_pointer(handles[H_DATA], inp), handles[H_DATA_LEN])
    ctrl = carray(address_as_pointer(handles[H_CTRL], handles), handles[H_CTRL_LEN])
    state = carray(address_as_pointer(handles[H_STATE], handles), handles[H_STATE_LEN])
    return _execute(prog, inp, out, tmp, data, ctrl, state)


# The record :func:`entry_at`'s entry points take: the address of the call's handles, then its
# buffers', whether the run only tries (RC_TRY: 1 sets S_TRY for the run), and the address of
# an agreement to make first (RC_AGREE: 0 for none).
(RC_HANDLES, RC_INP, RC_INP_LEN, RC_OUT, RC_OUT_LEN, RC_TRY, RC_AGREE) = range(7)
RECORD_WORDS = 7

# A rank's side of a timed call shape's agreement (comm.pages.lean), which its record's entry
# makes before the call: the control words' address and number, this rank's agreement word and
# its waiters' word, the word where the shape's leader writes its vote (layout.R_TIMED);
# agree_pages' table of words (AG_TABLE, AG_TABLE_LEN) and the address of cma's handles (AG_CMA),
# for the calls that agree on cma. On the leader: its last vote, which its calls in compiled code
# follow (AG_MINE); how many calls it makes before the next one it times (AG_SKIP: 0, the next is
# timed; SKIP_VOTE, its next call goes to Python first; SKIP_FOLLOWER on the others); and what
# the call it timed took and ran (AG_TOOK in ns, AG_RAN: 1 for cma).
(
    AG_CTRL,
    AG_CTRL_LEN,
    AG_WORD,
    AG_WAITERS,
    AG_VOTE,
    AG_SKIP,
    AG_MINE,
    AG_TABLE,
    AG_TABLE_LEN,
    AG_CMA,
    AG_TOOK,
    AG_RAN,
) = range(12)
AGREE_WORDS = 12
SKIP_FOLLOWER = -1
SKIP_VOTE = -2


def record_for(handles, inp, out, *, trying: bool = False, agree=None):  # type: ignore[no-untyped-def]
    """The record :func:`entry_at`'s entry points take for these arrays (which the caller must keep alive).

    ``trying``: the run returns ``WAITING`` at the first wait that outlasts ``TRY_SPIN_NS`` of
    spinning, instead of yielding or sleeping (a started operation's first run:
    ``requests.Queue._admit``). ``agree``: an :func:`agreement` the entry makes first (the
    caller keeps it alive too)."""
    r = np.zeros(RECORD_WORDS, np.int64)
    r[RC_HANDLES] = handles.ctypes.data
    r[RC_INP], r[RC_INP_LEN] = inp.ctypes.data, inp.shape[0]
    r[RC_OUT], r[RC_OUT_LEN] = out.ctypes.data, out.shape[0]
    r[RC_TRY] = int(trying)
    r[RC_AGREE] = 0 if agree is None else agree.ctypes.data
    return r


def agreement(ctrl, word, waiters, vote, leader, table, cma):  # type: ignore[no-untyped-def]
    """The words of a rank's agreement for :func:`record_for` (``AG_*``): ``ctrl`` the control
    words, ``word`` and ``waiters`` this rank's agreement word and its waiters' word, ``vote``
    the leader's vote word; ``leader``: this rank leads (its first call goes to Python);
    ``table``: :func:`agree_pages`' words; ``cma``: the handles of the plan every rank runs
    where every rank votes for it (the caller keeps both alive)."""
    a = np.zeros(AGREE_WORDS, np.int64)
    a[AG_CTRL], a[AG_CTRL_LEN] = ctrl.ctypes.data, ctrl.shape[0]
    a[AG_WORD], a[AG_WAITERS], a[AG_VOTE] = word, waiters, vote
    a[AG_SKIP] = SKIP_VOTE if leader else SKIP_FOLLOWER
    a[AG_TABLE], a[AG_TABLE_LEN] = table.ctypes.data, table.shape[0]
    a[AG_CMA] = cma.ctypes.data
    return a


@jit
def _agree(ag, state):  # type: ignore[no-untyped-def]
    """A rank's agreement ``ag`` on a timed call shape's next call (``RC_AGREE``), in the entry,
    as ``comm.pages.agreed`` makes it (its ``k``-th such call: ``2k`` for "not cma", ``2k + 1``
    for "cma"). On the leader at ``SKIP_VOTE``: VOTE, nothing done (``comm.pages.voted`` makes
    the call in Python). Else the vote is the leader's word (its own last one, ``AG_MINE``, on
    the leader): "not cma" is published and OK returned (run the shape's own plan); "cma" is
    published and every peer's word of call ``k`` waited for (:func:`agree_pages`): ON_CMA where
    each said cma (run cma's plan), OK where one did not, AGREEING where the wait outlasted a
    slice or the call was aborted (Python waits on, with the run loop's checks). Python's
    agreement and this one count the calls in the same word (``S_PAGES_CALLS``)."""
    ctrl = carray(address_as_pointer(ag[AG_CTRL], _WORDS), ag[AG_CTRL_LEN])
    skip = ag[AG_SKIP]
    if skip == SKIP_VOTE:
        return VOTE
    if skip >= 0:
        # (a call timed here that does not end in this entry sends the leader's next call to Python)
        ag[AG_SKIP] = skip - 1 if skip > 0 else SKIP_VOTE
        vote = ag[AG_MINE]
    else:
        vote = load_acquire(ctrl, ag[AG_VOTE])
    k = state[S_PAGES_CALLS] + 1
    state[S_PAGES_CALLS] = k
    if vote != 1:
        _publish(ctrl, ag[AG_WORD], 2 * k, ag[AG_WAITERS])
        return OK
    st = agree_pages(ctrl, carray(address_as_pointer(ag[AG_TABLE], _WORDS), ag[AG_TABLE_LEN]), k, state)
    if st == OK:
        return ON_CMA
    if st == NOT_EVERY:
        return OK
    return AGREEING


@jit
def _agreed_call(agreement, handles, inp, out):  # type: ignore[no-untyped-def]
    """A timed shape's call from :func:`entry_at`: the agreement (:func:`_agree`), then the plan
    agreed on; on the leader, where ``AG_SKIP`` says so, timed (``SAMPLED`` where it ends here:
    ``comm.pages.sampled`` counts it and votes for the next calls)."""
    ag = carray(address_as_pointer(agreement, _WORDS), AGREE_WORDS)
    timing = ag[AG_SKIP] == 0
    t0 = monotonic_ns() if timing else 0
    st = _agree(ag, carray(address_as_pointer(handles[H_STATE], _WORDS), handles[H_STATE_LEN]))
    ran = st == ON_CMA
    if ran:
        st = execute(carray(address_as_pointer(ag[AG_CMA], _WORDS), HANDLE_WORDS), inp, out)
    elif st == OK:
        st = execute(handles, inp, out)
    else:
        return st
    if st != OK:
        return ON_CMA + st if ran else st
    if timing:
        ag[AG_TOOK] = monotonic_ns() - t0
        ag[AG_RAN] = 1 if ran else 0
        return SAMPLED
    return OK


def entry_at(dtype):  # type: ignore[no-untyped-def]
    """The compiled entry point of :func:`execute` for a call whose buffers are fixed, for engine
    dtype ``dtype`` (compiled, or loaded from the cache, on first use), or None where numba does
    not expose one; call it as ``entry(record.ctypes.data)`` with the :func:`record_for` words.

    One plain int instead of three arrays: it skips numba's dispatch and the unboxing of the
    arrays, and every array inside is a view without a reference count (numba's reference
    counting of the caller's arrays, atomic increments at every inner call, was half of the
    engine's own time for a small call). The dtype is a constant of each dtype's own function
    rather than a second argument (which cost 23 ns of each call to unbox); numba's cache keys a
    closure on the values it closes over, and the name keeps each dtype's cache files apart.
    """
    from numba import types

    scalar = dtype.type

    def execute_at(record):  # type: ignore[no-untyped-def]
        rec = carray(address_as_pointer(record, _WORDS), RECORD_WORDS)
        handles = carray(address_as_pointer(rec[RC_HANDLES], _WORDS), HANDLE_WORDS)
        inp = carray(address_as_pointer(rec[RC_INP], scalar), rec[RC_INP_LEN])
        out = carray(address_as_pointer(rec[RC_OUT], scalar), rec[RC_OUT_LEN])
        if rec[RC_AGREE] != 0:
            return _agreed_call(rec[RC_AGREE], handles, inp, out)
        if rec[RC_TRY] == 0:
            return execute(handles, inp, out)
        state = carray(address_as_pointer(handles[H_STATE], _WORDS), handles[H_STATE_LEN])
        state[S_TRY] = 1
        st = execute(handles, inp, out)
        state[S_TRY] = 0
        return st

    execute_at.__name__ = execute_at.__qualname__ = f"execute_at_{dtype.name}"
    dispatcher = jit(execute_at)
    dispatcher.payload = dtype.name  # what its compile is for (shmcoll.jit's announcement)
    entry = dispatcher.compile((types.int64,))
    return entry if callable(entry) else None


@jit(**NO_REFCOUNTS)
def _execute(prog, inp, out, tmp, data, ctrl, state):  # type: ignore[no-untyped-def]
    rank_word = state[S_RANK_WORD]
    entry = prog[0, HD_ENTRY]
    if entry != ENTRY_RESUME:
        if entry != ENTRY_CLAIMED:
            if compare_exchange(state, S_ACTIVE, 0, 1) != 0:
                return BUSY
            if entry != ENTRY_NESTED and load_seqcst(state, S_NESTED) != 0:
                store_release(state, S_ACTIVE, 0)
                return BUSY
        if load_acquire(ctrl, AB_CODE) != 0:
            store_release(state, S_ACTIVE, 0)
            return ABORTED
        dead = _peers_alive(ctrl, state)
        if dead >= 0:
            state[S_ERR_PEER] = dead
            store_release(state, S_ACTIVE, 0)
            return PEER_DEAD
        if prog[0, HD_REGISTERED] == PEERS_CMA:  # where peers read this call's buffers from
            ctrl[rank_word + R_IN_ADDR] = inp.ctypes.data
            ctrl[rank_word + R_OUT_ADDR] = out.ctypes.data
        state[S_SEQ] += 1
        state[S_PC] = 0
        state[S_PIECE] = 0
        state[S_PHASE] = 0
        ctrl[rank_word + R_CUR_SIG] = prog[0, HD_SIG]
        ctrl[rank_word + R_CUR_SEQ] = state[S_SEQ]
        store_release(ctrl, rank_word + R_STATE, STATE_IN_CALL)

    nbody = prog[0, HD_NBODY]
    reps = prog[0, HD_REPS]
    piece = prog[0, HD_PIECE]
    while True:
        if state[S_PHASE] == 0:
            if state[S_PIECE] >= reps:
                state[S_PHASE] = 1
                state[S_PC] = 0
                continue
            base = state[S_PIECE] * piece
            first = 1
            nrows = nbody
        else:
            base = reps * piece
            first = 1 + nbody
            nrows = prog[0, HD_NTAIL]
        pc = state[S_PC]
        while pc < nrows:
            st = _step(prog, first + pc, base, inp, out, tmp, data, ctrl, state)
            if st != OK:
                state[S_PC] = pc
                ctrl[rank_word + R_CUR_STEP] = first + pc
                return st
            pc += 1
        if state[S_PHASE] == 0:
            state[S_PIECE] += 1
            state[S_PC] = 0
        else:
            break

    ctrl[rank_word + R_DONE_SIG] = prog[0, HD_SIG]
    ctrl[rank_word + R_DONE_SEQ] = state[S_SEQ]
    store_release(ctrl, rank_word + R_STATE, STATE_IDLE)
    store_release(state, S_ACTIVE, 0)
    return OK


@jit
def claim(state, nested):  # type: ignore[no-untyped-def]
    """Claim the state for a call started with ``ENTRY_CLAIMED``: OK, or BUSY if another call is
    under way or (unless ``nested``) another thread holds the communicator for a nested call."""
    if compare_exchange(state, S_ACTIVE, 0, 1) != 0:
        return BUSY
    if nested == 0 and load_seqcst(state, S_NESTED) != 0:
        store_release(state, S_ACTIVE, 0)
        return BUSY
    return OK


@jit
def release(state):  # type: ignore[no-untyped-def]
    """Give back a claim that no call used (the call failed before it started)."""
    store_release(state, S_ACTIVE, 0)


def new_state(layout, rank: int, *, spin_ns: int, yields: int, sleep_ns: int, slice_ns: int):  # type: ignore[no-untyped-def]
    """A fresh engine state for ``rank`` of an arena with this ``layout``."""
    state = np.zeros(STATE_WORDS, dtype=np.int64)
    state[S_RANK] = rank
    state[S_WORLD] = layout.world_size
    state[S_SPIN_NS] = spin_ns
    state[S_SPIN_CUR] = spin_ns
    state[S_YIELDS] = yields
    state[S_SLEEP_NS] = sleep_ns
    state[S_SLICE_NS] = slice_ns
    state[S_RING_CELLS] = layout.ring_cells
    state[S_RINGS_BASE] = layout.rings_base
    state[S_RING_BYTES] = layout.ring_bytes
    state[S_CHAN_BASE] = layout.channels_base_word
    state[S_RANK_WORD] = layout.rank_word(max(rank, 0), 0)
    state[S_NCHANNELS] = layout.nchannels
    state[S_LIVE_BASE] = layout.live_base_word
    return state


def warm(dtypes) -> None:  # type: ignore[no-untyped-def]
    """Compile (or load from the cache) the engine for each engine dtype, before ranks start,
    the bfloat16 conversions that a bfloat16 reduction runs around it (a read-only input is its
    own signature), and the page-aware calls' publish and wait (``comm.pages``)."""
    from numba import types
    from numba.np.numpy_support import from_dtype

    words = types.Array(types.int64, 1, "C")
    for dt in dtypes:
        arr = types.Array(from_dtype(dt), 1, "C")
        execute.compile((words, arr, arr))
    u16, u32, i64 = types.Array(types.uint16, 1, "C"), types.Array(types.uint32, 1, "C"), types.int64
    publish_word.compile((words, i64, i64, i64))  # (comm.pages)
    agree_pages.compile((words, words, i64, words))
    for src in (u16, u16.copy(readonly=True)):
        widen_bfloat16.compile((u32, i64, src, i64, i64))
    narrow_bfloat16.compile((u16, i64, u32, i64, i64))
