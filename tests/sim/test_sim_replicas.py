"""The scale test's replicas and what watches them: the replicas are built by the builder
`stoker serve` uses, their store wrapper passes everything through and reports every
write, and the invariant checker judges the rows as written, whatever the store."""

from __future__ import annotations

import random
from typing import Any

import pytest

from stoker import bootstrap
from stoker.adapters.sqlite import SqliteStore
from stoker.control.plane import ControlPlane
from stoker.domain.records import Claim, Worker
from stoker.domain.specs import PodTemplate, PoolSpec, Timeouts
from stoker.domain.states import ClaimMode, ClaimSource, ClaimState, WorkerState
from stoker.ports.clock import LoopClock
from stoker.ports.store import SpawnRequest
from stoker.sim import replicas
from stoker.sim.cluster import SimCluster
from stoker.sim.invariants import InvariantChecker
from stoker.sim.observed import ObservedStore
from stoker.sim.scenario import load_scenario
from stoker.sim.written import WrittenRows

T0 = 1_700_000_000.0


class Recorder:
    """An `Observer` that keeps every report."""

    def __init__(self) -> None:
        self.reports: list[tuple[Any, ...]] = []

    def worker_written(self, replica: int, before: WorkerState | None, worker: Worker) -> None:
        self.reports.append(("worker", replica, before, worker.state))

    def claim_bound(self, replica: int, claim: Claim) -> None:
        self.reports.append(("bound", replica, claim.id))

    def claim_renewed(self, replica: int, claim: Claim) -> None:
        self.reports.append(("renewed", replica, claim.id, claim.expires_at))

    def claim_ended(self, replica: int, claim: Claim) -> None:
        self.reports.append(("ended", replica, claim.id, claim.state))

    def spawn_reserved(self, replica: int, req: SpawnRequest, reserved: int) -> None:
        self.reports.append(("spawn", replica, req.pool, reserved))

    def activation(self, worker_id: str, org: str, epoch: int) -> None:
        self.reports.append(("activation", worker_id, org, epoch))

    def leader_changed(self, replica: int, leading: bool) -> None:
        self.reports.append(("leader", replica, leading))


def claim_for(worker: Worker, claim_id: str, now: float, lease_s: float = 60.0) -> Claim:
    assert worker.org is not None
    return Claim(
        id=claim_id,
        pool=worker.pool,
        org=worker.org,
        worker_id=worker.id,
        worker_epoch=worker.epoch,
        source=ClaimSource.WARM,
        mode=ClaimMode.PREFER_WARM,
        state=ClaimState.BOUND,
        token=f"token-{claim_id}",
        endpoint="10.0.0.1:8080",
        lease_s=lease_s,
        expires_at=now + lease_s,
        created_at=now,
        updated_at=now,
        owner="cp-a",
    )


async def hot_worker(store: Any, worker_id: str, org: str, now: float) -> tuple[Worker, Claim]:
    """A worker taken from spawning to hot for `org` through the port."""
    (spawned,) = (
        await store.reserve_spawn_slots(
            SpawnRequest(pool="p", revision="r1", count=1, owner="cp-a"), [worker_id], now
        )
    ).workers
    warm = await store.transition(
        worker_id,
        expect=WorkerState.SPAWNING,
        epoch=0,
        version=spawned.version,
        to=WorkerState.WARM,
        now=now,
    )
    reserved = (
        await store.reserve(
            worker_id,
            expect=WorkerState.WARM,
            epoch=warm.epoch,
            version=warm.version,
            org=org,
            org_cap=0,
            owner="cp-a",
            now=now,
        )
    ).worker
    activating = await store.transition(
        worker_id,
        expect=WorkerState.RESERVED,
        epoch=reserved.epoch,
        version=reserved.version,
        to=WorkerState.ACTIVATING,
        now=now,
        changes={"activated": True},
    )
    claim = claim_for(activating, f"c-{worker_id}", now)
    hot = await store.bind(
        worker_id, epoch=activating.epoch, version=activating.version, claim=claim, now=now
    )
    assert hot is not None and spawned.state is WorkerState.SPAWNING
    return hot, claim


