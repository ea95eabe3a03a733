"""The timed choice's leader (``comm/timed.py``), fed made-up call times: which plan it votes for at
each call as the two plans' times change, the other ranks following its every vote."""

from __future__ import annotations

from shmcoll.comm.timed import EXPLORE_CALLS, FIRST_CALLS, PROBE_CALLS, PROBE_LEN, WARM_CALLS, Timed

START = FIRST_CALLS + WARM_CALLS  # the calls before the leader votes by its estimates


class Leader:
    """A leader whose calls take the time of the plan it voted for."""

    def __init__(self) -> None:
        self.t = Timed(0, 0)

    def run(self, calls: int, own_us: float, alt_us: float) -> list[bool]:
        votes = []
        for _ in range(calls):
            vote = self.t.vote()
            self.t.ran(vote)
            votes.append(vote)
            self.t.took(int(1000 * (alt_us if vote else self.own(own_us))))
        return votes

    def own(self, own_us: float) -> float:
        """What a call of the rings takes."""
        return own_us


def _numbers(first: int, votes: list[bool], which: bool) -> list[int]:
    """The call numbers (from ``first``) at which the vote was ``which``."""
    return [first + i for i, v in enumerate(votes) if v is which]


def test_warm_calls_run_each_plan_then_the_faster_is_kept() -> None:
    lead = Leader()
    assert lead.run(START, 200, 300) == [False] * FIRST_CALLS + [True] * WARM_CALLS
    votes = lead.run(PROBE_CALLS[2] - START - 1, 200, 300)
    assert not any(votes)  # cma slower: not asked for again until its probe
    votes = lead.run(PROBE_LEN + 1, 200, 300)
    assert votes == [True] * PROBE_LEN + [False]  # (the probe: calls 512-514)


