"""The launchers as a user of torchrun, mpirun and mpi4py expects them: ``shmcoll run``'s
environment, rank-tagged output, any program, exit codes; ``init()`` without a launcher; and
``spawn``'s mistakes (a function the children cannot import, a missing ``__main__`` guard)
explained before anything starts. Everything runs as a subprocess, the way a user starts it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
from harness import TOKEN_LOG, owned_tokens

from shmcoll.shm.segment import list_segments, token_of

# Variables another launcher (or the test's own environment) may have set, which would change
# what these commands see.
_FOREIGN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
_FOREIGN += ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK", "PYTHONUNBUFFERED")


def _env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: no launcher's variables (the token log stays, so the
    leak check sees these jobs' segments)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMCOLL_") and k not in _FOREIGN}
    env["SHMCOLL_TOKEN_LOG"] = TOKEN_LOG
    env.update(extra)
    return env


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "shmcoll.cli", "run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or _env())


def _tagged(text: str) -> dict[int, list[str]]:
    """Each rank's lines of ``text``; fails on a line that carries no rank tag."""
    lines: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = re.fullmatch(r"\[rank (\d+)\] (.*)", line)
        assert m, f"untagged line: {line!r}"
        lines.setdefault(int(m[1]), []).append(m[2])
    return lines


def _ranks_lines(stderr: str) -> list[str]:
    """The lines of the launcher's stderr that its ranks wrote: all but its own ("shmcoll run:
    ...", and "shmcoll: compiling kernels ..." on a cold cache)."""
    return [line for line in stderr.splitlines() if not line.startswith("shmcoll")]


# --- shmcoll run ----------------------------------------------------------------------------------
ENV_SCRIPT = """
import json, os, sys
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "OMP_NUM_THREADS", "SHMCOLL_RANK", "SHMCOLL_WORLD_SIZE"]
print(json.dumps({n: os.environ.get(n) for n in names}))
print("args", sys.argv[1:], file=sys.stderr)
"""


