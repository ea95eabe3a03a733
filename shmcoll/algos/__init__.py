"""Algorithms: one module per algorithm, each registering builders for the collectives it serves."""

from shmcoll.algos import (
    direct,  # noqa: F401  (registers)
    zerocopy,  # noqa: F401  (registers)
)
