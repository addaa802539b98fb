"""The claim path, sessions and janitor of one replica, on virtual time (looptime).

Workers are `MemoryRuntime` entries (see tests/fakes.py for why); the store is the real
SQLite adapter. Every claim path (docs/concepts/claims.md, and the lifecycle) is driven here; the
same paths with real processes are in tests/test_integration_local.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from fakes import FakeProcess, FaultyStore, MemoryRuntime
from stoker.adapters.sqlite import SqliteStore
from stoker.control.plane import ControlPlane
from stoker.domain.errors import (
    CapacityError,
    ClaimConflict,
    NotFound,
    OrgCapError,
    StoreError,
    Unavailable,
)
from stoker.domain.records import ClaimRequest, Worker
from stoker.domain.specs import (
    DemandSpec,
    OrgSpec,
    PlaneSettings,
    PoolSpec,
    ProcessTemplate,
    SpawnBackoff,
    Timeouts,
)
from stoker.domain.states import ClaimMode, ClaimSource, ClaimState, Reuse, WorkerState
from stoker.policy.demand import warm_for_rate
from stoker.ports.clock import VirtualClock
from stoker.ports.runtime import RuntimeObject
from stoker.ports.store import fence

pytestmark = pytest.mark.looptime

S = WorkerState
TEMPLATE = ProcessTemplate(argv=("worker", "{port}"))
#: The pools here size their warm pool to the default quantile.
QUANTILE = DemandSpec().quantile


def pool(**kw: Any) -> PoolSpec:
    base: dict[str, Any] = {"name": "p", "template": TEMPLATE, "warm_target": 2}
    base.update(kw)
    return PoolSpec(**base)


@dataclass
class Harness:
    plane: ControlPlane
    runtime: MemoryRuntime
    store: FaultyStore
    clock: VirtualClock

    async def settle(self, seconds: float = 1.0) -> None:
        """Let virtual time pass so readiness events and background stops land."""
        await asyncio.sleep(seconds)

    async def tick(self) -> Any:
        report = await self.plane.run_janitor_pass()
        await self.settle()
        return report

    async def workers(self, *states: WorkerState) -> list[Worker]:
        return await self.store.list_workers(states=states or None)

    async def claim(self, org: str = "acme", **kw: Any) -> Any:
        kw.setdefault("timeout_s", 5.0)
        return await self.plane.claim(ClaimRequest(pool=kw.pop("pool", "p"), org=org, **kw))

    def metric(self, name: str, **labels: str) -> float:
        value = self.plane.metrics.registry.get_sample_value(name, labels)
        return value or 0.0


@asynccontextmanager
async def running(
    path: Path,
    pools: Iterable[PoolSpec] = (),
    *,
    runtime: MemoryRuntime | None = None,
    orgs: Iterable[OrgSpec] = (),
    settings: PlaneSettings | None = None,
) -> AsyncIterator[Harness]:
    """A started control plane, stopped on exit.

    Built inside the test (not in a fixture) because looptime makes only the test body
    virtual: a fixture would start the clock and the token bucket in real time.
    """
    store = FaultyStore(SqliteStore(str(path / "stoker.db")))
    runtime = runtime or MemoryRuntime(ready_delay=0.2)
    clock = VirtualClock()
    plane = ControlPlane(
        store=store,
        runtime=runtime,
        activator=runtime,
        pools=list(pools) or [pool()],
        orgs=orgs,
        settings=settings or PlaneSettings(),
        clock=clock,
    )
    await plane.start(loops=False)
    h = Harness(plane, runtime, store, clock)
    await h.settle()
    try:
        yield h
    finally:
        await plane.stop()


# -- warm, reuse, cold -------------------------------------------------------------------


async def test_start_fills_the_warm_target(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        warm = await h.workers(S.WARM)
        assert len(warm) == 2
        assert all(w.org is None and w.endpoint for w in warm)


async def test_warm_claim_activates_with_late_bound_config(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        claim = await h.claim(config={"dsn": "postgres://x", "role": "ro"})
        assert claim.source is ClaimSource.WARM
        assert claim.state is ClaimState.BOUND
        proc = h.runtime.procs[claim.worker_id]
        assert proc.org == "acme"
        assert proc.epoch == claim.worker_epoch
        assert proc.token == claim.token and claim.token
        assert proc.config == {"dsn": "postgres://x", "role": "ro"}
        worker = await h.store.get_worker(claim.worker_id)
        assert worker is not None and worker.state is S.HOT and worker.claim_id == claim.id


async def test_release_parks_hot_idle_and_same_org_reuses_it(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        first = await h.claim()
        await h.plane.release(first.id)
        parked = await h.store.get_worker(first.worker_id)
        assert parked is not None and parked.state is S.HOT_IDLE and parked.org == "acme"

        second = await h.claim()
        assert second.source is ClaimSource.REUSE
        assert second.worker_id == first.worker_id
        assert second.worker_epoch > first.worker_epoch
        assert second.token != first.token
        assert h.runtime.procs[first.worker_id].activations == 2


async def test_another_org_never_gets_a_worker_that_served_acme(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        first = await h.claim("acme")
        await h.plane.release(first.id)
        others = [await h.claim(f"org{i}") for i in range(4)]
        assert first.worker_id not in {c.worker_id for c in others}
        assert all(h.runtime.procs[c.worker_id].org == c.org for c in others)


async def test_reuse_never_retires_on_release(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(reuse=Reuse.NEVER)]) as h:
        await h.settle()
        claim = await h.claim()
        released = await h.plane.release(claim.id)
        assert released.state is ClaimState.RELEASED
        await h.settle()
        worker = await h.store.get_worker(claim.worker_id)
        assert worker is not None and worker.state is S.RETIRED and worker.reason == "no_reuse"
        assert claim.worker_id in h.runtime.stop_calls


async def test_cold_mode_spawns_a_dedicated_worker(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        claim = await h.claim(mode=ClaimMode.COLD)
        assert claim.source is ClaimSource.COLD
        assert len(await h.workers(S.WARM)) == 2


async def test_prefer_warm_falls_back_to_cold_and_counts_a_miss(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(warm_target=0)]) as h:
        claim = await h.claim()
        assert claim.source is ClaimSource.COLD
        assert h.metric("stoker_misses_total", pool="p", reason="no_warm") == 1


async def test_release_is_idempotent_and_renew_needs_a_bound_claim(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        claim = await h.claim()
        first = await h.plane.release(claim.id)
        again = await h.plane.release(claim.id)
        assert first.state is again.state is ClaimState.RELEASED
        with pytest.raises(ClaimConflict):
            await h.plane.renew(claim.id)


async def test_a_claim_ended_behind_the_replica_is_reported_as_ended(tmp_path: Path) -> None:
    # The replica that bound a claim does not read it before a release or a renewal; one
    # another replica ended meanwhile (its lease expired there) is answered as it is now.
    async with running(tmp_path) as h:
        claim = await h.claim()
        ended = await h.store.end_claim(
            claim.id,
            state=ClaimState.EXPIRED,
            worker_to=S.DRAINING,
            now=h.clock.now(),
            reason="lease_expired",
            worker_changes={"reason": "lease_expired"},
        )
        assert ended is not None
        with pytest.raises(ClaimConflict, match="is expired, not bound"):
            await h.plane.renew(claim.id)
        assert h.plane.book.sizes()["bound"] == 0
        released = await h.plane.release(claim.id)
        assert released.state is ClaimState.EXPIRED
        assert h.metric("stoker_claims_total", pool="p", source="warm", outcome="released") == 0
        assert h.metric("stoker_claims_total", pool="p", source="warm", outcome="bound") == 1


async def test_unknown_pool_and_claim(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        with pytest.raises(NotFound):
            await h.claim(pool="nope")
        with pytest.raises(NotFound):
            await h.plane.get_claim("c-missing")

    # -- waiting, timeouts, caps -------------------------------------------------------------


async def test_require_warm_waits_for_the_reconciler(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(warm_target=0)]) as h:
        task = asyncio.create_task(h.claim(mode=ClaimMode.REQUIRE_WARM, timeout_s=30))
        await asyncio.sleep(0.5)
        assert not task.done()
        assert h.runtime.spawn_calls == 0
        report = await h.plane.run_janitor_pass()
        # One spawn for the queued claim, plus what its rate wants warm for the next ones.
        sizing = h.plane.janitor.sizing("p")
        assert sizing is not None and sizing.waiting == 1
        assert sizing.reactive == warm_for_rate(1 / 30, sizing.replace_s, QUANTILE)
        assert report.spawned == {"p": 1 + sizing.reactive}
        claim = await task
        # It waited for the reconciler's spawn to start: cold, in any mode.
        assert claim.source is ClaimSource.COLD


async def test_require_warm_times_out_with_no_capacity(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(warm_target=0)]) as h:
        with pytest.raises(CapacityError) as err:
            await h.claim(mode=ClaimMode.REQUIRE_WARM, timeout_s=3)
        assert err.value.reason == "no_capacity"
        await h.settle(5)
        # One claim, one answer, counted once.
        assert h.metric("stoker_claims_total", pool="p", source="none", outcome="no_capacity") == 1


async def test_org_cap_waits_then_fails_with_retry_after(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(max_workers_per_org=1)]) as h:
        await h.settle()
        await h.claim()
        with pytest.raises(OrgCapError) as err:
            await h.claim(timeout_s=2)
        assert err.value.retry_after > 0
        # A cap miss is not demand: it must not grow the warm pool.
        assert h.plane.demand.misses("p") == 0


async def test_org_cap_waiter_gets_the_released_worker(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(max_workers_per_org=1)]) as h:
        await h.settle()
        first = await h.claim()
        waiting = asyncio.create_task(h.claim(timeout_s=30))
        await asyncio.sleep(1)
        assert not waiting.done()
        await h.plane.release(first.id)
        second = await waiting
        assert second.source is ClaimSource.REUSE and second.worker_id == first.worker_id


async def test_org_override_of_the_cap(tmp_path: Path) -> None:
    async with running(
        tmp_path, [pool(max_workers_per_org=1)], orgs=[OrgSpec("big", max_workers=3)]
    ) as h:
        await h.settle()
        claims = [await h.claim("big") for _ in range(3)]
        assert len({c.worker_id for c in claims}) == 3
        with pytest.raises(OrgCapError):
            await h.claim("big", timeout_s=1)


async def test_pool_cap_fails_with_pool_cap_reason(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(warm_target=1, max_workers=1)]) as h:
        await h.settle()
        await h.claim("a")
        with pytest.raises(CapacityError) as err:
            await h.claim("b", timeout_s=2)
        assert err.value.reason == "pool_cap"


async def test_pool_cap_waiter_gets_the_slot_a_retirement_frees(tmp_path: Path) -> None:
    spec = pool(warm_target=1, max_workers=1, reuse=Reuse.NEVER)
    async with running(tmp_path, [spec]) as h:
        await h.settle()
        first = await h.claim("a")
        waiting = asyncio.create_task(h.claim("b", timeout_s=30))
        await asyncio.sleep(1)
        assert not waiting.done()
        loop = asyncio.get_running_loop()
        released_at = loop.time()
        await h.plane.release(first.id)
        # The retirement's freed slot wakes the waiter at once, not its deadline.
        second = await waiting
        assert second.source is ClaimSource.COLD and second.worker_id != first.worker_id
        assert loop.time() - released_at < 5


# -- requesters that leave ---------------------------------------------------------------


async def test_abandoned_cold_spawn_becomes_warm_not_leaked(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(warm_target=0)], runtime=MemoryRuntime(ready_delay=10)) as h:
        with pytest.raises(CapacityError):
            await h.claim(timeout_s=2)
        await h.settle(15)
        warm = await h.workers(S.WARM)
        assert len(warm) == 1 and warm[0].org is None
        assert h.runtime.procs[warm[0].id].activations == 0
        # The neutral worker serves the next claim of any org.
        claim = await h.claim("globex")
        assert claim.source is ClaimSource.WARM and claim.worker_id == warm[0].id


async def test_abandoned_activation_parks_the_worker_for_its_org(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        h.runtime.activation_delay = 5
        with pytest.raises(CapacityError):
            await h.claim(timeout_s=1)
        await h.settle(10)
        parked = await h.workers(S.HOT_IDLE)
        assert len(parked) == 1 and parked[0].org == "acme"
        assert await h.store.list_claims(states=[ClaimState.BOUND]) == []
        h.runtime.activation_delay = 0
        again = await h.claim("acme")
        assert again.source is ClaimSource.REUSE and again.worker_id == parked[0].id


async def test_cancelled_requester_leaves_nothing_bound(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        h.runtime.activation_delay = 2
        task = asyncio.create_task(h.claim(timeout_s=30))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await h.settle(5)
        assert await h.store.list_claims(states=[ClaimState.BOUND]) == []
        assert await h.workers(S.RESERVED, S.ACTIVATING, S.HOT) == []

    # -- failures ----------------------------------------------------------------------------


async def test_activation_failure_retires_and_retries_with_another_worker(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        h.runtime.fail_activations = 1
        claim = await h.claim()
        assert claim.state is ClaimState.BOUND
        await h.settle()
        retired = await h.workers(S.RETIRED)
        assert [w.reason for w in retired] == ["activation_failure"]
        assert retired[0].id != claim.worker_id


async def test_spawn_failure_frees_its_slot_at_once(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(warm_target=0, max_workers=1)]) as h:
        h.runtime.fail_spawns = 1
        claim = await h.claim(timeout_s=10)
        assert claim.source is ClaimSource.COLD
        retired = await h.workers(S.RETIRED)
        assert [w.reason for w in retired] == ["spawn_failure"]
        assert h.metric("stoker_spawn_failures_total", pool="p", reason="create") == 1


async def test_a_worker_command_that_cannot_start_backs_off(tmp_path: Path) -> None:
    """A claim against a pool whose every spawn fails tries a handful of spawns in 30 s
    (the back-off: 1, 2, 4, 8 s...), not one per freed slot as fast as the token bucket
    allows (1,569 in 30 s before), and its 503 names the spawn error."""
    async with running(tmp_path, [pool(warm_target=0)]) as h:
        h.runtime.fail_spawns = 10**9
        with pytest.raises(CapacityError, match="injected spawn failure") as failed:
            await h.claim(timeout_s=30)
        assert failed.value.reason == "spawn_failing"
        assert h.runtime.spawn_calls == 5  # at 0, 1, 3, 7 and 15 s
        [status] = await h.plane.pool_status()
        assert status.spawn_failing and status.spawn_failures == 5
        assert status.last_spawn_error == "injected spawn failure"
        assert h.metric("stoker_spawn_failing", pool="p") == 5

        # The command is fixed: the next spawn after the back-off works and resets it.
        h.runtime.fail_spawns = 0
        await asyncio.sleep(60)
        claim = await h.claim(timeout_s=5)
        assert claim.source is ClaimSource.COLD
        [status] = await h.plane.pool_status()
        assert (status.spawn_failing, status.spawn_failures, status.last_spawn_error) == (
            False,
            0,
            None,
        )
        assert h.metric("stoker_spawn_failing", pool="p") == 0


async def test_the_janitor_backs_off_a_failing_pool_and_probes_one_at_a_time(
    tmp_path: Path,
) -> None:
    backoff = SpawnBackoff(initial_s=2, max_s=8, factor=2)
    runtime = MemoryRuntime(ready_delay=0.2)
    runtime.fail_spawns = 10**9
    pools = [pool(warm_target=3, spawn_backoff=backoff)]
    async with running(tmp_path, pools, runtime=runtime) as h:
        # The start's pass reserved three: the first failed, the other two wait their turn.
        assert h.runtime.spawn_calls == 1
        for _ in range(30):  # a pass a second for 30 s
            await h.plane.run_janitor_pass()
            await asyncio.sleep(1)
        # Then one probe after each back-off (2, 4, 8, 8 s...), never two at once.
        assert 1 + 4 <= h.runtime.spawn_calls <= 1 + 5
        h.runtime.fail_spawns = 0
        for _ in range(20):
            await h.plane.run_janitor_pass()
            await asyncio.sleep(1)
        assert len(await h.workers(S.WARM)) == 3


async def test_workers_lost_before_ready_count_as_failed_spawns(tmp_path: Path) -> None:
    runtime = MemoryRuntime(auto_ready=False)
    async with running(tmp_path, [pool(warm_target=1)], runtime=runtime) as h:
        [spawning] = await h.workers(S.SPAWNING)
        h.runtime.kill(spawning.id, "exited with status 1")
        await h.settle()
        [status] = await h.plane.pool_status()
        assert status.spawn_failing
        assert status.last_spawn_error == f"worker {spawning.id} exited with status 1 before ready"


async def test_lost_hot_worker_fails_its_claim_and_is_replaced(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        claim = await h.claim()
        h.runtime.kill(claim.worker_id)
        await h.settle()
        failed = await h.plane.get_claim(claim.id)
        assert failed.state is ClaimState.FAILED and failed.reason == "worker_lost"
        worker = await h.store.get_worker(claim.worker_id)
        assert worker is not None and worker.state is S.RETIRED and worker.reason == "lost"
        await h.tick()
        # Replaced: back to the warm target, or what the one claim's rate wants if more.
        sizing = h.plane.janitor.sizing("p")
        assert sizing is not None
        wanted = max(2, warm_for_rate(1 / 30, sizing.replace_s, QUANTILE))
        assert len(await h.workers(S.WARM)) == sizing.desired == wanted


async def test_lost_warm_worker_is_replaced_to_target(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        for w in await h.workers(S.WARM):
            h.runtime.kill(w.id)
        await h.settle()
        assert await h.workers(S.WARM) == []
        await h.tick()
        assert len(await h.workers(S.WARM)) == 2


async def test_failed_release_write_keeps_the_old_state(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        claim = await h.claim()
        h.store.fail_next = 1
        with pytest.raises(StoreError):
            await h.plane.release(claim.id)
        still = await h.plane.get_claim(claim.id)
        worker = await h.store.get_worker(claim.worker_id)
        assert still.state is ClaimState.BOUND
        assert worker is not None and worker.state is S.HOT
        assert h.metric("stoker_persist_failures_total", transition="hot->hot_idle") == 1
        released = await h.plane.release(claim.id)
        assert released.state is ClaimState.RELEASED


async def test_failed_ready_write_is_retried_by_the_next_pass(tmp_path: Path) -> None:
    async with running(
        tmp_path, [pool(warm_target=1)], runtime=MemoryRuntime(auto_ready=False)
    ) as h:
        [slot] = await h.workers(S.SPAWNING)
        h.store.fail_next = 1
        h.runtime.make_ready(slot.id)
        await h.settle()
        assert [w.state for w in await h.workers()] == [S.SPAWNING]
        await h.tick()
        assert [w.state for w in await h.workers()] == [S.WARM]


# -- leases and TTLs ---------------------------------------------------------------------


async def test_expired_lease_retires_the_worker(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        claim = await h.claim(lease_s=30)
        h.clock.advance(31)
        report = await h.tick()
        assert report.expired_claims == 1
        expired = await h.plane.get_claim(claim.id)
        assert expired.state is ClaimState.EXPIRED
        worker = await h.store.get_worker(claim.worker_id)
        assert worker is not None and worker.state is S.RETIRED and worker.reason == "lease_expired"


async def test_a_late_heartbeat_never_makes_a_replica_expire_itself(tmp_path: Path) -> None:
    # The loop was busy (hundreds of spawns, a slow disk) past instance_expiry_s, and the
    # janitor's timer fires before the heartbeat's: the replica is late, not dead.
    async with running(tmp_path) as h:
        h.clock.advance(10 * h.plane.settings.instance_expiry_s)
        await h.tick()
        (me,) = await h.store.list_instances()
        assert (me.id, me.state) == (h.plane.instance_id, "active")
        assert await h.store.heartbeat_instance(h.plane.instance_id, now=h.clock.now())


async def test_max_claim_s_caps_the_lease_then_a_renewal_past_it_is_409(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, [pool(max_claim_s=100)]) as h:
        claim = await h.claim(lease_s=60)
        assert claim.expires_at == claim.created_at + 60
        h.clock.advance(50)
        # The renewal asks for 60 s more; the session may last 50 more at most.
        renewed = await h.plane.renew(claim.id)
        assert renewed.expires_at == pytest.approx(claim.created_at + 100)
        h.clock.advance(51)
        with pytest.raises(ClaimConflict, match="max_claim_s of 100s"):
            await h.plane.renew(claim.id)
        ended = await h.plane.get_claim(claim.id)
        assert (ended.state, ended.reason) == (ClaimState.EXPIRED, "max_claim")
        await h.settle()
        worker = await h.store.get_worker(claim.worker_id)
        assert worker is not None and worker.state is S.RETIRED and worker.reason == "max_claim"


async def test_a_session_renewed_to_its_cap_is_ended_by_the_reaper(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(max_claim_s=100)]) as h:
        claim = await h.claim(lease_s=30)
        for step in (25, 25, 25, 20):
            h.clock.advance(step)
            renewed = await h.plane.renew(claim.id)
        assert renewed.expires_at == pytest.approx(claim.created_at + 100)
        h.clock.advance(6)  # past the cap: the last renewal ran to it, not beyond
        report = await h.plane.run_reaper_pass()
        assert report.retired == {"max_claim": 1}
        ended = await h.plane.get_claim(claim.id)
        assert (ended.state, ended.reason) == (ClaimState.EXPIRED, "max_claim")


async def test_an_orgs_max_claim_s_wins_over_the_pools(tmp_path: Path) -> None:
    orgs = [OrgSpec(name="acme", max_claim_s=10), OrgSpec(name="globex", max_claim_s=0)]
    async with running(tmp_path, [pool(max_claim_s=100)], orgs=orgs) as h:
        acme = await h.claim("acme", lease_s=60)
        globex = await h.claim("globex", lease_s=60)
        assert acme.lease_s == 10 and acme.expires_at == acme.created_at + 10
        h.clock.advance(200)
        renewed = await h.plane.renew(globex.id)  # no limit for globex
        assert renewed.expires_at == pytest.approx(h.clock.now() + 60)
        with pytest.raises(ClaimConflict):
            await h.plane.renew(acme.id)


async def test_renew_keeps_the_lease_alive(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        claim = await h.claim(lease_s=30)
        for _ in range(5):
            h.clock.advance(20)
            renewed = await h.plane.renew(claim.id)
            assert renewed.expires_at > h.clock.now()
            await h.tick()
        assert (await h.plane.get_claim(claim.id)).state is ClaimState.BOUND


async def test_hot_idle_ttl_reaping_resolves_claim_ttl_first(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        short = await h.claim("a", ttl_s=10)
        default = await h.claim("b")
        await h.plane.release(short.id)
        await h.plane.release(default.id)
        h.clock.advance(11)
        await h.tick()
        gone = await h.store.get_worker(short.worker_id)
        kept = await h.store.get_worker(default.worker_id)
        assert gone is not None and gone.state is S.RETIRED and gone.reason == "ttl"
        assert kept is not None and kept.state is S.HOT_IDLE
        h.clock.advance(60)
        await h.tick()
        kept = await h.store.get_worker(default.worker_id)
        assert kept is not None and kept.state is S.RETIRED


async def test_min_hot_idle_floor_is_kept(tmp_path: Path) -> None:
    async with running(
        tmp_path, [pool(hot_idle_ttl=10)], orgs=[OrgSpec("acme", min_hot_idle=1)]
    ) as h:
        await h.settle()
        claims = [await h.claim() for _ in range(3)]
        for c in claims:
            await h.plane.release(c.id)
        h.clock.advance(100)
        await h.tick()
        assert len(await h.workers(S.HOT_IDLE)) == 1


async def test_max_ttl_clamps_a_claims_ttl(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(max_ttl=20)]) as h:
        await h.settle()
        claim = await h.claim(ttl_s=3600)
        await h.plane.release(claim.id)
        worker = await h.store.get_worker(claim.worker_id)
        assert worker is not None and worker.ttl_s == 20


# -- reconciler --------------------------------------------------------------------------


async def test_thirty_misses_reserve_target_plus_thirty_slots_in_one_tick(tmp_path: Path) -> None:
    # duckgres #597: a static target with 1:1 replenish crept 5 -> 11 and never reached 30.
    async with running(
        tmp_path, [pool(warm_target=2)], runtime=MemoryRuntime(auto_ready=False)
    ) as h:
        assert len(await h.workers(S.SPAWNING)) == 2
        tasks = [
            asyncio.create_task(h.claim(f"org{i}", mode=ClaimMode.REQUIRE_WARM, timeout_s=60))
            for i in range(30)
        ]
        await asyncio.sleep(0.1)
        report = await h.plane.run_janitor_pass()
        # The thirty queued claims, one spawn each, plus the warm workers that their rate
        # (thirty within the panic window) wants for the claims to come.
        sizing = h.plane.janitor.sizing("p")
        assert sizing is not None and sizing.waiting == 30
        assert sizing.reactive == warm_for_rate(30 / 30, sizing.replace_s, QUANTILE) > 2
        assert report.spawned == {"p": 30 + sizing.reactive - 2}
        assert len(await h.workers(S.SPAWNING)) == 30 + sizing.reactive
        await h.settle()
        for w in await h.workers(S.SPAWNING):
            h.runtime.make_ready(w.id)
        claims = await asyncio.gather(*tasks)
        assert len({c.worker_id for c in claims}) == 30


async def test_zero_max_workers_hands_out_thirty_without_a_cap(tmp_path: Path) -> None:
    # duckgres #597: a derived cap held a 30-tenant load test at 11 workers.
    async with running(tmp_path, [pool(warm_target=0, max_workers=0)]) as h:
        claims = await asyncio.gather(*(h.claim(f"org{i}", timeout_s=30) for i in range(30)))
        assert len({c.worker_id for c in claims}) == 30
        assert h.metric("stoker_claims_total", pool="p", source="none", outcome="pool_cap") == 0


async def test_demand_raises_the_warm_pool_then_scale_down_is_slow(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(warm_target=1, scale_down_delay=60)]) as h:
        await h.settle()
        claims = await asyncio.gather(*(h.claim(f"o{i}", lease_s=3600) for i in range(20)))
        report = await h.tick()
        # Twenty claims in the panic window: the warm pool grows to what that rate wants.
        # The 19 misses spawned their own workers: they are not spawned for again.
        sizing = h.plane.janitor.sizing("p")
        assert sizing is not None
        wanted = warm_for_rate(20 / 30, sizing.replace_s, QUANTILE)
        assert sizing.reactive == wanted > 1
        assert report.spawned["p"] == wanted
        assert len(await h.workers(S.WARM)) == wanted
        # Demand falls off once the claims leave the windows: excess is held for
        # scale_down_delay, then retired 10 % per pass at most.
        assert (await h.tick()).retired == {}
        live = len(await h.workers(*(set(S) - {S.RETIRED})))
        assert live == 20 + wanted
        h.clock.advance(301)
        await h.tick()
        h.clock.advance(61)
        report = await h.tick()
        assert report.retired == {"excess": live // 10}
        for c in claims:
            await h.plane.release(c.id)


async def test_stuck_spawn_is_retired_after_its_timeout(tmp_path: Path) -> None:
    async with running(
        tmp_path,
        [pool(warm_target=1, timeouts=Timeouts(spawn_s=30))],
        runtime=MemoryRuntime(auto_ready=False),
    ) as h:
        [slot] = await h.workers(S.SPAWNING)
        h.clock.advance(31)
        report = await h.tick()
        assert report.retired.get("stuck") == 1
        worker = await h.store.get_worker(slot.id)
        assert worker is not None and worker.state is S.RETIRED


class QueuingRuntime(MemoryRuntime):
    """A memory runtime whose spawns wait in a queue (as the local runtime's start-up
    bound makes them) until the test opens it."""

    def __init__(self) -> None:
        super().__init__(auto_ready=False)
        self.queue_open = asyncio.Event()

    async def spawn(self, worker: Worker, pool: PoolSpec) -> Any:
        await self.queue_open.wait()
        return await super().spawn(worker, pool)


async def test_a_spawn_queued_in_the_runtime_is_not_stuck_until_it_started(
    tmp_path: Path,
) -> None:
    runtime = QueuingRuntime()
    async with running(
        tmp_path, [pool(warm_target=1, timeouts=Timeouts(spawn_s=30))], runtime=runtime
    ) as h:
        [slot] = await h.workers(S.SPAWNING)
        h.clock.advance(31)
        assert "stuck" not in (await h.tick()).retired
        runtime.queue_open.set()
        await h.settle()
        assert runtime.procs[slot.id].alive
        # 28 s after its start (each tick and settle lets 1 s pass): not stuck yet.
        h.clock.advance(27)
        assert "stuck" not in (await h.tick()).retired
        # Its spawn timeout counts from the start, not from the reservation.
        h.clock.advance(3)
        assert (await h.tick()).retired.get("stuck") == 1


async def test_runtime_objects_without_a_live_row_are_stopped(tmp_path: Path) -> None:
    """A process whose row was retired or never written is stopped; live rows keep theirs."""
    async with running(tmp_path, [pool(warm_target=3)]) as h:
        warm = await h.workers(S.WARM)
        assert len(warm) == 3
        gone = warm[0]
        retired = await h.store.transition(
            gone.id,
            expect=S.WARM,
            epoch=gone.epoch,
            version=gone.version,
            to=S.RETIRED,
            now=h.clock.now(),
        )
        assert retired is not None and gone.id in h.runtime.alive()
        h.runtime.procs["w-stray"] = FakeProcess("w-stray", "p")
        h.clock.advance(h.plane.settings.stranded_scan_s + 1)
        report = await h.plane.run_janitor_pass()
        assert report.stranded_stopped == 2
        assert {gone.id, "w-stray"} <= set(h.runtime.stop_calls)
        assert {w.id for w in warm[1:]} <= h.runtime.alive()


async def test_a_stranded_object_met_twice_is_stopped_once(tmp_path: Path) -> None:
    """The pass's first read of the runtime may meet one worker id twice (a launcher that
    forks before it execs the worker carries its labels too): it is stopped once."""
    async with running(tmp_path, [pool(warm_target=1)]) as h:
        h.runtime.procs["w-stray"] = FakeProcess("w-stray", "p")
        listed = h.runtime.list_objects
        reads = 0

        async def stray_twice_at_first() -> list[RuntimeObject]:
            nonlocal reads
            reads += 1
            objects = await listed()
            strays = [o for o in objects if o.worker_id == "w-stray"]
            return objects + strays if reads == 1 else objects

        h.runtime.list_objects = stray_twice_at_first  # type: ignore[method-assign]
        h.clock.advance(h.plane.settings.stranded_scan_s + 1)
        report = await h.plane.run_janitor_pass()
        assert reads >= 2
        assert report.stranded_stopped == 1
        assert h.runtime.stop_calls.count("w-stray") == 1


async def test_rollout_retires_stale_warm_and_spawns_the_new_revision(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(warm_target=2)]) as h:
        await h.settle()
        new = replace(
            pool(warm_target=2), template=ProcessTemplate(argv=("worker2", "{port}")), revision=""
        )
        h.plane.catalog.update_pool(new)
        await h.tick()
        await h.tick()
        warm = await h.workers(S.WARM)
        assert {w.revision for w in warm} == {new.revision}
        reasons = sorted(w.reason or "" for w in await h.workers(S.RETIRED))
        assert reasons == ["rollout", "rollout"]


async def test_a_claim_still_waiting_when_the_shutdown_grace_ends_is_unavailable(
    tmp_path: Path,
) -> None:
    settings = PlaneSettings(shutdown_grace_s=2.0)
    async with running(tmp_path, [pool(warm_target=0)], settings=settings) as h:
        waiting = asyncio.ensure_future(h.claim(mode=ClaimMode.REQUIRE_WARM, timeout_s=600))
        await h.settle()
        await h.plane.stop()
        with pytest.raises(Unavailable, match="shutting down"):
            await asyncio.wait_for(waiting, 10)


# -- restart -----------------------------------------------------------------------------


async def test_restart_adopts_live_workers_and_sessions(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        hot = await h.claim("acme")
        parked = await h.claim("globex")
        await h.plane.release(parked.id)
    async with running(tmp_path, runtime=h.runtime) as h2:
        owners = {w.owner for w in await h2.workers(S.WARM, S.HOT, S.HOT_IDLE)}
        assert owners == {h2.plane.instance_id}
        again = await h2.claim("globex")
        assert again.source is ClaimSource.REUSE and again.worker_id == parked.worker_id
        released = await h2.plane.release(hot.id)
        assert released.state is ClaimState.RELEASED
        # The sessions' workers were adopted, not replaced.
        assert h2.plane.book.known(hot.worker_id) is not None


async def test_restart_retires_workers_that_died_meanwhile(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        pass
    dead = next(iter(h.runtime.alive()))
    h.runtime.procs[dead].alive = False
    async with running(tmp_path, runtime=h.runtime) as h2:
        worker = await h2.store.get_worker(dead)
        assert worker is not None and worker.state is S.RETIRED and worker.reason == "lost"
        await h2.tick()
        assert len(await h2.workers(S.WARM)) == 2


async def test_stop_workers_retires_everything(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        await h.claim()
        await h.plane.stop(stop_workers=True)
        assert h.runtime.alive() == set()


async def test_stop_workers_retires_workers_that_moved_on_since_its_listing(
    tmp_path: Path,
) -> None:
    """A shutdown lists its workers, then retires them one at a time; meanwhile a spawn
    may record its process's ref or a worker get ready (a write to its row), and the
    listed row misses its fence. That worker was left live in the store, and on a loaded
    machine its process running (the last sweep's /proc scan can miss a process just
    started). It is read again and retired as it now is."""
    async with running(tmp_path) as h:
        listed_rows = h.store.inner.list_workers

        async def listing_a_step_behind(**query: Any) -> list[Worker]:
            listed = await listed_rows(**query)
            if query.get("owner") == h.plane.instance_id:
                for worker in listed:
                    # A write that keeps the state (as a spawn's ref does) bumps the version.
                    moved = await h.store.inner.transition(
                        worker.id, **fence(worker), to=worker.state, now=h.clock.now()
                    )
                    assert moved is not None and moved.version > worker.version
            return listed

        h.store.inner.list_workers = listing_a_step_behind  # type: ignore[method-assign]
        warm = {w.id for w in await h.workers(S.WARM)}
        assert len(warm) == 2
        await h.plane.stop(stop_workers=True)
        assert h.runtime.alive() == set()

    store = SqliteStore(str(tmp_path / "stoker.db"))
    await store.open()
    try:
        for worker_id in warm:
            row = await store.get_worker(worker_id)
            assert row is not None
            assert (row.state, row.reason) == (S.RETIRED, "shutdown")
    finally:
        await store.close()


# -- the fallback reaper, while nobody leads -------------------------------------------------


async def test_the_fallback_reaper_ends_a_gone_replicas_expired_claims_only(
    tmp_path: Path,
) -> None:
    # Two replicas on one store, no leader: b serves a claim, then falls silent. a's
    # fallback reaper leaves b's claim alone while b is alive, and ends it once b is gone
    # (past instance_expiry_s), without waiting for a leader.
    async with running(tmp_path) as a, running(tmp_path) as b:
        claim = await b.claim("acme", lease_s=30)
        a.clock.advance(31)
        await b.store.heartbeat_instance(b.plane.instance_id, now=a.clock.now())
        report = await a.plane.run_reaper_pass()
        assert report.expired_claims == 0
        assert (await a.plane.get_claim(claim.id)).state is ClaimState.BOUND

        a.clock.advance(a.plane.settings.instance_expiry_s + 1)
        report = await a.plane.run_reaper_pass()
        assert report.expired_claims == 1
        ended = await a.plane.get_claim(claim.id)
        assert (ended.state, ended.reason) == (ClaimState.EXPIRED, "lease_expired")


async def test_the_fallback_reaper_retires_parked_workers_past_their_ttl(
    tmp_path: Path,
) -> None:
    # Its own parked worker goes at its TTL; a live replica's stays until that replica is
    # gone, whoever's reaper runs.
    async with (
        running(tmp_path, [pool(hot_idle_ttl=60)]) as a,
        running(tmp_path, [pool(hot_idle_ttl=60)]) as b,
    ):
        mine = await a.claim("acme")
        theirs = await b.claim("globex")
        await a.plane.release(mine.id)
        await b.plane.release(theirs.id)
        a.clock.advance(61)
        await b.store.heartbeat_instance(b.plane.instance_id, now=a.clock.now())
        report = await a.plane.run_reaper_pass()
        assert report.retired == {"ttl": 1}
        await a.settle()
        assert (await a.store.get_worker(mine.worker_id)).state is S.RETIRED  # type: ignore[union-attr]
        assert (await a.store.get_worker(theirs.worker_id)).state is S.HOT_IDLE  # type: ignore[union-attr]

        a.clock.advance(a.plane.settings.instance_expiry_s + 1)
        report = await a.plane.run_reaper_pass()
        assert report.retired == {"ttl": 1}
        await a.settle()
        assert (await a.store.get_worker(theirs.worker_id)).state is S.RETIRED  # type: ignore[union-attr]


async def test_the_last_reap_gauge_stays_put_when_a_pass_fails(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        await h.plane.run_reaper_pass()
        stamped = h.metric("stoker_reaper_last_success_timestamp_seconds")
        assert stamped == pytest.approx(h.clock.now())
        h.clock.advance(30)

        async def failing(**_: Any) -> Any:
            raise StoreError("injected failure of list_claims")

        h.store.inner.list_claims = failing  # type: ignore[method-assign]
        with pytest.raises(StoreError):
            await h.plane.run_reaper_pass()
        assert h.metric("stoker_reaper_last_success_timestamp_seconds") == stamped


# -- a failing store ---------------------------------------------------------------------------


async def test_while_the_store_fails_claims_fail_at_once_and_recover_with_it(
    tmp_path: Path,
) -> None:
    async with running(tmp_path) as h:

        def store_error() -> str | None:
            return h.plane.store_error

        assert store_error() is None
        os.replace(tmp_path / "stoker.db", tmp_path / "moved.db")
        await h.plane.check_store()
        assert "was deleted" in (store_error() or "")
        started = h.clock.now()
        with pytest.raises(StoreError, match="the store is failing"):
            await h.claim(timeout_s=30)
        assert h.clock.now() == started  # at once, not after the claim's timeout

        os.replace(tmp_path / "moved.db", tmp_path / "stoker.db")
        await h.plane.check_store()
        assert store_error() is None
        claim = await h.claim()
        assert claim.state is ClaimState.BOUND


async def test_a_spawn_retired_while_it_waited_for_its_turn_never_starts(
    tmp_path: Path,
) -> None:
    """Spawns paced by the token bucket wait for their turn; a shutdown with stop_workers
    retires them meanwhile: none may start a process afterwards, which nobody would stop
    (the retirement found nothing to stop)."""
    runtime = MemoryRuntime(auto_ready=False)
    async with running(
        tmp_path,
        [pool(warm_target=3)],
        runtime=runtime,
        settings=PlaneSettings(spawn_rate=0.5, spawn_burst=1),
    ) as h:
        assert len(await h.workers(S.SPAWNING)) == 3
        assert runtime.spawn_calls == 1  # the other two wait for the bucket
        await h.plane.stop(stop_workers=True)
        await asyncio.sleep(10)  # the bucket would have let both go by now
        assert runtime.spawn_calls == 1
        assert runtime.alive() == set()


async def test_a_zero_timeout_takes_a_free_worker_without_waiting(tmp_path: Path) -> None:
    """`timeout_s: 0` waits for nothing: a parked or warm worker free now is taken, and a
    claim that finds none is refused at once."""
    async with running(tmp_path, [pool(warm_target=1, max_workers=2)]) as h:
        loop = asyncio.get_running_loop()
        started = loop.time()
        warm = await h.claim(timeout_s=0)
        assert warm.source is ClaimSource.WARM and warm.state is ClaimState.BOUND
        await h.plane.release(warm.id)
        reused = await h.claim(timeout_s=0)
        assert reused.source is ClaimSource.REUSE and reused.worker_id == warm.worker_id
        assert loop.time() - started < 1
        # Nothing free for globex now: refused at once, and no spawn is started for a
        # claim that could never wait for it.
        spawns = h.runtime.spawn_calls
        for mode in ClaimMode:
            with pytest.raises(CapacityError):
                await h.claim("globex", timeout_s=0, mode=mode)
        assert loop.time() - started < 1
        assert h.runtime.spawn_calls == spawns
