"""Workers spawned for a pool after its deletion: two replicas on one store (SQLite, and
PostgreSQL), one leading, sharing one in-memory fleet (`fakes.MemoryRuntime`, a fake: the
test needs a worker that a replica spawns without the leader's knowledge).

A replica that has not read a pool's drain yet (its passes stalled longer than the two
janitor intervals a deletion waits for) still serves the pool from its catalog and may
spawn for it after the deletion. No pool's scale-down retires such a worker: before the
leader looked for them, it stayed warm for good. Loops off: the test runs the passes
itself on one virtual clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from test_ledger_restart import until
from test_plane_claims import pool
from test_sizing_replicas import SETTINGS, Replica, replica

from fakes import MemoryRuntime
from stoker.control.scaler import PassReport
from stoker.domain.pools import StoredPool
from stoker.domain.records import ClaimRequest, Worker
from stoker.domain.specs import PoolSpec
from stoker.domain.states import WorkerState
from stoker.ports.clock import VirtualClock
from stoker.ports.store import Store


def warm_of(pool: str) -> Callable[[list[Worker]], bool]:
    """Whether a worker of `pool` is warm."""
    return lambda workers: any(w.pool == pool and w.state is WorkerState.WARM for w in workers)


@dataclass
class Two:
    """The leader and another replica, on one clock and one fleet."""

    clock: VirtualClock
    fleet: MemoryRuntime
    leader: Replica
    other: Replica

    async def spawn_warm(self, spec: PoolSpec) -> None:
        """One warm worker of `spec`, spawned by the other replica (the leader unaware)."""
        assert await self.other.plane.spawner.spawn_warm(spec, 1, target=1) == 1
        await until(self.other.plane, warm_of(spec.name))


@asynccontextmanager
async def two(stores: list[Store]) -> AsyncIterator[Two]:
    clock, fleet = VirtualClock(), MemoryRuntime()
    async with (
        replica(stores[0], clock, leads=True, runtime=fleet) as leader,
        replica(stores[1], clock, leads=False, runtime=fleet) as other,
    ):
        yield Two(clock, fleet, leader, other)


async def test_a_worker_spawned_for_a_deleted_pool_is_retired_by_the_leader(
    stores: list[Store],
) -> None:
    old = pool(name="old", warm_target=0)
    async with two(stores) as both:
        clock, fleet, leader, stalled = both.clock, both.fleet, both.leader, both.other
        store = leader.plane.store
        await store.create_pool(StoredPool(old, 0), now=clock.now())
        await stalled.plane.pools.refresh()  # its last pass: it serves "old" from here on
        drained = await leader.http.post("/v1/pools/old/drain")
        assert drained.status_code == 200, drained.text
        clock.advance(2 * SETTINGS.janitor_interval_s)
        deleted = await leader.http.delete("/v1/pools/old")
        assert deleted.status_code == 200, deleted.text

        assert "old" in stalled.plane.catalog.pools  # it has not read the drain
        # It serves a session of the pool (its worker parks at the release), and keeps
        # another worker warm for it.
        await both.spawn_warm(old)
        claim = await stalled.plane.claim(ClaimRequest(pool="old", org="acme", timeout_s=5))
        await stalled.plane.release(claim.id)
        await both.spawn_warm(old)
        spawned = await store.list_workers(pool="old")
        assert sorted(w.state.value for w in spawned) == ["hot_idle", "warm"]

        clock.advance(SETTINGS.janitor_interval_s)
        report = await leader.plane.run_janitor_pass()
        await until(
            leader.plane,
            lambda ws: all(w.state is WorkerState.RETIRED for w in ws if w.pool == "old"),
        )

        assert report.retired.get("pool_removed") == 2
        for worker in spawned:
            row = await store.get_worker(worker.id)
            assert row is not None and row.state is WorkerState.RETIRED
            assert row.reason == "pool_removed" and worker.id in fleet.stop_calls


async def test_a_worker_of_a_pool_created_since_the_catalog_loaded_is_kept(
    stores: list[Store],
) -> None:
    """The leader's catalog may lag the store by a pass: a pool created meanwhile, and
    its worker, are not taken for a deleted pool's."""
    new = pool(name="new", warm_target=1)
    async with two(stores) as both:
        leader, other = both.leader, both.other
        await other.plane.store.create_pool(StoredPool(new, 0), now=both.clock.now())
        await other.plane.pools.refresh()
        await both.spawn_warm(new)
        janitor = leader.plane.janitor
        assert "new" not in leader.plane.catalog.pools
        world = await janitor.sync()  # read without the catalog's reload of a pass
        report = PassReport()
        await janitor.step(world, report)

        assert "pool_removed" not in report.retired
        (kept,) = await leader.plane.store.list_workers(pool="new")
        assert kept.state is WorkerState.WARM
