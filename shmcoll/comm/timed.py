"""Timed choice: a call shape whose ranks choose between two plans at every call by what the
calls of each took, agreed as the pages are.

On a machine whose cores hand each other data at a speed that changes from launch to launch (a
VM's virtual cores: ``benchmarks/RESULTS.md``, stops 48-50), the rings and the kernel's copies
(``cma``) trade places. On the 2-core Zen 4 VM, reduce of 1 MiB at 4 ranks, calls of ``ring``
and ``cma`` taking turns in one launch: 180-230 us against 300-360 in quiet launches, 560-1160
against 340-460 in slow ones, and whichever was faster won 92-100% of the pairs of its launch. A
choice made once per call shape, or once per launch by the race of ``shm/cma.py`` (whose
two-thread race does not see what four ranks on two cores see), is wrong in one kind of launch
or the other. So where ``auto``'s pick is not ``cma`` and cma's registration says a call of the
shape may be timed (``Algorithm.auto_timed``), the call shape carries both plans (``Call.huge``:
the plan every rank runs where every rank votes for it) and a :class:`Timed` per rank.

One rank times the calls and decides, the *leader* (the root of a reduce, the rank before the
root of a broadcast, else rank 0): the root of a reduce is the rank that waits for the whole
call, where its peers may leave early, and a broadcast's root is the one that may leave early
(``calls._FROM_ROOT``). It times each call from before its vote to the engine's return, not what
the program does between calls. (Timed from one call's start to the next's, a benchmark's barriers and the other
algorithms it times in turn landed in the times and made them a coin toss: cma ran at 1.6x the
rings' time for 9 calls in a row in quiet launches.)

- The first calls of the shape run ``auto``'s plan (:data:`FIRST_CALLS`), then a few run cma
  (:data:`WARM_CALLS`; the first call of each plan is not counted, and the fastest of the next
  ones is the plan's first estimate).
- From then on the leader votes for cma while cma's estimate is under :data:`SWITCH` times the
  other's, and back once the other's is no more than cma's (a band, so that noise does not flip
  it); the estimates follow each call (:data:`WEIGHT`), a call counting as twice the estimate at
  most (one that lost its core for a time slice says nothing about the plan).
- The plan not being run is timed again now and then, for :data:`PROBE_LEN` calls in a row, the
  median of them replacing its estimate, which is a spell's old (:data:`PROBE_CALLS`): every 16
  calls while cma runs, half as often each time a probe finds cma still faster, down to every
  256; every 512 while the other runs.

The other ranks vote as the leader last did: it writes its vote in its rank record
(``layout.R_TIMED``), where they read it without waiting. The ranks then agree before each call as for the pages
(:func:`shmcoll.comm.pages.agreed`): cma runs only where every rank voted for it, a rank that
votes against runs the other plan at once, without waiting, and cma's syncs wait for every rank,
as the agreement requires. So every rank runs the same plan at every call; where a rank read the
leader's vote of an earlier call (the leader was behind, or changed its mind), the call runs
``auto``'s plan, which is why a probe lasts several calls. (An earlier version let every rank
vote by its own times: a reduce's ranks take different times (a leaf of ``dbtree`` leaves early),
the votes disagreed at 4 ranks on up to 90% of the calls, and the rings then ran with the ranks
waiting for each other's votes.)

What it costs: on a call a program's loop repeats (the lean path, calls of up to 1 MiB), the
agreement is made and the plan agreed on run in the engine's entry (``comm.pages.lean``), and the
leader times one call in :data:`SAMPLE` there, voting for the next calls in Python after it
(:meth:`Timed.quiet_calls`; the calls of a probe each); elsewhere, two clock reads,
the vote and the agreement in Python at every call (about 1-2 us, more where ranks outnumber cores:
a rank late at a call's start makes its peers' waits yield and sleep), which is why only calls
from :data:`TIMED_FROM` bytes are timed (:data:`PAIR_FROM` at 2 ranks, :data:`BROADCAST_FROM`
for a broadcast, which the lean path keeps); the first calls of cma, where it is the slower; and
in a quiet launch 3 calls of cma of every 512. Asking for
an algorithm by name, or setting ``SHMCOLL_ALGO``, turns it off; ``SHMCOLL_DEBUG=INFO`` logs each
change of plan. The leader's vote is one word, which every timed call shape writes, so where two
timed shapes take turns, the other ranks may read the leader's vote on the other shape: the calls
then run ``auto``'s plan more often, or cma less often, than the leader asks, never different
plans.

A call shape that is page-aware as well (a 2-rank reduce from 1 MiB, whose huge-page plan is
cma) keeps both reasons: a rank votes for cma where the leader's times say so or where its own
buffers are on huge pages, so cma runs where every rank's buffers are on huge pages, as before,
and on any pages where the leader's times ask for it. (The others follow the leader's times, not
its agreement word: a leader on huge pages votes yes there whatever its times say, and a peer on
4 KiB pages reading that as the leader's times would run cma where the pages ask for the rings.)
"""

