"""``cma``: cross-memory attach; ranks copy straight between their peers' buffers and their own.

The rings copy every byte twice: the sender into a slot, the receiver out of it. With
cross-memory attach (``process_vm_readv`` and ``process_vm_writev``, see :mod:`shmcoll.shm.cma`)
the kernel copies between a peer's own buffer, ordinary numpy memory included, and the caller's:
one copy, and the ranks copy at the same time. The plans use :mod:`~shmcoll.algos.zerocopy`'s
means (regions on other ranks, dissemination syncs of zero-byte messages, safety rules checked
by the verifier's vector clocks); each rank publishes its buffers' addresses when it enters the
call, and a copy from or into a peer's region is one system call (``ir.PEERS_CMA``).

**allreduce**: rank ``r`` reads chunk ``r`` of each peer's input into scratch (out of place, the
first peer's into its output), a 256 KiB part (64 Ki elements) at a time, combines it with its own
at once, while the part is still in its cache, and writes the finished part into every peer's output
(no sync between: chunk ``r`` of a peer's buffer is read and then written by rank ``r`` alone).
**reduce_scatter**: the reads and combinations alone; **reduce**: the finished parts written into
the root's output alone (``auto`` takes it only at 2 ranks on huge pages, 1-8 MiB:
:func:`_reduce_skips`). Each chunk is combined once, by its owner, so every rank gets the same
bits; the rings copy each byte into a slot and out again, and combine from memory. ``shmcoll
bench -c allreduce -a all``, in place, when cma still wrote whole chunks (stop 27; per-part
writes since, see :func:`allreduce`): 2 ranks 256 KiB 14 against 31 us for the best ring, 1 MiB 64 against 118,
4 MiB 355 against 511, 16 MiB 1390 against 2121; 4 ranks 1 MiB 202 against 295, 16 MiB 3894
against 5140.
**broadcast**: the root writes the first ``1/n`` of its buffer into every peer while each peer
reads the rest from the root: reading it all, the peers copied while the root's core idled (2
ranks, in place, 2 MiB 228 -> 64 us, 8 MiB 668 -> 320). Out of place the root's output is
filled by the root (its first ``1/n``) and the peers (each its share of the rest, written from
the output it has just read), so every rank copies the buffer once: with the root copying its
whole output, 2 ranks took 108 us at 1 MiB, 497 at 4 MiB, 1793 at 16 MiB, now 42, 386, 1279
(the rings: 93, 497, 2005); 4 ranks 1 MiB 249 -> 241, 4 MiB 842 -> 758, 16 MiB 3058 -> 2878
(three runs each, ``shmcoll bench -c broadcast -a cma,ring --out-of-place``). **scatter**: rank
``r`` reads block ``r`` of the root's input. **allgather**: every rank writes its input into its block of every peer's
output. **gather**: every rank writes its input into its block of the root's. **alltoall**: rank
``r`` writes block ``j`` of its input into block ``r`` of rank ``j``'s output (in place, each pair
of ranks swaps its two blocks, half each: :func:`_swaps`). Where every rank sends to every peer, writing beat
reading (two processes exchanging 1 MiB each with ``process_vm_writev``
took 126-157 us against 165-167 for ``process_vm_readv``, 4 ranks 355-387 against 443-446; the
data a rank just produced is in its own cache, where a reader must fetch it from another core's),
and it made gather a parallel copy instead of the root's alone. Writers start at their next
rank and go around (:func:`_around`), so no two write into one peer at once. A write into a
peer must follow the peer's entry (a sync), and the peer returns only after a sync that follows
every write into it; ``shmcoll bench -a cma`` (out of place): allgather at 2 ranks, 2 MiB, 204-234
us reading in rank order, 168 reading around, 122 writing around; at 4 ranks 463, 406, 293.

Rounds: 2 syncs of ``ceil(log2 n)`` zero-byte rounds each. Bytes through the rings: none. Memory
traffic per rank: it reads what it sends once and each output byte is written once (the
reductions: and each peer's part once more, from the cache).
Constraints: cross-memory attach must be permitted (``Query.cma``). ``auto`` weighs it
only from :func:`auto_from` on (a system call per block and the syncs cost what the cost model
does not see), and only where this machine's two cores exchange a block of the call's size no
slower by the kernel than through the rings (``Query.cma_crossover``, :func:`_below_crossover`),
not for broadcasts from 1 to 16 MiB at 3 ranks and more (see :func:`_broadcast_skips`), with the
model or the tune table's measurements; for the reductions it is preferred from there on up to 4
ranks (:func:`_preferred`); where every rank's buffers are on huge pages (``Query.huge_pages``,
which the ranks agree on before such a call: ``comm/pages.py``) it is taken from
:func:`huge_from` whatever the race says, before a tune table (:func:`_on_huge_pages`); asked for
by name it serves any size.

``auto`` cannot tell in place from out of place here: in place is per rank, and every rank of a
call must choose the same algorithm (``select.choose`` decides on the out-of-place query). One
measured case would want a rule on it: an in-place broadcast at 4 ranks from 1 to 16 MiB was
slower than the rings, and is left to them (:func:`_broadcast_skips`; in place is the common
broadcast). An in-place alltoall, slower than ``direct`` at every size while it staged its
blocks in scratch, now swaps them and is faster from 128 KiB (see :func:`_swaps`); at 32 KiB it
took 3.7 us against 3.4 for ``direct`` in place, 64 KiB a tie (3 runs; ``auto`` weighs cma at 2
ranks from 64 KiB, :func:`_blocks_from`).
"""

from __future__ import annotations

from collections.abc import Callable

from shmcoll.algos import zerocopy
from shmcoll.algos.registry import Query, register
from shmcoll.plan.builder import Context, split
from shmcoll.plan.ir import PEERS_CMA, Buf, Region


def auto_from(world_size: int) -> int:
    """Smallest call (``select.call_size``) for which ``auto`` weighs cma (scatter's; the others
    have their own below): 64 KiB at 2 ranks (32 KiB: 2.31 against 2.13 us for ``direct``),
    1 MiB above (measured with ``benchmarks/auto_vs_best.py`` on the 2-core machine: at 4 ranks
    each sync costs context switches, and cma lost to the rings up to 256 KiB there)."""
    return 64 << 10 if world_size <= 2 else 1 << 20


