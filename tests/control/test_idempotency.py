"""Idempotent claims (`stoker.control.idempotency`): one key, one claim, on one replica or
two sharing a store, on virtual time (looptime).

Workers are `MemoryRuntime` entries (tests/fakes.py says why); the store is the real SQLite
adapter, shared by the two replicas of a test as it is by `stoker serve` processes on one
file (PostgreSQL's unique index is in the store contract suite). The same over HTTP, with
real workers and a real server, is in tests/sdk/test_sdk_resilience.py.
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
from stoker.domain import idempotency
from stoker.domain.errors import ClaimConflict, IdempotencyKeyReused
from stoker.domain.records import Claim, ClaimRequest
from stoker.domain.specs import PlaneSettings, PoolSpec, ProcessTemplate
from stoker.domain.states import ClaimMode, ClaimState, WorkerState
from stoker.ports.clock import VirtualClock

pytestmark = pytest.mark.looptime

S = WorkerState
POOL = PoolSpec(name="p", template=ProcessTemplate(argv=("worker", "{port}")), warm_target=2)


@asynccontextmanager
async def replicas(path: Path, count: int = 1) -> AsyncIterator[list[ControlPlane]]:
    """`count` started planes on one SQLite file, each with its own runtime."""
    async with AsyncExitStack() as stack:
        planes = []
        for _ in range(count):
            runtime = MemoryRuntime(ready_delay=0.2)
            plane = ControlPlane(
                store=SqliteStore(str(path / "stoker.db")),
                runtime=runtime,
                activator=runtime,
                pools=[POOL],
                settings=PlaneSettings(),
                clock=VirtualClock(),
            )
            await plane.start(loops=False)
            stack.push_async_callback(plane.stop)
            planes.append(plane)
        await asyncio.sleep(1)
        yield planes


def req(key: str | None = "key-1", org: str = "acme", **kw: Any) -> ClaimRequest:
    kw.setdefault("timeout_s", 5.0)
    return ClaimRequest(pool="p", org=org, idempotency_key=key, **kw)


async def bound(plane: ControlPlane) -> list[Claim]:
    return await plane.store.list_claims(states=[ClaimState.BOUND])


async def test_a_repeated_key_gets_the_same_claim_and_token(tmp_path: Path) -> None:
    async with replicas(tmp_path) as (plane,):
        first, replayed = await plane.claim_once(req())
        assert not replayed and first.token
        again, replayed = await plane.claim_once(req(timeout_s=1.0))  # a retry waits less
        assert replayed
        assert (again.id, again.worker_id, again.token) == (first.id, first.worker_id, first.token)
        assert [c.id for c in await bound(plane)] == [first.id]
        stored = await plane.store.get_claim(first.id)
        assert stored is not None and stored.idempotency_key == idempotency.key_digest("key-1")
        # What the store keeps yields neither the key nor the token.
        assert "key-1" not in repr(stored) and first.token not in repr(stored)


async def test_another_org_or_key_or_none_is_another_claim(tmp_path: Path) -> None:
    async with replicas(tmp_path) as (plane,):
        claims = [
            await plane.claim(req()),
            await plane.claim(req(org="globex")),
            await plane.claim(req("key-2")),
            await plane.claim(req(None)),
            await plane.claim(req(None)),
        ]
        assert len({c.id for c in claims}) == len({c.worker_id for c in claims}) == 5


async def test_the_key_with_another_request_is_refused(tmp_path: Path) -> None:
    async with replicas(tmp_path) as (plane,):
        first = await plane.claim(req(config={"role": "ro"}))
        for other in (req(config={"role": "rw"}), req(lease_s=99.0), req(ttl_s=5.0)):
            with pytest.raises(IdempotencyKeyReused, match=first.id):
                await plane.claim(other)
        assert [c.id for c in await bound(plane)] == [first.id]


async def test_a_key_whose_claim_ended_answers_with_the_ended_claim(tmp_path: Path) -> None:
    async with replicas(tmp_path) as (plane,):
        first = await plane.claim(req())
        await plane.release(first.id)
        again, replayed = await plane.claim_once(req())
        assert replayed and again.id == first.id
        assert again.state is ClaimState.RELEASED and again.token == ""
        assert await bound(plane) == []


async def test_requests_with_one_key_take_turns(tmp_path: Path) -> None:
    async with replicas(tmp_path) as (plane,):
        outcomes = await asyncio.gather(*(plane.claim_once(req()) for _ in range(5)))
        assert len({claim.id for claim, _ in outcomes}) == 1
        assert sorted(replayed for _, replayed in outcomes) == [False, True, True, True, True]
        assert len(await bound(plane)) == 1
        assert plane.idempotent.in_progress() == 0  # nothing is kept once served


async def test_a_request_waiting_for_its_key_gives_up_at_its_timeout(tmp_path: Path) -> None:
    async with replicas(tmp_path) as (plane,):
        # The pool's two warm workers go to other claims: the first keyed claim waits.
        await plane.claim(req(None))
        await plane.claim(req(None))
        first = asyncio.ensure_future(
            plane.claim_once(req(timeout_s=30.0, mode=ClaimMode.REQUIRE_WARM))
        )
        await asyncio.sleep(0.5)
        with pytest.raises(ClaimConflict, match="still being served"):
            await plane.claim_once(req(timeout_s=2.0, mode=ClaimMode.REQUIRE_WARM))
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert plane.idempotent.in_progress() == 0


async def test_a_retry_on_another_replica_gets_the_claim_and_its_token(tmp_path: Path) -> None:
    async with replicas(tmp_path, 2) as (a, b):
        first = await a.claim(req())
        again, replayed = await b.claim_once(req())
        assert replayed
        assert (again.id, again.worker_id, again.token) == (first.id, first.worker_id, first.token)
        with pytest.raises(IdempotencyKeyReused):
            await b.claim(req(lease_s=5.0))


async def test_replicas_racing_on_one_key_bind_one_claim(tmp_path: Path) -> None:
    async with replicas(tmp_path, 2) as (a, b):
        (one, one_replayed), (two, two_replayed) = await asyncio.gather(
            a.claim_once(req()), b.claim_once(req())
        )
        assert one.id == two.id and one.token == two.token
        assert sorted([one_replayed, two_replayed]) == [False, True]
        assert len(await bound(a)) == 1
        # The loser's worker went back to its org, not into a second session.
        hot = await a.store.list_workers(states=[S.HOT])
        assert [w.claim_id for w in hot] == [one.id]
        parked = await a.store.list_workers(states=[S.HOT_IDLE])
        assert [w.org for w in parked] == ["acme"]
