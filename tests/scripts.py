"""The benchmark scripts (``benchmarks/*.py``) as modules, for the tests that drive them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str) -> Any:
    """``benchmarks/<name>.py`` as the module ``name``, loaded once per process (registered in
    ``sys.modules`` before it runs: dataclasses look their module up while a class is built)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
