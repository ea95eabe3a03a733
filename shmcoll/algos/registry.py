"""The algorithm registry: which builders serve which collective, and what each can serve.

Adding an algorithm is one module in ``algos/`` with builders decorated by :func:`register`,
imported by ``algos/__init__.py``; the communicator, the automatic choice, the tests and the
CLI's ``--algorithm`` choices all find it here. (Importing this module runs the package's
``__init__`` first, so every builder is registered before anyone can look one up.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from shmcoll.plan import ir
from shmcoll.plan.algorithm import Query
from shmcoll.plan.builder import Context

__all__ = ["ALGORITHM_NAMES", "Algorithm", "Query", "algorithms", "get", "register"]

# Algorithm names, spelled one way everywhere; the index is the algorithm's code in signatures.
ALGORITHM_NAMES: tuple[str, ...] = (
    "direct",
    "ring",
    "dbtree",
    "halving_doubling",
    "hierarchical",
    "ps",
    "pairwise",
    "zerocopy",
    "cma",
)


Builder = Callable[[Context], None]
Supports = Callable[[Query], str | None]
PieceRule = Callable[[int, int], int]
OptionsPieceRule = Callable[[int, int, Mapping[str, object]], int]


def _anywhere(world_size: int) -> int:
    return 0


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A registered builder for one collective.

    ``piece(slot_capacity, world_size)`` is the largest per-block count one pass of the builder may
    handle so that no step moves more than ``slot_capacity`` elements; a builder whose pieces depend
    on its options (``hierarchical``'s groups) gives ``options_piece`` instead, and callers ask
    :meth:`piece_count`. ``supports(query)`` returns ``None`` when the algorithm can serve the
    call, else the reason it cannot. ``auto_from(world_size)``: the automatic choice considers it
    only for calls of at least this size (``select.call_size``), and not where
    ``auto_skip(query, size)`` holds; asked for by name it serves any. Where
    ``auto_prefer(query, size)`` holds, the automatic choice takes it without asking the cost
    model (a measured advantage the model cannot see; like ``auto_skip``, from what every rank of
    the call knows alike); a tune table's measurements still decide. Where
    ``auto_huge(query, size)`` holds (``Query.huge_pages``: every rank's buffers are on huge
    pages, as the ranks agreed), the automatic choice takes it before a tune table's
    measurements, which were taken on buffers whose pages nobody knew. Where
    ``auto_timed(query, size)`` holds and the automatic choice took another algorithm, the ranks
    choose between the two at every call by what the calls of each took (``comm/timed.py``; only
    cma's plans, whose syncs wait for every rank, may be the other). (There is no rule on in
    place: it is per rank, and every rank of a call must choose alike.) ``peers`` says how its
    plans reach regions on other ranks (``ir.PEERS_*``: none, the registered allocation of
    ``zerocopy``, cross-memory attach for ``cma``); the engine reads it from each program's header.
    """

    collective: str
    name: str
    build: Builder
    piece: PieceRule
    supports: Supports
    doc: str
    options_piece: OptionsPieceRule | None = None
    auto_from: Callable[[int], int] = _anywhere
    auto_skip: Callable[[Query, int], bool] | None = None
    auto_prefer: Callable[[Query, int], bool] | None = None
    auto_huge: Callable[[Query, int], bool] | None = None
    peers: int = ir.PEERS_NONE
    auto_timed: Callable[[Query, int], bool] | None = None

    def for_auto(self, query: Query, size: int) -> bool:
        """Whether the automatic choice weighs this algorithm for ``query`` (``size`` bytes)."""
        n = query.world_size
        return self.auto_from(n) <= size and (self.auto_skip is None or not self.auto_skip(query, size))

    def piece_count(self, slot_capacity: int, world_size: int, options: Mapping[str, object] | None = None) -> int:
        """The piece for a call with these builder options (see the class docstring)."""
        if self.options_piece is not None:
            return self.options_piece(slot_capacity, world_size, options or {})
        return self.piece(slot_capacity, world_size)

    @property
    def code(self) -> int:
        return ALGORITHM_NAMES.index(self.name)


def _always(query: Query) -> str | None:
    return None


def one_slot(slot_capacity: int, world_size: int) -> int:
    """Piece rule of builders whose every step moves a whole piece."""
    return slot_capacity


_REGISTRY: dict[tuple[str, str], Algorithm] = {}


def register(
    collective: str,
    name: str,
    *,
    piece: PieceRule = one_slot,
    supports: Supports = _always,
    options_piece: OptionsPieceRule | None = None,
    auto_from: Callable[[int], int] | None = None,
    auto_skip: Callable[[Query, int], bool] | None = None,
    auto_prefer: Callable[[Query, int], bool] | None = None,
    auto_huge: Callable[[Query, int], bool] | None = None,
    auto_timed: Callable[[Query, int], bool] | None = None,
    peers: int = ir.PEERS_NONE,
) -> Callable[[Builder], Builder]:
    """Register ``build`` as algorithm ``name`` of ``collective``.

    ``peers`` says how its plans reach regions on other ranks (``ir.PEERS_*``); the call encodes
    it with every plan, and a plan that names a peer's region under ``PEERS_NONE`` is refused.
    """
    if name not in ALGORITHM_NAMES:
        raise ValueError(f"unknown algorithm name {name!r}; add it to ALGORITHM_NAMES")

    def decorate(build: Builder) -> Builder:
        key = (collective, name)
        if key in _REGISTRY:
            raise ValueError(f"{collective}/{name} registered twice")
        doc = (build.__doc__ or "").strip()
        _REGISTRY[key] = Algorithm(
            collective,
            name,
            build,
            piece,
            supports,
            doc,
            options_piece,
            auto_from or _anywhere,
            auto_skip,
            auto_prefer,
            auto_huge,
            peers,
            auto_timed,
        )
        return build

    return decorate


def get(collective: str, name: str) -> Algorithm:
    """The algorithm ``name`` of ``collective``; ValueError naming the registered ones."""
    try:
        return _REGISTRY[(collective, name)]
    except KeyError:
        names = ", ".join(a.name for a in algorithms(collective)) or "none"
        raise ValueError(f"no algorithm {name!r} for {collective}; registered: {names}") from None


def algorithms(collective: str | None = None) -> list[Algorithm]:
    """Registered algorithms (of one collective), in ALGORITHM_NAMES order."""
    found = [a for a in _REGISTRY.values() if collective is None or a.collective == collective]
    return sorted(found, key=lambda a: (a.collective, a.code))
