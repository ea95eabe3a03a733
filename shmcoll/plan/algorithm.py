"""What the plan layer needs of an algorithm, without knowing the registry that holds them.

``algos.registry.Algorithm`` satisfies :class:`AlgorithmLike`; the passes, the verifier's callers
and the cost model take anything that does, so ``plan/`` never imports ``algos/``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Protocol

from shmcoll.plan.builder import Context


@dataclasses.dataclass(frozen=True)
class Query:
    """What an algorithm's ``supports`` predicate is asked about one call."""

    collective: str
    world_size: int
    count: int
    itemsize: int
    root: int = 0
    inplace: bool = False
    registered: bool = False  # this rank's shared buffers come from comm.alloc
    cma: bool = False  # ranks may read each other's memory (cross-memory attach, shm.cma.probe)
    # The block size from which two cores exchange data by cross-memory attach no slower than
    # through the rings on this machine, the same on every rank (shm.cma.crossover_bytes, agreed
    # through the arena); 0: not measured.
    cma_crossover: int = 0
    # Processors of the machine (os.cpu_count(), the same for every rank of it); 0: unknown.
    cores: int = 0
    # Whether every rank's buffers of the call are on huge pages, as the ranks agreed before it
    # (comm.pages); None: not known (a plan, a simulation, a call whose choice does not hinge on it).
    huge_pages: bool | None = None

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize


class AlgorithmLike(Protocol):
    """A builder for one collective, with its piece rule and what it can serve."""

    @property
    def collective(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def build(self) -> Callable[[Context], None]: ...

    @property
    def supports(self) -> Callable[[Query], str | None]: ...

    def piece_count(self, slot_capacity: int, world_size: int, options: Mapping[str, object] | None = None) -> int: ...
