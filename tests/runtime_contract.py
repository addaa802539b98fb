"""The Runtime contract: what every runtime must do, run against each of them.

The in-memory runtime the control-plane tests use (`tests/fakes.py`) is checked here
against the real ones, so a control-plane test on it means what it would on a real
runtime: `tests/test_fakes.py` runs the suite on `MemoryRuntime`,
`tests/adapters/test_runtime_local.py` on real demo-worker processes and
`tests/adapters/test_runtime_kubernetes.py` on pods of the in-process fake cluster.

A subclass provides a `harness` fixture (a `RuntimeHarness`): it starts runtimes of one
fleet, kills a worker from outside (the process dies, the pod fails) and lets events
settle; it cleans up whatever its runtimes left.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from typing import Protocol

import pytest

from stoker.domain.records import Worker
from stoker.domain.specs import PoolSpec
from stoker.domain.states import WorkerState
from stoker.ports.runtime import Runtime

#: Bound on every wait for a runtime event (real time for processes, virtual for pods).
EVENT_TIMEOUT_S = 10.0


class Recorder:
    """A runtime listener that records every event and lets a test await one."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []
        #: How each lost worker ended, as the runtime said (`worker_lost`'s detail).
        self.details: dict[str, str | None] = {}
        #: Workers whose stopped object the runtime reported gone, and when.
        self.gone: list[tuple[str, float]] = []
        self._ready: dict[str, asyncio.Future[str]] = defaultdict(self._future)
        self._lost: dict[str, asyncio.Future[str]] = defaultdict(self._future)

    @staticmethod
    def _future() -> asyncio.Future[str]:
        return asyncio.get_running_loop().create_future()

    def worker_ready(self, worker_id: str, endpoint: str) -> None:
        self.events.append(("ready", worker_id, endpoint))
        if not self._ready[worker_id].done():
            self._ready[worker_id].set_result(endpoint)

    def worker_lost(self, worker_id: str, reason: str, detail: str | None = None) -> None:
        self.events.append(("lost", worker_id, reason))
        self.details[worker_id] = detail
        if not self._lost[worker_id].done():
            self._lost[worker_id].set_result(reason)

    def worker_stalled(self, worker_id: str, stage: str, error: str) -> None:
        self.events.append(("stalled", worker_id, stage))

    def worker_gone(self, worker_id: str, at: float) -> None:
        self.gone.append((worker_id, at))

    async def ready(self, worker_id: str) -> str:
        """The endpoint of `worker_id`'s readiness event, once it comes."""
        return await asyncio.wait_for(asyncio.shield(self._ready[worker_id]), EVENT_TIMEOUT_S)

    async def lost(self, worker_id: str, timeout: float = EVENT_TIMEOUT_S) -> str:
        """The reason of `worker_id`'s loss event, once it comes."""
        return await asyncio.wait_for(asyncio.shield(self._lost[worker_id]), timeout)

    def of(self, worker_id: str) -> list[tuple[str, str]]:
        """(kind, endpoint or reason) of every event about `worker_id`, in order."""
        return [(kind, detail) for kind, wid, detail in self.events if wid == worker_id]


class RuntimeHarness(Protocol):
    """What the contract needs of one runtime adapter's test setup."""

    #: A pool whose workers the runtime can run (and that become ready on their own).
    pool: PoolSpec

    async def start(self, instance_id: str) -> tuple[Runtime, Recorder]:
        """A started runtime of the harness's fleet, with a recorder subscribed."""
        ...

    async def kill(self, worker: Worker) -> None:
        """End the worker from outside the runtime (a crash, not a stop)."""
        ...

    async def settle(self) -> None:
        """Long enough for any event still on its way to arrive."""
        ...


def make_worker(pool: PoolSpec) -> Worker:
    """A fresh spawning worker of `pool`, as the pool manager hands it to `spawn`."""
    return Worker(
        id=f"w-{uuid.uuid4().hex[:8]}",
        pool=pool.name,
        revision=pool.revision,
        state=WorkerState.SPAWNING,
        epoch=0,
        owner="cp-contract",
        created_at=0.0,
        updated_at=0.0,
    )


async def spawn_ready(runtime: Runtime, recorder: Recorder, pool: PoolSpec) -> Worker:
    """Spawn a worker and wait for its readiness; returns it with its ref and endpoint."""
    worker = make_worker(pool)
    ref = await runtime.spawn(worker, pool)
    endpoint = await recorder.ready(worker.id)
    return worker.evolve(runtime_ref=dict(ref), endpoint=endpoint)