def _blocks_from(world_size: int) -> int:
    """:func:`auto_from` for allgather and alltoall, where every rank copies a block to every
    peer at once: 64 KiB at 2 ranks, 256 KiB above (at 4 ranks, 256 KiB, since the plans write
    into their peers: allgather 33 against 46-52 us for the others, alltoall 35 against 53 for
    ``direct``; 64 KiB: cma 1.3x slower).

    At 2 ranks, 32 KiB: on the Zen 5 VM (stop 47, ``shmcoll bench -n 2 -c allgather,alltoall
    -b 32K -e 32K -a direct,cma``, 8 launches each way) ``direct`` was the faster in 7 of 8
    launches out of place (medians: allgather 3.98 against 5.26 us, alltoall 3.70 against 4.93;
    Open MPI took 5.1-5.2 there) and in 6 of 8 in place (4.34 against 5.67, 4.35 against 8.38),
    losing only in launches where the machine's slow spell had the rings' copies 2-3x slower
    (9.6-10.3 against 5.5-6.4). At 64 KiB the two tie where the machine is quiet (out of place
    ``direct`` 6.04-6.17, cma 6.16-6.35) and cma is 2.4x faster in a spell (7.6-7.9 against
    18.6). The Intel VM where 32 KiB was chosen had cma faster at 32 KiB (alltoall 3.18 against
    3.64 us, allgather 2.99 against 3.03 for ``ring``); the race of ``Query.cma_crossover`` cannot
    tell the two machines apart there, as its ladder starts at 16 KiB blocks, where the kernel
    won on both."""
    return 64 << 10 if world_size <= 2 else 256 << 10


def _gather_from(world_size: int) -> int:
    """:func:`auto_from` for gather, since every rank writes its block into the root's output
    at once (when the root read them, alone, cma lost to ``direct`` everywhere): 64 KiB at 2
    ranks (64 KiB: 2.8 against 3.35-3.53 us for ``direct``, 256 KiB 5.8 against 11.7, 1 MiB
    14.5 against 68; 32 KiB: 2.25 against 1.88), 1 MiB above (4 ranks: 63 against 71 us, 4 MiB
    223 against 354; 256 KiB: 18 against 16)."""
    return 64 << 10 if world_size <= 2 else 1 << 20


def _broadcast_from(world_size: int) -> int:
    """:func:`auto_from` for broadcast: 32 KiB at 2 ranks (32 KiB out of place: 2.70-2.77 us
    against 3.15-3.51 for the rings; in place 2.71 against 2.68-2.71, a tie; 16 KiB: cma
    0.1-0.4 us slower), :func:`auto_from` above."""
    return 32 << 10 if world_size <= 2 else auto_from(world_size)


# Where ranks are at least twice the machine's cores (4 ranks on 2 cores, 8 on 2 or 4), ``auto``
# weighs cma for broadcast from 1 MiB on (:func:`_broadcast_skips` leaves 1-16 MiB to the rings
# elsewhere): every hand-off of a tree or ring then waits for the scheduler to run a rank that
# shares a core, which a kernel copy never does, and how long that takes swings with the machine's
# spells far more than the kernel's copy. On the 2-core Zen 4 VM of stop 48, 4 ranks, ``dbtree``
# (``auto``'s pick there until then; ``ring`` no faster) against cma, in place, medians of three
# runs' launches (``shmcoll bench -c broadcast --both``, the algorithms' order turned, and ``auto``
# before and after this rule; ``benchmarks/RESULTS.md``, stop 48): 1 MiB 771 / 294, 259 / 193, 144
# / 162 us; 4 MiB 3366 / 734, 1152 / 638, 643 / 504; out of place 1 MiB 875 / 356, 277 / 202, 158
# / 201; 4 MiB 3626 / 1093, 1595 / 1229, 845 / 733. 8 ranks, 2 launches: in place 1 MiB 1545 /
# 675, 4 MiB 5921 / 1971. At 256 KiB the spell decides (227 / 93, 64 / 45, 36 / 57): left to the
# rings. At 3 ranks on 2 cores ``dbtree`` won at 256 KiB and tied at 1-4 MiB: left as it was.


def _crowded(query: Query) -> bool:
    """Whether the call's ranks are at least twice the machine's cores (see above)."""
    return bool(query.cores) and query.world_size >= 2 * query.cores


# Where ranks outnumber cores, ``auto`` weighs cma from these call sizes on whatever the race of
# ``Query.cma_crossover`` says: the race runs two threads on two cores, and with more ranks than
# cores the rings' hand-offs wait for the scheduler too, which a kernel copy does not. Measured
# at 4 ranks on the 2-core Zen 5 VM, where the race never saw the kernel win: cma's time over the
# fastest ring's, median of 12 launches (``auto_vs_best.py -n 4 -b 1M -e 64M -f 4 --repeat 3``,
# four runs; 6 launches at 64 MiB): allgather 1.38 at 1 MiB, **0.67** at 4, 1.15 at 16, 1.25 at 64;
# allreduce 1.52, 1.28, **0.93**, **0.85**; reduce_scatter 1.78, 1.30, 1.00, **0.92**; scatter 1.73,
# 1.30, **0.93**, **0.60**; gather 1.76, 1.31, 1.50, **0.85**; alltoall 1.00, 1.27, 1.03, 1.00, and in
# 6 later launches 1.27, 1.05, 0.92, **0.79** at 64 MiB. A launch can differ by 2x either way
# (broadcast 4 MiB out of place: 0.31-0.65 in 12 of 18 launches, 1.6-2.1 in the other 6; whether
# the kernel gave the buffers huge pages, see ``shm/cma.py``), so these are where cma wins more
# often than not, from the first size where it does. One run of 3 launches before this table
# (stop 33) had cma faster at 4 MiB in 5 of 7 collectives; the 18 since, in 2 of 7 (allgather
# and, out of place, broadcast). Re-judging 12 later launches, which the table was not read
# from: 21 of 128 of ``auto``'s picks more than 10% slower than the fastest with this table, 28
# with cma from 4 MiB in every collective (``benchmarks/RESULTS.md``, stop 34).
OVERSUBSCRIBED_FROM = {
    "allreduce": 16 << 20,
    "reduce_scatter": 16 << 20,
    "scatter": 16 << 20,
    "gather": 64 << 20,
    "alltoall": 64 << 20,
}
OVERSUBSCRIBED_DEFAULT = 4 << 20  # allgather; broadcast (which _broadcast_skips keeps to 16 MiB)
# Where the ranks agreed that every buffer is on huge pages, gather's and alltoall's 64 MiB start
# at 16 MiB, up to HUGE_RANKS ranks. At 4 ranks on 2 cores, huge pages, cma's time over
# ``direct``'s, out of place / in place (``benchmarks/RESULTS.md``, stop 40):
# - gather: 16 MiB 0.57 / 0.63 (``auto_vs_best.py -n 4 --pages huge --mode both``, 5 launches),
#   0.29 / 0.44 and 32 MiB 0.65 / 0.71 (3 launches, another run), and in two launches of
#   ``shmcoll bench -a auto,direct,cma`` 0.80-1.01 / 0.78-0.88 at 16 MiB, 0.70-0.71 / 0.88-1.02 at
#   32 MiB (stop 39's run: 0.74-0.82 at 16 MiB);
# - alltoall, since its in-place swaps go a part at a time (:func:`_swaps`; before, they lost at
#   32 MiB, 1.17-1.44 in 5 of 6 launches): 8 launches alternating the two (``shmcoll bench -a
#   direct,cma`` and ``cma,direct``, each launch's own ratio), 16 MiB 0.91-0.98 / 0.87-0.96
#   (medians 0.94 / 0.89), 32 MiB 0.94-0.97 / 0.66-1.12 (0.96 / 0.94); against Open MPI
#   (``compare_peers.py -n 4 -c alltoall -b 16M -e 32M``, 3 runs of 3 rounds, paired), with
#   ``direct`` 0.78-0.84 at 16 MiB and 0.70-0.92 at 32, with cma 0.95-1.09 and 0.97-1.10.
OVERSUBSCRIBED_HUGE_FROM = {"gather": 16 << 20, "alltoall": 16 << 20}


