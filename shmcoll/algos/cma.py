"""``cma``: cross-memory attach; each rank copies what it needs straight out of its peers' buffers.

The rings copy every byte twice: the sender into a slot, the receiver out of it. With
cross-memory attach (``process_vm_readv``, see :mod:`shmcoll.shm.cma`) the kernel copies from a
peer's own buffer, ordinary numpy memory included, into the caller's: one copy, and the ranks
copy at the same time. The plans are :mod:`~shmcoll.algos.zerocopy`'s copy plans (regions on
other ranks, dissemination syncs of zero-byte messages, the same three safety rules, checked by
the verifier); only the way the engine reaches a peer's region differs: each rank publishes its
buffers' addresses when it enters the call, and a copy from a peer's region is one system call
(``ir.PEERS_CMA``).

**broadcast**: every rank copies the root's buffer. **allgather**, **gather**: every rank (the
root) copies each peer's input into its block. **alltoall**: rank ``r`` copies block ``r`` of
every input. **scatter**: rank ``r`` copies block ``r`` of the root's input.

Rounds: 2 syncs (3 for alltoall) of ``ceil(log2 n)`` zero-byte rounds each. Bytes through the
rings: none. Memory traffic per rank: it reads what it needs once and writes its output once.
Constraints: only copies (a reduction would need the peer's data in this process first, which
is what the rings do); cross-memory attach must be permitted (``Query.cma``). ``auto`` weighs it
only from :func:`auto_from` on (a system call per block and the syncs cost what the cost model
does not see), not for broadcasts from 1 to 16 MiB (see :func:`_broadcast_skips`), and never
for gather (see there), with the model or the tune table's measurements; asked for by name it
serves any size.

``auto`` cannot tell in place from out of place here: in place is per rank, and every rank of a
call must choose the same algorithm (``select.choose`` decides on the out-of-place query). Two
measured cases would want a rule on it: an in-place alltoall goes through scratch behind a third
sync and was slower than ``direct`` at every size (2 ranks: 32 KiB 5.94 against 3.35 us, 16 MiB
1182 against 1110; 4 ranks: 16 MiB 4419 against 3470), and an in-place broadcast at 2 ranks and
1 MiB took 88 us against 47-51 out of place (the root's own copy, made while the others read
its buffer, brings that buffer nearer to them: a 1 MiB effect on this machine, gone from 2 MiB).
For broadcast, where in place is the common call, the sizes where it loses are left to the
rings (:func:`_broadcast_skips`); an in-place alltoall is rare, and runs cma like the others.
"""

from __future__ import annotations

from shmcoll.algos import zerocopy
from shmcoll.algos.registry import Query, register
from shmcoll.plan.builder import Context
from shmcoll.plan.ir import Buf, Region


def auto_from(world_size: int) -> int:
    """Smallest call (``select.call_size``) for which ``auto`` weighs cma (scatter's; the others
    have their own below): 64 KiB at 2 ranks (32 KiB: 2.31 against 2.13 us for ``direct``),
    1 MiB above (measured with ``benchmarks/auto_vs_best.py`` on the 2-core machine: at 4 ranks
    each sync costs context switches, and cma lost to the rings up to 256 KiB there)."""
    return 64 << 10 if world_size <= 2 else 1 << 20


def _blocks_from(world_size: int) -> int:
    """:func:`auto_from` for allgather and alltoall, where every rank copies a block from every
    peer at once: 32 KiB at 2 ranks (32 KiB: alltoall 3.18 against 3.64 us for ``direct``,
    allgather 2.99 against 3.03 for ``ring``; 16 KiB: cma 0.2-0.5 us slower), 512 KiB above (at 4
    ranks, 512 KiB: alltoall 88 against 141 us for ``direct``, allgather 80 against 100 us for
    ``ring``; 256 KiB within 10% either way)."""
    return 32 << 10 if world_size <= 2 else 512 << 10


