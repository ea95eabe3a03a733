"""Cross-memory attach: whether this process may reach its peers' memory (``process_vm_readv``
and ``process_vm_writev``).

The ``cma`` algorithm copies a block straight between the peers' own (ordinary numpy) buffers:
one copy where the rings make two. The kernel allows it only where ptrace would be allowed (same
user, and Yama's ``ptrace_scope`` permitting it) and where no seccomp filter refuses the system
calls, as some container runtimes do. :func:`probe` decides
once per process, before any call is planned:

- ``SHMCOLL_CMA=0`` turns it off;
- Yama's scope 1 ("restricted": only a tracer's descendants) is lifted for this process with
  ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``, as MPI libraries do; scope 2 or 3 refuses
  unprivileged readers, so cross-memory attach is off there;
- a read and a write of this process's own memory through the system calls catch a seccomp
  refusal or a kernel without them (both are needed: cma's plans read and write).

Every rank of a machine decides the same way (same kernel settings, same user), so the plans
they choose agree. If a peer's memory is refused anyway (a process that is not dumpable, ranks
of different users), the call fails with an error that names ``SHMCOLL_CMA=0`` as the remedy.

Whether the single copy pays differs between machines far more than a user-space copy's speed
does, and what decides it is not the kernel's copy alone but the kernel's copy *against the
rings*: a ring moves a byte twice, but both copies are user-space copies, pipelined on two cores
and through slots that stay in the caches. On a 2-core Intel VM cma's allreduce of 1 MiB took 64
us and beat the rings' 118; on a 2-core AMD (Zen 4) VM 100-118 against the rings' 125-150; on a
2-core AMD (Zen 5) VM 82-89 against the rings' 48, and the rings won every collective at 2 ranks
from 64 KiB to 1 MiB, by up to 3x (``benchmarks/RESULTS.md``), although a kernel copy of 16 KiB there took
less time (1.7-1.9 us) than on the Zen 4 VM (2.4-2.8), and a 1 MiB one was 3.6x slower than
numpy's on both. A copy within one process cannot tell those machines apart; how fast two cores
hand each other data can. So :func:`crossover_bytes` races the two ways, the rings' and the
kernel's, the way a 2-rank exchange uses them: two threads of this process, on two cores, each
send a block to the other, once through a ring of slots (:func:`_ring_exchange`) and once by
``process_vm_readv`` of the other's buffer (:func:`_kernel_exchange`), at block sizes of 16 KiB
to 4 MiB; the first size at which the kernel is no slower is where ``auto`` starts weighing cma
(``algos/cma.py``). Its answer is noisy, and the ranks of a call must choose alike, so ranks take
the answer of the first of them to measure it (through the arena, ``comm.calls.cma_crossover``),
not their own.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time

import numpy as np

from shmcoll import config
from shmcoll.jit import jit
from shmcoll.shm import pages
from shmcoll.shm.atomics import (
    cpu_pause,
    fetch_add,
    load_acquire,
    monotonic_ns,
    move_bytes,
    sched_yield,
    store_release,
    vm_copy,
)

PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1 % (1 << 64))
_YAMA = "/proc/sys/kernel/yama/ptrace_scope"


def _yama_scope() -> int:
    try:
        with open(_YAMA) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0  # no Yama: plain ptrace rules (same user)


@functools.lru_cache(maxsize=1)
def probe() -> tuple[bool, str]:
    """(available, why) for this process; the answer is kept for the process's life."""
    if not config.get().cma:
        return False, "off (SHMCOLL_CMA=0)"
    scope = _yama_scope()
    if scope >= 2:
        return False, f"off: {_YAMA} is {scope} (ptrace restricted to administrators)"
    if scope == 1:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0:
            return False, f"off: prctl(PR_SET_PTRACER) failed ({os.strerror(ctypes.get_errno())})"
    src = np.arange(512, dtype=np.int64)
    dst = np.zeros_like(src)
    if not vm_copy(os.getpid(), dst.ctypes.data, src.ctypes.data, src.nbytes, False) or not np.array_equal(src, dst):
        return False, "off: process_vm_readv is refused here (a seccomp filter or an old kernel)"
    back = np.zeros_like(src)
    if not vm_copy(os.getpid(), src.ctypes.data, back.ctypes.data, src.nbytes, True) or not np.array_equal(src, back):
        return False, "off: process_vm_writev is refused here (a seccomp filter or an old kernel)"
    return True, "on: process_vm_readv/writev" + (
        " (Yama scope 1: peers allowed with PR_SET_PTRACER)" if scope == 1 else ""
    )


