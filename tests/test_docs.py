"""The API reference: built from the docstrings with pdoc, the way docs/README.md says, on every
test run, so that it cannot fall behind the code."""

from __future__ import annotations

import html
import importlib.util
import inspect
import os
import re
import shlex
import subprocess
import sys

import pytest

import shmcoll

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _documented_command() -> list[str]:
    """The pdoc command docs/README.md gives (its `-o docs/api` line)."""
    with open(os.path.join(ROOT, "docs", "README.md")) as f:
        m = re.search(r"^pdoc .*-o docs/api.*$", f.read(), re.M)
    assert m, "docs/README.md no longer says how to build the API reference"
    return shlex.split(m.group(0))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:  # type: ignore[no-untyped-def]
    """The reference built by the documented command, into a temporary directory."""
    pytest.importorskip("pdoc")
    out = str(tmp_path_factory.mktemp("api"))
    args = _documented_command()[1:]
    args[args.index("-o") + 1] = out
    if importlib.util.find_spec("torch") is None:
        args.remove("shmcoll.torch")  # (importing it needs torch)
    proc = subprocess.run([sys.executable, "-m", "pdoc", *args], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    return out


def _public_methods() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(shmcoll.Communicator, inspect.isfunction)
        if not name.startswith("_")
    }


def _where(name: str) -> tuple[str, str]:
    """The reference page and anchor of Communicator's method ``name``: on shmcoll's page if
    Communicator defines it, else on the page of the module of the base class that does."""
    owner = next(k for k in shmcoll.Communicator.__mro__ if name in vars(k))
    if owner is shmcoll.Communicator:
        return "shmcoll.html", f"Communicator.{name}"
    return owner.__module__.replace(".", "/") + ".html", f"{owner.__qualname__}.{name}"


def _member(page: str, ident: str) -> str:
    """The HTML of the member whose anchor is ``ident``, up to the next member."""
    start = page.find(f'id="{ident}"')
    assert start >= 0, f"{ident} is missing from the reference"
    end = page.find('class="classattr"', start + len(ident) + 30)
    return page[start : end if end > 0 else len(page)]


def test_every_public_method_is_in_the_reference_with_its_parameters(reference: str) -> None:
    methods = _public_methods()
    assert len(methods) > 40  # (the check below must not pass by finding nothing)
    pages: dict[str, str] = {}
    for name, sig in methods.items():
        path, ident = _where(name)
        if path not in pages:
            module = path.removesuffix(".html").replace("/", ".")
            assert os.path.exists(os.path.join(reference, path)), f"add {module} to the pdoc command in docs/README.md"
            with open(os.path.join(reference, path)) as f:
                pages[path] = f.read()
        chunk = _member(pages[path], ident)
        signature = html.unescape(re.sub(r"<[^>]+>", "", chunk[: chunk.find("View Source")]))
        for param in sig.parameters:
            if param != "self":
                assert re.search(rf"\b{param}\b", signature), f"Communicator.{name}: parameter {param} not shown"
        assert 'class="docstring"' in chunk, f"Communicator.{name} has no documentation in the reference"
    for entry in shmcoll.__all__:
        if not entry.startswith("_"):
            assert f'id="{entry}"' in pages["shmcoll.html"], f"shmcoll.{entry} is missing from the reference"


def test_the_reference_renders_the_docstrings_sections(reference: str) -> None:
    # Google-style sections become headings (pdoc -d google): a wrong --docformat would leave
    # "Args:" as running text.
    with open(os.path.join(reference, "shmcoll.html")) as f:
        page = f.read()
    for name in ("allreduce", "reduce_scatter", "recv", "split"):
        chunk = _member(page, f"Communicator.{name}")
        for heading in ("Arguments", "Returns", "Raises"):
            assert re.search(rf"<h6[^>]*>{heading}:</h6>", chunk), f"Communicator.{name}: no {heading} section"


def test_every_parameter_is_described() -> None:
    """Each public method's docstring describes every parameter in its Args section, or its first
    line names the method whose arguments it takes (the ``i``-forms: "Start :meth:`allreduce`
    ...", the persistent forms: "A persistent :meth:`allreduce`"), which describes them."""
    undocumented = []
    for name, sig in _public_methods().items():
        doc = inspect.getdoc(getattr(shmcoll.Communicator, name)) or ""
        m = re.search(r":meth:`(\w+)`", doc.split("\n")[0])
        if "Args:" not in doc and m and hasattr(shmcoll.Communicator, m[1]):
            doc = inspect.getdoc(getattr(shmcoll.Communicator, m[1])) or ""
        args = doc.partition("Args:\n")[2]
        for param in sig.parameters:
            if param != "self" and not re.search(rf"^\s+{param}:", args, re.M):
                undocumented.append(f"{name}({param})")
    assert not undocumented, f"describe these in the method's Args section: {undocumented}"


def test_the_torch_backend_is_in_the_reference_when_torch_is_installed(reference: str) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: shmcoll.torch is not documented")
    path = os.path.join(reference, "shmcoll", "torch.html")
    assert os.path.exists(path), "shmcoll.torch is missing from the reference"
    with open(path) as f:
        page = f.read()
    assert 'id="ProcessGroupShmcoll"' in page