def test_cma_is_taken_when_the_rings_slow_down_and_left_when_they_recover() -> None:
    lead = Leader()
    lead.run(START, 200, 300)
    # The rings slow to 700 us: the estimate follows within a few calls, then cma is voted for.
    votes = lead.run(8, 700, 300)
    assert votes[0] is False and votes[-1] is True
    first = votes.index(True)
    assert 1 <= first <= 6 and all(votes[first:])
    # Still slow: the rings are probed for PROBE_LEN calls in a row, 16 calls after the switch,
    # then half as often each time.
    start = lead.t.calls + 1
    votes = lead.run(300, 700, 300)
    probes = _numbers(start, votes, False)
    runs = [c for c in probes if c - 1 not in probes]
    assert all(c + k in probes for c in runs for k in range(PROBE_LEN)) and len(probes) == PROBE_LEN * len(runs)
    gaps = [b - a for a, b in zip(runs, runs[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[0] >= PROBE_CALLS[0] and gaps[-1] > gaps[0], runs
    # Quiet again: the next probe of the rings finds them faster, and they are kept.
    votes = lead.run(PROBE_CALLS[1] + PROBE_LEN, 200, 300)
    back = votes.index(False)
    assert not any(votes[back:])


class Spread(Leader):
    """A leader whose rings' calls take in turn the times of ``own_cycle`` (a slow spell: most a
    little under their mean, some far over it)."""

    def __init__(self, own_cycle: list[float]) -> None:
        super().__init__()
        self.cycle = own_cycle
        self.own_calls = 0

    def own(self, own_us: float) -> float:
        self.own_calls += 1
        return self.cycle[(self.own_calls - 1) % len(self.cycle)]


def test_a_probe_of_rings_whose_calls_are_spread_counts_their_median() -> None:
    """The rings' calls 100, 190 or 310 us in turn (mean 200), cma's 120: cma is kept, though one
    call of the rings in three is faster than cma's."""
    lead = Spread([100, 190, 310])
    lead.run(START, 0, 120)
    lead.run(64, 0, 120)
    votes = lead.run(3 * PROBE_CALLS[1], 0, 120)
    assert lead.t.on_alt
    assert votes.count(False) <= 8 * PROBE_LEN, votes.count(False)  # (the probes alone)


def test_a_noisy_call_does_not_flip_the_vote() -> None:
    lead = Leader()
    lead.run(START + 1, 200, 300)
    assert lead.run(1, 2000, 300) == [False]  # one call 10x slower (a preemption)
    assert not any(lead.run(20, 200, 300))


def test_a_band_between_the_two_thresholds_keeps_the_current_plan() -> None:
    lead = Leader()
    lead.run(START, 200, 180)  # cma 0.9 of the rings: not enough to switch
    assert not any(lead.run(30, 200, 180))
    lead = Leader()
    lead.run(START, 400, 180)
    votes = lead.run(10, 400, 180)
    assert votes.count(False) <= PROBE_LEN
    # The rings recover to 1.1x cma's: inside the band, cma stays but for the probes.
    votes = lead.run(64, 200, 180)
    assert sum(votes) >= 64 - 4 * PROBE_LEN


def test_the_first_call_of_each_plan_is_not_counted_and_warm_calls_count_their_fastest() -> None:
    lead = Leader()
    lead.run(1, 50_000, 0)  # first touches: 50 ms
    assert lead.t.estimate_ns[0] == 0.0
    lead.run(1, 30_000, 0)  # a rank still starting
    assert lead.t.estimate_ns[0] == 30_000_000
    lead.run(1, 200, 0)
    assert lead.t.estimate_ns[0] == 200_000
    lead.run(FIRST_CALLS - 3, 400, 0)
    assert lead.t.estimate_ns[0] == 200_000  # (the fastest of the first calls)


def test_cma_is_asked_for_a_while_when_the_calls_do_not_run_it() -> None:
    """(The other ranks may read an earlier vote of the leader's: the call then runs the rings.)"""
    t = Timed(0, 0)
    votes = []
    for _ in range(FIRST_CALLS + EXPLORE_CALLS + 20):
        votes.append(t.vote())
        t.ran(False)  # a peer voted against every time
        t.took(200_000)
    assert votes == [False] * FIRST_CALLS + [True] * EXPLORE_CALLS + [False] * 20


def test_only_the_leader_times() -> None:
    assert Timed(2, 2).leader and not Timed(2, 0).leader


def _quiet_run(lead: Leader, calls: int, own_us: float, alt_us: float) -> list[bool | str]:
    """As ``Leader.run``, with the calls ``Timed.quiet_calls`` lets the leader make without voting
    made so, as ``comm.pages.voted`` does ("own" or "cma": no vote, untimed, the plan of the
    leader's last vote)."""
    votes: list[bool | str] = []
    while len(votes) < calls:
        votes += lead.run(1, own_us, alt_us)
        quiet = min(lead.t.quiet_calls(), calls - len(votes))
        lead.t.calls += quiet
        votes += ["cma" if lead.t.last_vote else "own"] * quiet
    return votes


def test_quiet_calls_sample_the_own_plan_and_stop_before_each_probe() -> None:
    from shmcoll.comm.timed import SAMPLE

    lead = Leader()
    assert lead.t.quiet_calls() == 0  # (nothing timed yet)
    votes = _quiet_run(lead, START, 200, 300)
    assert all(isinstance(v, bool) for v in votes)  # (the first calls and cma's warm calls are all timed)
    votes = _quiet_run(lead, 2 * PROBE_CALLS[2], 200, 300)
    # One call in SAMPLE is voted on and timed while the rings run; the probes of cma come at the
    # calls they would without the quiet calls, every PROBE_CALLS[2] calls.
    first = START + 1
    probes = [c + k for c in (PROBE_CALLS[2], 2 * PROBE_CALLS[2]) for k in range(PROBE_LEN)]
    assert _numbers(first, votes, True) == probes
    assert "cma" not in votes
    voted = [i for i, v in enumerate(votes) if isinstance(v, bool)]
    assert len(voted) <= len(votes) // SAMPLE + 2 * (PROBE_LEN + SAMPLE)
    assert max(b - a for a, b in zip(voted, voted[1:], strict=False)) == SAMPLE
    # The rings slow down: seen at a sampled call, then cma, voted on and timed at one call in
    # SAMPLE too, but for the probes of the rings, whose calls are all voted on (each finding cma
    # still faster: the next one twice as far, up to PROBE_CALLS[1]).
    votes = _quiet_run(lead, 40 + 2 * PROBE_CALLS[1], 900, 300)
    assert lead.t.on_alt
    tail = votes[40:]
    assert "own" not in tail  # (no quiet call of the rings)
    own = [i for i, v in enumerate(tail) if v is False]
    starts = own[::PROBE_LEN]
    assert own == [s + k for s in starts for k in range(PROBE_LEN)], own
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    doubling = [g for g in (32, 64, 128, 256, 512) if g <= PROBE_CALLS[1]]
    assert gaps == doubling[: len(gaps)] and gaps[-1] == PROBE_CALLS[1], gaps
    voted = [i for i, v in enumerate(tail) if isinstance(v, bool)]
    assert len(voted) <= len(tail) // SAMPLE + len(starts) * (PROBE_LEN + 1), len(voted)
    assert max(b - a for a, b in zip(voted, voted[1:], strict=False)) == SAMPLE
    assert lead.t.probe_every == PROBE_CALLS[1]
