"""The layers of docs/architecture.md, checked on the code: no import loop, nothing imports upward.

Every ``import`` of ``shmcoll`` and ``cli`` is read from the source (those inside functions too,
which the interpreter only runs later), without importing anything.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Lowest first. A module may import its own layer and any lower one, never a higher one. The
# same table is in docs/architecture.md.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("shmcoll._version", "shmcoll.errors", "shmcoll.units", "shmcoll.collectives", "shmcoll.types")),
    ("configuration", ("shmcoll.config", "shmcoll.topology")),
    ("shared memory and kernels", ("shmcoll.jit", "shmcoll.shm", "shmcoll.kernels")),
    ("plans", ("shmcoll.plan",)),
    ("algorithms", ("shmcoll.algos",)),
    ("engines", ("shmcoll.engine",)),
    ("API", ("shmcoll.comm", "shmcoll.device")),
    ("processes", ("shmcoll.launch", "shmcoll.mpi", "shmcoll.torch", "shmcoll")),
    ("tools", ("shmcoll.bench", "shmcoll.sim", "shmcoll.tune", "shmcoll.train", "shmcoll.data")),
    ("command line", ("shmcoll.cli",)),
)


def _modules() -> dict[str, str]:
    """Module name -> source path, for shmcoll/ and cli/ (installed as shmcoll.cli)."""
    found = {}
    for top, package in (("shmcoll", "shmcoll"), ("cli", "shmcoll.cli")):
        base = os.path.join(ROOT, top)
        for dirpath, _, files in os.walk(base):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].replace(os.sep, ".")
                name = package if rel == "__init__" else f"{package}.{rel.removesuffix('.__init__')}"
                found[name] = os.path.join(dirpath, f)
    return found


def _imports(path: str, name: str, modules: dict[str, str]) -> set[str]:
    """The shmcoll modules ``name`` imports. ``from pkg import x`` imports module ``pkg.x`` when
    that is a module, else (a name defined in ``pkg/__init__.py``) the package itself."""
    with open(path) as f:
        tree = ast.parse(f.read())
    is_package = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "shmcoll")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != "shmcoll":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    out.discard(name)
    return {m for m in out if m in modules}


def _layer(module: str) -> int:
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    assert best >= 0, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return best


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def test_every_module_has_a_layer() -> None:
    for module in _graph():
        _layer(module)


def test_no_module_imports_a_higher_layer() -> None:
    upward = []
    for module, imports in _graph().items():
        for target in imports:
            if _layer(target) > _layer(module):
                upward.append(f"{module} ({LAYERS[_layer(module)][0]}) imports {target} ({LAYERS[_layer(target)][0]})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_loop() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    loops = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                loops.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not loops, "\n".join(loops)


def test_the_check_sees_imports_inside_functions() -> None:
    graph = _graph()
    assert "shmcoll.launch" in graph["shmcoll.bench"]  # imported inside bench.run
