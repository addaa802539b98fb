"""A long run of one replica returns its memory to where it started.

Tens of thousands of claim, release, abandon and cap-wait cycles, on virtual time
(looptime) with `MemoryRuntime` workers (tests/fakes.py: real processes would make this
hours long) and the real SQLite store; afterwards every in-memory structure of the
replica (the book's queues, waiters, in-flight set, spawn waits, facts and tasks, the
retirer's stops, the claims in flight, the demand queued, the attempts alive) is back to
its size before the run. The 50,000-cycle run the fault report asks for takes about
90 s here, so it is marked slow; the default run has 5,000.
"""

from __future__ import annotations

import asyncio
import gc
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fakes import FaultyStore, MemoryRuntime
from stoker.adapters.sqlite import SqliteStore
from stoker.control.attempt import Attempt
from stoker.control.plane import ControlPlane
from stoker.domain.errors import CapacityError, OrgCapError
from stoker.domain.records import Claim, ClaimRequest
from stoker.domain.specs import DemandSpec, PlaneSettings, PoolSpec, ProcessTemplate
from stoker.domain.states import LIVE, ClaimMode
from stoker.ports.clock import VirtualClock

pytestmark = pytest.mark.looptime

#: Distinct orgs the run cycles through: each parks its own hot_idle queue.
ORGS = 300
POOL = PoolSpec(
    name="p",
    template=ProcessTemplate(argv=("worker", "{port}")),
    warm_target=2,
    max_workers=6,
    max_workers_per_org=1,
    hot_idle_ttl=2.0,
    scale_down_delay=1.0,
    # Short demand windows: the claim rate, like the TTLs, falls to 0 within a quiesce.
    demand=DemandSpec(stable_window_s=1.0, panic_window_s=1.0, forecast=False),
)


def sizes(plane: ControlPlane) -> dict[str, int]:
    """Every in-memory structure of the replica that work in progress fills."""
    # Unreachable cycles (an exception's traceback holding a frame) count until the
    # collector runs, whenever that is: collect first, so that only live ones count.
    gc.collect()
    attempts = sum(1 for o in gc.get_objects() if isinstance(o, Attempt))
    return {
        **plane.book.sizes(),
        "stopping": plane.retirer.stopping(),
        "claims_in_flight": plane.claims.in_flight(),
        "demand_waiting": plane.demand.waiting(POOL.name),
        "attempts": attempts,
    }


async def cycles(plane: ControlPlane, n: int, seed: int = 0) -> dict[str, int]:
    """`n` cycles of four kinds, in a seeded random order; returns how each ended."""
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}

    def count(what: str) -> None:
        outcomes[what] = outcomes.get(what, 0) + 1

    async def claim(org: str, timeout: float, **kw: Any) -> Claim | None:
        try:
            return await plane.claim(ClaimRequest(pool="p", org=org, timeout_s=timeout, **kw))
        except OrgCapError:
            count("org_cap")
        except CapacityError as exc:
            count(exc.reason)
        return None

    for i in range(n):
        if i == n // 2:
            # A rollout half-way: the old revision's ready queue must go with its workers.
            rollout = replace(POOL, template=ProcessTemplate(argv=("worker-v2", "{port}")))
            plane.catalog.update_pool(replace(rollout, revision=""))
        org = f"org{rng.randrange(ORGS)}"
        kind = rng.randrange(4)
        if kind == 0:  # claim and release (warm, reuse or cold)
            got = await claim(org, 1.0)
            if got is not None:
                count("bound")
                await plane.release(got.id)
        elif kind == 1:  # the requester leaves at once, or mid-way
            task = asyncio.ensure_future(claim(org, 5.0, mode=ClaimMode.COLD))
            await asyncio.sleep(rng.choice((0, 0.1, 0.3)))
            task.cancel()
            [ended] = await asyncio.gather(task, return_exceptions=True)
            if isinstance(ended, Claim):
                await plane.release(ended.id)
            count("abandoned")
        elif kind == 2:  # the org at its cap asks again and gives up
            held = await claim(org, 1.0)
            again = await claim(org, 0.2)
            if held is not None and again is not None:
                raise AssertionError("the org cap let a second claim through")
            for c in (held, again):
                if c is not None:
                    await plane.release(c.id)
        else:  # the pool at its cap: the last claims wait for a slot, most give up
            burst = await asyncio.gather(*(claim(f"{org}-{j}", 0.3) for j in range(8)))
            for c in burst:
                if c is not None:
                    await plane.release(c.id)
        if i % 25 == 0:
            # Between cycles no claim waits (once the attempts of requesters that left
            # have seen it): none may be registered as waiting either.
            await asyncio.sleep(0.01)
            book = plane.book.sizes()
            assert (book["cap_waiters"], book["warm_waiters"]) == (0, 0), (i, book)
            await plane.run_janitor_pass()
    return outcomes


async def quiesce(plane: ControlPlane) -> None:
    """Let every hot_idle TTL and the scale-down delay pass, with janitor passes."""
    for _ in range(6):
        await plane.run_janitor_pass()
        await asyncio.sleep(1.0)
        # Stops and spawns run in tasks of their own, and their store writes in a thread
        # that virtual time does not wait for: let them finish.
        await plane.book.wait_background(30.0)


@pytest.mark.parametrize(
    "n",
    [
        pytest.param(5_000, id="5k"),
        pytest.param(50_000, id="50k", marks=pytest.mark.long_run),
    ],
)
async def test_memory_returns_to_its_baseline_after_a_long_run(tmp_path: Path, n: int) -> None:
    runtime = MemoryRuntime(ready_delay=0.05)
    plane = ControlPlane(
        store=FaultyStore(SqliteStore(str(tmp_path / "stoker.db"))),
        runtime=runtime,
        activator=runtime,
        pools=[POOL],
        settings=PlaneSettings(),
        clock=VirtualClock(),
    )
    await plane.start(loops=False)
    try:
        await quiesce(plane)
        baseline = sizes(plane)
        assert baseline["known"] == POOL.warm_target

        outcomes = await cycles(plane, n)

        # Every kind of cycle happened, each many times.
        for what in ("bound", "abandoned", "org_cap", "pool_cap"):
            assert outcomes.get(what, 0) > n // 50, outcomes
        await quiesce(plane)
        assert sizes(plane) == baseline
        live = await plane.store.list_workers(states=LIVE)
        assert len(live) == POOL.warm_target
        assert {w.revision for w in live} == {plane.catalog.pool("p").revision} != {POOL.revision}
    finally:
        await plane.stop()
