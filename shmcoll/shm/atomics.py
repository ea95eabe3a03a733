"""Atomics, CPU hints and the futex, as numba intrinsics: the only module that emits LLVM.

Every control word in shared memory is an ``int64`` element of an array (the arena viewed as
int64). Publishing a flag with a plain numpy or Python store gives no ordering guarantee against
the payload written before it (the vLLM shm ring broadcast needed explicit fences for exactly
this), so all control-word traffic goes through these functions:

- ``load_acquire`` / ``store_release``: the ring protocol. An acquire load of a counter makes
  every payload byte written before the matching release store visible.
- ``load_seqcst`` / ``store_seqcst``: the Dekker-style handshake between a sleeper announcing
  itself and a publisher checking for sleepers; both sides need store->load ordering, which
  acquire/release does not give (x86 reorders a store with a later load).
- ``fetch_add``, ``compare_exchange``: sequentially consistent read-modify-writes.
- ``cpu_pause``: the spin-loop hint (``pause`` on x86, ``yield`` on aarch64).
- ``sched_yield``, ``futex_wait``, ``futex_wake``, ``monotonic_ns``, ``vm_copy``: libc calls
  resolved by symbol name when the machine code is loaded, so they survive numba's on-disk cache
  (a ctypes function pointer would bake in one process's address). ``vm_copy`` is cross-memory
  attach (``process_vm_readv``/``process_vm_writev``): one copy straight out of, or into,
  another process's memory.
- ``move_bytes``: libc's ``memmove`` on two addresses (LLVM's memmove, a call resolved by
  name like the calls above), for the payload kernels' large copies.
- ``address_as_pointer``: an address (an int64 from Python) as a typed pointer, so that the
  engine can take the arrays that never change for a call shape as one table of addresses
  instead of one argument each (numba unboxes every array argument, about 55 ns each).

The futex works on 32-bit words. A waiter sleeps on the low half of a 64-bit counter (little
endian: same address); any increment changes that half, so ``FUTEX_WAIT`` returns at once if
the counter moved after the waiter last read it. Futexes here are shared (no
``FUTEX_PRIVATE_FLAG``) because the waiters are different processes.
"""

from __future__ import annotations

import platform
import sys

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from shmcoll.jit import jit

_MACHINE = platform.machine().lower()
if not sys.platform.startswith("linux"):
    raise ImportError("shmcoll needs Linux (POSIX shared memory in /dev/shm and futexes)")
if _MACHINE in ("x86_64", "amd64"):
    SYS_FUTEX, SYS_PROCESS_VM_READV, SYS_PROCESS_VM_WRITEV = 202, 310, 311
elif _MACHINE in ("aarch64", "arm64"):
    SYS_FUTEX, SYS_PROCESS_VM_READV, SYS_PROCESS_VM_WRITEV = 98, 270, 271
else:
    raise ImportError(f"shmcoll supports x86_64 and aarch64 Linux, not {_MACHINE}")

FUTEX_WAIT = 0
FUTEX_WAKE = 1
CLOCK_MONOTONIC = 1

_i32 = ir.IntType(32)
_i64 = ir.IntType(64)
_TIMESPEC = ir.LiteralStructType([_i64, _i64])


def _word_ptr(context, builder, arrty, arr, idx):  # type: ignore[no-untyped-def]
    ary = context.make_array(arrty)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [idx], wraparound=False, boundscheck=False)


def _check_words(arr: types.Type) -> None:
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        raise TypeError("control words must be a 1-d int64 array")


@intrinsic
def load_acquire(typingctx, arr, idx):  # type: ignore[no-untyped-def]
    """``arr[idx]`` with acquire ordering."""
    _check_words(arr)
    sig = types.int64(arr, types.intp)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        ptr = _word_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def load_seqcst(typingctx, arr, idx):  # type: ignore[no-untyped-def]
    """``arr[idx]`` with sequentially consistent ordering."""
    _check_words(arr)
    sig = types.int64(arr, types.intp)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        ptr = _word_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "seq_cst", 8)

    return sig, codegen


def _store(ordering: str):  # type: ignore[no-untyped-def]
    def impl(typingctx, arr, idx, val):  # type: ignore[no-untyped-def]
        _check_words(arr)
        sig = types.void(arr, types.intp, types.int64)

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            ptr = _word_ptr(context, builder, sig.args[0], args[0], args[1])
            builder.store_atomic(args[2], ptr, ordering, 8)
            return context.get_dummy_value()

        return sig, codegen

    return impl


store_release = intrinsic(_store("release"))
store_release.__doc__ = "``arr[idx] = val`` with release ordering."
store_seqcst = intrinsic(_store("seq_cst"))
store_seqcst.__doc__ = "``arr[idx] = val`` with sequentially consistent ordering."


