"""Seeding the store from a config file and reloading the catalog (a real SQLite store;
two `StoredPools` on one file stand for two replicas)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from stoker.adapters.sqlite import SqliteStore
from stoker.control.catalog import Catalog
from stoker.control.ids import Ids
from stoker.control.stored_pools import StoredPools, revision_shares
from stoker.domain.errors import InvalidRequest
from stoker.domain.pools import PoolInUse, Rollout, StaleGeneration
from stoker.domain.rollouts import CanaryStrategy, ReplaceStrategy, RolloutState, Strategy
from stoker.domain.specs import PoolSpec, ProcessTemplate
from stoker.ports.clock import LoopClock, VirtualClock

V1 = ProcessTemplate(argv=("worker", "{port}"))
V2 = ProcessTemplate(argv=("worker", "--v2", "{port}"))

Replica = Callable[..., StoredPools]


def spec(template: ProcessTemplate = V1, **kw: Any) -> PoolSpec:
    settings: dict[str, Any] = {"warm_target": 2, **kw}
    return PoolSpec(name="demo", template=template, **settings)


@pytest.fixture
async def replica(tmp_path: Path) -> AsyncIterator[Replica]:
    stores: list[SqliteStore] = []

    def make(pool: PoolSpec, strategy: Strategy | None = None) -> StoredPools:
        store = SqliteStore(str(tmp_path / "stoker.db"))
        stores.append(store)
        catalog = Catalog({pool.name: pool}, {}, derived_cap=lambda _: 0)
        strategies = {pool.name: strategy} if strategy else None
        return StoredPools(catalog, store, LoopClock(), Ids(), {pool.name: pool}, strategies)

    yield make
    for store in stores:
        await store.close()


async def seeded(pools: StoredPools) -> StoredPools:
    await pools.store.open()
    await pools.seed()
    return pools


def seed_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "event=pool_seeded" in r.getMessage()]


async def test_a_pool_the_store_lacks_is_created(
    replica: Replica, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "stoker")
    a = await seeded(replica(spec()))
    stored = await a.get("demo")
    assert stored.generation == 1 and stored.spec == spec()
    assert stored.strategy == CanaryStrategy()
    assert seed_lines(caplog) == ["event=pool_seeded pool=demo generation=1 settings=created"]


async def test_a_stored_pool_the_file_no_longer_names_is_a_warning_until_drained(
    replica: Replica, caplog: pytest.LogCaptureFixture
) -> None:
    """A pool removed from the file stays in the store and is served (the store is the
    truth): the replica says so at start, once, and stops saying it once it is drained."""
    a = await seeded(replica(spec()))
    caplog.set_level(logging.INFO, "stoker")
    other = PoolSpec(name="other", template=V1)
    b = await seeded(replica(other))
    assert "demo" in b.catalog.pools
    (line,) = [r for r in caplog.records if "pool_not_in_config" in r.getMessage()]
    assert line.levelno == logging.WARNING
    assert "pool=demo" in line.getMessage() and "stoker pools drain demo" in line.getMessage()
    stored = await a.get("demo")
    await a.store.update_pool(replace(stored, draining=True), now=0.0)
    caplog.clear()
    await seeded(replica(other))
    assert not [r for r in caplog.records if "pool_not_in_config" in r.getMessage()]


async def test_a_changed_file_updates_settings_a_file_wrote(
    replica: Replica, caplog: pytest.LogCaptureFixture
) -> None:
    await seeded(replica(spec()))
    caplog.set_level(logging.INFO, "stoker")
    b = await seeded(replica(spec(warm_target=5)))
    assert b.catalog.pool("demo").warm_target == 5
    (line,) = seed_lines(caplog)
    assert "generation=2" in line and "settings=updated" in line and "template=same" in line


async def test_a_file_never_undoes_a_change_made_through_the_api(
    replica: Replica, caplog: pytest.LogCaptureFixture
) -> None:
    a = await seeded(replica(spec()))
    await a.update("demo", {"warm_target": 7})
    caplog.set_level(logging.INFO, "stoker")
    b = await seeded(replica(spec(warm_target=5)))
    assert (await b.get("demo")).spec.warm_target == 7
    (line,) = seed_lines(caplog)
    assert "kept stored" in line and "warm_target" in line
    # The same file again: still kept (what a file last wrote is unchanged).
    c = await seeded(replica(spec(warm_target=5)))
    assert (await c.get("demo")).spec.warm_target == 7


async def test_a_new_template_proposes_a_rollout_an_old_one_changes_nothing(
    replica: Replica, caplog: pytest.LogCaptureFixture
) -> None:
    a = await seeded(replica(spec()))
    caplog.set_level(logging.INFO, "stoker")
    b = await seeded(replica(spec(V2)))
    stored = await b.get("demo")
    assert stored.revision == spec().revision  # the stable revision stays
    (rollout,) = await b.store.list_rollouts()
    assert (rollout.revision, rollout.base_revision) == (spec(V2).revision, spec().revision)
    # A canary prepares its first step: no claim routes to it before it holds its workers.
    assert (rollout.state, rollout.share) == (RolloutState.RAMPING, 0)
    assert b.catalog.rollout("demo") == rollout
    ramping = b.catalog.revision_spec("demo", rollout.revision)
    assert ramping is not None and ramping.template == V2
    assert "proposed" in seed_lines(caplog)[0]
    # A replica started on the first file again changes nothing.
    again = await seeded(replica(spec()))
    assert len(await again.store.list_rollouts(pool="demo")) == 1
    assert (await a.get("demo")).generation == stored.generation


async def test_a_replace_strategy_switches_the_stable_revision(replica: Replica) -> None:
    await seeded(replica(spec(), ReplaceStrategy()))
    b = await seeded(replica(spec(V2), ReplaceStrategy()))
    assert (await b.get("demo")).revision == spec(V2).revision
    # The older file now names a revision the store has moved past: nothing happens.
    c = await seeded(replica(spec(), ReplaceStrategy()))
    assert (await c.get("demo")).revision == spec(V2).revision
    assert await c.store.list_rollouts() == []


async def test_the_catalog_reloads_when_a_generation_changes(replica: Replica) -> None:
    a = await seeded(replica(spec()))
    b = await seeded(replica(spec()))
    assert not await b.refresh()
    await a.update("demo", {"max_workers_per_org": 3})
    assert await b.refresh()
    assert b.catalog.pool("demo").max_workers_per_org == 3
    await a.set_draining("demo", True)
    await b.refresh()
    assert b.catalog.draining("demo")
    assert b.catalog.pool("demo").warm_target == 0


async def test_a_deleted_pool_leaves_every_replicas_catalog(
    replica: Replica, caplog: pytest.LogCaptureFixture
) -> None:
    """Only a replica whose file no longer declares the pool may delete it; another replica
    forgets it at its next refresh, even when it was the last pool it served, and no start
    warns of it again."""
    a = await seeded(replica(spec()))
    other = PoolSpec(name="other", template=V1)
    b = await seeded(replica(other))
    await b.set_draining("other", True)
    await b.set_draining("demo", True)
    with pytest.raises(PoolInUse, match="declared in this replica's config") as refused:
        await a.delete("demo")
    assert refused.value.reason == "in_config"
    assert "demo" in (await a.store.pool_generations())
    forgotten: list[str] = []
    a.forgotten.append(forgotten.append)
    caplog.set_level(logging.INFO, "stoker")

    deleted = await b.delete("demo", generation=2)

    assert deleted.name == "demo" and deleted.removed["pools"] == 1
    assert set(b.catalog.pools) == {"other"}
    assert "demo" in a.catalog.pools  # until its next pass
    await a.refresh()
    assert set(a.catalog.pools) == {"other"} and forgotten == ["demo"]
    assert any("event=pool_deleted pool=demo" in r.getMessage() for r in caplog.records)
    # The last pool goes too: the catalogs serve none, not the ones they were built with.
    await a.delete("other")
    assert dict(a.catalog.pools) == {}
    await b.refresh()
    assert dict(b.catalog.pools) == {}
    caplog.clear()
    await seeded(replica(PoolSpec(name="third", template=V1)))
    assert not [r for r in caplog.records if "pool_not_in_config" in r.getMessage()]


async def test_updates_check_values_and_generations(replica: Replica) -> None:
    a = await seeded(replica(spec(max_workers=4)))
    with pytest.raises(InvalidRequest, match="exceeds max_workers"):
        await a.update("demo", {"warm_target": 5})
    with pytest.raises(InvalidRequest, match="not a tunable"):
        await a.update("demo", {"template": V2})
    with pytest.raises(StaleGeneration):
        await a.update("demo", {"warm_target": 1}, generation=9)
    assert (await a.get("demo")).generation == 1


def test_revision_shares_split_new_claims_between_stable_and_rollout() -> None:
    assert revision_shares("r1", None) == {"r1": ("stable", 100)}
    ramp = Rollout("ro", "demo", "r2", "r1", CanaryStrategy(), RolloutState.RAMPING, 0.0, share=10)
    assert revision_shares("r1", ramp) == {"r1": ("stable", 90), "r2": ("ramping", 10)}
    ended = replace(ramp, state=RolloutState.ROLLED_BACK, share=0)
    assert revision_shares("r1", ended) == {"r1": ("stable", 100)}


async def test_a_pool_drained_a_moment_ago_is_not_deleted_yet(tmp_path: Path) -> None:
    """Another replica reads a drain at its next pass and may serve the pool's claims (and
    spawn for it) until then: the pool may be deleted `settle_s` after its drain, not
    before (a spawn landing after the deletion would leave a worker of no pool)."""
    pool = spec()
    clock = VirtualClock()
    store = SqliteStore(str(tmp_path / "stoker.db"))
    gone = PoolSpec(name="gone", template=V1)
    pools = StoredPools(
        Catalog({"gone": gone}, {}, derived_cap=lambda _: 0),
        store,
        clock,
        Ids(),
        {pool.name: pool},
        settle_s=12.0,
    )
    await store.open()
    try:
        await pools.seed()
        # A pool another replica's file made, which this one may delete.
        await StoredPools(pools.catalog, store, clock, Ids(), {"gone": gone}).seed()
        await pools.set_draining("gone", True)
        clock.advance(11.0)
        with pytest.raises(PoolInUse, match=r"drained 11\.0s ago") as refused:
            await pools.delete("gone")
        assert refused.value.reason == "just_drained"
        clock.advance(1.0)
        assert (await pools.delete("gone")).name == "gone"
    finally:
        await store.close()
