"""How should several launches' times be combined before choosing an algorithm? Cross-checked.

Reads the launches that ``benchmarks/auto_vs_best.py --json FILE`` saved (every algorithm of
every collective, each launch timed separately) and, many times over, splits them at random into
two halves: one half chooses the fastest algorithm at each point with a candidate estimator, the
other half judges the pick (with the judge estimator). It prints how many points per split the
pick was more than 10% slower than the judged best. Estimators: the median of the per-launch
ratios (``median``), their geometric mean (``geomean``), the geometric mean with the top and
bottom tenth dropped (``trimmed``, what ``shmcoll.bench.paired_times`` does), and the 75th
percentile of each algorithm's ratio to the launch's fastest (``regret75``).

Run: ``python benchmarks/launch_averaging.py launches.json [--splits 60] [--seed 1]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import random
from collections.abc import Callable, Sequence

import numpy as np

Point = tuple[str, int]
Launch = dict[str, float]  # algorithm -> seconds at one point in one launch
Estimator = Callable[[Sequence[Launch]], dict[str, float]]


def _log_ratios(launches: Sequence[Launch]) -> dict[str, list[float]]:
    """Each algorithm's log time less the launch's mean log time, per launch."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    for times in launches:
        scale = sum(math.log(t) for t in times.values()) / len(times)
        for a, t in times.items():
            out[a].append(math.log(t) - scale)
    return out


def median(launches: Sequence[Launch]) -> dict[str, float]:
    return {a: float(np.median(x)) for a, x in _log_ratios(launches).items()}


def geomean(launches: Sequence[Launch], trim: float = 0.0) -> dict[str, float]:
    out = {}
    for a, x in _log_ratios(launches).items():
        x = sorted(x)
        k = int(len(x) * trim)
        out[a] = float(np.mean(x[k : len(x) - k]))
    return out


def trimmed(launches: Sequence[Launch]) -> dict[str, float]:
    return geomean(launches, 0.1)


def regret75(launches: Sequence[Launch]) -> dict[str, float]:
    regret: dict[str, list[float]] = collections.defaultdict(list)
    for times in launches:
        best = min(times.values())
        for a, t in times.items():
            regret[a].append(t / best)
    return {a: float(np.percentile(x, 75)) for a, x in regret.items()}


ESTIMATORS: dict[str, Estimator] = {"median": median, "geomean": geomean, "trimmed": trimmed, "regret75": regret75}


def by_point(rows_per_launch: Sequence[Sequence[dict]]) -> dict[Point, list[Launch]]:  # type: ignore[type-arg]
    out: dict[Point, list[Launch]] = collections.defaultdict(list)
    for rows in rows_per_launch:
        here: dict[Point, Launch] = collections.defaultdict(dict)
        for r in rows:
            here[(r["collective"], r["size"])][r["algorithm"]] = r["time_us"]
        for point, times in here.items():
            out[point].append(times)
    return out


def misses(choose: Estimator, judge: Estimator, a: dict[Point, list[Launch]], b: dict[Point, list[Launch]]) -> int:
    count = 0
    for point, launches in a.items():
        score = choose(launches)
        pick = min(score, key=score.__getitem__)
        judged = judge(b[point])
        if judge is regret75:
            ratio = judged[pick] / min(judged.values())
        else:  # log scale
            ratio = math.exp(judged[pick] - min(judged.values()))
        count += ratio > 1.10
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("launches", help="the --json file of benchmarks/auto_vs_best.py")
    ap.add_argument("--splits", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    with open(args.launches) as f:
        data = json.load(f)["launches"]
    for n, rows_per_launch in data.items():
        rng = random.Random(args.seed)
        order = list(range(len(rows_per_launch)))
        print(f"\n## {n} ranks, {len(order)} launches: points off by more than 10% per split, mean (max)")
        print(f"{'chosen by':>10} " + " ".join(f"{'judged by ' + j:>20}" for j in ("trimmed", "median")))
        results: dict[str, dict[str, list[int]]] = {c: {"trimmed": [], "median": []} for c in ESTIMATORS}
        for _ in range(args.splits):
            rng.shuffle(order)
            half = len(order) // 2
            a = by_point([rows_per_launch[i] for i in order[:half]])
            b = by_point([rows_per_launch[i] for i in order[half:]])
            for c, choose in ESTIMATORS.items():
                for j in ("trimmed", "median"):
                    results[c][j].append(misses(choose, ESTIMATORS[j], a, b))
        points = len(by_point(rows_per_launch))
        for c, per_judge in results.items():
            cells = " ".join(f"{np.mean(v):>13.2f} ({max(v):>3})" for v in per_judge.values())
            print(f"{c:>10} {cells}   of {points} points")


if __name__ == "__main__":
    main()