# Where every rank's buffers are on huge pages (``Query.huge_pages``), ``auto`` runs cma from
# huge_from(collective, n) on, up to HUGE_UNTIL (alltoall past it: HUGE_UNBOUNDED), at up to
# HUGE_RANKS ranks. The kernel pins a peer's pages one at a time before it copies, so from 4 KiB
# pages it copies at about half the speed it reaches from 2 MiB ones, while the rings, copying
# with the CPU, barely notice: the race of ``Query.cma_crossover`` runs on 4 KiB pages and says
# nothing about huge ones. Measured on the 2-core Zen 5 VM (``benchmarks/RESULTS.md``, stops 37
# and 38), cma's time over the fastest ring's:
# - ``page_agreement.py --pages huge``, 3 launches, out of place: at 2 ranks 0.45-0.88 at
#   256 KiB-1 MiB in every collective, 128 KiB 0.86-1.27, 32-64 KiB 1.3-2.5; at 4 ranks on 2
#   cores 0.65-0.87 at 1 MiB, at 512 KiB 0.79-0.98 but scatter and gather 1.3, at 128-256 KiB
#   1.1-3.9; the ranks' agreement (``comm/pages.py``) then costs a barrier, 15-20 us at 4 ranks on
#   2 cores, and it pays from 2 MiB (auto 1.4-2.9x faster than the rings at 2 MiB);
# - ``auto_vs_best.py --pages huge --mode both``, 5 launches, out of place / in place: 0.50-0.94
#   at 2 MiB, 0.40-0.96 at 8 MiB (but scatter in place 1.11 and alltoall out of place 1.02 at 2
#   ranks); at 32 MiB, where memory bandwidth sets both, alltoall and gather lost at 2 ranks in
#   place (1.76 and 1.99) and alltoall at 4 (1.13), the others won or tied (0.54-1.10).
# - out of place, stop 38 (``page_agreement.py --pages huge``, 3 launches, blocks from 4 MiB read
#   from the peers: see _READ_FROM): at 2 ranks 0.52-0.94 at 4-8 MiB (reduce_scatter 0.97-0.99),
#   and from 16 MiB, where the buffers outgrow the 32 MiB L3, allgather, alltoall, broadcast and
#   gather lost (1.05-1.37) while scatter won (0.66-0.91) and allreduce and reduce_scatter tied.
# So from 16 MiB the rules for unknown pages decide again, but for alltoall (HUGE_UNBOUNDED).
# Above 4 ranks: not measured (no machine here has the cores).
HUGE_UNTIL = 16 << 20
HUGE_RANKS = 4
# Collectives for which cma stays the choice on huge pages past HUGE_UNTIL, at every size. alltoall
# at 2 ranks on numpy's buffers (mmapped from these sizes: huge pages), cma's time over
# ``direct``'s in 6 launches alternating the two (``shmcoll bench -c alltoall -b 16M -e 256M -f 4
# -a cma,direct`` and ``direct,cma``, stop 41): 16 MiB 0.64-0.85 in place and 0.63-0.84 out of
# place in 5 launches (medians 0.77, 0.77), 64 MiB 0.64-0.70 and 0.61-0.79 (0.68, 0.68), 256 MiB
# 0.63-0.68 and 0.66-0.77 (0.67, 0.73); in the sixth, where ``direct`` ran at nearly twice its
# speed of the other five (the machine's spells move the rings' copies more than the kernel's),
# 1.31, 1.01, 1.18, 0.97, 0.89, 0.96. At 4 ranks on 2 cores cma already ran from 16 MiB on huge
# pages (OVERSUBSCRIBED_HUGE_FROM). The other collectives at 2 ranks, 16-256 MiB, same runs
# (``-a cma,direct,ring``), cma over the faster ring, medians: allgather 1.17-1.22 out of place,
# broadcast 1.02-1.23 at 16 MiB, gather 1.22-1.69 in place, reduce_scatter 0.98-1.28, allreduce
# 0.91-1.20; scatter out of place 0.82-0.89 and broadcast in place 0.89 from 64 MiB, which lose
# elsewhere (scatter in place at 16 MiB 1.17, broadcast in place at 16 MiB 1.23): left as they were.
HUGE_UNBOUNDED = frozenset({"alltoall"})


def huge_from(collective: str, world_size: int) -> int:
    """The smallest call for which ``auto`` runs cma where every rank's buffers are on huge pages:
    1 MiB (reduce_scatter at 2 ranks: 2 MiB); 4 MiB for gather and scatter. Looking at pages
    costs a call more where it is small: at 2 ranks cma wins from 256 KiB on huge pages, but at
    512 KiB on 4 KiB pages the look cost 1.2-1.9 us of a 7-14 us call. At 1 MiB
    (``page_agreement.py --sizes 1M``, 5 launches, two runs) it costs 0-6% on 4 KiB pages and
    gains 1.11-1.64x on huge pages at 2 ranks, 1.19-2.56x at 4 on 2 cores, where auto had run
    the rings at 1.2-2.1x cma's time (``auto_vs_best.py --pages huge``)
    and Open MPI's single copy beat it (alltoall, allgather, broadcast: 0.67-0.86); but
    reduce_scatter at 2 ranks lost there (0.84: cma no faster than ``direct``). A gather's or
    scatter's non-root has nothing its peers reach, so it waits for the root's word before it can
    start, even on 4 KiB pages: at 2 MiB 0.91-0.95 of the rings' time without the look (2-4
    ranks), at 4 MiB 0.95-0.97, at 8 MiB 0.97-0.98; and numpy gives an array huge pages only from
    4 MiB."""
    if collective in ("gather", "scatter"):
        return 4 << 20
    return 2 << 20 if collective == "reduce_scatter" and world_size <= 2 else 1 << 20


# Which of a rank's buffers its peers' system calls reach in each plan: (input, output), at the
# root and elsewhere. The kernel pins those page by page; the caller's own side it copies as any
# copy from user memory, whatever its pages (2 ranks, cma allgather out of place, 4 MiB: 82-84 us
# with the outputs on huge pages whether the inputs were on huge or 4 KiB pages, 183 with the
# outputs on 4 KiB pages; 16 MiB: 572-584 against 1045-1060).
_REACHED = {
    "allgather": ((False, True), (False, True)),  # each rank writes its block into its peers' outputs
    "alltoall": ((False, True), (False, True)),  # (in place: the same buffer, swapped)
    "gather": ((False, True), (False, False)),  # into the root's output
    "scatter": ((True, False), (False, False)),  # from the root's input
    "broadcast": ((True, True), (False, True)),  # from the root's input, into every output
    "allreduce": ((True, True), (True, True)),
    "reduce_scatter": ((True, False), (True, False)),
    "reduce": ((True, True), (True, False)),  # peers read every input, and write into the root's output
}


