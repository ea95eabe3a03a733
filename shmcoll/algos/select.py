"""Which algorithm serves a call when the caller says ``algorithm="auto"``.

An explicit name must serve the call or the call fails; ``auto`` takes the first registered
algorithm that supports the call, with ``direct`` as the fallback that supports everything.
"""

from __future__ import annotations

from shmcoll.algos import registry
from shmcoll.algos.registry import Algorithm, Query
from shmcoll.errors import UnsupportedError


def choose(query: Query, requested: str = "auto") -> Algorithm:
    """The algorithm for ``query``; raises :class:`UnsupportedError` for an unusable request."""
    if requested != "auto":
        alg = registry.get(query.collective, requested)
        reason = alg.reason_unsupported(query)
        if reason is not None:
            raise UnsupportedError(f"algorithm {requested!r} cannot serve this {query.collective}: {reason}")
        return alg
    for alg in registry.algorithms(query.collective):
        if alg.reason_unsupported(query) is None:
            return alg
    raise UnsupportedError(f"no registered algorithm serves {query}")
