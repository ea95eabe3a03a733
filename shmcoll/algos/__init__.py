"""Algorithms: one module per algorithm, each registering builders for the collectives it serves.

Importing the package (which any ``shmcoll.algos.*`` import does first) imports every module in
it, so a new algorithm's file registers itself; ``registry``, ``select`` and ``closed_forms``
are the package's own machinery and are imported where they are used.
"""

import importlib
import pkgutil

_MACHINERY = frozenset({"registry", "select", "closed_forms"})

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _MACHINERY:
        importlib.import_module(f"{__name__}.{_module.name}")
