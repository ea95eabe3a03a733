"""The exceptions shmcoll raises.

Argument errors are plain ``ValueError``/``TypeError`` raised on the calling rank before any
communication; so are :class:`UnsupportedError` (a request no algorithm can serve) and
:class:`ConcurrentCallError` (a call overlapping another thread's), after which the communicator
stays usable. Everything that goes wrong *between* ranks is another :class:`ShmcollError`; after
one of those the communicator is broken and every later call raises
:class:`CommunicatorBrokenError`.
"""

from __future__ import annotations


class ShmcollError(RuntimeError):
    """Base class of every error shmcoll raises other than argument errors."""


class CollectiveTimeout(ShmcollError, TimeoutError):
    """A collective did not complete within its timeout.

    The message names the peers that had not arrived and what each was last doing.
    """


class PeerLostError(ShmcollError):
    """A peer process died (exception, signal, ``os._exit``) while others needed it."""

    def __init__(self, message: str, dead_rank: int | None = None) -> None:
        super().__init__(message)
        self.dead_rank = dead_rank


class CollectiveMismatchError(ShmcollError):
    """Ranks called different collectives, or one collective with different arguments."""


class CommunicatorBrokenError(ShmcollError):
    """The communicator was aborted or failed earlier; create a new one."""


class PlanError(ShmcollError):
    """A plan breaks its collective's postcondition: a bug in an algorithm's builder, found by
    the symbolic verifier (:mod:`shmcoll.plan.verify`)."""


class UnsupportedError(ShmcollError, ValueError):
    """The request is well formed but this algorithm, dtype or op cannot serve it."""


class SpawnError(ShmcollError):
    """A rank started by :func:`shmcoll.spawn` or ``shmcoll run`` failed.

    ``rank`` is the first rank that failed, ``exitcode`` its exit code (negative: killed by that
    signal) and ``remote_traceback`` the traceback text it raised, when it raised one.
    """

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        exitcode: int | None = None,
        remote_traceback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback


class ConcurrentCallError(ShmcollError, RuntimeError):
    """A call was made on a communicator while another thread (or a signal handler) was in a call
    on it.

    Raised on entry, before the call does anything: the call already in progress is unaffected
    and the communicator stays usable. Calls on one communicator must not overlap; give each
    thread its own communicator (:meth:`~shmcoll.Communicator.split`), or serialise the calls.
    """


class ForkedCommunicatorError(CommunicatorBrokenError):
    """A communicator was used (or closed) in a forked child of the process that connected it.

    A communicator belongs to the process that connected it; in the child it raises this and
    never touches the shared state, so the parent carries on unharmed. Connect anew in the child
    (``group.connect(rank)``), or create communicators after forking.
    """
