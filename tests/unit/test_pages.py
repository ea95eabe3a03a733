"""shm/pages.py: arrays on 4 KiB or huge pages, what backs them, the system's setting."""

from __future__ import annotations

import numpy as np
import pytest

from shmcoll.shm import pages


@pytest.mark.parametrize("kind", pages.PAGES)
def test_arrays_are_like_np_empty(kind: str) -> None:
    for shape, dtype in (((3, 5), np.float32), (7, np.int64), ((0,), np.float64), ((2, 0), np.uint8)):
        a = pages.array(shape, dtype, kind)
        assert a.shape == ((shape,) if isinstance(shape, int) else shape) and a.dtype == dtype
        assert a.flags.c_contiguous and a.flags.writeable
        a[...] = 3
        assert (a == 3).all()
    if kind == "huge":  # every whole 2 MiB of it can have a huge page
        assert pages.array(10, np.float32, kind).ctypes.data % pages.HUGE_BYTES == 0


def test_small_pages_have_none_huge_and_huge_ones_do_where_granted() -> None:
    small = pages.array(8 << 20, np.uint8, "small")
    small[:] = 1
    assert pages.huge_bytes(small) == 0
    huge = pages.array(8 << 20, np.uint8, "huge")
    huge[:] = 1
    if pages.thp_setting() in ("always", "madvise"):
        assert pages.huge_bytes(huge) >= 2 << 20  # (madvised: the fault compacts memory for one if it must)
    else:
        assert pages.thp_setting() in ("never", "unknown")
    assert pages.huge_bytes(np.empty(0, np.uint8)) == 0


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="pages must be one of numpy, small, huge, not 'tiny'"):
        pages.array(4, np.float32, "tiny")


scans = pytest.mark.skipif(not pages.can_scan(), reason="no PAGEMAP_SCAN here (Linux 6.7 and later)")
thp = pytest.mark.skipif(pages.thp_setting() not in ("always", "madvise"), reason="no transparent huge pages")


@scans
def test_the_scan_tells_4k_pages_from_huge_ones_and_agrees_with_smaps() -> None:
    small = pages.array(4 << 20, np.uint8, "small")
    small[:] = 1
    assert pages.huge_share(small) == (0.0, True)
    view = small[12345:]  # (not page-aligned)
    assert pages.huge_share(view) == (0.0, True)
    if pages.thp_setting() in ("always", "madvise"):
        huge = pages.array(6 << 20, np.uint8, "huge")
        huge[:] = 1
        share, settled = pages.huge_share(huge)
        assert settled and share == pages.huge_bytes(huge) / huge.nbytes > 0
    assert pages.huge_share(np.empty(0, np.uint8)) == (0.0, True)


@scans
@thp
def test_pages_not_yet_touched_are_looked_at_again() -> None:
    """A fresh buffer has no pages yet: not huge, and not remembered as such, so the first call
    on an output it allocates does not settle the answer for the calls after it."""
    huge = pages.array(4 << 20, np.uint8, "huge")
    assert pages.huge_share(huge) == (0.0, False)
    huge[: 2 << 20] = 1
    assert pages.huge_share(huge) == (0.5, False)
    huge[:] = 1
    assert pages.huge_share(huge) == (1.0, True)
    # remembered once settled: the same buffer is not scanned again ...
    key = (huge.ctypes.data, huge.nbytes)
    pages._SHARES[key] = (pages._SHARES[key][0], 0.25)
    assert pages.huge_share(huge) == (0.25, True)
    # ... but another one mapped where it was is (mmap gives a freed range out again)
    owner = pages._SHARES[key][0]
    del huge
    assert owner() is None
    for _ in range(8):
        small = pages.array(4 << 20, np.uint8, "small")
        small[:] = 1
        if (small.ctypes.data, small.nbytes) == key:
            assert pages._SHARES[key][1] == 0.25  # (the old answer is still there)
            assert pages.huge_share(small) == (0.0, True)
            break
    pages._SHARES.clear()
