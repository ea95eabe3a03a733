"""The arrays a call may be given, and the checks every call makes on them before it communicates.

One set of checks serves every kind of array: numpy arrays (and :class:`~shmcoll.shm.registered.
SharedArray`, a subclass), and device arrays, described by ``engine.cuda.DeviceBuffer``. The
checks read only what both have (``shape``, ``dtype``, ``size``, ``nbytes``) plus what
:func:`flags` and :func:`address` tell, so a message is the same for a numpy array and a CuPy
array. Every check raises ``ValueError`` or ``TypeError`` on the calling
rank; nothing here communicates.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmcoll.comm import tensors
from shmcoll.types import DTYPE_CODE, ReduceOp, dtype_str, supports, valid_ops

_HINT = {True: "use np.ascontiguousarray", False: "use cupy.ascontiguousarray or .contiguous()"}


def flags(a: Any) -> tuple[bool, bool]:
    """(C-contiguous, writeable) of a numpy or device array."""
    if isinstance(a, np.ndarray):
        f = a.flags
        return f.c_contiguous, f.writeable
    return a.contiguous, not a.readonly


def address(a: Any) -> int:
    """The address of the first byte (a dict is built for a numpy array: not for the hot path)."""
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.ptr  # type: ignore[no-any-return]


def not_array(name: str, value: object) -> TypeError:
    return TypeError(
        f"{name} must be a numpy.ndarray (or a torch tensor, an object with the buffer protocol, "
        f"or a device array), got {type(value).__name__}"
    )


def as_host(value: Any, name: str = "a buffer") -> np.ndarray | None:
    """A zero-copy numpy view of a CPU torch tensor or of an object with the buffer protocol
    (``bytearray``, ``memoryview``, ``array.array``, ``bytes`` read-only), or None if it is
    neither."""
    if tensors.is_tensor(value):
        return tensors.as_array(value, name)
    try:
        view = memoryview(value)
    except TypeError:
        return None
    if not view.c_contiguous:
        raise ValueError("a buffer must be C-contiguous")
    return np.asarray(view)


def not_host_array(name: str, value: object) -> np.ndarray:
    """``value`` as a numpy view when it is an array of another kind; TypeError otherwise."""
    view = as_host(value, name)
    if view is None:
        raise not_array(name, value)
    return view


def check_read(a: Any, name: str) -> bool:
    """An input: C-contiguous. Returns whether it is also writeable (the engine is compiled for
    writeable arrays: a read-only input runs from a copy)."""
    if isinstance(a, np.ndarray):
        f = a.flags
        if not f.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous ({_HINT[True]})")
        return f.writeable  # type: ignore[no-any-return]
    if not a.contiguous:
        raise ValueError(f"{name} must be C-contiguous ({_HINT[False]})")
    return not a.readonly


def check_written(a: Any, name: str) -> None:
    """A buffer the call writes: C-contiguous and writeable."""
    if isinstance(a, np.ndarray):
        f = a.flags
        if f.c_contiguous and f.writeable:
            return
    contiguous, writeable = flags(a)
    if not contiguous:
        raise ValueError(f"{name} must be C-contiguous ({_HINT[isinstance(a, np.ndarray)]})")
    if not writeable:
        raise ValueError(f"{name} is read-only but this call writes into it")


def check_out(out: Any, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """A caller's output: the expected shape and dtype, C-contiguous, writeable."""
    if tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {dtype_str(out.dtype)}, expected {dtype_str(dtype)}")
    contiguous, writeable = flags(out)
    if not contiguous:
        raise ValueError("out must be C-contiguous")
    if not writeable:
        raise ValueError("out is read-only")


def overlap(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.may_share_memory(a, b))
    if a.nbytes == 0 or b.nbytes == 0:
        return False
    start_a, start_b = address(a), address(b)
    return start_a < start_b + b.nbytes and start_b < start_a + a.nbytes


def check_disjoint(x: Any, out: Any) -> None:
    if overlap(x, out):
        raise ValueError("x and out overlap: pass out=None (or out=x) to work in place, or disjoint arrays")