class RuntimeContract:
    """Every Runtime adapter behaves the same on these points."""

    @pytest.fixture
    def harness(self) -> RuntimeHarness:
        raise NotImplementedError("a subclass provides the harness")

    async def test_a_spawned_worker_is_reported_ready_once(self, harness: RuntimeHarness) -> None:
        """spawn returns a ref at once; readiness comes later as one event with an endpoint."""
        runtime, recorder = await harness.start("cp-one")
        worker = make_worker(harness.pool)
        ref = await runtime.spawn(worker, harness.pool)
        assert ref
        endpoint = await recorder.ready(worker.id)
        assert endpoint
        await harness.settle()
        assert recorder.of(worker.id) == [("ready", endpoint)]

    async def test_list_objects_shows_live_workers_as_ready(self, harness: RuntimeHarness) -> None:
        """Each live worker is listed once: its pool, alive, ready, at its endpoint."""
        runtime, recorder = await harness.start("cp-one")
        workers = [await spawn_ready(runtime, recorder, harness.pool) for _ in range(2)]
        listed = {obj.worker_id: obj for obj in await runtime.list_objects()}
        assert set(listed) == {w.id for w in workers}
        for worker in workers:
            obj = listed[worker.id]
            assert (obj.pool, obj.alive, obj.ready) == (harness.pool.name, True, True)
            assert obj.endpoint == worker.endpoint
            assert obj.ref

    async def test_a_stopped_worker_is_gone_and_no_loss(self, harness: RuntimeHarness) -> None:
        """stop ends the worker without a loss event; it is no longer listed; stopping it
        again (or a worker the runtime never saw) is not an error."""
        runtime, recorder = await harness.start("cp-one")
        worker = await spawn_ready(runtime, recorder, harness.pool)
        bystander = await spawn_ready(runtime, recorder, harness.pool)
        await runtime.stop(worker, 0.0)
        await harness.settle()
        assert recorder.of(worker.id) == [("ready", worker.endpoint)]
        assert [obj.worker_id for obj in await runtime.list_objects()] == [bystander.id]
        await runtime.stop(worker, 0.0)
        await runtime.stop(make_worker(harness.pool), 0.0)

    async def test_a_worker_stopped_while_spawning_reports_nothing(
        self, harness: RuntimeHarness
    ) -> None:
        """A stop before readiness: neither ready nor lost is ever reported."""
        runtime, recorder = await harness.start("cp-one")
        worker = make_worker(harness.pool)
        await runtime.spawn(worker, harness.pool)
        await runtime.stop(worker, 0.0)
        await harness.settle()
        assert recorder.of(worker.id) == []

    async def test_a_killed_worker_is_reported_lost_once(self, harness: RuntimeHarness) -> None:
        """An end the runtime did not ask for is one `lost` event, for that worker only."""
        runtime, recorder = await harness.start("cp-one")
        victim = await spawn_ready(runtime, recorder, harness.pool)
        bystander = await spawn_ready(runtime, recorder, harness.pool)
        await harness.kill(victim)
        assert await recorder.lost(victim.id) == "lost"
        await harness.settle()
        assert recorder.of(victim.id) == [("ready", victim.endpoint), ("lost", "lost")]
        assert recorder.of(bystander.id) == [("ready", bystander.endpoint)]
        # A failed pod stays listed until deleted, as not alive; a dead process is not listed.
        listed = await runtime.list_objects()
        assert not any(obj.alive for obj in listed if obj.worker_id == victim.id)

    async def test_pinned_follows_set_busy_and_a_ready_worker_has_no_progress(
        self, harness: RuntimeHarness
    ) -> None:
        """A runtime with a do-not-disrupt mark shows what `set_busy` set (once its view
        caught up), and `unpinned` names the live workers without it; one without says
        None throughout. A ready worker has no progress to
        tell, nor has a worker the runtime never saw."""
        runtime, recorder = await harness.start("cp-one")
        worker = await spawn_ready(runtime, recorder, harness.pool)
        before = runtime.pinned(worker)
        assert before in (False, None)
        # `unpinned` names exactly the workers `pinned` calls False.
        assert (worker.id in runtime.unpinned()) is (before is False)
        await runtime.set_busy(worker, True)
        await harness.settle()
        assert runtime.pinned(worker) is (None if before is None else True)
        assert worker.id not in runtime.unpinned()
        await runtime.set_busy(worker, False)
        await harness.settle()
        assert runtime.pinned(worker) is before
        assert (worker.id in runtime.unpinned()) is (before is False)
        assert runtime.progress(worker) is None
        assert runtime.progress(make_worker(harness.pool)) is None
        assert runtime.pinned(make_worker(harness.pool)) is None

    async def test_a_restarted_runtime_adopts_live_workers(self, harness: RuntimeHarness) -> None:
        """After a restart, adopt finds a live worker and watches it: its loss is reported
        by the adopter, once. A gone worker is not adopted. (A runtime may report an adopted
        worker ready again, as the informer's first list does: the pool manager ignores a
        ready event for a worker that is no longer spawning.)"""
        first, first_events = await harness.start("cp-one")
        worker = await spawn_ready(first, first_events, harness.pool)
        stopped = await spawn_ready(first, first_events, harness.pool)
        await first.stop(stopped, 0.0)
        await first.close()

        second, second_events = await harness.start("cp-two")
        assert await second.adopt(worker)
        assert await second.adopt(worker)  # adopting twice is harmless
        assert not await second.adopt(stopped)
        assert [obj.worker_id for obj in await second.list_objects()] == [worker.id]
        await harness.kill(worker)
        assert await second_events.lost(worker.id) == "lost"
        await harness.settle()
        assert [e for e in second_events.of(worker.id) if e[0] == "lost"] == [("lost", "lost")]
        assert second_events.of(worker.id)[-1] == ("lost", "lost")
        assert not await second.adopt(worker)
