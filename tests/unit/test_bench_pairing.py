"""How bench and tune combine several launches' times (``bench.paired_medians``)."""

from __future__ import annotations

import math

import pytest

from shmcoll.bench import Row, paired_medians


def _row(algorithm: str, size: int, time_us: float) -> Row:
    return Row("allreduce", algorithm, 4, size, size // 4, "float32", "sum", -1, "out-of-place", time_us, 0, 0, 0, 0, 0)


def test_one_launch_is_the_plain_time() -> None:
    got = paired_medians([[_row("ring", 64, 10.0), _row("direct", 64, 20.0)]])
    assert got[("allreduce", 4, "out-of-place", 64, "ring")] == pytest.approx(10e-6)
    assert got[("allreduce", 4, "out-of-place", 64, "direct")] == pytest.approx(20e-6)


def test_a_slow_launch_does_not_reorder_the_algorithms() -> None:
    # ring is 10% faster than direct in two launches of three; the second launch is 3x slower as
    # a whole and the third is noise in direct's favour. Pooled raw medians take ring's time from
    # the noisy launch and direct's from the fast one, and call direct 20% faster.
    launches = [
        [_row("ring", 64, 10.0), _row("direct", 64, 11.0)],
        [_row("ring", 64, 30.0), _row("direct", 64, 33.0)],
        [_row("ring", 64, 25.0), _row("direct", 64, 20.0)],
    ]
    assert sorted([10.0, 30.0, 25.0])[1] / sorted([11.0, 33.0, 20.0])[1] == pytest.approx(1.25)
    got = paired_medians(launches)
    ring = got[("allreduce", 4, "out-of-place", 64, "ring")]
    direct = got[("allreduce", 4, "out-of-place", 64, "direct")]
    assert ring / direct == pytest.approx(10 / 11)
    # and the scale is the launches' typical one (the median geometric mean), not a ratio
    assert math.sqrt(ring * direct) == pytest.approx(math.sqrt(25.0 * 20.0) * 1e-6)


def test_points_are_kept_apart() -> None:
    launches = [[_row("ring", 64, 1.0), _row("ring", 128, 2.0), _row("direct", 128, 4.0)]]
    got = paired_medians(launches)
    assert got[("allreduce", 4, "out-of-place", 64, "ring")] == pytest.approx(1e-6)
    assert got[("allreduce", 4, "out-of-place", 128, "direct")] == pytest.approx(4e-6)
