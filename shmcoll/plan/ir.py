"""The plan vocabulary, the step instruction, and its encoding as an int64 table.

Vocabulary (names elsewhere follow it):

- **rank**: a process's index in its communicator, ``0 <= rank < world_size``; **peer**: the
  other rank of a transfer; **root**: the rank a rooted collective starts from or ends at.
- **count**: elements; **nbytes**: bytes.
- **block**: the part of a buffer that belongs to one rank in a blocked collective (``gather``'s
  output holds ``world_size`` blocks); **chunk**: the part of a buffer an algorithm assigns to
  one rank (ring's reduce-scatter chunks).
- **slot**: a fixed-size cell of a ring, holding at most ``slot_capacity`` elements of the
  call's engine dtype; **channel** (ring): one directed single-producer single-consumer queue
  of ``nslots`` slots between two ranks.
- **message**: what one step sends or receives: at most one slot's payload.
- **piece**: the sub-range of every block that one pass of an algorithm handles. A call's count
  is cut into ``reps`` full pieces plus a tail piece (:func:`shmcoll.plan.passes.plan_call`),
  and the same step program (the **body**) runs once per full piece, so plans stay small
  whatever the count and large calls pipeline through a bounded number of slots.
- (A **segment** is a shared-memory segment, :mod:`shmcoll.shm.segment`, and nothing else.)
- **step**: one instruction of a rank's program; **program**: one rank's steps; **plan**: the
  programs of all ranks for one call shape.
- **seq**: the communicator's collective call counter (point-to-point transfers count per
  channel instead); **sig**: the call's signature, packed into 64 bits and decodable.

A step is one general transfer instruction, so that the engine stays a short loop::

    X, Y   = region A, region B               (operands)
    if RECV: the incoming slot replaces Y     (or X, with RECV_LEFT)
    v      = REDUCE ? X (op) Y : X-or-slot    (FINAL: AVG's division, applied once)
    if SEND:  outgoing slot <- v
    if STORE: region D      <- v

Regions name a buffer (IN, OUT, TMP) and an element offset. IN/OUT offsets are relative to the
current piece (the engine adds the piece's base); TMP offsets are not (pieces reuse TMP).

A region may name **another rank's** IN or OUT (``Region(Buf.IN, off, rank=p)``): with
registered buffers (``comm.alloc``) every rank maps every rank's buffer, and zero-copy plans read
peers' data in place instead of receiving it through slots; over ordinary buffers cma's plans
reach them with cross-memory attach. A step writes a peer's buffer only as a plain copy of its
own data (cma's ``process_vm_writev``). The encoding packs the owner into the buffer code
(``buf + 4 (owner + 1)``, owner -1 for the rank itself). Such a plan is marked registered in its
header, and the engine then places IN and OUT regions with the call's shifts and strides from
its state: where the call's buffer starts within each rank's region, and the distance between
two ranks' regions. One plan thus serves any registered buffers of the same shape.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from shmcoll.collectives import BY_CODE, KIND_CODE, PLAN_KINDS
from shmcoll.types import DTYPE_CODE, ReduceOp, dtype_name


class Buf(enum.IntEnum):
    IN = 0
    OUT = 1
    TMP = 2


# Opcode flags.
RECV = 1
SEND = 2
REDUCE = 4
STORE = 8
FINAL = 16
RECV_LEFT = 32

# Encoded step columns.
(
    C_OP,
    C_PEER_IN,
    C_CH_IN,
    C_PEER_OUT,
    C_CH_OUT,
    C_A_BUF,
    C_A_OFF,
    C_B_BUF,
    C_B_OFF,
    C_D_BUF,
    C_D_OFF,
    C_COUNT,
    C_TAG,
) = range(13)
NCOLS = 13

# Header row (row 0 of an encoded plan).
(
    HD_NBODY,
    HD_NTAIL,
    HD_REPS,
    HD_PIECE,
    HD_OP,
    HD_SIG,
    HD_KIND,
    HD_REGISTERED,
    HD_ENTRY,
) = range(9)
# How the engine enters a program (HD_ENTRY): the same table is kept once per way of entering it.
ENTRY_START = 0  # a new call: claims the communicator's engine state
ENTRY_RESUME = 1  # the claimed call, continued after a wait returned to Python
ENTRY_NESTED = 2  # a new call inside a call made of several (object collectives, alloc, split)
ENTRY_CLAIMED = 3  # a new call whose caller already claimed the engine state (see engine.cpu)
# How a plan's regions on other ranks are reached (HD_REGISTERED): not at all (every region is
# the rank's own), through the shared allocation of registered buffers (zerocopy), or by
# cross-memory attach into the peer's own buffers (cma: copies only).
PEERS_NONE = 0
PEERS_REGISTERED = 1
PEERS_CMA = 2


@dataclasses.dataclass(frozen=True)
class Region:
    buf: Buf
    off: int
    rank: int | None = None  # owner: None for this rank's own buffer

    def __str__(self) -> str:
        owner = "" if self.rank is None else f"@{self.rank}"
        return f"{self.buf.name}{owner}[{self.off}]"

    @property
    def code(self) -> int:
        """The buffer code in an encoded step: kind plus 4 x (owner + 1)."""
        return int(self.buf) + 4 * (0 if self.rank is None else self.rank + 1)


@dataclasses.dataclass(frozen=True)
class Step:
    """One instruction of a rank's program (see the module docstring for its meaning)."""

    count: int
    recv: int | None = None
    send: int | None = None
    a: Region | None = None
    b: Region | None = None
    dst: Region | None = None
    reduce: bool = False
    final: bool = False
    recv_left: bool = False
    fence: bool = False  # no-op: keeps the fuse pass from merging across it, which then drops it
    # What a message says about itself, checked by its receiver (0: the call's placement word).
    # Variable-count plans tag each message with the size the sender meant (count of the pair's
    # whole transfer + 1), so a receiver that expected another size reports a mismatch instead
    # of taking part of the next message.
    tag: int = 0

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"negative count in {self}")
        if self.fence:
            if self.count or self.recv is not None or self.send is not None or self.dst is not None:
                raise ValueError("a fence does nothing else")
            return
        if self.reduce:
            if self.recv is None and (self.a is None or self.b is None):
                raise ValueError("a local reduce needs regions a and b")
            if self.recv is not None and self.recv_left and self.b is None:
                raise ValueError("recv_left reduce needs region b")
            if self.recv is not None and not self.recv_left and self.a is None:
                raise ValueError("reduce with a received right operand needs region a")
        elif self.final:
            raise ValueError("final needs reduce")
        if self.recv is None and not self.reduce and (self.send is not None or self.dst is not None):
            if self.a is None and self.count > 0:
                raise ValueError("a step that sends or stores local data needs region a")
        if self.recv is None and self.send is None and self.dst is None:
            raise ValueError("a step must receive, send or store")
        if self.dst is not None and self.dst.rank is not None:
            # A copy into a peer's buffer (cma's process_vm_writev, a store into a peer's
            # comm.alloc region): from this rank's own buffer, and nothing else in the step.
            plain = self.recv is None and self.send is None and not self.reduce
            if not plain or self.a is None or self.a.rank is not None:
                raise ValueError("a step may write a peer's buffer only by copying its own data there")

    @property
    def flags(self) -> int:
        f = 0
        if self.recv is not None:
            f |= RECV
        if self.send is not None:
            f |= SEND
        if self.reduce:
            f |= REDUCE
        if self.dst is not None:
            f |= STORE
        if self.final:
            f |= FINAL
        if self.recv_left:
            f |= RECV_LEFT
        return f

    def operands(self) -> tuple[str, str]:
        """The left and right operand of a reduce, as text: a region or ``recv(peer)``."""
        x = str(self.a)
        y = str(self.b)
        if self.recv is not None:
            if self.recv_left:
                x = f"recv({self.recv})"
            else:
                y = f"recv({self.recv})"
        return x, y

    def __str__(self) -> str:
        if self.fence:
            return "fence"
        if self.reduce:
            x, y = self.operands()
            value = f"{x} (op) {y}" + (" /n" if self.final else "")
        else:
            value = f"recv({self.recv})" if self.recv is not None else str(self.a)
        outs = []
        if self.dst is not None:
            outs.append(str(self.dst))
        if self.send is not None:
            outs.append(f"send({self.send})")
        return f"{' + '.join(outs) or 'drop'} <- {value}  [{self.count}]"


