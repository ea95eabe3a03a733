"""The parts of the multi-node path that need no MPI: node layouts, shards, the configuration,
and the simulator's ``--nodes`` model."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from shmcoll import config, sim
from shmcoll.comm.multinode import Layout, _even
from shmcoll.plan.cost import CostModel


def test_layout_groups_ranks_by_key_in_order_of_first_rank() -> None:
    lay = Layout([1, 0, 1, 0, 2])  # --map-by node: ranks dealt round robin
    assert lay.nodes == [[0, 2], [1, 3], [4]]
    assert lay.sizes == [2, 2, 1] and lay.lmin == 1 and lay.nnodes == 3
    assert list(lay.node_of) == [0, 1, 0, 1, 2] and list(lay.local_of) == [0, 0, 1, 1, 0]
    assert list(lay.order) == [0, 2, 1, 3, 4]


def test_even_shards_cover_everything() -> None:
    for n in (0, 1, 7, 100):
        for parts in (1, 2, 3, 8):
            b = _even(n, parts)
            assert b[0] == 0 and b[-1] == n and len(b) == parts + 1
            assert np.diff(b).max() - np.diff(b).min() <= 1


def test_node_overrides_are_read_from_the_environment() -> None:
    cfg = config.load({"SHMCOLL_NODE_SIZES": "2,2,1", "SHMCOLL_NODE_ID": "3"})
    assert cfg.node_sizes == (2, 2, 1) and cfg.node_id == 3
    assert config.load({}).node_sizes == () and config.load({}).node_id is None
    with pytest.raises(ValueError, match="SHMCOLL_NODE_SIZES"):
        config.load({"SHMCOLL_NODE_SIZES": "2,x"})
    with pytest.raises(ValueError, match="SHMCOLL_NODE_SIZES"):
        config.load({"SHMCOLL_NODE_SIZES": "0"})


def test_import_shmcoll_does_not_import_mpi4py() -> None:
    code = "import sys, shmcoll; shmcoll.init_mpi; assert 'mpi4py' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_the_node_model_grows_with_nodes_and_bytes() -> None:
    model = CostModel(alpha_s=5e-6, beta_Bps=25e9)
    t = {
        (n, s): sim.predict_nodes("allreduce", n, 2, s, model, 10e-6, 1e9).time_s
        for n in (1, 2, 64, 1024)
        for s in (1 << 10, 1 << 24)
    }
    assert t[(1, 1 << 24)] < t[(2, 1 << 24)] < t[(64, 1 << 24)] < t[(1024, 1 << 24)]
    assert t[(2, 1 << 10)] < t[(2, 1 << 24)]
    # large: the inter-node term tends to 2 S / beta
    big = sim.predict_nodes("allreduce", 1024, 2, 1 << 24, model, 10e-6, 1e9)
    assert big.inter_s == pytest.approx(2 * 10 * 10e-6 + 2 * (1023 / 1024) * (1 << 24) / 1e9)
    with pytest.raises(ValueError):
        sim.predict_nodes("alltoall", 2, 2, 1024, model, 1e-5, 1e9)


def test_simulate_nodes_prints_a_row_per_node_count() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmcoll.cli.main",
            "simulate",
            "--nodes",
            "2,64,1024",
            "-n",
            "2",
            "-s",
            "1M",
            "--inter-alpha",
            "10us",
            "--inter-beta",
            "1GB/s",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert [r[0] for r in rows] == ["2", "64", "1024"] and [r[1] for r in rows] == ["4", "128", "2048"]


def test_same_signatures_as_the_communicator() -> None:
    """Code written for a Communicator runs on a MultiNodeCommunicator: every public method exists
    and takes the same parameter names, kinds and defaults (looser counts defaults aside)."""
    import inspect

    from shmcoll.comm.communicator import Communicator
    from shmcoll.comm.multinode import MultiNodeCommunicator

    looser = {"alloc", "iallgatherv", "ialltoallv"}  # alloc refuses; counts may default there
    for name in dir(Communicator):
        method = getattr(Communicator, name)
        if name.startswith("_") or not callable(method) or name.endswith("_init"):
            continue
        assert hasattr(MultiNodeCommunicator, name), name
        if name in looser:
            continue
        ours = [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()]
        theirs = [
            (p.name, p.kind, p.default)
            for p in inspect.signature(getattr(MultiNodeCommunicator, name)).parameters.values()
        ]
        assert ours == theirs, name
