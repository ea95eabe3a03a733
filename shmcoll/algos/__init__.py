"""Algorithms: one module per algorithm, each registering builders for the collectives it serves."""

from shmcoll.algos import (
    direct,  # noqa: F401  (registers)
    halving_doubling,  # noqa: F401  (registers)
    pairwise,  # noqa: F401  (registers)
    ps,  # noqa: F401  (registers)
)
