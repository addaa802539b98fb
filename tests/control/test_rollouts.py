"""A canary rollout in one replica: routing by share, org stickiness, reuse on the worker's
own revision, ramp sizing, steps, and a failure in the middle of a ramp (#14).

Workers are `MemoryRuntime` entries (tests/fakes.py: no process is needed to route a
claim); the store is the real SQLite adapter; time is virtual (looptime).
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fakes import MemoryRuntime
from stoker.adapters.sqlite import SqliteStore
from stoker.control.plane import ControlPlane
from stoker.control.rollout_actions import Action
from stoker.domain.errors import RuntimeFailure
from stoker.domain.pools import Rollout
from stoker.domain.records import Claim, ClaimRequest, Worker
from stoker.domain.rollouts import CanaryStrategy, RolloutState
from stoker.domain.specs import PlaneSettings, PoolSpec, ProcessTemplate, revision_of
from stoker.domain.states import ClaimSource, Reuse, WorkerState
from stoker.policy.rollout import org_position
from stoker.ports.activator import ActivationPayload
from stoker.ports.clock import VirtualClock

pytestmark = pytest.mark.looptime

S = WorkerState
OLD = ProcessTemplate(argv=("worker", "{port}"))
NEW = ProcessTemplate(argv=("worker", "--v2", "{port}"))
OLD_REV, NEW_REV = revision_of(OLD), revision_of(NEW)


class BadImageRuntime(MemoryRuntime):
    """Every other activation of the new revision fails (a bad image)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.bad = False
        self._tries = 0

    async def activate(self, worker: Worker, payload: ActivationPayload, timeout: float) -> None:
        if self.bad and worker.revision == NEW_REV:
            self._tries += 1
            if self._tries % 2:
                raise RuntimeFailure("bad image: exit 1")
        await super().activate(worker, payload, timeout)


@dataclass
class Harness:
    plane: ControlPlane
    runtime: BadImageRuntime
    store: SqliteStore
    clock: VirtualClock

    async def tick(self) -> None:
        await self.plane.run_janitor_pass()
        await asyncio.sleep(1.0)

    async def claim(self, org: str) -> Claim:
        return await self.plane.claim(ClaimRequest(pool="p", org=org, timeout_s=10.0))

    async def revision_of_claim(self, claim: Claim) -> str:
        worker = await self.store.get_worker(claim.worker_id)
        assert worker is not None
        return worker.revision

    async def warm(self, revision: str) -> list[Worker]:
        return [w for w in await self.store.list_workers(states=[S.WARM]) if w.revision == revision]

    async def start(self, step: int = 0, **kw: Any) -> Rollout:
        strategy = CanaryStrategy(**{"steps": (10, 50, 100), "step_interval_s": 60, **kw})
        now = self.clock.now()
        rollout = Rollout(
            id="ro-1",
            pool="p",
            revision=NEW_REV,
            base_revision=OLD_REV,
            strategy=strategy,
            state=RolloutState.RAMPING,
            started_at=now,
            step=step,
            share=strategy.steps[step],
            step_started_at=now,
        )
        # Stored as a rollout start writes it; the replica serves it from its next load.
        pool = await self.store.get_pool("p")
        assert pool is not None
        await self.store.start_rollout(rollout, NEW, generation=pool.generation, now=now)
        await self.plane.pools.refresh()
        return rollout


@asynccontextmanager
async def running(path: Path, **pool_kw: Any) -> AsyncIterator[Harness]:
    store = SqliteStore(str(path / "stoker.db"))
    runtime = BadImageRuntime(ready_delay=0.2)
    clock = VirtualClock()
    spec = PoolSpec(**{"name": "p", "template": OLD, "warm_target": 4, **pool_kw})
    plane = ControlPlane(
        store=store,
        runtime=runtime,
        activator=runtime,
        pools=[spec],
        settings=PlaneSettings(),
        clock=clock,
    )
    await plane.start(loops=False)
    await asyncio.sleep(1.0)
    try:
        yield Harness(plane, runtime, store, clock)
    finally:
        await plane.stop()


