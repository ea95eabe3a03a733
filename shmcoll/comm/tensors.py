"""torch tensors as arrays: zero-copy numpy views going in, tensors coming out.

torch is optional and never imported here: a tensor can only reach a call if the caller imported
torch, so ``sys.modules`` tells whether an object may be one. A CPU tensor becomes the numpy
array that shares its memory (``Tensor.numpy``), so it takes every check and every path a numpy
array takes, with the same messages; ``torch.bfloat16``, which numpy lacks, becomes an array of
:data:`shmcoll.types.BFLOAT16`. A result the call allocates is returned as a tensor when the
caller gave tensors. CUDA tensors never come here: they describe themselves with
``__cuda_array_interface__`` and take the device path.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from shmcoll.types import BFLOAT16


def is_tensor(a: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(a, torch.Tensor)


def as_array(t: Any, name: str) -> np.ndarray:
    """The numpy array sharing ``t``'s memory; TypeError/ValueError naming what does not fit."""
    torch = sys.modules["torch"]  # (imported: ``t`` is a tensor; an import statement costs 0.1 us per call)

    if not t.is_cpu:
        raise TypeError(f"{name} is a tensor on {t.device}; shmcoll takes CPU tensors and CUDA tensors")
    if t.layout != torch.strided:
        raise TypeError(f"{name} is a {t.layout} tensor; shmcoll takes dense (strided) tensors")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be C-contiguous (use .contiguous())")
    if t.requires_grad:
        t = t.detach()  # the data, not the autograd graph: collectives are not differentiable here
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)  # type: ignore[no-any-return]
    try:
        return t.numpy()  # type: ignore[no-any-return]
    except (TypeError, RuntimeError) as exc:  # a dtype numpy lacks; a lazily conjugated/negated view
        raise TypeError(f"{name} cannot be seen as a numpy array: {exc}") from None


def layout_of(x: Any, out: Any) -> tuple[Any, ...]:
    """Where the tensors ``x`` and ``out`` (or None) keep their data and how it is laid out: what a
    remembered call on them must find unchanged (``comm.bind._remember``)."""
    return (
        None if x is None else (x.data_ptr(), x.shape, x.stride()),
        None if out is None or out is x else (out.data_ptr(), out.shape, out.stride()),
    )


def as_tensor(a: Any) -> Any:
    """A tensor sharing the memory of a result shmcoll allocated (numpy array), or ``a`` itself."""
    if not isinstance(a, np.ndarray):
        return a
    import torch

    if a.dtype == BFLOAT16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
