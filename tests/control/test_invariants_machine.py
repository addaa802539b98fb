"""Invariants I1-I6 under random claims, releases, expiries, failures and deaths.

A hypothesis `RuleBasedStateMachine` drives one control plane (real SQLite store in memory,
`MemoryRuntime` workers, see tests/fakes.py) on a looptime loop, so timeouts, leases and
TTLs pass in virtual time. After every step it checks what must always hold; the
`reap_and_check` rule runs a fault-free janitor pass and checks what must hold after one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import defaultdict
from collections.abc import Coroutine
from typing import Any, TypeVar

import looptime
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fakes import FaultyStore, MemoryRuntime
from stoker.adapters.sqlite import SqliteStore
from stoker.control.ids import Ids
from stoker.control.plane import ControlPlane
from stoker.domain.errors import CapacityError, ClaimConflict, OrgCapError, StoreError
from stoker.domain.records import Claim, ClaimRequest, Worker
from stoker.domain.specs import OrgSpec, PlaneSettings, PoolSpec, ProcessTemplate, Timeouts
from stoker.domain.states import LIVE, ClaimMode, ClaimState, Reuse, WorkerState
from stoker.policy.reaping import idle_expires_at
from stoker.ports.clock import VirtualClock

T = TypeVar("T")
S = WorkerState
ORGS = ("acme", "globex", "initech")
TIMEOUTS = Timeouts(spawn_s=30, reserve_s=10, activation_s=10, drain_s=30, stop_grace_s=1)
POOLS = [
    PoolSpec(
        name="db",
        template=ProcessTemplate(argv=("db",)),
        warm_target=2,
        max_workers=8,
        max_workers_per_org=3,
        hot_idle_ttl=30,
        scale_down_delay=20,
        lease_s=60,
        timeouts=TIMEOUTS,
    ),
    PoolSpec(
        name="box",
        template=ProcessTemplate(argv=("box",)),
        warm_target=1,
        reuse=Reuse.NEVER,
        lease_s=60,
        timeouts=TIMEOUTS,
    ),
]
ORG_SPECS = [OrgSpec("acme", min_hot_idle=1)]


class LifecycleMachine(RuleBasedStateMachine):
    """One control plane; rules are what users, workers and failures do to it."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = looptime.new_event_loop(start=0)
        self.runtime = MemoryRuntime(ready_delay=0.5)
        self.store = FaultyStore(SqliteStore(":memory:"), seed=1)
        self.clock = VirtualClock()
        self.plane = ControlPlane(
            store=self.store,
            runtime=self.runtime,
            activator=self.runtime,
            pools=POOLS,
            orgs=ORG_SPECS,
            settings=PlaneSettings(spawn_rate=20, spawn_burst=5),
            clock=self.clock,
            # Seeded ids: hypothesis replays draws over worker and claim ids.
            ids=Ids(seed=7),
        )
        self.run(self.plane.start(loops=False))
        self.bound: dict[str, Claim] = {}
        #: Every org each worker was ever bound to (I2 demands at most one).
        self.orgs_of: dict[str, set[str]] = defaultdict(set)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def now(self) -> float:
        """The plane's clock, read inside the loop (its time scale is the loop's)."""

        async def read() -> float:
            return self.clock.now()

        return self.run(read())

    def settle(self, seconds: float = 2.0) -> None:
        self.run(asyncio.sleep(seconds))

    def teardown(self) -> None:
        self.store.rate = 0.0
        self.run(self.plane.stop())
        self.loop.close()

    # -- what users do ---------------------------------------------------------------------

    async def _claim(self, pool: str, org: str, mode: ClaimMode) -> Claim | None:
        try:
            return await self.plane.claim(
                ClaimRequest(pool=pool, org=org, mode=mode, timeout_s=5.0)
            )
        except (CapacityError, OrgCapError):
            return None
        except StoreError:
            # Its writes failed while it waited (injected store faults): 503 store_unavailable.
            return None

    def _record(self, claims: list[Claim | None]) -> None:
        for claim in claims:
            if claim is not None:
                self.bound[claim.id] = claim
                self.orgs_of[claim.worker_id].add(claim.org)

    @rule(
        pool=st.sampled_from(["db", "box"]),
        orgs=st.lists(st.sampled_from(ORGS), min_size=1, max_size=4),
        mode=st.sampled_from(list(ClaimMode)),
    )
    def claim_burst(self, pool: str, orgs: list[str], mode: ClaimMode) -> None:
        async def burst() -> list[Claim | None]:
            return list(await asyncio.gather(*(self._claim(pool, o, mode) for o in orgs)))

        self._record(self.run(burst()))
        self.settle(0.5)

    @precondition(lambda self: self.bound)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        claim_id = data.draw(st.sampled_from(sorted(self.bound)))
        try:
            self.run(self.plane.release(claim_id))
        except StoreError:
            return  # the claim stays bound; a later release retries
        self.bound.pop(claim_id)
        self.settle(0.5)

    @precondition(lambda self: self.bound)
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        claim_id = data.draw(st.sampled_from(sorted(self.bound)))
        # The claim may have expired or failed meanwhile (a conflict), or the write failed.
        with contextlib.suppress(StoreError, ClaimConflict):
            self.run(self.plane.renew(claim_id))

    # -- what time, workers and infrastructure do ------------------------------------------

    @rule(seconds=st.sampled_from([1, 5, 15, 35, 65]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.settle(0.2)

    @rule()
    def janitor_pass(self) -> None:
        self.run(self.plane.run_janitor_pass())
        self.settle()

    @rule(data=st.data())
    def a_worker_dies(self, data: st.DataObject) -> None:
        alive = sorted(self.runtime.alive())
        if alive:
            victim = data.draw(st.sampled_from(alive))

            async def die() -> None:
                # Runtime events arrive on the loop, as they do from a real runtime.
                self.runtime.kill(victim)
                await asyncio.sleep(0.5)

            self.run(die())

    @rule(n=st.integers(1, 3))
    def spawns_fail(self, n: int) -> None:
        self.runtime.fail_spawns = n

    @rule(n=st.integers(1, 2))
    def activations_fail(self, n: int) -> None:
        self.runtime.fail_activations = n

    @rule(rate=st.sampled_from([0.0, 0.1, 0.3]))
    def store_writes_fail(self, rate: float) -> None:
        self.store.rate = rate

    @rule()
    def reap_and_check(self) -> None:
        """Fault-free passes (two: I3 allows TTL + 2 passes), then what they must achieve."""
        self.store.rate = 0.0
        self.runtime.fail_spawns = self.runtime.fail_activations = 0
        # What had expired when the first pass started must be gone after the second.
        now = self.now()
        reports = []
        for _ in range(2):
            reports.append(self.run(self.plane.run_janitor_pass()))
            self.settle()
        workers = self.run(self.store.list_workers(states=LIVE))
        claims = self.run(self.store.list_claims(states=[ClaimState.BOUND]))
        # I3: no bound claim past its lease, no hot_idle past its TTL beyond the org floor.
        assert all(c.expires_at > now for c in claims), "expired lease survived two passes"
        idle: dict[tuple[str, str | None], list[Worker]] = defaultdict(list)
        for w in workers:
            if w.state is S.HOT_IDLE:
                idle[(w.pool, w.org)].append(w)
        for (pool, org), parked in idle.items():
            floor = self.plane.catalog.min_hot_idle(pool, org or "")
            expired = [w for w in parked if idle_expires_at(w) <= now]
            assert len(expired) <= floor, f"{pool}/{org} idle leak at {now}: {expired}"
        # I4: nothing in flight or draining beyond its timeout.
        for w in workers:
            if w.state in (S.SPAWNING, S.RESERVED, S.ACTIVATING, S.DRAINING):
                assert now - w.updated_at <= TIMEOUTS.spawn_s + 1, f"{w.id} stuck {w.state}"
        # I6: the warm target is kept where the cap leaves room. A pass that retires a
        # stuck row frees its slot after that pass's scaling step, hence one more pass.
        # A pool backing off before it probes with one spawn; that spawn's readiness
        # ends the back-off after the pass, and the next pass refills the rest.
        backing_off = {spec.name for spec in POOLS if self.plane.spawner.trouble(spec)}
        reports.append(self.run(self.plane.run_janitor_pass()))
        self.settle()
        workers = self.run(self.store.list_workers(states=LIVE))
        for spec in POOLS:
            ready = sum(
                1
                for w in workers
                if w.pool == spec.name
                and (w.state is S.WARM or (w.state is S.SPAWNING and w.org is None))
            )
            capped = spec.name in reports[-1].capped
            # A pool whose spawns failed backs off, then probes one spawn at a time until
            # a worker gets ready (crash-loop back-off): it refills after that.
            failing = spec.name in backing_off or self.plane.spawner.trouble(spec) is not None
            assert capped or failing or ready >= spec.warm_target, (
                spec.name,
                ready,
                reports,
                workers,
            )
        # Lost hot workers failed their claims instead of being silently swapped (I6).
        for claim in self.run(self.store.list_claims(states=[ClaimState.FAILED])):
            assert claim.reason and claim.reason.startswith("worker_"), claim

    # -- what must always hold -------------------------------------------------------------

    @invariant()
    def no_double_assignment(self) -> None:
        """I1: one bound claim per worker, and a hot worker serves exactly its claim."""
        claims = self.run(self.store.list_claims(states=[ClaimState.BOUND]))
        by_worker: dict[str, list[str]] = defaultdict(list)
        for c in claims:
            by_worker[c.worker_id].append(c.id)
        assert all(len(ids) == 1 for ids in by_worker.values()), by_worker
        for w in self.run(self.store.list_workers(states=[S.HOT])):
            assert by_worker.get(w.id) == [w.claim_id], (w, by_worker.get(w.id))

    @invariant()
    def tenant_isolation(self) -> None:
        """I2: a worker ever bound to one org never serves another."""
        assert all(len(orgs) == 1 for orgs in self.orgs_of.values()), dict(self.orgs_of)
        assert self.runtime.fencing_violations == []
        for w in self.run(self.store.list_workers()):
            if w.org is not None and w.id in self.orgs_of:
                assert self.orgs_of[w.id] == {w.org}

    @invariant()
    def caps_hold(self) -> None:
        """I5: live workers per pool and per org within their caps."""
        per_pool: dict[str, int] = defaultdict(int)
        per_org: dict[tuple[str, str], int] = defaultdict(int)
        for w in self.run(self.store.list_workers(states=LIVE)):
            per_pool[w.pool] += 1
            if w.org is not None:
                per_org[(w.pool, w.org)] += 1
        db = POOLS[0]
        assert per_pool["db"] <= db.max_workers
        assert all(n <= db.max_workers_per_org for (p, _), n in per_org.items() if p == "db")

    @invariant()
    def memory_agrees_with_the_store(self) -> None:
        """Persist before mutate: what memory believes was written."""
        for worker_id, known in list(self.plane.book.known_workers().items()):
            row = self.run(self.store.get_worker(worker_id))
            assert row is not None
            assert (row.state, row.epoch) == (known.state, known.epoch), (row, known)

    @invariant()
    def terminal_rows_stay_terminal(self) -> None:
        for w in self.run(self.store.list_workers(states=[S.RETIRED])):
            assert w.reason, w


TestLifecycle = LifecycleMachine.TestCase
TestLifecycle.settings = settings(
    max_examples=int(os.environ.get("STOKER_MACHINE_EXAMPLES", "60")),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
