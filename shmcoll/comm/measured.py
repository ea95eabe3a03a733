"""Measured choice: the ranks of a large call time the two plans ``auto`` weighs and run the faster.

For a call of ``select.MEASURED_FROM`` bytes or more, ``auto`` weighs cross-memory attach
(``cma``) against the rings from rules read off measurements (the launch's race, the tables in
``algos/cma.py``). On the 2-core Zen 5 VM the speed at which the two cores hand each other data
changes within seconds, and with it which plan wins: a 1 MiB in-place allreduce took 609-2009 us
through the rings and 106 through ``cma`` in a slow spell, 183-300 against 124 a minute later; at
16 MiB on 4 KiB pages ``cma`` took 1.05-1.68x the best ring's time in 5 launches of 6 and
0.30-0.52x in the sixth (``benchmarks/RESULTS.md``, stop 44). A rule read once is a snapshot. So
such a call shape keeps both plans (``Call.other``: ``auto``'s pick, and ``cma`` or the best
plan without it, ``select.rival``) and chooses at every call, from what this run measures:

1. each rank times its calls of the shape, from its vote to the call's end (``took``);
2. at calls the shape's history sets, every rank votes for the plan the shape is not running now
   (an *exploration*: that plan runs once and every rank times it). The first is the shape's
   second call; the gap doubles from 8 calls to 256 while the choice stands and falls back to 8
   when it changes, so a choice that holds costs one call of the other plan in 256;
3. at the other calls each rank votes for the plan whose last three times have the lower median,
   and keeps the plan it runs unless the other is ``MARGIN`` faster.

The votes are agreed as ``comm.pages`` agrees on pages (the same words and engine entry): the
other plan runs only where every rank votes for it, and a rank that votes against goes on at
once. Every rank runs the same plan at every call, so each rank's history of the shape (which
plan ran at each call) is the same, and so are its explorations; only the votes between them
come from each rank's own clock, and where ranks disagree ``auto``'s pick runs.

Where the plans reduce in different orders (allreduce, reduce_scatter and reduce above 2 ranks)
a float reduction's last bits follow the plan chosen: every rank still gets the same bits at
every call, but two runs of a program may differ. A named algorithm runs its one plan.
"""

from __future__ import annotations

FIRST_GAP = 8  # calls between explorations after the choice changes (and after the first)
LAST_GAP = 1024  # ... at most, while it stands: one call in 1024 runs the slower plan
MARGIN = 0.9  # the plan not running now is voted for where its estimate is under this share
_KEPT = 3  # times kept per plan (their least is the plan's estimate)


class Measured:
    """One call shape's measurements and votes (see the module doc). Plan 0 is ``auto``'s pick,
    plan 1 the call shape's ``other``. Everything but ``times`` and ``prefer`` follows from the
    plans the ranks agreed on, so it is the same on every rank."""

    __slots__ = ("times", "prefer", "calls", "explore_at", "gap", "steady", "last", "exploring", "runs", "changes")

    def __init__(self) -> None:
        self.times: tuple[list[int], list[int]] = ([], [])  # each plan's last times, ns
        self.prefer = False  # this rank's vote outside explorations, from its times
        self.calls = 0  # of this shape, on this rank (the same on every rank)
        self.explore_at = 2  # the next exploration's call
        self.gap = FIRST_GAP // 2  # (doubled at the first exploration)
        self.steady = 0  # the plan the last call that was not an exploration ran
        self.last = 0  # the plan the last call ran
        self.exploring = False  # whether the last call was an exploration
        self.runs = [0, 0]  # calls each plan ran
        self.changes = 0  # times the steady plan changed

    def vote(self) -> bool:
        """This rank's vote for the next call: True for the other plan."""
        self.calls += 1
        self.exploring = self.calls == self.explore_at
        return self.steady == 0 if self.exploring else self.prefer

    def ran(self, plan: int) -> bool:
        """The ranks agreed on ``plan`` for the call just voted on: True where the steady plan
        changed (not at an exploration)."""
        self.last = plan
        self.runs[plan] += 1
        if self.exploring:
            if self.runs[plan] < 2:  # a plan's first run is not timed: explore it once more
                self.explore_at = self.calls + 1
            else:
                self.gap = min(2 * self.gap, LAST_GAP)
                self.explore_at = self.calls + self.gap
            return False
        if plan == self.steady:
            return False
        self.steady = plan
        self.changes += 1
        self.gap = FIRST_GAP
        self.explore_at = self.calls + FIRST_GAP
        return True

    def took(self, ns: int) -> None:
        """The call just agreed on took ``ns`` on this rank. A plan's first run is left out: it
        pays for first touches (its scratch, the pages a kernel copy pins)."""
        last = self.last
        if self.runs[last] < 2:
            return
        kept = self.times[last]
        kept.append(ns)
        if len(kept) > _KEPT:
            del kept[0]
        running, other = self.times[self.steady], self.times[1 - self.steady]
        if running and len(other) >= 2:
            # The plan running now: the least of its last three times (this machine's noise only
            # ever adds: a preempted rank, a peer late into the call). The other: the larger of
            # its last two, taken at explorations, so that one lucky call does not move the
            # choice (it would stand until two more explorations).
            switch = max(other[-1], other[-2]) < MARGIN * min(running)
            self.prefer = switch if self.steady == 0 else not switch

    def describe(self) -> str:
        """Each plan's estimate, for the log."""
        return ", ".join(f"plan {p}: {min(t) / 1e3:.1f} us" if t else f"plan {p}: -" for p, t in enumerate(self.times))
