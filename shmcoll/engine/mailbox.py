"""Point-to-point messages through the arena's mailboxes: the jitted half of ``comm.p2p``.

A message from ``src`` to ``dst`` travels in mailbox ``src -> dst`` (``shm/layout``) as
``max(1, ceil(nbytes / SLOT_BYTES))`` fragments, each in one slot whose header repeats the
message's id (counting per mailbox from 1), tag, size and dtype code, so the receiver learns
what a message is from its first fragment and can decide where it goes (a posted receive's
buffer, or a buffer of its own for an unexpected message) before it copies anything.

None of these functions waits: :func:`push` sends the fragments that fit in free slots,
:func:`peek` reads the header at the head of a mailbox, :func:`pull` copies the fragments that
have arrived; each returns how far it got, and the Python side (``comm.p2p``), which owns the
matching, calls them again. Whoever fills a rank's mailboxes or frees slots in mailboxes a rank
fills rings that rank's **doorbell** (a counter; :func:`ring` wakes a sleeper with the futex,
only when one sleeps), and a rank with nothing to do sleeps on its own doorbell
(:func:`sleep_on_doorbell`), so one word covers every mailbox it waits on.

``geo`` is the communicator's geometry, fixed at connect time (:func:`geometry`).
"""

from __future__ import annotations

import numpy as np
from numba import carray

from shmcoll.jit import jit
from shmcoll.kernels.cpu import copy
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
)
from shmcoll.shm.layout import (
    C_HEAD,
    C_TAIL,
    D_DOORBELL,
    D_WAITERS,
    M_DTYPE,
    M_ID,
    M_NBYTES,
    M_TAG,
    MAILBOX_WORDS,
    SLOT_HEADER_BYTES,
    WORDS_PER_LINE,
)

# Geometry words.
(G_RANK, G_WORLD, G_MAIL_BASE, G_DOORBELL_BASE, G_SLOTS_BASE, G_RING_BYTES, G_STRIDE, G_NSLOTS, G_SLOT_BYTES) = range(9)


def geometry(layout, rank: int):  # type: ignore[no-untyped-def]
    """The geometry array of ``rank`` in an arena of this ``layout``."""
    import numpy as np

    g = np.zeros(9, np.int64)
    g[G_RANK] = rank
    g[G_WORLD] = layout.world_size
    g[G_MAIL_BASE] = layout.mail_base_word
    g[G_DOORBELL_BASE] = layout.doorbell_base_word
    g[G_SLOTS_BASE] = layout.mail_slots_base
    g[G_RING_BYTES] = layout.mail_ring_bytes
    g[G_STRIDE] = layout.slot_stride
    g[G_NSLOTS] = layout.mail_nslots
    g[G_SLOT_BYTES] = layout.slot_bytes
    return g


