"""The command line as a user of nccl-tests, mpirun and torchrun expects it (issue 17): rows as
they are measured, Ctrl-C keeps them, a progress line only on a terminal, usage errors before any
work, parameters in the output, readable plots, names with suggestions, clear logging settings,
and a first compile that says what it is doing."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from shmcoll import bench, config, sim
from shmcoll.plan.cost import CostModel
from shmcoll.units import human_size

TINY = ["-n", "2", "-b", "8", "-e", "2K", "-f", "4", "--iters", "3", "--warmup", "1"]


def _cli():  # type: ignore[no-untyped-def]
    # Imported here, as in test_cli_plan_sim_tune: shmcoll.cli resolves differently in worktrees.
    from shmcoll.cli.main import main

    return main


def _invoke(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(_cli(), list(args))


def _shmcoll(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shmcoll.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def _data(lines: list[str]) -> list[str]:
    return [line for line in lines if line.strip() and not line.startswith("#")]


# --- 1. rows as they are measured; Ctrl-C keeps them --------------------------------------------
def _sigint_default() -> None:
    """(in the child) Ctrl-C's default action, whatever this test run inherited: a shell ignores
    SIGINT for its background jobs, and a Python started so raises no KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_bench_streams_rows_and_ctrl_c_keeps_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "rows.json"
    # A sweep far too long to finish: 8 B to 1 GiB. Its own session, so the signal reaches the
    # launcher and its ranks together, as Ctrl-C in a terminal does.
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmcoll.cli", "bench", "-n", "2", "-b", "8", "-e", "1G", "--json", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_sigint_default,
    )
    try:
        assert proc.stdout is not None
        seen: list[str] = []
        deadline = time.monotonic() + 240
        while len(_data(seen)) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line.rstrip("\n"))
        assert len(_data(seen)) == 2, seen
        assert proc.poll() is None  # rows arrive while the sweep is running
        os.killpg(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = seen + rest.splitlines()
    assert proc.returncode == 130, err
    assert "Aborted!" not in err and "interrupted" in err
    assert not any(c in err for c in "\r\033")  # stderr is not a terminal: no progress line
    rows = _data(lines)
    assert rows[:2] == _data(seen) and all(len(r.split()) >= 9 for r in rows)
    assert any(line.startswith("# Interrupted:") for line in lines)
    assert lines[-2].startswith("# Out of bounds values : 0 OK") and lines[-1].startswith("# Avg bus bandwidth")
    data = json.loads(out.read_text())
    assert data["meta"]["interrupted"] is True
    cells = sum((len(r.split()) - 5) // 4 for r in rows)  # a line holds one or two (mode) cells
    assert len(data["rows"]) == cells >= 2


def test_table_streams_in_final_order() -> None:
    """With several algorithms measured side by side, the first's section streams and the others
    follow complete; the text is the finished table's."""
    cfg = bench.BenchConfig(algorithms=("direct", "ring"), min_bytes=8, max_bytes=32, step_factor=2, nprocs=2)
    rows = [
        bench.Row(p.collective, a, 2, p.nbytes, p.nbytes // 4, "float32", "sum", -1, p.mode, 1.0, 1.0, 1.0, 0, 1, 1)
        for p in bench.points(cfg, 2)
        for a in p.algorithms
    ]
    lines: list[str] = []
    table = bench.Table.of(cfg, lines.append)
    table.add(rows[:4])  # 8 B: both modes, both algorithms
    assert _data(lines) == [_data(bench.format_table(rows).splitlines())[0]]
    for i in range(4, len(rows), 4):
        table.add(rows[i : i + 4])
    table.finish()
    assert lines == bench.format_table(rows).splitlines()
    assert sum(line.startswith("# allreduce, algorithm ") for line in lines) == 2


# --- 2. the progress line: a terminal only, binary sizes, an ETA -----------------------------------
def test_bench_progress_line_only_on_a_terminal() -> None:
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmcoll.cli", "bench", "-n", "2", "-b", "16K", "-e", "64K", "--iters", "3"],
        stdout=subprocess.PIPE,
        stderr=slave,
        text=True,
    )
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    out, _ = proc.communicate(timeout=300)
    os.close(master)
    assert proc.returncode == 0
    terminal = seen.decode(errors="replace")
    assert "\r\033[K[1/" in terminal and "ETA " in terminal
    assert " allreduce 64K " in terminal and "65536 B" not in terminal
    assert "\033" not in out and "\r" not in out


def test_progress_eta_and_sizes() -> None:
    cfg = bench.BenchConfig(min_bytes=1 << 20, max_bytes=4 << 20, modes=("out-of-place",))
    with open(os.devnull, "w") as devnull:
        p = bench.Progress(bench.points(cfg, 2), stream=devnull)
        assert p.text(0, now=100.0) == "[1/3] allreduce 1M out-of-place"
        # 1M took 10 s: 2M and 4M weigh 6M, so 60 s remain
        assert p.text(1, now=110.0) == "[2/3] allreduce 2M out-of-place, ETA 1m00s"
        assert p.enabled is False  # not a terminal


# --- 3. counts that make no sense are usage errors ------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ["bench", "-n", "0"],
        ["bench", "-n", "-3"],
        ["bench", "--iters", "0"],
        ["bench", "--warmup", "-1"],
        ["train", "mnist", "-n", "0"],
        ["train", "mnist", "-n", "-3"],
    ],
)
def test_counts_below_one_are_usage_errors(args: list[str]) -> None:
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    assert "x>=" in result.output and "out of range" not in result.output


