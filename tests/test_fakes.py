"""The test doubles the control-plane tests run on, checked against the real adapters.

`MemoryRuntime` passes the Runtime contract (as the local-process and Kubernetes runtimes
do) and, as its workers' activator, the Activator contract (as the HTTP activator does
against real demo workers); so does the simulator's `SimActivator`.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import replace

import pytest

from activator_contract import ActivatorContract
from fakes import MemoryRuntime
from runtime_contract import Recorder, RuntimeContract, make_worker, spawn_ready
from stoker.domain.errors import ActivationRejected
from stoker.domain.records import Worker
from stoker.domain.specs import PoolSpec, ProcessTemplate
from stoker.domain.states import WorkerState
from stoker.ports.activator import ActivationPayload, Activator
from stoker.ports.clock import LoopClock
from stoker.ports.runtime import Runtime
from stoker.sim.cluster.distributions import Constant
from stoker.sim.replicas import SimActivator
from stoker.sim.scenario import ActivatorConfig

POOL = PoolSpec(name="demo", template=ProcessTemplate(argv=("worker",), memory_mb=32))


# -- MemoryRuntime as a Runtime ----------------------------------------------------------------


class MemoryHarness:
    """The contract's harness on memory runtimes; a restart shares the first's workers."""

    pool = POOL

    def __init__(self) -> None:
        self.runtime: MemoryRuntime | None = None

    async def start(self, instance_id: str) -> tuple[Runtime, Recorder]:
        runtime = MemoryRuntime(ready_delay=0.05)
        if self.runtime is not None:
            runtime.procs = self.runtime.procs
        self.runtime = runtime
        recorder = Recorder()
        runtime.subscribe(recorder)
        await runtime.start()
        return runtime, recorder

    async def kill(self, worker: Worker) -> None:
        assert self.runtime is not None
        self.runtime.kill(worker.id)

    async def settle(self) -> None:
        await asyncio.sleep(0.2)


class TestMemoryRuntimeContract(RuntimeContract):
    """The shared contract, on the control-plane tests' in-memory runtime."""

    @pytest.fixture
    def harness(self) -> MemoryHarness:
        return MemoryHarness()


# -- MemoryRuntime and SimActivator as Activators ----------------------------------------------


class MemoryTarget:
    """Memory workers, activated by their runtime."""

    def __init__(self) -> None:
        self.runtime = MemoryRuntime(ready_delay=0.0)
        self.recorder = Recorder()
        self.runtime.subscribe(self.recorder)
        self.activator: Activator = self.runtime

    async def ready_worker(self) -> Worker:
        return await spawn_ready(self.runtime, self.recorder, POOL)

    async def unreachable(self) -> tuple[Activator, Worker]:
        worker = await self.ready_worker()
        self.runtime.kill(worker.id)
        return self.runtime, worker


class TestMemoryActivatorContract(ActivatorContract):
    """The shared contract, on `MemoryRuntime`'s worker side of activation."""

    @pytest.fixture
    def target(self) -> MemoryTarget:
        return MemoryTarget()


class Activations:
    """The simulator's observer, as far as activation goes."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int]] = []

    def activation(self, worker_id: str, org: str, epoch: int) -> None:
        self.seen.append((worker_id, org, epoch))


class SimTarget:
    """Simulated pods, activated in-process; an unreachable one answers too late."""

    def __init__(self) -> None:
        self.observer = Activations()
        self.activator: Activator = self._activator(ActivatorConfig(latency=Constant(0.01)))

    def _activator(self, config: ActivatorConfig) -> SimActivator:
        return SimActivator(
            config=config,
            rng=random.Random(7),
            clock=LoopClock(),
            observer=self.observer,  # type: ignore[arg-type]
        )

    async def ready_worker(self) -> Worker:
        return make_worker(POOL).evolve(
            state=WorkerState.ACTIVATING, endpoint=f"http://10.0.0.{uuid.uuid4().int % 200}:8080"
        )

    async def unreachable(self) -> tuple[Activator, Worker]:
        slow = self._activator(ActivatorConfig(latency=Constant(30.0)))
        return slow, await self.ready_worker()


@pytest.mark.looptime
class TestSimActivatorContract(ActivatorContract):
    """The shared contract, on the simulator's activator (virtual time)."""

    @pytest.fixture
    def target(self) -> SimTarget:
        return SimTarget()


async def test_the_simulated_activator_tells_the_observer_every_activation() -> None:
    """The simulator's invariant checker sees each activation a worker receives, refused
    ones included (I2 is checked on them)."""
    target = SimTarget()
    worker = await target.ready_worker()
    payload = ActivationPayload(worker_id=worker.id, org="acme", epoch=2, token="t")
    await target.activator.activate(worker, payload, 5.0)
    with pytest.raises(ActivationRejected):
        await target.activator.activate(worker, replace(payload, org="other", epoch=3), 5.0)
    assert target.observer.seen == [(worker.id, "acme", 2), (worker.id, "other", 3)]
