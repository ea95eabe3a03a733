"""Algorithms: one module per algorithm, each registering builders for the collectives it serves."""

from shmcoll.algos import (  # noqa: F401  (importing registers)
    dbtree,
    direct,
    halving_doubling,
    hierarchical,
    pairwise,
    ps,
    ring,
    zerocopy,
)
