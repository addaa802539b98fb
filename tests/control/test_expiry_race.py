"""A replica that heartbeats between the leader's listing of the replicas and its expiry
of the stale ones keeps its workers: the leader adopts only the workers of replicas it
expired (or that were expired or stopped already).

Two planes on one store (a SQLite file, or a PostgreSQL schema), loops off, on virtual
time; the store of the leader lands the other replica's heartbeat just before its expiry
runs, as a replica back from a long pause would.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_sizing_replicas import replica

from fakes import MemoryRuntime
from stoker.domain.records import ClaimRequest
from stoker.domain.states import WorkerState
from stoker.ports.clock import VirtualClock
from stoker.ports.store import Store


class HeartbeatFirst:
    """A store whose `expire_instances` first runs `before` (another replica's heartbeat)."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.before: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def expire_instances(self, **kw: Any) -> list[str]:
        if self.before is not None:
            await self.before()
        return await self.inner.expire_instances(**kw)


@pytest.mark.parametrize("heartbeat_between", [True, False])
async def test_a_replica_that_heartbeats_before_its_expiry_keeps_its_workers(
    stores: list[Store],
    heartbeat_between: bool,
) -> None:
    clock = VirtualClock()
    leading = HeartbeatFirst(stores[0])
    fleet = MemoryRuntime()  # the workers are the same whichever replica asks
    async with (
        replica(leading, clock, leads=True, runtime=fleet) as leader,
        replica(stores[1], clock, leads=False, runtime=fleet) as other,
    ):
        await leader.plane.run_janitor_pass()  # spawns the pool's warm worker
        claim = await other.plane.claim(ClaimRequest(pool="p", org="acme", lease_s=3600))
        held = await stores[1].get_worker(claim.worker_id)
        assert held is not None and held.owner == other.plane.instance_id
        # The other replica's heartbeats stop for longer than the expiry ...
        clock.advance(other.plane.settings.instance_expiry_s + 1)
        await leader.plane.check_store()  # the leader's own heartbeat
        if heartbeat_between:
            # ... and resume just after the leader listed the replicas.
            leading.before = other.plane.check_store
        await leader.plane.run_janitor_pass()
        after = await stores[0].get_worker(claim.worker_id)
        assert after is not None and after.state is WorkerState.HOT
        instances = {i.id: i.state for i in await stores[0].list_instances()}
        if heartbeat_between:
            assert after.owner == other.plane.instance_id
            assert instances[other.plane.instance_id] == "active"
        else:
            # Without the heartbeat it is expired and its session's worker adopted.
            assert after.owner == leader.plane.instance_id
            assert instances[other.plane.instance_id] == "expired"
