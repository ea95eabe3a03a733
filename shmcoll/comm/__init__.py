"""The API layer: the :class:`Communicator` and everything between its methods and the engine.

=================  ==================================================================
module             what it holds
=================  ==================================================================
``communicator``   the public methods: each binds its arguments and runs the call
``bind``           argument checks, in-place rules and results, per collective family
``arrays``         the checks every kind of array shares (numpy, registered, device)
``calls``          call shapes: plans built once and cached; a bound call
``runtime``        the engine state, the run loop, who may call, leaving
``failures``       why a call failed, from the arena, as the exception every rank raises
``registered``     ``alloc`` and zero-copy placement on its buffers
``objects``        object collectives
``groups``         ``split`` and the groups of hierarchical plans
``device``         device (CUDA) arrays: the same checks, the device engine's data paths
=================  ==================================================================
"""

from shmcoll.comm.communicator import Communicator

__all__ = ["Communicator"]
