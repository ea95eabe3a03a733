"""Property-based: random world sizes, collectives, algorithms, dtypes, ops, shapes and roots,
each compared with numpy (hypothesis draws the cases; persistent pools run them)."""

from __future__ import annotations

import numpy as np
import pytest
from cases import EVERY, PREFIX, REDUCING, ROOTED, SAME_ON_ALL, Case, make_case, run_cases
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmcoll
from shmcoll import ReduceOp
from shmcoll.algos import registry
from shmcoll.types import DTYPES, dtype_str, supports

WORLD_SIZES = (1, 2, 3, 4, 5)


@st.composite
def cases(draw):  # type: ignore[no-untyped-def]
    world_size = draw(st.sampled_from(WORLD_SIZES))
    kind = draw(st.sampled_from(EVERY))
    algorithm = draw(st.sampled_from([a.name for a in registry.algorithms(kind)]))
    dtype = draw(st.sampled_from(DTYPES))
    ops = [op for op in ReduceOp if supports(op, dtype)] if kind in REDUCING else [ReduceOp.SUM]
    if kind in PREFIX:
        ops = [op for op in ops if op != ReduceOp.AVG]
    case = make_case(
        kind=kind,
        algorithm=algorithm,
        dtype=dtype_str(dtype),
        op=int(draw(st.sampled_from(ops))),
        root=draw(st.integers(0, world_size - 1)) if kind in ROOTED else 0,
        count=draw(st.one_of(st.integers(0, 40), st.integers(41, 700))),
        inplace=draw(st.booleans()),
        data=draw(st.sampled_from(["int", "int", "wrap"] if dtype.kind in "iu" else ["int"])),
        case_id=draw(st.integers(0, 2**31)),
        shape2d=draw(st.booleans()),
    )
    if case.shape2d and case.count % 2:
        case = Case(**{**case.__dict__, "shape2d": False})  # a 2-d shape needs an even count
    return world_size, case


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases())
def test_random_calls_match_numpy(pools, drawn) -> None:  # type: ignore[no-untyped-def]
    world_size, case = drawn
    results = pools.get(world_size, slot_bytes=64, nslots=2).run(run_cases, [case], timeout=120)
    failures = [f for fails, _ in results for f in fails]
    assert not failures, failures
    if case.kind in SAME_ON_ALL:
        assert len({r[1].get(case.case_id) for r in results}) == 1, f"{case.describe()}: ranks differ"


@pytest.fixture(scope="module")
def lone_comm():  # type: ignore[no-untyped-def]
    with shmcoll.Group(1) as group:
        comm = group.connect(0)
        yield comm
        comm.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(DTYPES), op=st.sampled_from(list(ReduceOp)), kind=st.sampled_from(REDUCING))
def test_invalid_op_dtype_pairs_raise_before_communicating(lone_comm, dtype, op, kind) -> None:  # type: ignore[no-untyped-def]
    x = np.zeros(4, dtype)
    call = {
        "allreduce": lambda: lone_comm.allreduce(x, op),
        "reduce": lambda: lone_comm.reduce(x, 0, op),
        "reduce_scatter": lambda: lone_comm.reduce_scatter(x, op),
        "reduce_scatterv": lambda: lone_comm.reduce_scatter(x, op, [4]),
        "scan": lambda: lone_comm.scan(x, op),
        "exscan": lambda: lone_comm.exscan(x, op),
    }[kind]
    if kind in PREFIX and op == ReduceOp.AVG and supports(op, dtype):
        with pytest.raises(ValueError, match="AVG is not a prefix reduction"):
            call()
    elif supports(op, dtype):
        call()
    else:
        with pytest.raises(ValueError, match="not defined for dtype"):
            call()