def _broadcast_from(world_size: int) -> int:
    """:func:`auto_from` for broadcast: 32 KiB at 2 ranks (32 KiB out of place: 2.70-2.77 us
    against 3.15-3.51 for the rings; in place 2.71 against 2.68-2.71, a tie; 16 KiB: cma
    0.1-0.4 us slower), :func:`auto_from` above."""
    return 32 << 10 if world_size <= 2 else auto_from(world_size)


def _never(world_size: int) -> int:
    return 1 << 62


def _permitted(query: Query) -> str | None:
    if query.registered:
        return "buffers from comm.alloc are read in place by zerocopy"
    if not query.cma:
        return "cross-memory attach is not permitted here (see `shmcoll info`)"
    return None


_whole = zerocopy._whole  # no slots carry data, so a call is never cut into pieces


def _broadcast_skips(world_size: int, size: int) -> bool:
    """Where ``auto`` leaves broadcast to the rings although cma is weighed below and above: from
    1 MiB to 16 MiB. In place (the form MPI's and torch's broadcast have) the rings were faster
    there at 2 and 4 ranks, while out of place cma was faster at 2 ranks; ``auto`` cannot tell
    the two apart (see the module doc), and in place is the common call. ``shmcoll bench -c
    broadcast -a cma,ps,dbtree,ring``, in place: 2 ranks 1 / 2 / 4 / 8 MiB cma 109 / 228 / 370 /
    668 us against the best ring's 72 / 150 / 321 / 611, 16 and 32 MiB a tie (1287 against 1297,
    2615 against 2506); 4 ranks 1 / 4 MiB 240 / 846 against 201 / 795, 16 and 64 MiB cma 1.25x
    and 1.10x faster. Out of place at 2 ranks cma was 1.17-1.5x faster from 4 MiB, at 4 ranks
    within 8% of the rings below 16 MiB."""
    return 1 << 20 <= size < 16 << 20


@register("broadcast", "cma", piece=_whole, supports=_permitted, auto_from=_broadcast_from, auto_skip=_broadcast_skips)
def broadcast(ctx: Context) -> None:
    """Every rank copies the root's buffer."""
    zerocopy.broadcast(ctx)


@register("allgather", "cma", piece=_whole, supports=_permitted, auto_from=_blocks_from)
def allgather(ctx: Context) -> None:
    """Every rank copies every input into its block, its own first (see ``zerocopy.sources``)."""
    zerocopy.copy_allgather(ctx, own_first=True)


# Not for auto: the root alone copies every block, where the rings share the copying between
# the senders and the root; measured slower than direct at 2 and 4 ranks from 1 to 64 MiB.
@register("gather", "cma", piece=_whole, supports=_permitted, auto_from=_never)
def gather(ctx: Context) -> None:
    """The root copies every rank's input into its block."""
    zerocopy.gather(ctx)


@register("alltoall", "cma", piece=_whole, supports=_permitted, auto_from=_blocks_from)
def alltoall(ctx: Context) -> None:
    """Rank ``r`` copies block ``r`` of every input (through scratch when in place), its own
    first (see ``zerocopy.sources``)."""
    zerocopy.copy_alltoall(ctx, own_first=True)


@register("scatter", "cma", piece=_whole, supports=_permitted, auto_from=auto_from)
def scatter(ctx: Context) -> None:
    """Rank ``r`` copies block ``r`` of the root's input; the root, its own unless in place."""
    n, root, count = ctx.world_size, ctx.root, ctx.count
    zerocopy.sync(ctx)
    for r in range(n):
        if r != root:
            ctx.copy(r, Region(Buf.IN, r * ctx.block, rank=root), Region(Buf.OUT, 0), count)
        elif not ctx.inplace:
            ctx.copy(r, Region(Buf.IN, r * ctx.block), Region(Buf.OUT, 0), count)
    zerocopy.sync(ctx)