def is_block_of(part: Any, whole: Any, block: int, world_size: int) -> bool:
    """Whether ``part`` is exactly block ``block`` of ``whole`` (the in-place form of a blocked
    collective); raises if they overlap any other way."""
    if not overlap(part, whole):
        return False
    block_bytes = whole.nbytes // world_size
    if address(part) == address(whole) + block * block_bytes and part.nbytes == block_bytes:
        return True
    raise ValueError(f"input and output overlap, but not as block {block} (this rank's block) of the larger one")


def is_span_of(part: Any, whole: Any, offset: int, count: int) -> bool:
    """Whether ``part`` is exactly elements ``[offset, offset + count)`` of ``whole`` (the in-place
    form of a variable-count collective); raises if they overlap any other way."""
    if not overlap(part, whole):
        return False
    itemsize = whole.dtype.itemsize
    if address(part) == address(whole) + offset * itemsize and part.nbytes == count * itemsize:
        return True
    raise ValueError(
        f"input and output overlap, but not as elements [{offset}, {offset + count}) "
        f"(this rank's block) of the larger one"
    )


def check_counts(counts: Any, name: str, world_size: int) -> tuple[int, ...]:
    """``counts`` (one count of elements per rank) as a tuple of ints; raises naming what is wrong."""
    if isinstance(counts, (str, bytes)) or not hasattr(counts, "__len__"):
        raise TypeError(f"{name} must be a sequence of {world_size} counts (one per rank), got {type(counts).__name__}")
    if len(counts) != world_size:
        raise ValueError(f"{name} must have one count per rank ({world_size}), got {len(counts)}")
    out = []
    for j, c in enumerate(counts):
        if isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, np.integer)):
            raise TypeError(f"{name}[{j}] must be an int, got {type(c).__name__}")
        if c < 0:
            raise ValueError(f"{name}[{j}] = {c} is negative")
        out.append(int(c))
    return tuple(out)


def check_size(a: Any, name: str, count: int, why: str) -> None:
    """``a`` must hold exactly ``count`` elements (``why`` says where the count comes from)."""
    if a.size != count:
        raise ValueError(f"{name} has {a.size} elements, but {why} is {count}")


def check_root(root: Any, world_size: int) -> None:
    if not isinstance(root, (int, np.integer)) or not 0 <= root < world_size:
        raise ValueError(f"root {root!r} out of range for world_size {world_size}")


def check_dtype(dtype: np.dtype) -> None:
    if dtype not in DTYPE_CODE:
        raise TypeError(f"unsupported dtype {dtype}; supported: {', '.join(map(dtype_str, DTYPE_CODE))}")


def as_op(op: ReduceOp | int | str) -> ReduceOp:
    """``op`` as a ReduceOp: a member, its value, or its name in any case."""
    if isinstance(op, str):
        try:
            return ReduceOp[op.upper()]
        except KeyError:
            raise ValueError(f"unknown reduction op {op!r}; one of {[o.name for o in ReduceOp]}") from None
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(f"unknown reduction op {op!r}; one of {[o.name for o in ReduceOp]}") from None


def check_op(op: ReduceOp | int | str, dtype: np.dtype) -> ReduceOp:
    """``op`` as a ReduceOp that is defined for ``dtype``."""
    reduce_op = as_op(op)
    if not supports(reduce_op, dtype):
        valid = ", ".join(o.name for o in sorted(valid_ops(dtype)))
        raise ValueError(f"op {reduce_op.name} is not defined for dtype {dtype_str(dtype)} (valid: {valid})")
    return reduce_op


def check_algorithm(algorithm: Any) -> None:
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a string, got {algorithm!r}")


def check_fits(what: str, nbytes: int, mem_total: int) -> None:
    """A buffer of ``nbytes`` must fit in this machine's memory (a size from bad data, not an OOM)."""
    if nbytes > mem_total:
        raise ValueError(f"{what} of {nbytes:,} bytes is larger than this machine's memory ({mem_total:,} bytes)")


def new_output(what: str, shape: tuple[int, ...], dtype: np.dtype, mem_total: int) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes > mem_total:
        raise ValueError(
            f"{what}: the result needs {nbytes:,} bytes, more than this machine's memory ({mem_total:,} bytes)"
        )
    return np.empty(shape, dtype=dtype)