Program = list[Step]


@dataclasses.dataclass
class Plan:
    """The programs of all ranks for one piece of a call."""

    kind: str
    algorithm: str
    world_size: int
    count: int
    root: int
    inplace: bool
    programs: list[Program]
    tmp_count: int = 0


@dataclasses.dataclass
class CallPlan:
    """A call: ``reps`` runs of ``body`` on consecutive pieces, then ``tail`` on the rest."""

    body: Plan | None
    tail: Plan
    reps: int
    piece: int

    @property
    def tmp_count(self) -> int:
        return max(self.tail.tmp_count, self.body.tmp_count if self.body else 0)


# --- call signatures -------------------------------------------------------------------------
# marker:1 | kind:5 | algorithm:4 | dtype:5 | op:4 | root:11 | count:33 (low bits); the marker
# bit keeps every signature non-zero (a zeroed slot never matches). Whether a call is in
# place is not part of it: that changes only a rank's local copies, never its messages, and
# ranks may differ in it (a rooted collective's root alone may be in place).
_SIG_FIELDS = (("kind", 5), ("algorithm", 4), ("dtype", 5), ("op", 4), ("root", 11), ("count", 33))
_SIG_MARKER = 1 << 62


def pack_sig(kind: str, algorithm_code: int, dtype: np.dtype, op: int, root: int, count: int) -> int:
    """Pack a call's description into a non-negative int64 that :func:`describe_sig` decodes."""
    values = {
        "kind": KIND_CODE[kind],
        "algorithm": algorithm_code,
        "dtype": DTYPE_CODE.get(np.dtype(dtype), 31),
        "op": int(op),
        "root": root,
        "count": count,
    }
    sig = 0
    shift = 0
    for name, width in reversed(_SIG_FIELDS):
        sig |= (values[name] & ((1 << width) - 1)) << shift
        shift += width
    return sig | _SIG_MARKER


