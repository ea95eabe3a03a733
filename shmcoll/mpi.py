"""Start-up under an MPI launcher: :func:`init_mpi`'s work (``shmcoll.init_mpi``).

The ranks of an MPI communicator are grouped into nodes (``MPI.Comm.Split_type`` with
``COMM_TYPE_SHARED``, refined by ``SHMCOLL_NODE_ID``, ``SHMCOLL_NODE_SIZES`` or ``node_id=``), each
node's ranks join one shmcoll job (its leader creates the group, the handle travels over the
node's MPI communicator), and :func:`shmcoll.comm.multinode.build` composes the result. mpi4py is
imported here only, and this module only when ``init_mpi`` is called.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from typing import Any

from shmcoll import config
from shmcoll.comm.communicator import Communicator
from shmcoll.comm.multinode import build
from shmcoll.errors import ShmcollError


def node_factory(group_cls: Any) -> Callable[[Any, float | None], tuple[Communicator, Callable[[], None]]]:
    """A function that builds the shmcoll communicator of a node's MPI communicator: the node's
    first rank creates a ``group_cls`` (:class:`shmcoll.Group`) and sends its handle to the others."""

    def make(node_mpi: Any, timeout: float | None) -> tuple[Communicator, Callable[[], None]]:
        local = node_mpi.Get_rank()
        group = None
        handle, error = None, None
        if local == 0:
            try:
                group = group_cls(node_mpi.Get_size(), timeout=timeout)
                handle = group.handle.encode()
            except Exception as e:  # noqa: BLE001  (told to the node's other ranks, then raised)
                error = f"{type(e).__name__}: {e}"
        handle, error = node_mpi.bcast((handle, error), root=0)
        if error is not None:
            raise ShmcollError(f"shmcoll.init_mpi(): the node's shmcoll group could not be created: {error}")
        try:
            comm = (group or group_cls.from_handle(handle)).connect(local, timeout=timeout)
        except BaseException:
            if group is not None:
                group.close()
            raise
        node_mpi.Barrier()  # every rank has attached: the leader may remove the names later
        return comm, (group.close if group is not None else (lambda: None))

    return make


def _override(rank: int, size: int, node_id: int | None) -> Any:
    """This rank's emulated node (``None``: the machine decides alone)."""
    if node_id is not None:
        return int(node_id)
    cfg = config.get()
    if cfg.node_id is not None:
        return cfg.node_id
    if cfg.node_sizes:
        sizes = cfg.node_sizes
        if len(sizes) == 1:
            return rank // sizes[0]
        if sum(sizes) != size:
            raise ValueError(
                f"SHMCOLL_NODE_SIZES={','.join(map(str, sizes))} adds up to {sum(sizes)}, not {size} ranks"
            )
        end = 0
        for k, s in enumerate(sizes):
            end += s
            if rank < end:
                return k
    return None


def init_mpi(comm: Any = None, node_id: int | None = None, timeout: float | None = None, group_cls: Any = None) -> Any:
    """See :func:`shmcoll.init_mpi`."""
    from mpi4py import MPI

    if comm is None:
        comm = MPI.COMM_WORLD
    if timeout is not None:
        timeout = config.timeout_s(timeout)
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    machine = shared.bcast(comm.Get_rank(), root=0)  # the machine's lowest rank names it
    shared.Free()
    key = (machine, _override(comm.Get_rank(), comm.Get_size(), node_id))
    result = build(comm, key, node_factory(group_cls), timeout)
    atexit.register(result.close)
    return result
