"""Does ``algorithm="auto"`` pick the fastest algorithm? Measured, per collective and size.

For each world size, the whole ``shmcoll bench`` sweep runs with every registered algorithm of
every collective (out of place, float32 SUM, root 0), ``--repeat`` times, each in a launch of its
own; each algorithm's time per size is the median over the launches, compared launch by launch
(``shmcoll.bench.paired_times``, as ``shmcoll tune`` does). Then, for each size, the script
asks the selection which algorithm ``auto`` runs (the same call the communicator makes, with the
same tune table: ``SHMCOLL_TUNE_FILE``) and compares that algorithm's measured time with the
fastest one's. Judging auto's *pick* against the same run's measurements, rather than timing
auto as one more contestant, keeps run-to-run noise out of the comparison.

``--interleave`` runs twice as many launches and makes the tune table from the even ones (with
tune's own code) and judges its picks on the odd ones. A tune run and a later check can fall in
different spells of this machine (memory-bound work 2-3x slower for minutes), where the ranking
of algorithms within ~15% of each other differs; interleaved, both halves see the same spells,
so what is judged is the choice, not the drift.

Run: ``python benchmarks/auto_vs_best.py [-n 2,4] [--repeat 15] [--iters 30] [-e 8M]
[--registered] [--interleave] [--json launches.json]`` (``--registered``: buffers from
``comm.alloc``, where ``zerocopy`` competes). Prints one table per world size and collective,
and the sizes where auto's pick is more than ``--tolerance`` (10%) slower than the best; exits 1
if there are any.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import numpy as np

from shmcoll import bench, collectives, config, tune, units
from shmcoll.algos import select
from shmcoll.algos.registry import Query
from shmcoll.collectives import COLLECTIVES
from shmcoll.shm import cma


def auto_pick(
    collective: str, world_size: int, total_count: int, itemsize: int, registered: bool, table: Any = None
) -> str:
    """The algorithm ``auto`` runs for this call: with ``table``, the one it would choose from that
    table; else the communicator's own choice (``SHMCOLL_TUNE_FILE``, ``SHMCOLL_ALGO``)."""
    count = total_count // world_size if collectives.get(collective).blocked else total_count
    cfg = config.get()
    # (as the communicator asks: cross-memory attach competes where this machine permits it, from
    # sizes that depend on how this machine's kernel copies against its rings; this process's own
    # measurement of that)
    permitted = not registered and cma.probe()[0]
    query = Query(
        collective,
        world_size,
        count,
        itemsize,
        root=0,
        registered=registered,
        cma=permitted,
        cma_crossover=cma.crossover_bytes() if permitted and world_size > 1 else 0,
        cores=os.cpu_count() or 0,
    )
    if table is not None:
        return select.decide(query, table=table, slot_bytes=cfg.slot_bytes, nslots=cfg.nslots).algorithm.name
    return select.choose(query, "auto", slot_bytes=cfg.slot_bytes, nslots=cfg.nslots).name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--nprocs", default="2,4")
    ap.add_argument("-c", "--collectives", default=",".join(COLLECTIVES))
    ap.add_argument("-b", "--min-bytes", default="8")
    ap.add_argument("-e", "--max-bytes", default="8M")
    ap.add_argument("-f", "--step-factor", type=float, default=4.0)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument(
        "--registered",
        action="store_true",
        help="buffers from comm.alloc (zerocopy competes; scatter has no such form)",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="2x --repeat launches: the even ones make the tune table (as shmcoll tune would), the odd "
        "ones judge its picks, so both halves see the same stretch of the machine's time",
    )
    ap.add_argument("--json", help="write every launch's rows here")
    args = ap.parse_args()
    collectives = tuple(c for c in args.collectives.split(",") if not (args.registered and c == "scatter"))
    itemsize = np.dtype(np.float32).itemsize
    bad = []
    saved: dict[str, list[list[dict[str, Any]]]] = {}
    for n in (int(x) for x in args.nprocs.split(",")):
        launches: list[list[bench.Row]] = []
        counts: dict[tuple[str, int], int] = {}
        total = args.repeat * (2 if args.interleave else 1)
        for rep in range(total):
            cfg = bench.BenchConfig(
                collectives=collectives,
                algorithms=("all",),
                nprocs=n,
                min_bytes=units.parse_size(args.min_bytes),
                max_bytes=units.parse_size(args.max_bytes),
                step_factor=args.step_factor,
                iters=args.iters,
                warmup=args.warmup,
                modes=("out-of-place",),
                registered=args.registered,
                progress=False,
            )
            print(f"# {n} ranks: launch {rep + 1}/{total}", file=sys.stderr, flush=True)
            launches.append(bench.run(cfg, timeout=3600))
            for row in launches[-1]:
                counts[(row.collective, row.size)] = row.count
        saved[str(n)] = [[dataclasses.asdict(r) for r in rows] for rows in launches]
        table = None
        judged = launches
        if args.interleave:
            existing = select.load_table(config.get().tune_file)
            model = existing.model if existing is not None else select.default_model()
            measured = tune._measured(launches[0::2], registered=args.registered)
            table = select.TuneTable(model, config.get().slot_bytes, tuple(measured), "the even launches")
            judged = launches[1::2]
        times = {(c, a, s): t * 1e6 for (c, _, _, s, a), t in bench.paired_times(judged).items()}
        for collective in collectives:
            algs = sorted({a for c, a, _ in times if c == collective})
            sizes = sorted({s for c, _, s in times if c == collective})
            print(
                f"\n## {collective}, {n} ranks: us per call over {len(judged)} launches compared side by side;"
                " * = auto's pick"
            )
            print(f"{'size':>10} " + " ".join(f"{a:>17}" for a in algs) + f" {'auto/best':>10}")
            for size in sizes:
                med = {a: times[(collective, a, size)] for a in algs}
                pick = auto_pick(collective, n, counts[(collective, size)], itemsize, args.registered, table)
                best = min(med, key=med.__getitem__)
                ratio = med[pick] / med[best]
                cells = " ".join(f"{med[a]:>16.2f}{'*' if a == pick else ' '}" for a in algs)
                flag = "  <-- more than the tolerance" if ratio > 1 + args.tolerance else ""
                print(f"{size:>10} {cells} {ratio:>10.2f}{flag}")
                if flag:
                    bad.append(f"{collective} n={n} {size} B: auto runs {pick} ({ratio:.2f}x {best})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "launches": saved}, f)
    print()
    if bad:
        print(f"auto's pick slower than the best by more than {args.tolerance:.0%}:")
        print("\n".join("  " + b for b in bad))
        return 1
    print(f"auto's pick is within {args.tolerance:.0%} of the best measured algorithm at every size")
    return 0


if __name__ == "__main__":
    sys.exit(main())
