"""Why a call failed, as the arena shows it, turned into the exception every rank raises.

Only this module (and the run loop that calls it) turns engine statuses into exceptions. Each
``fail_*`` function raises the abort word first, so the other ranks stop within milliseconds,
marks the communicator broken, and raises with the rank, the peer, the collective, its call
number and its step in the message. The diagnoses read the rank records and the abort line of
the arena (``shm/layout``) and ``/proc``; they run only once a call is already failing.
"""

from __future__ import annotations

import time
from typing import Any

from shmcoll.algos.registry import ALGORITHM_NAMES
from shmcoll.comm.calls import Call
from shmcoll.engine import cpu as engine
from shmcoll.errors import CollectiveMismatchError, CollectiveTimeout, CommunicatorBrokenError, PeerLostError
from shmcoll.plan import ir
from shmcoll.shm import layout
from shmcoll.shm.arena import proc_stat

ABORT_REASONS = {
    layout.ABORT_USER: "abort() was called",
    layout.ABORT_TIMEOUT: "a collective timed out",
    layout.ABORT_PEER_LOST: "a peer process died",
    layout.ABORT_MISMATCH: "ranks called mismatched collectives",
    layout.ABORT_ERROR: "failed (an error on that rank, in its own code or its device work)",
    layout.ABORT_REMOTE: "its multi-node communicator failed (over MPI, or on another node)",
}

Runtime = Any  # comm.runtime.Runtime (which imports this module)


def call_number(rt: Runtime) -> int:
    """The number of the call this rank is in (or last started)."""
    return int(rt._state[engine.S_SEQ])


def wait_step(rt: Runtime) -> int:
    """The step the current call waited at."""
    return int(rt._state[engine.S_WAIT_STEP])


def call_text(rt: Runtime, call: Call) -> str:
    """``allreduce(...) (call #N, step S)``, for messages."""
    if int(rt._state[engine.S_ACTIVE]) == 0:  # stopped at the start: the call has no number yet
        return f"{call.label} (call #{next_seq(rt, call)}, before its first step)"
    return f"{call.label} (call #{call_number(rt)}, step {wait_step(rt)})"


def next_seq(rt: Runtime, call: Call) -> int:
    """The number the call would have had, had it started."""
    return int(rt._state[engine.S_SEQ]) + 1


def lost_peer(rt: Runtime, seq: int) -> tuple[int, str] | None:
    """A peer this rank cannot finish call ``seq`` without: the awaited one if gone, or any that
    died in the middle of a call. A peer that left *because of an abort* is never the answer: the
    abort word names the cause, and the caller reads it first.

    Nor is a peer that completed call ``seq`` before it left: everything it had to send or say
    for this call, it published before it completed, so the engine finds it at its next look. The
    engine's wait can give up an instant before that peer publishes, then the peer completes and
    closes its communicator before this look: 4 ranks on 2 cores raised "peer rank 3 was lost
    ...: it closed its communicator" once in 43 thousand calls of a benchmark's last size. (Its
    state is read before its number: it stores the number, then leaves the call, then exits.)"""
    waited = int(rt._state[engine.S_WAIT_PEER])
    for peer in range(rt._world_size):
        if peer == rt._rank:
            continue
        status = rt._arena.peer_status(peer)
        if status in ("alive", "absent"):
            continue
        mid_call = rt._arena.rank_field(peer, layout.R_STATE) == layout.STATE_IN_CALL
        if not mid_call and status != "failed" and rt._arena.rank_field(peer, layout.R_DONE_SEQ) >= seq:
            continue  # (it did its part of this call, and left after it)
        if peer == waited or mid_call or status == "failed":
            # A rank raises the abort word before it marks itself failed or leaves, so having
            # seen that mark, this load sees the abort if there was one.
            if rt._arena.word(layout.AB_CODE) != 0:
                return None
            return peer, status
    return None


def fail_peer_lost(rt: Runtime, call: Call, peer: int, status: str) -> None:
    pid = rt._arena.rank_field(peer, layout.R_PID)
    how = {
        "dead": f"its process (pid {pid}) is gone",
        "exited": "it closed its communicator",
        "failed": "it failed and left",
    }.get(status, status)
    msg = f"rank {rt._rank}: peer rank {peer} was lost during {call_text(rt, call)}: {how}"
    rt._arena.abort(rt._rank, layout.ABORT_PEER_LOST, peer, call_number(rt), call.sig, wait_step(rt), 0, 0)
    rt._broken = msg
    raise PeerLostError(msg, dead_rank=peer)


