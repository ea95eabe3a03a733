"""Training on shmcoll: the data-parallel MNIST demo behind ``shmcoll train mnist``.

:mod:`shmcoll.train.mlp` is a numpy MLP with a hand-written backward pass and flat parameter and
gradient buffers; :mod:`shmcoll.train.data` loads the bundled MNIST subset or the IDX files;
:mod:`shmcoll.train.mnist` runs the ranks, checks the replicas and reports.
"""

from shmcoll.train.mlp import MLP, SGD
from shmcoll.train.mnist import (
    Equivalence,
    ReplicaDivergenceError,
    TrainConfig,
    TrainResult,
    compare,
    train,
)

__all__ = [
    "MLP",
    "SGD",
    "Equivalence",
    "ReplicaDivergenceError",
    "TrainConfig",
    "TrainResult",
    "compare",
    "train",
]
