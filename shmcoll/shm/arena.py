"""A communicator's arena: one segment laid out by :mod:`shmcoll.shm.layout`.

The creator fills the header; each rank attaches, checks the header (magic, version, job token,
geometry: another job's or another version's segment is refused), claims its rank record with a
compare-and-swap on the pid word, and counts itself in ATTACHED. The rank that brings ATTACHED to
``world_size`` unlinks the name: from then on nothing can leak, whatever happens to the processes.

Liveness, two ways. Each attached rank holds the robust mutex of its liveness line
(:mod:`shmcoll.shm.liveness`), which the kernel marks when the rank dies: cheap enough for the
engine to read at the start of every call. And a rank's record holds its pid and its process
start time (clock ticks since boot, field 22 of ``/proc/<pid>/stat``: exact, and immune to
wall-clock changes): a peer is alive while a process with that pid *and that start time* exists
and is not a zombie, so a recycled pid is never mistaken for the peer.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

import numpy as np

from shmcoll.errors import ShmcollError
from shmcoll.jit import jit
from shmcoll.shm import layout, liveness
from shmcoll.shm.atomics import (
    atomic_add,
    atomic_cas,
    compare_exchange,
    futex_wake,
    read_word,
    store_release,
    write_word,
)
from shmcoll.shm.layout import Layout
from shmcoll.shm.segment import Segment, segment_name


@dataclasses.dataclass(frozen=True)
class ArenaHandle:
    """Everything another process needs to attach: picklable, and encodable as one string."""

    name: str
    size: int
    world_size: int
    nslots: int
    slot_bytes: int
    token: str

    def encode(self) -> str:
        return f"{self.name}:{self.size}:{self.world_size}:{self.nslots}:{self.slot_bytes}:{self.token}"

    @classmethod
    def decode(cls, text: str) -> ArenaHandle:
        try:
            name, size, world_size, nslots, slot_bytes, token = text.split(":")
            return cls(name, int(size), int(world_size), int(nslots), int(slot_bytes), token)
        except ValueError:
            raise ValueError(f"malformed shmcoll handle {text!r}") from None

    @property
    def layout(self) -> Layout:
        return Layout(self.world_size, self.nslots, self.slot_bytes)


def _token_word(token: str) -> int:
    value = int(token, 16)
    return value - (1 << 64) if value >= (1 << 63) else value


@jit
def _raise_abort(ctrl, origin, code, peer, seq, sig, step, detail, own_seq, chan_base, nchannels):  # type: ignore[no-untyped-def]
    """Fill the abort line (first caller wins) and wake every sleeper; True if this call was first.

    The code word goes to -1 first (claimed, being filled) and gets its value last, with a
    release store: whoever reads a code > 0 reads the filled line.
    """
    first = compare_exchange(ctrl, layout.AB_CODE, 0, -1) == 0
    if first:
        ctrl[layout.AB_ORIGIN] = origin
        ctrl[layout.AB_PEER] = peer
        ctrl[layout.AB_SEQ] = seq
        ctrl[layout.AB_SIG] = sig
        ctrl[layout.AB_STEP] = step
        ctrl[layout.AB_DETAIL] = detail
        ctrl[layout.AB_OWN_SEQ] = own_seq
        store_release(ctrl, layout.AB_CODE, code)
    for ch in range(nchannels):
        cw = chan_base + ch * layout.CHANNEL_WORDS
        futex_wake(ctrl, cw + layout.C_HEAD)
        futex_wake(ctrl, cw + layout.C_TAIL)
    return first


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a live process, or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(b")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return fields[0].decode(), int(fields[19])


class Arena:
    """A mapped arena and the views of it that the engine uses."""

    def __init__(self, segment: Segment, handle: ArenaHandle) -> None:
        self.segment = segment
        self.handle = handle
        self.layout = handle.layout
        self.ctrl = segment.array(np.int64)
        self._views: dict[np.dtype, np.ndarray] = {np.dtype(np.int64): self.ctrl}
        self._held: liveness.Held | None = None

    # --- lifetime -----------------------------------------------------------------------------
    @classmethod
    def create(cls, world_size: int, nslots: int, slot_bytes: int, token: str, what: str = "arena") -> Arena:
        lay = layout.Layout(world_size, nslots, slot_bytes)
        name = segment_name(token, what)
        purpose = f"the arena for {world_size} ranks ({nslots} slots of {slot_bytes} bytes per ring)"
        seg = Segment.create(name, lay.total_bytes, what_for=purpose)
        handle = ArenaHandle(name, lay.total_bytes, world_size, nslots, slot_bytes, token)
        ctrl = seg.array(np.int64)
        # Nobody else can see the segment yet: plain stores are fine, then publish MAGIC last.
        ctrl[layout.H_VERSION] = layout.VERSION
        ctrl[layout.H_TOKEN] = _token_word(token)
        ctrl[layout.H_WORLD_SIZE] = world_size
        ctrl[layout.H_NSLOTS] = nslots
        ctrl[layout.H_SLOT_BYTES] = slot_bytes
        ctrl[layout.H_TOTAL] = lay.total_bytes
        write_word(ctrl, layout.H_MAGIC, layout.MAGIC)
        return cls(seg, handle)

    @classmethod
    def attach(cls, handle: ArenaHandle) -> Arena:
        seg = Segment.attach(handle.name, handle.size)
        try:
            ctrl = seg.array(np.int64)
            expected = {
                "magic": (layout.H_MAGIC, layout.MAGIC),
                "version": (layout.H_VERSION, layout.VERSION),
                "job token": (layout.H_TOKEN, _token_word(handle.token)),
                "world_size": (layout.H_WORLD_SIZE, handle.world_size),
                "nslots": (layout.H_NSLOTS, handle.nslots),
                "slot_bytes": (layout.H_SLOT_BYTES, handle.slot_bytes),
            }
            for what, (word, value) in expected.items():
                found = int(read_word(ctrl, word))
                if found != value:
                    raise ShmcollError(
                        f"segment {handle.name} is not this job's arena: {what} is {found:#x}, "
                        f"expected {value:#x} (another job, another shmcoll version, or corrupted)"
                    )
            del ctrl
            return cls(seg, handle)
        except BaseException:
            seg.close()
            raise

    def register(self, rank: int) -> None:
        """Claim ``rank``'s record for this process and count it as attached."""
        if not 0 <= rank < self.layout.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.layout.world_size}")
        pid = os.getpid()
        pid_word = self.layout.rank_word(rank, layout.R_PID)
        taken = int(atomic_cas(self.ctrl, pid_word, 0, pid))
        if taken != 0 and taken != pid:
            raise ShmcollError(f"rank {rank} is already connected (by pid {taken})")
        # STATE before START: a reader takes the record as filled in once START is set.
        write_word(self.ctrl, self.layout.rank_word(rank, layout.R_STATE), layout.STATE_IDLE)
        stat = proc_stat(pid)
        write_word(self.ctrl, self.layout.rank_word(rank, layout.R_START), stat[1] + 1 if stat else 1)
        write_word(self.ctrl, self.layout.rank_word(rank, layout.R_WAIT_PEER), -1)
        base = self.ctrl.__array_interface__["data"][0]
        self._held = liveness.hold(base + 8 * self.layout.live_word(rank), self.ctrl)
        attached = int(atomic_add(self.ctrl, layout.A_ATTACHED, 1)) + 1
        if attached >= self.layout.world_size:
            self.segment.unlink()

    def agree_group_size(self, value: int) -> int:
        """Propose ``value`` (>= 1) as the ranks per group of hierarchical plans; returns the agreed
        one: the first proposal wins (a compare-and-swap from 0), so every rank sees the same."""
        return self._agree(layout.A_GROUP_SIZE, value)

    def cma_crossover(self, measure: Callable[[], int], deadline_s: float) -> int:
        """The block size from which cross-memory attach beats the rings here
        (``shm.cma.crossover_bytes``), the same for every rank: the value in the arena if the
        launcher or a rank put one there; else this rank claims the word, runs ``measure`` and
        publishes its answer, or, if another rank claimed it first, waits for that one's (so
        that the ranks do not measure at once, on cores they share). A waiter still waiting
        after ``deadline_s`` (its measurer died) publishes its own answer in its place."""
        word = layout.A_CMA_CROSSOVER
        found = int(atomic_cas(self.ctrl, word, 0, layout.CMA_MEASURING))
        if found == 0:
            return self._settle(word, measure())
        give_up = time.monotonic() + deadline_s
        while found == layout.CMA_MEASURING:
            if time.monotonic() > give_up:
                return self._settle(word, measure())
            time.sleep(0.0005)
            found = int(read_word(self.ctrl, word))
        return found

    def _settle(self, word: int, value: int) -> int:
        """Publish ``value`` over a claim; the value already there if another rank settled first."""
        found = int(atomic_cas(self.ctrl, word, layout.CMA_MEASURING, value))
        return value if found == layout.CMA_MEASURING else found

    def publish_cma_crossover(self, value: int) -> None:
        """Put ``value`` in the arena before any rank needs it (the launcher, which measures it
        while no rank runs); a value already there stays."""
        self._agree(layout.A_CMA_CROSSOVER, value)

    def _agree(self, word: int, value: int) -> int:
        found = int(atomic_cas(self.ctrl, word, 0, value))
        return value if found == 0 else found

    def deregister(self, rank: int, failed: bool = False) -> None:
        state = layout.STATE_FAILED if failed else layout.STATE_EXITED
        write_word(self.ctrl, self.layout.rank_word(rank, layout.R_STATE), state)
        self._release_liveness()
        atomic_add(self.ctrl, layout.A_DETACHED, 1)

    def _release_liveness(self) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None

    def close(self) -> None:
        self._release_liveness()  # before the mapping goes: glibc's robust list runs through it
        self._views.clear()
        self.ctrl = np.empty(0, np.int64)
        self.segment.close()

    # --- views --------------------------------------------------------------------------------
    def view(self, dtype: np.dtype) -> np.ndarray:
        """The whole arena as a 1-d array of ``dtype`` (slots are addressed in it)."""
        v = self._views.get(dtype)
        if v is None:
            v = self._views[dtype] = self.segment.array(dtype)
        return v

    # --- records ------------------------------------------------------------------------------
    def word(self, index: int) -> int:
        return int(read_word(self.ctrl, index))

    def rank_field(self, rank: int, field: int) -> int:
        return self.word(self.layout.rank_word(rank, field))

    def attached(self) -> int:
        return self.word(layout.A_ATTACHED)

    def liveness(self, rank: int) -> str:
        """What ``rank``'s liveness mutex says: ``"free"``, ``"held"`` or ``"died"``."""
        return liveness.state(self.word(self.layout.live_word(rank)) & 0xFFFFFFFF)

    def peer_status(self, rank: int) -> str:
        """``"absent"`` (not attached yet), ``"alive"``, ``"exited"``, ``"failed"`` or ``"dead"``."""
        pid = self.rank_field(rank, layout.R_PID)
        start = self.rank_field(rank, layout.R_START)
        if pid == 0 or start == 0:
            return "absent"  # not attached yet, or between claiming the record and filling it
        state = self.rank_field(rank, layout.R_STATE)
        if state == layout.STATE_EXITED:
            return "exited"
        if state == layout.STATE_FAILED:
            return "failed"
        if self.liveness(rank) == "died":
            return "dead"  # the kernel says so, in whatever PID namespace the rank ran
        stat = proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X") or stat[1] + 1 != start:
            return "dead"  # gone, a zombie, or the pid now belongs to another process
        return "alive"

    def abort(
        self,
        origin: int,
        code: int,
        peer: int = -1,
        seq: int = 0,
        sig: int = 0,
        step: int = 0,
        detail: int = 0,
        own_seq: int = 0,
    ) -> bool:
        """Raise the abort word (``origin`` -1: the launcher), waking every rank that sleeps on a
        channel; returns whether this was the first abort. See ``layout`` for the fields."""
        lay = self.layout
        return bool(
            _raise_abort(
                self.ctrl, origin, code, peer, seq, sig, step, detail, own_seq, lay.channels_base_word, lay.nchannels
            )
        )

    def abort_info(self) -> dict[str, int]:
        return {
            "code": self.word(layout.AB_CODE),
            "origin": self.word(layout.AB_ORIGIN),
            "peer": self.word(layout.AB_PEER),
            "seq": self.word(layout.AB_SEQ),
            "sig": self.word(layout.AB_SIG),
            "step": self.word(layout.AB_STEP),
            "detail": self.word(layout.AB_DETAIL),
            "own_seq": self.word(layout.AB_OWN_SEQ),
        }
