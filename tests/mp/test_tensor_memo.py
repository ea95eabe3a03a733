"""A loop's repeated call on the same tensors skips the checks and the binding (comm.bind._remember),
so it must notice what a tensor can change in place: its storage, shape and strides (``set_``,
``as_strided_``)."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")


def _changes(comm):  # type: ignore[no-untyped-def]
    n, r = comm.world_size, comm.rank
    seen = []
    t = torch.full((4,), float(r + 1))
    out = torch.empty(4)
    for _ in range(3):  # (bound, then remembered: from the second call on through its record)
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
    want = [[total] * 4] * 3 + [[float(sum(range(n)))] * 3, [float(n)] * 5]
    want += ["x must be C-contiguous (use .contiguous())", [0.0, 1.0], [1.0, 2.0]]
    assert all(res == want for res in results), results


def _i_form_loop(comm):  # type: ignore[no-untyped-def]
    # A repeated i-form on the same tensors takes its record once the binder has matched it (the
    # layout included): a small one then runs at its start until its first wait, as on numpy
    # arrays (requests.Queue._admit), and new storage under the same tensor is bound anew.
    from shmcoll.engine.cpu import WAITING

    x, out = torch.zeros(4), torch.empty(4)
    seen = []
    for k in range(4):
        x.fill_(k + comm.rank)
        comm.barrier()
        if comm.rank == 1:
            time.sleep(0.2)  # rank 0 starts alone: what it can do without rank 1 is posting
        req = comm.iallreduce(x, out=out)
        seen.append((req._parked == WAITING, req.wait().tolist()))
    x.set_(torch.full((4,), 5.0))  # new storage, same shape, same object
    seen.append((None, comm.iallreduce(x, out=out).wait().tolist()))
    return seen


def test_a_repeated_tensor_i_form_starts_at_once_and_notices_new_storage(pools) -> None:  # type: ignore[no-untyped-def]
    first, second = pools.get(2).run(_i_form_loop)
    assert [parked for parked, _ in first[:4]] == [False, True, True, True]  # bound, then its record
    for seen in (first, second):
        assert [total for _, total in seen] == [[2.0 * k + 1] * 4 for k in range(4)] + [[10.0] * 4]