from __future__ import annotations

TIMED_FROM = 4 << 20
"""Bytes from which a call shape may be timed. Where the plan does not change, the timed call
costs more than its vote's microseconds, by a share that falls with the size (2-core VM, stop
50, quiet launches): 8-35% at 256 KiB (calls of 30-45 us at 3-4 ranks), about 8% at 1 MiB in a
loop of calls (10 us of 125), more in ``shmcoll bench`` (1.2x and worse), 1-9% at 4 MiB. The
cause of most of it was not found (stop 45 met the same with a choice like this one); stop 52
found most of it on smaller calls to be the Python of every call on every rank, which the lean
path's calls (up to 1 MiB) now leave to the engine's entry."""

PAIR_FROM = 256 << 10
"""Bytes from which a call shape of 2 ranks may be timed. There the rings lose most in the slow
spells (2-core Zen 4 VM, stop 51: a side-by-side run's 2-rank reduce took 470-570 us at 1 MiB in
all three of its launches, against Open MPI's 107-135 and its own 120 in quiet launches, 8 KiB
to 16 MiB alike); from 1 MiB, where ``auto``'s 2-rank reduce also looks at the ranks' pages, the
two choices share one agreement (``Timed.paged``). From 256 KiB since stop 52, where a call the
lean path remembers agrees in compiled code (``benchmarks/timed_choice.py -n 2 --from 256K``, 10
launches): ``auto`` over ``direct`` 0.86-1.02 at 256 KiB and 0.92-1.03 at 512 KiB in the 7 quiet
launches, 0.30-0.36 and 0.27-0.34 in the 3 slow ones (cma's time there 1.13-1.39x and
1.13-1.55x).
Not below: at 64 KiB a launch in which the rings were quicker than usual (4.1 us a call against
8) had ``auto`` at 1.32x their time."""


BROADCAST_FROM = 256 << 10
"""Bytes from which a broadcast may be timed (3 ranks and more: ``algos.cma``'s
``_broadcast_timed``). A broadcast's rings lose more in the VM's slow launches than a
reduction's, and from smaller calls (2-core Zen 4 VM, stop 52, 4 ranks, ``dbtree`` / cma in one
launch, 3 slow launches of 8: 256 KiB 203-212 against 77-90 us, 512 KiB 390-505 against 127-160;
in the 5 quiet ones 44-57 against 56-87, 78-88 against 98-125). From 512 KiB at stop 52; from
256 KiB since stop 53, where the entry agrees on cma too and the leader votes after its calls
(``benchmarks/timed_choice.py -n 4 -c broadcast --sizes 256K --from 256K --calls 200``): 0.48-0.57x
``dbtree``'s time in 3 slow launches of 12 (1.07-1.45x cma's), 0.96-1.10x in the 9 quiet ones
(median 1.03); at 3 ranks 0.62-0.93x in 6 slow launches of 8, 0.99 and 1.20 in the 2 quiet ones.
(Stop 52, with cma's calls agreed in Python, gained nothing at 256 KiB in slow launches.)"""