# --- 4. output files: checked first; '-' is stdout ----------------------------------------------
def test_bench_checks_output_paths_before_the_sweep(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def never(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the sweep ran")

    monkeypatch.setattr(bench, "run", never)
    for option in ("--json", "--csv", "--plot"):
        result = _invoke("bench", option, "/nonexistent/x.out")
        assert result.exit_code == 2 and "does not exist" in result.output, result.output
    result = _invoke("bench", "--json", str(tmp_path))
    assert result.exit_code == 2 and "is a directory" in result.output
    result = _invoke("bench", "--json", "-", "--csv", "-")
    assert result.exit_code == 2 and "both" in result.output
    assert not os.path.exists("-")


def test_bench_json_to_stdout_table_to_stderr() -> None:
    proc = _shmcoll("bench", *TINY, "--algorithm", "direct", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert len(data["rows"]) == 10
    meta = data["meta"]
    for key, want in (("iters", 3), ("warmup", 1), ("nprocs", 2), ("algorithms", ["direct"]), ("dtype", "float32")):
        assert meta[key] == want
    assert meta["op"] == "sum" and meta["modes"] == ["out-of-place", "in-place"] and meta["interrupted"] is False
    for key in ("version", "numba", "numpy", "python", "cores", "machine"):
        assert meta[key]
    assert meta["date"][:4].isdigit() and "T" in meta["date"]
    # the table went to stderr, its header with the parameters
    assert "Out of bounds values : 0 OK" in proc.stderr
    assert "iters 3, warmup 1" in proc.stderr and "algorithms direct" in proc.stderr
    assert f"numba {meta['numba']}" in proc.stderr and meta["date"] in proc.stderr
    proc = _shmcoll("bench", *TINY, "--out-of-place", "--csv", "-")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("collective,algorithm") and len(proc.stdout.splitlines()) == 6


# --- 6. the bench plot says what it draws ----------------------------------------------------------
def _captured_figure(monkeypatch, draw) -> object:  # type: ignore[no-untyped-def]
    """Run ``draw()`` and return the figure it closed, drawn."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures: list[object] = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    draw()
    (fig,) = figures
    fig.canvas.draw()  # type: ignore[attr-defined]
    return fig


def test_bench_plot_draws_both_modes_with_binary_ticks(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    rows = [
        bench.Row("allreduce", "auto", 2, s, s // 4, "float32", "sum", -1, m, 1.0, 1.0, b, 0, 1.0, 1.0)
        for s in (16, 256, 4096, 65536, 1 << 20)
        for m, b in (("out-of-place", 1.0), ("in-place", 2.0))
    ]
    path = tmp_path / "bench.png"
    fig = _captured_figure(monkeypatch, lambda: bench.plot({"allreduce auto": rows}, str(path), title="t"))
    assert path.stat().st_size > 0
    ax = fig.axes[0]  # type: ignore[attr-defined]
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["allreduce auto, out-of-place", "allreduce auto, in-place"]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks[0] == "16 B" and ticks[-1] == "1 MiB" and "1 KiB" in ticks


# --- 7. names with suggestions --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "show", "allreduc"], "unknown collective 'allreduc'; did you mean 'allreduce'?"),
        (["plan", "show", "allreduce", "-a", "rnig"], "unknown algorithm 'rnig'; did you mean 'ring'?"),
        (["plan", "show", "gather", "-a", "ring"], "algorithm 'ring' does not serve gather"),
        (["plan", "verify", "-c", "broadcats"], "did you mean 'broadcast'?"),
        (["simulate", "-c", "allreduc"], "did you mean 'allreduce'?"),
        (["simulate", "-a", "dbtee"], "did you mean 'dbtree'?"),
        (["bench", "-c", "allgathr"], "did you mean 'allgather'?"),
        (["bench", "-a", "rign"], "did you mean 'ring'?"),
    ],
)
def test_unknown_names_suggest_the_closest(args: list[str], message: str) -> None:
    result = _invoke(*args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert "registered: none" not in result.output


# --- 8. simulate: binary sizes, a readable figure for one size -------------------------------------
def test_simulate_prints_binary_sizes() -> None:
    result = _invoke("simulate", "-a", "direct,ring", "-n", "8", "-s", "64K")
    assert result.exit_code == 0, result.output
    assert " KB" not in result.output and " MB" not in result.output
    assert "slot 64K" in result.output and "896K" in result.output  # ring moves 2(n-1)/n x 8 ranks
    assert human_size(58700) == "57.3K" and human_size(1 << 20, iec=True) == "1 MiB"


def test_simulate_plot_of_one_size_is_readable(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model = CostModel(alpha_s=5e-6, beta_Bps=25e9)
    rows, _ = sim.sweep("allreduce", ["direct", "ring", "hierarchical", "dbtree"], [8, 64, 1024], [1 << 20], model)
    title = "allreduce, float32, alpha 5 us, beta 25 GB/s; plans simulated up to 128 ranks, closed forms above"
    fig = _captured_figure(monkeypatch, lambda: sim.plot(rows, str(tmp_path / "s.png"), title=title))
    width_px = fig.get_figwidth() * fig.dpi  # type: ignore[attr-defined]
    assert width_px >= 800
    box = fig._suptitle.get_window_extent()  # type: ignore[attr-defined]
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width  # type: ignore[attr-defined]
    lines = fig.axes[0].get_lines()  # type: ignore[attr-defined]
    assert len(lines) == 4 and len({(line.get_marker(), line.get_linestyle()) for line in lines}) == 4


# --- 9. SHMCOLL_DEBUG names its levels ----------------------------------------------------------------
def test_shmcoll_debug_must_be_a_level() -> None:
    assert config.load({"SHMCOLL_DEBUG": "info"}).debug == "INFO"
    assert config.load({"SHMCOLL_DEBUG": "TRACE"}).debug == "TRACE"
    assert config.load({}).debug == ""
    with pytest.raises(ValueError, match="SHMCOLL_DEBUG must be one of TRACE, DEBUG, INFO, WARNING, ERROR"):
        config.load({"SHMCOLL_DEBUG": "bogus"})
    proc = subprocess.run(
        [sys.executable, "-c", "import shmcoll"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SHMCOLL_DEBUG": "bogus"},
    )
    assert proc.returncode != 0 and "got 'bogus'" in proc.stderr


# --- 10. a first compile says so, once per machine -------------------------------------------------------
_COMPILE = """
import numpy as np
from shmcoll.kernels.cpu import copy
from shmcoll.shm.atomics import read_word
read_word(np.zeros(2, np.int64), 1)
x = np.ones(8, np.float32)
y = np.zeros(8, np.float32)
copy(y, 0, y, 0, 0, x, 0, 8)
assert y.sum() == 8
"""


def test_first_compile_is_announced_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {**os.environ, "SHMCOLL_CACHE_DIR": str(tmp_path)}

    def run() -> str:
        proc = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    first = run()
    assert "shmcoll: compiling kernels (once per machine, about" in first
    assert "shmcoll: compiling kernels for float32 (once per machine, about" in first
    assert first.count("shmcoll: compiling") == 2  # callees compiled on the way are not announced
    assert "compiling" not in run()  # loaded from the cache


def test_processes_that_miss_the_cache_together_compile_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {**os.environ, "SHMCOLL_CACHE_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", _COMPILE], stderr=subprocess.PIPE, text=True, env=env) for _ in range(3)
    ]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errs
    said = "".join(errs)
    # one compiles each kernel and says so; the others wait for it and load what it cached
    assert said.count("compiling kernels for float32") == 1 and said.count("compiling kernels (") == 1, errs


_THREADS_COMPILE = """
import importlib.util, os, sys, threading
import numpy as np
kernels = "from shmcoll.jit import jit\\n" + "".join(
    f"@jit\\ndef f{i}(a):\\n    s = 0.0\\n    for v in a:\\n        s += v * {i}\\n    return s\\n" for i in range(8)
)
path = os.path.join(sys.argv[1], "kernels.py")
open(path, "w").write(kernels)
spec = importlib.util.spec_from_file_location("kernels", path)
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
errors = []
def first_call(i, start):
    start.wait()
    try:
        assert getattr(m, f"f{i}")(np.ones(3)) == 3 * i
    except BaseException as exc:
        errors.append(repr(exc))
for i in range(8):
    start = threading.Barrier(2)
    threads = [threading.Thread(target=first_call, args=(i, start), daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), f"f{i}: a thread still compiles after 60 s"
assert not errors, errors
"""


def test_two_threads_making_a_kernels_first_call_at_once_both_get_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The compile announcer's state (its depth, the lock file's descriptor) is per process; a
    second thread's compile that started between the first one's return and its bookkeeping
    shared it, and one of them failed (``OSError: [Errno 9] Bad file descriptor``, 1-4 of 12
    kernels here) or could wait for ever. A fresh cache, so that every first call compiles."""
    env = {**os.environ, "SHMCOLL_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", _THREADS_COMPILE, str(tmp_path)], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr


def test_payload_dtype() -> None:
    from numba import types

    from shmcoll.jit import payload_dtype

    i64, f32 = types.Array(types.int64, 1, "C"), types.Array(types.float32, 1, "C")
    assert payload_dtype((i64, f32, f32)) == "float32"
    assert payload_dtype((i64, i64, i64)) == "int64"
    assert payload_dtype((i64, types.int64)) == ""


def test_auto_log_lines_name_their_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``SHMCOLL_DEBUG=INFO``: the automatic choice's lines carry ``[rank N]`` like the others."""
    script = tmp_path / "auto_log.py"
    script.write_text(
        "import numpy as np, shmcoll\n"
        "def w(comm):\n"
        "    comm.allreduce(np.ones(10))\n"
        "if __name__ == '__main__':\n"
        "    shmcoll.spawn(w, 2)\n"
    )
    env = {**os.environ, "SHMCOLL_DEBUG": "INFO"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "auto:" in line]
    assert lines and all("[rank " in line for line in lines), proc.stderr
