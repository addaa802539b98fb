"""The ClusterAPI contract on a `SimCluster` client view.

The view adds a token bucket, latency and scheduled faults in front of the simulated API
server; with none of them in the way it must behave exactly like the cluster the
contract describes. The cluster is not started, so no scheduler writes Unschedulable
reasons into the event streams the contract checks event by event.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from cluster_contract import ClusterContract
from stoker.ports.clock import LoopClock
from stoker.sim.cluster import SimCluster
from stoker.sim.cluster.client import SimClient
from stoker.sim.cluster.config import SimClusterConfig

EPOCH = 1_700_000_000.0


class TestSimClientContract(ClusterContract):
    """The shared contract, through one client's view of the simulated cluster."""

    @pytest.fixture
    async def cluster(self) -> AsyncIterator[SimClient]:
        sim = SimCluster(
            SimClusterConfig(namespace="workers"),
            clock=LoopClock(epoch=EPOCH),
            rng=random.Random(1),
        )
        yield sim.client("contract", qps=1000, burst=1000)
        await sim.stop()
