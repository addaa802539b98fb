"""A pool that cannot be served never stops the janitor's work on the others, and a pool
whose spawns fail (whatever they fail with) holds no slot and makes a bounded number of
attempts: on virtual time (looptime), with `MemoryRuntime` workers and the real SQLite
store. A bad stored template is written into the store directly, as an older release or a
hand-edited database would have left it: the API rejects it today.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import sqlite3
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fakes import MemoryRuntime
from stoker.adapters.sqlite import SqliteStore
from stoker.control.plane import ControlPlane
from stoker.control.status import PoolStatus
from stoker.domain.errors import CapacityError, RuntimeFailure
from stoker.domain.records import ClaimRequest, Worker
from stoker.domain.rollouts import CanaryStrategy, ReplaceStrategy, RolloutState, Strategy
from stoker.domain.specs import PlaneSettings, PoolSpec, ProcessTemplate, SpawnBackoff, Timeouts
from stoker.domain.states import WorkerState
from stoker.ports.clock import VirtualClock

pytestmark = pytest.mark.looptime

S = WorkerState
TEMPLATE = ProcessTemplate(argv=("worker", "{port}"))


def pool(name: str, **kw: Any) -> PoolSpec:
    base: dict[str, Any] = {"name": name, "template": TEMPLATE, "warm_target": 2}
    base.update(kw)
    return PoolSpec(**base)


class MeasuringRuntime(MemoryRuntime):
    """A memory runtime that derives a pool's cap from its template's `memory_mb`, as the
    local runtime does (a budget of 4 GiB)."""

    def derived_cap(self, pool: PoolSpec) -> int:
        template = pool.template
        assert isinstance(template, ProcessTemplate)
        return max(1, 4096 // max(1, template.memory_mb))


class TimedRuntime(MemoryRuntime):
    """A memory runtime that notes when (loop time) each spawn was tried."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.tried: list[float] = []

    async def spawn(self, worker: Worker, pool: PoolSpec) -> Mapping[str, Any]:
        self.tried.append(asyncio.get_running_loop().time())
        return await super().spawn(worker, pool)