def activity(rt: Runtime, rank: int, seq: int) -> str:
    """What ``rank`` is doing, relative to this rank's call number ``seq``."""
    a = rt._arena
    if a.rank_field(rank, layout.R_PID) == 0:
        return f"rank {rank}: never connected"
    state = a.rank_field(rank, layout.R_STATE)
    last = ir.describe_sig(a.rank_field(rank, layout.R_DONE_SIG), ALGORITHM_NAMES)
    done = f"last completed {last} #{a.rank_field(rank, layout.R_DONE_SEQ)}"
    if state == layout.STATE_IN_CALL:
        cur = ir.describe_sig(a.rank_field(rank, layout.R_CUR_SIG), ALGORITHM_NAMES)
        cur_seq, step = a.rank_field(rank, layout.R_CUR_SEQ), a.rank_field(rank, layout.R_CUR_STEP)
        where = "arrived" if cur_seq == seq else "not arrived"
        return f"rank {rank}: {where}, in {cur} #{cur_seq} (step {step}); {done}"
    name = {layout.STATE_IDLE: "not in a call", layout.STATE_EXITED: "closed", layout.STATE_FAILED: "failed"}.get(
        state, "?"
    )
    return f"rank {rank}: not arrived ({name}); {done}"


def activities(rt: Runtime) -> str:
    seq = call_number(rt)
    return "; ".join(activity(rt, r, seq) for r in range(rt._world_size) if r != rt._rank)


def holdup(rt: Runtime, waited: int) -> tuple[int, str]:
    """The rank a timed-out call is really waiting for, and why, as far as the arena shows: a
    stopped process first (``SIGSTOP``, a debugger), else the end of the chain of ranks each
    waiting for the next, starting at the one this rank waits for."""
    for peer in range(rt._world_size):
        if peer == rt._rank:
            continue
        pid = rt._arena.rank_field(peer, layout.R_PID)
        stat = proc_stat(pid) if pid > 0 else None
        if stat is not None and stat[0] in ("T", "t"):
            return peer, f"its process (pid {pid}) is stopped (SIGSTOP, or a debugger)"
    peer, seen = waited, {rt._rank}
    while 0 <= peer < rt._world_size and peer not in seen:
        seen.add(peer)
        if rt._arena.rank_field(peer, layout.R_PID) == 0:
            return peer, "it never connected"
        if rt._arena.rank_field(peer, layout.R_STATE) != layout.STATE_IN_CALL:
            return peer, "it has not arrived"
        nxt = rt._arena.rank_field(peer, layout.R_WAIT_PEER)
        if nxt < 0 or nxt in seen:
            return peer, "it is in a call and not waiting: busy, or stuck"
        peer = nxt
    return waited, ""


def compiling_peer(rt: Runtime) -> int | None:
    """A peer that is compiling kernels now (its first call of a new dtype, say), if any."""
    lay = rt._arena.layout
    for peer in range(rt._world_size):
        if peer != rt._rank and rt._ctrl[lay.rank_word(peer, layout.R_COMPILING)] != 0:
            return peer
    return None


def fail_timeout(rt: Runtime, call: Call, limit: float) -> None:
    waited = int(rt._state[engine.S_WAIT_PEER])
    culprit, why = holdup(rt, waited)
    chain = "" if culprit == waited else f" (which waits, in turn, for rank {culprit})"
    cause = f": rank {culprit} {why}" if why else ""
    peers = activities(rt)
    msg = (
        f"rank {rt._rank}: {call_text(rt, call)} timed out after {limit:g}s waiting for rank {waited}"
        f"{chain}{cause}. Peers: {peers}"
    )
    rt._arena.abort(rt._rank, layout.ABORT_TIMEOUT, culprit, call_number(rt), call.sig, wait_step(rt), 0, 0)
    rt._broken = msg
    raise CollectiveTimeout(msg)


