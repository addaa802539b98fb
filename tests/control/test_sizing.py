"""The leader's sizing (`stoker.control.sizing`) on a real SQLite store and virtual time:
demand as a rate, the spawn-to-ready estimate, no double spawn for one miss, and a forecast
that outlives its leader. The runtime is `MemoryRuntime` (the processes do not matter here)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fakes import FaultyStore, MemoryRuntime
from stoker.adapters.runtime_local._startups import StartGate
from stoker.adapters.sqlite import SqliteStore
from stoker.control.plane import ControlPlane
from stoker.control.sizing import Sizing
from stoker.domain.records import ClaimRequest, ForecastBucket, SpawnProgress, Worker
from stoker.domain.specs import DemandSpec, PlaneSettings, PoolSpec, ProcessTemplate
from stoker.domain.states import ClaimSource, WorkerState
from stoker.policy.demand import warm_for_rate
from stoker.policy.forecast import DAY, WEEK, buckets_of
from stoker.ports.clock import VirtualClock

pytestmark = pytest.mark.looptime

TEMPLATE = ProcessTemplate(argv=("worker", "{port}"))
#: The pools here size their warm pool to the default quantile.
QUANTILE = DemandSpec().quantile


def pool(**demand: object) -> PoolSpec:
    return PoolSpec(name="p", template=TEMPLATE, warm_target=0, demand=DemandSpec(**demand))  # type: ignore[arg-type]


@asynccontextmanager
async def plane(
    path: Path,
    spec: PoolSpec,
    *,
    ready_delay: float = 0.2,
    clock: VirtualClock | None = None,
    runtime: MemoryRuntime | None = None,
) -> AsyncIterator[ControlPlane]:
    runtime = runtime or MemoryRuntime(ready_delay=ready_delay)
    cp = ControlPlane(
        store=FaultyStore(SqliteStore(str(path / "stoker.db"))),
        runtime=runtime,
        activator=runtime,
        pools=[spec],
        settings=PlaneSettings(),
        clock=clock or VirtualClock(),
    )
    await cp.start(loops=False)
    try:
        yield cp
    finally:
        await cp.stop()


async def claim_and_release(cp: ControlPlane, org: str) -> ClaimSource:
    claim = await cp.claim(ClaimRequest(pool="p", org=org, timeout_s=30))
    await cp.release(claim.id)
    return claim.source


async def test_a_miss_is_not_spawned_for_twice(tmp_path: Path) -> None:
    # Three warm, four claims at once: three take a warm worker, one misses and spawns its
    # own. A miss used to raise the target by one for a pass as well: a second spawn.
    spec = replace(pool(quantile=0.5, forecast=False), warm_target=3)
    async with plane(tmp_path, spec) as cp:
        await cp.run_janitor_pass()
        await asyncio.sleep(1.0)
        runtime = cp.runtime
        assert isinstance(runtime, MemoryRuntime) and runtime.spawn_calls == 3
        claims = await asyncio.gather(
            *(cp.claim(ClaimRequest(pool="p", org=f"o{i}", timeout_s=30)) for i in range(4))
        )
        assert sorted(c.source.value for c in claims) == ["cold", "warm", "warm", "warm"]
        assert runtime.spawn_calls == 4
        report = await cp.run_janitor_pass()
        sizing = cp.janitor.sizing("p")
        # Four claims' rate wants fewer than the static target: the target alone is refilled.
        assert sizing is not None and sizing.reactive < 3 and sizing.policy == "static"
        assert report.spawned == {"p": 3}
        await asyncio.sleep(1.0)
        assert runtime.spawn_calls == 7
        for c in claims:
            await cp.release(c.id)


async def test_the_rate_raises_the_warm_pool_and_the_ready_time_is_observed(
    tmp_path: Path,
) -> None:
    async with plane(tmp_path, pool(forecast=False), ready_delay=3.0) as cp:
        await cp.run_janitor_pass()
        for i in range(6):
            await claim_and_release(cp, f"org{i}")
            await asyncio.sleep(2.0)
        report = await cp.run_janitor_pass()
        sizing = cp.janitor.sizing("p")
        assert sizing is not None
        # Six claims within the windows' first 30 s: 0.2 a second.
        assert sizing.rate.value == pytest.approx(6 / 30, rel=0.05)
        # The cold spawns took 3 s to get ready: the seed (10 s) gave way to what was seen.
        assert sizing.ready_s == pytest.approx(3.0, abs=0.3)
        assert sizing.replace_s == pytest.approx(sizing.ready_s + 2.0)
        assert sizing.reactive >= 2 and sizing.policy == "reactive"
        assert report.spawned == {"p": sizing.desired}
        status = {s.name: s for s in await cp.pool_status()}["p"]
        assert status.sizing is not None and status.sizing.reactive_warm == sizing.reactive
        assert cp.metrics.registry.get_sample_value(
            "stoker_pool_demand_rate", {"pool": "p"}
        ) == pytest.approx(sizing.rate.value)


async def test_a_restarted_leader_forecasts_from_what_the_last_one_learned(
    tmp_path: Path,
) -> None:
    clock = VirtualClock()
    spec = pool()
    async with plane(tmp_path, spec, clock=clock) as cp:
        # Start just after an hour begins, count claims through it, and close it.
        now = clock.now()
        clock.advance(math.ceil(now / 3600) * 3600 + 1 - now)
        await cp.run_janitor_pass()
        for i in range(12):
            await claim_and_release(cp, f"org{i}")
        await cp.run_janitor_pass()
        assert cp.janitor.sizing("p") is not None
        assert cp.janitor.sizing("p").forecast_rate is None  # type: ignore[union-attr]
        clock.advance(3600)
        await cp.run_janitor_pass()
        learned = await cp.store.read_forecast()
        # The hour the plane started in (quiet, most of it seen) and the hour of the claims.
        assert sorted((b.level, b.seen) for b in learned) == [("day", 1)] * 2 + [("week", 1)] * 2
        last = [b for b in learned if b.updated_at == max(b.updated_at for b in learned)]
        assert len(last) == 2 and all(b.mean == pytest.approx(12 / 3600) for b in last)
    # A new leader on the same store: its first pass forecasts.
    async with plane(tmp_path, spec, clock=clock) as again:
        await again.run_janitor_pass()
        sizing = again.janitor.sizing("p")
        assert sizing is not None and sizing.forecast_rate is not None
        assert sizing.forecast_rate >= 12 / 3600 * 0.5
        assert not sizing.forecast_off and sizing.forecast_error is not None
        # Nobody claimed since the restart: the warm pool is the forecast's alone.
        assert sizing.rate.value == 0 and sizing.policy == "forecast"
        wanted = warm_for_rate(sizing.forecast_rate, sizing.replace_s, QUANTILE)
        assert sizing.desired == sizing.forecast_warm == wanted > 0
        workers = await again.store.list_workers(states=[WorkerState.SPAWNING, WorkerState.WARM])
        assert len(workers) == wanted


async def test_a_forecast_that_misses_is_set_aside_for_the_reactive_policy(
    tmp_path: Path,
) -> None:
    # The store holds a busy forecast (0.2 claims a second, every hour of the week), as a
    # leader that learned ordinary weeks left it; today nobody comes (a holiday).
    clock = VirtualClock()
    busy = [
        ForecastBucket("p", level, bucket, 0.2, 1e-5, 4, clock.now())
        for level, count in (("week", 168), ("day", 48))
        for bucket in range(count)
    ]
    store = SqliteStore(str(tmp_path / "stoker.db"))
    await store.open()
    await store.record_forecast(busy)
    await store.close()
    async with plane(tmp_path, pool(), clock=clock) as cp:
        await cp.run_janitor_pass()
        sizing = cp.janitor.sizing("p")
        assert sizing is not None and sizing.policy == "forecast" and not sizing.forecast_off
        wanted = warm_for_rate(sizing.forecast_rate or 0, sizing.replace_s, QUANTILE)
        assert sizing.desired == wanted
        assert sizing.desired > 2
        # Passes without a claim: once the error window holds more than Poisson noise of
        # misses, the forecast is set aside and the pool is sized as without one.
        for _ in range(12):
            clock.advance(5.0)
            await cp.run_janitor_pass()
        sizing = cp.janitor.sizing("p")
        assert sizing is not None and sizing.forecast_off
        assert sizing.forecast_error == pytest.approx(-1.0)
        assert sizing.forecast_warm is None and sizing.policy == "static"
        assert sizing.desired == 0 == sizing.reactive
        status = {s.name: s for s in await cp.pool_status()}["p"]
        assert status.sizing is not None and status.sizing.forecast_off


class GatedRuntime(MemoryRuntime):
    """`MemoryRuntime` behind the local runtime's start-up bound: at most `limit` workers
    start at once, each holding its slot until ready; the rest queue (`StartGate`)."""

    def __init__(self, *, limit: int, ready_delay: float) -> None:
        super().__init__(ready_delay=ready_delay)
        self.gate = StartGate(limit)

    async def spawn(self, worker: Worker, pool: PoolSpec) -> Mapping[str, Any]:
        await self.gate.enter(worker.id, urgent=worker.org is not None)
        return await super().spawn(worker, pool)

    def make_ready(self, worker_id: str) -> None:
        self.gate.leave(worker_id)
        super().make_ready(worker_id)


async def test_a_refill_after_a_burst_stays_at_what_the_rate_wants(tmp_path: Path) -> None:
    # The claim-burst geometry at an eighth: a pool of 40 (cap 80) fills through a start-up
    # bound of one at a time, 2 s each, so its last spawns waited ~80 s in the queue; then
    # 20 orgs claim at once and release. The replacement time is what a claim would wait
    # for a new worker: ~2 s plus a pass. Measured from the spawn's row, it held the queue
    # (~80 s), the burst's rate over it wanted more than the static 40, and the spawns that
    # ordered queued longer still: the pool ran to its cap.
    spec = replace(pool(forecast=False), warm_target=40, max_workers=80)
    runtime = GatedRuntime(limit=1, ready_delay=2.0)
    cp = ControlPlane(
        store=SqliteStore(str(tmp_path / "stoker.db")),
        runtime=runtime,
        activator=runtime,
        pools=[spec],
        settings=PlaneSettings(),
        clock=VirtualClock(),
    )
    await cp.start(loops=False)
    try:
        interval = cp.settings.janitor_interval_s

        async def passes(seconds: float) -> int:
            """Janitor passes over `seconds`; the most live workers seen."""
            peak = 0
            for _ in range(int(seconds / interval)):
                await cp.run_janitor_pass()
                await asyncio.sleep(interval)
                counts = {s.name: s for s in await cp.pool_status()}["p"].counts
                peak = max(peak, sum(n for state, n in counts.items() if state != "retired"))
            return peak

        await passes(120)
        status = {s.name: s for s in await cp.pool_status()}["p"]
        assert status.counts["warm"] == 40
        claims = await asyncio.gather(
            *(cp.claim(ClaimRequest(pool="p", org=f"o{i}", timeout_s=30)) for i in range(20))
        )
        assert {c.source for c in claims} == {ClaimSource.WARM}
        for c in claims:
            await cp.release(c.id)
        peak = await passes(240)
        sizing = cp.janitor.sizing("p")
        assert sizing is not None
        # 20 claims in the 30 s panic window over ~4 s of replacement want far fewer than
        # 40: the static target is refilled, beside the burst's 20 parked workers.
        assert peak <= 40 + 20, (peak, sizing)
        # Each start-up took 2 s: the estimate is that, not the queue behind the fill.
        assert sizing.ready_s == pytest.approx(2.0, abs=0.5)
        status = {s.name: s for s in await cp.pool_status()}["p"]
        assert status.counts.get("spawning", 0) == 0
    finally:
        await cp.stop()


class NodelessRuntime(MemoryRuntime):
    """`MemoryRuntime` whose spawns stay unready until `make_ready`, and say what the
    Kubernetes runtime's progress would: `unschedulable` (no node fits them) while `full`,
    else `starting` (a node took them). A fake: no scheduler or node is modelled, only
    what the sizing reads of a spawn."""

    def __init__(self) -> None:
        super().__init__(auto_ready=False)
        self.full = True

    def progress(self, worker: Worker) -> SpawnProgress | None:
        proc = self.procs.get(worker.id)
        if proc is None or proc.ready or not proc.alive:
            return None
        if self.full:
            return SpawnProgress("unschedulable", waiting=True, failure="no node fits it")
        return SpawnProgress("starting", waiting=True)


async def go_cold(cp: ControlPlane, runtime: NodelessRuntime) -> None:
    """A claim on an empty warm pool: its own spawn waits (on a node while the runtime is
    `full`) through a janitor pass; then the spawn gets ready and the claim is served."""
    claim = asyncio.create_task(cp.claim(ClaimRequest(pool="p", org="acme", timeout_s=30)))
    while not runtime.procs:
        await asyncio.sleep(0.01)
    await cp.run_janitor_pass()
    for worker_id in list(runtime.procs):
        runtime.make_ready(worker_id)
    bound = await claim
    assert bound.source is ClaimSource.COLD
    await cp.release(bound.id)


@asynccontextmanager
async def nodeless_plane(
    path: Path, spec: PoolSpec, clock: VirtualClock
) -> AsyncIterator[tuple[ControlPlane, NodelessRuntime]]:
    runtime = NodelessRuntime()
    async with plane(path, spec, clock=clock, runtime=runtime) as cp:
        yield cp, runtime


async def test_headroom_is_kept_while_claims_wait_for_nodes_and_falls_after_the_hold(
    tmp_path: Path,
) -> None:
    # No forecast: nothing says a placeholder buys anything until a claim goes cold while
    # its spawn waits for a node.
    clock = VirtualClock()
    spec = replace(pool(forecast=False, headroom_hold_s=600.0), headroom_nodes=2)
    async with nodeless_plane(tmp_path, spec, clock) as (cp, runtime):
        await cp.run_janitor_pass()
        sizing = cp.janitor.sizing("p")
        assert sizing is not None
        assert (sizing.headroom, sizing.headroom_reason, sizing.headroom_short) == (0, "none", None)
        await go_cold(cp, runtime)
        sizing = cp.janitor.sizing("p")
        # One claim waited for a node: room for one more (this runtime's placeholders
        # make room for one worker each, and say nothing of a node's room).
        assert sizing is not None and (sizing.headroom, sizing.headroom_reason) == (1, "cold")
        status = {s.name: s for s in await cp.pool_status()}["p"]
        assert status.sizing is not None and status.sizing.headroom_reason == "cold"
        # Held while the hold lasts, though no claim went cold since ...
        clock.advance(300.0)
        await cp.run_janitor_pass()
        sizing = cp.janitor.sizing("p")
        assert sizing is not None and (sizing.headroom, sizing.headroom_reason) == (1, "cold")
        # ... and none once it has passed.
        clock.advance(400.0)
        await cp.run_janitor_pass()
        sizing = cp.janitor.sizing("p")
        assert sizing is not None and (sizing.headroom, sizing.headroom_reason) == (0, "none")


async def test_a_cold_claim_whose_spawn_found_a_node_keeps_no_headroom(tmp_path: Path) -> None:
    # The same cold claim, but a node had room for its spawn: a placeholder would not
    # have made it any faster.
    clock = VirtualClock()
    spec = replace(pool(forecast=False), headroom_nodes=2)
    async with nodeless_plane(tmp_path, spec, clock) as (cp, runtime):
        runtime.full = False
        await go_cold(cp, runtime)
        sizing = cp.janitor.sizing("p")
        assert sizing is not None and (sizing.headroom, sizing.headroom_reason) == (0, "none")
        assert sizing.rate.value > 0  # the claim was seen


async def test_constant_headroom_is_kept_whatever_it_buys(tmp_path: Path) -> None:
    spec = replace(pool(forecast=False, headroom="constant"), headroom_nodes=2)
    async with plane(tmp_path, spec) as cp:
        await cp.run_janitor_pass()
        sizing = cp.janitor.sizing("p")
        assert sizing is not None and (sizing.headroom, sizing.headroom_reason) == (2, "constant")


async def test_a_draining_pool_keeps_no_headroom(tmp_path: Path) -> None:
    """A draining pool hands out no claims: a spare node held for its spawns buys nothing,
    whatever `demand.headroom` says (it kept its constant headroom, and a cold one for
    the hold, until it was deleted: the ledger's headroom cost of a pool being retired).
    Undrained, it keeps it again."""
    spec = replace(pool(forecast=False, headroom="constant"), headroom_nodes=2)
    async with plane(tmp_path, spec) as cp:
        await cp.run_janitor_pass()
        await cp.pools.set_draining("p", True)
        await cp.run_janitor_pass()
        sizing = cp.janitor.sizing("p")
        assert sizing is not None and (sizing.headroom, sizing.headroom_reason) == (0, "draining")
        await cp.pools.set_draining("p", False)
        await cp.run_janitor_pass()
        sizing = cp.janitor.sizing("p")
        assert sizing is not None and (sizing.headroom, sizing.headroom_reason) == (2, "constant")


async def test_a_forecast_that_expects_a_ramp_counts_the_reactive_rate_too(
    tmp_path: Path,
) -> None:
    """Led by its mean, a forecast alone sizes the pool between surges; while it expects
    a ramp (its rate rises over the replacement time), the reactive rate counts too: a
    ramp that comes early, with claims faster than the forecast's mean, finds the pool as
    warm as those claims want. Claims come at 0.1 a second, evenly (no panic), against a
    learned 0.05 an hour that stays (flat) or rises to 0.1 the next hour (a ramp)."""
    for ramp in (False, True):
        clock = VirtualClock()
        now_hour = buckets_of(clock.now())
        later = buckets_of(clock.now() + 3600.0)
        learned = [
            ForecastBucket("p", level, bucket, 0.05, 0.0001, 4, clock.now())
            for level, count in ((WEEK, 168), (DAY, 48))
            for bucket in range(count)
            if (level, bucket) not in now_hour + later
        ]
        for level, bucket in now_hour:
            learned.append(ForecastBucket("p", level, bucket, 0.05, 0.0001, 4, clock.now()))
        for level, bucket in later:
            rate = 0.1 if ramp else 0.05
            learned.append(ForecastBucket("p", level, bucket, rate, 0.0001, 4, clock.now()))
        path = tmp_path / str(ramp)
        path.mkdir()
        store = SqliteStore(str(path / "stoker.db"))
        await store.open()
        await store.record_forecast(learned)
        await store.close()
        # Past the hour's centre, where the forecast turns towards the next hour's.
        clock.advance(3600.0 - clock.now() % 3600.0 - 1500.0)
        spec = pool(forecast_error_bound=100.0)
        async with plane(path, spec, clock=clock) as cp:
            for _ in range(31):
                cp.demand.record_claim("p")
                await cp.run_janitor_pass()
                clock.advance(10.0)
            sizing = cp.janitor.sizing("p")
            assert sizing is not None and not sizing.rate.panicking
            assert sizing.forecast_warm is not None and sizing.reactive > sizing.forecast_warm
            if ramp:
                assert (sizing.policy, sizing.base) == ("reactive", sizing.reactive)
            else:
                assert (sizing.policy, sizing.base) == ("forecast", sizing.forecast_warm)


async def test_a_forecast_leads_by_its_mean_until_a_claim_misses(tmp_path: Path) -> None:
    # A learned forecast of 0.2 claims a second with a wide spread, every hour of the week.
    clock = VirtualClock()
    learned = [
        ForecastBucket("p", level, bucket, 0.2, 0.01, 4, clock.now())
        for level, count in (("week", 168), ("day", 48))
        for bucket in range(count)
    ]
    store = SqliteStore(str(tmp_path / "stoker.db"))
    await store.open()
    await store.record_forecast(learned)
    await store.close()
    # An error bound that never sets the forecast aside: nobody claims but one.
    spec = pool(forecast_error_bound=100.0, miss_hold_s=600.0)
    async with nodeless_plane(tmp_path, spec, clock) as (cp, runtime):
        runtime.full = False  # spawns find a node; they get ready when the test says

        def mean_warm(sizing: Sizing) -> int:
            return warm_for_rate(0.2, sizing.replace_s, QUANTILE)

        await cp.run_janitor_pass()
        sizing = cp.janitor.sizing("p")
        # No claim has missed: the forecast's mean sizes the pool, not its upper quantile.
        assert sizing is not None and sizing.policy == "forecast"
        assert sizing.forecast_rate == pytest.approx(0.2)
        assert sizing.desired == sizing.forecast_warm == mean_warm(sizing)
        # A flat forecast wants no room beyond the warm pool: new workers may gather.
        assert sizing.headroom_short is not None and sizing.headroom_short <= 0
        assert sizing.gather and runtime.gathering == {"p": True}
        # None of the warm pool is ready yet: a claim waits through a pass.
        claim = asyncio.create_task(cp.claim(ClaimRequest(pool="p", org="acme", timeout_s=30)))
        await asyncio.sleep(0.05)
        clock.advance(5.0)
        await cp.run_janitor_pass()
        for worker_id in list(runtime.procs):
            runtime.make_ready(worker_id)
        await cp.release((await claim).id)
        sizing = cp.janitor.sizing("p")
        # Guarded after the miss: the upper quantile, more warm workers, and no gathering
        # (the miss says the room was short).
        assert sizing is not None and sizing.policy == "forecast"
        assert sizing.forecast_rate is not None and sizing.forecast_rate > 0.2
        assert not sizing.gather and runtime.gathering == {"p": False}
        # (The claim waiting then adds one to the target: `desired` = `base` + 1.)
        assert sizing.forecast_warm is not None and sizing.waiting == 1
        assert sizing.base == sizing.forecast_warm > mean_warm(sizing)
        # Until `miss_hold_s` has passed without a miss.
        clock.advance(300.0)
        await cp.run_janitor_pass()
        sizing = cp.janitor.sizing("p")
        assert sizing is not None and sizing.desired > mean_warm(sizing)
        clock.advance(305.0)
        await cp.run_janitor_pass()
        sizing = cp.janitor.sizing("p")
        assert sizing is not None and sizing.forecast_rate == pytest.approx(0.2)
        assert sizing.desired == mean_warm(sizing)
        assert sizing.gather and runtime.gathering == {"p": True}