async def test_the_store_wrapper_reports_every_write_and_passes_the_rest_through() -> None:
    inner = SqliteStore(":memory:")
    recorder = Recorder()
    store = ObservedStore(inner, replica=2, observer=recorder)
    await store.open()
    try:
        hot, claim = await hot_worker(store, "w-1", "acme", T0)
        # A write that keeps the state is reported too (with that state as `before`).
        await store.transition(
            "w-1",
            expect=WorkerState.HOT,
            epoch=hot.epoch,
            version=hot.version,
            to=WorkerState.HOT,
            now=T0 + 1,
        )
        await store.renew_claim(claim.id, expires_at=T0 + 120, now=T0 + 1)
        await store.end_claim(
            claim.id, state=ClaimState.RELEASED, worker_to=WorkerState.HOT_IDLE, now=T0 + 2
        )
        # Reads are the store's own methods, unwrapped.
        assert store.list_workers == inner.list_workers
        assert [w.state for w in await store.list_workers()] == [WorkerState.HOT_IDLE]
    finally:
        await store.close()
        # The shared store outlives a replica's handle on it.
        assert await inner.get_worker("w-1") is not None
        await inner.close()
    assert recorder.reports == [
        ("worker", 2, None, WorkerState.SPAWNING),
        ("spawn", 2, "p", 1),
        ("worker", 2, WorkerState.SPAWNING, WorkerState.WARM),
        ("worker", 2, WorkerState.WARM, WorkerState.RESERVED),
        ("worker", 2, WorkerState.RESERVED, WorkerState.ACTIVATING),
        ("bound", 2, "c-w-1"),
        ("worker", 2, WorkerState.ACTIVATING, WorkerState.HOT),
        ("worker", 2, WorkerState.HOT, WorkerState.HOT),
        ("renewed", 2, "c-w-1", T0 + 120),
        ("ended", 2, "c-w-1", ClaimState.RELEASED),
        ("worker", 2, WorkerState.HOT, WorkerState.HOT_IDLE),
    ]


def worker(worker_id: str, state: WorkerState, *, org: str | None = None, t: float = T0) -> Worker:
    return Worker(
        id=worker_id,
        pool="p",
        revision="r1",
        state=state,
        epoch=1,
        owner="cp-a",
        created_at=t,
        updated_at=t,
        org=org,
    )


def test_written_rows_follow_each_worker_and_list_in_creation_order() -> None:
    rows = WrittenRows()
    for worker_id in ("w-b", "w-a", "w-c"):
        rows.worker_written(worker(worker_id, WorkerState.SPAWNING))
    rows.worker_written(worker("w-b", WorkerState.WARM))
    rows.worker_written(worker("w-a", WorkerState.HOT_IDLE, org="acme"))
    rows.worker_written(worker("w-c", WorkerState.RETIRED))
    assert sorted(rows.workers) == ["w-a", "w-b"]
    assert rows.neutral[("p", "r1")] == 1
    assert list(rows.org_counts()) == [("p", None, 1), ("p", "acme", 1)]
    rows.worker_written(worker("w-b", WorkerState.HOT_IDLE, org="beta"))
    # Not by id: by when each row was created (w-b first).
    assert [w.id for w in rows.in_states(WorkerState.HOT_IDLE)] == ["w-b", "w-a"]


def checker(wall: list[float]) -> InvariantChecker:
    pool = PoolSpec(name="p", template=PodTemplate(image="w"), timeouts=Timeouts())
    return InvariantChecker(
        now=lambda: wall[0] - T0,
        wall=lambda: wall[0],
        pools={"p": pool},
        pool_cap=lambda _pool: 0,
        org_cap=lambda _pool, _org: 0,
        floor=lambda _pool, _org: 0,
        pass_s=10.0,
        check_interval_s=5.0,
    )


async def test_the_checker_judges_the_rows_as_the_replicas_wrote_them() -> None:
    """I1, I3 and I2 from the reports alone: the store itself is never read."""
    wall = [T0]
    check = checker(wall)
    store = ObservedStore(SqliteStore(":memory:"), replica=0, observer=check)
    await store.open()
    try:
        hot, claim = await hot_worker(store, "w-1", "acme", T0)
        # A second bound claim on the same worker: I1.
        check.claim_bound(1, claim_for(hot, "c-other", T0))
        # The lease runs out and nobody ends the claim: I3 after two passes.
        wall[0] = T0 + claim.lease_s + 21
        check.check()
        # The same worker activated for another org: I2.
        check.activation("w-1", "beta", hot.epoch + 1)
    finally:
        await store.inner.close()
    found = {(v.invariant, v.subject) for v in check.violations}
    assert found == {("I1", "w-1"), ("I3", "c-w-1"), ("I3", "c-other"), ("I2", "w-1")}
    assert check.checks == 1


async def test_every_replica_is_built_by_the_builder_stoker_serve_uses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[ControlPlane] = []

    def recording(**parts: Any) -> ControlPlane:
        plane = bootstrap.build_plane(**parts)
        built.append(plane)
        return plane

    monkeypatch.setattr(replicas, "build_plane", recording)
    scenario = load_scenario("leader-blip", short=True)
    view = scenario.for_policy(scenario.policies[0].name)
    clock = LoopClock()
    cluster = SimCluster(view.cluster_config(), clock=clock, rng=random.Random(1))
    group = replicas.build_replicas(
        scenario=view,
        cluster=cluster,
        store=SqliteStore(":memory:"),
        clock=clock,
        observer=Recorder(),
    )
    assert built == group.planes
    assert len(built) == view.control_plane.replicas > 1
    for plane, runtime, elector in zip(built, group.runtimes, group.electors, strict=True):
        assert plane.runtime is runtime and plane.elector is elector
        assert isinstance(plane.store, ObservedStore)
    assert len({plane.instance_id for plane in built}) == len(built)