class CrashingRuntime(MemoryRuntime):
    """A runtime whose spawns of one pool raise what a template of the wrong type raises
    deep in a runtime (`env` values that are not strings, say)."""

    def __init__(self, pool: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.crash_pool = pool
        self.crashes = 0

    async def spawn(self, worker: Worker, pool: PoolSpec) -> Mapping[str, Any]:
        if pool.name == self.crash_pool:
            self.spawn_calls += 1
            self.crashes += 1
            raise TypeError("expected str, bytes or os.PathLike object, not int")
        return await super().spawn(worker, pool)


@dataclass
class Plane:
    plane: ControlPlane
    runtime: MemoryRuntime
    store: SqliteStore
    path: Path

    async def passes(self, n: int, every: float = 1.0) -> None:
        """`n` janitor passes, `every` seconds apart."""
        for _ in range(n):
            await self.plane.run_janitor_pass()
            await asyncio.sleep(every)

    async def warm(self, pool: str) -> list[Worker]:
        return [w for w in await self.store.list_workers(states=(S.WARM,)) if w.pool == pool]

    def metric(self, name: str, **labels: str) -> float:
        return self.plane.metrics.registry.get_sample_value(name, labels) or 0.0

    async def store_bad_rollout(self, name: str, strategy: Strategy, **bad: Any) -> str:
        """Start a rollout of `name` to a new template, then make its stored template bad
        in the database (as no API accepts it); returns the revision."""
        stored = await self.plane.pools.get(name)
        template = ProcessTemplate(argv=("worker", "{port}", "--v2"))
        rollout = await self.plane.pools.propose(
            stored, template, now=self.plane.clock.now(), strategy=strategy
        )
        body = {"kind": "process", "argv": list(template.argv), **bad}
        with sqlite3.connect(self.path / "stoker.db") as db:
            db.execute(
                "UPDATE revisions SET template = ? WHERE pool = ? AND revision = ?",
                (json.dumps(body), name, rollout.revision),
            )
        await self.plane.pools.refresh(force=True)
        return rollout.revision


@asynccontextmanager
async def running(
    path: Path, pools: Iterable[PoolSpec], *, runtime: MemoryRuntime | None = None
) -> AsyncIterator[Plane]:
    """A started plane without background loops: the test drives its passes."""
    store = SqliteStore(str(path / "stoker.db"))
    runtime = runtime or MeasuringRuntime(ready_delay=0.2)
    plane = ControlPlane(
        store=store,
        runtime=runtime,
        activator=runtime,
        pools=list(pools),
        settings=PlaneSettings(),
        clock=VirtualClock(),
    )
    await plane.start(loops=False)
    await asyncio.sleep(1)
    try:
        yield Plane(plane, runtime, store, path)
    finally:
        await plane.stop()


# -- a bad stored template never stops the janitor ------------------------------------------


async def test_a_bad_stable_template_fails_its_pool_only(tmp_path: Path) -> None:
    """The pool whose template breaks its step (`memory_mb: "x"` once promoted) fails
    pass after pass, counted and reported by readiness; the pool listed after it is still
    refilled and scaled down, and a replica restarted on the store starts."""
    pools = [pool("bad", warm_target=1), pool("good", scale_down_delay=2.0)]
    async with running(tmp_path, pools) as p:
        assert len(await p.warm("good")) == 2
        await p.store_bad_rollout("bad", ReplaceStrategy(), memory_mb="x")
        assert p.plane.degraded() == []

        await p.passes(3)
        [problem] = p.plane.degraded()
        assert (problem.pool, problem.problem, problem.in_a_row) == ("bad", "pass_failing", 3)
        # The pools' listing still answers, for the bad pool too (its configured cap).
        listed = {s.name: s for s in await p.plane.pool_status()}
        assert set(listed) == {"bad", "good"} and listed["bad"].cap == 0
        assert "TypeError" in problem.detail and "janitor pass, scale" in problem.detail
        assert p.metric("stoker_pass_failures_total", **{"pass": "janitor", "pool": "bad"}) == 3
        assert p.metric("stoker_pass_failures_total", **{"pass": "janitor", "pool": "good"}) == 0
        assert p.metric("stoker_pass_failures_total", **{"pass": "janitor", "pool": ""}) == 0

        # The other pool is refilled: a warm worker lost is replaced at the next pass.
        lost = (await p.warm("good"))[0]
        p.runtime.kill(lost.id)
        await p.passes(2)
        warm = await p.warm("good")
        assert len(warm) == 2 and lost.id not in {w.id for w in warm}

        # ... and scaled down when its target drops.
        await p.plane.pools.update("good", {"warm_target": 0})
        await p.passes(6)
        assert await p.warm("good") == []

        # The bad pool's step goes on failing, once per pass, each one counted.
        failed = p.metric("stoker_pass_failures_total", **{"pass": "janitor", "pool": "bad"})
        assert failed >= 3 + 2 + 6
        [problem] = p.plane.degraded()
        assert problem.in_a_row == failed

    # A replica that starts on this store starts (and serves the good pool).
    async with running(tmp_path, pools) as again:
        await again.passes(3)
        assert [x.pool for x in again.plane.degraded()] == ["bad"]


async def test_a_bad_rollout_revision_backs_off_and_the_stable_one_is_served(
    tmp_path: Path,
) -> None:
    """A canary whose stored template breaks its spawns: each attempt counts as a failed
    spawn of that revision (backed off, judged by the rollout, which rolls back), the step
    of the pass is counted as failed, readiness reports the spawns failing, and the stable
    revision keeps its warm pool."""
    pools = [pool("bad", warm_target=2), pool("good")]
    async with running(tmp_path, pools) as p:
        revision = await p.store_bad_rollout("bad", CanaryStrategy(steps=(50, 100)), memory_mb="x")
        await p.passes(8)
        assert p.metric("stoker_pass_failures_total", **{"pass": "janitor", "pool": "bad"}) >= 3
        assert p.metric("stoker_spawn_failures_total", pool="bad", reason="crash") >= 3
        problems = {(x.pool, x.problem, x.revision) for x in p.plane.degraded()}
        assert ("bad", "spawn_failing", revision) in problems
        # Backed off: attempts at 0, 1, 3 and 7 s, not one per pass.
        assert p.metric("stoker_spawn_failures_total", pool="bad", reason="crash") <= 5
        assert len(await p.warm("good")) == 2

        await p.passes(30)
        stable = p.plane.catalog.pool("bad").revision
        assert stable != revision
        assert len([w for w in await p.warm("bad") if w.revision == stable]) == 2
        [ramp] = await p.store.list_rollouts(pool="bad")
        assert ramp.state is RolloutState.ROLLED_BACK


# -- a spawn that crashes is a failed spawn ---------------------------------------------------


async def test_a_spawn_that_raises_frees_its_slot_at_once_and_counts(tmp_path: Path) -> None:
    runtime = CrashingRuntime("bad", ready_delay=0.2)
    backoff = SpawnBackoff(initial_s=30, max_s=60, factor=2)
    pools = [pool("bad", warm_target=1, max_workers=1, spawn_backoff=backoff), pool("good")]
    async with running(tmp_path, pools, runtime=runtime) as p:
        # The start's pass tried once; the slot is free again at once, not in 120 s.
        assert runtime.crashes == 1
        workers = [w for w in await p.store.list_workers() if w.pool == "bad"]
        assert [(w.state, w.reason) for w in workers] == [(S.RETIRED, "spawn_failure")]
        assert p.metric("stoker_spawn_failures_total", pool="bad", reason="crash") == 1
        [status] = [s for s in await p.plane.pool_status() if s.name == "bad"]
        assert status.spawn_failing and status.spawn_failures == 1
        error = status.last_spawn_error or ""
        assert "could not be started" in error and "not int" in error

        # The back-off holds the next attempts; a claim is told why, at once.
        with pytest.raises(CapacityError) as failed:
            await p.plane.claim(ClaimRequest(pool="bad", org="acme", timeout_s=0.5))
        assert failed.value.reason == "spawn_failing"
        assert runtime.crashes == 1
        assert len(await p.warm("good")) == 2

        # Fixed, the next probe after the back-off works and the pool fills its slot.
        runtime.crash_pool = ""
        await p.passes(31)
        assert len(await p.warm("bad")) == 1
        [status] = [s for s in await p.plane.pool_status() if s.name == "bad"]
        assert not status.spawn_failing


# -- back-off bounds spawns -----------------------------------------------------------------


async def test_a_pool_of_300_whose_command_cannot_start_tries_once_per_back_off(
    tmp_path: Path,
) -> None:
    """The figure docs/operations.md states: warm_target 300, every spawn fails, the
    default back-off (1 s doubling to 60 s), a janitor pass every 2 s for 15 minutes.
    Before, the 300 slots of the first pass all tried within 4 s (the token bucket's pace);
    now they wait their turn and one probes per back-off interval."""
    runtime = TimedRuntime(ready_delay=0.2)
    runtime.fail_spawns = 10**9
    async with running(tmp_path, [pool("p", warm_target=300)], runtime=runtime) as p:
        for _ in range(15):
            await p.passes(30, every=2.0)
        start = runtime.tried[0]
        at = [round(t - start) for t in runtime.tried]
        # 1, 2, 4, 8, 16 and 32 s of back-off, then 60 s: six tries in the first minute,
        # then one per minute.
        assert at[:6] == [0, 1, 3, 7, 15, 31], at
        # (A try may come a pass late: once the waiting slots gave up at their spawn
        # timeout, the janitor's next pass reserves the probe.)
        gaps = [b - a for a, b in itertools.pairwise(at[6:])]
        assert at[6] - at[5] == 32 and all(60 <= gap <= 64 for gap in gaps), at
        assert len(at) == 20


async def test_claims_during_a_back_off_do_not_spawn(tmp_path: Path) -> None:
    """Fifty prefer_warm claims (each would spawn cold) against a pool whose spawns fail:
    they share the revision's one probe per back-off and fail with `spawn_failing`."""
    backoff = SpawnBackoff(initial_s=10, max_s=60, factor=2)
    runtime = MemoryRuntime(ready_delay=0.2)
    runtime.fail_spawns = 10**9
    pools = [pool("p", warm_target=1, spawn_backoff=backoff)]
    async with running(tmp_path, pools, runtime=runtime) as p:
        before = runtime.spawn_calls
        claims = [
            p.plane.claim(ClaimRequest(pool="p", org=f"org{i}", timeout_s=30)) for i in range(50)
        ]
        results = await asyncio.gather(*claims, return_exceptions=True)
        assert all(isinstance(r, CapacityError) and r.reason == "spawn_failing" for r in results), (
            results
        )
        # Within 30 s of a 10 s back-off: the probes at 10 s and (after 20 s) 30 s at most.
        assert runtime.spawn_calls - before <= 2


async def test_a_pool_row_that_cannot_be_read_keeps_its_last_settings(tmp_path: Path) -> None:
    """A stored pool whose settings cannot be read (`min_hot_idle: "x"`) no longer keeps
    every pool from loading: the others load, it is served as it was, and its failure to
    load counts in each pass (the fallback reaper's and the janitor's) until /readyz names
    it. Parked workers past their TTL are retired by the reaper in both pools."""
    pools = [pool("bad", hot_idle_ttl=5.0), pool("good", hot_idle_ttl=5.0)]
    async with running(tmp_path, pools) as p:
        parked = {}
        for name in ("bad", "good"):
            claim = await p.plane.claim(ClaimRequest(pool=name, org="acme", timeout_s=5))
            await p.plane.release(claim.id)
            parked[name] = claim.worker_id
        with sqlite3.connect(p.path / "stoker.db") as db:
            [(settings,)] = db.execute("SELECT settings FROM pools WHERE name = 'bad'")
            db.execute(
                "UPDATE pools SET settings = ?, generation = generation + 1 WHERE name = 'bad'",
                (json.dumps({**json.loads(settings), "min_hot_idle": "x"}),),
            )
        await asyncio.sleep(10)

        await p.plane.run_reaper_pass()
        await asyncio.sleep(1)
        for name in ("bad", "good"):
            worker = await p.store.get_worker(parked[name])
            assert worker is not None and (worker.state, worker.reason) == (S.RETIRED, "ttl")
        assert p.metric("stoker_pass_failures_total", **{"pass": "reaper", "pool": "bad"}) == 1
        assert p.metric("stoker_pass_failures_total", **{"pass": "reaper", "pool": ""}) == 0

        await p.passes(3)
        # Both refilled after the claims (the demand rate may ask for more than 2).
        assert len(await p.warm("good")) >= 2 and len(await p.warm("bad")) >= 2
        [problem] = p.plane.degraded()
        assert (problem.pool, problem.problem) == ("bad", "pass_failing")
        assert "janitor pass, load: its stored row cannot be read" in problem.detail


async def test_one_probe_at_a_time_while_it_is_in_flight(tmp_path: Path) -> None:
    """A probe that started but is not ready yet (a slow start, or one that will fail
    late) holds the revision's turn: claims that come after its back-off ended do not
    each start another."""
    backoff = SpawnBackoff(initial_s=2, max_s=8, factor=2)
    runtime = MemoryRuntime(auto_ready=False)
    runtime.fail_spawns = 1
    async with running(
        tmp_path, [pool("p", warm_target=0, spawn_backoff=backoff)], runtime=runtime
    ) as p:
        with pytest.raises(CapacityError):
            await p.plane.claim(ClaimRequest(pool="p", org="acme", timeout_s=1))
        assert runtime.spawn_calls == 1
        await asyncio.sleep(3)
        with pytest.raises(CapacityError):  # the probe starts, and never gets ready
            await p.plane.claim(ClaimRequest(pool="p", org="acme", timeout_s=1))
        assert runtime.spawn_calls == 2
        for i in range(10):
            await asyncio.sleep(3)
            with pytest.raises(CapacityError):
                await p.plane.claim(ClaimRequest(pool="p", org=f"org{i}", timeout_s=1))
        assert runtime.spawn_calls == 2


async def test_a_waiting_spawn_retired_elsewhere_never_starts(tmp_path: Path) -> None:
    """Another replica's stuck sweep may retire a slot that waits for its turn here (this
    replica's memory does not hear of it): the spawn reads its row before it starts, and
    starts nothing for a retired one. A slot that outwaits its spawn timeout gives up on
    its own, nothing started."""
    backoff = SpawnBackoff(initial_s=5, max_s=60, factor=2)
    timeouts = Timeouts(spawn_s=30)
    runtime = MemoryRuntime(ready_delay=0.2)
    runtime.fail_spawns = 1
    pools = [pool("p", warm_target=3, spawn_backoff=backoff, timeouts=timeouts)]
    async with running(tmp_path, pools, runtime=runtime) as p:
        waiting = await p.store.list_workers(states=(S.SPAWNING,))
        assert runtime.spawn_calls == 1 and len(waiting) == 2
        gone = waiting[0]
        await p.store.transition(
            gone.id,
            expect=S.SPAWNING,
            epoch=gone.epoch,
            version=gone.version,
            to=S.RETIRED,
            now=p.plane.clock.now(),
            changes={"reason": "stuck"},
        )
        await asyncio.sleep(10)  # the back-off ended: one of them probes, and works
        assert runtime.spawn_calls == 2
        assert gone.id not in runtime.procs

    runtime = MemoryRuntime(ready_delay=0.2)
    runtime.fail_spawns = 10**9
    (tmp_path / "2").mkdir()
    pools = [pool("p", warm_target=10, spawn_backoff=backoff, timeouts=timeouts)]
    async with running(tmp_path / "2", pools, runtime=runtime) as p:
        await asyncio.sleep(31)
        rows = await p.store.list_workers()
        assert not [w for w in rows if w.state is S.SPAWNING]
        assert {w.reason for w in rows} == {"spawn_failure", "stuck"}
        assert runtime.spawn_calls == 3  # at 0, 5 and 15 s; the next would be at 35 s


# -- what a pool whose spawns fail shows ------------------------------------------------------


class QuotaRuntime(MemoryRuntime):
    """A memory runtime in a namespace whose quota has room for `room` workers: a spawn
    beyond them is refused at once, as the API server refuses a pod (403)."""

    def __init__(self, room: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.room = room

    async def spawn(self, worker: Worker, pool: PoolSpec) -> Mapping[str, Any]:
        if sum(proc.alive for proc in self.procs.values()) >= self.room:
            self.spawn_calls += 1
            raise RuntimeFailure(f'pods "{worker.id}" is forbidden: exceeded quota: pods=1')
        return await super().spawn(worker, pool)


async def status_of(p: Plane, name: str = "p") -> PoolStatus:
    [status] = [s for s in await p.plane.pool_status() if s.name == name]
    return status


async def test_a_quota_full_after_one_worker_shows_the_spawns_failing_all_along(
    tmp_path: Path,
) -> None:
    """A quota has room for one of the three workers the pool wants: the first is created,
    the next two refused, then the first gets ready. Its readiness ends the back-off (what
    gates spawns is as it was) but not what the pool shows: the quota is as full as
    before, and `spawn_failing`, the metric and `/readyz` keep saying so with the error,
    where they said all was well until the next refusal (seconds, up to a back-off)."""
    runtime = QuotaRuntime(room=1, ready_delay=2.5)
    pools = [pool("p", warm_target=3)]
    async with running(tmp_path, pools, runtime=runtime) as p:
        await asyncio.sleep(2)  # the first gets ready after the two refusals (0 and 1 s)
        spec = p.plane.catalog.pool("p")
        assert len(await p.warm("p")) == 1 and runtime.spawn_calls == 3
        assert p.plane.spawner.trouble(spec) is None  # the back-off ended, as before
        status = await status_of(p)
        assert (status.spawn_failing, status.spawn_failures) == (True, 2)
        assert "exceeded quota" in (status.last_spawn_error or "")
        assert p.metric("stoker_spawn_failing", pool="p") == 2

        # The next pass asks again (no back-off): refused twice more, 4 since spawns worked.
        await p.passes(1)
        status = await status_of(p)
        assert (status.spawn_failing, status.spawn_failures) == (True, 4)
        assert p.metric("stoker_spawn_failing", pool="p") == 4
        [problem] = p.plane.degraded()
        assert (problem.pool, problem.problem, problem.in_a_row) == ("p", "spawn_failing", 4)
        assert "exceeded quota" in problem.detail


async def test_a_worker_asked_for_after_the_failures_ends_them(tmp_path: Path) -> None:
    """A real recovery clears what the pool shows: room in the quota, the next spawn (asked
    for after the last refusal) gets ready, and the pool fills."""
    runtime = QuotaRuntime(room=1, ready_delay=2.5)
    async with running(tmp_path, [pool("p", warm_target=3)], runtime=runtime) as p:
        await asyncio.sleep(2)
        assert (await status_of(p)).spawn_failing
        runtime.room = 3
        await p.passes(10)
        assert len(await p.warm("p")) == 3
        status = await status_of(p)
        assert (status.spawn_failing, status.spawn_failures, status.last_spawn_error) == (
            False,
            0,
            None,
        )
        assert p.metric("stoker_spawn_failing", pool="p") == 0
        assert p.plane.degraded() == []


async def test_another_replicas_worker_ends_the_failures_only_if_asked_for_after_them(
    tmp_path: Path,
) -> None:
    """On Kubernetes every replica hears every pod get ready. A worker another replica
    asked for proves the spawns work again if its row was created after the last failure
    (this replica's own are ordered by its asks): else a follower whose one cold spawn
    failed would show it, and page, until it spawned again itself."""
    runtime = QuotaRuntime(room=1, ready_delay=2.5)
    async with running(tmp_path, [pool("p", warm_target=3)], runtime=runtime) as p:
        await asyncio.sleep(2)
        [ready] = await p.warm("p")
        spawner, now = p.plane.spawner, p.plane.clock.now()
        assert (await status_of(p)).spawn_failing
        # Another replica's worker, created before the failures: proves nothing.
        earlier = dataclasses.replace(ready, id="w-other-1", created_at=ready.created_at - 1)
        spawner.spawn_ready(earlier)
        assert (await status_of(p)).spawn_failing
        # One created after them: the runtime takes spawns again.
        later = dataclasses.replace(ready, id="w-other-2", created_at=now + 0.5)
        spawner.spawn_ready(later)
        status = await status_of(p)
        assert (status.spawn_failing, status.spawn_failures) == (False, 0)
        assert p.metric("stoker_spawn_failing", pool="p") == 0


async def test_a_pool_that_holds_its_target_after_failures_shows_them_no_more(
    tmp_path: Path,
) -> None:
    """Failures that no longer keep the pool from its target end what it shows, though no
    worker asked for after them got ready: here the quota still has room for one, and the
    pool's target is lowered to that one. Else an idle pool would show them (and page
    through `StokerPoolBackingOff`) until its next spawn."""
    runtime = QuotaRuntime(room=1, ready_delay=2.5)
    async with running(tmp_path, [pool("p", warm_target=3)], runtime=runtime) as p:
        await asyncio.sleep(2)
        assert (await status_of(p)).spawn_failing
        await p.plane.pools.update("p", {"warm_target": 1})
        await p.passes(3)
        assert len(await p.warm("p")) == 1
        status = await status_of(p)
        assert (status.spawn_failing, status.spawn_failures) == (False, 0)
        assert p.metric("stoker_spawn_failing", pool="p") == 0
        assert p.plane.degraded() == []


async def test_pods_kept_waiting_for_a_node_end_the_failures_when_all_got_ready(
    tmp_path: Path,
) -> None:
    """Pods no node fits are failed spawns that are kept (a node may be on its way): once
    the node came and every one of them got ready, the trouble is over, though all were
    asked for before the failures; while one still waits, it is not."""
    runtime = MemoryRuntime(auto_ready=False)
    async with running(tmp_path, [pool("p", warm_target=2)], runtime=runtime) as p:
        first, second = sorted(runtime.procs)
        assert runtime.listener is not None
        for worker_id in (first, second):
            runtime.listener.worker_stalled(worker_id, "unschedulable", "0/3 nodes fit")
        assert (await status_of(p)).spawn_failures == 2
        runtime.make_ready(first)
        await asyncio.sleep(1)
        status = await status_of(p)
        assert (status.spawn_failing, status.last_spawn_error) == (True, "0/3 nodes fit")
        runtime.make_ready(second)
        await asyncio.sleep(1)
        assert len(await p.warm("p")) == 2
        assert not (await status_of(p)).spawn_failing
        assert p.metric("stoker_spawn_failing", pool="p") == 0


async def test_a_deleted_pool_whose_spawns_failed_leaves_readiness(tmp_path: Path) -> None:
    """Spawn trouble is kept per pool revision; once the pool is deleted from the store
    (drained, its workers gone) the replica forgets it: `/readyz` no longer names it."""
    runtime = CrashingRuntime("bad", ready_delay=0.2)
    async with running(tmp_path, [pool("bad"), pool("good")], runtime=runtime) as p:
        await p.passes(3)
        assert "bad" in {x.pool for x in p.plane.degraded()}
        await p.plane.pools.set_draining("bad", True)
        await p.passes(3)
        # Deleted through a replica whose file no longer declares it.
        await p.store.delete_pool("bad")
        await p.passes(1)
        assert "bad" not in p.plane.catalog.pools
        assert p.plane.degraded() == []
        assert p.metric("stoker_spawn_failures_total", pool="bad", reason="crash") == 0