def reached(collective: str, at_root: bool, count: int, world_size: int) -> tuple[bool, bool]:
    """(input, output): whether peers read or write this rank's input and output in this
    collective's cma plan for blocks of ``count`` elements at ``world_size`` ranks (``at_root``:
    this rank is the root; unrooted collectives ignore it)."""
    if collective in ("allgather", "alltoall") and _reads(collective, count, world_size):
        return True, False  # (read from the peers: see _READ_FROM)
    at, elsewhere = _REACHED[collective]
    return at if at_root else elsewhere


def _on_huge_pages(query: Query, size: int) -> bool:
    """``Algorithm.auto_huge``: where cma is taken because every rank's buffers are on huge pages."""
    n = query.world_size
    return (
        bool(query.huge_pages)
        and n <= HUGE_RANKS
        and huge_from(query.collective, n) <= size
        and (size < HUGE_UNTIL or query.collective in HUGE_UNBOUNDED)
    )


# Past the race's ladder. The race exchanges blocks of up to 4 MiB (``shm.cma.LADDER_BYTES``),
# whose calls fit in the 32 MiB L3; where the rings won at every block (``NEVER``), ``auto`` left
# cma out at 2 ranks at every size, and there the race decides by what it never measured. On the
# Zen 5 VM the race said so in 1 of 9 to 2 of 3 launches, and in those launches the rings lost
# past the L3 where the copy collectives move each byte once by the kernel and twice through
# them (``benchmarks/RESULTS.md``, stop 42): 2 ranks, the race forced to ``NEVER``, ``auto``
# (the rings) / cma, median of 5 blocks: broadcast in place 16 MiB 2436 / 602 us, 64 MiB 9016 /
# 4096, 256 MiB 30589 / 16944; allgather 16 MiB 2725 / 1742, 64 MiB 9236 / 8579, 256 MiB 32581 /
# 36105; in copy_floor.py's launches where ``auto`` ran the rings, broadcast 16-256 MiB 1.6-11x
# and allgather 16-64 MiB 1.2-2.4x slower than cma in the same launch. (alltoall: cma already
# from 16 MiB on huge pages, which numpy's buffers of these sizes have, HUGE_UNBOUNDED; on 4 KiB
# pages 2 of 2 ``shmcoll bench`` launches had it 1.02-1.25x faster than ``direct`` from 16 MiB.)
# Below 16 MiB the race's verdict stands for allgather and alltoall: on this VM the rings have
# won at 256 KiB-1 MiB in some launches (stop 33) and lost in others (stop 42), and cma's lead
# over the best ring at 1-4 MiB is thin (out of place, 21 launches of stop 43 on either page
# size: medians 0.84-0.97 of the rings' time, the rings faster in up to 2 per size; at 8 MiB on
# 4 KiB pages the rings won, allgather 1.00 and alltoall 1.36). So does it where the ranks agreed
# that their buffers are on 4 KiB pages: there alltoall's cma was 1.2-1.3x slower than ``direct``
# at 16-64 MiB in a quiet spell (stop 42); at stop 43, 5 launches at 8-64 MiB out of place, cma
# took 0.37-0.71 of the best ring's time at 24 of 40 points (allgather and alltoall) and 1.02-1.57
# at the other 16, which launch won turning with the machine's spells.
# Broadcast weighs cma from 2 MiB, on any pages: its root writes a share into its peer while the
# peer reads the rest, so two cores move each byte once, where the rings' pipeline moves it
# twice (``_broadcast_skips``). Stop 43, 2 ranks, cma's time over the best ring's in the same
# launch (``shmcoll bench -c broadcast -b 1M -e 16M -a all --both``, medians over launches):
# numpy's buffers, 13 launches, in place 0.36-0.51 at 2-16 MiB (the rings faster in 1 launch at 2
# MiB, 1.18, and 1 at 4, 1.02), out of place 0.57-0.69; 4 KiB pages (``--pages small``), 8
# launches, in place 0.35-0.67, out of place 0.64-0.85, the rings faster in none. With the race
# forced to ``NEVER``, 4 MiB in place, stop 42: the rings 477-2024 us, cma 129-193. At 1 MiB the
# rings won out of place in 1 of 21 launches (1.21), and at 256 KiB by 2.8x in launches where the
# race said so (stop 33): left to the race.
PAST_LADDER_FROM = {"broadcast": 2 << 20, "allgather": 16 << 20, "alltoall": 16 << 20}
PAST_LADDER_ANY_PAGES = frozenset({"broadcast"})


def _below_crossover(query: Query, size: int) -> bool:
    """Whether ``auto`` leaves a call of ``size`` bytes to the rings because this machine's two
    cores exchange blocks of its size faster through them than by the kernel
    (``Query.cma_crossover``, measured by ``shm.cma.crossover_bytes``): below ``n`` times the
    crossover, a block being the bytes a rank moves to one peer, about ``size / n`` in every
    collective here (the reductions' chunks, the broadcast's shares). Where ranks outnumber the
    machine's cores, from the collective's :data:`OVERSUBSCRIBED_FROM` on at the latest (from
    :data:`OVERSUBSCRIBED_HUGE_FROM` where the ranks agreed that every buffer is on huge pages),
    unless the ranks agreed that their buffers are not all on huge pages (``Query.huge_pages`` False):
    that table was measured on buffers of either page size, and on 4 KiB pages cma lost to the
    rings at every size there (4 ranks, 1.07-5.84x; stop 37). Never where :func:`_on_huge_pages`
    holds, nor at 2 ranks for broadcast from 2 MiB and allgather and alltoall from 16 MiB, whatever
    the race said (:data:`PAST_LADDER_FROM`). Not measured (0): the sizes of ``auto_from`` alone decide.

    The race decides this rather than a fixed size, because where the kernel loses differs by
    machine more than any one figure can say (see ``shm/cma.py``): on the Zen 5 VM, at 2 ranks,
    the rings were faster from 64 KiB to 1 MiB in every collective (alltoall 1 MiB 31-33 us
    against cma's 45-48, allreduce 1 MiB 48 against 89, broadcast 256 KiB 6.1 against 17.3),
    where the sizes of ``auto_from``, measured on an Intel VM, had ``auto`` run cma from 32-64
    KiB; above, cma won or lost by launch (1.7x faster to 1.4x slower at 4 MiB, mostly slower at
    16 MiB), with whether the kernel had given the buffers huge pages (``benchmarks/RESULTS.md``,
    stop 33)."""
    if _on_huge_pages(query, size):
        return False
    crossover = query.cma_crossover
    if crossover <= 0:
        return False
    past = PAST_LADDER_FROM.get(query.collective)
    if (
        past is not None
        and query.world_size == 2
        and size >= past
        and (query.huge_pages is not False or query.collective in PAST_LADDER_ANY_PAGES)
    ):
        return False  # (past the race's ladder, whatever it said: see PAST_LADDER_FROM)
    start = query.world_size * crossover
    if query.cores and query.world_size > query.cores and query.huge_pages is not False:
        start = min(start, OVERSUBSCRIBED_FROM.get(query.collective, OVERSUBSCRIBED_DEFAULT))
        if query.huge_pages and query.world_size <= HUGE_RANKS:
            start = min(start, OVERSUBSCRIBED_HUGE_FROM.get(query.collective, start))
    return size < start


