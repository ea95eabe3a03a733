"""The one reader of ``SHMCOLL_*`` environment variables.

Every knob lives in :class:`Config`, a frozen dataclass read once per process by :func:`load`
(tests call ``load(env)`` with a dict). The variables:

==========================  ===========================================================  =========
variable                    meaning                                                      default
==========================  ===========================================================  =========
SHMCOLL_TIMEOUT             seconds a collective may wait for its peers (inf: no limit)  60
SHMCOLL_SLOT_BYTES          the most one message carries (K/M suffixes)                  64K
SHMCOLL_NSLOTS              full messages a ring holds at least (small ones: many more)  4
SHMCOLL_SPIN                microseconds of busy-waiting before yielding, at most       auto
SHMCOLL_DEBUG               log level of the ``shmcoll`` logger: TRACE, DEBUG, INFO,    (off)
                            WARNING or ERROR (any case; anything else is an error)
SHMCOLL_ALGO                algorithm overrides, e.g. ``allreduce:ring,broadcast:dbtree``
SHMCOLL_GROUP_SIZE          ranks per group for the hierarchical algorithm               topology
SHMCOLL_TUNE_FILE           the table written by ``shmcoll tune``                       cache dir
SHMCOLL_CACHE_DIR           where compiled kernels are cached                           ~/.cache
SHMCOLL_CMA                 cross-memory attach for large copies: ``auto`` (use it if    auto
                            the start-up probe allows it) or ``0`` (never)
SHMCOLL_RANK                set by ``shmcoll run``: this process's rank
SHMCOLL_WORLD_SIZE          set by ``shmcoll run``: the number of ranks
SHMCOLL_HANDLE              set by ``shmcoll run``: the group's handle
SHMCOLL_TOKEN_LOG           a file every new job token is appended to (test harnesses
                            use it to tell their own segments from other jobs')
SHMCOLL_NODE_ID             ``init_mpi``: this rank's node, overriding the machine's      machine
                            (ranks of one machine with different ids: emulated nodes)
SHMCOLL_NODE_SIZES          ``init_mpi``: ranks per emulated node in rank order, e.g.     machine
                            ``2,2,1``; one number: consecutive nodes of that many ranks
==========================  ===========================================================  =========
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Mapping

from shmcoll.units import parse_size


def timeout_s(value: object, what: str = "timeout") -> float:
    """``value`` as a timeout in seconds: a number > 0, where ``inf`` means no limit.

    Every timeout shmcoll accepts (per call, per communicator, ``Group``, ``spawn``,
    ``SHMCOLL_TIMEOUT``) goes through here before it is used, so a bad one fails where it is given,
    before any communication.

    Raises:
        TypeError: not a real number (a string, a list, a bool).
        ValueError: zero, negative or NaN.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds (or None), got {value!r}")
    seconds = float(value)
    if not seconds > 0:  # NaN fails this too: a NaN deadline could never expire
        raise ValueError(f"{what} must be > 0 seconds (inf: no limit), got {value!r}")
    return seconds


def _default_cache_dir(env: Mapping[str, str]) -> str:
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shmcoll")


@dataclasses.dataclass(frozen=True)
class Config:
    timeout_s: float = 60.0
    slot_bytes: int = 64 << 10
    nslots: int = 4
    spin: int | None = None
    debug: str = ""
    algo: str = ""
    group_size: int | None = None
    tune_file: str = ""
    cache_dir: str = ""
    rank: int | None = None
    world_size: int | None = None
    handle: str = ""
    token_log: str = ""
    node_id: int | None = None
    node_sizes: tuple[int, ...] = ()
    cma: bool = True  # SHMCOLL_CMA: may large copy collectives read peers' memory directly


# The levels SHMCOLL_DEBUG may name, most verbose first (TRACE is shmcoll's own, below DEBUG).
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR")


def _log_level(value: str) -> str:
    level = value.strip().upper()
    if level and level not in LOG_LEVELS:
        raise ValueError(f"SHMCOLL_DEBUG must be one of {', '.join(LOG_LEVELS)} (or empty: off), got {value!r}")
    return level


def _int_or_none(value: str | None, name: str) -> int | None:
    if value is None or value.strip() == "" or value.strip().lower() == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _cma(value: str) -> bool:
    v = value.strip().lower()
    if v in ("", "auto", "1", "on"):
        return True
    if v in ("0", "off", "no"):
        return False
    raise ValueError(f"SHMCOLL_CMA must be auto or 0, got {value!r}")


def _node_sizes(value: str) -> tuple[int, ...]:
    value = value.strip()
    if not value:
        return ()
    try:
        sizes = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise ValueError(f"SHMCOLL_NODE_SIZES must be ranks per node, e.g. 2,2,1, got {value!r}") from None
    if any(s < 1 for s in sizes):
        raise ValueError(f"SHMCOLL_NODE_SIZES must be positive, got {value!r}")
    return sizes


def load(env: Mapping[str, str] | None = None) -> Config:
    """Read the configuration from ``env`` (default: ``os.environ``)."""
    e = os.environ if env is None else env
    cache_dir = e.get("SHMCOLL_CACHE_DIR") or _default_cache_dir(e)
    timeout = e.get("SHMCOLL_TIMEOUT", "").strip()
    try:
        timeout_value = timeout_s(float(timeout), "SHMCOLL_TIMEOUT") if timeout else Config.timeout_s
    except ValueError:
        raise ValueError(f"SHMCOLL_TIMEOUT must be a number of seconds > 0 (inf: no limit), got {timeout!r}") from None
    cfg = Config(
        timeout_s=timeout_value,
        slot_bytes=parse_size(e.get("SHMCOLL_SLOT_BYTES", "") or Config.slot_bytes),
        nslots=_int_or_none(e.get("SHMCOLL_NSLOTS"), "SHMCOLL_NSLOTS") or Config.nslots,
        spin=_int_or_none(e.get("SHMCOLL_SPIN"), "SHMCOLL_SPIN"),
        debug=_log_level(e.get("SHMCOLL_DEBUG", "")),
        algo=e.get("SHMCOLL_ALGO", "").strip(),
        group_size=_int_or_none(e.get("SHMCOLL_GROUP_SIZE"), "SHMCOLL_GROUP_SIZE"),
        tune_file=e.get("SHMCOLL_TUNE_FILE") or os.path.join(cache_dir, "tune.json"),
        cache_dir=cache_dir,
        rank=_int_or_none(e.get("SHMCOLL_RANK"), "SHMCOLL_RANK"),
        world_size=_int_or_none(e.get("SHMCOLL_WORLD_SIZE"), "SHMCOLL_WORLD_SIZE"),
        handle=e.get("SHMCOLL_HANDLE", ""),
        token_log=e.get("SHMCOLL_TOKEN_LOG", ""),
        node_id=_int_or_none(e.get("SHMCOLL_NODE_ID"), "SHMCOLL_NODE_ID"),
        node_sizes=_node_sizes(e.get("SHMCOLL_NODE_SIZES", "")),
        cma=_cma(e.get("SHMCOLL_CMA", "")),
    )
    return cfg


_CURRENT: Config | None = None


def get() -> Config:
    """The process's configuration, read from the environment on first use."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = load()
    return _CURRENT


def reload() -> Config:
    """Re-read the environment (after a test or the launcher changed it)."""
    global _CURRENT
    _CURRENT = load()
    return _CURRENT
