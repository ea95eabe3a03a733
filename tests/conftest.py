"""Fixtures shared by every test: no leaks in /dev/shm, warm kernels, rank pools."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import TOKEN_LOG, Pools, owned_segments  # noqa: E402

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


@pytest.fixture(autouse=True)
def no_shm_leaks():  # type: ignore[no-untyped-def]
    """Fail any test that leaves a shmcoll-* entry in /dev/shm."""
    before = owned_segments()
    yield
    left = sorted(owned_segments() - before)
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


@pytest.fixture(scope="session", autouse=True)
def token_log():  # type: ignore[no-untyped-def]
    yield TOKEN_LOG
    try:
        os.unlink(TOKEN_LOG)
    except FileNotFoundError:
        pass