def _permitted(query: Query) -> str | None:
    if query.registered:
        return "buffers from comm.alloc are read in place by zerocopy"
    if not query.cma:
        return "cross-memory attach is not permitted here (see `shmcoll info`)"
    return None


_whole = zerocopy._whole  # no slots carry data, so a call is never cut into pieces


def _broadcast_skips(query: Query, size: int) -> bool:
    """Where ``auto`` leaves broadcast to the rings although cma is weighed below and above: from
    1 MiB to 16 MiB at 3 ranks and more, unless the ranks are at least twice the machine's cores
    (:func:`_crowded`). In place (the form MPI's and torch's broadcast have) the
    rings were faster there at 4 ranks (``shmcoll bench -c broadcast -a cma,ring,dbtree``, two
    runs: 4 MiB 648-678 us for ``ring`` against 750-818 for cma; 1 MiB a tie; 16 and 64 MiB cma
    1.9x and 1.5x faster), while out of place cma was as fast or faster; ``auto`` cannot tell the
    two apart (see the module doc), and in place is the common call. At 2 ranks, since the root
    writes its share, cma is the faster one in place at every size from 128 KiB (2 MiB 64 against
    150 us, 8 MiB 312-328 against 650-662) and out of place from 256 KiB (1 MiB 42 against 93 us,
    16 MiB 1279 against 2005). Out of place at 4 ranks cma was faster than the rings from 4 MiB
    (4 MiB 758 against 875 us, 16 MiB 2878 against 4253): the rings there are in place's pick.
    The crossover's rule holds here too (:func:`_below_crossover`)."""
    if _on_huge_pages(query, size):
        return False
    n = query.world_size
    if n > 2 and 1 << 20 <= size < 16 << 20 and not _crowded(query):
        return True
    return _below_crossover(query, size)


# Elements from which an out-of-place broadcast's peers fill part of the root's output (2 ranks,
# float32: 64 KiB 4.5 against 5.0 us with the share, 128 KiB a tie, 256 KiB 12.4 against 12.0,
# 512 KiB 23.9 against 19.4). Counted in elements as plans are, so 1-byte types share from 64 KiB.
_SHARE_FROM = 64 << 10


# Where a timed broadcast stops (comm.bind.MEMO_MAX_BYTES, which a test keeps equal): the calls a
# program's loop makes through the lean path, whose entry agrees in compiled code.
_BROADCAST_TIMED_UNTIL = 1 << 20


def _broadcast_timed(query: Query, size: int) -> bool:
    """Where ``auto`` times cma against its own pick at every call (``comm/timed.py``): every
    broadcast of 3 ranks and more it leaves to the rings from ``comm.timed.BROADCAST_FROM`` (256
    KiB) to 1 MiB. The rings' hand-offs are what the VM's slow launches slow down, and a broadcast
    is all hand-offs (2-core Zen 4 VM, stop 52, 4 ranks, ``dbtree`` / cma in one launch: 512 KiB
    390-505 against 127-160 us in slow launches, 78-88 against 98-125 in quiet ones). Not above
    1 MiB, where a call is not remembered and agrees in Python: at 3 ranks, 2 MiB, the timed
    shape took 1.02-1.15x ``dbtree``'s time in 6 quiet launches. (At 4 ranks on 2 cores cma is
    ``auto``'s pick from 1 MiB: :func:`_broadcast_skips`.) At 2 ranks the root writes its share,
    and cma is ``auto``'s pick from 128 KiB already."""
    return query.world_size > 2 and size <= _BROADCAST_TIMED_UNTIL


@register(
    "broadcast",
    "cma",
    piece=_whole,
    supports=_permitted,
    peers=PEERS_CMA,
    auto_from=_broadcast_from,
    auto_skip=_broadcast_skips,
    auto_huge=_on_huge_pages,
    auto_timed=_broadcast_timed,
)
def broadcast(ctx: Context) -> None:
    """The root writes the first ``1/n`` of its buffer into every peer while each peer reads the
    rest from the root, so that the root's core copies too (each rank copies ``(n-1)/n`` of the
    buffer). Out of place the root's own output needs the buffer once more: the root copies its
    first ``1/n`` and each peer writes its share of the rest from the output it has just read
    (still in its cache), so every rank copies the buffer once; with the root copying it all,
    it copied ``(2n-1)/n`` while its peers copied ``(n-1)/n``. (Below :data:`_SHARE_FROM` the
    root copies its whole output: a peer's extra system call costs more than it saves.)"""
    n, root, count = ctx.world_size, ctx.root, ctx.count
    head = count // n
    peers = _around(root, n)
    share = not ctx.inplace and count >= _SHARE_FROM
    zerocopy.sync(ctx)
    for r in range(n):
        if r == root:
            for j in peers:
                if head:
                    ctx.copy(r, Region(Buf.IN, 0), Region(Buf.OUT, 0, rank=j), head)
            if not ctx.inplace:
                ctx.copy(r, Region(Buf.IN, 0), Region(Buf.OUT, 0), head if share else count)
        elif count > head:
            ctx.copy(r, Region(Buf.IN, head, rank=root), Region(Buf.OUT, head), count - head)
            if share:
                off, m = split(count - head, n - 1)[peers.index(r)]
                if m:
                    ctx.copy(r, Region(Buf.OUT, head + off), Region(Buf.OUT, head + off, rank=root), m)
    zerocopy.sync(ctx)


# Blocks of this many elements and more are read from the peers instead of written into them
# (allgather, alltoall out of place). Writing won where it was measured first (stop 27: 2 ranks
# exchanging 1 MiB, 126-157 us against 165-167 reading), and still ties at 2-4 MiB; beyond the
# caches reading wins, as the kernel then copies into memory this rank will read next: two
# processes each copying 4 MiB of its own and 4 MiB of its peer's on huge pages (the 2-core
# Zen 5 VM, 15 times each) took 275-313 us reading and 364-412 writing, 16 MiB 1003-1037 against
# 1102-1173; ``shmcoll bench -a cma --pages huge``, write / read, out of place: alltoall 2 ranks
# 8 MiB 383 / 258 us, allgather 16 MiB 934 / 865 and 32 MiB 2704 / 2405; 4 ranks alltoall 64 MiB
# 13.1 / 11.8 ms; on 4 KiB pages within 5% either way. An alltoall above 2 ranks reads from
# blocks of 1 MiB of float32 on (huge pages, 3 and 4 ranks on the 2 cores, ``shmcoll bench -a
# cma``, 6 rounds alternating, read / write, median of the rounds' ratios: 4 MiB 0.69 and 0.68, 8
# MiB 0.84 and 0.99); an allgather did not gain there (4 MiB 1.09 and 1.10, 8 MiB 1.01 and
# 0.95), and at 2 ranks the two tied, writing 5% faster for 1 MiB blocks.
_READ_FROM = 1 << 20
_ALLTOALL_READ_FROM = 1 << 18  # (above 2 ranks)


