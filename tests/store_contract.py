"""The Store contract: one suite that every Store adapter passes unchanged.

An adapter's test module subclasses `StoreContract` and provides one fixture, `make_store`:
an async factory that returns a new store instance on the *same* database for the whole
test (a fresh, empty database per test), opened unless called with `opened=False`. Build it
with `store_factory`, which closes every store it made at teardown. `store` is the first
such instance. The concurrency tests spread their tasks over several instances, so they
exercise what several control-plane replicas do at once (I1, I5, I7).

Workers are put into each state through the port itself (`Fleet`), never by raw SQL, so
the suite knows nothing of an adapter's tables.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.domain.errors import ClaimKeyTaken, IllegalTransition, StoreError
from stoker.domain.ledger import LedgerCounts, LedgerKey, hour_of
from stoker.domain.records import (
    Claim,
    DemandRecord,
    ForecastBucket,
    LeaseRecord,
    OrgForecastBucket,
    PoolSizingRecord,
    Worker,
    token_digest,
)
from stoker.domain.states import (
    LIVE,
    TERMINAL,
    TRANSITIONS,
    ClaimMode,
    ClaimSource,
    ClaimState,
    WorkerState,
    check_transition,
)
from stoker.ports.store import MUTABLE_WORKER_FIELDS, SpawnRequest, StateCount, Store
from store_contract_pools import PoolContract

S = WorkerState
T0 = 1_000.0
T = TypeVar("T")


class MakeStore(Protocol):
    """Returns a new store instance on the test's database."""

    async def __call__(self, *, opened: bool = True) -> Store: ...


@asynccontextmanager
async def store_factory(build: Callable[[], Store]) -> AsyncIterator[MakeStore]:
    """The body of an adapter's `make_store` fixture: stores from `build`, all closed after."""
    made: list[Store] = []

    async def make(*, opened: bool = True) -> Store:
        store = build()
        made.append(store)
        if opened:
            await store.open()
        return store

    try:
        yield make
    finally:
        for store in reversed(made):
            await store.close()


def must(value: T | None) -> T:
    """The value a step of the test setup must produce."""
    assert value is not None
    return value


def make_claim(
    worker: Worker,
    claim_id: str,
    now: float,
    *,
    lease_s: float = 30.0,
    owner: str = "cp-a",
    org: str | None = None,
) -> Claim:
    """A bound claim for `worker` at its current epoch, as the pool manager builds it."""
    return Claim(
        id=claim_id,
        pool=worker.pool,
        org=org or must(worker.org),
        worker_id=worker.id,
        worker_epoch=worker.epoch,
        source=ClaimSource.WARM,
        mode=ClaimMode.PREFER_WARM,
        state=ClaimState.BOUND,
        token=f"token-{claim_id}",
        endpoint=worker.endpoint or "",
        lease_s=lease_s,
        expires_at=now + lease_s,
        created_at=now,
        updated_at=now,
        owner=owner,
        ttl_s=120.0,
    )


def stored(claim: Claim) -> Claim:
    """`claim` as the store keeps it: its token as a digest."""
    return claim.evolve(token=token_digest(claim.token))


class Fleet:
    """Puts workers into each lifecycle state through the port, asserting every step.

    Times come from `tick()`, strictly increasing, so "oldest first" is observable.
    """

    def __init__(self, store: Store, *, prefix: str = "w", owner: str = "cp-a") -> None:
        self.store = store
        self.prefix = prefix
        self.owner = owner
        self.now = T0
        self._seq = itertools.count(1)

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def ids(self, n: int) -> list[str]:
        return [f"{self.prefix}-{next(self._seq):04d}" for _ in range(n)]

    async def spawning(
        self,
        n: int = 1,
        *,
        pool: str = "p",
        revision: str = "r1",
        org: str | None = None,
        owner: str | None = None,
    ) -> list[Worker]:
        req = SpawnRequest(
            pool=pool, revision=revision, count=n, owner=owner or self.owner, org=org
        )
        result = await self.store.reserve_spawn_slots(req, self.ids(n), self.tick())
        assert len(result.workers) == n
        return result.workers

    async def warm(
        self, *, pool: str = "p", revision: str = "r1", owner: str | None = None
    ) -> Worker:
        (w,) = await self.spawning(pool=pool, revision=revision, owner=owner)
        return must(
            await self.store.transition(
                w.id,
                expect=S.SPAWNING,
                epoch=w.epoch,
                version=w.version,
                to=S.WARM,
                now=self.tick(),
                changes={"endpoint": f"http://{w.id}", "runtime_ref": {"pid": 100}},
            )
        )

    async def reserved(self, org: str, *, pool: str = "p", revision: str = "r1") -> Worker:
        w = await self.warm(pool=pool, revision=revision)
        result = await self.store.reserve(
            w.id,
            expect=S.WARM,
            epoch=w.epoch,
            version=w.version,
            org=org,
            org_cap=0,
            owner=w.owner,
            now=self.tick(),
        )
        return must(result.worker)

    async def activating(self, org: str, *, pool: str = "p", revision: str = "r1") -> Worker:
        w = await self.reserved(org, pool=pool, revision=revision)
        return must(
            await self.store.transition(
                w.id,
                expect=S.RESERVED,
                epoch=w.epoch,
                version=w.version,
                to=S.ACTIVATING,
                now=self.tick(),
                changes={"activated": True, "heartbeat_at": self.now},
            )
        )

    async def hot(
        self,
        org: str,
        *,
        pool: str = "p",
        owner: str | None = None,
        lease_s: float = 30.0,
        revision: str = "r1",
    ) -> tuple[Worker, Claim]:
        w = await self.activating(org, pool=pool, revision=revision)
        now = self.tick()
        claim = make_claim(w, f"c-{w.id}", now, lease_s=lease_s, owner=owner or self.owner)
        return must(
            await self.store.bind(w.id, epoch=w.epoch, version=w.version, claim=claim, now=now)
        ), claim

    async def hot_idle(self, org: str, *, pool: str = "p", revision: str = "r1") -> Worker:
        _, claim = await self.hot(org, pool=pool, revision=revision)
        now = self.tick()
        ended = await self.store.end_claim(
            claim.id,
            state=ClaimState.RELEASED,
            worker_to=S.HOT_IDLE,
            now=now,
            worker_changes={"idle_since": now, "ttl_s": 60.0},
        )
        return must(ended)[1]

    async def draining(self, *, pool: str = "p") -> Worker:
        w = await self.warm(pool=pool)
        return must(
            await self.store.transition(
                w.id,
                expect=S.WARM,
                epoch=w.epoch,
                version=w.version,
                to=S.DRAINING,
                now=self.tick(),
            )
        )

    async def retired(self, *, pool: str = "p", org: str | None = None) -> Worker:
        w = await self.reserved(org, pool=pool) if org else await self.warm(pool=pool)
        return must(
            await self.store.transition(
                w.id,
                expect=w.state,
                epoch=w.epoch,
                version=w.version,
                to=S.RETIRED,
                now=self.tick(),
                changes={"reason": "excess"},
            )
        )

    async def in_state(self, state: WorkerState, org: str = "org-a") -> Worker:
        """One worker in `state` (bound to `org` where the state needs an org)."""
        if state is S.SPAWNING:
            return (await self.spawning())[0]
        if state is S.WARM:
            return await self.warm()
        if state is S.RESERVED:
            return await self.reserved(org)
        if state is S.ACTIVATING:
            return await self.activating(org)
        if state is S.HOT:
            return (await self.hot(org))[0]
        if state is S.HOT_IDLE:
            return await self.hot_idle(org)
        if state is S.DRAINING:
            return await self.draining()
        return await self.retired()


def spawn_req(**kw: Any) -> SpawnRequest:
    base: dict[str, Any] = {"pool": "p", "revision": "r1", "count": 1, "owner": "cp-a"}
    base.update(kw)
    return SpawnRequest(**base)


ILLEGAL = sorted(
    (src, dst)
    for src in S
    for dst in S
    if dst not in TRANSITIONS[src] and (src is not dst or src in TERMINAL)
)


