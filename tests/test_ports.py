"""Ports for the servers the suite and the lab start (bench/common/localredis.py).

Under pytest-xdist each worker takes ports from a block of its own, below the kernel's
ephemeral range: a port one worker found free and closed cannot be handed to the other worker
before the first one's server binds it (it would then wait for, and talk to, a server of the
other worker's, which that worker may flush)."""

from __future__ import annotations

import socket

import pytest

from bench.common import localredis
from bench.common.localredis import free_cluster_port, free_port


@pytest.mark.parametrize("worker, block", [("gw0", 0), ("gw1", 1), ("gw5", 5)])
def test_each_worker_takes_ports_from_its_own_block(monkeypatch: pytest.MonkeyPatch,
                                                    worker: str, block: int) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setattr(localredis, "_block_next", {})
    lo = localredis.PORT_BLOCK_BASE + block * localredis.PORT_BLOCK
    picks = [free_port() for _ in range(50)]
    assert all(lo <= p < lo + localredis.PORT_BLOCK for p in picks), picks
    # Picked before any server binds them: still never the same port twice.
    assert len(set(picks)) == len(picks)
    cluster = free_cluster_port()
    c_lo = localredis.CLUSTER_BLOCK_BASE + block * localredis.CLUSTER_BLOCK
    assert c_lo <= cluster < c_lo + localredis.CLUSTER_BLOCK
    # Every block of either kind, and every bus port, is below the ephemeral range and apart
    # from every other block.
    top = localredis.PORT_BLOCK_BASE + localredis.PORT_BLOCKS * localredis.PORT_BLOCK
    assert top <= 32_768
    assert localredis.CLUSTER_BLOCK_BASE + localredis.PORT_BLOCKS * localredis.CLUSTER_BLOCK \
        + 10_000 <= localredis.PORT_BLOCK_BASE


def test_a_port_in_use_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    monkeypatch.setattr(localredis, "_block_next", {})
    lo = localredis.PORT_BLOCK_BASE + 2 * localredis.PORT_BLOCK
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        monkeypatch.setattr(localredis, "_block_next", {2: port - lo})  # its turn again
        assert free_port() != port


def test_outside_a_worker_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free when picked
