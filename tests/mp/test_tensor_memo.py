"""A loop's repeated call on the same tensors skips the checks and the binding (comm.bind._remember),
so it must notice what a tensor can change in place: its storage, shape and strides (``set_``,
``as_strided_``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _changes(comm):  # type: ignore[no-untyped-def]
    n, r = comm.world_size, comm.rank
    seen = []
    t = torch.full((4,), float(r + 1))
    out = torch.empty(4)
    for _ in range(2):
        t.fill_(r + 1)
        seen.append(comm.allreduce(t, out=out) is out and out.tolist())
    t.set_(torch.full((3,), float(r)))  # new storage, new shape, same object
    seen.append(comm.allreduce(t).tolist())
    t.set_(torch.ones(5))  # again (resize_ is refused once numpy shares a storage, by torch)
    seen.append(comm.allreduce(t).tolist())
    u = torch.arange(6.0).reshape(2, 3).t()  # same size, not contiguous: refused, not run wrongly
    try:
        comm.allreduce(u)
        seen.append("ran")
    except ValueError as exc:
        seen.append(str(exc))
    g = torch.empty(n, 2)
    x = torch.full((2,), float(r))
    for k in range(2):
        x.fill_(r + k)
        comm.allgather(x, out=g)
        seen.append(g[:, 0].tolist())
    return seen


def test_repeated_tensor_calls_notice_what_changed(pools) -> None:  # type: ignore[no-untyped-def]
    n = 2
    results = pools.get(n).run(_changes)
    total = float(sum(range(1, n + 1)))
    want = [[total] * 4, [total] * 4, [float(sum(range(n)))] * 3, [float(n)] * 5]
    want += ["x must be C-contiguous (use .contiguous())", [0.0, 1.0], [1.0, 2.0]]
    assert all(res == want for res in results), results
