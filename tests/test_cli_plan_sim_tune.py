"""The plan, simulate and tune commands (and auto reading what tune wrote)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from shmcoll.algos import registry
from shmcoll.algos.registry import ALGORITHM_NAMES, Algorithm, Query
from shmcoll.plan.builder import Context
from shmcoll.plan.ir import Buf
from shmcoll.plan.passes import plan_call
from shmcoll.shm import cma


def _cli():  # type: ignore[no-untyped-def]
    # Imported here: shmcoll.cli resolves through a symlink in worktrees and a package-dir
    # mapping when installed, and import sorting would classify it differently in each.
    from shmcoll.cli.main import main

    return main


def _invoke(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(_cli(), list(args), catch_exceptions=False)


def _shmcoll(*args: str, env: dict[str, str] | None = None, timeout: float = 300):  # type: ignore[no-untyped-def]
    return subprocess.run(
        [sys.executable, "-m", "shmcoll.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# --- plan show ---------------------------------------------------------------------------------
def test_plan_show_prints_every_ranks_steps() -> None:
    result = _invoke("plan", "show", "allreduce", "-n", "3", "--count", "5")
    assert result.exit_code == 0, result.output
    plan = plan_call(registry.get("allreduce", "direct"), 3, 5, 16384)
    lines = result.output.splitlines()
    for rank in range(3):
        start = lines.index(f"rank {rank}:")
        steps = [line.split(None, 1)[1] for line in lines[start + 2 : start + 2 + len(plan.tail.programs[rank])]]
        assert steps == [str(s) for s in plan.tail.programs[rank]]
    assert "one piece of 5 elements" in result.output


def test_plan_show_body_and_tail_with_small_slots() -> None:
    result = _invoke(
        "plan", "show", "broadcast", "-n", "3", "--count", "10", "--root", "2", "--slot-bytes", "16", "--in-place"
    )
    assert result.exit_code == 0, result.output
    assert "2 body piece(s) of 4 elements, then a tail of 2" in result.output
    assert "body x2: 2 step(s)" in result.output and "send(0) <- IN[0]  [4]" in result.output
    assert "in place" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["allreduce", "-a", "nope"], "unknown algorithm 'nope'"),
        (["broadcast", "-n", "2", "--root", "2"], "root 2 out of range"),
        (["allreduce", "--slot-bytes", "lots"], "not a size"),
    ],
)
def test_plan_show_rejects_bad_arguments(args: list[str], message: str) -> None:
    result = CliRunner().invoke(_cli(), ["plan", "show", *args])
    assert result.exit_code == 2 and message in result.output


# --- plan verify -------------------------------------------------------------------------------
def test_plan_verify_everything_small() -> None:
    result = _invoke("plan", "verify", "--all", "-n", "1-4")
    assert result.exit_code == 0, result.output
    pairs = [(a.collective, a.name) for a in registry.algorithms()]
    for collective, name in pairs:
        assert f"ok   {collective}/{name}:" in result.output
    assert (
        f"# {len(pairs)} algorithm(s), world sizes 1..4, every root" in result.output
        and "all verified" in result.output
    )


def test_plan_verify_narrowed_and_usage() -> None:
    result = _invoke("plan", "verify", "-c", "reduce", "-a", "direct", "-n", "5")
    assert result.exit_code == 0 and "reduce/direct" in result.output and "allreduce" not in result.output
    assert CliRunner().invoke(_cli(), ["plan", "verify"]).exit_code == 2
    assert CliRunner().invoke(_cli(), ["plan", "verify", "-c", "nonsense"]).exit_code == 2


def _broken_allreduce(ctx: Context) -> None:
    """Every rank keeps its own input: wrong for any world size above 1."""
    for r in range(ctx.world_size):
        ctx.copy(r, ctx.region(Buf.IN), ctx.region(Buf.OUT), ctx.count)
        if ctx.world_size > 1:
            ctx.send(r, (r + 1) % ctx.world_size, None, 0)
            ctx.recv(r, (r - 1) % ctx.world_size, None, 0)


def _always(query: Query) -> str | None:
    return None


def test_plan_verify_fails_on_a_broken_algorithm(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    registry.algorithms()
    bad = Algorithm("allreduce", "pairwise", _broken_allreduce, registry.one_slot, _always, "")
    monkeypatch.setitem(registry._REGISTRY, ("allreduce", "pairwise"), bad)
    result = CliRunner().invoke(_cli(), ["plan", "verify", "-c", "allreduce", "-n", "1-3"])
    assert result.exit_code == 1
    assert "FAIL allreduce/pairwise" in result.output and "ok   allreduce/direct" in result.output
    assert "expected each of" in result.output and "1 algorithm(s) FAILED" in result.output


# --- simulate ----------------------------------------------------------------------------------
def _unregistered(collective: str) -> str | None:
    registered = {a.name for a in registry.algorithms(collective)}
    return next((name for name in ALGORITHM_NAMES if name not in registered), None)


def test_simulate_table(tmp_path) -> None:  # type: ignore[no-untyped-def]
    missing = _unregistered("scatter")
    names = "direct" + (f",{missing}" if missing else "")
    png = tmp_path / "sim.png"
    args = ["simulate", "-c", "scatter", "-a", names, "-n", "4,300", "-s", "1K,1M", "--alpha", "2us"]
    args += ["--beta", "10GB/s", "--closed-forms"]
    pytest.importorskip("matplotlib")
    result = _invoke(*args, "--plot", str(png))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "alpha 2 us, beta 10 GB/s" in out
    if missing:
        assert f"# note: {missing}: not registered for scatter, skipped" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  direct")]
    assert len(rows) == 4
    assert [r[1] for r in rows] == ["4", "4", "300", "300"] and [r[-1] for r in rows] == [
        "plan",
        "plan",
        "form",
        "form",
    ]
    assert "# direct: closed form for n >= 3" in out and "bytes" in out
    assert png.stat().st_size > 1000


def test_simulate_markdown_and_errors() -> None:
    result = _invoke("simulate", "-a", "direct", "-n", "8", "-s", "1M", "--markdown")
    assert result.exit_code == 0
    assert "| algorithm | ranks | size | time |" in result.output and "| direct | 8 | 1M |" in result.output
    for bad in (["--alpha", "soon"], ["--beta", "0GB/s"], ["-n", "0"], ["-s", "big"], ["-c", "nonsense"]):
        r = CliRunner().invoke(_cli(), ["simulate", "-a", "direct", *bad])
        assert r.exit_code == 2, bad
    r = CliRunner().invoke(_cli(), ["simulate", "-a", "direct", "--inter-alpha", "10us"])
    assert r.exit_code == 2 and "group size" in r.output


# --- tune, then auto ---------------------------------------------------------------------------
TINY_TUNE = ["-n", "2", "-c", "allreduce", "-b", "8", "-e", "1K", "-f", "32", "--iters", "2", "--warmup", "1"]
TINY_TUNE += ["--link-bytes", "256K", "--link-iters", "10"]


def test_tune_writes_the_table_auto_reads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "tune.json"
    t0 = time.monotonic()
    proc = _shmcoll("tune", *TINY_TUNE, "-o", str(path), timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 60, f"tune took {elapsed:.0f} s"
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["model"]["alpha_s"] > 0 and data["model"]["beta_Bps"] > 0
    entry, on_alloc = sorted(data["measured"], key=lambda m: m["registered"])
    for m in (entry, on_alloc):
        assert (m["collective"], m["world_size"], m["sizes"]) == ("allreduce", 2, [8, 256])
    query = Query("allreduce", 2, 1024, 4, cma=cma.probe()[0])  # (cma has an allreduce: tune times it where permitted)
    names = {a.name for a in registry.algorithms("allreduce") if a.supports(query) is None}
    assert set(entry["times_s"]) == names and all(t > 0 for ts in entry["times_s"].values() for t in ts)
    on_alloc_names = (names - {"cma"}) | {"zerocopy"}  # (comm.alloc buffers: zerocopy reads them in place)
    assert set(on_alloc["times_s"]) == on_alloc_names and "# allreduce, 2 ranks on comm.alloc" in proc.stdout
    assert data["fastest"][0]["by_size"][0][1] in names
    assert "# allreduce, 2 ranks: time per call" in proc.stdout and str(path) in proc.stdout

    # auto, in real ranks, picks from the table at a measured size and says why
    env = {"SHMCOLL_TUNE_FILE": str(path), "SHMCOLL_DEBUG": "INFO"}
    bench = _shmcoll("bench", "-n", "2", "-b", "256", "-e", "256", "--iters", "2", "--warmup", "1", "--quiet", env=env)
    assert bench.returncode == 0, bench.stderr
    assert "auto: allreduce n=2 256 B -> " in bench.stderr and "(measured: measured" in bench.stderr


def test_tune_rejects_bad_options(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for bad in (["-n", "1"], ["-n", "two"], ["-c", "nonsense"], ["-b", "1M", "-e", "1K"], ["--link-iters", "1"]):
        r = CliRunner().invoke(_cli(), ["tune", *bad, "-o", str(tmp_path / "t.json")])
        assert r.exit_code == 2, (bad, r.output)
    assert not (tmp_path / "t.json").exists()
