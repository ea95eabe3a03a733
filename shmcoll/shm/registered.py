"""Registered buffers: arrays in shared memory that every rank of a communicator maps.

``comm.alloc(shape, dtype)`` is collective: one segment holds one page-aligned *region* per
rank, all of the same size, and every rank maps the whole segment. A rank's array is a view of
its own region; a collective on such arrays can read a peer's data in place (the ``zerocopy``
algorithm), because the same call's buffer sits at the same offset in the peer's region
whenever every rank allocated it the same way.

The array type, :class:`SharedArray`, is an ``ndarray`` subclass: views and slices of it stay
registered (the subclass remembers its :class:`Allocation`), and it behaves as a numpy array
everywhere else.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmcoll.shm.segment import Segment

PAGE = 4096


class Allocation:
    """One ``comm.alloc`` call: a segment of ``world_size`` regions of ``region_bytes`` each."""

    def __init__(self, ident: int, segment: Segment, world_size: int, region_bytes: int) -> None:
        self.ident = ident
        self.segment = segment
        self.world_size = world_size
        self.region_bytes = region_bytes
        whole = segment.array(np.uint8)
        self.base_address = whole.__array_interface__["data"][0]
        self._views: dict[np.dtype, np.ndarray] = {np.dtype(np.uint8): whole}

    def view(self, dtype: np.dtype) -> np.ndarray:
        """The whole segment (every rank's region) as a 1-d array of ``dtype``."""
        v = self._views.get(dtype)
        if v is None:
            v = self._views[dtype] = self.segment.array(dtype)
        return v

    def region(self, rank: int, shape: tuple[int, ...], dtype: np.dtype) -> SharedArray:
        """Rank ``rank``'s array: the start of its region, as ``shape`` of ``dtype``."""
        count = int(np.prod(shape, dtype=np.int64))
        start = rank * self.region_bytes // dtype.itemsize
        arr = self.view(dtype)[start : start + count].reshape(shape).view(SharedArray)
        arr._allocation = self
        return arr

    def placement(self, arr: np.ndarray, rank: int) -> int | None:
        """Byte offset of ``arr`` inside rank ``rank``'s region, or None if it is not inside."""
        if arr.nbytes == 0:
            return 0  # numpy may point an empty view anywhere; it has nothing to share anyway
        start = self.base_address + rank * self.region_bytes
        address = arr.__array_interface__["data"][0]
        if start <= address and address + arr.nbytes <= start + self.region_bytes:
            return address - start
        return None

    def close(self) -> None:
        self._views.clear()
        self.segment.close()


class SharedArray(np.ndarray):
    """A numpy array living in shared memory, from :meth:`shmcoll.Communicator.alloc`.

    Collectives on arrays like this one read the peers' data in place instead of copying it
    through the rings, when every rank passes such arrays (algorithm ``zerocopy``).
    """

    _allocation: Allocation | None = None

    def __array_finalize__(self, obj: Any) -> None:
        self._allocation = getattr(obj, "_allocation", None)


def region_bytes(nbytes: int) -> int:
    """The region size for ``nbytes``: whole pages, so every region starts page aligned."""
    return max(PAGE, (nbytes + PAGE - 1) // PAGE * PAGE)