@intrinsic
def fetch_add(typingctx, arr, idx, val):  # type: ignore[no-untyped-def]
    """Atomically add ``val`` to ``arr[idx]``; returns the old value."""
    _check_words(arr)
    sig = types.int64(arr, types.intp, types.int64)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        ptr = _word_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")

    return sig, codegen


@intrinsic
def compare_exchange(typingctx, arr, idx, expected, desired):  # type: ignore[no-untyped-def]
    """Set ``arr[idx] = desired`` if it equals ``expected``; returns the value found."""
    _check_words(arr)
    sig = types.int64(arr, types.intp, types.int64, types.int64)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        ptr = _word_ptr(context, builder, sig.args[0], args[0], args[1])
        pair = builder.cmpxchg(ptr, args[2], args[3], "seq_cst", "seq_cst")
        return builder.extract_value(pair, 0)

    return sig, codegen


@intrinsic
def cpu_pause(typingctx):  # type: ignore[no-untyped-def]
    """The spin-wait hint: lets the sibling hyperthread run and saves power."""
    sig = types.void()

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        if SYS_FUTEX == 202:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"
            )
            builder.call(fn, [])
        else:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [_i32]), "llvm.aarch64.hint"
            )
            builder.call(fn, [ir.Constant(_i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def sched_yield(typingctx):  # type: ignore[no-untyped-def]
    """Give the core to another runnable process (the ranks outnumber the cores)."""
    sig = types.int32()

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_i32, []), "sched_yield")
        return builder.call(fn, [])

    return sig, codegen


def _syscall(builder):  # type: ignore[no-untyped-def]
    fnty = ir.FunctionType(_i64, [_i64], var_arg=True)
    return cgutils.get_or_insert_function(builder.module, fnty, "syscall")


@intrinsic
def futex_wait(typingctx, arr, idx, expected, timeout_ns):  # type: ignore[no-untyped-def]
    """Sleep while the low 32 bits of ``arr[idx]`` equal those of ``expected``.

    Returns at a wake, at the timeout, at a signal, or at once if the word differs; the caller
    always re-reads the counter, so the return value (0 or -1) is only informative.
    """
    _check_words(arr)
    sig = types.int64(arr, types.intp, types.int64, types.int64)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        ptr = _word_ptr(context, builder, sig.args[0], args[0], args[1])
        ts = cgutils.alloca_once(builder, _TIMESPEC)
        billion = ir.Constant(_i64, 1_000_000_000)
        zero = ir.Constant(_i32, 0)
        builder.store(builder.sdiv(args[3], billion), builder.gep(ts, [zero, zero]))
        builder.store(builder.srem(args[3], billion), builder.gep(ts, [zero, ir.Constant(_i32, 1)]))
        return builder.call(
            _syscall(builder),
            [
                ir.Constant(_i64, SYS_FUTEX),
                builder.ptrtoint(ptr, _i64),
                ir.Constant(_i32, FUTEX_WAIT),
                builder.trunc(args[2], _i32),
                builder.ptrtoint(ts, _i64),
                ir.Constant(_i64, 0),
                ir.Constant(_i32, 0),
            ],
        )

    return sig, codegen


@intrinsic
def futex_wake(typingctx, arr, idx):  # type: ignore[no-untyped-def]
    """Wake every process sleeping on ``arr[idx]``; returns how many were woken."""
    _check_words(arr)
    sig = types.int64(arr, types.intp)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        ptr = _word_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.call(
            _syscall(builder),
            [
                ir.Constant(_i64, SYS_FUTEX),
                builder.ptrtoint(ptr, _i64),
                ir.Constant(_i32, FUTEX_WAKE),
                ir.Constant(_i32, 0x7FFFFFFF),
                ir.Constant(_i64, 0),
                ir.Constant(_i64, 0),
                ir.Constant(_i32, 0),
            ],
        )

    return sig, codegen


def _vm_syscall(number: int, name: str, doc: str):  # type: ignore[no-untyped-def]
    """An intrinsic ``(pid, local, remote, nbytes) -> bytes copied, or -1`` making system call
    ``number`` (``process_vm_readv`` or ``process_vm_writev``: the same arguments, one iovec
    each side; the kernel's errno is not kept)."""

    def call(typingctx, pid, local, remote, nbytes):  # type: ignore[no-untyped-def]
        sig = types.int64(types.int64, types.int64, types.int64, types.int64)

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            zero, one = ir.Constant(_i32, 0), ir.Constant(_i32, 1)
            iovs = []
            for base in (args[1], args[2]):  # struct iovec {void *base; size_t len}
                iov = cgutils.alloca_once(builder, _TIMESPEC)
                builder.store(base, builder.gep(iov, [zero, zero]))
                builder.store(args[3], builder.gep(iov, [zero, one]))
                iovs.append(builder.ptrtoint(iov, _i64))
            one64 = ir.Constant(_i64, 1)
            return builder.call(
                _syscall(builder),
                [ir.Constant(_i64, number), args[0], iovs[0], one64, iovs[1], one64, ir.Constant(_i64, 0)],
            )

        return sig, codegen

    call.__name__ = call.__qualname__ = name
    call.__doc__ = doc
    return intrinsic(call)


_process_vm_readv = _vm_syscall(
    SYS_PROCESS_VM_READV,
    "_process_vm_readv",
    "``process_vm_readv``: ``nbytes`` from ``remote`` in process ``pid`` to our ``local``.",
)
_process_vm_writev = _vm_syscall(
    SYS_PROCESS_VM_WRITEV,
    "_process_vm_writev",
    "``process_vm_writev``: ``nbytes`` from our ``local`` to ``remote`` in process ``pid``.",
)


@jit
def vm_copy(pid, local, remote, nbytes, write):  # type: ignore[no-untyped-def]
    """Copy ``nbytes`` between address ``local`` in ours and address ``remote`` in process ``pid``
    (cross-memory attach): into ours (``process_vm_readv``), or with ``write`` into theirs
    (``process_vm_writev``). True if every byte went. The kernel may copy less than asked per
    call (it stops at a page it cannot take), so it is called until done or it copies nothing."""
    done = 0
    while done < nbytes:
        if write:
            got = _process_vm_writev(pid, local + done, remote + done, nbytes - done)
        else:
            got = _process_vm_readv(pid, local + done, remote + done, nbytes - done)
        if got <= 0:
            return False
        done += got
    return True


@intrinsic
def monotonic_ns(typingctx):  # type: ignore[no-untyped-def]
    """``clock_gettime(CLOCK_MONOTONIC)`` in nanoseconds (same clock as ``time.monotonic_ns``)."""
    sig = types.int64()

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        fnty = ir.FunctionType(_i32, [_i32, _TIMESPEC.as_pointer()])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "clock_gettime")
        ts = cgutils.alloca_once(builder, _TIMESPEC)
        builder.call(fn, [ir.Constant(_i32, CLOCK_MONOTONIC), ts])
        zero = ir.Constant(_i32, 0)
        sec = builder.load(builder.gep(ts, [zero, zero]))
        nsec = builder.load(builder.gep(ts, [zero, ir.Constant(_i32, 1)]))
        return builder.add(builder.mul(sec, ir.Constant(_i64, 1_000_000_000)), nsec)

    return sig, codegen