# Block sizes at which the two ways are raced, smallest first (the rings' slot is 64 KiB, so from
# 64 KiB a block is pipelined through the ring as the engine pipelines it).
LADDER_BYTES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
NEVER = 1 << 62
""":func:`crossover_bytes` where the kernel lost at every size of the ladder."""
_SLOT_BYTES = 64 << 10  # the rings' default slot (config.slot_bytes) and count (config.nslots)
_NSLOTS = 4
# Pauses of a waiting thread before it yields: a hand-off between two running threads takes a
# copy of a slot (1-2 us, well under 1024 pauses); longer, and the other thread has lost its core.
_IDLE_SPINS = 1024
_ROUNDS = 3  # timed races per size (the best counts), after one untimed
# A race whose rings waited for a core (a thread yielded: another process ran on one of the two,
# such as the janitor the launcher starts, a Python interpreter) says nothing about two cores
# exchanging data; where the kernel won such a race it is run again after these pauses. A machine
# busy through all of them is busy for the ranks too, and the kernel's win stands.
_CONTENDED_PAUSES_S = (0.01, 0.03, 0.1)


@jit
def _wait_for(ctrl, word, target):  # type: ignore[no-untyped-def]
    """Wait until ``ctrl[word] >= target``: pause, and yield when the other thread has no core."""
    idle = 0
    while load_acquire(ctrl, word) < target:
        cpu_pause()
        idle += 1
        if idle >= _IDLE_SPINS:
            sched_yield()
            idle = 0


@jit
def _ring_exchange(ctrl, me, src, dst, out_slots, in_slots, nbytes, reps):  # type: ignore[no-untyped-def]
    """Thread ``me`` (0 or 1) sends ``nbytes`` from address ``src`` to the other thread through a
    ring of slots at ``out_slots`` while it receives as much into ``dst`` from the other's ring
    at ``in_slots``, ``reps`` times: as a 2-rank exchange runs through the rings, a slot sent
    whenever one is free, a slot taken whenever one has arrived. ``ctrl`` holds each ring's head
    and tail (words ``16 r`` and ``16 r + 8`` for the ring of thread ``r``, lines apart), counting
    slots on from the exchange before. Returns how often it yielded: each time the other thread
    had no core for over a thousand pauses."""
    out_head, out_tail = 16 * me, 16 * me + 8
    in_head, in_tail = 16 * (1 - me), 16 * (1 - me) + 8
    head = ctrl[out_head]  # (each thread's own words: the other only reads them)
    tail = ctrl[in_tail]
    idle = 0
    yields = 0
    for _ in range(reps):
        sent = 0
        got = 0
        while sent < nbytes or got < nbytes:
            if sent < nbytes and head - load_acquire(ctrl, out_tail) < _NSLOTS:
                m = min(_SLOT_BYTES, nbytes - sent)
                move_bytes(out_slots + (head % _NSLOTS) * _SLOT_BYTES, src + sent, m)
                head += 1
                store_release(ctrl, out_head, head)
                sent += m
                idle = 0
            elif got < nbytes and load_acquire(ctrl, in_head) > tail:
                m = min(_SLOT_BYTES, nbytes - got)
                move_bytes(dst + got, in_slots + (tail % _NSLOTS) * _SLOT_BYTES, m)
                tail += 1
                store_release(ctrl, in_tail, tail)
                got += m
                idle = 0
            else:
                cpu_pause()
                idle += 1
                if idle >= _IDLE_SPINS:  # the other thread has no core now: let it have ours
                    sched_yield()
                    yields += 1
                    idle = 0
    return yields


# The words :func:`_races` shares between its two threads: the rings' counters (0-31), its
# barrier (32), the buffers' addresses (from _BUFS: both sources, both destinations, both rings'
# slots), then each thread's times (from _TIMES) and after them its rings' yields per race (one
# int64 array, not several: jit's compile notice would take three int64 arrays for an engine's
# payload).
_BARRIER, _BUFS, _TIMES = 32, 40, 48


