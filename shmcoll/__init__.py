"""shmcoll: collective communication for processes on one machine, over shared memory.

Start ranks with :func:`spawn`, :class:`Group` or ``shmcoll run`` + :func:`init`; each rank gets a
:class:`Communicator` whose methods are the collectives.
"""

from shmcoll._version import __version__
from shmcoll.comm import Communicator
from shmcoll.comm.p2p import ANY_SOURCE, ANY_TAG, Status
from shmcoll.comm.persistent import Persistent
from shmcoll.comm.requests import Request, wait_all, wait_any
from shmcoll.errors import (
    CollectiveMismatchError,
    CollectiveTimeout,
    CommunicatorBrokenError,
    PeerLostError,
    ShmcollError,
    SpawnError,
    UnsupportedError,
)
from shmcoll.launch import Group, init, init_mpi, spawn
from shmcoll.types import ReduceOp

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "Communicator",
    "CommunicatorBrokenError",
    "Group",
    "PeerLostError",
    "ReduceOp",
    "ShmcollError",
    "SpawnError",
    "Status",
    "UnsupportedError",
    "Persistent",
    "Request",
    "__version__",
    "init",
    "init_mpi",
    "spawn",
    "wait_all",
    "wait_any",
]
