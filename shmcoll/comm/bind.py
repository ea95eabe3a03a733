"""From a method's arguments to a bound call: every check, before any communication.

One binder per family of collectives, driven by the collective's record
(:mod:`shmcoll.collectives`) rather than by its name:

- :func:`elementwise`: the result has x's shape (allreduce, reduce, broadcast, alltoall);
- :func:`gathering`: the result stacks one block per rank (allgather, gather);
- :func:`scattering`: the input holds one block per rank (scatter, reduce_scatter);
- :func:`varying`: flat buffers cut into blocks by counts (the v-forms);
- :func:`barrier`.

A binder checks the arrays (shape, dtype, contiguity, writeability, overlap), decides whether
the call is in place, finds the call shape, allocates a result the caller did not give, and
returns a bound call: the run loop (and, later, a request) only executes it. The same binders
serve every *kind* of array: :data:`HOST` (numpy arrays; plans and the CPU engine) and
``comm.device.DEVICE`` (device arrays, described by ``engine.cuda.DeviceBuffer``). Plain numpy
arrays take the first lines of each binder and nothing else; arrays from ``comm.alloc`` are
routed first (``comm.registered``), device arrays are described and bound with their kind.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmcoll.collectives import KIND_CODE, Collective
from shmcoll.comm import arrays, device, pages, registered, tensors
from shmcoll.comm.calls import Bound, Call
from shmcoll.comm.requests import with_trying
from shmcoll.comm.runtime import Runtime
from shmcoll.engine import cpu as engine
from shmcoll.types import dtype_str


class HostKind:
    """Numpy arrays: call shapes are plans, run by the CPU engine."""

    @staticmethod
    def new(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    @staticmethod
    def shape(
        rt: Runtime,
        coll: Collective,
        dtype: np.dtype,
        count: int,
        op: Any,
        algorithm: str,
        inplace: bool,
        root: Any,
        zero_copy: bool,
    ) -> Call:
        key = (coll.code, dtype, count, op, algorithm, inplace, root, zero_copy)
        call = rt._calls.get(key)
        if call is not None:
            return call  # type: ignore[no-any-return]
        return rt._shape(  # type: ignore[no-any-return]
            key,
            coll.name,
            dtype,
            count,
            op=op,
            algorithm=algorithm,
            inplace=inplace,
            root=root,
            registered=zero_copy,
        )

    # The run loop's own binding, called straight (one Python frame fewer on the hot path).
    bind = staticmethod(Runtime._bind)


HOST = HostKind()


def _reroute(rt: Runtime, coll: Collective, x: Any, out: Any, algorithm: str, root: Any) -> tuple[Any, ...] | None:
    """For arrays that are not plain ``np.ndarray``: (x, out, algorithm, placement, kind) to bind
    instead, or None to go on with these. Raises TypeError for what is no array at all."""
    probe = out if x is None else x
    if registered.is_registered(probe) or registered.is_registered(out):
        plain_x, plain_out, algorithm, placement = registered.route(rt, coll, x, out, algorithm, root)
        return plain_x, plain_out, algorithm, placement, HOST
    if not (tensors.is_tensor(probe) and probe.is_cpu) and device.is_device(probe):
        # (a CPU tensor answers the device probe with an exception: microseconds, so not asked)
        kind = device.DEVICE
        dx = kind.describe(x, "x")
        return dx, dx if out is x else kind.describe(out, "out"), algorithm, None, kind
    if isinstance(probe, np.ndarray) and (out is None or isinstance(out, np.ndarray)):
        return None
    # Buffers (bytearray, memoryview, array.array): bound as numpy views of the same memory.
    vx = x if x is None or isinstance(x, np.ndarray) else arrays.not_host_array("x", x)
    vout = (
        vx if out is x else (out if out is None or isinstance(out, np.ndarray) else arrays.not_host_array("out", out))
    )
    return vx, vout, algorithm, None, HOST


MEMO_MAX_BYTES = 1 << 20
"""Largest buffer a remembered call may hold on to (see :func:`_remember`)."""


def _remember(rt: Runtime, coll: Collective, x: Any, out: Any, op: Any, root: Any, algorithm: str, b: Any) -> Any:
    """Keep ``b`` as the collective's last call, and return it.

    A program that calls a collective in a loop passes the same arrays every time; the next call
    with the very same objects (``is``), op, root and algorithm, whose dtype object is the same
    and whose written array is still writeable, gets this bound call back instead of checking
    and binding again: about 0.4 us of an 8-byte in-place call, 1 us out of place. Only plain
    numpy calls and CPU-tensor calls whose engine arrays are views of the caller's (not the copies
    of float16 and read-only inputs, not zero-copy placements, not a result this call allocated)
    are kept, and only small ones (``MEMO_MAX_BYTES``; above it the binding is noise), so that a
    large buffer the program dropped is not kept alive until the collective's next call. A
    tensor can change its storage, shape or strides in place (``set_``, ``resize_``), so a
    tensor call also compares those (``tensors.layout_of``: about 0.3 us, against the 2 us a
    tensor's binding costs).
    """
    if not (
        type(b) is tuple
        and b[1] is not None
        and b[5] is None
        and (b[3] is None or b[3] is x or b[3] is out)
        and b[1].nbytes <= MEMO_MAX_BYTES
        and b[2].nbytes <= MEMO_MAX_BYTES
    ):
        return b
    if (x is None or type(x) is np.ndarray) and (out is None or type(out) is np.ndarray):
        guard = None
    elif (x is None or tensors.is_tensor(x)) and (out is None or tensors.is_tensor(out)):
        guard = tensors.layout_of(x, out)
    else:
        return b
    rt._memo[coll.code] = (x, out, op, root, algorithm, (out if x is None else x).dtype, b[4], b, guard)
    rt._lean[coll.code] = None  # until the call is made again (_promote)
    return b


# What ``_lean`` holds for a remembered call that may not take the lean path (work after the
# engine's, a trace, a dtype without an entry point): it matches no call, and is not promoted
# again at every memo hit.
NOT_LEAN = (object(),)
# The identity of a remembered call that the methods' lean tests must not match, but whose record
# a call the binder has just matched may use (Runtime._run, Runtime._start): a tensor's, whose
# layout only the binder checks (tensors.layout_of). Seven objects that are no caller's argument.
_MATCHES_NO_CALL = tuple(object() for _ in range(7))


def _promote(rt: Runtime, code: int, m: Any) -> None:
    """Give a remembered call that was made again to the lean path (``Runtime._again``): plain
    numpy calls with no work after the engine's. Only at its second call, because its record
    costs about 3 us to make (numpy's ``ctypes.data``), which a call that never repeats (new
    arrays every time) must not pay. A tensor call gets the record under an identity that
    matches no call (its layout is checked by the binder alone): the run loop and the queue use
    it once the binder has matched the call (``Runtime._run``, ``Runtime._start``)."""
    _make_lean(rt, code, m[:7] if m[8] is None else _MATCHES_NO_CALL, m[7])


def _make_lean(rt: Runtime, code: int, identity: tuple[Any, ...], b: Any) -> None:
    """``rt._lean[code]``: the call's identity (the seven items the lean tests compare), then the
    entry point, the record's address, the bound call and the record; or :data:`NOT_LEAN` where
    the call has work after the engine's, a trace is on, or its dtype has no entry point."""
    call = b[0]
    enter = lean_entry(call.engine_dtype) if not call.finish and not rt._trace else None
    if enter is None:
        rt._lean[code] = NOT_LEAN
        return
    record = engine.record_for(call.start, b[1], b[2])
    if call.huge is not None:  # the ranks agree on their pages or the leader's times first (comm.pages)
        enter, record = pages.lean(rt, b, enter, record)
    rt._lean[code] = (*identity, enter, record.ctypes.data, b, record)


def lean_run(rt: Runtime, b: Any) -> tuple[Any, ...] | None:
    """(entry point, record address, record) through which a started operation bound as ``b``
    enters the engine (``requests.Queue`` runs it so when nothing else needs the run loop), or
    None for a call :func:`_make_lean` would not give the lean path, extended by
    ``requests.with_trying``. For persistent requests, made once per request; an ``i``-form started
    with a remembered lean call uses that call's."""
    if type(b) is not tuple or b[1] is None or b[5] is not None or rt._trace:
        return None
    call = b[0]
    # (a call shape whose ranks agree on their pages first runs through the run loop: comm.pages)
    enter = lean_entry(call.engine_dtype) if not call.finish and call.huge is None else None
    if enter is None:
        return None
    record = engine.record_for(call.start, b[1], b[2])
    return with_trying((enter, record.ctypes.data, record), b)


_ENTRIES: dict[np.dtype, Any] = {}


def lean_entry(dtype: np.dtype) -> Any:
    """The engine's entry for a remembered call of engine dtype ``dtype`` (``engine.entry_at``,
    compiled on first use), or None for a dtype it does not take (a non-native byte order)."""
    enter = _ENTRIES.get(dtype, False)
    if enter is False:
        enter = _ENTRIES[dtype] = engine.entry_at(dtype) if dtype.isnative and dtype.kind in "iufc" else None
    return enter


def _returned(b: Any, given: tuple[Any, Any], bound_with: tuple[Any, Any]) -> Any:
    # A call given a SharedArray (or a buffer, or a tensor) returns that object, not the view it
    # ran on; a result it allocates is a tensor if it was given tensors.
    if type(b) is not tuple:
        return b
    for mine, theirs in zip(bound_with, given, strict=True):
        if b[3] is mine and mine is not theirs and mine is not None:
            return (*b[:3], theirs, *b[4:])
    if tensors.is_tensor(given[0]) or tensors.is_tensor(given[1]):
        return (*b[:3], tensors.as_tensor(b[3]), *b[4:])
    return b


def elementwise(rt: Runtime, coll: Collective, x: Any, out: Any, op: Any, root: Any, algorithm: str) -> Any:
    """allreduce, reduce, broadcast, alltoall, scan, exscan: the result has x's shape."""
    m = rt._memo[coll.code]
    if (
        m is not None
        and m[0] is x
        and m[1] is out
        and m[2] is op
        and m[3] is root
        and m[4] is algorithm
        and x.dtype is m[5]
        and (m[6] is None or m[6].flags.writeable)
        and (m[8] is None or tensors.layout_of(x, out) == m[8])
    ):
        if rt._lean[coll.code] is None:
            _promote(rt, coll.code, m)
        return m[7]
    return _remember(rt, coll, x, out, op, root, algorithm, _elementwise(rt, coll, x, out, op, root, algorithm))


def _elementwise(
    rt: Runtime,
    coll: Collective,
    x: Any,
    out: Any,
    op: Any,
    root: Any,
    algorithm: str,
    placement: Any = None,
    kind: Any = HOST,
) -> Any:
    if kind is HOST and (type(x) is not np.ndarray or (out is not None and type(out) is not np.ndarray)):
        routed = _reroute(rt, coll, x, out, algorithm, root)
        if routed is not None:
            b = _elementwise(rt, coll, routed[0], routed[1], op, root, routed[2], routed[3], routed[4])
            return _returned(b, (x, out), (routed[0], routed[1]))
    n, rank = rt._world_size, rt._rank
    if coll.blocks_in:
        if len(x.shape) == 0 or x.shape[0] != n:
            raise ValueError(f"{coll.name}: x must have shape (world_size={n}, ...), got {tuple(x.shape)}")
        count = x.size // n
    else:
        count = x.size
    zero_copy = placement is not None
    if coll.result_at_root:  # reduce
        writeable = arrays.check_read(x, "x")
        at_root = rank == root
        inplace = at_root and out is x
        call = (
            rt._calls.get((coll.code, x.dtype, count, op, algorithm, inplace, root, zero_copy))
            if kind is HOST
            else None
        )
        if call is None:
            call = kind.shape(rt, coll, x.dtype, count, op, algorithm, inplace, root, zero_copy)
        if not at_root:
            return kind.bind(rt, call, x, None, None, placement, writeable)
        if out is None:
            out = kind.new(tuple(x.shape), x.dtype)
        elif not inplace:
            arrays.check_out(out, tuple(x.shape), x.dtype)
            arrays.check_disjoint(x, out)
        else:
            arrays.check_written(x, "x")
        return kind.bind(rt, call, x, out, out, placement, writeable)
    inplace = out is x or (out is None and coll.out_none_in_place)
    call = rt._calls.get((coll.code, x.dtype, count, op, algorithm, inplace, root, zero_copy)) if kind is HOST else None
    if call is None:
        call = kind.shape(rt, coll, x.dtype, count, op, algorithm, inplace, root, zero_copy)
    if inplace:
        if coll.rooted and rank == root:  # a broadcast root only reads its buffer
            writeable = arrays.check_read(x, "x")
        else:
            arrays.check_written(x, "x")
            writeable = True
        return kind.bind(rt, call, x, x, x, placement, writeable)
    writeable = arrays.check_read(x, "x")
    if out is None:
        out = kind.new(tuple(x.shape), x.dtype)
    else:
        arrays.check_out(out, tuple(x.shape), x.dtype)
        arrays.check_disjoint(x, out)
    return kind.bind(rt, call, x, out, out, placement, writeable)


def gathering(rt: Runtime, coll: Collective, x: Any, out: Any, root: Any, algorithm: str) -> Any:
    """allgather, gather: the result stacks one block per rank, ``(world_size, *x.shape)``."""
    m = rt._memo[coll.code]
    if (
        m is not None
        and m[0] is x
        and m[1] is out
        and m[3] is root
        and m[4] is algorithm
        and x.dtype is m[5]
        and (m[6] is None or m[6].flags.writeable)
        and (m[8] is None or tensors.layout_of(x, out) == m[8])
    ):
        if rt._lean[coll.code] is None:
            _promote(rt, coll.code, m)
        return m[7]
    return _remember(rt, coll, x, out, None, root, algorithm, _gathering(rt, coll, x, out, root, algorithm))


def _gathering(
    rt: Runtime, coll: Collective, x: Any, out: Any, root: Any, algorithm: str, placement: Any = None, kind: Any = HOST
) -> Any:
    if kind is HOST and (type(x) is not np.ndarray or (out is not None and type(out) is not np.ndarray)):
        routed = _reroute(rt, coll, x, out, algorithm, root)
        if routed is not None:
            b = _gathering(rt, coll, routed[0], routed[1], root, routed[2], routed[3], routed[4])
            return _returned(b, (x, out), (routed[0], routed[1]))
    n, rank = rt._world_size, rt._rank
    writeable = arrays.check_read(x, "x")
    receives = not coll.result_at_root or rank == root
    inplace = False
    if receives:
        shape = (n, *x.shape)
        if out is None:
            arrays.check_fits(f"{coll.name}: the result", int(np.prod(shape)) * x.dtype.itemsize, rt._mem_total)
            out = kind.new(shape, x.dtype)
        else:
            arrays.check_out(out, shape, x.dtype)
            inplace = arrays.is_block_of(x, out, root if coll.result_at_root else rank, n)
    call = (
        rt._calls.get((coll.code, x.dtype, x.size, None, algorithm, inplace, root, placement is not None))
        if kind is HOST
        else None
    )
    if call is None:
        call = kind.shape(rt, coll, x.dtype, x.size, None, algorithm, inplace, root, placement is not None)
    if not receives:
        return kind.bind(rt, call, x, None, None, placement, writeable)
    return kind.bind(rt, call, x, out, out, placement, writeable)


def scattering(rt: Runtime, coll: Collective, x: Any, out: Any, op: Any, root: Any, algorithm: str) -> Any:
    """scatter, reduce_scatter: the input holds one block per rank; the result is one block."""
    m = rt._memo[coll.code]
    if (
        m is not None
        and m[0] is x
        and m[1] is out
        and m[2] is op
        and m[3] is root
        and m[4] is algorithm
        and (out if x is None else x).dtype is m[5]
        and (m[6] is None or m[6].flags.writeable)
        and (m[8] is None or tensors.layout_of(x, out) == m[8])
    ):
        if rt._lean[coll.code] is None:
            _promote(rt, coll.code, m)
        return m[7]
    return _remember(rt, coll, x, out, op, root, algorithm, _scattering(rt, coll, x, out, op, root, algorithm))


def _scattering(
    rt: Runtime,
    coll: Collective,
    x: Any,
    out: Any,
    op: Any,
    root: Any,
    algorithm: str,
    placement: Any = None,
    kind: Any = HOST,
) -> Any:
    if kind is HOST and (
        (x is not None and type(x) is not np.ndarray) or (out is not None and type(out) is not np.ndarray)
    ):
        routed = _reroute(rt, coll, x, out, algorithm, root)
        if routed is not None:
            b = _scattering(rt, coll, routed[0], routed[1], op, root, routed[2], routed[3], routed[4])
            return _returned(b, (x, out), (routed[0], routed[1]))
    n, rank = rt._world_size, rt._rank
    inplace = False
    writeable = True
    if coll.input_at_root and rank != root:  # a scatter's non-root: out gives shape and dtype
        if out is None:
            raise ValueError(f"{coll.name}: non-root ranks must pass out= (it gives the shape and dtype)")
        arrays.check_written(out, "out")
        x = None
        dtype, count = out.dtype, out.size
    else:
        if x is None:
            raise arrays.not_array("x", x)
        writeable = arrays.check_read(x, "x")
        xs = tuple(x.shape)
        if coll.input_at_root:
            if len(xs) == 0 or xs[0] != n:
                raise ValueError(f"{coll.name}: root's x must have shape (world_size={n}, ...), got {xs}")
            shape = xs[1:]
        else:
            if len(xs) == 0 or xs[0] % n:
                raise ValueError(f"{coll.name}: x.shape[0] must be divisible by world_size={n}, got shape {xs}")
            shape = (xs[0] // n, *xs[1:])
        if out is None:
            out = kind.new(shape, x.dtype)
        else:
            arrays.check_out(out, shape, x.dtype)
            inplace = arrays.is_block_of(out, x, root if coll.input_at_root else rank, n)
        dtype, count = x.dtype, out.size
    call = (
        rt._calls.get((coll.code, dtype, count, op, algorithm, inplace, root, placement is not None))
        if kind is HOST
        else None
    )
    if call is None:
        call = kind.shape(rt, coll, dtype, count, op, algorithm, inplace, root, placement is not None)
    return kind.bind(rt, call, x, out, out, placement, writeable)


def _flat_host(rt: Runtime, coll: Collective, x: Any, out: Any) -> tuple[Any, Any]:
    """A variable-count call's arrays as plain numpy arrays (views of buffers and SharedArrays)."""

    def plain(a: Any, name: str) -> Any:
        if a is None or type(a) is np.ndarray:
            return a
        if device.is_device(a):
            raise TypeError(f"{coll.name} takes host arrays; {name} is a device array (copy it to the host)")
        if isinstance(a, np.ndarray):
            return a.view(np.ndarray)
        return arrays.not_host_array(name, a)

    px = plain(x, "x")
    return px, px if out is x else plain(out, "out")


def _result(rt: Runtime, name: str, out: Any, count: int, dtype: np.dtype, why: str) -> Any:
    """The caller's ``out`` (checked: ``count`` elements of ``dtype``, writeable), or a new 1-d array."""
    if out is None:
        return arrays.new_output(name, (count,), dtype, rt._mem_total)
    arrays.check_written(out, "out")
    if out.dtype != dtype:
        raise TypeError(f"{name}: out has dtype {dtype_str(out.dtype)}, expected {dtype_str(dtype)} (x's)")
    arrays.check_size(out, "out", count, why)
    return out


def varying(
    rt: Runtime,
    coll: Collective,
    x: Any,
    out: Any,
    counts: Any,
    op: Any,
    root: Any,
    algorithm: str,
    recv_counts: Any = None,
) -> Bound:
    """allgatherv, gatherv, scatterv, reduce_scatterv, alltoallv: flat buffers cut into blocks of
    ``counts[j]`` elements for rank ``j`` (alltoallv: ``counts`` is what this rank sends each
    rank, ``recv_counts`` what it receives from each). A result the caller did not give is 1-d.

    The call signature carries the total where every rank knows it (allgatherv,
    reduce_scatterv); each message carries its block's count, so ranks that disagree on the
    counts fail with a mismatch naming both counts.
    """
    given = (x, out)
    x, out = flat = _flat_host(rt, coll, x, out)
    n, rank, name = rt._world_size, rt._rank, coll.name
    if coll.name == "alltoallv":
        return _returned(_alltoallv(rt, coll, x, out, counts, recv_counts, algorithm), given, flat)
    if coll.rooted:
        arrays.check_root(root, n)
    at_root = rank == root
    if counts is None:
        if not coll.rooted or at_root:
            raise ValueError(f"{name}: counts is required" + (" on the root" if coll.rooted else ""))
    else:
        counts = arrays.check_counts(counts, "counts", n)
    writeable = True
    inplace = False
    if coll.rooted and not at_root:
        # A root's counts are all that matter; this rank's program needs only its own block.
        if coll.input_at_root:  # scatterv: out gives this rank's size
            if out is None:
                raise ValueError(f"{name}: non-root ranks must pass out= (it gives the size and dtype)")
            arrays.check_written(out, "out")
            mine, dtype, x = out.size, out.dtype, None
        else:  # gatherv
            if x is None:
                raise arrays.not_array("x", x)
            writeable = arrays.check_read(x, "x")
            mine, dtype, out = x.size, x.dtype, None
        if counts is not None and counts[rank] != mine:
            raise ValueError(f"{name}: this rank's block has {mine} elements, but counts[{rank}] is {counts[rank]}")
        counts = tuple(mine if j == rank else 0 for j in range(n))
    else:
        if x is None:
            raise arrays.not_array("x", x)
        writeable = arrays.check_read(x, "x")
        dtype = x.dtype
        total = sum(counts)
        me = root if coll.rooted else rank
        at = sum(counts[:me])
        if coll.blocks_out:  # allgatherv, gatherv: x is my block, out all of them
            arrays.check_size(x, "x", counts[me], f"counts[{me}]")
            out = _result(rt, name, out, total, dtype, "sum(counts)")
            inplace = arrays.is_span_of(x, out, at, counts[me])
        else:  # scatterv, reduce_scatterv: x holds every block, out is mine
            arrays.check_size(x, "x", total, "sum(counts)")
            out = _result(rt, name, out, counts[me], dtype, f"counts[{me}]")
            inplace = arrays.is_span_of(out, x, at, counts[me])
    agreed = sum(counts) if not coll.rooted else 0  # (a rooted call's non-roots know only theirs)
    key = (coll.code, dtype, counts, op, algorithm, inplace, root)
    call = rt._calls.get(key)
    if call is None:
        call = rt._shape(
            key, name, dtype, agreed, op=op, algorithm=algorithm, inplace=inplace, root=root, counts=counts
        )
    return _returned(HOST.bind(rt, call, x, out, out, None, writeable), given, flat)


def _alltoallv(rt: Runtime, coll: Collective, x: Any, out: Any, send: Any, recv: Any, algorithm: str) -> Bound:
    n, rank = rt._world_size, rt._rank
    send = arrays.check_counts(send, "send_counts", n)
    recv = arrays.check_counts(recv, "recv_counts", n)
    if send[rank] != recv[rank]:
        raise ValueError(
            f"alltoallv: send_counts[{rank}] = {send[rank]} but recv_counts[{rank}] = {recv[rank]} "
            f"(both are what this rank sends itself)"
        )
    if x is None:
        raise arrays.not_array("x", x)
    writeable = arrays.check_read(x, "x")
    arrays.check_size(x, "x", sum(send), "sum(send_counts)")
    if out is x:
        raise ValueError("alltoallv cannot run in place: pass a separate out (or none)")
    out = _result(rt, coll.name, out, sum(recv), x.dtype, "sum(recv_counts)")
    arrays.check_disjoint(x, out)
    key = (coll.code, x.dtype, send, recv, algorithm)
    call = rt._calls.get(key)
    if call is None:
        # This rank's row and column; the rest zero: a consistent matrix for this rank's program.
        matrix = tuple(send if i == rank else tuple(recv[i] if j == rank else 0 for j in range(n)) for i in range(n))
        call = rt._shape(key, coll.name, x.dtype, 0, algorithm=algorithm, matrix=matrix)
    return HOST.bind(rt, call, x, out, out, None, writeable)  # type: ignore[no-any-return]


_BARRIER_CODE = KIND_CODE["barrier"]


def barrier(rt: Runtime) -> Bound:
    call = rt._shape(("barrier",), "barrier", np.dtype(np.uint8), 0, algorithm="direct")
    return rt._bind(call, None, None, None, None)  # type: ignore[no-any-return]


def lean_barrier(rt: Runtime, b: Bound) -> None:
    """Give ``barrier`` (bound as ``b``) the lean path after its first call: it has no arrays to
    compare, so its identity is empty. Without it a barrier paid numba's dispatch and the
    unboxing of three empty arrays at every call: 1.07 us at 2 ranks against an 8-byte
    allreduce's 0.70."""
    _make_lean(rt, _BARRIER_CODE, (None,) * 7, b)