def timed_from(collective: str, world_size: int) -> int:
    """Bytes from which a call shape of ``collective`` at ``world_size`` ranks may be timed."""
    if collective == "broadcast":
        return BROADCAST_FROM
    return PAIR_FROM if world_size == 2 else TIMED_FROM


SWITCH = 0.8
"""cma is voted for once its estimate is under this share of the other plan's; the other is voted
for again once its estimate is no more than cma's."""

WEIGHT = 0.25
"""How much a call's time moves its plan's estimate (an exponential average)."""

FIRST_CALLS = 8
"""Calls of the shape's own plan before cma is first tried: a shape called only a few times (a
benchmark's large sizes, a program's setup) never pays for trying it. The fastest of their
times (but the first's) is the plan's first estimate: a launch's first calls wait for ranks
still starting and for first touches."""

WARM_CALLS = 3
"""Calls of cma the leader asks for after :data:`FIRST_CALLS` (for at most
:data:`EXPLORE_CALLS` calls, until that many have run). The first call of each plan is not
counted (it touches scratch and output pages for the first time), and the fastest of the next
ones is the plan's first estimate: on the VM the first calls of a launch took 25-30 ms at 3
ranks, waiting for ranks still starting, where later calls of 256 KiB took 0.1."""

EXPLORE_CALLS = 3 * WARM_CALLS

PROBE_LEN = 3
"""Calls in a row for which the plan not being run is asked for when it is timed again. Their
median, not their fastest, is the plan's new estimate: in the VM's slow launches the rings' calls
of a 4-rank broadcast of 256 KiB took 114-182 us at their 25th percentile on the leader and
131-192 at their median, where the loop of them took 189-256 us a call, against cma's 104-116;
the fastest of a probe's calls sent the leader back to the rings after each probe
(``benchmarks/RESULTS.md``, stop 53)."""

PROBE_CALLS = (16, 256, 512)
"""Every how many calls the plan not being run is timed again: while cma runs, first (doubling
up to the second as long as a probe finds cma still faster); while the other runs, the third."""

SAMPLE = 4
"""While no probe is due and its mind stays, the leader votes and times one call in this many;
the others run from compiled code, as on the other ranks (``comm.pages.lean``: Python's part of
a call is most of what a timed shape costs)."""


