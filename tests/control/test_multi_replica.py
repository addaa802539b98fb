"""Several control-plane replicas in one process on one PostgreSQL schema, with real
demo-worker processes: claims on any replica, a dead leader, lease blips, failed writes.

Real time with short intervals (PostgreSQL I/O is invisible to looptime); every wait is
a bounded poll of an observable condition. The same faults against `stoker serve`
processes are in tests/test_replicas_e2e.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import signal
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import psycopg
import pytest

from fakes import TEST_ACTIVATION_KEY, FaultyStore
from stoker.adapters.activator_http import HttpActivator
from stoker.adapters.elector_store import StoreLeaseElector
from stoker.adapters.postgres import PostgresStore
from stoker.adapters.runtime_local import LocalProcessRuntime
from stoker.control.ids import Ids
from stoker.control.plane import ControlPlane
from stoker.domain.errors import CapacityError, ClaimConflict, OrgCapError, StoreError
from stoker.domain.ledger import LedgerCounts
from stoker.domain.records import Claim, ClaimRequest, Worker
from stoker.domain.specs import PlaneSettings, PoolSpec, ProcessTemplate, Timeouts
from stoker.domain.states import LIVE, ClaimSource, ClaimState, WorkerState
from stoker.ports.clock import LoopClock

pytestmark = [pytest.mark.postgres, pytest.mark.processes]

S = WorkerState
POSTGRES_URL = os.environ.get(
    "STOKER_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
SETTINGS = PlaneSettings(
    janitor_interval_s=0.25,
    reaper_interval_s=0.3,
    instance_heartbeat_s=0.2,
    instance_expiry_s=1.5,
    stranded_grace_s=600,
    shutdown_grace_s=2,
)
LEASE = {"lease_duration_s": 1.5, "renew_deadline_s": 1.0, "retry_period_s": 0.2}


def demo(start_delay: float = 0.0) -> ProcessTemplate:
    argv = [
        "{python}",
        "-m",
        "stoker.demo_worker",
        "--port",
        "{port}",
        "--worker-id",
        "{worker_id}",
    ]
    if start_delay:
        argv += ["--start-delay", str(start_delay)]
    return ProcessTemplate(argv=tuple(argv), memory_mb=32)


def pool(**kw: Any) -> PoolSpec:
    base: dict[str, Any] = {
        "name": "demo",
        "template": demo(),
        "warm_target": 3,
        "hot_idle_ttl": 30,
        "scale_down_delay": 600,
        "timeouts": Timeouts(spawn_s=20, stop_grace_s=2),
    }
    base.update(kw)
    return PoolSpec(**base)


@dataclass
class Replica:
    plane: ControlPlane
    store: FaultyStore
    elector: StoreLeaseElector

    @property
    def id(self) -> str:
        return self.plane.instance_id


class Cluster:
    """N replicas sharing one schema and one worker fleet label."""

    def __init__(self, schema: str, fleet: str) -> None:
        self.schema = schema
        self.fleet = fleet
        self.replicas: list[Replica] = []

    async def add(self, pool_spec: PoolSpec) -> Replica:
        clock = LoopClock()
        ids = Ids()
        instance = ids.instance()
        store = FaultyStore(PostgresStore(POSTGRES_URL, schema=self.schema, max_size=4))
        elector = StoreLeaseElector(store, clock=clock, identity=instance, **LEASE)  # type: ignore[arg-type]
        plane = ControlPlane(
            store=store,
            runtime=LocalProcessRuntime(
                clock=clock,
                fleet=self.fleet,
                instance_id=instance,
                activation_key=TEST_ACTIVATION_KEY,
            ),
            activator=HttpActivator(activation_key=TEST_ACTIVATION_KEY),
            pools=[pool_spec],
            settings=SETTINGS,
            clock=clock,
            elector=elector,
            ids=ids,
            instance_id=instance,
        )
        try:
            await plane.start()
        except StoreError as exc:
            if os.environ.get("CI") == "true":
                raise
            pytest.skip(f"PostgreSQL is not reachable: {exc}")
        replica = Replica(plane, store, elector)
        self.replicas.append(replica)
        return replica

    def leader(self) -> Replica | None:
        leaders = [r for r in self.replicas if r.plane.started and r.elector.is_leader]
        assert len(leaders) <= 1, "two leaders at once"
        return leaders[0] if leaders else None

    async def crash(self, replica: Replica) -> None:
        """Die without a clean shutdown: loops stop, nothing is written, workers live on."""
        loops = list(replica.plane._loops)
        for task in loops:
            task.cancel()
        if loops:
            # A loop that ignored its cancellation would hang the test until its bound:
            # name it, with where it waits, instead.
            _done, pending = await asyncio.wait(loops, timeout=30)
            assert not pending, "loops that ignored their cancellation:\n" + "\n".join(
                _where(task) for task in pending
            )
        replica.plane.book.start_closing()
        for task in replica.plane.book.background_tasks():
            task.cancel()
        await replica.plane.runtime.close()
        await replica.store.close()
        replica.plane.started = False

    async def stop(self) -> None:
        for replica in self.replicas:
            if replica.plane.started:
                await replica.plane.stop(stop_workers=True)


def _where(task: asyncio.Task[Any]) -> str:
    """The task's name and every frame it waits in, down to the innermost await (a task's
    own stack shows only its outermost coroutine)."""
    frames = []
    awaited: Any = task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
        if frame is not None:
            code = frame.f_code
            frames.append(f"  {code.co_filename}:{frame.f_lineno} in {code.co_name}")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
    return f"{task.get_name()}:\n" + "\n".join(frames)


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    fleet = "mr-" + uuid.uuid4().hex[:8]
    c = Cluster("stoker_mr_" + uuid.uuid4().hex[:8], fleet)
    try:
        yield c
    finally:
        await c.stop()
        _kill_fleet(fleet)
        with contextlib.suppress(psycopg.Error):
            async with await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True) as conn:
                await conn.execute(f"DROP SCHEMA IF EXISTS {c.schema} CASCADE")


def _kill_fleet(fleet: str) -> None:
    import psutil

    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("STOKER_FLEET") == fleet:
                os.kill(proc.pid, signal.SIGKILL)


def bounded(
    seconds: float,
) -> Callable[[Callable[..., Awaitable[None]]], Callable[..., Awaitable[None]]]:
    """Fail a test that runs longer than `seconds` with a traceback of where it waited."""

    def wrap(test: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        @functools.wraps(test)
        async def run(*args: Any, **kwargs: Any) -> None:
            async with asyncio.timeout(seconds):
                await test(*args, **kwargs)

        return run

    return wrap


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.05)


async def rows(replica: Replica, *states: WorkerState) -> list[Worker]:
    return await replica.store.list_workers(states=states or None)


async def whoami(claim: Claim) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        response = await http.get(
            claim.endpoint + "/", headers={"Authorization": f"Bearer {claim.token}"}
        )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


@bounded(120)
async def test_any_replica_serves_renews_and_releases(cluster: Cluster) -> None:
    a, b, c = [await cluster.add(pool()) for _ in range(3)]

    async def three_warm() -> bool:
        return len(await rows(a, S.WARM)) >= 3

    await until(three_warm)
    spawners = {w.owner for w in await rows(a, S.WARM)}
    assert len(spawners) == 1  # only the leader reconciles

    # A claim on each replica, whoever spawned the worker.
    claims = [
        await r.plane.claim(ClaimRequest(pool="demo", org=f"org{i}"))
        for i, r in enumerate((a, b, c))
    ]
    assert len({cl.worker_id for cl in claims}) == 3
    for cl in claims:
        assert (await whoami(cl))["org"] == cl.org

    # Renew on one replica, release on another, reuse through a third.
    first = claims[0]
    renewed = await c.plane.renew(first.id)
    assert renewed.expires_at > first.expires_at
    released = await b.plane.release(first.id)
    assert released.state is ClaimState.RELEASED
    again = await c.plane.claim(ClaimRequest(pool="demo", org="org0"))
    assert again.source is ClaimSource.REUSE
    assert again.worker_id == first.worker_id
    assert (await whoami(again))["epoch"] == again.worker_epoch
    with pytest.raises(ClaimConflict):
        await a.plane.renew(first.id)


@bounded(120)
async def test_a_dead_leaders_workers_are_adopted_and_its_spawns_retired(
    cluster: Cluster,
) -> None:
    # Slow-starting workers, so the leader dies while some of its spawns are in flight.
    spec = pool(template=demo(start_delay=3.0), warm_target=2)
    a = await cluster.add(spec)
    await until(lambda: _is_leader(a))
    b, c = await cluster.add(spec), await cluster.add(spec)

    async def two_warm() -> bool:
        return len(await rows(a, S.WARM)) >= 2

    await until(two_warm)
    session = await b.plane.claim(ClaimRequest(pool="demo", org="acme", lease_s=600))
    # More demand: the leader spawns slow workers, then dies with them still spawning.
    await a.plane.spawner.spawn_warm(spec, 2, target=4)
    in_flight = {w.id for w in await rows(a, S.SPAWNING) if w.owner == a.id}
    assert in_flight
    dead_warm = {w.id for w in await rows(a, S.WARM) if w.owner == a.id}
    await cluster.crash(a)

    async def new_leader() -> bool:
        return cluster.leader() is not None

    await until(new_leader, timeout=LEASE["lease_duration_s"] + 3)
    survivor = cluster.leader()
    assert survivor is not None and survivor is not a

    async def adopted() -> bool:
        ws = {w.id: w for w in await rows(survivor)}
        return all(ws[i].state is S.RETIRED for i in in_flight) and all(
            ws[i].owner != a.id or ws[i].state is S.RETIRED for i in dead_warm
        )

    await until(adopted)
    for worker_id in in_flight:
        worker = await survivor.store.get_worker(worker_id)
        assert worker is not None and worker.reason == "orphaned"
    adopted_warm = [w for w in await rows(survivor, S.WARM, S.HOT, S.HOT_IDLE) if w.id in dead_warm]
    assert all(w.owner in {b.id, c.id} for w in adopted_warm)
    # The session kept running through the leader's death.
    assert (await whoami(session))["org"] == "acme"
    assert (await survivor.plane.get_claim(session.id)).state is ClaimState.BOUND


@bounded(120)
async def test_the_fleet_is_reaped_while_the_lease_blinks(cluster: Cluster) -> None:
    spec = pool(hot_idle_ttl=0.5, warm_target=2)
    a = await cluster.add(spec)
    await until(lambda: _is_leader(a))
    b = await cluster.add(spec)

    async def two_warm() -> bool:
        return len(await rows(a, S.WARM)) >= 2

    await until(two_warm)
    # Lease renewals of the leader fail: it steps down; b cannot take over until expiry.
    a.store.fail_leases = True
    parked = await a.plane.claim(ClaimRequest(pool="demo", org="acme"))
    await a.plane.release(parked.id)

    async def reaped() -> bool:
        worker = await b.store.get_worker(parked.worker_id)
        return worker is not None and worker.state is S.RETIRED

    # The parked worker's TTL passes during the blip: a's own fallback reaper retires it.
    await until(reaped, timeout=10)
    worker = await b.store.get_worker(parked.worker_id)
    assert worker is not None and worker.reason == "ttl"
    assert a.plane.metrics.reaper_last_success._value.get() > 0

    async def b_leads() -> bool:
        return cluster.leader() is b

    await until(b_leads, timeout=5)
    a.store.fail_leases = False
    await asyncio.sleep(1.0)
    # a contends again (its elector loop never ended) but b holds the lease.
    assert cluster.leader() is b
    assert not a.plane._loops[0].done()


@bounded(120)
async def test_failed_writes_during_a_workload_break_no_invariant(cluster: Cluster) -> None:
    replicas = [await cluster.add(pool(warm_target=4, max_workers_per_org=3)) for _ in range(3)]

    async def warm() -> bool:
        return len(await rows(replicas[0], S.WARM)) >= 4

    await until(warm)
    for i, r in enumerate(replicas):
        r.store.rate = (0.05, 0.1, 0.2)[i]
    bound: list[Claim] = []
    outcomes: dict[str, int] = defaultdict(int)

    async def session(i: int) -> None:
        r = replicas[i % 3]
        org = f"org{i % 4}"
        try:
            claim = await r.plane.claim(ClaimRequest(pool="demo", org=org, timeout_s=5))
        except (CapacityError, OrgCapError, StoreError) as exc:
            outcomes[type(exc).__name__] += 1
            return
        bound.append(claim)
        assert (await whoami(claim))["org"] == org
        await asyncio.sleep(0.05)
        for attempt in range(20):
            try:
                await replicas[(i + attempt) % 3].plane.release(claim.id)
                break
            except StoreError:
                await asyncio.sleep(0.05)
        outcomes["released"] += 1

    for wave in range(6):
        await asyncio.gather(*(session(wave * 8 + i) for i in range(8)))
    for r in replicas:
        r.store.rate = 0.0

    failures = sum(r.store.failures for r in replicas)
    persist_failures = sum(
        s.value
        for r in replicas
        for metric in r.plane.metrics.registry.collect()
        if metric.name == "stoker_persist_failures"
        for s in metric.samples
        if s.name.endswith("_total")
    )
    assert failures > 0 and persist_failures > 0
    assert outcomes["released"] == len(bound) > 0
    store = replicas[0].store
    # I1/I2: no worker had two overlapping sessions or two orgs.
    by_worker: dict[str, set[str]] = defaultdict(set)
    for claim in await store.list_claims():
        by_worker[claim.worker_id].add(claim.org)
    assert all(len(orgs) == 1 for orgs in by_worker.values())
    assert await store.list_claims(states=[ClaimState.BOUND]) == []

    # Memory is only a hint across replicas (a release on another replica is not seen by
    # the owner's queues), but no write is left pending once the store recovers: the next
    # passes write them, however long a loaded machine takes to run them.
    async def settled() -> bool:
        for r in replicas:
            pending = r.plane.book.pending_facts()
            if (pending.ready, pending.lost, pending.retire) != ({}, {}, {}):
                return False
        return await store.list_workers(states=[S.RESERVED, S.ACTIVATING]) == []

    await until(settled, timeout=30)
    # I5: the org cap held throughout (checked at the end on every live row).
    per_org: dict[str | None, int] = defaultdict(int)
    for w in await store.list_workers(states=LIVE):
        per_org[w.org] += 1
    assert all(n <= 3 for org, n in per_org.items() if org is not None)


async def _is_leader(replica: Replica) -> bool:
    return replica.elector.is_leader


@bounded(120)
async def test_replicas_started_with_different_files_serve_one_stored_revision(
    cluster: Cluster,
) -> None:
    a = await cluster.add(pool(warm_target=2))
    # B's file has another template and target: it proposes a rollout and keeps the store's
    # settings (the store's pool was seeded by A's file, B's file changes it as a file may).
    b = await cluster.add(pool(warm_target=2, template=demo(start_delay=0.05)))
    stable = pool().revision
    for replica in (a, b):
        assert replica.plane.catalog.pool("demo").revision == stable
    (proposed,) = await a.store.list_rollouts()
    assert proposed.revision == pool(template=demo(start_delay=0.05)).revision
    assert proposed.base_revision == stable and proposed.active

    async def two_warm() -> bool:
        return len(await rows(a, S.WARM)) >= 2

    await until(two_warm)
    # An admin's change is in force on every replica within a pass, no restart.
    changed = await b.plane.pools.update("demo", {"warm_target": 3})
    # After the seed and the proposal (and the canary's first step, once it held).
    assert changed.generation in (3, 4)

    async def served_everywhere() -> bool:
        return all(r.plane.catalog.pool("demo").warm_target == 3 for r in (a, b))

    await until(served_everywhere)
    # Both serve the one stored truth: the same stable revision and rollout, and neither
    # retires the other's workers as a stale revision.
    for replica in (a, b):
        await replica.plane.run_reaper_pass()
        assert replica.plane.catalog.pool("demo").revision == stable
        ramp = replica.plane.catalog.rollout("demo")
        assert ramp is not None and ramp.id == proposed.id
    retired = await rows(a, S.RETIRED)
    assert [w for w in retired if w.reason == "rollout"] == []
    assert {w.revision for w in await rows(a, S.WARM)} <= {stable, proposed.revision}


@pytest.mark.parametrize(
    ("replicas", "sessions_per_org", "longest_s"),
    [(2, 12, 0.2), (4, 30, 0.05)],
    ids=["two-replicas", "four-replicas-short-sessions"],
)
@bounded(120)
async def test_claims_and_releases_on_any_replica_count_each_worker_second_once(
    cluster: Cluster, replicas: int, sessions_per_org: int, longest_s: float
) -> None:
    """Five orgs claim and release through replicas picked at random, with sessions
    shorter than a ledger pass, so that workers change hands, and come back, between
    flushes: with four replicas and sessions of 5 to 50 ms, a worker is taken by three
    or more replicas, one after the other, between two flushes of the one it left. After a
    clean stop the ledger holds each worker's whole life once: the time in every state,
    summed over the replicas, is the time the workers lived (from their rows) up to their
    owners' last ledger writes, and the hot time is the sessions'."""
    planes = [await cluster.add(pool(warm_target=2)) for _ in range(replicas)]
    a = planes[0]

    async def two_warm() -> bool:
        return len(await rows(a, S.WARM)) >= 2

    await until(two_warm)
    rng = random.Random(5)
    shortest_s = longest_s / 10

    async def sessions(org: str) -> None:
        for _ in range(sessions_per_org):
            taker, releaser = rng.choice(planes), rng.choice(planes)
            claim = await taker.plane.claim(ClaimRequest(pool="demo", org=org, timeout_s=20))
            await asyncio.sleep(rng.uniform(shortest_s, longest_s))
            await releaser.plane.release(claim.id)
            await asyncio.sleep(rng.uniform(shortest_s, longest_s * 1.5))

    await asyncio.gather(*(sessions(f"org{i}") for i in range(5)))
    for replica in planes:
        await replica.plane.stop(stop_workers=False)
    store = PostgresStore(POSTGRES_URL, schema=cluster.schema, max_size=2)
    await store.open()
    try:
        written: dict[str, float] = {}
        for r in planes:
            written[r.id] = await store.ledger_written_at(r.id) or pytest.fail("no ledger")
        lived = 0.0
        for w in await store.list_workers():
            end = w.updated_at if w.state is S.RETIRED else written[w.owner]
            lived += end - w.created_at
        total = LedgerCounts()
        for _, cell in await store.read_ledger("demo", since=0, until=max(written.values()) + 1):
            total.merge(cell)
        taken = await store.list_claims()
    finally:
        await store.close()
    assert len(taken) == 5 * sessions_per_org
    counted = total.starting_s + total.warm_s + total.hot_s + total.hot_idle_s + total.draining_s
    # Beyond the rows: a retired worker's process ends a few ms after its retirement,
    # which its retirer counts as draining.
    assert counted == pytest.approx(lived, abs=0.05)
    # Each session's time is hot, whichever replica released it and took the worker next.
    held = sum((c.ended_at or 0.0) - c.created_at for c in taken)
    assert total.hot_s == pytest.approx(held, rel=0.05)
