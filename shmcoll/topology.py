"""The machine's topology, as ``hierarchical`` groups ranks by it.

Three levels of CPU domain are read from ``/sys``: NUMA nodes
(``devices/system/node/node*/cpulist``), sockets (``devices/system/cpu/cpu*/topology/
physical_package_id``) and shared last-level caches (the ``shared_cpu_list`` of each CPU's
``cache/index*`` whose ``level`` is 3). A rank belongs to a domain when every CPU it may run on
(its affinity) lies in it; a rank allowed on CPUs of two domains belongs to none, and then
ranks cannot be grouped at that level.

Groups are contiguous runs of ranks of equal size but the last (what a ``group_size`` describes:
rank ``r`` in group ``r // group_size``), so the first level, coarsest first, whose domains split
the ranks that way gives the group size; otherwise there is one group. Pure functions over a
``/sys`` root and a list of affinities, so tests run them against a fake tree.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Sequence

LEVELS = ("numa", "socket", "l3")


def parse_cpulist(text: str) -> frozenset[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if sep:
            cpus.update(range(int(lo), int(hi) + 1))
        else:
            cpus.add(int(lo))
    return frozenset(cpus)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cpu_index(path: str, prefix: str) -> int | None:
    name = os.path.basename(path.rstrip("/"))
    tail = name[len(prefix) :]
    return int(tail) if name.startswith(prefix) and tail.isdigit() else None


@dataclasses.dataclass(frozen=True)
class Topology:
    """The CPU domains of each level (an empty tuple where ``/sys`` says nothing)."""

    numa: tuple[frozenset[int], ...] = ()
    socket: tuple[frozenset[int], ...] = ()
    l3: tuple[frozenset[int], ...] = ()

    def level(self, name: str) -> tuple[frozenset[int], ...]:
        return tuple(getattr(self, name))


def read_topology(sys_root: str = "/sys") -> Topology:
    """Read the domains from ``sys_root`` (a real or fake ``/sys``)."""
    base = os.path.join(sys_root, "devices", "system")
    numa = []
    for node in sorted(glob.glob(os.path.join(base, "node", "node*")), key=lambda p: _cpu_index(p, "node") or 0):
        if _cpu_index(node, "node") is None:
            continue
        text = _read(os.path.join(node, "cpulist"))
        if text:
            numa.append(parse_cpulist(text))
    sockets: dict[int, set[int]] = {}
    caches: set[frozenset[int]] = set()
    for cpu_dir in glob.glob(os.path.join(base, "cpu", "cpu*")):
        cpu = _cpu_index(cpu_dir, "cpu")
        if cpu is None:
            continue
        package = _read(os.path.join(cpu_dir, "topology", "physical_package_id"))
        if package is not None and package.lstrip("-").isdigit():
            sockets.setdefault(int(package), set()).add(cpu)
        for index in glob.glob(os.path.join(cpu_dir, "cache", "index*")):
            if _read(os.path.join(index, "level")) == "3":
                shared = _read(os.path.join(index, "shared_cpu_list"))
                if shared:
                    caches.add(parse_cpulist(shared))
    return Topology(
        numa=tuple(numa),
        socket=tuple(frozenset(sockets[k]) for k in sorted(sockets)),
        l3=tuple(sorted(caches, key=min)),
    )


def domain_of(affinity: frozenset[int] | set[int], domains: Sequence[frozenset[int]]) -> int | None:
    """The index of the one domain holding every CPU of ``affinity``, else ``None``."""
    for i, dom in enumerate(domains):
        if affinity and affinity <= dom:
            return i
    return None


def contiguous_group_size(labels: Sequence[int | None]) -> int | None:
    """The group size whose groups (``r // g``) are exactly the runs of equal labels, if any.

    ``None`` when a rank has no label, a label comes back after another, the runs are uneven
    (other than a shorter last one), or there is only one run.
    """
    if not labels or any(x is None for x in labels):
        return None
    runs: list[int] = []
    seen: set[int | None] = set()
    prev: int | None = None
    for i, x in enumerate(labels):
        if i == 0 or x != prev:
            if x in seen:
                return None
            seen.add(x)
            runs.append(0)
            prev = x
        runs[-1] += 1
    if len(runs) < 2:
        return None
    g = runs[0]
    if any(r != g for r in runs[:-1]) or runs[-1] > g:
        return None
    return g


def group_size_for(affinities: Sequence[frozenset[int] | set[int]], topology: Topology) -> int | None:
    """The group size the topology gives ranks with these affinities (``None``: one group)."""
    for name in LEVELS:
        domains = topology.level(name)
        if len(domains) < 2:
            continue
        labels = [domain_of(frozenset(a), domains) for a in affinities]
        if any(x is None for x in labels):
            return None  # some rank may run anywhere: finer levels cannot hold it either
        g = contiguous_group_size(labels)
        if g is not None:
            return g
    return None


def affinity(pid: int = 0) -> frozenset[int]:
    """The CPUs process ``pid`` (0: this one) may run on; empty if it cannot be read."""
    try:
        return frozenset(os.sched_getaffinity(pid))
    except (OSError, AttributeError):
        try:
            import psutil

            return frozenset(psutil.Process(pid or os.getpid()).cpu_affinity() or ())
        except Exception:  # noqa: BLE001  (no affinity: the caller treats the rank as unpinned)
            return frozenset()


_TOPOLOGY: Topology | None = None


def machine() -> Topology:
    """This machine's topology, read once per process."""
    global _TOPOLOGY
    if _TOPOLOGY is None:
        _TOPOLOGY = read_topology()
    return _TOPOLOGY
