"""The command line: bench's table, #wrong detection and JSON; run; info; cleanup."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from click.testing import CliRunner

from shmcoll.cli.main import main
from shmcoll.collectives import COLLECTIVES

SMALL = ["-n", "2", "-b", "8", "-e", "2K", "-f", "4", "--iters", "3", "--warmup", "1", "--quiet"]


def _shmcoll(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmcoll.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_help_and_version() -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    for cmd in ("bench", "run", "info", "cleanup"):
        assert cmd in result.output
    assert "0.1.0" in runner.invoke(main, ["--version"]).output


def test_bench_table_columns_and_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "rows.json"
    proc = _shmcoll("bench", *SMALL, "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if "size" in line and "count" in line)
    for column in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"):
        assert column in header
    assert "out-of-place" in proc.stdout and "in-place" in proc.stdout
    rows = [line for line in lines if not line.startswith("#")]
    assert [int(r.split()[0]) for r in rows] == [8, 32, 128, 512, 2048]
    assert all(r.split()[2] == "float32" and r.split()[3] == "sum" for r in rows)
    assert "Out of bounds values : 0 OK" in proc.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["nprocs"] == 2
    assert len(data["rows"]) == 10  # 5 sizes x 2 modes
    row = data["rows"][0]
    for key in ("collective", "algorithm", "size", "count", "time_us", "algbw", "busbw", "wrong", "mode"):
        assert key in row
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in data["rows"])


def test_bench_counts_wrong_results() -> None:
    proc = _shmcoll("bench", *SMALL, "--inject-error", "--out-of-place", "-c", "allreduce,allgather")
    assert proc.returncode == 1
    assert "FAILED" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert rows and all(int(r.split()[-1]) == 1 for r in rows)


def test_bench_bfloat16() -> None:
    proc = _shmcoll("bench", *SMALL, "--dtype", "bfloat16", "--op", "avg", "-c", "allreduce,reduce_scatter,allgather")
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert rows and all(r.split()[2] == "bfloat16" and int(r.split()[-1]) == 0 for r in rows)
    proc = _shmcoll("bench", *SMALL, "--dtype", "bfloat16", "--inject-error", "--out-of-place", "-c", "allreduce")
    assert proc.returncode == 1 and "FAILED" in proc.stdout


def test_bench_every_collective_csv(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "rows.csv"
    proc = _shmcoll(
        "bench",
        "-n",
        "3",
        "-c",
        "all",
        "-b",
        "64",
        "-e",
        "1K",
        "-f",
        "16",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--quiet",
        "--dtype",
        "int32",
        "--op",
        "max",
        "--root",
        "2",
        "--csv",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    text = out.read_text().splitlines()
    assert text[0].startswith("collective,algorithm")
    kinds = {line.split(",")[0] for line in text[1:]}
    assert kinds == set(COLLECTIVES)  # the v-forms and scans included


def test_bench_rejects_bad_options() -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "-c", "allsort"])
    assert result.exit_code == 2 and "unknown collective" in result.output
    result = runner.invoke(main, ["bench", "--op", "band"])
    assert result.exit_code == 2 and "not defined" in result.output
    result = runner.invoke(main, ["bench", "-b", "lots"])
    assert result.exit_code == 2
    from shmcoll.shm.pages import PAGES

    pages_option = next(o for o in main.commands["bench"].params if o.name == "pages")
    assert tuple(pages_option.type.choices) == PAGES  # (the command line keeps numpy out of its import)
    result = runner.invoke(main, ["bench", "--pages", "tiny"])
    assert result.exit_code == 2 and "tiny" in result.output
    result = runner.invoke(main, ["bench", "--registered", "--pages", "small"])
    assert result.exit_code == 2 and "pages applies to ordinary buffers" in result.output


def test_info() -> None:
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    assert "cores usable" in result.output and "/dev/shm" in result.output and "footprint" in result.output
    from shmcoll.shm import cma, pages

    if cma.probe()[0]:
        assert f"transparent huge pages: {pages.thp_setting()} (" in result.output
        aware = "on (the ranks" if pages.can_scan() else "off (this kernel has no PAGEMAP_SCAN"
        assert f"page-aware choice of cross-memory attach: {aware}" in result.output


def test_cleanup_removes_only_stale_segments() -> None:
    from shmcoll.shm.segment import pid_namespace

    dead = f"shmcoll-00000000deadbeef-{pid_namespace()}-999999999-arena.00000001"
    live = f"shmcoll-00000000cafef00d-{pid_namespace()}-{os.getpid()}-arena.00000002"
    for name in (dead, live):
        with open(f"/dev/shm/{name}", "wb") as f:
            f.write(b"x")
    try:
        result = CliRunner().invoke(main, ["cleanup", "--dry-run"])
        assert dead in result.output and live not in result.output
        assert os.path.exists(f"/dev/shm/{dead}")
        result = CliRunner().invoke(main, ["cleanup"])
        assert result.exit_code == 0
        assert not os.path.exists(f"/dev/shm/{dead}")
        assert os.path.exists(f"/dev/shm/{live}")
    finally:
        for name in (dead, live):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def test_bench_every_algorithm_on_registered_buffers() -> None:
    """--registered with every algorithm, both modes: zerocopy competes (except where its in-place
    form does not exist), every rank allocates alike (comm.alloc is collective), all right."""
    proc = _shmcoll("bench", "-n", "3", "-c", "all", "-a", "all", "--registered", *SMALL[2:])
    assert proc.returncode == 0, proc.stderr
    sections = [line for line in proc.stdout.splitlines() if line.startswith("# ") and ", algorithm " in line]
    zero_copy = {line.split(",")[0][2:] for line in sections if "algorithm zerocopy" in line}
    assert zero_copy == {"allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "alltoall", "gather"}
    assert "Out of bounds values : 0 OK" in proc.stdout


def test_bench_on_chosen_pages() -> None:
    """--pages huge with every collective and algorithm (cma included) on 2 MiB-aligned mappings,
    and --pages small with cma against direct on blocks of several pages: all right, and the
    header says what backed the buffers."""
    proc = _shmcoll("bench", "-c", "all", "-a", "all", "--pages", "huge", *SMALL)
    assert proc.returncode == 0, proc.stderr
    assert "Out of bounds values : 0 OK" in proc.stdout
    assert "buffers huge pages (transparent huge pages: " in proc.stdout
    assert any(", algorithm cma," in line for line in proc.stdout.splitlines())
    small = [*SMALL[:2], "-b", "64K", "-e", "256K", *SMALL[6:]]
    proc = _shmcoll("bench", "-c", "alltoall,broadcast", "-a", "cma,direct", "--pages", "small", *small)
    assert proc.returncode == 0, proc.stderr
    assert "Out of bounds values : 0 OK" in proc.stdout and "buffers 4 KiB pages" in proc.stdout