def unpack_sig(sig: int) -> dict[str, int]:
    out = {}
    shift = 0
    for name, width in reversed(_SIG_FIELDS):
        out[name] = (sig >> shift) & ((1 << width) - 1)
        shift += width
    return out


def describe_sig(sig: int, algorithm_names: tuple[str, ...] = ()) -> str:
    """``allreduce(count=10, float32, SUM, algorithm=ring)`` for a packed signature."""
    if not sig & _SIG_MARKER:
        return "no call"
    f = unpack_sig(sig)
    kind = PLAN_KINDS[f["kind"]] if f["kind"] < len(PLAN_KINDS) else ""
    if not kind:
        return f"kind#{f['kind']}(...)"
    if kind == "barrier":
        return "barrier()"
    record = BY_CODE[f["kind"]]
    if record.varying:  # (the count is the total where every rank knows it, else 0: say nothing)
        parts = ([f"total={f['count']}"] if f["count"] else []) + [dtype_name(f["dtype"])]
    else:
        parts = [f"count={f['count']}", dtype_name(f["dtype"])]
    if record.reducing:
        parts.append(ReduceOp(f["op"]).name if f["op"] < len(ReduceOp) else f"op#{f['op']}")
    if record.rooted:
        parts.append(f"root={f['root']}")
    alg = f["algorithm"]
    if alg < len(algorithm_names):
        parts.append(f"algorithm={algorithm_names[alg]}")
    return f"{kind}({', '.join(parts)})"


