"""Fixtures shared by every test: no leaks in /dev/shm, warm kernels, rank pools."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import Pools  # noqa: E402

from shmcoll.shm.segment import issued_tokens, list_segments, stale_segments, token_of  # noqa: E402

ENGINE_DTYPES = [
    np.dtype(t)
    for t in (
        np.uint8,
        np.int8,
        np.uint16,
        np.int16,
        np.uint32,
        np.int32,
        np.uint64,
        np.int64,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
    )
]


@pytest.fixture(scope="session", autouse=True)
def warm_kernels() -> None:
    """Compile every engine dtype once, so rank processes only load them from the cache."""
    from shmcoll.launch import warm_kernels as warm

    warm(ENGINE_DTYPES)


def _ours() -> set[str]:
    """Segments of jobs started by this test process, plus any whose creator is dead (a leak,
    from a job this test started in a subprocess). Live jobs of other processes are not ours."""
    tokens = issued_tokens()
    return {name for name in list_segments() if token_of(name) in tokens} | set(stale_segments())


@pytest.fixture(autouse=True)
def no_shm_leaks():  # type: ignore[no-untyped-def]
    """Fail any test that leaves a shmcoll-* entry in /dev/shm."""
    before = _ours()
    yield
    left = sorted(_ours() - before)
    if left:
        for name in left:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass
        pytest.fail(f"test left shared-memory segments behind: {left}")


@pytest.fixture(scope="session")
def pools():  # type: ignore[no-untyped-def]
    p = Pools()
    yield p
    p.close()
