"""How bench and tune combine several launches' times (``bench.paired_times``)."""

from __future__ import annotations

import math

import pytest

from shmcoll.bench import Row, paired_times


def _row(algorithm: str, size: int, time_us: float) -> Row:
    return Row("allreduce", algorithm, 4, size, size // 4, "float32", "sum", -1, "out-of-place", time_us, 0, 0, 0, 0, 0)


def _get(got: dict, algorithm: str, size: int = 64) -> float:  # type: ignore[type-arg]
    return got[("allreduce", 4, "out-of-place", size, algorithm)]  # type: ignore[no-any-return]


def test_one_launch_is_the_plain_time() -> None:
    got = paired_times([[_row("ring", 64, 10.0), _row("direct", 64, 20.0)]])
    assert _get(got, "ring") == pytest.approx(10e-6) and _get(got, "direct") == pytest.approx(20e-6)


def test_algorithms_are_compared_within_each_launch() -> None:
    # The second launch is 3x slower as a whole; the third favours direct. The ratio of the
    # results is the geometric mean of the per-launch ratios, whatever the launches' scales.
    launches = [
        [_row("ring", 64, 10.0), _row("direct", 64, 11.0)],
        [_row("ring", 64, 30.0), _row("direct", 64, 33.0)],
        [_row("ring", 64, 25.0), _row("direct", 64, 20.0)],
    ]
    got = paired_times(launches)
    ratio = math.exp((2 * math.log(10 / 11) + math.log(25 / 20)) / 3)
    assert _get(got, "ring") / _get(got, "direct") == pytest.approx(ratio)
    # and the scale is the launches' typical one (their geometric means, averaged the same way)
    scale = math.exp(sum(math.log(math.sqrt(a * b)) for a, b in ((10, 11), (30, 33), (25, 20))) / 3)
    assert math.sqrt(_get(got, "ring") * _get(got, "direct")) == pytest.approx(scale * 1e-6)


def test_one_wild_launch_in_ten_is_dropped() -> None:
    steady = [[_row("ring", 64, 9.0 * k), _row("direct", 64, 10.0 * k)] for k in (1, 2, 1, 3, 1, 2, 1, 1, 2)]
    wild = [[_row("ring", 64, 30.0), _row("direct", 64, 10.0)]]  # ring 3x slower, once
    got = paired_times(steady + wild)
    assert _get(got, "ring") / _get(got, "direct") == pytest.approx(0.9)


def test_points_are_kept_apart() -> None:
    got = paired_times([[_row("ring", 64, 1.0), _row("ring", 128, 2.0), _row("direct", 128, 4.0)]])
    assert _get(got, "ring") == pytest.approx(1e-6) and _get(got, "direct", 128) == pytest.approx(4e-6)


def test_iterations_are_longer_when_ranks_outnumber_cores() -> None:
    """Oversubscribed ranks leave a barrier a scheduler slice apart: a 20 us iteration would time
    that instead of the calls, so both bench and compare_peers use 2 ms there."""
    import os

    from shmcoll import bench

    cores = len(os.sched_getaffinity(0))
    assert bench.min_iteration_s(cores) == bench.MIN_ITERATION_S
    assert bench.min_iteration_s(cores + 1) == bench.MIN_ITERATION_OVERSUBSCRIBED_S > bench.MIN_ITERATION_S


def _calls_per_iteration(monkeypatch, slow_calls: int, slow: float, fast: float, target: float) -> int:  # type: ignore[no-untyped-def]
    """bench.calls_per_iteration on a clock where the first ``slow_calls`` calls take ``slow`` s."""
    from shmcoll import bench

    clock = [0.0]
    made = [0]

    def run() -> None:
        clock[0] += slow if made[0] < slow_calls else fast
        made[0] += 1

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    return bench.calls_per_iteration(run, lambda: None, lambda t: t, target)


def test_one_slow_call_does_not_make_iterations_short(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Calls slowed by the scheduler at the start of a size (4 ranks on 2 cores: a first
    allreduce of 2.6 ms, then 6.6 us ones) must not set the calls per iteration; a single-call
    estimate gave 1 call for a 2 ms iteration, which timed the barrier's exit instead."""
    assert _calls_per_iteration(monkeypatch, 2, 2.6e-3, 6.6e-6, 2e-3) == math.ceil(2e-3 / 6.6e-6)
    assert _calls_per_iteration(monkeypatch, 1, 1.4e-3, 1e-6, 2e-3) == 1000  # capped
    assert _calls_per_iteration(monkeypatch, 0, 0.0, 5e-3, 2e-3) == 1  # calls longer than an iteration
    assert _calls_per_iteration(monkeypatch, 0, 0.0, 0.3, 2e-3) == 1  # (one batch of 1: no second)
