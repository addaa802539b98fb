"""The ledger and the claim log (docs/warmth.md, docs/claim-log.md) on both stores, on
virtual time (looptime): a fleet whose every transition happens at a time the test chose,
written through the real lifecycle, counted by the ledger, flushed to the store and summed
back, against a hand-computed table. Then bounded purges and the claim log's round trip.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import psycopg
import pytest
from prometheus_client import CollectorRegistry

from fakes import MemoryRuntime
from stoker.adapters.postgres import PostgresStore
from stoker.adapters.sqlite import SqliteStore
from stoker.control.catalog import Catalog
from stoker.control.ledger import TERMINATING_KEEP_S, Ledger
from stoker.control.lifecycle import Lifecycle
from stoker.control.metrics import Metrics
from stoker.control.plane import ControlPlane
from stoker.domain.errors import CapacityError, OrgCapError
from stoker.domain.ledger import (
    HOUR_S,
    ClaimEnding,
    ClaimLogEntry,
    LedgerCounts,
    LedgerKey,
    hour_of,
    money,
    split_hours,
    summed,
)
from stoker.domain.records import Claim, ClaimRequest, Worker
from stoker.domain.specs import CostSpec, PlaneSettings, PodTemplate, PoolSpec, ProcessTemplate
from stoker.domain.states import ClaimMode, ClaimSource, ClaimState, WorkerState
from stoker.ports.clock import VirtualClock
from stoker.ports.store import SpawnRequest, Store

pytestmark = pytest.mark.looptime

S = WorkerState
ME = "replica-1"
POOL = PoolSpec(
    name="p",
    template=ProcessTemplate(argv=("worker", "{port}"), memory_mb=512),
    cost=CostSpec(per_worker_hour=3.6),
)
#: A secret a claim is handed, which must never reach the log.
SECRET = "tok-SECRET-never-logged"


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """A fresh, opened store of each kind (PostgreSQL: a schema of its own)."""
    schema = ""
    made: Store
    if request.param == "sqlite":
        made = SqliteStore(str(tmp_path / "stoker.db"))
    else:
        url = request.getfixturevalue("postgres_url")
        schema = f"stoker_test_{uuid.uuid4().hex[:12]}"
        made = PostgresStore(url, schema=schema)
    await made.open()
    try:
        yield made
    finally:
        await made.close()
        if schema:
            url = request.getfixturevalue("postgres_url")
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


class ManualClock:
    """Time that moves only when the test says (the store's own I/O takes none of it)."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)

    def advance(self, seconds: float) -> None:
        assert seconds >= 0
        self.t += seconds


def wire(
    store: Store, clock: ManualClock, catalog: Catalog | None = None, instance_id: str = ME
) -> tuple[Ledger, Lifecycle, Metrics]:
    """Replica `instance_id`'s ledger, told of every write its lifecycle makes."""
    metrics = Metrics(CollectorRegistry())
    catalog = catalog or Catalog({"p": POOL}, {}, derived_cap=lambda _: 0)
    ledger = Ledger(clock=clock, catalog=catalog, instance_id=instance_id, metrics=metrics)
    lifecycle = Lifecycle(store, clock, metrics)
    lifecycle.on_moved = ledger.moved
    lifecycle.on_claim_ended = ledger.claim_ended
    return ledger, lifecycle, metrics


def claim_for(worker: Worker, now: float) -> Claim:
    return Claim(
        id="c-1",
        pool="p",
        org="acme",
        worker_id=worker.id,
        worker_epoch=worker.epoch,
        source=ClaimSource.WARM,
        mode=ClaimMode.PREFER_WARM,
        state=ClaimState.BOUND,
        token=SECRET,
        endpoint=worker.endpoint or "",
        lease_s=600.0,
        expires_at=now + 600.0,
        created_at=now,
        updated_at=now,
        owner=ME,
    )


async def run_fleet(store: Store, clock: ManualClock) -> tuple[Ledger, Metrics, float]:
    """Two workers, every transition at a chosen time after t0 (returned):

    A: spawning 0-10, warm 10-100, reserved+activating 100-101 (acme), hot 101-400,
       hot_idle 400-460, draining 460-470, retired.
    B: spawning 0-5, warm 5-4000 (the flush), across an hour boundary.
    """
    ledger, life, metrics = wire(store, clock)
    t0 = clock.now()

    async def at(offset: float) -> None:
        clock.advance(t0 + offset - clock.now())

    slots = await life.reserve_slots(
        SpawnRequest(pool="p", revision=POOL.revision, count=2, owner=ME), ["w-a", "w-b"]
    )
    a, b = slots.workers
    await at(5)
    b = await life.move(b, S.WARM, endpoint="http://b") or pytest.fail("b not warm")
    ledger.spawn_ready(b, 5.0)
    await at(10)
    a = await life.move(a, S.WARM, endpoint="http://a") or pytest.fail("a not warm")
    ledger.spawn_ready(a, 10.0)
    await at(100)
    reserved = await life.reserve(a, org="acme", org_cap=0, owner=ME)
    a = reserved.worker or pytest.fail("a not reserved")
    if a.state is S.RESERVED:
        a = await life.move(a, S.ACTIVATING, activated=True) or pytest.fail("not activating")
    await at(101)
    claim = claim_for(a, clock.now())
    a = await life.bind(a, claim) or pytest.fail("a not hot")
    ledger.claimed(claim, revision=a.revision, wait_s=0.004)
    await at(102)
    ledger.failed(
        pool="p",
        revision=POOL.revision,
        org="globex",
        mode=ClaimMode.REQUIRE_WARM,
        wait_s=1.5,
        error=OrgCapError("globex holds its cap", retry_after=45.0),
    )
    await at(400)
    ended = await life.end_claim(
        claim, state=ClaimState.RELEASED, worker_to=S.HOT_IDLE, idle_since=clock.now()
    )
    a = (ended or pytest.fail("not released"))[1]
    await at(460)
    a = await life.move(a, S.DRAINING, reason="ttl") or pytest.fail("a not draining")
    await at(470)
    await life.move(a, S.RETIRED, reason="ttl") or pytest.fail("a not retired")
    await at(4000)
    await ledger.flush(store)
    return ledger, metrics, t0


async def test_every_worker_second_is_counted_in_its_state_on_both_stores(store: Store) -> None:
    clock = ManualClock()
    _, metrics, t0 = await run_fleet(store, clock)
    rows = await store.read_ledger("p", since=t0 - 1, until=t0 + 4001)
    total = LedgerCounts()
    by_org: dict[str, LedgerCounts] = {}
    for key, counts in rows:
        total.merge(counts)
        by_org.setdefault(key.org, LedgerCounts()).merge(counts)
    # By hand: A lived 470 s, B 4000 s.
    assert total.starting_s == pytest.approx(10 + 1 + 5)
    assert total.warm_s == pytest.approx(90 + 3995)
    assert total.hot_s == pytest.approx(299)
    assert total.hot_idle_s == pytest.approx(60)
    assert total.draining_s == pytest.approx(10)
    assert total.placeholder_s == 0
    all_s = total.starting_s + total.warm_s + total.hot_s + total.hot_idle_s + total.draining_s
    assert all_s == pytest.approx(470 + 4000)
    assert total.gib_s == pytest.approx(0.5 * (470 + 4000))
    # The org's share: from its reservation on (1 + 299 + 60 + 10 s); the rest is neutral.
    acme = by_org["acme"]
    assert acme.starting_s + acme.hot_s + acme.hot_idle_s + acme.draining_s == pytest.approx(370)
    assert by_org[""].warm_s == pytest.approx(4085)
    assert (total.spawns, total.ready) == (2, 2)
    assert total.ready_sum_s == pytest.approx(15.0)
    assert sum(total.ready_hist) == 2
    assert (total.claims_warm, total.claims_reuse, total.claims_cold) == (1, 0, 0)
    assert total.wait_warm_s == pytest.approx(0.004)
    assert total.failed == 1
    assert total.failed_wait_s == pytest.approx(1.5)
    # The hours: the cells of each hour hold exactly the seconds of that hour.
    hours = {key.hour for key, _ in rows}
    assert hours == {h for h, _ in split_hours(t0, t0 + 4000)}
    worth = money(total, POOL.cost)
    assert worth["idle_warm_cost"] == pytest.approx(4085 / 3600 * 3.6)
    assert worth["idle_parked_cost"] == pytest.approx(60 / 3600 * 3.6)
    assert worth["cold_start_s_avoided"] == pytest.approx(1 * 7.5)
    assert metrics.registry.get_sample_value(
        "stoker_ledger_worker_seconds_total", {"pool": "p", "state": "warm"}
    ) == pytest.approx(4085)
    assert metrics.registry.get_sample_value(
        "stoker_ledger_idle_cost_total", {"pool": "p", "kind": "warm"}
    ) == pytest.approx(4.085)


async def test_headroom_is_counted_in_slots_and_priced_by_the_placeholders_requests(
    store: Store,
) -> None:
    """One placeholder of 1.1 CPUs and 0.25 GiB, room for 4 workers, kept for 60 s (two
    leader passes) by a pool with no worker time: 240 slot-seconds, priced at what the
    placeholder holds on its node (66 cpu-seconds, 15 GiB-seconds), in the ledger and in
    the idle cost metric. (Headroom was priced at the cell's workers' mix: here nothing.)"""
    clock = ManualClock()
    metrics = Metrics(CollectorRegistry())
    cost = CostSpec(per_cpu_hour=1.0, per_gib_hour=0.1)
    catalog = Catalog({"p": dataclasses.replace(POOL, cost=cost)}, {}, derived_cap=lambda _: 0)
    ledger = Ledger(clock=clock, catalog=catalog, instance_id=ME, metrics=metrics)
    t0 = clock.now()
    for _ in range(2):
        ledger.placeholders("p", POOL.revision, 4.0, requests=(1.1, 0.25))
        clock.advance(30)
    await ledger.flush(store)
    total = LedgerCounts()
    for _, counts in await store.read_ledger("p", since=t0 - 1, until=t0 + 61):
        total.merge(counts)
    assert total.placeholder_s == pytest.approx(4 * 60)
    assert (total.placeholder_cpu_s, total.placeholder_gib_s) == pytest.approx((66, 15))
    assert (total.cpu_s, total.gib_s, total.warm_s) == (0, 0, 0)
    priced = (1.1 * 1.0 + 0.25 * 0.1) * 60 / 3600
    assert money(total, cost)["headroom_cost"] == pytest.approx(priced)
    assert metrics.registry.get_sample_value(
        "stoker_ledger_idle_cost_total", {"pool": "p", "kind": "headroom"}
    ) == pytest.approx(priced)


async def test_the_claim_log_keeps_arrival_hold_and_outcome_and_no_token(store: Store) -> None:
    clock = ManualClock()
    _, _, t0 = await run_fleet(store, clock)
    log = await store.read_claim_log(since=t0, until=t0 + 5000)
    # By arrival: the refused claim arrived 1.5 s before its refusal, before the other.
    assert [(e.outcome, e.org, e.mode, e.source) for e in log] == [
        ("org_cap", "globex", "require_warm", None),
        ("released", "acme", "prefer_warm", "warm"),
    ]
    refused, bound = log
    assert bound.at == pytest.approx(t0 + 101 - 0.004)
    assert bound.wait_s == pytest.approx(0.004)
    assert bound.held_s == pytest.approx(299)
    assert bound.revision == POOL.revision
    assert refused.at == pytest.approx(t0 + 102 - 1.5)
    assert (refused.held_s, refused.revision) == (None, None)
    exported = "\n".join(json.dumps(e.export()) for e in log)
    assert SECRET not in exported and "sha256" not in exported
    assert set(json.loads(exported.splitlines()[0])) == {
        "at", "pool", "org", "mode", "source", "wait_s", "held_s", "outcome", "revision"
    }  # fmt: skip


async def test_an_ending_written_before_its_arrival_keeps_its_outcome(store: Store) -> None:
    ending = ClaimEnding("c-9", "p", "acme", "cold", "cold", 1000.0, 30.0, "expired")
    arrival = ClaimLogEntry("c-9", 990.0, "p", "acme", "cold", "cold", 10.0, None, "open", "r1")
    await store.record_claim_log([], [ending])
    await store.record_claim_log([arrival], [])
    (row,) = await store.read_claim_log(since=0, until=2000)
    assert (row.at, row.wait_s, row.held_s, row.outcome, row.revision) == (
        990.0,
        10.0,
        30.0,
        "expired",
        "r1",
    )


async def test_the_claim_log_pages_by_arrival(store: Store) -> None:
    entries = [
        ClaimLogEntry(f"c-{i:03}", 100.0 + i // 2, "p" if i % 3 else "q", "o", "cold", "cold",
                      0.1, 1.0, "released", "r")
        for i in range(25)
    ]  # fmt: skip
    await store.record_claim_log(entries, [])
    got: list[ClaimLogEntry] = []
    after = None
    while True:
        page = await store.read_claim_log(since=0, until=1e9, pool="p", after=after, limit=4)
        if not page:
            break
        got += page
        after = (page[-1].at, page[-1].id)
    want = sorted((e for e in entries if e.pool == "p"), key=lambda e: (e.at, e.id))
    assert got == want


async def test_replicas_rows_are_summed_and_a_rewrite_replaces_its_own(store: Store) -> None:
    key = LedgerKey("p", "r1", "acme", 7200)
    one = LedgerCounts(warm_s=10.0, claims_warm=1)
    await store.record_ledger("r-a", {key: one}, now=7300.0)
    await store.record_ledger("r-b", {key: LedgerCounts(warm_s=5.0)}, now=7300.0)
    # Cumulative per replica: writing again replaces, never adds.
    await store.record_ledger("r-a", {key: LedgerCounts(warm_s=12.0, claims_warm=2)}, now=7400.0)
    rows = await store.read_ledger("p", since=7200.0, until=10800.0)
    total = summed(rows, by=None)
    (cell,) = total.values()
    assert (cell.warm_s, cell.claims_warm) == (17.0, 2)
    assert await store.read_ledger("p", since=10800.0, until=14400.0) == []


async def test_one_purge_deletes_at_most_its_batch(store: Store) -> None:
    cells = {
        LedgerKey("p", "r", f"o{i}", 3600 * (i % 5)): LedgerCounts(warm_s=1.0) for i in range(30)
    }
    await store.record_ledger("r-a", cells, now=0.0)
    log = [
        ClaimLogEntry(f"c{i}", float(i), "p", "o", "cold", None, 0.0, None, "no_capacity", None)
        for i in range(30)
    ]
    await store.record_claim_log(log, [])
    cutoff = 10 * HOUR_S
    assert await store.purge_ledger(before=cutoff, limit=7) == 7
    assert await store.purge_ledger(before=cutoff, limit=20) == 20
    assert await store.purge_ledger(before=cutoff, limit=100) == 33
    assert await store.purge_ledger(before=cutoff, limit=100) == 0
    assert await store.read_ledger("p", since=0, until=1e9) == []
    assert await store.read_claim_log(since=0, until=1e9) == []


async def test_a_purge_keeps_what_is_within_retention(store: Store) -> None:
    old, new = LedgerKey("p", "r", "o", 0), LedgerKey("p", "r", "o", hour_of(50_000))
    await store.record_ledger("r-a", {old: LedgerCounts(), new: LedgerCounts()}, now=0.0)
    entry = ClaimLogEntry("c", 49_000.0, "p", "o", "cold", None, 0.0, None, "failed", None)
    await store.record_claim_log([entry], [])
    assert await store.purge_ledger(before=40_000.0, limit=100) == 1
    assert [k for k, _ in await store.read_ledger("p", since=0, until=1e9)] == [new]
    assert len(await store.read_claim_log(since=0, until=1e9)) == 1


async def test_a_failure_is_logged_by_what_its_requester_was_told(store: Store) -> None:
    clock = ManualClock()
    ledger, _, _ = wire(store, clock)
    for error in (
        CapacityError("full", reason="pool_cap"),
        CapacityError("none", reason="no_capacity"),
        CapacityError("broken", reason="spawn_failing"),
    ):
        ledger.failed(pool="p", revision="r", org="o", mode=ClaimMode.COLD, wait_s=1.0, error=error)
        clock.advance(1.0)
    await ledger.flush(store)
    log = await store.read_claim_log(since=0, until=clock.now() + 1)
    assert [e.outcome for e in log] == ["pool_cap", "no_capacity", "failed"]


async def test_a_claim_across_an_hour_is_counted_in_the_hour_it_arrived(store: Store) -> None:
    """The ledger's claims of an hour are the claim log's arrivals of that hour: a claim
    that arrived before the hour turned and was bound or refused after it counts in the
    hour before, in both."""
    clock = ManualClock(start=10 * HOUR_S - 0.5)
    ledger, life, _ = wire(store, clock)
    (worker,) = (await life.reserve_slots(
        SpawnRequest(pool="p", revision=POOL.revision, count=1, owner=ME), ["w-a"]
    )).workers  # fmt: skip
    clock.advance(1.0)  # bound 0.5 s into hour 10, after waiting a second
    ledger.claimed(claim_for(worker, clock.now()), revision=POOL.revision, wait_s=1.0)
    clock.advance(1.0)  # refused 1.5 s into hour 10, after waiting 3 s
    ledger.failed(
        pool="p", revision=POOL.revision, org="acme", mode=ClaimMode.COLD, wait_s=3.0,
        error=CapacityError("full", reason="pool_cap"),
    )  # fmt: skip
    await ledger.flush(store)
    hours = summed(await store.read_ledger("p", since=0, until=20 * HOUR_S), by=None)
    claims = {key: (c.claims_warm, c.failed) for key, c in hours.items()}
    assert claims[f"{int(9 * HOUR_S)}|"] == (1, 1)
    assert claims.get(f"{int(10 * HOUR_S)}|", (0, 0)) == (0, 0)
    log = await store.read_claim_log(since=9 * HOUR_S, until=10 * HOUR_S)
    assert sorted(e.outcome for e in log) == ["open", "pool_cap"]


async def test_a_requester_that_left_is_logged_failed_not_refused(tmp_path: Path) -> None:
    """A claim whose requester was cancelled while it waited (it disconnected, or the
    server's shutdown grace ended: the API then answers 503 shutting_down) was told no
    capacity refusal: `failed`; one whose timeout ran out at the pool cap: `pool_cap`."""
    store = SqliteStore(str(tmp_path / "stoker.db"))
    runtime = MemoryRuntime(ready_delay=0.2)
    clock = VirtualClock()
    pool = PoolSpec(name="p", template=POOL.template, warm_target=1, max_workers=1)
    plane = ControlPlane(store=store, runtime=runtime, activator=runtime, pools=[pool], clock=clock)
    await plane.start(loops=False)
    try:
        await asyncio.sleep(1.0)
        held = await plane.claim(ClaimRequest(pool="p", org="acme", timeout_s=5.0))
        left = asyncio.create_task(plane.claim(ClaimRequest(pool="p", org="globex", timeout_s=30)))
        await asyncio.sleep(1.0)
        left.cancel()
        with pytest.raises(asyncio.CancelledError):
            await left
        with pytest.raises(CapacityError):
            await plane.claim(ClaimRequest(pool="p", org="initech", timeout_s=2.0))
        await asyncio.sleep(1.0)
        await plane.ledger.flush(store)
        log = await store.read_claim_log(since=0, until=clock.now() + 1)
        outcomes = {e.org: e.outcome for e in log}
        assert outcomes == {"acme": "open", "globex": "failed", "initech": "pool_cap"}
        assert held.state is ClaimState.BOUND
    finally:
        await plane.stop()


async def test_a_running_plane_accounts_for_every_second_of_every_worker(tmp_path: Path) -> None:
    """The real claim path, passes and readiness events: whatever the workers did, the sum
    of the ledger's states is each worker's whole life (from its row), and every claim is
    one log row with its outcome."""
    store = SqliteStore(str(tmp_path / "stoker.db"))
    runtime = MemoryRuntime(ready_delay=0.2)
    clock = VirtualClock()
    pool = PoolSpec(name="p", template=POOL.template, warm_target=2, hot_idle_ttl=5.0)
    plane = ControlPlane(store=store, runtime=runtime, activator=runtime, pools=[pool], clock=clock)
    await plane.start(loops=False)
    try:
        await asyncio.sleep(1.0)
        t0 = clock.now()
        first = await plane.claim(ClaimRequest(pool="p", org="acme", timeout_s=5.0))
        await asyncio.sleep(30.0)
        await plane.release(first.id)
        second = await plane.claim(ClaimRequest(pool="p", org="acme", timeout_s=5.0))
        cold = await plane.claim(
            ClaimRequest(pool="p", org="globex", mode=ClaimMode.COLD, timeout_s=5.0)
        )
        await asyncio.sleep(10.0)
        await plane.release(second.id)
        await plane.release(cold.id)
        for _ in range(5):
            await plane.run_janitor_pass()
            await asyncio.sleep(3.0)
        await plane.run_reaper_pass()
        now = clock.now()
        rows = await store.read_ledger("p", since=t0 - HOUR_S, until=now + 1)
        total = LedgerCounts()
        for _, counts in rows:
            total.merge(counts)
        workers = await store.list_workers()
        lived = sum((w.updated_at if w.state is S.RETIRED else now) - w.created_at for w in workers)
        counted = total.starting_s + total.warm_s + total.hot_s + total.hot_idle_s
        assert counted + total.draining_s == pytest.approx(lived, abs=1e-6)
        assert total.hot_s > 40 and total.hot_idle_s > 0 and total.warm_s > 0
        assert (total.claims_warm, total.claims_reuse, total.claims_cold) == (1, 1, 1)
        assert total.spawns == len(workers) and total.ready >= 3
        log = await store.read_claim_log(since=0, until=now + 1)
        assert sorted(e.id for e in log) == sorted([first.id, second.id, cold.id])
        assert {e.outcome for e in log} == {"released"}
        assert all(e.held_s is not None and e.held_s > 0 for e in log)
    finally:
        await plane.stop()


async def test_moves_another_replica_wrote_are_placed_at_their_write(store: Store) -> None:
    """The leader drains one of this replica's workers and retires another: the owner's
    next flush places each change at the row's write, not at the flush."""
    clock = ManualClock()
    ledger, life, _ = wire(store, clock)
    leader = Lifecycle(store, clock, Metrics(CollectorRegistry()))  # no ledger hooks
    t0 = clock.now()
    slots = await life.reserve_slots(
        SpawnRequest(pool="p", revision=POOL.revision, count=2, owner=ME), ["w-x", "w-y"]
    )
    clock.advance(5)
    x, y = [await life.move(w, S.WARM, endpoint="http://w") for w in slots.workers]
    assert x is not None and y is not None
    clock.advance(45)
    drained = await leader.move(x, S.DRAINING, reason="excess")
    gone = await leader.move(y, S.DRAINING, reason="excess")
    assert drained is not None and gone is not None
    assert await leader.move(gone, S.RETIRED, reason="excess") is not None
    clock.advance(50)
    await ledger.flush(store)
    total = LedgerCounts()
    for _, counts in await store.read_ledger("p", since=t0 - 1, until=t0 + 101):
        total.merge(counts)
    assert total.starting_s == pytest.approx(5 + 5)
    assert total.warm_s == pytest.approx(45 + 45)
    # x drains from the leader's write on; y's time ends at its retirement.
    assert total.draining_s == pytest.approx(50)


async def test_a_retired_pods_terminating_time_is_counted_by_its_retirer_up_to_a_bound(
    store: Store,
) -> None:
    """Three pods of 250m and 1 GiB retired 5 s before an hour's end, after 1 s draining:
    w-a's pod is gone 12 s after its delete (12 s more of draining, split 5 + 7 across the
    hours), w-b's goes only once its kubelet is back, 200 s later (counted up to
    `stop_grace_s` + the margin: 40 s), w-c's never (nothing more, forgotten). Another
    replica, told of w-a's end too (its informer sees the deletion), counts nothing."""
    pods = dataclasses.replace(
        POOL, template=PodTemplate(image="worker", cpu="250m", memory="1Gi"), cost=None
    )
    catalog = Catalog({"p": pods}, {}, derived_cap=lambda _: 0)
    boundary = hour_of(472_223 * HOUR_S)  # an hour's start
    clock = ManualClock(start=boundary - 106)
    ledger, life, _ = wire(store, clock, catalog)
    other = Ledger(
        clock=clock, catalog=catalog, instance_id="replica-2", metrics=Metrics(CollectorRegistry())
    )
    t0 = clock.now()
    slots = await life.reserve_slots(
        SpawnRequest(pool="p", revision=pods.revision, count=3, owner=ME), ["w-a", "w-b", "w-c"]
    )
    clock.advance(100)
    drained = [await life.move(w, S.DRAINING, reason="excess") for w in slots.workers]
    clock.advance(1)
    for draining in drained:
        assert draining is not None and await life.move(draining, S.RETIRED) is not None
    retired = clock.now()
    assert retired == boundary - 5
    ledger.terminated("w-a", retired + 12)
    other.terminated("w-a", retired + 12)
    clock.advance(30)
    await ledger.flush(store)
    await other.flush(store)
    clock.advance(170)
    ledger.terminated("w-b", retired + 200)
    clock.advance(TERMINATING_KEEP_S + 60)
    await ledger.flush(store)
    ledger.terminated("w-c", clock.now())  # forgotten by now: ignored
    await ledger.flush(store)

    rows = await store.read_ledger("p", since=t0 - 1, until=clock.now() + 1)
    assert {key.org for key, _ in rows} == {""}
    by_hour = {key.hour: counts for key, counts in rows}
    assert set(by_hour) == {boundary - HOUR_S, boundary}
    total = LedgerCounts()
    for _, counts in rows:
        total.merge(counts)
    assert total.starting_s == pytest.approx(3 * 100)
    # 1 s of draining each before the retirement; then w-a's 12 s and w-b's 10 + 30 s.
    assert total.draining_s == pytest.approx(3 * 1 + 12 + 40)
    assert by_hour[boundary].draining_s == pytest.approx(7 + 35)
    assert (total.cpu_s, total.gib_s) == pytest.approx((0.25 * (300 + 55), 1.0 * (300 + 55)))
    # The other replica retired none of them: it wrote no cell.
    assert await store.ledger_written_at("replica-2") is None


async def test_a_worker_another_replica_takes_is_counted_once(stores: list[Store]) -> None:
    """Replica 2 takes replica 1's warm worker for a claim, and the session ends before
    replica 1's next flush: replica 1 counts the worker warm up to the take, not up to the
    row's later writes (replica 2 counts it from the take on), so its whole life is counted
    once."""
    clock = ManualClock()
    mine, life, _ = wire(stores[0], clock)
    theirs, other, _ = wire(stores[1], clock, instance_id="replica-2")
    t0 = clock.now()
    slots = await life.reserve_slots(
        SpawnRequest(pool="p", revision=POOL.revision, count=1, owner=ME), ["w-t"]
    )
    clock.advance(5)
    warm = await life.move(slots.workers[0], S.WARM, endpoint="http://t")
    assert warm is not None
    clock.advance(5)
    await mine.flush(stores[0])
    clock.advance(10)  # t0 + 20: the take
    reserved = await other.reserve(warm, org="acme", org_cap=0, owner="replica-2", activate=True)
    taken = reserved.worker or pytest.fail("not taken")
    if taken.state is S.RESERVED:
        taken = await other.move(taken, S.ACTIVATING, activated=True) or pytest.fail("no")
    clock.advance(1)
    claim = dataclasses.replace(claim_for(taken, clock.now()), owner="replica-2")
    taken = await other.bind(taken, claim) or pytest.fail("not hot")
    clock.advance(2)
    ended = await other.end_claim(
        claim, state=ClaimState.RELEASED, worker_to=S.HOT_IDLE, idle_since=clock.now()
    )
    assert ended is not None
    clock.advance(7)  # t0 + 30
    await mine.flush(stores[0])
    await theirs.flush(stores[1])
    total = LedgerCounts()
    for _, cell in await stores[1].read_ledger("p", since=t0 - 1, until=t0 + 31):
        total.merge(cell)
    assert total.starting_s == pytest.approx(5 + 1)
    assert total.warm_s == pytest.approx(15)
    assert total.hot_s == pytest.approx(2)
    assert total.hot_idle_s == pytest.approx(7)
    worker_s = total.starting_s + total.warm_s + total.hot_s + total.hot_idle_s
    assert worker_s == pytest.approx(30)


@pytest.mark.parametrize(
    "again",
    [
        ["back by its owner"],
        ["by the taker"],
        ["by a third replica"],
        ["by a third replica", "back by its owner"],
        ["by a third replica", "by the taker"],
        ["by a third replica", "by the taker", "by a third replica", "back by its owner"],
    ],
    ids=lambda again: ", then ".join(again),
)
async def test_a_worker_taken_again_between_flushes_is_counted_once(
    stores: list[Store], again: list[str]
) -> None:
    """Replica 2 takes replica 1's warm worker for a session that ends within the pass, and
    the worker is taken again, once or more, before replica 1's next flush: back by
    replica 1, by replica 2 once more, or by replica 3. Replica 1 counts it warm up to the
    first take only (replica 2 counts it from there), however often it changed hands
    since (the row keeps the last two changes, the store every one), so its whole life
    is counted once."""
    clock = ManualClock()
    mine, life, _ = wire(stores[0], clock)
    theirs, other, _ = wire(stores[1], clock, instance_id="replica-2")
    third, third_life, _ = wire(stores[1], clock, instance_id="replica-3")
    t0 = clock.now()

    async def session(by: Lifecycle, owner: str, worker: Worker, claim_id: str) -> Worker:
        """A session of acme through `by`: reserved now, hot 1 s later for 2 s, then parked."""
        reserved = await by.reserve(worker, org="acme", org_cap=0, owner=owner, activate=True)
        taken = reserved.worker or pytest.fail("not taken")
        if taken.state is S.RESERVED:
            taken = await by.move(taken, S.ACTIVATING, activated=True) or pytest.fail("no")
        clock.advance(1)
        claim = dataclasses.replace(claim_for(taken, clock.now()), id=claim_id, owner=owner)
        taken = await by.bind(taken, claim) or pytest.fail("not hot")
        clock.advance(2)
        ended = await by.end_claim(
            claim, state=ClaimState.RELEASED, worker_to=S.HOT_IDLE, idle_since=clock.now()
        )
        assert ended is not None
        return await stores[0].get_worker(worker.id) or pytest.fail("gone")

    slots = await life.reserve_slots(
        SpawnRequest(pool="p", revision=POOL.revision, count=1, owner=ME), ["w-t"]
    )
    clock.advance(5)
    warm = await life.move(slots.workers[0], S.WARM, endpoint="http://t")
    assert warm is not None
    clock.advance(5)
    await mine.flush(stores[0])
    clock.advance(10)  # t0 + 20: the first take, by replica 2
    parked = await session(other, "replica-2", warm, "c-1")
    takers = {
        "back by its owner": (life, ME),
        "by the taker": (other, "replica-2"),
        "by a third replica": (third_life, "replica-3"),
    }
    for number, who in enumerate(again, start=2):
        clock.advance(2)  # t0 + 25, t0 + 30, ...: the next take
        by, owner = takers[who]
        parked = await session(by, owner, parked, f"c-{number}")
    clock.advance(2)  # t0 + 30 after one more take, 5 s later for each further one
    end = 25 + 5 * len(again)
    await mine.flush(stores[0])
    await theirs.flush(stores[1])
    await third.flush(stores[1])
    total = LedgerCounts()
    for _, cell in await stores[1].read_ledger("p", since=t0 - 1, until=t0 + end + 1):
        total.merge(cell)
    sessions = 1 + len(again)
    assert total.starting_s == pytest.approx(5 + sessions)
    assert total.warm_s == pytest.approx(15)
    assert total.hot_s == pytest.approx(2 * sessions)
    assert total.hot_idle_s == pytest.approx(2 * sessions)
    worker_s = total.starting_s + total.warm_s + total.hot_s + total.hot_idle_s
    assert worker_s == pytest.approx(end)


async def test_a_take_that_commits_after_the_owners_flush_read_the_row_ends_its_count_there(
    stores: list[Store],
) -> None:
    """Replica 2's take of replica 1's warm worker is stamped when it is sent (t0 + 20) and
    commits after replica 1's flush read the row as its own (at t0 + 22): that flush
    counted the worker warm up to t0 + 22. Replica 3 takes it next (t0 + 25). Replica 1
    counts no more at its next flush: the first take since its span opened is before what
    it counted, so only those 2 s are counted twice, not the time up to the later take."""
    clock = ManualClock()
    mine, life, _ = wire(stores[0], clock)
    theirs, other, _ = wire(stores[1], clock, instance_id="replica-2")
    third, third_life, _ = wire(stores[1], clock, instance_id="replica-3")
    t0 = clock.now()
    slots = await life.reserve_slots(
        SpawnRequest(pool="p", revision=POOL.revision, count=1, owner=ME), ["w-c"]
    )
    clock.advance(5)
    warm = await life.move(slots.workers[0], S.WARM, endpoint="http://c") or pytest.fail("no")
    clock.advance(17)  # t0 + 22: replica 1 flushes before the take commits
    await mine.flush(stores[0])
    clock.t -= 2  # the take, as sent at t0 + 20
    taken = (
        await other.reserve(warm, org="acme", org_cap=0, owner="replica-2")
    ).worker or pytest.fail("not taken")
    assert taken.taken_at == t0 + 20
    clock.advance(5)  # t0 + 25: replica 3 takes it from replica 2
    moved = await other.move(taken, S.WARM, org=None) or pytest.fail("not released")
    again = (
        await third_life.reserve(moved, org="acme", org_cap=0, owner="replica-3")
    ).worker or pytest.fail("not taken again")
    clock.advance(5)  # t0 + 30
    for ledger, store in ((mine, stores[0]), (theirs, stores[1]), (third, stores[1])):
        await ledger.flush(store)
    total = LedgerCounts()
    for _, cell in await stores[1].read_ledger("p", since=t0 - 1, until=t0 + 31):
        total.merge(cell)
    assert again.owner == "replica-3"
    # Starting 0-5; warm 5-22 (replica 1) and, from the take, 20-25 (replica 2: reserved,
    # then warm again); starting 25-30 (replica 3's reservation).
    assert total.warm_s + total.starting_s == pytest.approx(30 + 2)


async def test_a_release_through_another_replica_is_placed_when_the_owner_takes_it_again(
    stores: list[Store],
) -> None:
    """Replica 1's session is released through replica 2 (the worker stays replica 1's,
    parked), and replica 1 takes the parked worker for the next session before its next
    flush. Replica 1 counts the session hot up to the release and the worker parked from
    there (its `idle_since`), not hot up to its own next write."""
    clock = ManualClock()
    mine, life, _ = wire(stores[0], clock)
    theirs, other, _ = wire(stores[1], clock, instance_id="replica-2")
    t0 = clock.now()
    slots = await life.reserve_slots(
        SpawnRequest(pool="p", revision=POOL.revision, count=1, owner=ME), ["w-r"]
    )
    clock.advance(5)
    worker = await life.move(slots.workers[0], S.WARM, endpoint="http://r") or pytest.fail(
        "not warm"
    )
    clock.advance(5)
    await mine.flush(stores[0])
    for number, releaser in ((1, other), (2, life)):
        # t0 + 10 (and t0 + 17): reserved by replica 1, hot 1 s later for 2 s.
        reserved = await life.reserve(worker, org="acme", org_cap=0, owner=ME, activate=True)
        worker = reserved.worker or pytest.fail("not reserved")
        if worker.state is S.RESERVED:
            worker = await life.move(worker, S.ACTIVATING, activated=True) or pytest.fail(
                "not activating"
            )
        clock.advance(1)
        claim = dataclasses.replace(claim_for(worker, clock.now()), id=f"c-{number}")
        worker = await life.bind(worker, claim) or pytest.fail("not hot")
        clock.advance(2)
        ended = await releaser.end_claim(
            claim, state=ClaimState.RELEASED, worker_to=S.HOT_IDLE, idle_since=clock.now()
        )
        worker = (ended or pytest.fail("not ended"))[1]
        clock.advance(4)
    await mine.flush(stores[0])  # t0 + 24
    await theirs.flush(stores[1])
    total = LedgerCounts()
    for _, cell in await stores[1].read_ledger("p", since=t0 - 1, until=t0 + 25):
        total.merge(cell)
    assert total.starting_s == pytest.approx(5 + 1 + 1)
    assert total.warm_s == pytest.approx(5)
    assert total.hot_s == pytest.approx(2 + 2)
    assert total.hot_idle_s == pytest.approx(4 + 4)
    assert total.starting_s + total.warm_s + total.hot_s + total.hot_idle_s == pytest.approx(24)


async def test_a_replica_that_lost_a_worker_counts_it_once_when_it_writes_its_row(
    stores: list[Store],
) -> None:
    """Replica 2 took replica 1's warm worker for a session, and replica 1 took it back
    for one of its own before replica 2's next flush; that session is released through
    replica 2. Replica 2's write of replica 1's row ends replica 2's time at replica 1's
    take, not at the write: each second is counted once."""
    clock = ManualClock()
    mine, life, _ = wire(stores[0], clock)
    theirs, other, _ = wire(stores[1], clock, instance_id="replica-2")
    t0 = clock.now()
    slots = await life.reserve_slots(
        SpawnRequest(pool="p", revision=POOL.revision, count=1, owner=ME), ["w-l"]
    )
    clock.advance(5)
    worker = await life.move(slots.workers[0], S.WARM, endpoint="http://l") or pytest.fail(
        "not warm"
    )
    clock.advance(5)
    for number, (taker, owner) in enumerate(((other, "replica-2"), (life, ME)), start=1):
        # t0 + 10 (and t0 + 17): reserved, hot 1 s later for 2 s, released via replica 2.
        reserved = await taker.reserve(worker, org="acme", org_cap=0, owner=owner, activate=True)
        worker = reserved.worker or pytest.fail("not reserved")
        if worker.state is S.RESERVED:
            worker = await taker.move(worker, S.ACTIVATING, activated=True) or pytest.fail(
                "not activating"
            )
        clock.advance(1)
        claim = dataclasses.replace(claim_for(worker, clock.now()), id=f"c-{number}", owner=owner)
        worker = await taker.bind(worker, claim) or pytest.fail("not hot")
        clock.advance(2)
        ended = await other.end_claim(
            claim, state=ClaimState.RELEASED, worker_to=S.HOT_IDLE, idle_since=clock.now()
        )
        worker = (ended or pytest.fail("not ended"))[1]
        clock.advance(4)
    await mine.flush(stores[0])  # t0 + 24
    await theirs.flush(stores[1])
    total = LedgerCounts()
    for _, cell in await stores[1].read_ledger("p", since=t0 - 1, until=t0 + 25):
        total.merge(cell)
    assert total.starting_s == pytest.approx(5 + 1 + 1)
    assert total.warm_s == pytest.approx(5)
    assert total.hot_s == pytest.approx(2 + 2)
    assert total.hot_idle_s == pytest.approx(4 + 4)
    assert total.starting_s + total.warm_s + total.hot_s + total.hot_idle_s == pytest.approx(24)


async def test_a_graceful_restart_loses_no_second_of_an_adopted_workers_time(
    tmp_path: Path,
) -> None:
    """A claim held across a clean stop and the next start (which adopts the running
    workers): the ledger's hot time is the claim's hold, and the sum of every state is each
    worker's whole life, the seconds between the stop and the adoption included."""
    db = str(tmp_path / "stoker.db")
    runtime = MemoryRuntime(ready_delay=0.2)
    clock = VirtualClock()
    pool = PoolSpec(name="p", template=POOL.template, warm_target=1)

    def plane() -> ControlPlane:
        return ControlPlane(
            store=SqliteStore(db), runtime=runtime, activator=runtime, pools=[pool], clock=clock
        )

    first = plane()
    await first.start(loops=False)
    await asyncio.sleep(1.0)
    t0 = clock.now()
    claim = await first.claim(ClaimRequest(pool="p", org="acme", timeout_s=5.0))
    await asyncio.sleep(20.0)
    await first.stop()
    await asyncio.sleep(9.0)  # the restart
    second = plane()
    await second.start(loops=False)
    try:
        hot = await second.store.get_worker(claim.worker_id)
        assert hot is not None and hot.owner == second.instance_id and hot.state is S.HOT
        await asyncio.sleep(30.0)
        await second.release(claim.id)
        await asyncio.sleep(2.0)
        await second.run_reaper_pass()
        now = clock.now()
        total = LedgerCounts()
        for _, counts in await second.store.read_ledger("p", since=t0 - HOUR_S, until=now + 1):
            total.merge(counts)
        (logged,) = await second.store.read_claim_log(since=0, until=now + 1)
        assert logged.held_s == pytest.approx(59.0, abs=0.01)
        assert total.hot_s == pytest.approx(logged.held_s, abs=0.01)
        workers = await second.store.list_workers()
        lived = sum((w.updated_at if w.state is S.RETIRED else now) - w.created_at for w in workers)
        counted = total.starting_s + total.warm_s + total.hot_s + total.hot_idle_s
        assert counted + total.draining_s == pytest.approx(lived, abs=1e-6)
    finally:
        await second.stop()


async def test_after_a_crash_the_adopter_counts_from_the_last_ledger_write(
    tmp_path: Path,
) -> None:
    """A replica killed outright after a flush: the worker was not moved since, so its
    adopter counts it from that flush on, through the expiry wait, and nothing is lost."""
    db = str(tmp_path / "stoker.db")
    runtime = MemoryRuntime(ready_delay=0.2)
    clock = VirtualClock()
    pool = PoolSpec(name="p", template=POOL.template, warm_target=1)

    def plane() -> ControlPlane:
        return ControlPlane(
            store=SqliteStore(db), runtime=runtime, activator=runtime, pools=[pool], clock=clock
        )

    crashed = plane()
    await crashed.start(loops=False)
    await asyncio.sleep(1.0)
    claim = await crashed.claim(ClaimRequest(pool="p", org="acme", timeout_s=5.0))
    await asyncio.sleep(20.0)
    await crashed.run_reaper_pass()
    await asyncio.sleep(5.0)
    await crashed.store.close()  # no clean stop: the instance row stays active
    survivor = plane()
    await survivor.start(loops=False)
    try:
        await asyncio.sleep(PlaneSettings().instance_expiry_s + 1)
        await survivor.run_janitor_pass()
        hot = await survivor.store.get_worker(claim.worker_id)
        assert hot is not None and hot.owner == survivor.instance_id
        await asyncio.sleep(10.0)
        await survivor.release(claim.id)
        await survivor.run_reaper_pass()
        now = clock.now()
        total = LedgerCounts()
        for _, counts in await survivor.store.read_ledger("p", since=0, until=now + 1):
            total.merge(counts)
        (logged,) = await survivor.store.read_claim_log(since=0, until=now + 1)
        assert logged.held_s is not None and logged.held_s > 35 + PlaneSettings().instance_expiry_s
        assert total.hot_s == pytest.approx(logged.held_s, abs=0.01)
    finally:
        await survivor.stop()


async def test_a_replicas_last_ledger_write_is_read_back(store: Store) -> None:
    assert await store.ledger_written_at(ME) is None
    key = LedgerKey("p", POOL.revision, "acme", hour_of(1_700_000_000.0))
    cells = {key: LedgerCounts(hot_s=5.0)}
    await store.record_ledger(ME, cells, now=1_700_000_010.0)
    await store.record_ledger(ME, cells, now=1_700_000_020.0)
    await store.record_ledger("replica-2", cells, now=1_700_000_030.0)
    assert await store.ledger_written_at(ME) == pytest.approx(1_700_000_020.0)


@pytest.mark.parametrize("ends_reported", [True, False])
async def test_a_stopping_replica_counts_its_terminating_pods_up_to_its_stop(
    store: Store, ends_reported: bool
) -> None:
    """The replica stops 7 s after retiring w-a, whose pod still terminates: no report of
    its end will reach it, so its final flush counts those 7 s as draining (none before).
    w-b's spawn failed: it has no pod, and nothing is counted after its retirement. With a
    runtime that reports no ends (local processes: a stop waits for the exit) there is
    nothing to count after a retirement."""
    pods = dataclasses.replace(
        POOL, template=PodTemplate(image="worker", cpu="250m", memory="1Gi"), cost=None
    )
    catalog = Catalog({"p": pods}, {}, derived_cap=lambda _: 0)
    clock = ManualClock(start=hour_of(472_223 * HOUR_S) + 60)
    ledger = Ledger(
        clock=clock,
        catalog=catalog,
        instance_id=ME,
        metrics=Metrics(CollectorRegistry()),
        ends_reported=ends_reported,
    )
    life = Lifecycle(store, clock, Metrics(CollectorRegistry()))
    life.on_moved = ledger.moved
    t0 = clock.now()
    a, b = (
        await life.reserve_slots(
            SpawnRequest(pool="p", revision=pods.revision, count=2, owner=ME), ["w-a", "w-b"]
        )
    ).workers
    clock.advance(100)
    draining = await life.move(a, S.DRAINING, reason="excess")
    assert draining is not None
    clock.advance(1)
    assert await life.move(draining, S.RETIRED) is not None
    assert await life.move(b, S.RETIRED, reason="spawn_failure") is not None
    clock.advance(7)
    await ledger.flush(store, final=True)

    total = LedgerCounts()
    for _, counts in await store.read_ledger("p", since=t0 - 1, until=clock.now() + 1):
        total.merge(counts)
    assert total.starting_s == pytest.approx(100 + 101)
    assert total.draining_s == pytest.approx(1 + 7 if ends_reported else 1)


async def test_a_move_written_later_than_this_replicas_clock_counts_from_its_write(
    store: Store,
) -> None:
    """The leader's clock runs 3 s ahead: its drain of this replica's worker w-x is
    written at a time this replica's flushes have not reached. w-x drains from that write
    on, not before (the flush in between counts nothing of it), until this replica
    retires it with w-y, which it drained itself. Open spans are carried by group at a
    flush: w-x's waits in w-y's group until its own start."""
    clock = ManualClock()
    ledger, life, _ = wire(store, clock)
    leader_clock = ManualClock(start=clock.now() + 3)
    leader = Lifecycle(store, leader_clock, Metrics(CollectorRegistry()))
    t0 = clock.now()
    slots = (
        await life.reserve_slots(
            SpawnRequest(pool="p", revision=POOL.revision, count=2, owner=ME), ["w-x", "w-y"]
        )
    ).workers
    clock.advance(5)
    leader_clock.advance(5)
    x, y = [await life.move(w, S.WARM, endpoint="http://w") for w in slots]
    assert x is not None and y is not None
    clock.advance(45)
    leader_clock.advance(45)
    y_draining = await life.move(y, S.DRAINING, reason="excess")
    x_draining = await leader.move(x, S.DRAINING, reason="excess")
    assert y_draining is not None and x_draining is not None
    assert x_draining.updated_at == clock.now() + 3
    await ledger.flush(store)  # w-x's warm time ends now; its drain starts 3 s on
    clock.advance(1)
    await ledger.flush(store)
    clock.advance(9)
    assert await life.move(x_draining, S.RETIRED) is not None
    assert await life.move(y_draining, S.RETIRED) is not None
    await ledger.flush(store)

    total = LedgerCounts()
    for _, counts in await store.read_ledger("p", since=t0 - 1, until=clock.now() + 1):
        total.merge(counts)
    assert total.starting_s == pytest.approx(2 * 5)
    assert total.warm_s == pytest.approx(2 * 45)
    assert total.draining_s == pytest.approx(10 + (10 - 3))