def _reads(collective: str, count: int, world_size: int) -> bool:
    """Whether the allgather or alltoall plan reads blocks of ``count`` elements from the peers
    rather than writes them into the peers (:data:`_READ_FROM`)."""
    many = collective == "alltoall" and world_size > 2
    return count >= (_ALLTOALL_READ_FROM if many else _READ_FROM)


def _around(r: int, n: int) -> list[int]:
    """The peers rank ``r`` writes to, in order: ``r + 1``, ``r + 2``, ... around the world, so
    that no two ranks write into the same peer at once (all starting at rank 0 was measured
    slower: allgather at 4 ranks, 16 MiB, 3493 against 3030 us, when the plans still read)."""
    return [(r + k) % n for k in range(1, n)]


@register(
    "allgather",
    "cma",
    piece=_whole,
    supports=_permitted,
    peers=PEERS_CMA,
    auto_from=_blocks_from,
    auto_skip=_below_crossover,
    auto_huge=_on_huge_pages,
)
def allgather(ctx: Context) -> None:
    """Every rank copies its input into its own block, then writes it into every peer's (blocks
    from :data:`_READ_FROM` elements, :func:`_reads`: reads every peer's into its own). The own
    copy comes before the first sync (it touches nothing a peer reads or writes), so a rank that
    enters first copies while it waits for the others."""
    n, count = ctx.world_size, ctx.count
    if not ctx.inplace:
        for r in range(n):
            ctx.copy(r, Region(Buf.IN, 0), Region(Buf.OUT, r * ctx.block), count)
    zerocopy.sync(ctx)
    for r in range(n):
        for j in _around(r, n):
            if _reads("allgather", count, n):
                ctx.copy(r, Region(Buf.IN, 0, rank=j), Region(Buf.OUT, j * ctx.block), count)
            else:
                ctx.copy(r, Region(Buf.IN, 0), Region(Buf.OUT, r * ctx.block, rank=j), count)
    zerocopy.sync(ctx)


@register(
    "gather",
    "cma",
    piece=_whole,
    supports=_permitted,
    peers=PEERS_CMA,
    auto_from=_gather_from,
    auto_skip=_below_crossover,
    auto_huge=_on_huge_pages,
)
def gather(ctx: Context) -> None:
    """Every rank writes its input into its block of the root's output (the root copies its own
    unless in place)."""
    n, root, count = ctx.world_size, ctx.root, ctx.count
    zerocopy.sync(ctx)
    for r in range(n):
        if r != root:
            ctx.copy(r, Region(Buf.IN, 0), Region(Buf.OUT, r * ctx.block, rank=root), count)
        elif not ctx.inplace:
            ctx.copy(r, Region(Buf.IN, 0), Region(Buf.OUT, r * ctx.block), count)
    zerocopy.sync(ctx)


@register(
    "alltoall",
    "cma",
    piece=_whole,
    supports=_permitted,
    peers=PEERS_CMA,
    auto_from=_blocks_from,
    auto_skip=_below_crossover,
    auto_huge=_on_huge_pages,
)
def alltoall(ctx: Context) -> None:
    """Rank ``r`` writes block ``j`` of its input into block ``r`` of rank ``j``'s output (blocks
    from :data:`_READ_FROM` elements, :func:`_reads`: reads block ``r`` of rank ``j``'s input
    into its block ``j``), after copying its own block before its first sync (as allgather). In place (see
    :func:`_swaps`) the blocks are swapped pair by pair."""
    n, count = ctx.world_size, ctx.count
    if ctx.inplace:
        _swaps(ctx)
        return
    for r in range(n):
        ctx.copy(r, Region(Buf.IN, r * ctx.block), Region(Buf.OUT, r * ctx.block), count)
    zerocopy.sync(ctx)
    for r in range(n):
        for j in _around(r, n):
            if _reads("alltoall", count, n):
                ctx.copy(r, Region(Buf.IN, r * ctx.block, rank=j), Region(Buf.OUT, j * ctx.block), count)
            else:
                ctx.copy(r, Region(Buf.IN, j * ctx.block), Region(Buf.OUT, r * ctx.block, rank=j), count)
    zerocopy.sync(ctx)


def _swaps(ctx: Context) -> None:
    """In-place alltoall: block ``j`` of rank ``r`` and block ``r`` of rank ``j`` trade places,
    the lower rank of each pair swapping the first half of the two blocks and the higher one the
    second half: read the peer's half into scratch, write its own half into the peer, copy the
    scratch into its own block. No two ranks touch the same element, so the two syncs suffice.
    Each rank copies 1.5 blocks per peer where copying its blocks into scratch and sending them
    from there cost 2, and the pair's blocks stay in the two ranks' caches. ``shmcoll bench -c
    alltoall -a cma,direct --in-place``, this plan against the staging one, alternating, 3
    rounds: 2 ranks 128 KiB 14.9 -> 6.2 us, 2 MiB 154 -> 59, 8 MiB 605 -> 480 (``direct`` 7.9,
    122, 561); 4 ranks 1 MiB 261 -> 109, 16 MiB 5159 -> 2872 (``direct`` 233, 3649).

    The halves go a part (:func:`_part`) at a time through a scratch of one part, which stays in
    the core's cache: a whole half's scratch outgrew it from 16 MiB calls, where the swap lost to
    ``direct`` (2 ranks 16 MiB 794 against 481 us; 4 ranks 32 MiB 1.17-1.44x in 5 of 6 launches).
    ``shmcoll bench -c alltoall -a cma --in-place --pages huge``, 5-8 rounds alternating, median
    of the rounds' parts / whole halves: 2 ranks 8 MiB 0.99, 16 MiB 0.74, 32 MiB 0.57, 64 MiB
    0.52; 4 ranks 8 MiB 0.91, 16 MiB 0.82, 32 MiB 0.73, 64 MiB 0.62; at 1-4 MiB (one or two
    parts) 0.90-1.04."""
    n, count, block = ctx.world_size, ctx.count, ctx.block
    halves = split(count, 2)
    part = _part(halves[0][1])
    scratch = ctx.tmp(part)
    zerocopy.sync(ctx)
    for r in range(n):
        for j in _around(r, n):
            off, m = halves[0] if r < j else halves[1]
            for s in range(off, off + m, max(part, 1)):
                k = min(part, off + m - s)
                ctx.copy(r, Region(Buf.IN, r * block + s, rank=j), scratch, k)
                ctx.copy(r, Region(Buf.IN, j * block + s), Region(Buf.OUT, r * block + s, rank=j), k)
                ctx.copy(r, scratch, Region(Buf.OUT, j * block + s), k)
    zerocopy.sync(ctx)


