"""Do-not-disrupt pins with two replicas on one store, on virtual time (looptime).

A replica's book is a hint: a warm worker it spawned still shows warm there after another
replica took it for a claim. Its janitor pass must not take that session's pin away (a
node consolidator would then drain the node under the session).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from test_plane_claims import pool

from fakes import MemoryRuntime
from stoker.adapters.sqlite import SqliteStore
from stoker.control.plane import ControlPlane
from stoker.domain.records import ClaimRequest
from stoker.domain.specs import PlaneSettings
from stoker.domain.states import ClaimSource, WorkerState
from stoker.ports.clock import VirtualClock

pytestmark = pytest.mark.looptime


@asynccontextmanager
async def two_replicas(path: Path) -> AsyncIterator[tuple[ControlPlane, ControlPlane]]:
    """Replicas A and B on one SQLite file and one set of pods (their runtimes share the
    processes, pins included), loops off: A's spawns get ready in 0.2 s, B's never do."""
    runtime_a = MemoryRuntime(ready_delay=0.2)
    runtime_b = MemoryRuntime(auto_ready=False)
    runtime_b.procs = runtime_a.procs
    planes = [
        ControlPlane(
            store=SqliteStore(str(path / "stoker.db")),
            runtime=runtime,
            activator=runtime,
            pools=[pool(warm_target=1)],
            settings=PlaneSettings(),
            clock=VirtualClock(),
        )
        for runtime in (runtime_a, runtime_b)
    ]
    for plane in planes:
        await plane.start(loops=False)
        await asyncio.sleep(1)
    try:
        yield planes[0], planes[1]
    finally:
        for plane in planes:
            await plane.stop()


async def test_a_replica_keeps_the_pin_of_its_warm_worker_another_replica_took(
    tmp_path: Path,
) -> None:
    async with two_replicas(tmp_path) as (a, b):
        runtime = a.runtime
        (spawned,) = [w for w in await a.store.list_workers() if w.state is WorkerState.WARM]
        assert spawned.owner == a.instance_id
        claim = await b.claim(ClaimRequest(pool="p", org="acme", timeout_s=5))
        assert claim.source is ClaimSource.WARM and claim.worker_id == spawned.id
        await asyncio.sleep(1)  # B's pin lands in the background
        taken = await b.store.get_worker(spawned.id)
        assert taken is not None and taken.state is WorkerState.HOT
        assert runtime.pinned(taken) is True
        # A's book still shows the worker warm (a hint); pass after pass, on A and on B,
        # the pin of B's session stays.
        seen_by_a = a.book.known(spawned.id)
        assert seen_by_a is not None and seen_by_a.state is WorkerState.WARM
        for _ in range(3):
            await a.run_janitor_pass()
            assert runtime.pinned(taken) is True
            await b.run_janitor_pass()
            assert runtime.pinned(taken) is True
            await asyncio.sleep(5)
