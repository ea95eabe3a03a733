"""The one place numba's decorators are configured.

Numba's on-disk cache notices edits to a function's *own* file only: change an intrinsic in
``shm/atomics.py`` and the engine's cached machine code would still be loaded. So every jitted
function of shmcoll caches under a directory keyed on the package version plus a hash of all
jitted sources (and the numba/numpy/Python versions): any edit gives a fresh directory, and a
stale kernel can never run.

Numba picks a function's cache directory when it is decorated (``config.CACHE_DIR`` at that
moment), so :func:`jit` sets it just for the decoration and leaves the user's own setting alone.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import numba
import numpy as np

from shmcoll import config
from shmcoll._version import __version__

F = TypeVar("F", bound=Callable[..., Any])

_HERE = os.path.dirname(os.path.abspath(__file__))
# Every file whose code ends up inside a jitted function.
_JITTED_SOURCES = (
    "jit.py",
    "shm/atomics.py",
    "kernels/scalar.py",
    "kernels/cpu.py",
    "engine/cpu.py",
    "plan/ir.py",
    "shm/layout.py",
    "shm/liveness.py",
    "shm/arena.py",
)


def _source_key() -> str:
    h = hashlib.sha256()
    for name in (__version__, numba.__version__, np.__version__, sys.version):
        h.update(name.encode())
    for rel in _JITTED_SOURCES:
        path = os.path.join(_HERE, rel)
        with open(path, "rb") as f:
            h.update(rel.encode())
            h.update(f.read())
    return h.hexdigest()[:16]


SOURCE_KEY = _source_key()
CACHE_DIR = os.path.join(config.get().cache_dir, "numba", SOURCE_KEY)


def jit(fn: F | None = None, **options: Any) -> Any:
    """``numba.njit(cache=True, nogil=True, ...)`` caching under :data:`CACHE_DIR`."""
    opts = {"cache": True, "nogil": True, **options}

    def decorate(f: F) -> F:
        # numba.config gains CACHE_DIR at import, which type checkers cannot see.
        saved = numba.config.CACHE_DIR  # type: ignore[attr-defined]
        numba.config.CACHE_DIR = CACHE_DIR  # type: ignore[attr-defined]
        try:
            return numba.njit(**opts)(f)  # type: ignore[no-any-return]
        finally:
            numba.config.CACHE_DIR = saved  # type: ignore[attr-defined]

    return decorate(fn) if fn is not None else decorate
