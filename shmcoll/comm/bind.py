"""From a method's arguments to a bound call: every check, before any communication.

One binder per family of collectives, driven by the collective's record
(:mod:`shmcoll.collectives`) rather than by its name:

- :func:`elementwise`: the result has x's shape (allreduce, reduce, broadcast, alltoall);
- :func:`gathering`: the result stacks one block per rank (allgather, gather);
- :func:`scattering`: the input holds one block per rank (scatter, reduce_scatter);
- :func:`point_to_point` and :func:`barrier`.

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

from shmcoll.collectives import Collective
from shmcoll.comm import arrays, device, registered
from shmcoll.comm.calls import Bound, Call
from shmcoll.comm.runtime import Runtime


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
    if device.is_device(probe):
        kind = device.DEVICE
        dx = kind.describe(x, "x")
        return dx, dx if out is x else kind.describe(out, "out"), algorithm, None, kind
    if isinstance(probe, np.ndarray) or probe is None:
        if out is not None and not isinstance(out, np.ndarray):
            raise arrays.not_array("out", out)
        return None
    raise arrays.not_array("out" if x is None else "x", probe)


def _returned(b: Any, given: tuple[Any, Any], bound_with: tuple[Any, Any]) -> Any:
    # A call given a SharedArray returns that array, not the plain view it ran on.
    if type(b) is not tuple:
        return b
    for mine, theirs in zip(bound_with, given, strict=True):
        if b[3] is mine and mine is not theirs and mine is not None:
            return (*b[:3], theirs, *b[4:])
    return b


def elementwise(
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
    """allreduce, reduce, broadcast, alltoall: the result has x's shape."""
    if kind is HOST and (type(x) is not np.ndarray or (out is not None and type(out) is not np.ndarray)):
        routed = _reroute(rt, coll, x, out, algorithm, root)
        if routed is not None:
            b = elementwise(rt, coll, routed[0], routed[1], op, root, routed[2], routed[3], routed[4])
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


def gathering(
    rt: Runtime, coll: Collective, x: Any, out: Any, root: Any, algorithm: str, placement: Any = None, kind: Any = HOST
) -> Any:
    """allgather, gather: the result stacks one block per rank, ``(world_size, *x.shape)``."""
    if kind is HOST and (type(x) is not np.ndarray or (out is not None and type(out) is not np.ndarray)):
        routed = _reroute(rt, coll, x, out, algorithm, root)
        if routed is not None:
            b = gathering(rt, coll, routed[0], routed[1], root, routed[2], routed[3], routed[4])
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


def scattering(
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
    """scatter, reduce_scatter: the input holds one block per rank; the result is one block."""
    if kind is HOST and (
        (x is not None and type(x) is not np.ndarray) or (out is not None and type(out) is not np.ndarray)
    ):
        routed = _reroute(rt, coll, x, out, algorithm, root)
        if routed is not None:
            b = scattering(rt, coll, routed[0], routed[1], op, root, routed[2], routed[3], routed[4])
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


def point_to_point(rt: Runtime, send: bool, buf: Any, peer: Any) -> Bound:
    """send (``buf`` is read) or recv (``buf`` is written) between this rank and ``peer``."""
    name = "x" if send else "buf"
    if type(buf) is not np.ndarray:
        if registered.is_registered(buf):
            buf = buf.view(np.ndarray)
        elif device.is_device(buf):
            return device.PointToPoint(rt, send, buf, peer)  # type: ignore[return-value]
        elif not isinstance(buf, np.ndarray):
            raise arrays.not_array(name, buf)
    writeable = True
    if send:
        writeable = arrays.check_read(buf, name)
    else:
        arrays.check_written(buf, name)
    key = ("send" if send else "recv", buf.dtype, buf.size, peer)
    call = rt._calls.get(key)
    if call is None:
        arrays.check_peer(peer, "dst" if send else "src", rt._rank, rt._world_size)
        sender, receiver = (rt._rank, peer) if send else (peer, rt._rank)
        call = rt._shape(
            key,
            "p2p",
            buf.dtype,
            buf.size,
            algorithm="direct",
            root=sender,
            peer=receiver,
            p2p_peer=peer,
            p2p_send=send,
        )
    if send:
        return rt._bind(call, buf, None, None, None, writeable)  # type: ignore[no-any-return]
    return rt._bind(call, None, buf, buf, None)  # type: ignore[no-any-return]


def barrier(rt: Runtime) -> Bound:
    call = rt._shape(("barrier",), "barrier", np.dtype(np.uint8), 0, algorithm="direct")
    return rt._bind(call, None, None, None, None)  # type: ignore[no-any-return]