@register(
    "scatter",
    "cma",
    piece=_whole,
    supports=_permitted,
    peers=PEERS_CMA,
    auto_from=auto_from,
    auto_skip=_below_crossover,
    auto_huge=_on_huge_pages,
)
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


# A peer's part is read into scratch and combined at once, while it is still in this core's
# cache, and (allreduce) written into the peers' outputs at once too. 64 Ki elements (256 KiB of
# float32): with the writes per part, 2 ranks in place 2 MiB 129 us against 137 for 32 Ki parts,
# 4 MiB 295 against 311; 128 Ki parts were slower (139, 318); reduce_scatter the same within
# the spread (``shmcoll bench -c allreduce,reduce_scatter -a cma``, 3-5 runs).
_PART = 64 << 10  # elements
# At most this many parts per chunk, so that a plan stays a bounded table (1536 steps per rank
# at 2 ranks); larger calls (above 32 Mi elements per rank's chunk: 128 MiB of float32) are the
# rings' (at 256 MiB cma and the ring were already tied at 2 ranks).
_MAX_PARTS = 512


def _part(count: int) -> int:
    """Elements per part of a chunk of ``count`` (the scratch's size, too)."""
    return min(max(_PART, -(-count // _MAX_PARTS)), count)


def _reduction_permitted(query: Query) -> str | None:
    reason = _permitted(query)
    chunk = -(-query.count // query.world_size) if query.collective in ("allreduce", "reduce") else query.count
    if reason is None and chunk > _PART * _MAX_PARTS:
        return f"more than {_MAX_PARTS} parts of {_PART} elements per rank: the rings serve it"
    return reason


def _reduce_chunk(
    ctx: Context, r: int, src: int, dst: int, count: int, scratch: Region | None, spread: bool = False
) -> None:
    """``OUT[dst:+count]`` on rank ``r`` = its own ``IN[src:+count]`` (op) each peer's, around the
    world from the next rank, a part at a time; AVG's division at the last combination.
    ``spread``: each finished part is also written into every peer's ``OUT`` at the same place.

    Out of place (where ``OUT`` does not hold this rank's input), the first peer's part is read
    straight into ``OUT`` and combined there, in place, and only the others go through
    ``scratch`` (None at 2 ranks out of place: there are no others); the operands keep their
    order (this rank's own on the left), so the bits are those of the reads through scratch.
    Measured (stop 46, one process per rank running both plans in turn, 12 rounds of 15 calls,
    paired medians), out of place against reading every part into scratch: 2 ranks
    reduce_scatter 1, 4 and 16 MiB 0.93, 0.90, 0.89 (a second run: 0.94, 0.88, 0.80), allreduce
    0.98, 0.96, 0.91 (0.96, 0.91, 0.92); 3 ranks allreduce 1 and 4 MiB 0.97, 0.93; 4 ranks on 2
    cores reduce_scatter 0.98, 0.90, 0.91, allreduce 1.00, 0.97, 1.01. (The kernel's copy brings
    the output's lines into the cache, where the combination then reads and writes them; through
    scratch, the combination fetched them from memory only to overwrite them.)"""
    n = ctx.world_size
    if n == 1:
        ctx.copy(r, Region(Buf.IN, src), Region(Buf.OUT, dst), count)
        return
    part = max(_part(count), 1)
    for s in range(0, count, part):
        m = min(part, count - s)
        here = Region(Buf.OUT, dst + s)
        for pos, j in enumerate(_around(r, n)):
            into = here if pos == 0 and not ctx.inplace else scratch
            assert into is not None  # (no scratch only where no peer needs one)
            ctx.copy(r, Region(Buf.IN, src + s, rank=j), into, m)
            left = Region(Buf.IN, src + s) if pos == 0 else here
            ctx.reduce_local(r, left, into, here, m, final=pos == n - 2)
        if spread:
            for j in _around(r, n):
                ctx.copy(r, here, Region(Buf.OUT, dst + s, rank=j), m)


def _scratch(ctx: Context, chunk: int) -> Region | None:
    """A part's scratch for :func:`_reduce_chunk`, where it needs one: in place, or from 3 ranks."""
    return ctx.tmp(_part(chunk)) if ctx.inplace or ctx.world_size > 2 else None


def _allreduce_from(world_size: int) -> int:
    """:func:`auto_from` for allreduce: 64 KiB at 2 ranks, 128 KiB at 3-4 (measured on the 2-core
    machine, ``auto_vs_best.py -c allreduce``: 2 ranks 128 KiB 15.4 against 18.5 us for the best
    other algorithm, 512 KiB 51 against 70, 8 MiB 851 against 1248, 32 KiB a tie; 4 ranks 128 KiB
    45 against 52, 512 KiB 137 against 192, 8 MiB 2217 against 2989, 32 KiB 29 against 20). Above 4
    ranks, from 16 MiB: measured only with ranks outnumbering cores, 8 ranks on 2 cores
    (``auto_vs_best.py -n 8 -b 1M -e 16M -f 4``, 3 launches: 16 MiB 9.4 ms against 12.4 for ``ps``,
    the fastest ring; 4 MiB 3.1 against 3.5, 1 MiB 0.83 against 0.78; stop 33 saw it 1.2-1.4x faster
    from 4 to 16 MiB); where each rank has a core, the race of :func:`_below_crossover` decides too."""
    if world_size > 4:
        return 16 << 20
    return 64 << 10 if world_size <= 2 else 128 << 10


def _preferred(auto_from: Callable[[int], int]) -> Callable[[Query, int], bool]:
    """``Algorithm.auto_prefer`` for the reductions: from ``auto_from`` on, up to 4 ranks, ``auto``
    runs cma without asking the cost model, which charges the copy of a peer's part into scratch
    as a full copy and does not see that the combination then reads it from the cache (above 4
    ranks the model decides, from ``auto_from``'s 16 MiB)."""

    def prefer(query: Query, size: int) -> bool:
        return query.world_size <= 4 and size >= auto_from(query.world_size)

    return prefer


@register(
    "allreduce",
    "cma",
    piece=_whole,
    supports=_reduction_permitted,
    peers=PEERS_CMA,
    auto_from=_allreduce_from,
    auto_skip=_below_crossover,
    auto_huge=_on_huge_pages,
    auto_prefer=_preferred(_allreduce_from),
)
def allreduce(ctx: Context) -> None:
    """Rank ``r`` reads chunk ``r`` of every peer's input, a part at a time (into scratch, or out
    of place the first peer's into its output: :func:`_reduce_chunk`), combines it with its own,
    and writes the finished part into every peer's output while it is still in its cache.
    (Writing the whole chunk after the last part read it back from memory:
    ``shmcoll bench -c allreduce -a cma``, this plan against that one, alternating, 3 rounds: 2
    ranks in place 4 MiB 348 -> 254 us, 16 MiB 1452 -> 1019, out of place 4 MiB 449 -> 347; 4
    ranks in place 8 MiB 2185 -> 1541; 256 KiB-1 MiB within 3-5% either way.)"""
    n, count = ctx.world_size, ctx.count
    chunks = split(count, n)
    biggest = max(c for _, c in chunks)
    scratch = _scratch(ctx, biggest)
    zerocopy.sync(ctx)
    for r in range(n):
        off, c = chunks[r]
        if c:
            _reduce_chunk(ctx, r, off, off, c, scratch, spread=True)
    zerocopy.sync(ctx)


# Where a 2-rank reduce on huge pages goes back to the rings (_reduce_skips).
_REDUCE_HUGE_UNTIL = 8 << 20


def _reduce_skips(query: Query, size: int) -> bool:
    """Where ``auto`` leaves reduce to the rings: everywhere but at 2 ranks where every rank's
    buffers are on huge pages (:func:`_on_huge_pages`), from 1 MiB to below 8 MiB. Where a rank
    combines the whole call on the way to the root, the rings' copies run on both cores at once,
    while cma's kernel copies pin a peer's 4 KiB pages one by one.

    Measured on the 2-core Zen 4 VM (stop 49), cma's time over the fastest of ``direct``,
    ``dbtree`` and ``ring`` in the same launch (``shmcoll bench -c reduce -b 64K -e 64M -f 4
    --both``; the 4 of 10 launches that ran into a slow spell, where the rings' hand-offs were 3-5x
    slower and cma took 0.22-0.45 at most sizes, left out):
    - numpy's buffers, 2 ranks: 1.07-1.73 at 1 MiB, 0.78-2.00 at 4, 0.99-1.43 at 16; 4 ranks:
      1.32-2.26 at 1-4 MiB;
    - huge pages (``--pages huge``), 2 ranks, in place / out of place: 0.48 / 0.66 at 1 MiB, 0.58 /
      0.78 at 4, 0.88 / 1.31 at 16; 4 ranks 1.06-1.36. A second run (``-b 512K -e 32M -f 2``,
      4 launches, medians): 1 MiB 0.70 / 0.78, 2 MiB 0.70 / 0.92, 4 MiB 0.66 / 0.89, 8 MiB 0.81
      / 1.22, 16 MiB 0.93 / 1.23."""
    return not (query.world_size == 2 and size < _REDUCE_HUGE_UNTIL and _on_huge_pages(query, size))


def _reduce_timed(query: Query, size: int) -> bool:
    """Where ``auto`` times cma against its own pick at every call (``comm/timed.py``): every
    reduce it leaves to the rings from ``comm.timed.timed_from`` on (4 MiB; 256 KiB at 2 ranks,
    where from 1 MiB the shape looks at the ranks' pages too). Which is faster turns with
    the cores' spells more than with the size or the ranks (2-core Zen 4 VM, stop 50: calls of
    ``auto``'s pick and of cma taking turns in one launch, ``benchmarks/RESULTS.md``): cma's time
    over the other's 1.28-1.47 at 2 ranks and 512 KiB-8 MiB, 1.28-2.20 at 3 ranks and 1.32-1.83
    at 8 ranks in quiet launches, and in slow ones 0.61-0.66 at 3 ranks, 0.46-0.73 at 4 (every
    launch of that run), 0.41 at 8."""
    return True


@register(
    "reduce",
    "cma",
    piece=_whole,
    supports=_reduction_permitted,
    peers=PEERS_CMA,
    auto_skip=_reduce_skips,
    auto_huge=_on_huge_pages,
    auto_timed=_reduce_timed,
)
def reduce(ctx: Context) -> None:
    """allreduce's plan with the finished parts written into the root's output alone: rank ``r``
    reads chunk ``r`` of every peer's input, a part at a time, and combines it with its own (the
    root into its output, as :func:`_reduce_chunk`; the others, which have no output, in a part of
    scratch), then writes the part into the root's output. Every rank combines ``1/n`` of the
    call, where the rings' chain or trees combine all of it on the way to the root."""
    n, root, count = ctx.world_size, ctx.root, ctx.count
    chunks = split(count, n)
    biggest = max(c for _, c in chunks)
    part = max(_part(biggest), 1)
    scratch = _scratch(ctx, biggest)
    acc = ctx.tmp(part) if n > 1 else None  # (a non-root's part, combined)
    peer = scratch if scratch is not None else ctx.tmp(part)
    zerocopy.sync(ctx)
    for r in range(n):
        off, c = chunks[r]
        if not c:
            continue
        if r == root:
            _reduce_chunk(ctx, r, off, off, c, scratch)
            continue
        assert acc is not None
        for s in range(0, c, part):
            m = min(part, c - s)
            for pos, j in enumerate(_around(r, n)):
                ctx.copy(r, Region(Buf.IN, off + s, rank=j), peer, m)
                left = Region(Buf.IN, off + s) if pos == 0 else acc
                ctx.reduce_local(r, left, peer, acc, m, final=pos == n - 2)
            ctx.copy(r, acc, Region(Buf.OUT, off + s, rank=root), m)
    zerocopy.sync(ctx)


def _reduce_scatter_from(world_size: int) -> int:
    """:func:`auto_from` for reduce_scatter: 64 KiB at 2 ranks (64 KiB: 4.2 against 4.5 us for the
    rings, 512 KiB 17.8 against 31; 8 KiB: 2.3 against 1.6), 1 MiB above (4 ranks: 168 against
    182 us, 4 MiB 666 against 796; 256 KiB a tie, 64 KiB 20 against 14); above 4 ranks from 16 MiB, as
    :func:`_allreduce_from` (8 ranks on 2 cores, the same launches: 16 MiB 5.5 ms against 6.0 for
    ``ring``; 4 MiB 2.5 against 1.6)."""
    if world_size > 4:
        return 16 << 20
    return 64 << 10 if world_size <= 2 else 1 << 20


@register(
    "reduce_scatter",
    "cma",
    piece=_whole,
    supports=_reduction_permitted,
    peers=PEERS_CMA,
    auto_from=_reduce_scatter_from,
    auto_skip=_below_crossover,
    auto_huge=_on_huge_pages,
    auto_prefer=_preferred(_reduce_scatter_from),
)
def reduce_scatter(ctx: Context) -> None:
    """Rank ``r`` reads block ``r`` of every peer's input, a part at a time, and combines it with
    its own into its output (out of place the first peer's part is read into the output itself:
    :func:`_reduce_chunk`)."""
    n, count = ctx.world_size, ctx.count
    scratch = _scratch(ctx, count)
    zerocopy.sync(ctx)
    for r in range(n):
        if count:
            _reduce_chunk(ctx, r, r * ctx.block, 0, count, scratch)
    zerocopy.sync(ctx)
