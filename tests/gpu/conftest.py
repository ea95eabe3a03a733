"""GPU tests: which modules run where.

``test_sim_*.py`` need numba's CUDA simulator, which has to be switched on before numba is first
imported, so they are collected only by a pytest started with ``NUMBA_ENABLE_CUDASIM=1``:
``test_gpu_launcher.py`` starts one (a subprocess, with a deadline) from the default run, so the
main pytest process never imports numba in simulator mode. Tests marked ``gpu`` need a real GPU
and are deselected unless asked for (``-m gpu``).
"""

from __future__ import annotations

import os

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "") == "1"

collect_ignore_glob = [] if SIMULATOR else ["test_sim_*.py"]
