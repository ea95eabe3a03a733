"""One record per collective: every fact about it that more than one module needs.

The API's argument checks, the plan verifier, the automatic choice, the simulator, ``bench``
(buffers, expected values, bus bandwidth) and the device path all read these records instead of
keeping their own lists of which collectives are rooted, reducing or blocked. Adding a
collective starts here (``docs/architecture.md`` lists the rest).

The shape facts, for ``n`` ranks and a per-rank input ``x``::

    collective      input x            result                 in place when
    broadcast       shape s            shape s                out is x (or None)
    scatter         root: (n, *s)      shape s                out is x[rank] (root)
    gather          shape s            root: (n, *s)          x is out[rank] (root)
    allgather       shape s            (n, *s)                x is out[rank]
    reduce          shape s            root: shape s          out is x (root)
    allreduce       shape s            shape s                out is x (or None)
    reduce_scatter  (n * k, *t)        (k, *t)                out is x[rank]
    alltoall        (n, *s)            (n, *s)                out is x
    scan, exscan    shape s            shape s                out is x (or None)

and the variable-count forms, on flat buffers with ``counts[j]`` elements for rank ``j``::

    allgatherv      counts[rank]       sum(counts)            x is out[displ[rank]:][:counts[rank]]
    gatherv         counts[rank]       root: sum(counts)      as allgatherv (root)
    scatterv        root: sum(counts)  counts[rank]           out is x[displ[rank]:...] (root)
    reduce_scatterv sum(counts)        counts[rank]           as scatterv
    alltoallv       sum(send_counts)   sum(recv_counts)       never

A call's **count** (what plans and signatures carry) is the elements of one block: the whole
buffer for the unblocked collectives, one rank's block for the blocked ones, and the sum of the
counts for the variable-count ones (whose plans take the counts themselves). Where the ranks
cannot all know that sum (gatherv's and scatterv's non-roots know only their own block,
alltoallv's ranks only their row and column of the matrix), the call's signature carries 0, and
``algorithm="auto"`` decides as for a call of size 0.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable


class InPlace(enum.Enum):
    """How a call says it is in place (see the table in the module docstring)."""

    SAME = "same"  # out is x
    INPUT_IS_MY_BLOCK = "input_is_my_block"  # x is out[rank]
    OUTPUT_IS_MY_BLOCK = "output_is_my_block"  # out is x[rank]
    NEVER = "never"


def _ring_factor(n: int) -> float:
    return (n - 1) / n


@dataclasses.dataclass(frozen=True)
class Collective:
    """What shmcoll knows about one collective.

    Attributes:
        name: spelled one way everywhere.
        code: its number in call signatures (``plan.ir.pack_sig``); never reused.
        rooted: has a root.
        reducing: combines with a ``ReduceOp``.
        blocks_in: the input holds one block per rank (the root's, for scatter).
        blocks_out: the result holds one block per rank (the root's, for gather).
        result_at_root: only the root gets a result; the others get ``None``.
        input_at_root: only the root's input is read (non-roots may pass ``x=None``).
        inplace: how a call says it is in place.
        out_none_in_place: ``out=None`` means in place (else: a new result array).
        zero_copy: has a ``zerocopy`` form on buffers from ``comm.alloc``.
        bus_factor: nccl-tests' bus bandwidth factor, a function of the world size.
        internal: a plan kind of shmcoll's own, not a user-facing collective.
        varying: takes a count per rank (the v-forms); ``uniform`` names its equal-count form.
        prefix: each rank's result combines the ranks up to it (scan) or before it (exscan).
    """

    name: str
    code: int
    rooted: bool = False
    reducing: bool = False
    blocks_in: bool = False
    blocks_out: bool = False
    result_at_root: bool = False
    input_at_root: bool = False
    inplace: InPlace = InPlace.NEVER
    out_none_in_place: bool = False
    zero_copy: bool = True
    bus_factor: Callable[[int], float] = _ring_factor
    internal: bool = False
    varying: bool = False
    uniform: str = ""
    prefix: bool = False

    @property
    def blocked(self) -> bool:
        """Whether a rank's largest buffer holds one block per rank."""
        return self.blocks_in or self.blocks_out

    def call_bytes(self, world_size: int, count: int, itemsize: int) -> int:
        """The size of a call as ``bench``, ``tune`` and ``SHMCOLL_ALGO`` count it: the largest
        per-rank buffer (allgather's output, reduce_scatter's input; a variable-count call's
        count is its total already)."""
        return count * itemsize * (world_size if self.blocked and not self.varying else 1)

    def count_for(self, world_size: int, call_bytes: int, itemsize: int) -> int:
        """The count of a call of ``call_bytes`` (the inverse of :meth:`call_bytes`)."""
        return call_bytes // itemsize // (world_size if self.blocked and not self.varying else 1)


def _one(n: int) -> float:
    return 1.0


def _allreduce_factor(n: int) -> float:
    return 2 * (n - 1) / n


_ALL: tuple[Collective, ...] = (
    Collective("broadcast", 0, rooted=True, inplace=InPlace.SAME, out_none_in_place=True, bus_factor=_one),
    Collective(
        "scatter",
        1,
        rooted=True,
        blocks_in=True,
        input_at_root=True,
        inplace=InPlace.OUTPUT_IS_MY_BLOCK,
        zero_copy=False,
    ),
    Collective("gather", 2, rooted=True, blocks_out=True, result_at_root=True, inplace=InPlace.INPUT_IS_MY_BLOCK),
    Collective("allgather", 3, blocks_out=True, inplace=InPlace.INPUT_IS_MY_BLOCK),
    Collective("reduce", 4, rooted=True, reducing=True, result_at_root=True, inplace=InPlace.SAME, bus_factor=_one),
    Collective(
        "allreduce", 5, reducing=True, inplace=InPlace.SAME, out_none_in_place=True, bus_factor=_allreduce_factor
    ),
    Collective("reduce_scatter", 6, reducing=True, blocks_in=True, inplace=InPlace.OUTPUT_IS_MY_BLOCK),
    Collective("alltoall", 7, blocks_in=True, blocks_out=True, inplace=InPlace.SAME),
    Collective("barrier", 8, zero_copy=False, bus_factor=_one, internal=True),
    # (code 9 was the old point-to-point plan kind: codes are never reused)
    Collective(
        "allgatherv",
        10,
        blocks_out=True,
        inplace=InPlace.INPUT_IS_MY_BLOCK,
        zero_copy=False,
        varying=True,
        uniform="allgather",
    ),
    Collective(
        "gatherv",
        11,
        rooted=True,
        blocks_out=True,
        result_at_root=True,
        inplace=InPlace.INPUT_IS_MY_BLOCK,
        zero_copy=False,
        varying=True,
        uniform="gather",
    ),
    Collective(
        "scatterv",
        12,
        rooted=True,
        blocks_in=True,
        input_at_root=True,
        inplace=InPlace.OUTPUT_IS_MY_BLOCK,
        zero_copy=False,
        varying=True,
        uniform="scatter",
    ),
    Collective("alltoallv", 13, blocks_in=True, blocks_out=True, zero_copy=False, varying=True, uniform="alltoall"),
    Collective(
        "reduce_scatterv",
        14,
        reducing=True,
        blocks_in=True,
        inplace=InPlace.OUTPUT_IS_MY_BLOCK,
        zero_copy=False,
        varying=True,
        uniform="reduce_scatter",
    ),
    Collective(
        "scan",
        15,
        reducing=True,
        inplace=InPlace.SAME,
        out_none_in_place=True,
        zero_copy=False,
        bus_factor=_one,
        prefix=True,
    ),
    Collective(
        "exscan",
        16,
        reducing=True,
        inplace=InPlace.SAME,
        out_none_in_place=True,
        zero_copy=False,
        bus_factor=_one,
        prefix=True,
    ),
)

BY_NAME: dict[str, Collective] = {c.name: c for c in _ALL}
BY_CODE: dict[int, Collective] = {c.code: c for c in _ALL}

# User-facing collective names, in the order tables list them (bench, tune, simulate).
COLLECTIVES: tuple[str, ...] = (
    "allreduce",
    "allgather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "alltoall",
    "gather",
    "scatter",
    "allgatherv",
    "gatherv",
    "scatterv",
    "alltoallv",
    "reduce_scatterv",
    "scan",
    "exscan",
)
# The collectives with one count for every rank (the tools that time uniform sizes use these).
UNIFORM: tuple[str, ...] = tuple(name for name in COLLECTIVES if not BY_NAME[name].varying)
# Every plan kind's name, indexed by code ("" for a retired code): the user-facing collectives
# plus shmcoll's own (barrier).
PLAN_KINDS: tuple[str, ...] = tuple(BY_CODE[c].name if c in BY_CODE else "" for c in range(max(BY_CODE) + 1))
KIND_CODE: dict[str, int] = {c.name: c.code for c in _ALL}


def get(name: str) -> Collective:
    """The record of ``name``; raises ValueError naming the known ones."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown collective {name!r}; one of {', '.join(COLLECTIVES)}") from None
