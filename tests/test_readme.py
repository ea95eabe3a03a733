"""The README's promises: a two-command Quickstart that .ci/run follows, and a runnable example."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def _quickstart() -> list[str]:
    text = _read("README.md")
    block = re.search(r"## Quickstart\s+```sh\n(.*?)```", text, re.S)
    assert block, "README has no Quickstart code block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_quickstart_is_two_commands_and_ci_runs_the_test_one() -> None:
    commands = _quickstart()
    assert len(commands) == 2
    assert "shmcoll bench" in commands[0] and "pytest" in commands[1]
    assert commands[1] in _read(".ci", "run").splitlines()


def test_readme_example_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    text = _read("README.md")
    code = re.search(r"## Using it\s+```python\n(.*?)```", text, re.S)
    assert code
    script = tmp_path / "example.py"
    script.write_text(code.group(1))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith("[")


def test_every_runnable_readme_block_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each python block that starts ranks itself (``if __name__ == "__main__"``) runs as shown."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", _read("README.md"), re.S) if "__main__" in b]
    assert len(blocks) >= 3
    for i, code in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(code)
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"block {i}:\n{code}\n{proc.stderr}"
