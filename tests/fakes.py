"""In-memory stand-ins for the control-plane tests that cannot afford real processes.

`MemoryRuntime` replaces worker processes in the unit and property tests of the pool
manager and janitor: a hypothesis state machine runs thousands of lifecycles, which real
processes would make minutes long. It is also its workers' `Activator` and keeps the worker
side of the activation protocol (another worker's payload, a second org and stale epochs
are rejected) so control-plane fencing bugs still surface. The Runtime and Activator
contract suites check it against the real adapters (`tests/test_fakes.py`). Integration
tests use the real local-process runtime and demo workers instead.

`FaultyStore` wraps a real store and fails chosen writes *before* they reach it, the way a
lost connection does, to test persist-before-mutate.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stoker.domain.activation import ActivationKey
from stoker.domain.errors import ActivationRejected, RuntimeFailure, StoreError
from stoker.domain.pools import DeletedPool, Rollout, StoredPool, StoredRevision
from stoker.domain.records import (
    Claim,
    DemandRecord,
    ForecastBucket,
    Instance,
    LeaseRecord,
    OrgForecastBucket,
    PoolSizingRecord,
    Worker,
)
from stoker.domain.specs import PoolSpec
from stoker.domain.states import WorkerState
from stoker.ports.activator import ActivationPayload
from stoker.ports.runtime import RuntimeListener, RuntimeObject, SpawnProgress
from stoker.ports.store import (
    DemandCounts,
    ReserveResult,
    SpawnRequest,
    SpawnResult,
    StateCount,
    Store,
)

#: The fleet activation key of tests that run real runtimes and activators: any key of 32
#: bytes or more would do, and one shared constant lets a test derive a worker's secret.
TEST_ACTIVATION_KEY = ActivationKey(b"stoker-tests-fleet-activation-key-0001")


@dataclass
class FakeProcess:
    """What the memory runtime knows of one worker."""

    worker_id: str
    pool: str
    alive: bool = True
    ready: bool = False
    org: str | None = None
    epoch: int = 0
    token: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    activations: int = 0
    busy: bool = False
    stopped: bool = False


class MemoryRuntime:
    """A runtime whose workers are dictionary entries, and their activator (see the module
    docstring). `procs` may be shared by a second instance: a restarted runtime."""

    kind = "memory"
    #: Packing tests place workers on `nodes`.
    has_nodes = True

    def __init__(self, *, auto_ready: bool = True, ready_delay: float = 0.0, cap: int = 0) -> None:
        self.auto_ready = auto_ready
        self.ready_delay = ready_delay
        self.cap = cap
        self.procs: dict[str, FakeProcess] = {}
        self.listener: RuntimeListener | None = None
        self.fail_spawns = 0
        self.fail_activations = 0
        self.activation_delay = 0.0
        self.spawn_calls = 0
        self.stop_calls: list[str] = []
        #: Activations a real worker would refuse; a correct control plane never sends one.
        self.fencing_violations: list[str] = []
        self.headroom_calls = 0
        #: What the sizing last said of each pool's gathering (`Runtime.gather`).
        self.gathering: dict[str, bool] = {}
        #: Worker id -> node, for tests of packing; a worker with none set is on no node
        #: (as a local runtime's are).
        self.nodes: dict[str, str] = {}

    def subscribe(self, listener: RuntimeListener) -> None:
        self.listener = listener

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def derived_cap(self, pool: PoolSpec) -> int:
        return self.cap

    async def spawn(self, worker: Worker, pool: PoolSpec) -> Mapping[str, Any]:
        self.spawn_calls += 1
        if self.fail_spawns:
            self.fail_spawns -= 1
            raise RuntimeFailure("injected spawn failure")
        self.procs[worker.id] = FakeProcess(worker.id, worker.pool)
        if self.auto_ready:
            asyncio.get_running_loop().call_later(self.ready_delay, self.make_ready, worker.id)
        return {"fake": worker.id}

    def make_ready(self, worker_id: str) -> None:
        proc = self.procs.get(worker_id)
        if proc is None or not proc.alive or proc.ready or proc.stopped:
            return
        proc.ready = True
        assert self.listener is not None
        self.listener.worker_ready(worker_id, _endpoint(worker_id))

    def kill(self, worker_id: str, reason: str = "lost") -> None:
        """The process dies on its own (the runtime reports it)."""
        proc = self.procs[worker_id]
        if not proc.alive:
            return
        proc.alive = False
        assert self.listener is not None
        self.listener.worker_lost(worker_id, reason)

    async def activate(self, worker: Worker, payload: ActivationPayload, timeout: float) -> None:
        proc = self.procs.get(worker.id)
        if self.activation_delay:
            await asyncio.sleep(self.activation_delay)
        if proc is None or not proc.alive:
            raise RuntimeFailure(f"worker {worker.id} is gone")
        if self.fail_activations:
            self.fail_activations -= 1
            raise RuntimeFailure("injected activation failure")
        refusal = None
        if payload.worker_id != worker.id:
            refusal = "wrong worker id"
        elif proc.org is not None and proc.org != payload.org:
            refusal = f"{worker.id} bound to {proc.org}, refused {payload.org}"
        elif payload.epoch <= proc.epoch:
            refusal = f"{worker.id}: stale epoch {payload.epoch} <= {proc.epoch}"
        if refusal is not None:
            self.fencing_violations.append(refusal)
            raise ActivationRejected(refusal)
        proc.org, proc.epoch, proc.token = payload.org, payload.epoch, payload.token
        proc.config = dict(payload.config)
        proc.activations += 1

    async def stop(self, worker: Worker, grace_s: float) -> None:
        self.stop_calls.append(worker.id)
        proc = self.procs.get(worker.id)
        if proc is not None:
            proc.alive = False
            proc.stopped = True

    async def adopt(self, worker: Worker) -> bool:
        proc = self.procs.get(worker.id)
        return proc is not None and proc.alive

    async def list_objects(self) -> list[RuntimeObject]:
        return [
            RuntimeObject(
                p.worker_id,
                p.pool,
                {"fake": p.worker_id},
                0.0,
                True,
                p.ready,
                endpoint=_endpoint(p.worker_id) if p.ready else None,
            )
            for p in self.procs.values()
            if p.alive
        ]

    async def set_busy(self, worker: Worker, busy: bool) -> None:
        proc = self.procs.get(worker.id)
        if proc is not None:
            proc.busy = busy

    def progress(self, worker: Worker) -> SpawnProgress | None:
        return None

    def pinned(self, worker: Worker) -> bool | None:
        proc = self.procs.get(worker.id)
        return proc.busy if proc is not None and proc.alive else None

    def unpinned(self) -> Collection[str]:
        return {wid for wid, p in self.procs.items() if p.alive and not p.busy}

    def node_sessions(self, worker: Worker) -> int | None:
        node = self.nodes.get(worker.id)
        proc = self.procs.get(worker.id)
        if node is None or proc is None or not proc.alive:
            return None
        return sum(
            1 for wid, p in self.procs.items() if p.alive and p.busy and self.nodes.get(wid) == node
        )

    def gather(self, pool: str, on: bool) -> None:
        self.gathering[pool] = on

    async def reconcile_headroom(self, pools: Sequence[PoolSpec]) -> None:
        self.headroom_calls += 1

    def placeholder_slots(self, pool: PoolSpec) -> int:
        return 1

    def placeholder_requests(self, pool: PoolSpec) -> tuple[float, float]:
        return 0.0, 0.0

    def alive(self) -> set[str]:
        return {wid for wid, p in self.procs.items() if p.alive}


def _endpoint(worker_id: str) -> str:
    """Where a memory worker "listens"."""
    return f"mem://{worker_id}"


_WRITES = frozenset(
    {
        "reserve_spawn_slots",
        "transition",
        "reserve",
        "reserve_any",
        "bind",
        "end_claim",
        "renew_claim",
    }
)


class FaultyStore:
    """A store whose writes fail on demand, before reaching the real store."""

    def __init__(self, inner: Store, *, rate: float = 0.0, seed: int = 0) -> None:
        self.inner = inner
        self.rate = rate
        self.fail_next = 0
        self.failures = 0
        #: While set, lease writes fail (a lease-renewal blip).
        self.fail_leases = False
        self._rng = random.Random(seed)

    def _maybe_fail(self, op: str) -> None:
        if self.fail_next > 0:
            self.fail_next -= 1
        elif not (self.rate and self._rng.random() < self.rate):
            return
        self.failures += 1
        raise StoreError(f"injected failure of {op}")

    async def open(self) -> None:
        await self.inner.open()

    async def close(self) -> None:
        await self.inner.close()

    async def schema_version(self) -> int:
        return await self.inner.schema_version()

    async def reserve_spawn_slots(
        self, req: SpawnRequest, ids: Sequence[str], now: float
    ) -> SpawnResult:
        self._maybe_fail("reserve_spawn_slots")
        return await self.inner.reserve_spawn_slots(req, ids, now)

    async def transition(self, worker_id: str, **kw: Any) -> Worker | None:
        self._maybe_fail("transition")
        return await self.inner.transition(worker_id, **kw)

    async def reserve(self, worker_id: str, **kw: Any) -> ReserveResult:
        self._maybe_fail("reserve")
        return await self.inner.reserve(worker_id, **kw)

    async def reserve_any(self, pool: str, revision: str, **kw: Any) -> ReserveResult:
        self._maybe_fail("reserve_any")
        return await self.inner.reserve_any(pool, revision, **kw)

    async def get_worker(self, worker_id: str) -> Worker | None:
        return await self.inner.get_worker(worker_id)

    async def list_workers(self, **kw: Any) -> list[Worker]:
        return await self.inner.list_workers(**kw)

    async def count_workers(self) -> list[StateCount]:
        return await self.inner.count_workers()

    async def bind(self, worker_id: str, **kw: Any) -> Worker | None:
        self._maybe_fail("bind")
        return await self.inner.bind(worker_id, **kw)

    async def end_claim(self, claim_id: str, **kw: Any) -> tuple[Claim, Worker] | None:
        self._maybe_fail("end_claim")
        return await self.inner.end_claim(claim_id, **kw)

    async def renew_claim(self, claim_id: str, **kw: Any) -> Claim | None:
        self._maybe_fail("renew_claim")
        return await self.inner.renew_claim(claim_id, **kw)

    async def get_claim(self, claim_id: str) -> Claim | None:
        return await self.inner.get_claim(claim_id)

    async def claim_by_key(self, org: str, idempotency_key: str) -> Claim | None:
        return await self.inner.claim_by_key(org, idempotency_key)

    async def list_claims(self, **kw: Any) -> list[Claim]:
        return await self.inner.list_claims(**kw)

    async def register_instance(self, instance_id: str, **kw: Any) -> None:
        await self.inner.register_instance(instance_id, **kw)

    async def heartbeat_instance(self, instance_id: str, **kw: Any) -> bool:
        return await self.inner.heartbeat_instance(instance_id, **kw)

    async def expire_instances(self, **kw: Any) -> list[str]:
        return await self.inner.expire_instances(**kw)

    async def stop_instance(self, instance_id: str, **kw: Any) -> None:
        await self.inner.stop_instance(instance_id, **kw)

    async def list_instances(self) -> list[Instance]:
        return await self.inner.list_instances()

    async def acquire_lease(self, name: str, **kw: Any) -> LeaseRecord | None:
        if self.fail_leases:
            raise StoreError("injected failure of acquire_lease")
        return await self.inner.acquire_lease(name, **kw)

    async def release_lease(self, name: str, **kw: Any) -> bool:
        if self.fail_leases:
            raise StoreError("injected failure of release_lease")
        return await self.inner.release_lease(name, **kw)

    async def get_lease(self, name: str) -> LeaseRecord | None:
        return await self.inner.get_lease(name)

    async def record_demand(
        self, instance_id: str, demand: Mapping[str, DemandCounts], *, now: float
    ) -> None:
        self._maybe_fail("record_demand")
        await self.inner.record_demand(instance_id, demand, now=now)

    async def read_demand(self) -> list[DemandRecord]:
        return await self.inner.read_demand()

    async def record_outcomes(
        self, instance_id: str, counts: Mapping[str, Mapping[str, int]], *, now: float
    ) -> None:
        self._maybe_fail("record_outcomes")
        await self.inner.record_outcomes(instance_id, counts, now=now)

    async def read_outcomes(self, rollout_ids: Sequence[str]) -> dict[str, dict[str, int]]:
        self._maybe_fail("read_outcomes")
        return await self.inner.read_outcomes(rollout_ids)

    async def record_ledger(self, instance_id: str, cells: Any, *, now: float) -> bool:
        self._maybe_fail("record_ledger")
        return await self.inner.record_ledger(instance_id, cells, now=now)

    async def read_ledger(self, pool: str, **kw: Any) -> Any:
        return await self.inner.read_ledger(pool, **kw)

    async def ledger_written_at(self, instance_id: str) -> float | None:
        return await self.inner.ledger_written_at(instance_id)

    async def first_takes(self, since: Any) -> list[float | None]:
        self._maybe_fail("first_takes")
        return await self.inner.first_takes(since)

    async def record_claim_log(self, arrivals: Any, endings: Any) -> None:
        self._maybe_fail("record_claim_log")
        await self.inner.record_claim_log(arrivals, endings)

    async def read_claim_log(self, **kw: Any) -> Any:
        return await self.inner.read_claim_log(**kw)

    async def purge_ledger(self, **kw: Any) -> int:
        self._maybe_fail("purge_ledger")
        return await self.inner.purge_ledger(**kw)

    async def record_forecast(self, buckets: Sequence[ForecastBucket]) -> None:
        self._maybe_fail("record_forecast")
        await self.inner.record_forecast(buckets)

    async def read_forecast(self) -> list[ForecastBucket]:
        self._maybe_fail("read_forecast")
        return await self.inner.read_forecast()

    async def record_org_forecast(
        self, buckets: Sequence[OrgForecastBucket], *, drop: Sequence[tuple[str, str]] = ()
    ) -> None:
        self._maybe_fail("record_org_forecast")
        await self.inner.record_org_forecast(buckets, drop=drop)

    async def read_org_forecast(self) -> list[OrgForecastBucket]:
        self._maybe_fail("read_org_forecast")
        return await self.inner.read_org_forecast()

    async def claims_by_org(self, *, since: float, before: float) -> list[tuple[str, str, int]]:
        self._maybe_fail("claims_by_org")
        return await self.inner.claims_by_org(since=since, before=before)

    async def purge(self, *, before: float) -> int:
        self._maybe_fail("purge")
        return await self.inner.purge(before=before)

    # The leader's published sizing passes through unfailed too: a write more per pass
    # drawing from the sequence (or taking `fail_next`) would move the faults tests aim.

    async def record_sizing(self, sizings: Sequence[PoolSizingRecord]) -> None:
        await self.inner.record_sizing(sizings)

    async def read_sizing(self) -> list[PoolSizingRecord]:
        return await self.inner.read_sizing()

    # Stored pools pass through unfailed: the faults here are those of the claim path and
    # the janitor, and a pool write drawing from the same random sequence would move them.

    async def list_pools(self) -> list[StoredPool]:
        return await self.inner.list_pools()

    async def get_pool(self, name: str) -> StoredPool | None:
        return await self.inner.get_pool(name)

    async def pool_generations(self) -> dict[str, int]:
        return await self.inner.pool_generations()

    async def list_revisions(self, pool: str) -> list[StoredRevision]:
        return await self.inner.list_revisions(pool)

    async def get_rollout(self, rollout_id: str) -> Rollout | None:
        return await self.inner.get_rollout(rollout_id)

    async def list_rollouts(self, *, pool: str | None = None) -> list[Rollout]:
        return await self.inner.list_rollouts(pool=pool)

    async def create_pool(self, pool: StoredPool, *, now: float) -> StoredPool | None:
        return await self.inner.create_pool(pool, now=now)

    async def update_pool(self, pool: StoredPool, *, now: float) -> StoredPool:
        return await self.inner.update_pool(pool, now=now)

    async def start_rollout(self, rollout: Rollout, template: Any, **kw: Any) -> StoredPool:
        return await self.inner.start_rollout(rollout, template, **kw)

    async def update_rollout(self, rollout: Rollout, **kw: Any) -> StoredPool:
        return await self.inner.update_rollout(rollout, **kw)

    async def delete_pool(self, name: str, *, generation: int | None = None) -> DeletedPool:
        return await self.inner.delete_pool(name, generation=generation)


def live_states() -> set[WorkerState]:
    return set(WorkerState) - {WorkerState.RETIRED}