# --- encoding --------------------------------------------------------------------------------
def _encode_steps(steps: Program, rank: int, channel: object) -> np.ndarray:
    rows = np.full((len(steps), NCOLS), -1, dtype=np.int64)
    for i, s in enumerate(steps):
        rows[i, C_OP] = s.flags
        if s.recv is not None:
            rows[i, C_PEER_IN] = s.recv
            rows[i, C_CH_IN] = channel(s.recv, rank)  # type: ignore[operator]
        if s.send is not None:
            rows[i, C_PEER_OUT] = s.send
            rows[i, C_CH_OUT] = channel(rank, s.send)  # type: ignore[operator]
        for col_buf, col_off, region in ((C_A_BUF, C_A_OFF, s.a), (C_B_BUF, C_B_OFF, s.b), (C_D_BUF, C_D_OFF, s.dst)):
            if region is not None:
                rows[i, col_buf] = region.code
                rows[i, col_off] = region.off
            else:
                rows[i, col_off] = 0
        rows[i, C_COUNT] = s.count
        rows[i, C_TAG] = s.tag
    return rows


def _peer_region(plan: CallPlan) -> str | None:
    """The first step, on any rank, that names a region on another rank, as text; else None."""
    for part in (plan.body, plan.tail):
        for rank, steps in enumerate(part.programs if part else ()):
            for s in steps:
                if any(r is not None and r.rank is not None for r in (s.a, s.b, s.dst)):
                    return f"rank {rank}: {s}"
    return None


def encode(
    plan: CallPlan,
    rank: int,
    channel: object,
    op: int,
    sig: int,
    peers: int = PEERS_NONE,
) -> np.ndarray:
    """One rank's program as an int64 table: a header row, the body rows, then the tail rows.

    ``channel(src, dst)`` maps a rank pair to its channel index (``Layout.channel``).
    ``peers`` says how regions on other ranks are reached: ``PEERS_REGISTERED`` for a plan over
    buffers from ``comm.alloc``, whose placement the engine takes from its state at each call
    (see the module docstring), ``PEERS_CMA`` for copies out of peers' own buffers. A plan that
    names a peer's region under ``PEERS_NONE`` is refused (ValueError), on every rank alike: the
    engine would read this rank's own buffer there instead (``Algorithm.peers`` says the mode).
    """
    if peers == PEERS_NONE and (where := _peer_region(plan)) is not None:
        raise ValueError(
            f"{plan.tail.kind}/{plan.tail.algorithm}: the plan names peer regions ({where}) but was "
            "encoded with peers=PEERS_NONE; register the algorithm with the peers mode it needs"
        )
    body = _encode_steps(plan.body.programs[rank], rank, channel) if plan.body else np.empty((0, NCOLS), np.int64)
    tail = _encode_steps(plan.tail.programs[rank], rank, channel)
    header = np.zeros((1, NCOLS), dtype=np.int64)
    header[0, HD_NBODY] = len(body)
    header[0, HD_NTAIL] = len(tail)
    header[0, HD_REPS] = plan.reps if plan.body else 0
    header[0, HD_PIECE] = plan.piece
    header[0, HD_OP] = int(op)
    header[0, HD_SIG] = sig
    header[0, HD_KIND] = KIND_CODE[plan.tail.kind]
    header[0, HD_REGISTERED] = int(peers)
    table = np.concatenate([header, body, tail])
    return np.ascontiguousarray(table)


def with_entry(table: np.ndarray, entry: int) -> np.ndarray:
    """A copy of an encoded program entered as ``entry`` (``ENTRY_*``)."""
    copy = table.copy()
    copy[0, HD_ENTRY] = entry
    return copy