def check_awaited_call(rt: Runtime, call: Call) -> None:
    """Mismatch that no message can reveal: both ranks wait to receive (two ranks that each
    believe they are a reduce's root). Seen in the awaited peer's record: same call number,
    different call."""
    peer = int(rt._state[engine.S_WAIT_PEER])
    if not 0 <= peer < rt._world_size or peer == rt._rank:
        return
    a = rt._arena
    if a.rank_field(peer, layout.R_STATE) != layout.STATE_IN_CALL:
        return
    their_seq, their_sig = a.rank_field(peer, layout.R_CUR_SEQ), a.rank_field(peer, layout.R_CUR_SIG)
    if their_seq == call_number(rt) and their_sig != call.sig:
        fail_mismatch(rt, call, peer, their_seq, their_sig, wait_step(rt))


def fail_placement(rt: Runtime, call: Call) -> None:
    peer = int(rt._state[engine.S_ERR_PEER])
    msg = (
        f"rank {rt._rank}: {call.label} (call #{call_number(rt)}): rank {peer} passed its buffer from another "
        f"place (another comm.alloc allocation, or another offset in it) than this rank did: zero-copy "
        f"collectives read each peer's buffer at the same place as their own"
    )
    number = call_number(rt)
    rt._arena.abort(rt._rank, layout.ABORT_MISMATCH, peer, number, call.sig, wait_step(rt), call.sig, number)
    rt._broken = msg
    raise CollectiveMismatchError(msg)


def fail_read(rt: Runtime, call: Call) -> None:
    """A cma call's ``process_vm_readv`` or ``process_vm_writev`` of a peer's buffer failed: the
    peer is gone (then say so), or the kernel refused this pair what the start-up probe allowed."""
    peer = int(rt._state[engine.S_ERR_PEER])
    if rt._arena.peer_status(peer) in ("dead", "exited", "failed"):
        fail_peer_lost(rt, call, peer, rt._arena.peer_status(peer))
    msg = (
        f"rank {rt._rank}: {call_text(rt, call)}: could not reach rank {peer}'s buffer with "
        f"process_vm_readv/writev (cross-memory attach; the kernel refused it for this pair of processes, "
        f"e.g. ranks of different users or a process that is not dumpable). Set SHMCOLL_CMA=0 "
        f"to move data through shared memory only"
    )
    rt._arena.abort(rt._rank, layout.ABORT_ERROR, peer, call_number(rt), call.sig, wait_step(rt))
    rt._broken = msg
    raise CommunicatorBrokenError(msg)


def fail_counts(rt: Runtime, call: Call) -> None:
    """A variable-count call whose ranks disagree on a block's size: each message says the size
    of the whole transfer it belongs to (its tag, the count + 1), and the receiver expected another."""
    peer = int(rt._state[engine.S_ERR_PEER])
    sent = int(rt._state[engine.S_ERR_PLACE]) - 1
    expected = int(call.prog[int(rt._state[engine.S_ERR_STEP]), ir.C_TAG]) - 1
    number = call_number(rt)
    rule = {
        "alltoallv": "rank i's send_counts[j] must equal rank j's recv_counts[i]",
        "gatherv": "rank j's x must have the root's counts[j] elements",
        "scatterv": "rank j's out must have the root's counts[j] elements",
    }.get(call.kind, "every rank must pass the same counts")
    msg = (
        f"rank {rt._rank}: {call.label} (call #{number}): rank {peer} sent a block of {sent} element(s) where "
        f"this rank's counts say {expected}: {rule}"
    )
    rt._arena.abort(rt._rank, layout.ABORT_MISMATCH, peer, number, call.sig, wait_step(rt), call.sig, number)
    rt._broken = msg
    raise CollectiveMismatchError(msg)


def fail_mismatch(rt: Runtime, call: Call, peer: int, their_seq: int, their_sig: int, step: int) -> None:
    theirs = ir.describe_sig(their_sig, ALGORITHM_NAMES)
    mine_seq, mine = call_number(rt), call.label
    if their_seq != mine_seq:
        # Their message comes from another call number: name our own call of that number if
        # it was the last one we completed (the usual case: a mismatch only one side saw).
        done_seq = rt._arena.rank_field(rt._rank, layout.R_DONE_SEQ)
        if done_seq == their_seq:
            mine_seq = done_seq
            mine = ir.describe_sig(rt._arena.rank_field(rt._rank, layout.R_DONE_SIG), ALGORITHM_NAMES)
    msg = (
        f"rank {rt._rank} called {mine} (call #{mine_seq}) but rank {peer} called {theirs} "
        f"(call #{their_seq}); detected in call #{call_number(rt)} at step {step}: ranks must call the same "
        f"collectives, in the same order, with the same sizes, dtypes, ops and roots"
    )
    mine_sig = call.sig if mine_seq == call_number(rt) else rt._arena.rank_field(rt._rank, layout.R_DONE_SIG)
    rt._arena.abort(rt._rank, layout.ABORT_MISMATCH, peer, their_seq, their_sig, step, mine_sig, mine_seq)
    rt._broken = msg
    raise CollectiveMismatchError(msg)


