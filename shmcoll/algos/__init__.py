"""Algorithms: one module per algorithm, each registering builders for the collectives it serves."""

from shmcoll.algos import (
    dbtree,  # noqa: F401  (registers)
    direct,  # noqa: F401  (registers)
    ring,  # noqa: F401  (registers)
)