@jit
def _races(words, me, pid, nbytes, reps, rounds):  # type: ignore[no-untyped-def]
    """Thread ``me``'s side of ``rounds`` races at ``nbytes``: each starts together with the other
    thread (a barrier), exchanges through the rings, meets it again, then copies the other's
    block by cross-memory attach (``process_vm_readv``), each ``reps`` times, and writes the
    nanoseconds of both into its times, and the rings' yields after them (see :data:`_TIMES`)."""
    src, peer_src, dst = words[_BUFS + me], words[_BUFS + 1 - me], words[_BUFS + 2 + me]
    out_slots, in_slots = words[_BUFS + 4 + me], words[_BUFS + 5 - me]
    times = _TIMES + me * 2 * rounds
    yielded = _TIMES + 4 * rounds + me * rounds
    meet = 0
    for r in range(rounds):
        for k in range(2):
            meet += 2
            fetch_add(words, _BARRIER, 1)
            _wait_for(words, _BARRIER, meet)
            t0 = monotonic_ns()
            if k == 0:
                words[yielded + r] = _ring_exchange(words, me, src, dst, out_slots, in_slots, nbytes, reps)
            else:
                for _ in range(reps):
                    vm_copy(pid, dst, peer_src, nbytes, False)
            words[times + 2 * r + k] = monotonic_ns() - t0
    return 0


def warm() -> None:
    """Compile (or load from the cache) what :func:`crossover_bytes` runs, before ranks start."""
    _races(np.zeros(_TIMES, np.int64), 0, os.getpid(), 0, 0, 0)


def race(nbytes: int, reps: int = 1, rounds: int = _ROUNDS) -> tuple[int, int, bool]:
    """(rings, kernel, contended): the best nanoseconds of ``rounds`` races in which two threads
    exchange ``nbytes`` each way ``reps`` times through rings, and by cross-memory attach (after
    one untimed race of each); ``contended``: in the rings' fastest race a thread waited for the
    other to get a core (it yielded), so the rings' time is the scheduler's, not the copies'."""
    # On 4 KiB pages, whatever numpy or the process's heap would have given: the kernel pins a
    # peer's buffer page by page, so on huge pages it copies up to twice as fast (shm/pages.py),
    # and np.ones gave huge pages from 4 MiB (numpy asks for them there), so the 4 MiB rung was
    # a coin toss between launches (the kernel won it in 4 of 16 compare_peers.py launches on
    # the Zen 5 VM, and auto ran cma from 8 MiB for their user's buffers, on whatever pages).
    # auto weighs cma by this race for buffers whose pages it cannot see: it assumes the common
    # 4 KiB (torch's allocator, and numpy's below 4 MiB).
    held = [pages.array(max(nbytes, 1), np.uint8, "small") for _ in range(4)]
    held += [pages.array(_SLOT_BYTES * _NSLOTS, np.uint8, "small") for _ in range(2)]
    for buf in held:
        buf[:] = 1  # (pages touched before timing)
    total = rounds + 1
    words = np.zeros(_TIMES + 6 * total, np.int64)
    words[_BUFS : _BUFS + 6] = [x.ctypes.data for x in held]
    args = [(words, me, os.getpid(), nbytes, reps, total) for me in (0, 1)]
    other = threading.Thread(target=_races, args=args[1], name="shmcoll-cma-probe", daemon=True)
    other.start()
    _races(*args[0])
    other.join()
    times = words[_TIMES : _TIMES + 4 * total].reshape(2, total, 2)
    yields = words[_TIMES + 4 * total :].reshape(2, total).sum(axis=0)[1:]
    both = np.maximum(times[0], times[1])[1:]  # the slower thread of each race; the first untimed
    best = int(both[:, 0].argmin())
    return int(both[best, 0]), int(both[:, 1].min()), bool(yields[best] > 0)