async def test_new_claims_split_by_share_and_each_org_keeps_its_revision(tmp_path: Path) -> None:
    async with running(tmp_path, reuse=Reuse.NEVER, warm_target=20) as h:
        await h.start(step=1)  # 50 %
        await h.tick()
        assert await h.warm(NEW_REV), "the ramp got warm workers of its own"
        orgs = [f"org-{i}" for i in range(16)]
        seen: dict[str, set[str]] = {org: set() for org in orgs}
        for _ in range(2):
            claims = [await h.claim(org) for org in orgs]
            for org, claim in zip(orgs, claims, strict=True):
                seen[org].add(await h.revision_of_claim(claim))
                await h.plane.release(claim.id)
            await h.tick()
        for org in orgs:
            expected = NEW_REV if org_position("ro-1", org) < 0.5 else OLD_REV
            assert seen[org] == {expected}, org
        assert {r for s in seen.values() for r in s} == {OLD_REV, NEW_REV}


async def test_reuse_stays_on_the_workers_own_revision(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        first = await h.claim("acme")
        await h.plane.release(first.id)  # parked as acme's hot_idle, old revision
        await h.start(step=2)  # every new claim goes to the new revision
        await h.tick()
        again = await h.claim("acme")
        assert again.source is ClaimSource.REUSE and again.worker_id == first.worker_id
        assert await h.revision_of_claim(again) == OLD_REV
        fresh = await h.claim("newcomer")
        assert await h.revision_of_claim(fresh) == NEW_REV
        # Released during the ramp, both park: each revision serves.
        for claim in (again, fresh):
            await h.plane.release(claim.id)
        parked = await h.store.list_workers(states=[S.HOT_IDLE])
        assert {w.revision for w in parked} == {OLD_REV, NEW_REV}


async def test_the_ramp_is_sized_from_the_claims_it_will_get(tmp_path: Path) -> None:
    async with running(tmp_path, warm_target=20, reuse=Reuse.NEVER) as h:
        claims = [await h.claim(f"o{i}") for i in range(60)]
        assert len(claims) == 60
        await h.start(step=0)
        await h.tick()
        await h.tick()
        plan = h.plane.rollouts.plans["p"]
        assert plan.ramping == NEW_REV
        whole = plan.totals["whole"]
        new, old = plan.part(NEW_REV), plan.part(OLD_REV)
        # 10 % of the pool's own warm target, never 10 % of the 60 sessions the old
        # revision serves (they never move); the stable revision gives up as much.
        assert new.warm_target == math.ceil(whole * 0.1) < 6
        assert new.warm_target + old.warm_target == whole
        assert len(await h.warm(NEW_REV)) == new.warm_target


async def test_a_started_canary_routes_nothing_before_it_holds_its_first_step(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, warm_target=20, reuse=Reuse.NEVER) as h:
        stored = await h.plane.pools.get("p")
        strategy = CanaryStrategy(steps=(50, 100), step_interval_s=60)
        rollout = await h.plane.pools.propose(stored, NEW, now=h.clock.now(), strategy=strategy)
        assert rollout.share == 0 and rollout.step == 0
        # Nothing of the new revision is warm yet: every new claim stays on the old one.
        orgs = [f"org-{i}" for i in range(12)]
        for org in orgs:
            claim = await h.claim(org)
            assert await h.revision_of_claim(claim) == OLD_REV
            await h.plane.release(claim.id)
        await h.tick()  # spawns the first step's workers (ready 0.2 s later)
        await h.tick()  # holds them: the step takes effect
        ramp = h.plane.catalog.rollout("p")
        assert ramp is not None and ramp.share == 50 and ramp.state is RolloutState.RAMPING
        assert len(await h.warm(NEW_REV)) >= 9  # 90 % of half of the pool's 20
        kinds = [e.kind.value for e in h.plane.journal.recent()]
        assert "rollout_step" in kinds


async def test_a_step_that_cannot_hold_its_workers_pauses_the_rollout(tmp_path: Path) -> None:
    spec = {"warm_target": 4, "max_workers": 10, "scale_down_delay": 3600.0}
    async with running(tmp_path, reuse=Reuse.NEVER, **spec) as h:
        # Sessions that outlast the deadline, and the old revision's warm workers that do
        # not make room before it (scale_down_delay), fill the cap.
        for i in range(6):
            await h.plane.claim(ClaimRequest(pool="p", org=f"o{i}", timeout_s=10, lease_s=600))
        await h.tick()
        assert len(await h.warm(OLD_REV)) == 4
        stored = await h.plane.pools.get("p")
        strategy = CanaryStrategy(steps=(50, 100), step_interval_s=60, hold_deadline_s=120)
        await h.plane.pools.propose(stored, NEW, now=h.clock.now(), strategy=strategy)
        await h.tick()
        for _ in range(3):
            await asyncio.sleep(50)
            await h.tick()
        row = await h.store.get_rollout(h.plane.catalog.rollout("p").id)  # type: ignore[union-attr]
        assert row is not None and row.state is RolloutState.PAUSED and row.share == 0
        assert row.reason is not None
        assert re.search(r"holds 0 of the \d+ warm workers", row.reason)
        assert "cap of 10" in row.reason
        events = [e for e in h.plane.journal.recent() if e.kind.value == "rollout_paused"]
        assert events and events[0].reason == row.reason


async def test_steps_advance_after_their_interval_and_the_last_promotes(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        await h.start(step=0, step_interval_s=30)
        await h.tick()
        ramp = h.plane.catalog.rollout("p")
        assert ramp is not None and ramp.step == 0
        for _ in range(3):
            await asyncio.sleep(31)
            await h.tick()
            await h.tick()
        # Ended: the store has it promoted, and the replica serves its revision as stable.
        ramp = await h.store.get_rollout("ro-1")
        assert ramp is not None and ramp.state is RolloutState.PROMOTED
        assert h.plane.catalog.pool("p").revision == NEW_REV
        for _ in range(4):
            await h.tick()
        assert await h.warm(OLD_REV) == []
        assert len(await h.warm(NEW_REV)) == 4


async def test_failure_mid_ramp_rolls_back_and_restores_the_stable_target_at_once(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, warm_target=10, reuse=Reuse.NEVER) as h:
        await h.start(step=2)  # 100 %: every new claim tries the new revision
        await h.tick()
        h.runtime.bad = True
        for i in range(3):
            claim = await h.claim(f"o{i}")  # each retries past a failed activation
            await h.plane.release(claim.id)
        left = await h.warm(NEW_REV)
        assert left, "the ramp still holds warm workers when it fails"
        await h.plane.run_janitor_pass()
        ramp = h.plane.catalog.rollout("p")
        assert ramp is not None and ramp.state is RolloutState.ROLLED_BACK
        plan = h.plane.rollouts.plans["p"]
        whole = 10 + h.plane.janitor.demand["p"]  # the static target plus the misses
        assert plan.part(OLD_REV).share == 1.0 and plan.part(OLD_REV).warm_target == whole
        assert plan.part(NEW_REV).warm_target == 0
        await asyncio.sleep(1.0)
        # In the same pass: the stable revision spawned back to its whole target, and every
        # warm worker of the failed one retired.
        assert len(await h.warm(OLD_REV)) == whole
        assert await h.warm(NEW_REV) == []
        for w in left:
            gone = await h.store.get_worker(w.id)
            assert gone is not None and gone.reason == "rollout_failed"
        after = await h.claim("o-late")
        assert await h.revision_of_claim(after) == OLD_REV


def _shares(h: Harness) -> dict[str, float]:
    return {
        sample.labels["revision"]: sample.value
        for metric in h.plane.metrics.registry.collect()
        if metric.name == "stoker_pool_revision_share"
        for sample in metric.samples
    }


def _state(h: Harness) -> set[str]:
    return {
        sample.labels["state"]
        for metric in h.plane.metrics.registry.collect()
        if metric.name == "stoker_rollout_state"
        for sample in metric.samples
        if sample.value == 1
    }


async def test_metrics_show_the_current_plan_after_rollouts_that_ended(tmp_path: Path) -> None:
    async with running(tmp_path, warm_target=4) as h:
        strategy = CanaryStrategy(steps=(50, 100), step_interval_s=60)
        seen: list[str] = []
        for version in range(3):
            template = ProcessTemplate(argv=("worker", f"--v{version + 2}", "{port}"))
            stored = await h.plane.pools.get("p")
            rollout = await h.plane.pools.propose(
                stored, template, now=h.clock.now(), strategy=strategy
            )
            seen.append(rollout.revision)
            await h.tick()
            await h.tick()
            assert _state(h) == {"ramping"}
            if version == 1:
                await h.plane.rollout_actions.act("p", rollout.id, Action.ABORT)
                assert _state(h) == {"aborted"}
                await h.tick()
                assert _state(h) == set()  # none under way
        # The first was superseded, the second aborted, the third ramps at 50 %.
        shares = _shares(h)
        assert shares == {OLD_REV: 0.5, seen[2]: 0.5}
        await h.plane.rollout_actions.act("p", rollout.id, Action.PROMOTE)
        assert _shares(h) == {seen[2]: 1.0} and _state(h) == {"promoted"}
        await h.tick()
        assert _shares(h) == {seen[2]: 1.0} and _state(h) == set()


async def test_the_rollout_view_samples_each_revision_and_says_why_a_step_waits(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, warm_target=10, reuse=Reuse.NEVER) as h:
        claims = [await h.claim(f"o{i}") for i in range(3)]
        strategy = CanaryStrategy(steps=(50, 100), step_interval_s=60)
        stored = await h.plane.pools.get("p")
        rollout = await h.plane.pools.propose(stored, NEW, now=h.clock.now(), strategy=strategy)
        await h.plane.run_janitor_pass()  # spawns the first step's workers: they wait
        (status,) = await h.plane.pool_status()
        assert status.rollout_waits is not None
        assert "holds 0 of the" in status.rollout_waits
        await h.tick()
        await h.tick()
        (status,) = await h.plane.pool_status()
        assert status.rollout_waits is not None
        assert status.rollout_waits.startswith("the step's interval: the next step is due in")
        await h.plane.sample_pools()
        samples = h.plane.history.samples()["p"]
        revisions = {r.revision: r for r in samples[-1].revisions}
        assert revisions[OLD_REV].share == 0.5 and revisions[NEW_REV].share == 0.5
        assert revisions[OLD_REV].busy == len(claims)
        assert revisions[NEW_REV].warm >= 5 and revisions[NEW_REV].busy == 0
        await h.plane.rollout_actions.act("p", rollout.id, Action.ABORT)
        await h.tick()
        (status,) = await h.plane.pool_status()
        assert status.rollout_waits is None


async def test_a_canary_preparing_its_first_step_lends_no_warm_worker(tmp_path: Path) -> None:
    async with running(tmp_path, warm_target=2, reuse=Reuse.NEVER) as h:
        stored = await h.plane.pools.get("p")
        strategy = CanaryStrategy(steps=(50, 100), step_interval_s=60)
        await h.plane.pools.propose(stored, NEW, now=h.clock.now(), strategy=strategy)
        await h.plane.run_janitor_pass()  # spawns the first step's workers
        await asyncio.sleep(1.0)
        held = {w.id for w in await h.warm(NEW_REV)}
        ramp = h.plane.catalog.rollout("p")
        assert held and ramp is not None and ramp.share == 0
        # More claims than the old revision has warm workers: they go cold on it rather
        # than take a worker of the revision whose first step has not taken effect.
        for i in range(6):
            claim = await h.claim(f"o{i}")
            assert await h.revision_of_claim(claim) == OLD_REV
        assert {w.id for w in await h.warm(NEW_REV)} == held
