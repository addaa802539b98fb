"""The Store contract for stored pools: pools, revisions and rollouts, and the
compare-and-set on a pool's generation (part of `StoreContract`, run on every adapter)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from stoker.domain.errors import NotFound
from stoker.domain.ledger import ClaimLogEntry, LedgerCounts, LedgerKey
from stoker.domain.pools import PoolInUse, Rollout, StaleGeneration, StoredPool, seed_settings
from stoker.domain.records import ForecastBucket, OrgForecastBucket, PoolSizingRecord
from stoker.domain.rollouts import CanaryStrategy, ReplaceStrategy, RolloutState
from stoker.domain.specs import PodTemplate, PoolSpec, ProcessTemplate, Timeouts, revision_of
from stoker.domain.states import Reuse

if TYPE_CHECKING:
    from stoker.ports.store import Store
    from store_contract import Fleet, MakeStore

T0 = 1_000.0
V1 = ProcessTemplate(argv=("worker", "{port}"), env={"A": "1"}, memory_mb=32)
V2 = ProcessTemplate(argv=("worker", "--v2", "{port}"))


def stored_pool(name: str = "p", template: ProcessTemplate | PodTemplate = V1) -> StoredPool:
    """A pool as a seed writes it, with settings besides the defaults."""
    spec = PoolSpec(
        name=name,
        template=template,
        warm_target=3,
        max_workers=10,
        hot_idle_ttl=90.0,
        reuse=Reuse.NEVER,
        timeouts=Timeouts(spawn_s=7.0),
    )
    strategy = CanaryStrategy(steps=(5, 100))
    return StoredPool(spec, 0, strategy, seed=seed_settings(spec, strategy))


def rollout(
    rollout_id: str = "ro-1",
    *,
    template: ProcessTemplate = V2,
    state: RolloutState = RolloutState.RAMPING,
    base: str = revision_of(V1),
) -> Rollout:
    return Rollout(
        id=rollout_id,
        pool="p",
        revision=revision_of(template),
        base_revision=base,
        strategy=CanaryStrategy(),
        state=state,
        started_at=T0,
        share=10,
        step_started_at=T0,
    )


class PoolContract:
    """Stored pools; mixed into `StoreContract`, whose fixtures it uses."""

    async def test_a_created_pool_round_trips_at_generation_1(self, store: Store) -> None:
        seed = stored_pool()
        created = await store.create_pool(seed, now=T0)
        assert created is not None
        assert created.generation == 1 and created.spec == seed.spec
        assert created.strategy == seed.strategy and not created.draining
        assert created.seed == seed.seed and created.seed["rollout"]["steps"] == [5, 100]
        assert (created.created_at, created.updated_at) == (T0, T0)
        assert await store.get_pool("p") == created
        assert await store.list_pools() == [created]
        assert await store.pool_generations() == {"p": 1}
        (revision,) = await store.list_revisions("p")
        assert (revision.revision, revision.template) == (seed.revision, V1)
        assert await store.get_pool("other") is None

    async def test_a_pod_template_round_trips(self, store: Store) -> None:
        pod = PodTemplate(
            image="img:1",
            command=("serve",),
            args=("--port", "{port}"),
            tolerations=({"key": "k", "operator": "Exists"},),
            labels={"team": "a"},
        )
        created = await store.create_pool(stored_pool("k", pod), now=T0)
        assert created is not None and created.spec.template == pod
        assert created.revision == revision_of(pod)

    async def test_creating_a_pool_the_store_has_writes_nothing(self, store: Store) -> None:
        first = await store.create_pool(stored_pool(), now=T0)
        assert await store.create_pool(stored_pool(template=V2), now=T0 + 1) is None
        assert await store.get_pool("p") == first
        assert len(await store.list_revisions("p")) == 1

    async def test_an_update_bumps_the_generation(self, store: Store) -> None:
        pool = await store.create_pool(stored_pool(), now=T0)
        assert pool is not None
        changed = pool.evolve(spec=replace(pool.spec, warm_target=5), draining=True)
        updated = await store.update_pool(changed, now=T0 + 1)
        assert updated.generation == 2 and updated.spec.warm_target == 5 and updated.draining
        assert updated.updated_at == T0 + 1 and updated.revision == pool.revision
        assert await store.pool_generations() == {"p": 2}

    async def test_a_write_from_a_stale_generation_loses_and_says_so(self, store: Store) -> None:
        pool = await store.create_pool(stored_pool(), now=T0)
        assert pool is not None
        await store.update_pool(pool.evolve(spec=replace(pool.spec, warm_target=1)), now=T0 + 1)
        with pytest.raises(StaleGeneration) as lost:
            await store.update_pool(pool.evolve(spec=replace(pool.spec, warm_target=9)), now=T0)
        assert (lost.value.expected, lost.value.current) == (1, 2)
        stored = await store.get_pool("p")
        assert stored is not None and stored.spec.warm_target == 1
        with pytest.raises(NotFound):
            await store.update_pool(stored_pool("gone").evolve(generation=1), now=T0)

    async def test_racing_writers_of_one_generation_one_wins(
        self, store: Store, make_store: MakeStore
    ) -> None:
        replicas = [store, await make_store(), await make_store()]
        pool = await store.create_pool(stored_pool(), now=T0)
        assert pool is not None

        async def write(i: int) -> int | None:
            changed = pool.evolve(spec=replace(pool.spec, warm_target=i))
            try:
                return (await replicas[i % 3].update_pool(changed, now=T0 + 1)).spec.warm_target
            except StaleGeneration:
                return None

        results = await asyncio.gather(*(write(i) for i in range(1, 10)))
        winners = [r for r in results if r is not None]
        assert len(winners) == 1
        stored = await store.get_pool("p")
        assert stored is not None and (stored.generation, stored.spec.warm_target) == (
            2,
            winners[0],
        )

    async def test_a_rollout_start_is_one_write(self, store: Store) -> None:
        pool = await store.create_pool(stored_pool(), now=T0)
        assert pool is not None
        after = await store.start_rollout(rollout(), V2, generation=1, now=T0 + 1)
        assert after.generation == 2 and after.revision == revision_of(V1)  # stable stays
        assert [r.template for r in await store.list_revisions("p")] == [V1, V2]
        assert await store.get_rollout("ro-1") == rollout()
        assert await store.list_rollouts(pool="p") == [rollout()]
        assert await store.list_rollouts() == [rollout()]
        # From a stale generation nothing is written: no revision, no rollout, no bump.
        with pytest.raises(StaleGeneration):
            await store.start_rollout(rollout("ro-2", template=V1), V1, generation=1, now=T0 + 2)
        assert await store.get_rollout("ro-2") is None
        assert await store.pool_generations() == {"p": 2}

    async def test_a_new_rollout_supersedes_the_active_one(self, store: Store) -> None:
        await store.create_pool(stored_pool(), now=T0)
        await store.start_rollout(rollout(), V2, generation=1, now=T0 + 1)
        v3 = ProcessTemplate(argv=("worker", "--v3", "{port}"))
        second = rollout("ro-2", template=v3)
        await store.start_rollout(second, v3, generation=2, now=T0 + 2)
        first = await store.get_rollout("ro-1")
        assert first is not None and first.state is RolloutState.SUPERSEDED
        assert (first.share, first.ended_at, first.reason) == (0, T0 + 2, "superseded by ro-2")
        assert await store.list_rollouts() == [second]
        assert len(await store.list_revisions("p")) == 3

    async def test_a_replace_starts_promoted_and_switches_the_stable_revision(
        self, store: Store
    ) -> None:
        await store.create_pool(stored_pool(), now=T0)
        done = rollout(state=RolloutState.PROMOTED).evolve(
            strategy=ReplaceStrategy(), share=100, ended_at=T0 + 1
        )
        after = await store.start_rollout(done, V2, generation=1, now=T0 + 1)
        assert after.revision == revision_of(V2) and after.spec.template == V2
        assert after.spec.warm_target == 3  # the settings stay
        assert await store.list_rollouts() == []

    async def test_a_rollout_state_change_is_one_write(self, store: Store) -> None:
        await store.create_pool(stored_pool(), now=T0)
        await store.start_rollout(rollout(), V2, generation=1, now=T0 + 1)
        stepped = rollout().evolve(step=1, share=50, step_started_at=T0 + 60)
        after = await store.update_rollout(stepped, generation=2, now=T0 + 60)
        assert after.generation == 3 and await store.get_rollout("ro-1") == stepped
        with pytest.raises(StaleGeneration):
            await store.update_rollout(stepped.evolve(share=100), generation=2, now=T0 + 61)
        promoted = stepped.evolve(state=RolloutState.PROMOTED, share=100, ended_at=T0 + 120)
        after = await store.update_rollout(promoted, generation=3, now=T0 + 120)
        assert after.revision == revision_of(V2) and after.generation == 4
        assert await store.get_rollout("ro-1") == promoted

    async def test_a_rollback_keeps_the_stable_revision(self, store: Store) -> None:
        await store.create_pool(stored_pool(), now=T0)
        await store.start_rollout(rollout(), V2, generation=1, now=T0 + 1)
        failed = rollout().evolve(
            state=RolloutState.ROLLED_BACK, share=0, ended_at=T0 + 5, reason="spawns fail"
        )
        after = await store.update_rollout(failed, generation=2, now=T0 + 5)
        assert after.revision == revision_of(V1) and after.generation == 3
        assert await store.list_rollouts() == []
        assert await store.get_rollout("ro-1") == failed

    async def test_a_change_of_an_unknown_rollout_writes_nothing(self, store: Store) -> None:
        await store.create_pool(stored_pool(), now=T0)
        with pytest.raises(NotFound, match="unknown rollout"):
            await store.update_rollout(rollout("nope"), generation=1, now=T0 + 1)
        assert await store.pool_generations() == {"p": 1}

    async def test_racing_rollout_starts_leave_one_active_rollout(
        self, store: Store, make_store: MakeStore
    ) -> None:
        replicas = [store, await make_store(), await make_store()]
        await store.create_pool(stored_pool(), now=T0)

        async def start(i: int) -> bool:
            template = ProcessTemplate(argv=("worker", f"--v{i}", "{port}"))
            try:
                await replicas[i % 3].start_rollout(
                    rollout(f"ro-{i}", template=template), template, generation=1, now=T0 + 1
                )
            except StaleGeneration:
                return False
            return True

        assert sum(await asyncio.gather(*(start(i) for i in range(9)))) == 1
        assert len(await store.list_rollouts()) == 1
        assert len(await store.list_revisions("p")) == 2
        assert await store.pool_generations() == {"p": 2}

    # -- outcome counts of a rollout's revision, from every replica ---------------------------

    async def test_outcome_counts_are_upserted_per_replica_and_summed(
        self, store: Store, make_store: MakeStore
    ) -> None:
        """Each replica replaces its own cumulative counts; the leader reads their sum."""
        other = await make_store()
        assert await store.read_outcomes(["ro-1"]) == {}
        await store.record_outcomes("cp-a", {"ro-1": {"spawn": 4, "claim": 2}}, now=T0)
        await other.record_outcomes(
            "cp-b", {"ro-1": {"activation": 5, "activation_failure": 3}}, now=T0 + 1
        )
        await store.record_outcomes("cp-c", {"ro-2": {"spawn": 9}}, now=T0 + 1)
        await store.record_outcomes("cp-a", {"ro-1": {"spawn": 6, "claim": 2}}, now=T0 + 2)
        await store.record_outcomes("cp-b", {}, now=T0 + 3)
        await other.record_outcomes("cp-b", {"ro-1": {"activation": 7}}, now=T0 + 4)
        assert await store.read_outcomes(["ro-1"]) == {
            "ro-1": {"spawn": 6, "claim": 2, "activation": 7, "activation_failure": 3}
        }
        assert await other.read_outcomes(["ro-1", "ro-2", "ro-3"]) == {
            "ro-1": {"spawn": 6, "claim": 2, "activation": 7, "activation_failure": 3},
            "ro-2": {"spawn": 9},
        }
        assert await store.read_outcomes([]) == {}

    async def test_the_purge_deletes_the_outcome_counts_of_rollouts_that_ended(
        self, store: Store
    ) -> None:
        await store.create_pool(stored_pool(), now=T0)
        await store.start_rollout(rollout(), V2, generation=1, now=T0 + 1)
        await store.record_outcomes("cp-a", {"ro-1": {"spawn": 3}}, now=T0 + 2)
        await store.purge(before=T0 + 10_000)
        assert await store.read_outcomes(["ro-1"]) == {"ro-1": {"spawn": 3}}  # still active
        failed = rollout().evolve(state=RolloutState.ROLLED_BACK, share=0, ended_at=T0 + 5)
        await store.update_rollout(failed, generation=2, now=T0 + 5)
        await store.purge(before=T0 + 5)
        assert await store.read_outcomes(["ro-1"]) == {"ro-1": {"spawn": 3}}  # not old yet
        assert await store.purge(before=T0 + 6) >= 1
        assert await store.read_outcomes(["ro-1"]) == {}

    # -- deleting a pool --------------------------------------------------------------------

    async def test_deleting_a_drained_pool_removes_what_is_its_alone(
        self, store: Store, fleet: Fleet
    ) -> None:
        """The pool's rows in every table keyed by it go in one write; another pool's stay,
        and so do the ledger, the claim log, retired workers and ended claims (history)."""
        for name in ("p", "q"):
            await store.create_pool(stored_pool(name), now=T0)
        await store.start_rollout(rollout(), V2, generation=1, now=T0 + 1)
        ended = rollout().evolve(state=RolloutState.ROLLED_BACK, share=0, ended_at=T0 + 2)
        await store.update_rollout(ended, generation=2, now=T0 + 2)
        await store.record_outcomes("cp-a", {"ro-1": {"spawn": 3}}, now=T0 + 2)
        await store.record_forecast(
            [ForecastBucket(n, "day", 9, 0.01, 0.0, 3, T0) for n in ("p", "q")]
        )
        await store.record_org_forecast(
            [OrgForecastBucket(n, "acme", 9, 0.01, 0.0, 3, T0) for n in ("p", "q")]
        )
        await store.record_sizing([PoolSizingRecord(n, "cp-a", T0, 2, 1) for n in ("p", "q")])
        await store.record_demand("cp-a", {"p": (4, 0), "q": (1, 0)}, now=T0)
        await store.record_demand("cp-b", {"p": (2, 1)}, now=T0)
        cell = LedgerKey("p", "r1", "acme", 0)
        await store.record_ledger("cp-a", {cell: LedgerCounts(warm_s=5.0)}, now=T0)
        logged = ClaimLogEntry("c-1", T0, "p", "acme", "cold", "cold", 0.1, 2.0, "released", "r1")
        await store.record_claim_log([logged], [])
        retired = await fleet.retired(pool="p")
        pool = await store.get_pool("p")
        assert pool is not None
        await store.update_pool(pool.evolve(draining=True), now=T0 + 3)

        deleted = await store.delete_pool("p", generation=4)

        assert (deleted.name, deleted.generation) == ("p", 4)
        assert deleted.removed == {
            "rollout_outcomes": 1,
            "rollouts": 1,
            "revisions": 2,
            "forecast": 1,
            "org_forecast": 1,
            "pool_sizing": 1,
            "demand": 2,
            "pools": 1,
        }
        assert await store.get_pool("p") is None
        assert [p.name for p in await store.list_pools()] == ["q"]
        assert await store.pool_generations() == {"q": 1}
        assert await store.list_revisions("p") == []
        assert await store.list_rollouts(pool="p") == []
        assert await store.get_rollout("ro-1") is None
        assert await store.read_outcomes(["ro-1"]) == {}
        assert [b.pool for b in await store.read_forecast()] == ["q"]
        assert [b.pool for b in await store.read_org_forecast()] == ["q"]
        assert [s.pool for s in await store.read_sizing()] == ["q"]
        assert [d.pool for d in await store.read_demand()] == ["q"]
        # History keeps its own retention.
        assert [k for k, _ in await store.read_ledger("p", since=0, until=T0 + 1e6)] == [cell]
        assert await store.read_claim_log(since=0, until=T0 + 1) == [logged]
        assert await store.get_worker(retired.id) == retired
        # The name is free again: a seed creates the pool afresh, at generation 1.
        again = await store.create_pool(stored_pool("p", V2), now=T0 + 9)
        assert again is not None and again.generation == 1
        assert [r.template for r in await store.list_revisions("p")] == [V2]

    async def test_a_pool_that_is_not_drained_is_not_deleted(self, store: Store) -> None:
        await store.create_pool(stored_pool(), now=T0)
        with pytest.raises(PoolInUse, match="not drained") as refused:
            await store.delete_pool("p")
        assert refused.value.reason == "not_draining"
        assert await store.pool_generations() == {"p": 1}
        assert len(await store.list_revisions("p")) == 1

    async def test_a_pool_with_live_workers_or_open_claims_is_not_deleted(
        self, store: Store, fleet: Fleet
    ) -> None:
        pool = await store.create_pool(stored_pool(), now=T0)
        assert pool is not None
        await store.update_pool(pool.evolve(draining=True), now=T0 + 1)
        await fleet.hot("acme")
        await fleet.warm()
        await fleet.retired()
        await fleet.warm(pool="q")  # another pool's
        with pytest.raises(PoolInUse, match="2 live workers and 1 open claim") as refused:
            await store.delete_pool("p")
        assert refused.value.reason == "in_use"
        assert (refused.value.live_workers, refused.value.open_claims) == (2, 1)
        assert await store.pool_generations() == {"p": 2}

    async def test_a_pool_rolling_out_is_not_deleted(self, store: Store) -> None:
        await store.create_pool(stored_pool(), now=T0)
        await store.start_rollout(rollout(), V2, generation=1, now=T0 + 1)
        pool = await store.get_pool("p")
        assert pool is not None
        await store.update_pool(pool.evolve(draining=True), now=T0 + 2)
        with pytest.raises(PoolInUse, match="rollout 'ro-1'") as refused:
            await store.delete_pool("p")
        assert refused.value.reason == "rollout_active"
        assert await store.get_rollout("ro-1") == rollout()

    async def test_deleting_an_unknown_or_moved_on_pool_deletes_nothing(self, store: Store) -> None:
        with pytest.raises(NotFound, match="unknown pool 'p'"):
            await store.delete_pool("p")
        pool = await store.create_pool(stored_pool(), now=T0)
        assert pool is not None
        await store.update_pool(pool.evolve(draining=True), now=T0 + 1)
        with pytest.raises(StaleGeneration) as lost:
            await store.delete_pool("p", generation=1)
        assert (lost.value.expected, lost.value.current) == (1, 2)
        assert await store.pool_generations() == {"p": 2}

    async def test_racing_deletions_delete_once(self, store: Store, make_store: MakeStore) -> None:
        replicas = [store, await make_store(), await make_store()]
        pool = await store.create_pool(stored_pool(), now=T0)
        assert pool is not None
        await store.update_pool(pool.evolve(draining=True), now=T0 + 1)

        async def delete(i: int) -> bool:
            try:
                await replicas[i % 3].delete_pool("p")
            except NotFound:
                return False
            return True

        assert sum(await asyncio.gather(*(delete(i) for i in range(6)))) == 1
        assert await store.list_pools() == []
