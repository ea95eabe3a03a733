"""Settings of the device (CUDA) path: the public face of :mod:`shmcoll.comm.device`.

Every :class:`~shmcoll.Communicator` method accepts device arrays (numba, CuPy, torch CUDA
tensors) where it accepts numpy arrays; see docs/gpu.md. ``configure`` chooses how a
communicator moves them; ``release`` frees its device workspaces.
"""

from shmcoll.comm.device import configure, release

__all__ = ["configure", "release"]