class Timed:
    """One rank's part in the timed choice of a call shape (see the module doc): on the leader
    (``leader``), its timings of the shape's two plans (``estimate_ns``: the shape's own plan
    first, 0 before it is timed) and its vote; elsewhere, where to read the leader's vote. ``paged``: the shape
    is also page-aware (cma as its huge-page plan): a rank on huge pages votes for cma anyway."""

    __slots__ = (
        "leader",
        "leader_word",
        "quiet",
        "last_vote",
        "paged",
        "calls",
        "estimate_ns",
        "counted",
        "on_alt",
        "probe_every",
        "probing",
        "probe_fresh",
        "probe_times",
        "last_alt",
        "since",
    )

    def __init__(self, leader_rank: int, rank: int, paged: bool = False, leader_word: int = -1) -> None:
        self.leader = leader_rank == rank
        # The control word where the leader writes its vote (layout.R_TIMED), which the others
        # read at every call (-1: a Timed made without an arena, as the unit tests make).
        self.leader_word = leader_word
        self.quiet = 0  # calls the leader's lean entry was last let make without voting (quiet_calls)
        self.last_vote = False  # (its vote at its last call: its vote word says so until its next vote)
        # The call shape is page-aware too: a rank whose buffers are on huge pages votes for cma
        # whatever the leader's times say (comm.pages.agreed).
        self.paged = paged
        self.calls = 0
        self.estimate_ns = [0.0, 0.0]
        self.counted = [0, 0]  # calls of each plan timed (the first of each is not counted)
        self.on_alt = False
        self.probe_every = PROBE_CALLS[0]
        self.probing = False  # the call runs the plan not being run, to time it again
        self.probe_fresh = False  # no call of this probe counted yet
        self.probe_times: list[int] = []  # what this probe's calls took
        self.last_alt = False  # whether it ran the other plan
        self.since = 0  # the call after which the leader last changed its mind (probes count from it)

    def vote(self) -> bool:
        """The leader's vote for the other plan at its next call of the shape."""
        self.last_vote = vote = self._vote()
        return vote

    def _vote(self) -> bool:
        self.calls = c = self.calls + 1
        if c <= FIRST_CALLS:
            return False
        if self.counted[1] < WARM_CALLS:  # cma not yet timed: ask for it, for a while
            return c <= FIRST_CALLS + EXPLORE_CALLS
        if not self.estimate_ns[0]:
            return False
        every = self.probe_every if self.on_alt else PROBE_CALLS[2]
        after = c - self.since
        phase = after % every if after >= every else every
        if phase == 0:
            self.probe_fresh = True
        elif phase == PROBE_LEN and self.on_alt and not self.probe_fresh:
            # (a probe of the rings has just found them still slower: probe half as often)
            self.probe_every = min(2 * every, PROBE_CALLS[1])
        self.probing = phase < PROBE_LEN
        return self.on_alt != self.probing

    def quiet_calls(self) -> int:
        """How many of the next calls need not be voted on or timed, the vote staying the last
        one (at most ``SAMPLE - 1``; none while a probe runs, before both plans are timed, where
        the last vote is not the plan the leader now prefers, nor past the call before the next
        probe): the leader makes them without its Python side, and adds them to :attr:`calls`
        before its next vote."""
        if self.probing or self.last_vote != self.on_alt or self.counted[1] < WARM_CALLS or not self.estimate_ns[0]:
            return 0
        every = self.probe_every if self.on_alt else PROBE_CALLS[2]
        to_probe = every - (self.calls - self.since) % every  # (calls from now to the next probe's first)
        return max(0, min(SAMPLE, to_probe) - 1)

    def ran(self, alt: bool) -> None:
        """Which plan the ranks agreed on for the call just voted on."""
        self.last_alt = alt

    def took(self, elapsed_ns: int) -> None:
        """What the call just voted on took, from before the vote to the engine's return."""
        self._count(self.last_alt, elapsed_ns)

    def _count(self, alt: bool, elapsed_ns: int) -> None:
        which = int(alt)
        counted = self.counted[which] = self.counted[which] + 1
        if counted == 1:
            return  # (first touches)
        est = self.estimate_ns
        if counted <= (WARM_CALLS if alt else FIRST_CALLS):
            # The fastest warm call: the first calls of a launch also wait for ranks still
            # starting, or for a program's (a benchmark's) first barriers around them.
            est[which] = float(elapsed_ns) if not est[which] else min(est[which], elapsed_ns)
        elif self.probing and which != self.on_alt:
            if self.probe_fresh:
                self.probe_times.clear()
            self.probe_fresh = False
            times = self.probe_times
            times.append(elapsed_ns)
            times.sort()
            half = len(times) // 2
            est[which] = float(times[half] if len(times) % 2 else (times[half - 1] + times[half]) / 2)
            if len(times) < PROBE_LEN:
                return  # (decided on the probe's median: one fast call is no reason to switch)
        else:  # (a call preempted for a time slice counts as twice the estimate at most)
            est[which] += WEIGHT * (min(elapsed_ns, 2 * est[which]) - est[which])
        if not (est[0] and est[1]):
            return
        if self.on_alt:
            if est[0] <= est[1]:
                self.on_alt, self.since, self.probing = False, self.calls, False
        elif est[1] < SWITCH * est[0]:
            self.on_alt, self.since, self.probing = True, self.calls, False
            self.probe_every = PROBE_CALLS[0]