@intrinsic
def move_bytes(typingctx, dst, src, nbytes):  # type: ignore[no-untyped-def]
    """``memmove(dst, src, nbytes)`` on addresses: libc's copy, which a loop in jitted code does
    not become (LLVM cannot prove the arrays apart). glibc picks its method by size and CPU (wide
    vector moves, ``rep movsb``, non-temporal stores for copies larger than the cache):
    measured here 6-16% faster than the vectorized loop from 64 KiB to 1 MiB and 1.2-1.8x from
    64 MiB, the same in between."""
    sig = types.void(types.int64, types.int64, types.int64)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        bytep = ir.IntType(8).as_pointer()
        d, s = builder.inttoptr(args[0], bytep), builder.inttoptr(args[1], bytep)
        cgutils.raw_memmove(builder, d, s, args[2], ir.Constant(_i64, 1))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def address_as_pointer(typingctx, address, like):  # type: ignore[no-untyped-def]
    """``address`` as a pointer to elements of ``like``'s dtype (``like`` only gives the type: an
    array, or a numpy scalar type such as ``np.float32``)."""
    if isinstance(like, types.Array):
        elem = like.dtype
    elif isinstance(like, types.NumberClass):
        elem = like.instance_type
    else:
        raise TypeError("like must be an array or a numpy scalar type")
    sig = types.CPointer(elem)(types.int64, like)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return sig, codegen


# --- the same operations for Python callers (set-up and diagnostics, never the hot path) ----
@jit
def atomic_add(words, idx, value):  # type: ignore[no-untyped-def]
    """``fetch_add`` callable from Python."""
    return fetch_add(words, idx, value)


@jit
def atomic_cas(words, idx, expected, desired):  # type: ignore[no-untyped-def]
    """``compare_exchange`` callable from Python."""
    return compare_exchange(words, idx, expected, desired)


@jit
def read_word(words, idx):  # type: ignore[no-untyped-def]
    """An acquire load callable from Python."""
    return load_acquire(words, idx)


@jit
def write_word(words, idx, value):  # type: ignore[no-untyped-def]
    """A release store callable from Python."""
    store_release(words, idx, value)
