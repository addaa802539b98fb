"""Verdicts from every replica: a bad revision whose failures only the replicas that do
not lead see rolls back, because every replica writes its outcome counts to the store and
the leader judges from their sum (#25).

Three planes on one SQLite file with one set of `MemoryRuntime` workers; the passes are
driven by hand (the first plane runs the janitor, the others their fallback reaper), on
virtual time (looptime).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from fakes import MemoryRuntime
from stoker.adapters.sqlite import SqliteStore
from stoker.control.plane import ControlPlane
from stoker.control.rollout_actions import Action
from stoker.domain.errors import RuntimeFailure
from stoker.domain.pools import Rollout
from stoker.domain.records import ClaimRequest, Worker
from stoker.domain.rollouts import CanaryStrategy, RolloutState
from stoker.domain.specs import PlaneSettings, PoolSpec, ProcessTemplate, revision_of
from stoker.domain.states import Reuse
from stoker.ports.activator import ActivationPayload
from stoker.ports.clock import VirtualClock

pytestmark = pytest.mark.looptime

OLD = ProcessTemplate(argv=("worker", "{port}"))
NEW = ProcessTemplate(argv=("worker", "--v2", "{port}"))
STEP_S = 60.0


class ImageRuntime(MemoryRuntime):
    """Activations of `bad` (a revision) fail on this replica's activator."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.bad: str | None = None

    async def activate(self, worker: Worker, payload: ActivationPayload, timeout: float) -> None:
        if worker.revision == self.bad:
            raise RuntimeFailure("bad image: exit 1")
        await super().activate(worker, payload, timeout)


@asynccontextmanager
async def replicas(path: Path) -> AsyncIterator[tuple[list[ControlPlane], list[ImageRuntime]]]:
    spec = PoolSpec(name="p", template=OLD, warm_target=10, reuse=Reuse.NEVER)
    async with AsyncExitStack() as stack:
        planes: list[ControlPlane] = []
        runtimes: list[ImageRuntime] = []
        for _ in range(3):
            runtime = ImageRuntime(ready_delay=0.2)
            if runtimes:
                runtime.procs = runtimes[0].procs  # one set of workers
            plane = ControlPlane(
                store=SqliteStore(str(path / "stoker.db")),
                runtime=runtime,
                activator=runtime,
                pools=[spec],
                settings=PlaneSettings(),
                clock=VirtualClock(),
            )
            await plane.start(loops=False)
            stack.push_async_callback(plane.stop)
            planes.append(plane)
            runtimes.append(runtime)
        await asyncio.sleep(1)
        yield planes, runtimes


async def test_failures_seen_only_by_replicas_that_do_not_lead_roll_the_revision_back(
    tmp_path: Path,
) -> None:
    async with replicas(tmp_path) as (planes, runtimes):
        leader, others = planes[0], planes[1:]
        for runtime in runtimes[1:]:
            runtime.bad = revision_of(NEW)
        stored = await leader.pools.get("p")
        strategy = CanaryStrategy(steps=(50, 100), step_interval_s=STEP_S)
        rollout = await leader.pools.propose(stored, NEW, now=leader.clock.now(), strategy=strategy)
        loop = asyncio.get_running_loop()
        took_effect: float | None = None
        row: Rollout | None = None
        orgs = iter(range(10_000))
        for _ in range(int(3 * STEP_S)):
            await leader.run_janitor_pass()
            for plane in others:
                await plane.run_reaper_pass()
            row = await leader.store.get_rollout(rollout.id)
            assert row is not None
            if row.state.ended:
                break
            if took_effect is None and row.share > 0:
                took_effect = loop.time()
            # New claims only on the replicas that do not lead.
            for plane in others:
                claim = await plane.claim(ClaimRequest(pool="p", org=f"o{next(orgs)}"))
                await plane.release(claim.id)
            await asyncio.sleep(1.0)
        assert took_effect is not None, "the first step never took effect"
        assert row is not None
        assert row.state is RolloutState.ROLLED_BACK and "activation" in (row.reason or "")
        assert loop.time() - took_effect <= 2 * STEP_S
        # The leader saw none of the failures itself: the verdict is the replicas' sum.
        assert leader.rollouts.failures(rollout.id).activation_failures == 0
        summed = await leader.store.read_outcomes([rollout.id])
        assert summed[rollout.id]["activation_failure"] >= 5
        kinds = [e.kind.value for e in leader.journal.recent()]
        assert "rollout_rolled_back" in kinds and "rollout_step" in kinds


async def test_a_replica_that_does_not_lead_shows_the_stored_rollout(tmp_path: Path) -> None:
    async with replicas(tmp_path) as (planes, _):
        leader, other = planes[0], planes[1]

        def shares(plane: ControlPlane) -> dict[str, float]:
            return {
                s.labels["revision"]: s.value
                for m in plane.metrics.registry.collect()
                if m.name == "stoker_pool_revision_share"
                for s in m.samples
            }

        stored = await leader.pools.get("p")
        strategy = CanaryStrategy(steps=(50, 100), step_interval_s=STEP_S)
        rollout = await leader.pools.propose(stored, NEW, now=leader.clock.now(), strategy=strategy)
        for _ in range(3):
            await leader.run_janitor_pass()
            await other.run_reaper_pass()
            await asyncio.sleep(1.0)
        assert shares(other) == {revision_of(OLD): 0.5, revision_of(NEW): 0.5}
        await leader.rollout_actions.act("p", rollout.id, Action.ABORT)
        await other.run_reaper_pass()
        assert shares(other) == {revision_of(OLD): 1.0}