class StoreContract(PoolContract):
    """Tests every adapter runs unchanged; subclasses provide the `make_store` fixture."""

    @pytest.fixture
    async def store(self, make_store: MakeStore) -> Store:
        return await make_store()

    @pytest.fixture
    def fleet(self, store: Store) -> Fleet:
        return Fleet(store)

    async def replicas(self, store: Store, make_store: MakeStore, n: int = 3) -> list[Store]:
        """`store` plus `n - 1` more instances on the same database."""
        return [store, *[await make_store() for _ in range(n - 1)]]

    # -- migrations -----------------------------------------------------------------------

    async def test_open_applies_migrations_to_an_empty_store(self, store: Store) -> None:
        assert await store.schema_version() > 0
        assert await store.list_workers() == []
        assert await store.count_workers() == []
        assert await store.list_claims() == []
        assert await store.list_instances() == []
        assert await store.get_lease("janitor") is None

    async def test_opening_again_keeps_schema_and_rows(
        self, store: Store, make_store: MakeStore, fleet: Fleet
    ) -> None:
        version = await store.schema_version()
        w = await fleet.warm()
        await store.open()  # a second open of the same instance is harmless
        other = await make_store()  # a second instance migrates nothing
        assert await store.schema_version() == version
        assert await other.schema_version() == version
        assert await other.get_worker(w.id) == w
        assert await store.get_worker(w.id) == w

    async def test_stores_opening_at_once_all_migrate_safely(self, make_store: MakeStore) -> None:
        stores = [await make_store(opened=False) for _ in range(4)]
        await asyncio.gather(*(s.open() for s in stores))
        versions = {await s.schema_version() for s in stores}
        assert len(versions) == 1
        assert versions.pop() > 0
        (w,) = (await stores[0].reserve_spawn_slots(spawn_req(), ["w-1"], T0)).workers
        for s in stores:
            assert await s.get_worker("w-1") == w

    async def test_closed_store_raises_store_error(self, make_store: MakeStore) -> None:
        store = await make_store()
        await store.close()
        with pytest.raises(StoreError):
            await store.get_worker("w-1")

    # -- reserve_spawn_slots --------------------------------------------------------------

    async def test_spawn_slots_insert_spawning_rows_with_the_given_ids(self, store: Store) -> None:
        req = spawn_req(count=2, owner="cp-x", revision="r7")
        result = await store.reserve_spawn_slots(req, ["a", "b", "c"], T0)
        assert result.limited_by is None
        assert [w.id for w in result.workers] == ["a", "b"]
        for w in result.workers:
            assert (w.pool, w.revision, w.state, w.epoch, w.owner) == (
                "p",
                "r7",
                S.SPAWNING,
                0,
                "cp-x",
            )
            assert (w.created_at, w.updated_at, w.heartbeat_at) == (T0, T0, T0)
            assert (w.org, w.claim_id, w.endpoint, w.activated) == (None, None, None, False)
            assert await store.get_worker(w.id) == w
        assert await store.get_worker("c") is None

    async def test_spawn_slots_for_an_org_carry_the_org(self, store: Store) -> None:
        result = await store.reserve_spawn_slots(spawn_req(org="org-a"), ["a"], T0)
        assert must(await store.get_worker("a")).org == "org-a"
        assert result.workers[0].org == "org-a"

    async def test_spawn_slots_take_no_more_than_the_ids_given(self, store: Store) -> None:
        result = await store.reserve_spawn_slots(spawn_req(count=5), ["a", "b"], T0)
        assert [w.id for w in result.workers] == ["a", "b"]
        assert result.limited_by is None
        empty = await store.reserve_spawn_slots(spawn_req(count=0), ["c"], T0)
        assert empty.workers == []
        assert await store.get_worker("c") is None

    async def test_spawn_slots_refuse_a_negative_count(self, store: Store) -> None:
        with pytest.raises(ValueError):
            await store.reserve_spawn_slots(spawn_req(count=-1), ["a", "b"], T0)
        assert await store.list_workers() == []

    async def test_pool_cap_counts_live_workers_of_the_pool(
        self, store: Store, fleet: Fleet
    ) -> None:
        await fleet.warm()
        await fleet.reserved("org-a", revision="r2")  # every revision counts
        await fleet.retired()  # retired rows do not
        await fleet.warm(pool="q")  # other pools do not
        result = await store.reserve_spawn_slots(
            spawn_req(count=5, pool_cap=4), ["a", "b", "c", "d", "e"], T0
        )
        assert [w.id for w in result.workers] == ["a", "b"]
        assert result.limited_by == "pool_cap"
        full = await store.reserve_spawn_slots(spawn_req(pool_cap=4), ["f"], T0)
        assert (full.workers, full.limited_by) == ([], "pool_cap")
        assert await store.get_worker("f") is None
        assert len(await store.list_workers(pool="p", states=[S.SPAWNING])) == 2

    async def test_pool_cap_frees_a_slot_when_a_worker_retires(
        self, store: Store, fleet: Fleet
    ) -> None:
        (a,) = (await store.reserve_spawn_slots(spawn_req(pool_cap=1), ["a"], T0)).workers
        assert (await store.reserve_spawn_slots(spawn_req(pool_cap=1), ["b"], T0)).workers == []
        await store.transition(
            "a",
            expect=S.SPAWNING,
            epoch=a.epoch,
            version=a.version,
            to=S.RETIRED,
            now=T0 + 1,
            changes={"reason": "spawn_failure"},
        )
        again = await store.reserve_spawn_slots(spawn_req(pool_cap=1), ["b"], T0 + 2)
        assert [w.id for w in again.workers] == ["b"]

    async def test_org_cap_counts_the_orgs_live_workers_in_the_pool(
        self, store: Store, fleet: Fleet
    ) -> None:
        await fleet.reserved("org-a")
        await fleet.hot_idle("org-a")
        await fleet.retired(org="org-a")  # retired: not counted
        await fleet.reserved("org-b")  # another org
        await fleet.reserved("org-a", pool="q")  # another pool
        await fleet.warm()  # neutral
        result = await store.reserve_spawn_slots(
            spawn_req(count=3, org="org-a", org_cap=3), ["a", "b", "c"], T0
        )
        assert [w.id for w in result.workers] == ["a"]
        assert result.limited_by == "org_cap"
        other = await store.reserve_spawn_slots(spawn_req(org="org-b", org_cap=3), ["d"], T0)
        assert [w.id for w in other.workers] == ["d"]

    async def test_org_cap_does_not_limit_neutral_spawns(self, store: Store, fleet: Fleet) -> None:
        await fleet.reserved("org-a")
        result = await store.reserve_spawn_slots(spawn_req(count=2, org_cap=1), ["a", "b"], T0)
        assert len(result.workers) == 2

    async def test_target_counts_warm_and_neutral_spawning_of_the_revision(
        self, store: Store, fleet: Fleet
    ) -> None:
        await fleet.warm()
        await fleet.spawning()
        await fleet.spawning(org="org-a")  # a cold spawn for a claim is not neutral
        await fleet.reserved("org-a")  # taken: no longer warm
        await fleet.warm(revision="r2")  # another revision
        await fleet.warm(pool="q")  # another pool
        result = await store.reserve_spawn_slots(
            spawn_req(count=5, target=4), ["a", "b", "c", "d", "e"], T0
        )
        assert [w.id for w in result.workers] == ["a", "b"]
        assert result.limited_by == "target"
        over = await store.reserve_spawn_slots(spawn_req(count=2, target=1), ["f", "g"], T0)
        assert (over.workers, over.limited_by) == ([], "target")

    async def test_zero_caps_are_unbounded(self, store: Store, fleet: Fleet) -> None:
        for _ in range(3):
            await fleet.reserved("org-a")
        ids = [f"n-{i}" for i in range(20)]
        result = await store.reserve_spawn_slots(
            spawn_req(count=20, org="org-a", pool_cap=0, org_cap=0), ids, T0
        )
        assert len(result.workers) == 20
        assert result.limited_by is None

    async def test_spawn_reports_the_limit_that_stopped_it(self, store: Store) -> None:
        ids = [f"n-{i}" for i in range(10)]
        by_org = await store.reserve_spawn_slots(
            spawn_req(count=10, org="org-a", pool_cap=5, org_cap=2), ids, T0
        )
        assert (len(by_org.workers), by_org.limited_by) == (2, "org_cap")
        by_pool = await store.reserve_spawn_slots(
            spawn_req(count=10, org="org-b", pool_cap=5, org_cap=4), ids[2:], T0
        )
        assert (len(by_pool.workers), by_pool.limited_by) == (3, "pool_cap")
        exact = await store.reserve_spawn_slots(spawn_req(count=2, target=2), ["t-1", "t-2"], T0)
        assert (len(exact.workers), exact.limited_by) == (2, None)

    async def test_spawn_with_a_taken_id_fails_whole(self, store: Store, fleet: Fleet) -> None:
        gone = await fleet.retired()
        with pytest.raises(StoreError):
            await store.reserve_spawn_slots(spawn_req(count=2), ["fresh", gone.id], T0 + 50)
        assert await store.get_worker("fresh") is None
        assert await store.get_worker(gone.id) == gone

    # -- transition -----------------------------------------------------------------------

    async def test_transition_moves_state_and_sets_changes(
        self, store: Store, fleet: Fleet
    ) -> None:
        (w,) = await fleet.spawning()
        new = await store.transition(
            w.id,
            expect=S.SPAWNING,
            epoch=0,
            version=w.version,
            to=S.WARM,
            now=T0 + 100,
            changes={"endpoint": "http://x:1", "runtime_ref": {"pid": 7, "start": 1.5}},
        )
        assert new is not None
        assert (new.state, new.epoch, new.updated_at) == (S.WARM, 0, T0 + 100)
        assert (new.endpoint, dict(new.runtime_ref)) == ("http://x:1", {"pid": 7, "start": 1.5})
        assert (new.created_at, new.owner, new.pool) == (w.created_at, w.owner, w.pool)
        assert await store.get_worker(w.id) == new

    async def test_transition_with_a_stale_state_or_epoch_misses(
        self, store: Store, fleet: Fleet
    ) -> None:
        w = await fleet.warm()
        assert (
            await store.transition(
                w.id, expect=S.SPAWNING, epoch=w.epoch, version=w.version, to=S.WARM, now=T0 + 50
            )
            is None
        )
        assert (
            await store.transition(
                w.id,
                expect=S.WARM,
                epoch=w.epoch + 1,
                version=w.version,
                to=S.DRAINING,
                now=T0 + 50,
            )
            is None
        )
        assert (
            await store.transition(
                "nobody", expect=S.WARM, epoch=0, version=0, to=S.DRAINING, now=T0 + 50
            )
            is None
        )
        assert await store.get_worker(w.id) == w

    @pytest.mark.parametrize(("src", "dst"), ILLEGAL)
    async def test_illegal_moves_raise_before_touching_anything(
        self, store: Store, src: WorkerState, dst: WorkerState
    ) -> None:
        with pytest.raises(IllegalTransition):
            await store.transition("nobody", expect=src, epoch=0, version=0, to=dst, now=T0)
        assert await store.get_worker("nobody") is None

    @pytest.mark.parametrize(
        ("src", "dst"),
        [(S.WARM, S.HOT), (S.HOT, S.WARM), (S.SPAWNING, S.ACTIVATING), (S.DRAINING, S.WARM)],
    )
    async def test_illegal_moves_of_a_matching_row_raise_and_change_nothing(
        self, store: Store, fleet: Fleet, src: WorkerState, dst: WorkerState
    ) -> None:
        w = await fleet.in_state(src)
        with pytest.raises(IllegalTransition):
            await store.transition(
                w.id, expect=src, epoch=w.epoch, version=w.version, to=dst, now=T0 + 50
            )
        assert await store.get_worker(w.id) == w

    async def test_bump_epoch_fences_the_old_epoch(self, store: Store, fleet: Fleet) -> None:
        (w,) = await fleet.spawning(org="org-a")
        new = must(
            await store.transition(
                w.id,
                expect=S.SPAWNING,
                epoch=0,
                version=w.version,
                to=S.RESERVED,
                now=T0 + 50,
                bump_epoch=True,
            )
        )
        assert new.epoch == 1
        stale = await store.transition(
            w.id, expect=S.RESERVED, epoch=0, version=new.version, to=S.WARM, now=T0 + 51
        )
        assert stale is None
        assert await store.get_worker(w.id) == new

    @pytest.mark.parametrize("field", ["state", "epoch", "pool", "revision", "id", "created_at"])
    async def test_only_mutable_fields_may_change(
        self, store: Store, fleet: Fleet, field: str
    ) -> None:
        assert field not in MUTABLE_WORKER_FIELDS
        w = await fleet.warm()
        with pytest.raises(ValueError):
            await store.transition(
                w.id,
                expect=S.WARM,
                epoch=w.epoch,
                version=w.version,
                to=S.DRAINING,
                now=T0 + 50,
                changes={field: "x"},
            )
        with pytest.raises(ValueError):  # also when the row would not match
            await store.transition(
                w.id,
                expect=S.WARM,
                epoch=w.epoch + 9,
                version=w.version,
                to=S.WARM,
                now=T0 + 50,
                changes={field: "x"},
            )
        assert await store.get_worker(w.id) == w

    async def test_same_state_updates_fields_without_moving(
        self, store: Store, fleet: Fleet
    ) -> None:
        a = await fleet.activating("org-a")
        beat = must(
            await store.transition(
                a.id,
                expect=S.ACTIVATING,
                epoch=a.epoch,
                version=a.version,
                to=S.ACTIVATING,
                now=T0 + 60,
                changes={"heartbeat_at": T0 + 60},
            )
        )
        assert (beat.state, beat.epoch, beat.heartbeat_at, beat.org) == (
            S.ACTIVATING,
            a.epoch,
            T0 + 60,
            "org-a",
        )
        adopted = must(
            await store.transition(
                a.id,
                expect=S.ACTIVATING,
                epoch=beat.epoch,
                version=beat.version,
                to=S.ACTIVATING,
                now=T0 + 61,
                changes={"owner": "cp-b", "endpoint": "http://moved"},
            )
        )
        assert (adopted.owner, adopted.endpoint) == ("cp-b", "http://moved")
        assert await store.get_worker(a.id) == adopted

    async def test_every_write_bumps_the_version(self, store: Store, fleet: Fleet) -> None:
        (w,) = await fleet.spawning()
        assert w.version == 0
        warm = must(
            await store.transition(
                w.id, expect=S.SPAWNING, epoch=w.epoch, version=w.version, to=S.WARM, now=T0 + 50
            )
        )
        same = must(
            await store.transition(
                w.id,
                expect=S.WARM,
                epoch=warm.epoch,
                version=warm.version,
                to=S.WARM,
                now=T0 + 51,
                changes={"owner": "cp-b"},
            )
        )
        reserved = must(
            (
                await store.reserve(
                    w.id,
                    expect=S.WARM,
                    epoch=same.epoch,
                    version=same.version,
                    org="org-a",
                    org_cap=0,
                    owner="cp-b",
                    now=T0 + 52,
                )
            ).worker
        )
        assert [warm.version, same.version] == [1, 2]
        assert reserved.version > same.version
        assert must(await store.get_worker(w.id)).version == reserved.version

    async def test_a_write_from_a_stale_version_misses(self, store: Store, fleet: Fleet) -> None:
        """State and epoch as read, but the row was written since: every write misses."""
        w = await fleet.warm()
        beat = must(
            await store.transition(
                w.id,
                expect=S.WARM,
                epoch=w.epoch,
                version=w.version,
                to=S.WARM,
                now=T0 + 50,
                changes={"endpoint": "http://moved"},
            )
        )
        assert (beat.state, beat.epoch, beat.version) == (w.state, w.epoch, w.version + 1)
        for to in (S.DRAINING, S.WARM):
            assert (
                await store.transition(
                    w.id, expect=S.WARM, epoch=w.epoch, version=w.version, to=to, now=T0 + 51
                )
                is None
            )
        stale = await store.reserve(
            w.id,
            expect=S.WARM,
            epoch=w.epoch,
            version=w.version,
            org="org-a",
            org_cap=0,
            owner="cp-a",
            now=T0 + 51,
        )
        assert (stale.worker, stale.at_org_cap) == (None, False)
        assert await store.get_worker(w.id) == beat
        a = await fleet.activating("org-a")
        stamped = must(
            await store.transition(
                a.id,
                expect=S.ACTIVATING,
                epoch=a.epoch,
                version=a.version,
                to=S.ACTIVATING,
                now=T0 + 52,
                changes={"heartbeat_at": T0 + 52},
            )
        )
        claim = make_claim(a, "c-1", T0 + 53)
        assert (
            await store.bind(a.id, epoch=a.epoch, version=a.version, claim=claim, now=T0 + 53)
            is None
        )
        assert await store.get_claim("c-1") is None
        assert await store.get_worker(a.id) == stamped
        hot = await store.bind(
            a.id, epoch=stamped.epoch, version=stamped.version, claim=claim, now=T0 + 54
        )
        assert must(hot).state is S.HOT

    async def test_every_mutable_field_round_trips(self, store: Store, fleet: Fleet) -> None:
        w = await fleet.reserved("org-a")
        changes: dict[str, Any] = {
            "owner": "cp-z",
            "claim_id": "c-1",
            "endpoint": "http://e",
            "runtime_ref": {"pod": "w-1", "nested": {"n": [1, 2]}},
            "activated": True,
            "heartbeat_at": T0 + 70.25,
            "idle_since": T0 + 70.5,
            "ttl_s": 12.5,
            "reason": "why",
        }
        new = must(
            await store.transition(
                w.id,
                expect=S.RESERVED,
                epoch=w.epoch,
                version=w.version,
                to=S.ACTIVATING,
                now=T0 + 70,
                changes=changes,
            )
        )
        stored = must(await store.get_worker(w.id))
        assert stored == new
        for name, value in changes.items():
            assert getattr(stored, name) == value, name

    async def test_org_is_written_once(self, store: Store, fleet: Fleet) -> None:
        w = await fleet.reserved("org-a")
        with pytest.raises(IllegalTransition):
            await store.transition(
                w.id,
                expect=S.RESERVED,
                epoch=w.epoch,
                version=w.version,
                to=S.RESERVED,
                now=T0 + 50,
                changes={"org": "org-b"},
            )
        with pytest.raises(IllegalTransition):
            await store.transition(
                w.id,
                expect=S.RESERVED,
                epoch=w.epoch,
                version=w.version,
                to=S.ACTIVATING,
                now=T0 + 50,
                changes={"org": "org-b", "activated": True},
            )
        assert await store.get_worker(w.id) == w
        same = await store.transition(
            w.id,
            expect=S.RESERVED,
            epoch=w.epoch,
            version=w.version,
            to=S.RESERVED,
            now=T0 + 51,
            changes={"org": "org-a"},
        )
        assert must(same).org == "org-a"

    async def test_a_never_activated_worker_goes_back_to_warm_neutral(
        self, store: Store, fleet: Fleet
    ) -> None:
        w = await fleet.reserved("org-a")
        back = must(
            await store.transition(
                w.id,
                expect=S.RESERVED,
                epoch=w.epoch,
                version=w.version,
                to=S.WARM,
                now=T0 + 50,
                changes={"org": None},
            )
        )
        assert (back.state, back.org) == (S.WARM, None)
        assert await store.get_worker(w.id) == back

    async def test_a_warm_worker_never_keeps_an_org(self, store: Store, fleet: Fleet) -> None:
        w = await fleet.reserved("org-a")
        with pytest.raises(IllegalTransition):
            await store.transition(
                w.id, expect=S.RESERVED, epoch=w.epoch, version=w.version, to=S.WARM, now=T0 + 50
            )
        (cold,) = await fleet.spawning(org="org-b")
        with pytest.raises(IllegalTransition):
            await store.transition(
                cold.id,
                expect=S.SPAWNING,
                epoch=cold.epoch,
                version=cold.version,
                to=S.WARM,
                now=T0 + 50,
            )
        warm = await fleet.warm()
        with pytest.raises(IllegalTransition):
            await store.transition(
                warm.id,
                expect=S.WARM,
                epoch=warm.epoch,
                version=warm.version,
                to=S.WARM,
                now=T0 + 50,
                changes={"org": "org-a"},
            )
        assert await store.get_worker(w.id) == w
        assert await store.get_worker(cold.id) == cold
        assert await store.get_worker(warm.id) == warm
        neutral = await store.transition(
            cold.id,
            expect=S.SPAWNING,
            epoch=cold.epoch,
            version=cold.version,
            to=S.WARM,
            now=T0 + 51,
            changes={"org": None},
        )
        assert must(neutral).org is None

    async def test_an_activated_worker_never_becomes_neutral(
        self, store: Store, fleet: Fleet
    ) -> None:
        idle = await fleet.hot_idle("org-a")
        r = must(
            (
                await store.reserve(
                    idle.id,
                    expect=S.HOT_IDLE,
                    epoch=idle.epoch,
                    version=idle.version,
                    org="org-a",
                    org_cap=0,
                    owner="cp-a",
                    now=T0 + 50,
                )
            ).worker
        )
        with pytest.raises(IllegalTransition):
            await store.transition(
                r.id,
                expect=S.RESERVED,
                epoch=r.epoch,
                version=r.version,
                to=S.WARM,
                now=T0 + 51,
                changes={"org": None},
            )
        with pytest.raises(IllegalTransition):
            await store.transition(
                r.id,
                expect=S.RESERVED,
                epoch=r.epoch,
                version=r.version,
                to=S.RESERVED,
                now=T0 + 51,
                changes={"org": None},
            )
        with pytest.raises(IllegalTransition):
            await store.transition(
                r.id,
                expect=S.RESERVED,
                epoch=r.epoch,
                version=r.version,
                to=S.RESERVED,
                now=T0 + 51,
                changes={"activated": False},
            )
        assert await store.get_worker(r.id) == r
        back = await store.transition(
            r.id,
            expect=S.RESERVED,
            epoch=r.epoch,
            version=r.version,
            to=S.HOT_IDLE,
            now=T0 + 52,
            changes={"idle_since": T0 + 52},
        )
        assert (must(back).state, must(back).org) == (S.HOT_IDLE, "org-a")

    async def test_a_reserved_worker_never_activated_cannot_park_as_hot_idle(
        self, store: Store, fleet: Fleet
    ) -> None:
        w = await fleet.reserved("org-a")
        with pytest.raises(IllegalTransition):
            await store.transition(
                w.id,
                expect=S.RESERVED,
                epoch=w.epoch,
                version=w.version,
                to=S.HOT_IDLE,
                now=T0 + 50,
            )
        assert await store.get_worker(w.id) == w

    async def test_entering_activating_marks_the_worker_activated(
        self, store: Store, fleet: Fleet
    ) -> None:
        w = await fleet.reserved("org-a")
        a = must(
            await store.transition(
                w.id,
                expect=S.RESERVED,
                epoch=w.epoch,
                version=w.version,
                to=S.ACTIVATING,
                now=T0 + 50,
            )
        )
        assert a.activated
        assert await store.get_worker(w.id) == a
        w2 = await fleet.reserved("org-a")
        with pytest.raises(IllegalTransition):
            await store.transition(
                w2.id,
                expect=S.RESERVED,
                epoch=w2.epoch,
                version=w2.version,
                to=S.ACTIVATING,
                now=T0 + 50,
                changes={"activated": False},
            )
        assert await store.get_worker(w2.id) == w2

    async def test_draining_retires_with_a_reason(self, store: Store, fleet: Fleet) -> None:
        d = await fleet.draining()
        r = must(
            await store.transition(
                d.id,
                expect=S.DRAINING,
                epoch=d.epoch,
                version=d.version,
                to=S.RETIRED,
                now=T0 + 50,
                changes={"reason": "ttl"},
            )
        )
        assert (r.state, r.reason) == (S.RETIRED, "ttl")
        assert await store.get_worker(d.id) == r

    @pytest.mark.parametrize("to", list(S))
    async def test_a_retired_row_is_never_written_again(
        self, store: Store, fleet: Fleet, to: WorkerState
    ) -> None:
        gone = await fleet.retired(org="org-a")
        with pytest.raises(IllegalTransition):
            await store.transition(
                gone.id,
                expect=S.RETIRED,
                epoch=gone.epoch,
                version=gone.version,
                to=to,
                now=T0 + 50,
                changes={"reason": "again"},
            )
        missed = await store.transition(
            gone.id,
            expect=S.WARM,
            epoch=gone.epoch,
            version=gone.version,
            to=S.DRAINING,
            now=T0 + 50,
        )
        assert missed is None
        assert await store.get_worker(gone.id) == gone

    async def test_a_retired_row_is_never_reserved_bound_or_reused(
        self, store: Store, fleet: Fleet
    ) -> None:
        w, claim = await fleet.hot("org-a")
        gone = must(
            await store.transition(
                w.id,
                expect=S.HOT,
                epoch=w.epoch,
                version=w.version,
                to=S.RETIRED,
                now=T0 + 50,
                changes={"reason": "lost"},
            )
        )
        for expect in (S.WARM, S.HOT_IDLE):
            result = await store.reserve(
                gone.id,
                expect=expect,
                epoch=gone.epoch,
                version=gone.version,
                org="org-a",
                org_cap=0,
                owner="cp-a",
                now=T0 + 51,
            )
            assert result.worker is None
            any_ = await store.reserve_any(
                "p", "r1", expect=expect, org="org-a", org_cap=0, owner="cp-a", now=T0 + 51
            )
            assert any_.worker is None
        rebind = make_claim(gone, "c-2", T0 + 52)
        assert (
            await store.bind(
                gone.id, epoch=gone.epoch, version=gone.version, claim=rebind, now=T0 + 52
            )
            is None
        )
        ended = await store.end_claim(
            claim.id, state=ClaimState.RELEASED, worker_to=S.HOT_IDLE, now=T0 + 53
        )
        assert ended is None
        assert await store.get_claim("c-2") is None
        assert await store.get_worker(gone.id) == gone

    # -- reserve --------------------------------------------------------------------------

    async def test_reserve_warm_sets_org_owner_and_bumps_epoch(
        self, store: Store, fleet: Fleet
    ) -> None:
        w = await fleet.warm()
        result = await store.reserve(
            w.id,
            expect=S.WARM,
            epoch=w.epoch,
            version=w.version,
            org="org-a",
            org_cap=2,
            owner="cp-b",
            now=T0 + 50,
        )
        r = must(result.worker)
        assert not result.at_org_cap and not result.parked
        assert (r.state, r.org, r.owner, r.epoch) == (S.RESERVED, "org-a", "cp-b", w.epoch + 1)
        assert (r.heartbeat_at, r.updated_at, r.endpoint) == (T0 + 50, T0 + 50, w.endpoint)
        assert await store.get_worker(w.id) == r

    async def test_a_write_that_changes_the_owner_stamps_when_and_keeps_the_time_before(
        self, store: Store, fleet: Fleet
    ) -> None:
        """`taken_at` says when the row's owner last changed and `prior_taken_at` the
        `taken_at` before (the ledger places a worker another replica took by them): a
        reservation or a move to another owner stamps them, the same owner's keeps them;
        the store keeps every change (`first_takes`)."""
        w = await fleet.warm()
        assert (w.taken_at, w.prior_taken_at) == (None, None)
        reserved = await store.reserve(
            w.id,
            expect=S.WARM,
            epoch=w.epoch,
            version=w.version,
            org="org-a",
            org_cap=0,
            owner="cp-b",
            now=T0 + 50,
        )
        taken = must(reserved.worker)
        assert (taken.taken_at, taken.prior_taken_at) == (T0 + 50, None)
        hot_idle = await fleet.hot_idle("org-a")
        # The same owner reserving its own parked worker keeps both.
        again = must(
            (
                await store.reserve_any(
                    "p", "r1", expect=S.HOT_IDLE, org="org-a", org_cap=0, owner="cp-a", now=T0 + 60
                )
            ).worker
        )
        assert again.id == hot_idle.id
        assert (again.taken_at, again.prior_taken_at) == (None, None)

        async def stay(worker: Worker, now: float, **changes: Any) -> Worker:
            """A move of `worker` to its own state with `changes` (an adoption, a renewal)."""
            return must(
                await store.transition(
                    worker.id,
                    expect=worker.state,
                    epoch=worker.epoch,
                    version=worker.version,
                    to=worker.state,
                    now=now,
                    changes=changes,
                )
            )

        # Another owner's move (an adoption) stamps it; taking it back keeps the time before.
        adopted = await stay(taken, T0 + 70, owner="cp-c")
        assert (adopted.taken_at, adopted.prior_taken_at) == (T0 + 70, T0 + 50)
        kept = await stay(adopted, T0 + 80, owner="cp-c", heartbeat_at=T0 + 80)
        assert (kept.taken_at, kept.prior_taken_at) == (T0 + 70, T0 + 50)
        assert await store.get_worker(w.id) == kept
        # Every change is kept, however many the row's two stamps no longer show: the
        # first after a time, for the ledger of the replica the worker left by then (one
        # worker may be asked for twice, from two times).
        back = await stay(kept, T0 + 90, owner="cp-b")
        assert (back.taken_at, back.prior_taken_at) == (T0 + 90, T0 + 70)
        since = [(w.id, T0), (hot_idle.id, T0), ("w-none", T0), (w.id, T0 + 50)]
        assert await store.first_takes(since) == [T0 + 50, None, None, T0 + 70]
        assert await store.first_takes([(w.id, T0 + 89.5)]) == [T0 + 90]
        assert await store.first_takes([(w.id, T0 + 90)]) == [None]
        assert await store.first_takes([]) == []
        # They are history: purged with it.
        await store.purge(before=T0 + 80)
        assert await store.first_takes([(w.id, T0)]) == [T0 + 90]

    async def test_reserve_may_move_on_to_activating_in_the_same_write(
        self, store: Store, fleet: Fleet
    ) -> None:
        """`activate` is a store's option: the result is activating (activated, stamped,
        epoch bumped once) or reserved, and the row says the same."""
        warm = await fleet.warm()
        idle = await fleet.hot_idle("org-a")
        by_id = await store.reserve(
            warm.id,
            expect=S.WARM,
            epoch=warm.epoch,
            version=warm.version,
            org="org-a",
            org_cap=0,
            owner="cp-b",
            now=T0 + 50,
            activate=True,
        )
        picked = await store.reserve_any(
            idle.pool,
            idle.revision,
            expect=S.HOT_IDLE,
            org="org-a",
            org_cap=0,
            owner="cp-b",
            now=T0 + 51,
            activate=True,
        )
        for before, result, now in ((warm, by_id, T0 + 50), (idle, picked, T0 + 51)):
            w = must(result.worker)
            assert w.state in (S.RESERVED, S.ACTIVATING)
            assert (w.id, w.org, w.owner, w.epoch) == (before.id, "org-a", "cp-b", before.epoch + 1)
            assert (w.heartbeat_at, w.updated_at) == (now, now)
            assert w.activated is (w.state is S.ACTIVATING or before.activated)
            assert await store.get_worker(w.id) == w

    async def test_reserve_with_a_stale_read_misses(self, store: Store, fleet: Fleet) -> None:
        w = await fleet.warm()
        for expect, epoch in ((S.WARM, w.epoch + 1), (S.HOT_IDLE, w.epoch)):
            result = await store.reserve(
                w.id,
                expect=expect,
                epoch=epoch,
                version=w.version,
                org="org-a",
                org_cap=0,
                owner="cp-a",
                now=T0 + 50,
            )
            assert (result.worker, result.at_org_cap) == (None, False)
        result = await store.reserve(
            "nobody",
            expect=S.WARM,
            epoch=0,
            version=0,
            org="org-a",
            org_cap=1,
            owner="cp-a",
            now=T0 + 50,
        )
        assert (result.worker, result.at_org_cap) == (None, False)
        assert await store.get_worker(w.id) == w

    @pytest.mark.parametrize(
        "expect", [S.SPAWNING, S.RESERVED, S.ACTIVATING, S.HOT, S.DRAINING, S.RETIRED]
    )
    async def test_only_warm_and_hot_idle_are_reservable(
        self, store: Store, fleet: Fleet, expect: WorkerState
    ) -> None:
        w = await fleet.in_state(expect)
        with pytest.raises(ValueError):
            await store.reserve(
                w.id,
                expect=expect,
                epoch=w.epoch,
                version=w.version,
                org="org-a",
                org_cap=0,
                owner="cp-a",
                now=T0 + 50,
            )
        with pytest.raises(ValueError):
            await store.reserve_any(
                "p", "r1", expect=expect, org="org-a", org_cap=0, owner="cp-a", now=T0 + 50
            )
        assert await store.get_worker(w.id) == w

    async def test_hot_idle_is_reserved_only_by_its_org(self, store: Store, fleet: Fleet) -> None:
        idle = await fleet.hot_idle("org-a")
        other = await store.reserve(
            idle.id,
            expect=S.HOT_IDLE,
            epoch=idle.epoch,
            version=idle.version,
            org="org-b",
            org_cap=0,
            owner="cp-a",
            now=T0 + 50,
        )
        assert (other.worker, other.at_org_cap) == (None, False)
        assert await store.get_worker(idle.id) == idle
        own = await store.reserve(
            idle.id,
            expect=S.HOT_IDLE,
            epoch=idle.epoch,
            version=idle.version,
            org="org-a",
            org_cap=0,
            owner="cp-b",
            now=T0 + 51,
        )
        r = must(own.worker)
        assert own.parked
        assert (r.state, r.org, r.owner, r.epoch, r.activated) == (
            S.RESERVED,
            "org-a",
            "cp-b",
            idle.epoch + 1,
            True,
        )

    async def test_reserve_warm_honours_the_org_cap(self, store: Store, fleet: Fleet) -> None:
        await fleet.reserved("org-a")
        await fleet.hot_idle("org-a")
        await fleet.retired(org="org-a")  # not live: not counted
        await fleet.reserved("org-a", pool="q")  # another pool: not counted
        w = await fleet.warm()
        capped = await store.reserve(
            w.id,
            expect=S.WARM,
            epoch=w.epoch,
            version=w.version,
            org="org-a",
            org_cap=2,
            owner="cp-a",
            now=T0 + 50,
        )
        assert (capped.worker, capped.at_org_cap) == (None, True)
        assert await store.get_worker(w.id) == w
        other = await store.reserve(
            w.id,
            expect=S.WARM,
            epoch=w.epoch,
            version=w.version,
            org="org-b",
            org_cap=2,
            owner="cp-a",
            now=T0 + 51,
        )
        assert must(other.worker).org == "org-b"
        w2 = await fleet.warm()
        roomier = await store.reserve(
            w2.id,
            expect=S.WARM,
            epoch=w2.epoch,
            version=w2.version,
            org="org-a",
            org_cap=3,
            owner="cp-a",
            now=T0 + 52,
        )
        assert must(roomier.worker).org == "org-a"

    async def test_zero_org_cap_is_unbounded(self, store: Store, fleet: Fleet) -> None:
        for _ in range(3):
            await fleet.reserved("org-a")
        w = await fleet.warm()
        result = await store.reserve(
            w.id,
            expect=S.WARM,
            epoch=w.epoch,
            version=w.version,
            org="org-a",
            org_cap=0,
            owner="cp-a",
            now=T0 + 50,
        )
        assert must(result.worker).state is S.RESERVED

    async def test_an_org_at_its_cap_reuses_its_own_hot_idle(
        self, store: Store, fleet: Fleet
    ) -> None:
        await fleet.reserved("org-a")
        idle = await fleet.hot_idle("org-a")
        result = await store.reserve(
            idle.id,
            expect=S.HOT_IDLE,
            epoch=idle.epoch,
            version=idle.version,
            org="org-a",
            org_cap=2,
            owner="cp-a",
            now=T0 + 50,
        )
        assert must(result.worker).state is S.RESERVED
        any_idle = await fleet.hot_idle("org-a")
        picked = await store.reserve_any(
            "p", "r1", expect=S.HOT_IDLE, org="org-a", org_cap=1, owner="cp-a", now=T0 + 51
        )
        assert must(picked.worker).id == any_idle.id

    # -- reserve_any ----------------------------------------------------------------------

    async def test_reserve_any_picks_only_the_pool_revision_and_state(
        self, store: Store, fleet: Fleet
    ) -> None:
        decoys = [
            await fleet.warm(pool="q"),
            await fleet.warm(revision="r2"),
            (await fleet.spawning())[0],
            await fleet.reserved("org-b"),
            await fleet.hot_idle("org-b"),
        ]
        nothing = await store.reserve_any(
            "p", "r1", expect=S.WARM, org="org-a", org_cap=0, owner="cp-b", now=T0 + 50
        )
        assert (nothing.worker, nothing.at_org_cap) == (None, False)
        target = await fleet.warm()
        got = await store.reserve_any(
            "p", "r1", expect=S.WARM, org="org-a", org_cap=0, owner="cp-b", now=T0 + 51
        )
        r = must(got.worker)
        assert r.id == target.id
        assert (r.state, r.org, r.owner, r.epoch) == (S.RESERVED, "org-a", "cp-b", target.epoch + 1)
        assert await store.get_worker(r.id) == r
        for d in decoys:
            assert await store.get_worker(d.id) == d

    async def test_reserve_any_hot_idle_only_for_its_org(self, store: Store, fleet: Fleet) -> None:
        b = await fleet.hot_idle("org-b")
        await fleet.warm()
        miss = await store.reserve_any(
            "p", "r1", expect=S.HOT_IDLE, org="org-a", org_cap=0, owner="cp-a", now=T0 + 50
        )
        assert miss.worker is None
        assert await store.get_worker(b.id) == b
        a = await fleet.hot_idle("org-a")
        hit = await store.reserve_any(
            "p", "r1", expect=S.HOT_IDLE, org="org-a", org_cap=0, owner="cp-a", now=T0 + 51
        )
        assert must(hit.worker).id == a.id and hit.parked
        assert must(hit.worker).epoch == a.epoch + 1

    async def test_reserve_any_takes_each_worker_once(self, store: Store, fleet: Fleet) -> None:
        warm = {(await fleet.warm()).id for _ in range(3)}
        taken = set()
        for i in range(3):
            r = await store.reserve_any(
                "p", "r1", expect=S.WARM, org=f"org-{i}", org_cap=0, owner="cp-a", now=T0 + 50 + i
            )
            taken.add(must(r.worker).id)
        assert taken == warm
        empty = await store.reserve_any(
            "p", "r1", expect=S.WARM, org="org-9", org_cap=0, owner="cp-a", now=T0 + 60
        )
        assert empty.worker is None

    async def test_reserve_any_honours_the_org_cap_for_warm(
        self, store: Store, fleet: Fleet
    ) -> None:
        await fleet.reserved("org-a")
        w = await fleet.warm()
        capped = await store.reserve_any(
            "p", "r1", expect=S.WARM, org="org-a", org_cap=2, owner="cp-a", now=T0 + 50
        )
        assert must(capped.worker).id == w.id
        w2 = await fleet.warm()
        full = await store.reserve_any(
            "p", "r1", expect=S.WARM, org="org-a", org_cap=2, owner="cp-a", now=T0 + 51
        )
        assert (full.worker, full.at_org_cap) == (None, True)
        assert await store.get_worker(w2.id) == w2

    # -- claims ---------------------------------------------------------------------------

    async def test_bind_makes_the_worker_hot_and_inserts_the_claim(
        self, store: Store, fleet: Fleet
    ) -> None:
        a = await fleet.activating("org-a")
        claim = make_claim(a, "c-1", T0 + 50)
        hot = must(
            await store.bind(a.id, epoch=a.epoch, version=a.version, claim=claim, now=T0 + 50)
        )
        assert (hot.state, hot.claim_id, hot.epoch, hot.org, hot.idle_since) == (
            S.HOT,
            "c-1",
            a.epoch,
            "org-a",
            None,
        )
        assert await store.get_worker(a.id) == hot
        assert await store.get_claim("c-1") == stored(claim)

    async def test_a_claim_is_kept_with_the_digest_of_its_token_only(
        self, store: Store, fleet: Fleet
    ) -> None:
        a = await fleet.activating("org-a")
        claim = make_claim(a, "c-1", T0 + 50)
        await store.bind(a.id, epoch=a.epoch, version=a.version, claim=claim, now=T0 + 50)
        kept = must(await store.get_claim("c-1"))
        assert kept.token == token_digest(claim.token) != claim.token
        assert kept.token == "sha256:" + hashlib.sha256(claim.token.encode()).hexdigest()
        renewed = must(await store.renew_claim("c-1", expires_at=T0 + 90, now=T0 + 60))
        assert renewed.token == kept.token  # written again, not hashed twice

    async def test_bind_that_misses_inserts_nothing(self, store: Store, fleet: Fleet) -> None:
        a = await fleet.activating("org-a")
        r = await fleet.reserved("org-a")
        stale = make_claim(a, "c-1", T0 + 50).evolve(worker_epoch=a.epoch + 1)
        assert (
            await store.bind(a.id, epoch=a.epoch + 1, version=a.version, claim=stale, now=T0 + 50)
            is None
        )
        foreign = make_claim(a, "c-2", T0 + 50, org="org-b")
        assert (
            await store.bind(a.id, epoch=a.epoch, version=a.version, claim=foreign, now=T0 + 50)
            is None
        )
        early = make_claim(r, "c-3", T0 + 50)
        assert (
            await store.bind(r.id, epoch=r.epoch, version=r.version, claim=early, now=T0 + 50)
            is None
        )
        assert (
            await store.bind(
                "nobody",
                epoch=r.epoch,
                version=r.version,
                claim=early.evolve(worker_id="nobody"),
                now=T0,
            )
            is None
        )
        for cid in ("c-1", "c-2", "c-3"):
            assert await store.get_claim(cid) is None
        assert await store.get_worker(a.id) == a
        assert await store.get_worker(r.id) == r

    async def test_bind_refuses_a_claim_for_another_worker_or_epoch(
        self, store: Store, fleet: Fleet
    ) -> None:
        a = await fleet.activating("org-a")
        for claim in (
            make_claim(a, "c-1", T0 + 50).evolve(worker_id="someone-else"),
            make_claim(a, "c-1", T0 + 50).evolve(worker_epoch=a.epoch + 1),
            make_claim(a, "c-1", T0 + 50).evolve(state=ClaimState.RELEASED),
        ):
            with pytest.raises(ValueError):
                await store.bind(a.id, epoch=a.epoch, version=a.version, claim=claim, now=T0 + 50)
        assert await store.get_claim("c-1") is None
        assert await store.get_worker(a.id) == a

    async def test_bind_with_a_taken_claim_id_changes_nothing(
        self, store: Store, fleet: Fleet
    ) -> None:
        _, claim = await fleet.hot("org-a")
        a = await fleet.activating("org-a")
        dup = make_claim(a, claim.id, T0 + 50)
        with pytest.raises(StoreError):
            await store.bind(a.id, epoch=a.epoch, version=a.version, claim=dup, now=T0 + 50)
        assert await store.get_worker(a.id) == a  # still activating: the worker write rolled back
        assert await store.get_claim(claim.id) == stored(claim)

    async def test_an_orgs_idempotency_key_names_one_claim(
        self, store: Store, fleet: Fleet
    ) -> None:
        a = await fleet.activating("org-a")
        keyed = make_claim(a, "c-1", T0 + 50).evolve(
            idempotency_key="sha256:k1", request_digest="sha256:r1", sealed_token="v1:00"
        )
        await store.bind(a.id, epoch=a.epoch, version=a.version, claim=keyed, now=T0 + 50)
        assert await store.claim_by_key("org-a", "sha256:k1") == stored(keyed)
        assert await store.claim_by_key("org-b", "sha256:k1") is None
        assert await store.claim_by_key("org-a", "sha256:k2") is None
        # The same key for a second claim of the org: refused, and nothing changes.
        b = await fleet.activating("org-a")
        again = make_claim(b, "c-2", T0 + 60).evolve(idempotency_key="sha256:k1")
        with pytest.raises(ClaimKeyTaken):
            await store.bind(b.id, epoch=b.epoch, version=b.version, claim=again, now=T0 + 60)
        assert await store.get_worker(b.id) == b  # still activating: the move rolled back
        assert await store.get_claim("c-2") is None
        # Another org may use the same key; claims without a key never clash.
        c = await fleet.activating("org-b")
        other = make_claim(c, "c-3", T0 + 70).evolve(idempotency_key="sha256:k1")
        assert await store.bind(c.id, epoch=c.epoch, version=c.version, claim=other, now=T0 + 70)
        for n in (4, 5):
            d = await fleet.activating("org-a")
            plain = make_claim(d, f"c-{n}", T0 + 80)
            assert await store.bind(
                d.id, epoch=d.epoch, version=d.version, claim=plain, now=T0 + 80
            )
        assert await store.claim_by_key("org-b", "sha256:k1") == stored(other)

    async def test_release_parks_the_worker_hot_idle(self, store: Store, fleet: Fleet) -> None:
        hot, claim = await fleet.hot("org-a")
        result = must(
            await store.end_claim(
                claim.id,
                state=ClaimState.RELEASED,
                worker_to=S.HOT_IDLE,
                now=T0 + 50,
                reason="client",
                worker_changes={"idle_since": T0 + 50, "ttl_s": 90.0},
            )
        )
        ended, worker = result
        assert (ended.state, ended.ended_at, ended.updated_at, ended.reason) == (
            ClaimState.RELEASED,
            T0 + 50,
            T0 + 50,
            "client",
        )
        assert (worker.state, worker.claim_id, worker.idle_since, worker.ttl_s) == (
            S.HOT_IDLE,
            None,
            T0 + 50,
            90.0,
        )
        assert (worker.org, worker.epoch) == (hot.org, hot.epoch)
        assert await store.get_claim(claim.id) == ended
        assert await store.get_worker(hot.id) == worker

    async def test_expiry_drains_the_worker(self, store: Store, fleet: Fleet) -> None:
        hot, claim = await fleet.hot("org-a")
        ended, worker = must(
            await store.end_claim(
                claim.id,
                state=ClaimState.EXPIRED,
                worker_to=S.DRAINING,
                now=T0 + 50,
                reason="lease_expired",
                worker_changes={"reason": "lease_expired"},
            )
        )
        assert (ended.state, ended.reason) == (ClaimState.EXPIRED, "lease_expired")
        assert (worker.state, worker.reason, worker.claim_id) == (S.DRAINING, "lease_expired", None)
        assert await store.get_worker(hot.id) == worker

    async def test_a_claim_ends_once(self, store: Store, fleet: Fleet) -> None:
        _, claim = await fleet.hot("org-a")
        first = must(
            await store.end_claim(
                claim.id, state=ClaimState.RELEASED, worker_to=S.HOT_IDLE, now=T0 + 50
            )
        )
        again = await store.end_claim(
            claim.id, state=ClaimState.EXPIRED, worker_to=S.DRAINING, now=T0 + 51
        )
        assert again is None
        assert await store.get_claim(claim.id) == first[0]
        assert await store.get_worker(claim.worker_id) == first[1]
        assert (
            await store.end_claim("nobody", state=ClaimState.RELEASED, worker_to=S.HOT_IDLE, now=T0)
            is None
        )

    async def test_end_claim_misses_when_the_worker_moved_on(
        self, store: Store, fleet: Fleet
    ) -> None:
        hot, claim = await fleet.hot("org-a")
        bumped = must(
            await store.transition(
                hot.id,
                expect=S.HOT,
                epoch=hot.epoch,
                version=hot.version,
                to=S.HOT,
                now=T0 + 50,
                bump_epoch=True,
            )
        )
        missed = await store.end_claim(
            claim.id, state=ClaimState.RELEASED, worker_to=S.HOT_IDLE, now=T0 + 51
        )
        assert missed is None
        assert await store.get_claim(claim.id) == stored(claim)
        assert await store.get_worker(hot.id) == bumped
        hot2, claim2 = await fleet.hot("org-b")
        drained = must(
            await store.transition(
                hot2.id,
                expect=S.HOT,
                epoch=hot2.epoch,
                version=hot2.version,
                to=S.DRAINING,
                now=T0 + 52,
                changes={"reason": "lost"},
            )
        )
        assert (
            await store.end_claim(
                claim2.id, state=ClaimState.RELEASED, worker_to=S.HOT_IDLE, now=T0 + 53
            )
            is None
        )
        assert await store.get_claim(claim2.id) == stored(claim2)
        assert await store.get_worker(hot2.id) == drained

    async def test_end_claim_rejects_bad_arguments_and_changes_nothing(
        self, store: Store, fleet: Fleet
    ) -> None:
        hot, claim = await fleet.hot("org-a")
        with pytest.raises(ValueError):
            await store.end_claim(
                claim.id, state=ClaimState.BOUND, worker_to=S.HOT_IDLE, now=T0 + 50
            )
        with pytest.raises(IllegalTransition):
            await store.end_claim(
                claim.id, state=ClaimState.RELEASED, worker_to=S.WARM, now=T0 + 50
            )
        with pytest.raises(ValueError):
            await store.end_claim(
                claim.id,
                state=ClaimState.RELEASED,
                worker_to=S.HOT_IDLE,
                now=T0 + 50,
                worker_changes={"pool": "q"},
            )
        with pytest.raises(IllegalTransition):
            await store.end_claim(
                claim.id,
                state=ClaimState.RELEASED,
                worker_to=S.HOT_IDLE,
                now=T0 + 50,
                worker_changes={"org": "org-b"},
            )
        assert await store.get_claim(claim.id) == stored(claim)
        assert await store.get_worker(hot.id) == hot

    async def test_a_claim_fails_only_while_bound(self, store: Store, fleet: Fleet) -> None:
        # A claim fails in the write that drains its worker (never one alone, I6).
        hot, claim = await fleet.hot("org-a")
        failed, drained = must(
            await store.end_claim(
                claim.id,
                state=ClaimState.FAILED,
                worker_to=S.DRAINING,
                now=T0 + 50,
                reason="lost",
                worker_changes={"reason": "lost"},
            )
        )
        assert (failed.state, failed.reason, failed.ended_at, failed.updated_at) == (
            ClaimState.FAILED,
            "lost",
            T0 + 50,
            T0 + 50,
        )
        assert await store.get_claim(claim.id) == failed
        again = await store.end_claim(
            claim.id, state=ClaimState.FAILED, worker_to=S.DRAINING, now=T0 + 51, reason="again"
        )
        assert again is None
        assert await store.get_claim(claim.id) == failed
        assert (
            await store.end_claim(
                "nobody", state=ClaimState.FAILED, worker_to=S.DRAINING, now=T0, reason="x"
            )
            is None
        )
        assert (drained.state, drained.reason, drained.claim_id) == (S.DRAINING, "lost", None)
        assert await store.get_worker(hot.id) == drained

    async def test_renew_claim_only_while_bound(self, store: Store, fleet: Fleet) -> None:
        _, claim = await fleet.hot("org-a")
        renewed = must(await store.renew_claim(claim.id, expires_at=T0 + 500, now=T0 + 50))
        assert (renewed.expires_at, renewed.updated_at, renewed.state) == (
            T0 + 500,
            T0 + 50,
            ClaimState.BOUND,
        )
        assert await store.get_claim(claim.id) == renewed
        ended = must(
            await store.end_claim(
                claim.id, state=ClaimState.RELEASED, worker_to=S.HOT_IDLE, now=T0 + 60
            )
        )[0]
        assert await store.renew_claim(claim.id, expires_at=T0 + 900, now=T0 + 70) is None
        assert await store.get_claim(claim.id) == ended
        assert await store.renew_claim("nobody", expires_at=T0, now=T0) is None
        assert await store.get_claim("nobody") is None

    async def test_list_claims_filters_and_orders_oldest_first(
        self, store: Store, fleet: Fleet
    ) -> None:
        _, c1 = await fleet.hot("org-a", lease_s=10.0, owner="cp-a")
        _, c2 = await fleet.hot("org-b", lease_s=100.0, owner="cp-b")
        _, c3 = await fleet.hot("org-a", lease_s=10.0, owner="cp-b")
        _, c4 = await fleet.hot("org-c", lease_s=10.0, owner="cp-a")
        ended = must(
            await store.end_claim(
                c4.id, state=ClaimState.RELEASED, worker_to=S.HOT_IDLE, now=T0 + 90
            )
        )[0]

        async def ids(**kw: Any) -> list[str]:
            return [c.id for c in await store.list_claims(**kw)]

        assert await store.list_claims() == [stored(c) for c in (c1, c2, c3, ended)]
        assert await ids(states=[ClaimState.BOUND]) == [c1.id, c2.id, c3.id]
        assert await ids(states=[ClaimState.RELEASED, ClaimState.FAILED]) == [c4.id]
        assert await ids(states=[]) == []
        assert await ids(owner="cp-b") == [c2.id, c3.id]
        # expires_before is inclusive: a lease is over at its expiry instant
        assert await ids(expires_before=c3.expires_at) == [c1.id, c3.id]
        assert await ids(expires_before=c4.expires_at) == [c1.id, c3.id, c4.id]
        assert await ids(expires_before=c1.expires_at - 0.5) == []
        assert await ids(states=[ClaimState.BOUND], expires_before=c3.expires_at) == [c1.id, c3.id]
        assert await ids(states=[ClaimState.BOUND], owner="cp-a", expires_before=T0 + 999) == [
            c1.id
        ]
        assert await ids(limit=2) == [c1.id, c2.id]
        assert await ids(states=[ClaimState.BOUND], limit=1, owner="cp-b") == [c2.id]

    # -- listing and counting ---------------------------------------------------------------

    async def test_list_workers_filters_and_orders_oldest_first(
        self, store: Store, fleet: Fleet
    ) -> None:
        w1 = await fleet.warm()
        r1 = await fleet.reserved("org-a")
        q1 = await fleet.warm(pool="q", owner="cp-b")
        i1 = await fleet.hot_idle("org-a")
        g1 = await fleet.retired()
        (s1,) = await fleet.spawning(owner="cp-b", org="org-b")

        async def ids(**kw: Any) -> list[str]:
            return [w.id for w in await store.list_workers(**kw)]

        everything = await store.list_workers()
        assert everything == [w1, r1, q1, i1, g1, s1]
        assert await ids(pool="p") == [w1.id, r1.id, i1.id, g1.id, s1.id]
        assert await ids(states=[S.WARM]) == [w1.id, q1.id]
        assert await ids(states=[S.RETIRED]) == [g1.id]
        assert await ids(states=[]) == []
        assert await ids(states=[S.RESERVED, S.HOT_IDLE, S.SPAWNING]) == [r1.id, i1.id, s1.id]
        assert await ids(org="org-a") == [r1.id, i1.id]
        assert await ids(owner="cp-b") == [q1.id, s1.id]
        assert await ids(not_owners=["cp-b"]) == [w1.id, r1.id, i1.id, g1.id]
        assert await ids(not_owners=["cp-b", w1.owner]) == [
            w.id for w in everything if w.owner not in ("cp-b", w1.owner)
        ]
        assert await ids(not_owners=[]) == [w.id for w in everything]
        assert await ids(states=[S.WARM], not_owners=["cp-b"]) == [w1.id]
        assert await ids(pool="p", owner="cp-b", states=[S.SPAWNING], org="org-b") == [s1.id]
        assert await ids(pool="q", org="org-a") == []
        assert await ids(limit=2) == [w1.id, r1.id]
        assert await ids(states=[S.WARM], limit=1) == [w1.id]
        assert await store.get_worker("nobody") is None

    async def test_listings_page_after_a_rows_created_at_and_id(
        self, store: Store, fleet: Fleet
    ) -> None:
        # Three spawn slots of one request share their created_at: the id breaks the tie.
        same = await fleet.spawning(3)
        w = await fleet.warm()
        g = await fleet.retired()
        everything = await store.list_workers()
        assert [x.id for x in everything] == [*(x.id for x in same), w.id, g.id]

        async def page(after: Worker | None, **kw: Any) -> list[str]:
            cursor = (after.created_at, after.id) if after is not None else None
            return [x.id for x in await store.list_workers(after=cursor, limit=2, **kw)]

        assert await page(None) == [same[0].id, same[1].id]
        assert await page(same[1]) == [same[2].id, w.id]
        assert await page(w) == [g.id]
        assert await page(g) == []
        # The live rows (SQLite answers them from memory) page the same way.
        assert await page(same[0], states=LIVE) == [same[1].id, same[2].id]
        assert await page(same[2], states=LIVE) == [w.id]
        # A cursor names a place in the order, whether or not its row is still there.
        assert await page(None, states=[S.RETIRED]) == [g.id]
        assert [x.id for x in await store.list_workers(after=(w.created_at + 0.5, ""))] == [g.id]

        _, c1 = await fleet.hot("org-a")
        _, c2 = await fleet.hot("org-b")
        _, c3 = await fleet.hot("org-c")
        claims = await store.list_claims(states=[ClaimState.BOUND], after=(c1.created_at, c1.id))
        assert [c.id for c in claims] == [c2.id, c3.id]
        assert [c.id for c in await store.list_claims(after=(c3.created_at, c3.id))] == []
        assert [c.id for c in await store.list_claims(after=(c1.created_at, c1.id), limit=1)] == [
            c2.id
        ]

    async def test_count_workers_groups_live_workers(self, store: Store, fleet: Fleet) -> None:
        await fleet.warm()
        await fleet.warm()
        await fleet.reserved("org-a")
        await fleet.spawning()
        await fleet.spawning(org="org-b")
        await fleet.retired()
        await fleet.warm(revision="r2")
        await fleet.hot("org-a", pool="q")
        await fleet.hot_idle("org-c", pool="q")
        expected = {
            StateCount("p", "r1", S.WARM, False, 2),
            StateCount("p", "r1", S.RESERVED, True, 1),
            StateCount("p", "r1", S.SPAWNING, False, 1),
            StateCount("p", "r1", S.SPAWNING, True, 1),
            StateCount("p", "r2", S.WARM, False, 1),
            StateCount("q", "r1", S.HOT, True, 1),
            StateCount("q", "r1", S.HOT_IDLE, True, 1),
        }
        counts = await store.count_workers()
        assert len(counts) == len(expected)
        assert set(counts) == expected

    # -- replicas -------------------------------------------------------------------------

    async def test_register_and_list_instances(self, store: Store) -> None:
        await store.register_instance("cp-a", now=T0, meta={"host": "a", "pid": 1, "tags": ["x"]})
        await store.register_instance("cp-b", now=T0 + 1, meta={})
        a, b = await store.list_instances()
        assert (a.id, a.started_at, a.heartbeat_at, a.state) == ("cp-a", T0, T0, "active")
        assert dict(a.meta) == {"host": "a", "pid": 1, "tags": ["x"]}
        assert (b.id, b.state, dict(b.meta)) == ("cp-b", "active", {})
        with pytest.raises(StoreError):
            await store.register_instance("cp-a", now=T0 + 2, meta={})
        assert len(await store.list_instances()) == 2

    async def test_heartbeat_and_expiry_of_instances(self, store: Store) -> None:
        await store.register_instance("cp-a", now=T0, meta={})
        await store.register_instance("cp-b", now=T0, meta={})
        await store.register_instance("cp-c", now=T0, meta={})
        assert await store.heartbeat_instance("cp-a", now=T0 + 10)
        assert await store.heartbeat_instance("cp-c", now=T0 + 5)
        assert not await store.heartbeat_instance("nobody", now=T0 + 10)
        # `before` is exclusive: a heartbeat at exactly `before` is still alive
        expired = await store.expire_instances(before=T0 + 5, now=T0 + 20)
        assert expired == ["cp-b"]
        assert await store.expire_instances(before=T0 + 5, now=T0 + 21) == []
        assert not await store.heartbeat_instance("cp-b", now=T0 + 22)
        by_id = {i.id: i for i in await store.list_instances()}
        assert (by_id["cp-a"].state, by_id["cp-a"].heartbeat_at) == ("active", T0 + 10)
        assert (by_id["cp-b"].state, by_id["cp-b"].heartbeat_at) == ("expired", T0)
        assert by_id["cp-c"].state == "active"
        assert await store.expire_instances(before=T0 + 11, now=T0 + 30, keep="cp-a") == ["cp-c"]
        assert await store.expire_instances(before=T0 + 11, now=T0 + 31) == ["cp-a"]

    async def test_stopped_instances_are_not_active(self, store: Store) -> None:
        await store.register_instance("cp-a", now=T0, meta={})
        await store.stop_instance("cp-a", now=T0 + 3)
        (a,) = await store.list_instances()
        assert a.state == "stopped"
        assert not await store.heartbeat_instance("cp-a", now=T0 + 4)
        assert await store.expire_instances(before=T0 + 100, now=T0 + 100) == []
        assert (await store.list_instances())[0].state == "stopped"

    async def test_a_replica_whose_registration_ended_writes_no_more_ledger(
        self, store: Store
    ) -> None:
        """An expired or stopped replica's ledger write is refused (its workers' time is
        others' from its last write on); an active or unregistered one's is written."""
        key = LedgerKey("p", "r1", "acme", hour_of(T0))
        for instance in ("cp-a", "cp-b", "cp-c"):
            await store.register_instance(instance, now=T0, meta={})
            assert await store.record_ledger(instance, {key: LedgerCounts(hot_s=5.0)}, now=T0 + 1)
        assert await store.heartbeat_instance("cp-a", now=T0 + 10)
        assert await store.expire_instances(before=T0 + 5, now=T0 + 10, keep="cp-c") == ["cp-b"]
        await store.stop_instance("cp-c", now=T0 + 10)
        later = {key: LedgerCounts(hot_s=60.0)}
        assert await store.record_ledger("cp-a", later, now=T0 + 61)
        assert not await store.record_ledger("cp-b", later, now=T0 + 61)
        assert not await store.record_ledger("cp-c", later, now=T0 + 61)
        assert await store.record_ledger("cp-unregistered", later, now=T0 + 61)
        assert await store.ledger_written_at("cp-b") == T0 + 1
        assert await store.ledger_written_at("cp-c") == T0 + 1
        assert await store.ledger_written_at("cp-a") == T0 + 61
        rows = await store.read_ledger("p", since=T0, until=T0 + 1)
        assert {k.hour for k, _ in rows} == {key.hour}
        assert sum(c.hot_s for _, c in rows) == 60.0 + 5.0 + 5.0 + 60.0

    # -- leases ---------------------------------------------------------------------------

    async def test_lease_acquire_renew_and_refuse(self, store: Store) -> None:
        first = await store.acquire_lease("janitor", holder="cp-a", now=T0, duration_s=10.0)
        assert first == LeaseRecord("janitor", "cp-a", 1, T0, 10.0)
        assert await store.get_lease("janitor") == first
        renewed = await store.acquire_lease("janitor", holder="cp-a", now=T0 + 5, duration_s=10.0)
        assert renewed == LeaseRecord("janitor", "cp-a", 1, T0 + 5, 10.0)
        assert (
            await store.acquire_lease("janitor", holder="cp-b", now=T0 + 14, duration_s=10.0)
            is None
        )
        assert await store.get_lease("janitor") == renewed
        assert await store.get_lease("other") is None

    async def test_an_expired_lease_is_taken_over_with_a_new_epoch(self, store: Store) -> None:
        await store.acquire_lease("janitor", holder="cp-a", now=T0, duration_s=10.0)
        # expired exactly at renewed_at + duration, as LeaseRecord.expired says
        taken = await store.acquire_lease("janitor", holder="cp-b", now=T0 + 10, duration_s=20.0)
        assert taken == LeaseRecord("janitor", "cp-b", 2, T0 + 10, 20.0)
        assert (
            await store.acquire_lease("janitor", holder="cp-a", now=T0 + 11, duration_s=10.0)
            is None
        )
        assert await store.get_lease("janitor") == taken
        again = await store.acquire_lease("janitor", holder="cp-b", now=T0 + 40, duration_s=20.0)
        assert must(again).epoch == 3  # its own term ran out: a new term, a new fencing token

    async def test_a_released_lease_goes_to_the_next_holder(self, store: Store) -> None:
        await store.acquire_lease("janitor", holder="cp-a", now=T0, duration_s=10.0)
        assert not await store.release_lease("janitor", holder="cp-b", now=T0 + 1)
        assert must(await store.get_lease("janitor")).holder == "cp-a"
        assert await store.release_lease("janitor", holder="cp-a", now=T0 + 2)
        assert must(await store.get_lease("janitor")).holder != "cp-a"
        assert not await store.release_lease("janitor", holder="cp-a", now=T0 + 3)
        taken = await store.acquire_lease("janitor", holder="cp-b", now=T0 + 3, duration_s=10.0)
        assert taken == LeaseRecord("janitor", "cp-b", 2, T0 + 3, 10.0)
        assert not await store.release_lease("nothing", holder="cp-a", now=T0)

    async def test_leases_are_independent(self, store: Store) -> None:
        a = await store.acquire_lease("janitor", holder="cp-a", now=T0, duration_s=10.0)
        b = await store.acquire_lease("reaper", holder="cp-b", now=T0, duration_s=10.0)
        assert (must(a).holder, must(b).holder) == ("cp-a", "cp-b")
        assert await store.release_lease("janitor", holder="cp-a", now=T0 + 1)
        assert await store.get_lease("reaper") == b

    # -- demand and housekeeping -------------------------------------------------------------

    async def test_demand_rows_are_upserted_per_pool_and_replica(self, store: Store) -> None:
        assert await store.read_demand() == []
        await store.record_demand("cp-a", {"p": (3, 1), "q": (0, 0)}, now=T0)
        await store.record_demand("cp-b", {"p": (5, 2)}, now=T0 + 1)
        await store.record_demand("cp-a", {"p": (7, 0)}, now=T0 + 2)
        await store.record_demand("cp-c", {}, now=T0 + 3)
        rows = await store.read_demand()
        assert rows == [
            DemandRecord("p", "cp-a", 7, 0, T0 + 2),
            DemandRecord("p", "cp-b", 5, 2, T0 + 1),
            DemandRecord("q", "cp-a", 0, 0, T0),
        ]

    async def test_demand_rows_carry_each_replicas_claim_counter(self, store: Store) -> None:
        await store.record_demand("cp-a", {"p": (3, 1, 40)}, now=T0)
        await store.record_demand("cp-b", {"p": (0, 0, 2), "q": (1, 0)}, now=T0 + 1)
        await store.record_demand("cp-a", {"p": (4, 0, 41)}, now=T0 + 2)
        assert await store.read_demand() == [
            DemandRecord("p", "cp-a", 4, 0, T0 + 2, 41),
            DemandRecord("p", "cp-b", 0, 0, T0 + 1, 2),
            DemandRecord("q", "cp-b", 1, 0, T0 + 1, 0),
        ]

    async def test_each_pools_sizing_is_replaced_by_whichever_replica_wrote_last(
        self, store: Store, make_store: MakeStore
    ) -> None:
        """The leader publishes its sizings; a new leader's replace them; every replica
        reads the same rows."""
        other = await make_store()
        assert await store.read_sizing() == []
        terms = {
            "demand_rate": 0.25,
            "panicking": False,
            "forecast_rate": None,
            "policy": "reactive",
            "headroom": 2,
        }
        p = PoolSizingRecord("p", "cp-a", T0, 5, 3, terms, "the step's interval")
        q = PoolSizingRecord("q", "cp-a", T0, 2, 0)
        await store.record_sizing([q, p])
        await store.record_sizing([])
        assert await other.read_sizing() == [p, q]
        # A new leader's pass: its rows replace the old leader's, whatever they held.
        p2 = PoolSizingRecord("p", "cp-b", T0 + 2, 1, -1, {"policy": "static"}, "")
        await other.record_sizing([p2])
        assert await store.read_sizing() == [p2, q]
        assert await other.read_sizing() == [p2, q]

    async def test_the_purge_deletes_sizings_published_before_its_horizon(
        self, store: Store
    ) -> None:
        old = PoolSizingRecord("p", "cp-a", T0, 5, 3)
        young = PoolSizingRecord("q", "cp-a", T0 + 10, 2, 0)
        await store.record_sizing([old, young])
        assert await store.purge(before=T0 + 5) == 1
        assert await store.read_sizing() == [young]

    async def test_forecast_buckets_round_trip_and_are_replaced_by_key(self, store: Store) -> None:
        """What one leader learned is what the next one reads (a restart, a failover)."""
        assert await store.read_forecast() == []
        first = [
            ForecastBucket("p", "week", 14, 0.09, 0.0001, 1, T0),
            ForecastBucket("p", "day", 14, 0.09, 0.0001, 1, T0),
            ForecastBucket("q", "day", 47, 1e-9, 0.0, 3, T0),
        ]
        await store.record_forecast(first)
        await store.record_forecast([])
        assert await store.read_forecast() == sorted(
            first, key=lambda b: (b.pool, b.level, b.bucket)
        )
        learned = ForecastBucket("p", "day", 14, 0.081, 0.00013, 2, T0 + 3600)
        await store.record_forecast([learned])
        rows = await store.read_forecast()
        assert len(rows) == 3 and learned in rows and first[1] not in rows

    async def test_org_forecast_buckets_are_replaced_by_key_and_dropped_by_org(
        self, store: Store
    ) -> None:
        """A new leader reads what the last one learned of each org; an evicted org's
        buckets go in the same write as the buckets learned with it."""
        assert await store.read_org_forecast() == []
        first = [
            OrgForecastBucket("p", "acme", 9, 0.002, 1e-6, 1, T0),
            OrgForecastBucket("p", "acme", 10, 0.003, 1e-6, 1, T0),
            OrgForecastBucket("p", "globex", 9, 0.001, 0.0, 4, T0),
            OrgForecastBucket("q", "acme", 47, 0.0, 0.0, 2, T0),
        ]
        await store.record_org_forecast(first)
        await store.record_org_forecast([])
        assert await store.read_org_forecast() == first
        learned = OrgForecastBucket("p", "initech", 11, 0.004, 2e-6, 1, T0 + 3600)
        again = OrgForecastBucket("p", "globex", 9, 0.0012, 1e-7, 5, T0 + 3600)
        await store.record_org_forecast([learned, again], drop=[("p", "acme")])
        assert await store.read_org_forecast() == [again, learned, first[3]]
        await store.record_org_forecast([], drop=[("q", "acme"), ("p", "nobody")])
        assert await store.read_org_forecast() == [again, learned]

    async def test_claims_are_counted_by_pool_and_org_in_a_time_range(
        self, store: Store, fleet: Fleet
    ) -> None:
        """Every claim created in the range counts once, bound or ended."""
        _, first = await fleet.hot("acme")
        await fleet.hot_idle("acme")
        await fleet.hot("globex")
        await fleet.hot("acme", pool="q")
        _, last = await fleet.hot("globex")
        counted = await store.claims_by_org(since=first.created_at, before=fleet.tick())
        assert counted == [("p", "acme", 2), ("p", "globex", 2), ("q", "acme", 1)]
        # [since, before): the last claim's own time is outside a range that ends there.
        assert await store.claims_by_org(since=T0, before=last.created_at) == [
            ("p", "acme", 2),
            ("p", "globex", 1),
            ("q", "acme", 1),
        ]
        assert await store.claims_by_org(since=fleet.tick(), before=fleet.tick()) == []

    async def test_purge_deletes_only_old_terminal_history(
        self, store: Store, fleet: Fleet
    ) -> None:
        old_retired = await fleet.retired()
        _, bound = await fleet.hot("org-a")
        ended_worker = await fleet.hot_idle("org-b")
        live_warm = await fleet.warm()
        await store.register_instance("cp-old", now=fleet.tick(), meta={})
        await store.stop_instance("cp-old", now=fleet.now)
        await store.record_demand("cp-old", {"p": (1, 0)}, now=fleet.now)
        await store.register_instance("cp-live", now=fleet.tick(), meta={})
        await store.record_demand("cp-live", {"p": (2, 0)}, now=fleet.now)
        cutoff = fleet.tick()
        young_retired = await fleet.retired()

        deleted = await store.purge(before=cutoff)

        # The retired worker, the released claim of the hot_idle one, the stopped
        # replica and its demand row.
        assert deleted == 4
        assert await store.get_worker(old_retired.id) is None
        assert must(await store.get_worker(young_retired.id)).state is S.RETIRED
        assert must(await store.get_worker(live_warm.id)).state is S.WARM
        assert must(await store.get_worker(ended_worker.id)).state is S.HOT_IDLE
        assert must(await store.get_claim(bound.id)).state is ClaimState.BOUND
        assert [c.state for c in await store.list_claims()] == [ClaimState.BOUND]
        assert [i.id for i in await store.list_instances()] == ["cp-live"]
        assert [(d.instance, d.misses) for d in await store.read_demand()] == [("cp-live", 2)]
        assert await store.purge(before=cutoff) == 0

    # -- property: the fence and the table, over random histories -----------------------------

    @settings(
        max_examples=25,
        deadline=None,
        # One store serves every example (each uses fresh ids), and each adapter's
        # subclass runs this same method: both are by design.
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.differing_executors,
        ],
    )
    @given(data=st.data())
    async def test_random_histories_follow_the_table_and_the_fence(
        self, store: Store, data: st.DataObject
    ) -> None:
        fleet = Fleet(store, prefix=f"h-{uuid.uuid4().hex[:8]}")
        (w,) = await fleet.spawning()
        state, epoch, version, activated = S.SPAWNING, 0, w.version, False
        for _ in range(data.draw(st.integers(1, 12), label="steps")):
            to = data.draw(st.sampled_from(list(S)), label="to")
            expect = data.draw(st.sampled_from([state, state, *S]), label="expect")
            seen = data.draw(st.sampled_from([epoch, epoch, epoch - 1, epoch + 1]), label="epoch")
            read = data.draw(st.sampled_from([version, version, version - 1]), label="version")
            bump = data.draw(st.booleans(), label="bump")
            now = fleet.tick()
            outcome: str
            if to not in TRANSITIONS[expect] and (to is not expect or expect in TERMINAL):
                outcome = "illegal"
            elif (expect, seen, read) != (state, epoch, version):
                outcome = "miss"
            else:
                try:
                    if to is not state:
                        check_transition(state, to, activated=activated)
                    outcome = "ok"
                except IllegalTransition:
                    outcome = "illegal"
            try:
                new = await store.transition(
                    w.id,
                    expect=expect,
                    epoch=seen,
                    version=read,
                    to=to,
                    now=now,
                    bump_epoch=bump,
                    changes={"heartbeat_at": now},
                )
            except IllegalTransition:
                assert outcome == "illegal"
            else:
                assert outcome == ("ok" if new is not None else "miss")
                if new is not None:
                    epoch += 1 if bump else 0
                    version += 1  # every write, the same-state ones too
                    activated = activated or to is S.ACTIVATING
                    state = to
            row = must(await store.get_worker(w.id))
            assert (row.state, row.epoch, row.version, row.activated) == (
                state,
                epoch,
                version,
                activated,
            )

    # -- concurrency (several instances on one database) ---------------------------------------

    async def test_concurrent_cas_on_one_row_has_one_winner(
        self, store: Store, make_store: MakeStore, fleet: Fleet
    ) -> None:
        replicas = await self.replicas(store, make_store)
        w = await fleet.warm()

        async def drain(i: int) -> Worker | None:
            return await replicas[i % 3].transition(
                w.id,
                expect=S.WARM,
                epoch=w.epoch,
                version=w.version,
                to=S.DRAINING,
                now=T0 + 100 + i,
                changes={"reason": f"by-{i}"},
            )

        async def bump(i: int) -> Worker | None:
            return await replicas[i % 3].transition(
                w.id,
                expect=S.DRAINING,
                epoch=w.epoch,
                version=drained.version,
                to=S.DRAINING,
                now=T0 + 200 + i,
                bump_epoch=True,
            )

        drained = w
        for attempt in (drain, bump):
            results = await asyncio.gather(*(attempt(i) for i in range(30)))
            winners = [r for r in results if r is not None]
            assert len(winners) == 1
            assert await store.get_worker(w.id) == winners[0]
            drained = winners[0]
        assert must(await store.get_worker(w.id)).epoch == w.epoch + 1

    async def test_a_same_state_write_from_one_read_has_one_winner(
        self, store: Store, make_store: MakeStore, fleet: Fleet
    ) -> None:
        """Two janitors adopt the same orphan from one snapshot: neither changes the state,
        and still only the first write lands (the other's read is stale by then)."""
        replicas = await self.replicas(store, make_store, n=2)
        orphans = [await fleet.warm(), (await fleet.hot("org-a"))[0], await fleet.hot_idle("org-b")]
        for orphan in orphans:

            async def adopt(i: int, orphan: Worker = orphan) -> Worker | None:
                return await replicas[i].transition(
                    orphan.id,
                    expect=orphan.state,
                    epoch=orphan.epoch,
                    version=orphan.version,
                    to=orphan.state,
                    now=T0 + 100 + i,
                    changes={"owner": f"cp-{i}"},
                )

            results = await asyncio.gather(adopt(0), adopt(1))
            winners = [r for r in results if r is not None]
            assert len(winners) == 1
            (won,) = winners
            assert (won.state, won.epoch, won.version) == (
                orphan.state,
                orphan.epoch,
                orphan.version + 1,
            )
            assert await store.get_worker(orphan.id) == won
            # The loser, run again from the same read, still misses.
            loser = results.index(None)
            assert await adopt(loser) is None
            assert await store.get_worker(orphan.id) == won

    async def test_50_claims_across_3_replicas_never_double_assign(
        self, store: Store, make_store: MakeStore, fleet: Fleet
    ) -> None:
        replicas = await self.replicas(store, make_store)
        warm = [await fleet.warm() for _ in range(20)]

        async def claim(i: int) -> tuple[str, Worker | None]:
            org, replica = f"org-{i}", replicas[i % 3]
            if i % 2:
                target = warm[i % len(warm)]  # a queue hint, possibly stale
                result = await replica.reserve(
                    target.id,
                    expect=S.WARM,
                    epoch=target.epoch,
                    version=target.version,
                    org=org,
                    org_cap=1,
                    owner=f"cp-{i % 3}",
                    now=T0 + 100,
                )
            else:
                result = await replica.reserve_any(
                    "p", "r1", expect=S.WARM, org=org, org_cap=1, owner=f"cp-{i % 3}", now=T0 + 100
                )
            return org, result.worker

        results = await asyncio.gather(*(claim(i) for i in range(50)))
        got = [(org, w) for org, w in results if w is not None]
        assert len({w.id for _, w in got}) == len(got)  # I1: never the same worker twice
        for org, w in got:
            stored = must(await store.get_worker(w.id))
            assert (stored.state, stored.org, stored.epoch) == (S.RESERVED, org, 1)
        reserved = await store.list_workers(states=[S.RESERVED])
        assert {w.id for w in reserved} == {w.id for _, w in got}
        # 25 reserve_any calls for 20 workers: a call comes back empty only once every
        # warm worker left is being taken by another call, so none stays warm.
        assert len(got) == 20
        assert await store.list_workers(states=[S.WARM]) == []

    async def test_concurrent_reserves_for_one_org_respect_its_cap(
        self, store: Store, make_store: MakeStore, fleet: Fleet
    ) -> None:
        replicas = await self.replicas(store, make_store)
        for _ in range(20):
            await fleet.warm()
        await fleet.reserved("org-a")

        async def claim(i: int) -> tuple[Worker | None, bool]:
            result = await replicas[i % 3].reserve_any(
                "p", "r1", expect=S.WARM, org="org-a", org_cap=5, owner="cp-a", now=T0 + 100
            )
            return result.worker, result.at_org_cap

        results = await asyncio.gather(*(claim(i) for i in range(30)))
        assert len([w for w, _ in results if w is not None]) == 4
        assert all(capped for w, capped in results if w is None)
        assert len(await store.list_workers(org="org-a", states=[S.RESERVED])) == 5

    async def test_30_concurrent_spawn_reservations_never_exceed_the_pool_cap(
        self, store: Store, make_store: MakeStore, fleet: Fleet
    ) -> None:
        replicas = await self.replicas(store, make_store)
        await fleet.warm()

        async def spawn(i: int) -> list[Worker]:
            req = spawn_req(count=2, pool_cap=10, owner=f"cp-{i % 3}")
            result = await replicas[i % 3].reserve_spawn_slots(
                req, [f"s-{i}-0", f"s-{i}-1"], T0 + 100
            )
            assert result.limited_by in (None, "pool_cap")
            return result.workers

        results = await asyncio.gather(*(spawn(i) for i in range(30)))
        inserted = [w for ws in results for w in ws]
        assert len(inserted) == 9
        assert len(await store.list_workers(pool="p", states=[S.SPAWNING, S.WARM])) == 10

    async def test_concurrent_reconcilers_never_overshoot_a_target(
        self, store: Store, make_store: MakeStore, fleet: Fleet
    ) -> None:
        replicas = await self.replicas(store, make_store)
        await fleet.warm()

        async def reconcile(i: int) -> int:
            req = spawn_req(count=3, target=8, owner=f"cp-{i % 3}")
            ids = [f"s-{i}-{k}" for k in range(3)]
            return len((await replicas[i % 3].reserve_spawn_slots(req, ids, T0 + 100)).workers)

        assert sum(await asyncio.gather(*(reconcile(i) for i in range(30)))) == 7
        assert len(await store.list_workers(states=[S.SPAWNING, S.WARM])) == 8

    async def test_cold_spawns_and_warm_reserves_share_the_org_cap(
        self, store: Store, make_store: MakeStore, fleet: Fleet
    ) -> None:
        replicas = await self.replicas(store, make_store)
        for _ in range(20):
            await fleet.warm()

        async def cold(i: int) -> int:
            req = spawn_req(org="org-a", org_cap=5, pool_cap=100, owner=f"cp-{i % 3}")
            return len(
                (await replicas[i % 3].reserve_spawn_slots(req, [f"c-{i}"], T0 + 100)).workers
            )

        async def warm(i: int) -> int:
            result = await replicas[i % 3].reserve_any(
                "p", "r1", expect=S.WARM, org="org-a", org_cap=5, owner="cp-a", now=T0 + 100
            )
            return 0 if result.worker is None else 1

        tasks = [cold(i) if i % 2 else warm(i) for i in range(30)]
        assert sum(await asyncio.gather(*tasks)) == 5
        live = await store.list_workers(org="org-a", states=[S.SPAWNING, S.RESERVED])
        assert len(live) == 5

    async def test_one_lease_holder_among_racing_replicas(
        self, store: Store, make_store: MakeStore
    ) -> None:
        replicas = await self.replicas(store, make_store)

        async def contend(i: int) -> LeaseRecord | None:
            return await replicas[i % 3].acquire_lease(
                "janitor", holder=f"cp-{i}", now=T0, duration_s=10.0
            )

        results = await asyncio.gather(*(contend(i) for i in range(12)))
        winners = [r for r in results if r is not None]
        assert len(winners) == 1
        assert await store.get_lease("janitor") == winners[0]
        assert winners[0].epoch == 1

        async def take_over(i: int) -> LeaseRecord | None:
            return await replicas[i % 3].acquire_lease(
                "janitor", holder=f"cp-next-{i}", now=T0 + 30, duration_s=10.0
            )

        results = await asyncio.gather(*(take_over(i) for i in range(12)))
        winners = [r for r in results if r is not None]
        assert len(winners) == 1
        assert winners[0].epoch == 2

    async def test_a_claim_ended_by_racing_replicas_ends_once(
        self, store: Store, make_store: MakeStore, fleet: Fleet
    ) -> None:
        replicas = await self.replicas(store, make_store)
        _, claim = await fleet.hot("org-a")

        async def end(i: int) -> tuple[Claim, Worker] | None:
            if i % 2:
                return await replicas[i % 3].end_claim(
                    claim.id, state=ClaimState.RELEASED, worker_to=S.HOT_IDLE, now=T0 + 100
                )
            return await replicas[i % 3].end_claim(
                claim.id, state=ClaimState.EXPIRED, worker_to=S.DRAINING, now=T0 + 100
            )

        results = await asyncio.gather(*(end(i) for i in range(12)))
        winners = [r for r in results if r is not None]
        assert len(winners) == 1
        ended, worker = winners[0]
        assert await store.get_claim(claim.id) == ended
        assert await store.get_worker(worker.id) == worker