def test_run_gives_each_rank_torchruns_variables(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "env.py"
    script.write_text(ENV_SCRIPT)
    proc = _run("-n", "3", str(script), "--lr", "0.1")
    assert proc.returncode == 0, proc.stderr
    seen = {rank: json.loads(lines[0]) for rank, lines in _tagged(proc.stdout).items()}
    assert sorted(seen) == [0, 1, 2]
    for rank, env in seen.items():
        assert env["RANK"] == env["LOCAL_RANK"] == env["SHMCOLL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["SHMCOLL_WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["OMP_NUM_THREADS"] == "1"
    ports = {env["MASTER_PORT"] for env in seen.values()}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536  # one rendezvous port for the job
    # OMP_NUM_THREADS=1 is said once (not per rank), and the ranks' stderr is tagged too.
    notes = [line for line in proc.stderr.splitlines() if "OMP_NUM_THREADS=1" in line]
    assert len(notes) == 1 and notes[0].startswith("shmcoll run:"), proc.stderr
    ranks_stderr = _ranks_lines(proc.stderr)
    assert sorted(_tagged("\n".join(ranks_stderr))) == [0, 1, 2]
    assert "[rank 2] args ['--lr', '0.1']" in proc.stderr


def test_run_keeps_the_users_omp_num_threads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "env.py"
    script.write_text(ENV_SCRIPT)
    proc = _run("-n", "2", str(script), env=_env(OMP_NUM_THREADS="3"))
    assert proc.returncode == 0, proc.stderr
    assert all(json.loads(lines[0])["OMP_NUM_THREADS"] == "3" for lines in _tagged(proc.stdout).values())
    assert "OMP_NUM_THREADS" not in proc.stderr


CHATTY = """
import os, sys, time
rank = os.environ["RANK"]
for i in range(20):
    # A line written in pieces, with a pause in between: another rank's line must never land
    # inside it.
    sys.stdout.write(f"begin-{rank}-{i} ")
    sys.stdout.flush()
    time.sleep(0.002)
    sys.stdout.write(f"end-{rank}-{i}\\n")
    sys.stdout.flush()
    print(f"err-{i}", file=sys.stderr)
sys.stdout.write("no newline at the end")
"""


def test_run_tags_whole_lines_and_never_merges_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    proc = _run("-n", "3", str(script))
    assert proc.returncode == 0, proc.stderr
    lines = _tagged(proc.stdout)
    assert sorted(lines) == [0, 1, 2]
    for rank, mine in lines.items():
        assert mine == [f"begin-{rank}-{i} end-{rank}-{i}" for i in range(20)] + ["no newline at the end"]
    assert all(len(mine) == 20 for mine in _tagged("\n".join(_ranks_lines(proc.stderr))).values())


def test_run_no_tag_output(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = _run("-n", "2", "--no-tag-output", "--", "/bin/echo", "plain")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["plain", "plain"]


def test_run_starts_any_program(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = _run("-n", "2", "--", "/bin/echo", "hi", "-n")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[rank 0] hi -n", "[rank 1] hi -n"]
    # python -m pkg.mod as a program after --, and as shmcoll run's own -m: the same module.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("import os, sys\nprint('mod', os.environ['RANK'], sys.argv[1:])\n")
    env = _env(PYTHONPATH=str(tmp_path))
    for how in (["--", sys.executable, "-m", "pkg.mod", "x"], ["-m", "pkg.mod", "x"]):
        proc = _run("-n", "2", *how, env=env)
        assert proc.returncode == 0, proc.stderr
        assert sorted(proc.stdout.splitlines()) == ["[rank 0] mod 0 ['x']", "[rank 1] mod 1 ['x']"]


def test_run_exit_codes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = _run(
        "-n", "3", "--", sys.executable, "-c", "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)"
    )
    assert proc.returncode == 3
    assert "shmcoll run: rank 1 exited with code 3" in proc.stderr
    proc = _run("-n", "2", "--", "/bin/sh", "-c", 'test "$RANK" = 1 && kill -9 $$; sleep 30')
    assert proc.returncode == 128 + 9
    assert "rank 1 killed by signal SIGKILL" in proc.stderr
    proc = _run("-n", "2", "--", "no-such-program-anywhere", "x")
    assert proc.returncode == 127
    assert "no-such-program-anywhere" in proc.stderr and "PATH" in proc.stderr
    proc = _run("-n", "2", str(tmp_path / "missing.py"))
    assert proc.returncode == 127 and "no such script" in proc.stderr


HANGS = """
import time
import shmcoll
comm = shmcoll.init()
print("started", flush=True)
time.sleep(120)
"""


def test_run_timeout_dumps_stacks_tagged_with_the_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    proc = _run("-n", "2", "--timeout", "15", str(script))
    assert proc.returncode == 124, proc.stderr
    assert "timed out after 15.0s" in proc.stderr
    for rank in (0, 1):
        # faulthandler's dump, each line tagged: the stack shows where the rank was waiting.
        assert re.search(rf"^\[rank {rank}\] .*most recent call first", proc.stderr, re.M), proc.stderr
        assert re.search(rf'^\[rank {rank}\]   File ".*hangs.py", line 6', proc.stderr, re.M), proc.stderr
    proc = _run("-n", "1", "--no-tag-output", "--timeout", "15", str(script))
    assert proc.returncode == 124
    assert re.search(r"^--- Python stacks of rank 0 \(pid \d+\) ---$", proc.stderr, re.M), proc.stderr


TORCH_SCRIPT = """
import torch
import torch.distributed as dist
import shmcoll.torch  # noqa: F401  (registers backend "shmcoll")

dist.init_process_group("shmcoll")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
t = torch.full((2,), float(dist.get_rank()))
dist.all_reduce(t)
gloo = dist.new_group(backend="gloo")  # torch's own backend, on the same rendezvous
u = torch.ones(1)
dist.all_reduce(u, group=gloo)
print(dist.get_rank(), dist.get_world_size(), t.tolist(), u.item(), torch.get_num_threads())
dist.destroy_process_group()
"""


def test_run_starts_an_unchanged_torch_script(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    script = tmp_path / "torch_job.py"
    script.write_text(TORCH_SCRIPT)
    proc = _run("-n", "2", str(script), timeout=240)
    lines = _tagged(proc.stdout)
    assert lines == {0: ["0 2 [1.0, 1.0] 2.0 1"], 1: ["1 2 [1.0, 1.0] 2.0 1"]}, proc.stderr  # one thread each
    assert proc.returncode == 0, proc.stderr


TORCH_EXIT_SCRIPT = """
import torch
import torch.distributed as dist
import shmcoll.torch  # noqa: F401

dist.init_process_group("shmcoll")
gloo = dist.new_group(backend="gloo")
u = torch.ones(1000)
dist.all_reduce(u, group=gloo, async_op=True)  # never waited for: gloo's worker holds u at exit
print("done")
"""


def test_torch_job_exits_after_torchs_threads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A gloo worker that drops a finished work's tensors takes the GIL to decref them; once the
    # interpreter finalizes, Python 3.11 ends such a thread with pthread_exit inside that C++
    # destructor: "terminate called without an active exception", SIGABRT. The backend waits at
    # exit until torch's threads are idle (before it, about half of these jobs aborted).
    pytest.importorskip("torch")
    script = tmp_path / "torch_exit.py"
    script.write_text(TORCH_EXIT_SCRIPT)
    for _ in range(3):
        proc = _run("-n", "2", str(script), timeout=240)
        assert _tagged(proc.stdout) == {0: ["done"], 1: ["done"]}, proc.stderr
        assert proc.returncode == 0, proc.stderr


SPAWN_HANGS = """
import time
import shmcoll

def stuck(comm):
    time.sleep(120)

if __name__ == "__main__":
    shmcoll.spawn(stuck, 2, timeout=8)
"""


def test_spawn_timeout_says_whose_stacks_follow(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # spawn's ranks write to the launcher's stderr directly: a header names each rank's dump.
    script = tmp_path / "spawn_hangs.py"
    script.write_text(SPAWN_HANGS)
    proc = _python([str(script)])
    assert proc.returncode == 1 and "timed out after 8" in proc.stderr
    for rank in (0, 1):
        header = re.search(rf"^--- Python stacks of rank {rank} \(pid \d+\) ---$", proc.stderr, re.M)
        assert header, proc.stderr
        assert "in stuck" in proc.stderr[header.end() :].split("--- Python stacks")[0]


# --- init without a launcher ------------------------------------------------------------------------
ALONE = """
import numpy as np
import shmcoll
comm = shmcoll.init()
x = np.arange(3.0)
comm.allreduce(x)
print(comm.rank, comm.world_size, x.tolist(), comm.allgather_object("me"), comm.exscan(np.ones(1)).tolist())
"""


def test_init_without_a_launcher_is_a_world_of_one() -> None:
    before = owned_tokens()
    for extra in ({}, {"RANK": "0", "WORLD_SIZE": "1"}):  # torchrun with one process: the same
        proc = subprocess.run(
            [sys.executable, "-c", ALONE], env=_env(**extra), capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split("\n")[0] == "0 1 [0.0, 1.0, 2.0] ['me'] [0.0]"
    new = owned_tokens() - before
    assert len(new) == 2  # one job each, owned by the script ...
    assert not [name for name in list_segments() if token_of(name) in new]  # ... and gone at exit


def test_init_under_another_launcher_says_what_to_do() -> None:
    code = "import shmcoll; shmcoll.init()"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=_env(RANK="1", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    message = proc.stderr.strip().splitlines()[-1]
    assert "rank 1 of 4 started by torchrun" in message
    assert "shmcoll run -n 4" in message and "import shmcoll.torch" in message
    mpi_segments = {n for n in os.listdir("/dev/shm") if n.startswith("sm_segment.")}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_env(PMI_RANK="0", PMI_SIZE="2"), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "mpirun" in proc.stderr and "shmcoll run -n 2" in proc.stderr
    # Telling whether mpi4py's MPI could join that launcher's job must not start MPI here: an
    # Open MPI job of one leaves its shared-memory segment behind, even after MPI_Finalize.
    assert {n for n in os.listdir("/dev/shm") if n.startswith("sm_segment.")} <= mpi_segments


# --- spawn's mistakes, before anything starts -------------------------------------------------------
def _python(args: list[str], cwd: str | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120, env=_env(), cwd=cwd)


INTERACTIVE = """
import shmcoll
def f(comm):
    return comm.rank
print(shmcoll.spawn(f, 2, timeout=60))
"""


def test_spawn_from_python_c_explains_instead_of_failing_in_the_children() -> None:
    start = time.monotonic()
    proc = _python(["-c", INTERACTIVE])
    assert proc.returncode == 1
    assert "ValueError: shmcoll.spawn: the function `f` is defined in the __main__ module" in proc.stderr
    assert "Define it in a module or a file" in proc.stderr
    assert "exited with code" not in proc.stderr and "Can't get attribute" not in proc.stderr
    assert time.monotonic() - start < 60
    # From stdin (`python - < job.py`), where the children could not even start.
    proc = _python(["-"], stdin=INTERACTIVE)
    assert proc.returncode == 1 and "the main program was read from <stdin>, not from a file" in proc.stderr
    assert "exited with code" not in proc.stderr


def test_spawn_with_fork_works_from_python_c() -> None:
    # What the message offers as the other way out.
    proc = _python(["-c", INTERACTIVE.replace("timeout=60", 'timeout=60, start_method="fork"')])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[0, 1]"


UNGUARDED = """
import shmcoll

def work(comm):
    return comm.rank

print(shmcoll.spawn(work, 2, timeout=60))
"""

DEFINED_IN_GUARD = """
import shmcoll

if __name__ == "__main__":
    def work(comm):
        return comm.rank

    print(shmcoll.spawn(work, 2, timeout=60))
"""


def test_spawn_without_the_main_guard_is_explained(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    proc = _python([str(script)])
    assert proc.returncode == 1
    assert "RuntimeError: shmcoll.spawn: called from unguarded.py line 7" in proc.stderr
    assert 'if __name__ == "__main__":' in proc.stderr
    assert proc.stderr.count("Traceback") == 1  # the parent's only: no child ever started
    script = tmp_path / "inguard.py"
    script.write_text(DEFINED_IN_GUARD)
    proc = _python([str(script)])
    assert proc.returncode == 1
    assert 'the function `work` is defined under `if __name__ == "__main__":` in inguard.py (line 5)' in proc.stderr
    # Run as a module (python -m), the same rules hold.
    proc = _python(["-m", "unguarded"], cwd=str(tmp_path))
    assert proc.returncode == 1 and "called from unguarded.py line 7" in proc.stderr


def test_spawn_of_an_unpicklable_function_is_a_type_error() -> None:
    import shmcoll

    with pytest.raises(TypeError, match="cannot send fn and its arguments to the new processes"):
        shmcoll.spawn(lambda comm: comm.rank, 2, timeout=60)


GUARDED = textwrap.dedent("""
    import shmcoll

    class Box:
        def __init__(self, v):
            self.v = v

    def work(comm, box):
        return comm.rank + box.v

    if __name__ == "__main__":
        print(shmcoll.spawn(work, 2, args=(Box(10),), timeout=60))
""")


def test_spawn_from_a_guarded_script_still_works(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "guarded.py"
    script.write_text(GUARDED)
    proc = _python([str(script)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[10, 11]"
