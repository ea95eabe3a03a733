"""Registered buffers: ``comm.alloc``, and calls that read the peers' buffers in place.

A call on arrays from :meth:`~shmcoll.Communicator.alloc` (``SharedArray``) is *routed* before it
is bound: ``auto`` weighs the ``zerocopy`` algorithm against the others on such buffers (it saves
copies but pays barriers), and a zero-copy call gets a :class:`Placement`: which allocations its
buffers are in and where. The placement travels with the bound call to the run loop, which
hands the engine the whole allocations and writes the call's offsets into the engine state
only once the call holds it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from shmcoll.algos.registry import Query
from shmcoll.algos.select import choose
from shmcoll.collectives import Collective, InPlace
from shmcoll.comm import groups
from shmcoll.comm.calls import Call
from shmcoll.engine import cpu as engine
from shmcoll.errors import ShmcollError, UnsupportedError
from shmcoll.shm.registered import Allocation, SharedArray, region_bytes
from shmcoll.shm.segment import Segment, segment_name
from shmcoll.types import BFLOAT16, DTYPE_CODE, FLOAT16, dtype_str

_ALLOCATIONS = itertools.count()  # segment names of alloc() calls, unique in this process
_MAX_CHOICES = 512  # auto decisions kept per communicator

Runtime = Any  # comm.runtime.Runtime


class Placement:
    """Where a zero-copy call's buffers sit: allocations and byte offsets in this rank's region."""

    __slots__ = ("a_in", "shift_in", "a_out", "shift_out", "tag")

    def __init__(
        self, a_in: Allocation, shift_in: int, a_out: Allocation | None, shift_out: int, out_read: bool
    ) -> None:
        self.a_in, self.shift_in, self.a_out, self.shift_out = a_in, shift_in, a_out, shift_out
        # Every message of the call carries this tag of where the buffers that *peers read* sit
        # (the output too, where peers read it: allreduce); a peer whose sit elsewhere mismatches.
        tag: tuple[int, ...] = (a_in.ident & 0xFFFF, shift_in)
        if out_read:
            tag += (a_in.ident & 0xFFFF, shift_in) if a_out is None else (a_out.ident & 0xFFFF, shift_out)
        self.tag = hash(tag) & 0x7FFF_FFFF_FFFF_FFFF

    def buffers(self, call: Call, x: np.ndarray, out: np.ndarray | None, state: np.ndarray) -> tuple[Any, Any]:
        """The engine's arrays (whole allocations) and this call's offsets in ``state``."""
        engine_dtype = call.engine_dtype
        item = engine_dtype.itemsize
        inp = self.a_in.view(engine_dtype)
        state[engine.S_IN_SHIFT] = self.shift_in // item
        state[engine.S_IN_STRIDE] = self.a_in.region_bytes // item
        out_alloc, out_shift = (self.a_in, self.shift_in) if out is x else (self.a_out, self.shift_out)
        if out is None:
            res = call.no_buffer
            state[engine.S_OUT_SHIFT] = state[engine.S_OUT_STRIDE] = 0
        elif out_alloc is not None:
            res = out_alloc.view(engine_dtype)
            state[engine.S_OUT_SHIFT] = out_shift // item
            state[engine.S_OUT_STRIDE] = out_alloc.region_bytes // item
        else:  # a plain local output, which only this rank writes and reads
            res = out if out.ndim == 1 else out.reshape(-1)
            if res.dtype != engine_dtype:
                res = res.view(engine_dtype)
            state[engine.S_OUT_SHIFT] = state[engine.S_OUT_STRIDE] = 0
        state[engine.S_PLACE] = self.tag
        return inp, res


def is_registered(a: Any) -> bool:
    return isinstance(a, SharedArray)


def route(
    rt: Runtime, coll: Collective, x: Any, out: Any, algorithm: str, root: Any
) -> tuple[Any, Any, str, Placement | None]:
    """(plain x, plain out, algorithm, placement) for a call on arrays from ``alloc``: zero-copy
    where possible and chosen, else the usual path on plain views of the same memory."""
    plain_x = x.view(np.ndarray) if isinstance(x, SharedArray) else x
    plain_out = plain_x if out is x else (out.view(np.ndarray) if isinstance(out, SharedArray) else out)
    chosen = algorithm
    if algorithm == "auto" and coll.zero_copy and isinstance(x, np.ndarray):
        chosen = _auto(rt, coll, x, root)
        if chosen != "zerocopy":  # it measured (or is modelled) slower at this size
            algorithm = chosen
    placement = _placement(rt, coll, x, out) if chosen in ("auto", "zerocopy") else "not asked for"
    if isinstance(placement, str):
        if algorithm == "zerocopy":
            raise UnsupportedError(f"{coll.name}: algorithm 'zerocopy' cannot serve this call: {placement}")
        return plain_x, plain_out, algorithm, None
    return plain_x, plain_out, "zerocopy", placement


def _auto(rt: Runtime, coll: Collective, x: np.ndarray, root: Any) -> str:
    """What ``auto`` runs for a call that could go zero-copy: ``zerocopy`` saves a copy but
    pays two or three barriers, so the selection weighs it against the other algorithms on
    such buffers (measured by ``shmcoll tune``, else modelled). Every rank of a valid call
    asks the same question, so every rank gets the same answer."""
    n = rt.world_size
    if not coll.rooted:
        root = 0
    elif not isinstance(root, (int, np.integer)) or not 0 <= root < n:
        return "zerocopy"  # the call's own checks reject it, with the usual message
    key = (coll.name, x.size, x.dtype.itemsize, root)
    chosen = rt._auto_registered_choice.get(key)
    if chosen is None:
        count = x.size // n if coll.blocks_in else x.size
        query = Query(coll.name, n, count, x.dtype.itemsize, root=int(root), registered=True, cores=os.cpu_count() or 0)
        lay = rt._arena.layout
        chosen = choose(
            query,
            "auto",
            slot_bytes=lay.slot_bytes,
            nslots=lay.nslots,
            group_size=groups.group_size(rt),
            logger=rt._log,
        ).name
        if len(rt._auto_registered_choice) >= _MAX_CHOICES:
            rt._auto_registered_choice.clear()
        rt._auto_registered_choice[key] = chosen
    return chosen


def _placement(rt: Runtime, coll: Collective, x: Any, out: Any) -> Placement | str:
    """Where this call's registered buffers are, or why the call cannot go zero-copy."""
    if not coll.zero_copy:
        return f"{coll.name} has no zero-copy form"
    if not isinstance(x, SharedArray) or x._allocation not in rt._allocations:
        return "this rank's buffer is not from comm.alloc on this communicator"
    if coll.reducing and x.dtype in (FLOAT16, BFLOAT16):
        return f"{dtype_str(x.dtype)} reduces through float32 scratch, which peers cannot read"
    a_in = x._allocation
    shift_in = a_in.placement(x, rt.rank) if a_in is not None else None
    if shift_in is None or not x.flags.c_contiguous:
        return "the buffer is not a contiguous part of its allocation"
    a_out: Allocation | None = None
    shift_out: int | None = 0
    if isinstance(out, SharedArray) and out._allocation in rt._allocations and out.flags.c_contiguous:
        a_out = out._allocation
        shift_out = a_out.placement(out, rt.rank) if a_out is not None else None
        if shift_out is None:
            a_out, shift_out = None, 0
    if coll.name == "allreduce" and not (out is None or out is x or a_out is not None):
        return "peers read each other's allreduce output: out must be from comm.alloc too, or x itself"
    if coll.inplace is InPlace.INPUT_IS_MY_BLOCK and out is not None and np.may_share_memory(x, out):
        return "in place, x = out[rank] sits at a different place on every rank"
    assert a_in is not None
    return Placement(a_in, shift_in, a_out, shift_out or 0, out_read=coll.name == "allreduce")