def _kernel_wins(nbytes: int, reps: int) -> bool:
    """Whether the kernel is no slower than the rings in a race at ``nbytes``, run again after a
    pause where it won only because the rings waited for a core (:data:`_CONTENDED_PAUSES_S`)."""
    for pause in _CONTENDED_PAUSES_S:
        rings, kernel, contended = race(nbytes, reps)
        if kernel > rings or not contended:
            return kernel <= rings
        time.sleep(pause)
    rings, kernel, _ = race(nbytes, reps)
    return kernel <= rings


@functools.lru_cache(maxsize=1)
def crossover_bytes() -> int:
    """The smallest block of :data:`LADDER_BYTES` that two cores exchange by cross-memory attach
    no slower than through rings (:data:`NEVER`: none; 0: cross-memory attach is off). A size
    counts when the kernel wins two races in a row there, and a race it won because another
    process held one of the cores a moment is run again after a pause. With one core to run on,
    the smallest: every hand-off of the rings then waits for the scheduler, and a kernel copy waits
    for no one. A ladder that finds the kernel slower at the smallest block is climbed again
    after :data:`_AGAIN_AFTER_S`, and the smaller answer stands (see there).
    Measured once per process (on a 2-core VM the first size's two races took about 2 ms, the
    whole ladder 7-36 ms); the answer is kept for the process's life."""
    if not probe()[0]:
        return 0
    if len(os.sched_getaffinity(0)) < 2:
        return LADDER_BYTES[0]
    first = _ladder()
    if first == LADDER_BYTES[0]:
        return first
    time.sleep(_AGAIN_AFTER_S)
    return min(first, _ladder())


# A ladder whose answer is not the smallest block is climbed again after this long. On the 2-core
# Zen 5 VMs the answer of a process's first ladder is a moment's: right after a process starts
# the machine's two virtual cores can act for a moment as if they shared one physical core's
# caches (a copy from one to the other of 1 MiB then took 47 us, as on one core, against 100-170
# us, and 500-630 in the slowest spells), which the rings' hand-offs love, and the kernel lost every block of the ladder
# (kernel/rings 2.2 at 16 KiB, 1.3 at 1 MiB) in 6 of 80 fresh processes and won from 64 KiB-4 MiB
# in 4 more; climbed again 50 ms later, 3 of those 6 said "never" still and 3 of the 4 said 16
# KiB, and 250 ms after that every one said 16 KiB. Ranks run on long after that moment: in the same
# minutes, ``auto`` with the answer forced to "never" against "from 16 KiB", in launches taking
# turns, took 1.03-2.29x the time at 256 KiB-1 MiB in allreduce, allgather, alltoall, broadcast
# and scatter, and 1.21-2.10x at 4 MiB in allreduce, alltoall and scatter, where the rings won
# allgather at 4 MiB (0.69-0.83) and reduce_scatter from 4 MiB (0.82-0.91) (``benchmarks/RESULTS.md``,
# stop 44). Where the rings do win (another Zen 5 VM:
# kernel/rings 1.6-4.3 at every block in 11 ladders, stop 33) the second ladder says so again,
# and a launch there takes this much longer.
_AGAIN_AFTER_S = 0.25


def _ladder() -> int:
    """One climb of :data:`LADDER_BYTES` (see :func:`crossover_bytes`)."""
    for nbytes in LADDER_BYTES:
        reps = max(1, (1 << 20) // nbytes)
        # A win must hold twice: where the second thread shares the first one's core (another
        # process holding the other), the rings' hand-offs wait for the scheduler and lose.
        if _kernel_wins(nbytes, reps) and _kernel_wins(nbytes, reps):
            return nbytes
    return NEVER


def describe_crossover(crossover: int) -> str:
    """What ``auto`` makes of a :func:`crossover_bytes` answer, in words (``shmcoll info`` and
    the communicator's log)."""
    from shmcoll.units import format_size

    if crossover <= 0:
        return "off"
    if crossover >= NEVER:
        top = format_size(LADDER_BYTES[-1])
        return (
            f"two cores exchange blocks of up to {top} faster through the rings "
            "(auto weighs cma only where ranks outnumber cores, for large calls, and at 2 ranks "
            "for broadcasts from 2M, allgathers and alltoalls from 16M)"
        )
    return (
        f"two cores exchange blocks from {format_size(crossover)} on no slower by the kernel "
        "than through the rings (auto weighs cma for blocks from there)"
    )
