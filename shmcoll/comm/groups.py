"""Groups of ranks: sub-communicators (``split``) and the groups of hierarchical plans."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from shmcoll import config, topology
from shmcoll.engine import cpu as engine
from shmcoll.errors import CollectiveMismatchError, ShmcollError
from shmcoll.shm import layout
from shmcoll.shm.arena import Arena

Runtime = Any  # comm.runtime.Runtime


def group_size(rt: Runtime) -> int | None:
    """Ranks per group for hierarchical plans (``None``: one group), the same on every rank.

    ``SHMCOLL_GROUP_SIZE`` if set, else what the topology gives the ranks' CPU affinities
    (read from their pids once all have attached: every rank reads the same). The signature
    has no room for it, so ranks agree on it through the arena instead: the first rank to
    need it publishes it and every other compares, and a rank that disagrees (say, another
    ``SHMCOLL_GROUP_SIZE``) fails at once, aborting the others, before any message.
    """
    if rt._groups_agreed:
        return rt._groups  # type: ignore[no-any-return]
    n = rt.world_size
    g, source = config.get().group_size, "SHMCOLL_GROUP_SIZE"
    if g is None:
        g, source = _topology_group_size(rt), "the topology"
    elif g < 1:
        raise ValueError(f"SHMCOLL_GROUP_SIZE must be >= 1, got {g}")
    mine = n if g is None or g >= n else g
    agreed = rt._arena.agree_group_size(mine)
    if agreed != mine:
        msg = (
            f"rank {rt.rank}: ranks disagree on the hierarchical groups: this rank has groups of "
            f"{mine} (from {source}), another rank already chose {agreed}; set SHMCOLL_GROUP_SIZE "
            "alike on every rank"
        )
        rt._fail(msg)
        raise CollectiveMismatchError(msg)
    rt._groups = None if mine >= n else mine
    rt._groups_agreed = True
    rt._log.info("hierarchical groups: %s (from %s)", rt._groups or "one group", source)
    return rt._groups  # type: ignore[no-any-return]


def _topology_group_size(rt: Runtime) -> int | None:
    n = rt.world_size
    if n == 1:
        return None
    deadline = time.monotonic() + rt.timeout
    while rt._arena.attached() < n:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.001)
    affinities = [topology.affinity(rt._arena.rank_field(r, layout.R_PID)) for r in range(n)]
    return topology.group_size_for(affinities, topology.machine())


def split(comm: Any, color: int | None, key: int | None, timeout: float | None) -> Any:
    """``comm.split`` (see its docstring)."""
    if color is not None and (not isinstance(color, (int, np.integer)) or color < 0):
        raise ValueError(f"split: color must be a non-negative int or None, got {color!r}")
    rank, n = comm.rank, comm.world_size
    key = rank if key is None else int(key)
    sub: Any = None
    error: Exception | None = None
    with comm._nested("split", timeout):
        infos = comm.allgather_object((None if color is None else int(color), key), timeout=timeout)
        members: list[int] = []
        if color is not None:
            members = [r for _, r in sorted((infos[r][1], r) for r in range(n) if infos[r][0] == color)]
        arena: Arena | None = None
        offer: Any = None
        if members and members[0] == rank:
            try:
                lay = comm._arena.layout
                what = f"c{comm._state[engine.S_SEQ]}r{rank}"
                arena = Arena.create(len(members), lay.nslots, lay.slot_bytes, comm.handle.token, what)
                offer = arena.handle
            except Exception as exc:  # noqa: BLE001  (every member must learn it)
                offer = f"{type(exc).__name__}: {exc}"
        offers = comm.allgather_object(offer, timeout=timeout)
        failure = None
        if members:
            mine = offers[members[0]]
            if isinstance(mine, str):
                failure = f"rank {members[0]} could not create the sub-communicator: {mine}"
            else:
                try:
                    if arena is None:
                        arena = Arena.attach(mine)
                    sub = type(comm)(arena, members.index(rank), timeout=comm.timeout)
                except Exception as exc:  # noqa: BLE001
                    failure = f"rank {rank} could not join: {type(exc).__name__}: {exc}"
                    if arena is not None and sub is None:
                        arena.close()
        # Everyone has attached (or failed) before the creator drops the name.
        failures = comm.allgather_object(failure, timeout=timeout)
        if arena is not None and arena.segment.owner:
            arena.segment.unlink()
        ours = sorted({f for r, f in enumerate(failures) if f is not None and r in members})
        if ours:
            if sub is not None:
                sub.close()
                sub = None
            error = ShmcollError(f"split: {'; '.join(ours)}")
    if error is not None:  # every member of the color learnt the same failures
        raise error
    return sub