# --- comm.alloc ---------------------------------------------------------------------------------
def alloc(comm: Any, shape: int | Sequence[int], dtype: Any, timeout: float | None) -> SharedArray:
    """``comm.alloc`` (see its docstring)."""
    comm._check_usable()
    dims = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
    dt = np.dtype(dtype)
    if any(d < 0 for d in dims):
        raise ValueError(f"alloc: negative dimension in shape {dims}")
    if dt not in DTYPE_CODE:
        raise TypeError(f"alloc: unsupported dtype {dtype_str(dt)}")
    nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    rb = region_bytes(nbytes)
    n = comm.world_size
    if rb * n > comm._mem_total:
        raise ValueError(f"alloc: {rb * n:,} bytes of shared memory is more than this machine has")
    error: Exception | None = None
    segment = None
    with comm._nested("alloc", timeout):
        asked = comm.allgather_object((dims, dtype_str(dt)), timeout=timeout)
        if any(a != asked[comm.rank] for a in asked):
            error = ValueError(f"alloc must get the same shape and dtype on every rank; got {asked}")
        else:
            segment, error = shared_segment(comm, "alloc", f"buf{next(_ALLOCATIONS)}", rb * n, timeout)
    if error is not None:  # the same on every rank: raised after the block, it breaks nothing
        raise error
    assert segment is not None
    allocation = Allocation(next(comm._allocation_ids), segment, n, rb)
    comm._allocations.add(allocation)
    return allocation.region(comm.rank, dims, dt)


def shared_segment(
    comm: Any, what: str, name_part: str, nbytes: int, timeout: float | None
) -> tuple[Segment | None, Exception | None]:
    """Rank 0 creates a segment, every rank maps it, rank 0 unlinks its name (collective).

    Returns the segment, or the error that every rank raises alike: a failure to create it on
    rank 0 or to map it on any rank becomes an error on every rank (never a hang, never one
    rank with memory its peers lack).
    """
    offer: Any = None
    segment: Segment | None = None
    if comm.rank == 0:
        try:
            name = segment_name(comm.handle.token, name_part)
            segment = Segment.create(name, nbytes, what_for=f"{what} ({nbytes:,} bytes)")
            offer = segment.name
        except Exception as exc:  # noqa: BLE001  (every rank must learn it)
            offer = ("error", f"{type(exc).__name__}: {exc}")
    offer = comm.broadcast_object(offer, timeout=timeout)
    if isinstance(offer, tuple):
        return None, ShmcollError(f"{what}: rank 0 could not create the shared memory: {offer[1]}")
    failure = None
    try:
        if segment is None:
            segment = Segment.attach(offer, nbytes)
    except Exception as exc:  # noqa: BLE001
        failure = f"{type(exc).__name__}: {exc}"
    failures = comm.allgather_object(failure, timeout=timeout)  # all mapped (or failed): unlink
    if comm.rank == 0 and segment is not None:
        segment.unlink()
    failed = {r: f for r, f in enumerate(failures) if f is not None}
    if failed:
        if segment is not None:
            segment.close()
        return None, ShmcollError(f"{what}: rank(s) {sorted(failed)} could not map the shared memory: {failed}")
    return segment, None