@jit
def fragments(geo, nbytes):  # type: ignore[no-untyped-def]
    """How many fragments a message of ``nbytes`` travels in (at least one)."""
    slot = geo[G_SLOT_BYTES]
    return max(1, (nbytes + slot - 1) // slot)


@jit
def ring(ctrl, geo, rank):  # type: ignore[no-untyped-def]
    """Ring ``rank``'s doorbell; wake it if it sleeps (seq_cst pairs with the sleeper's check)."""
    word = geo[G_DOORBELL_BASE] + rank * WORDS_PER_LINE
    fetch_add(ctrl, word + D_DOORBELL, 1)
    if load_seqcst(ctrl, word + D_WAITERS) != 0:
        futex_wake(ctrl, word + D_DOORBELL)


@jit
def doorbell(ctrl, geo):  # type: ignore[no-untyped-def]
    """This rank's doorbell count (read it before looking for work, then sleep on it)."""
    return load_acquire(ctrl, geo[G_DOORBELL_BASE] + geo[G_RANK] * WORDS_PER_LINE + D_DOORBELL)


@jit(nogil=True)
def sleep_on_doorbell(ctrl, geo, seen, timeout_ns, spin_ns, yields):  # type: ignore[no-untyped-def]
    """Wait until this rank's doorbell moves past ``seen`` or ``timeout_ns`` passes, in the
    engine's three stages (``engine/cpu.py``): spin for ``spin_ns``, ``sched_yield`` up to
    ``yields`` times, then sleep on the futex. Sleeping at once cost a blocking ``recv`` the
    sleep and the wake-up at every message: 23 us per hop of a ping-pong at 2 ranks on 2 cores
    (``benchmarks/handoff.py``), where the sender's ring comes a microsecond later."""
    word = geo[G_DOORBELL_BASE] + geo[G_RANK] * WORDS_PER_LINE
    if spin_ns > 0:
        end = monotonic_ns() + spin_ns
        i = 0
        while True:
            cpu_pause()
            if load_acquire(ctrl, word + D_DOORBELL) != seen:
                return
            i += 1
            if (i & 63) == 0 and monotonic_ns() >= end:
                break
    for _ in range(yields):
        sched_yield()
        if load_acquire(ctrl, word + D_DOORBELL) != seen:
            return
    fetch_add(ctrl, word + D_WAITERS, 1)
    if load_seqcst(ctrl, word + D_DOORBELL) == seen:
        futex_wait(ctrl, word + D_DOORBELL, seen, timeout_ns)
    fetch_add(ctrl, word + D_WAITERS, -1)


@jit
def _mailbox_word(geo, src, dst):  # type: ignore[no-untyped-def]
    return geo[G_MAIL_BASE] + (src * geo[G_WORLD] + dst) * MAILBOX_WORDS


@jit
def _slot_byte(geo, src, dst, index):  # type: ignore[no-untyped-def]
    mailbox = src * geo[G_WORLD] + dst
    return geo[G_SLOTS_BASE] + mailbox * geo[G_RING_BYTES] + (index % geo[G_NSLOTS]) * geo[G_STRIDE]


@jit
def push(ctrl, data, geo, dst, payload, sent, msg_id, tag, nbytes, dtype):  # type: ignore[no-untyped-def]
    """Send fragments ``sent``.. of a message to ``dst`` while slots are free; returns how many
    fragments are sent now. ``payload`` is the message as bytes; ``data`` the arena as bytes."""
    me = geo[G_RANK]
    cw = _mailbox_word(geo, me, dst)
    head = ctrl[cw + C_HEAD]  # ours: no other process writes it
    total = fragments(geo, nbytes)
    slot = geo[G_SLOT_BYTES]
    start = sent
    while sent < total:
        if head - load_acquire(ctrl, cw + C_TAIL) >= geo[G_NSLOTS]:
            break
        at = _slot_byte(geo, me, dst, head)
        hdr = at // 8
        ctrl[hdr + M_ID] = msg_id
        ctrl[hdr + M_TAG] = tag
        ctrl[hdr + M_NBYTES] = nbytes
        ctrl[hdr + M_DTYPE] = dtype
        lo = sent * slot
        hi = min(nbytes, lo + slot)
        if hi > lo:
            copy(data, at + SLOT_HEADER_BYTES, data, 0, False, payload, lo, hi - lo)
        head += 1
        sent += 1
        store_release(ctrl, cw + C_HEAD, head)
    if sent != start:
        ring(ctrl, geo, dst)
    return sent


@jit
def peek(ctrl, geo, src, header):  # type: ignore[no-untyped-def]
    """The header of the next fragment in mailbox ``src -> me`` into ``header`` (id, tag, nbytes,
    dtype); returns False if the mailbox is empty."""
    me = geo[G_RANK]
    cw = _mailbox_word(geo, src, me)
    tail = ctrl[cw + C_TAIL]  # ours
    if load_acquire(ctrl, cw + C_HEAD) <= tail:
        return False
    hdr = _slot_byte(geo, src, me, tail) // 8
    header[0] = ctrl[hdr + M_ID]
    header[1] = ctrl[hdr + M_TAG]
    header[2] = ctrl[hdr + M_NBYTES]
    header[3] = ctrl[hdr + M_DTYPE]
    return True


@jit
def pull(ctrl, data, geo, src, out, got, msg_id, nbytes):  # type: ignore[no-untyped-def]
    """Copy the arrived fragments ``got``.. of message ``msg_id`` from ``src`` into ``out`` (bytes;
    empty to drop them); returns how many fragments are in now, or -1 if the mailbox holds
    another message than expected (a protocol error)."""
    me = geo[G_RANK]
    cw = _mailbox_word(geo, src, me)
    tail = ctrl[cw + C_TAIL]  # ours
    total = fragments(geo, nbytes)
    slot = geo[G_SLOT_BYTES]
    start = got
    while got < total:
        if load_acquire(ctrl, cw + C_HEAD) <= tail:
            break
        at = _slot_byte(geo, src, me, tail)
        if ctrl[at // 8 + M_ID] != msg_id:
            return -1
        lo = got * slot
        hi = min(nbytes, lo + slot)
        if hi > lo and out.size > 0:
            copy(out, lo, out, 0, False, data, at + SLOT_HEADER_BYTES, hi - lo)
        tail += 1
        got += 1
        store_release(ctrl, cw + C_TAIL, tail)
    if got != start:
        ring(ctrl, geo, src)
    return got


@jit
def take(ctrl, data, geo, src, tag, dtype, out, header):  # type: ignore[no-untyped-def]
    """Receive the next message of mailbox ``src -> me`` in one go where it is one fragment that
    matches ``tag`` (-1: any) and the dtype code ``dtype`` and fits in ``out`` (bytes): returns
    its size in bytes, its header in ``header`` (as :func:`peek`). -1: the mailbox is empty;
    -2: its next message is for ``comm.p2p``'s general path (another tag or dtype, or more than
    ``out`` or one slot holds), which finds it as it was."""
    if not peek(ctrl, geo, src, header):
        return -1
    nbytes = header[2]
    if (tag != -1 and header[1] != tag) or header[3] != dtype or nbytes > out.size or nbytes > geo[G_SLOT_BYTES]:
        return -2
    pull(ctrl, data, geo, src, out, 0, header[0], nbytes)  # its one fragment: copied, freed, rung
    return nbytes


# --- the gate: who may touch a communicator's point-to-point state ----------------------------
# Two words per communicator, in this process only. GATE_HELD is 1 while a thread is in the state:
# comm.p2p's general and direct paths hold it (with their Python lock) and so does a lean call
# (below), which takes no Python lock: the lock and the checks of the Python state under it were
# 0.25 us of each lean call. GATE_QUIET is 1 while nothing is pending in that state (no nonblocking
# operation, no queued send, no posted or kept-aside receive, no message half taken), written by
# the general path as it lets go: a lean call runs only then, so that it never passes a message
# or a receive that came first.
GATE_HELD, GATE_QUIET = 0, 1
BUSY = -4  # send_at / recv_at: the gate was held or the state not quiet; nothing was done


@jit
def hold_at(address, blocking):  # type: ignore[no-untyped-def]
    """Take the gate at ``address`` (a lean call holds it for one call, a receive for its spin at
    most); False if ``blocking`` is 0 and it is held. Called through its entry point, with ints."""
    gate = carray(address_as_pointer(address, _W), 2)
    while compare_exchange(gate, GATE_HELD, 0, 1) != 0:
        if not blocking:
            return False
        for _ in range(64):
            cpu_pause()
        sched_yield()
    return True


@jit
def let_go_at(address, quiet):  # type: ignore[no-untyped-def]
    """Give the gate at ``address`` back, saying whether the state is quiet."""
    gate = carray(address_as_pointer(address, _W), 2)
    gate[GATE_QUIET] = quiet
    store_release(gate, GATE_HELD, 0)


# --- the lean path: a repeated blocking send or receive of the same array ---------------------
# A record of int64 words holds everything such a call passes (the arrays as addresses), so that
# it enters compiled code through one int, as the collectives' lean path does (engine.entry_at):
# numba's dispatch of push's ten arguments and take's eight, four arrays each to unbox, was most
# of a blocking send's 2 us and a receive's 2.5.
(
    L_CTRL,
    L_CTRL_LEN,
    L_DATA,
    L_DATA_LEN,
    L_GEO,
    L_BUF,
    L_NBYTES,
    L_PEER,
    L_TAG,
    L_DTYPE,
    L_NEXT_IDS,
    L_HEADER,
    L_SPIN_NS,
    L_LAST_NBYTES,
    L_LAST_TAG,
    L_YIELDS,
    L_GATE,
) = range(17)
LEAN_WORDS = 17
SAME_AS_LAST = -3  # recv_at: a message of the size and tag of the record's last one
_W = np.int64  # (the scalar types address_as_pointer makes pointers to)
_B = np.uint8


def lean_record(ctrl, data, geo, gate, buf, peer, tag, dtype, next_ids, header, spin_ns, yields):  # type: ignore[no-untyped-def]
    """The record :func:`send_at` or :func:`recv_at` takes for one call shape: the gate, ``buf`` (the
    message's or the receive's bytes), the peer, the tag (-1: any, for a receive), the dtype
    code, the sender's next message ids (one per outgoing mailbox), where a receive's header goes,
    and how long a receive spins and how often it yields for its message (the communicator's
    waits). The caller keeps every array alive."""
    r = np.zeros(LEAN_WORDS, np.int64)
    r[L_CTRL], r[L_CTRL_LEN] = ctrl.ctypes.data, ctrl.shape[0]
    r[L_DATA], r[L_DATA_LEN] = data.ctypes.data, data.shape[0]
    r[L_GEO] = geo.ctypes.data
    r[L_BUF], r[L_NBYTES] = buf.ctypes.data, buf.shape[0]
    r[L_PEER], r[L_TAG], r[L_DTYPE] = peer, tag, dtype
    r[L_NEXT_IDS] = next_ids.ctypes.data
    r[L_HEADER] = header.ctypes.data
    r[L_SPIN_NS] = spin_ns
    r[L_LAST_NBYTES] = -1
    r[L_YIELDS] = yields
    r[L_GATE] = gate.ctypes.data
    return r


@jit
def send_at(record):  # type: ignore[no-untyped-def]
    """:func:`push` of a one-fragment message as ``record`` describes it (:func:`lean_record`),
    taking its id from the sender's next ids: 1 if it is in its mailbox, 0 if no slot was free,
    :data:`BUSY` if the gate was held or the state not quiet (nothing was written)."""
    rec = carray(address_as_pointer(record, _W), LEAN_WORDS)
    gate = carray(address_as_pointer(rec[L_GATE], _W), 2)
    if not _enter(gate):
        return BUSY
    ctrl = carray(address_as_pointer(rec[L_CTRL], _W), rec[L_CTRL_LEN])
    data = carray(address_as_pointer(rec[L_DATA], _B), rec[L_DATA_LEN])
    geo = carray(address_as_pointer(rec[L_GEO], _W), 9)
    payload = carray(address_as_pointer(rec[L_BUF], _B), rec[L_NBYTES])
    ids = carray(address_as_pointer(rec[L_NEXT_IDS], _W), geo[G_WORLD])
    dst = rec[L_PEER]
    msg_id = ids[dst]
    sent = push(ctrl, data, geo, dst, payload, 0, msg_id, rec[L_TAG], rec[L_NBYTES], rec[L_DTYPE])
    if sent == 1:
        ids[dst] = msg_id + 1
    store_release(gate, GATE_HELD, 0)
    return sent


@jit
def _enter(gate):  # type: ignore[no-untyped-def]
    """A lean call's take of the gate: held only where it was free and the state quiet."""
    if compare_exchange(gate, GATE_HELD, 0, 1) != 0:
        return False
    if gate[GATE_QUIET] == 0:
        store_release(gate, GATE_HELD, 0)
        return False
    return True


@jit
def recv_at(record):  # type: ignore[no-untyped-def]
    """:func:`take` as ``record`` describes it (:func:`lean_record`), waiting for the message
    as the communicator's waits begin (spin, then ``sched_yield``; a ping-pong's answer comes
    within a microsecond or two where the peer has a core of its own, and where ranks outnumber
    cores the sender needs this core: yielding here, not after a return to Python, is most of
    what took a 4-rank ring on 2 cores from 9.0-10.2 to 2.3-4.0 us per hop,
    ``benchmarks/handoff.py``): the message's size in bytes, its header in the
    record's header words, or :data:`SAME_AS_LAST` where its size and tag are the last message's
    this record took (the caller's Status of it is this one's too); -1: still empty (the caller
    sleeps the general way, which minds timeouts and lost peers), -2: the next message is for the
    general path, :data:`BUSY`: the gate was held or the state not quiet."""
    rec = carray(address_as_pointer(record, _W), LEAN_WORDS)
    gate = carray(address_as_pointer(rec[L_GATE], _W), 2)
    if not _enter(gate):
        return BUSY
    got = _take_waiting(rec)
    store_release(gate, GATE_HELD, 0)
    return got


@jit
def _take_waiting(rec):  # type: ignore[no-untyped-def]
    """:func:`recv_at`'s take and wait, with the gate held."""
    ctrl = carray(address_as_pointer(rec[L_CTRL], _W), rec[L_CTRL_LEN])
    data = carray(address_as_pointer(rec[L_DATA], _B), rec[L_DATA_LEN])
    geo = carray(address_as_pointer(rec[L_GEO], _W), 9)
    out = carray(address_as_pointer(rec[L_BUF], _B), rec[L_NBYTES])
    header = carray(address_as_pointer(rec[L_HEADER], _W), 4)
    bell = geo[G_DOORBELL_BASE] + geo[G_RANK] * WORDS_PER_LINE + D_DOORBELL
    end = 0
    yields = 0
    while True:
        seen = load_acquire(ctrl, bell)
        got = take(ctrl, data, geo, rec[L_PEER], rec[L_TAG], rec[L_DTYPE], out, header)
        if got >= 0:
            if got == rec[L_LAST_NBYTES] and header[1] == rec[L_LAST_TAG]:
                return SAME_AS_LAST
            rec[L_LAST_NBYTES] = got
            rec[L_LAST_TAG] = header[1]
            return got
        if got != -1:
            return got
        now = monotonic_ns()
        if end == 0:
            end = now + rec[L_SPIN_NS]
        if now < end:
            for _ in range(64):  # until the doorbell moves (a message, or a freed slot)
                cpu_pause()
                if load_acquire(ctrl, bell) != seen:
                    break
            continue
        while yields < rec[L_YIELDS] and load_acquire(ctrl, bell) == seen:
            sched_yield()
            yields += 1
        if load_acquire(ctrl, bell) == seen:
            return -1


def warm() -> None:
    """Compile (or load from the cache) the mailbox functions."""
    words = np.zeros(64, np.int64)
    geo = np.zeros(9, np.int64)
    geo[G_WORLD] = 1
    geo[G_NSLOTS] = 1
    geo[G_SLOT_BYTES] = 64
    data = np.zeros(0, np.uint8)
    doorbell(words, geo)
    sleep_on_doorbell(words, geo, 1, 0, 0, 0)
    peek(words, geo, 0, np.zeros(4, np.int64))
    pull(words, data, geo, 0, data, 1, 1, 0)
    push(words, data, geo, 0, data, 1, 1, 0, 0, 0)
    take(words, data, geo, 0, 0, 0, data, np.zeros(4, np.int64))
    lean_entries()


_LEAN: list[object] = []


def lean_entries():  # type: ignore[no-untyped-def]
    """The compiled entry points of (:func:`send_at`, :func:`recv_at`), each called with a
    record's address, and of (:func:`hold_at`, :func:`let_go_at`), called with a gate's address
    and an int (compiled, or loaded from the cache, on first use); None where numba does not
    expose them."""
    if not _LEAN:
        from numba import types

        i64 = types.int64
        entries = (
            send_at.compile((i64,)),
            recv_at.compile((i64,)),
            hold_at.compile((i64, i64)),
            let_go_at.compile((i64, i64)),
        )
        _LEAN.append(entries if all(callable(e) for e in entries) else None)
    return _LEAN[0]