def fail_mismatch_at_entry(rt: Runtime, call: Call, peer: int, their_sig: int) -> None:
    """A mismatch seen before the call started (``comm.pages``: this rank waits for its peers'
    pages while ``peer`` is already in another call of the same number)."""
    seq = next_seq(rt, call)
    theirs = ir.describe_sig(their_sig, ALGORITHM_NAMES)
    msg = (
        f"rank {rt._rank} called {call.label} (call #{seq}) but rank {peer} called {theirs} (call #{seq}); "
        f"detected before the call's first step: ranks must call the same collectives, in the same order, "
        f"with the same sizes, dtypes, ops and roots"
    )
    rt._arena.abort(rt._rank, layout.ABORT_MISMATCH, peer, seq, their_sig, 0, call.sig, seq)
    rt._broken = msg
    raise CollectiveMismatchError(msg)


def fail_aborted(rt: Runtime, call: Call) -> None:
    info = rt._arena.abort_info()
    deadline = time.monotonic() + 1.0
    while info["code"] == -1 and time.monotonic() < deadline:  # the aborting rank is filling it
        time.sleep(0.001)
        info = rt._arena.abort_info()
    code, origin, peer = info["code"], info["origin"], info["peer"]
    where = f"rank {rt._rank}: {call_text(rt, call)} aborted"
    who = f"rank {origin}" if origin >= 0 else "the launcher"
    if code == layout.ABORT_PEER_LOST:
        msg = f"{where}: {who} found peer rank {peer} lost"
        rt._broken = msg
        raise PeerLostError(msg, dead_rank=peer)
    if code == layout.ABORT_TIMEOUT:
        msg = f"{where}: {who} timed out waiting for rank {peer}. Peers: {activities(rt)}"
        rt._broken = msg
        raise CollectiveTimeout(msg)
    if code == layout.ABORT_MISMATCH:
        mine = ir.describe_sig(info["detail"], ALGORITHM_NAMES)
        theirs = ir.describe_sig(info["sig"], ALGORITHM_NAMES)
        msg = (
            f"{where}: mismatched collectives: rank {origin} called {mine} (call #{info['own_seq']}) "
            f"but rank {peer} called {theirs} (call #{info['seq']})"
        )
        rt._broken = msg
        raise CollectiveMismatchError(msg)
    reason = ABORT_REASONS.get(code, f"abort code {code}")
    msg = f"{where}: {who}: {reason}"
    rt._broken = msg
    raise CommunicatorBrokenError(msg)


def warn_unreceived(rt: Runtime) -> None:
    """Messages sent to this rank that it never received: collective ones point at mismatched
    calls that no receive got to see (say two ranks that both believed they were a broadcast's
    root); point-to-point ones at a send with no matching receive."""
    lay = rt._arena.layout
    for peer in range(rt._world_size):
        if peer != rt._rank:
            ch = lay.channel(peer, rt._rank)
            # (a channel counts cells, not messages: say only that something is left)
            waiting = rt._arena.word(lay.channel_word(ch, layout.C_HEAD)) - int(
                rt._ctrl[lay.channel_word(ch, layout.C_TAIL)]
            )
            if waiting > 0:
                rt._log.warning(
                    "closing with message(s) from rank %d never received: the ranks' calls "
                    "did not match (e.g. different roots, or an extra send)",
                    peer,
                )
        box = lay.mailbox(peer, rt._rank)
        fragments = rt._arena.word(lay.mailbox_word(box, layout.C_HEAD)) - rt._arena.word(
            lay.mailbox_word(box, layout.C_TAIL)
        )
        kept = sum(1 for m in rt._p2p._unexpected if m.src == peer) if rt._p2p is not None else 0
        if fragments > 0 or kept:
            rt._log.warning(
                "closing with point-to-point message(s) from rank %d never received "
                "(%d kept unmatched, %d slot(s) in the mailbox): a send with no matching recv",
                peer,
                kept,
                fragments,
            )
