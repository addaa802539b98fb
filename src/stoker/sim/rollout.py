"""A rollout during a simulated run: start it, watch it, measure it (#14).

A scenario's `rollout` section rolls a new image out at `at_s`, through the same call an
admin's `POST /v1/pools/{name}/rollouts` makes, with the policy's strategy:

- **stoker**: the scenario's canary, sized by `stoker.policy.rollout.rollout_plan`;
- **replace**: every new claim goes to the new revision at once (stoker before canaries);
- **canary-pool-default**: the same canary, but its ramp's warm target is the pool's
  default target times the step's share, never the other revisions' load (picchu #602:
  "a ramp sized from a default of 1 got stuck at 1-4 pods"; `stoker.sim.baselines`).

`RolloutRun` watches the rollout every second until it has *completed*: its row ended
(promoted or rolled back) and no idle worker (warm, spawning or parked) of another
revision is left: new claims are served by one revision again (sessions are never moved:
those under way finish on their worker). While it is under way it checks **I8**, live
workers within the pool's cap. The summary (`summary.json`'s `rollout`) counts the claims
sent while it was under way, and those sent from its start to the end of the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

from stoker.domain.pools import Rollout
from stoker.domain.rollouts import ReplaceStrategy, Strategy, strategy_from
from stoker.domain.specs import PodTemplate
from stoker.domain.states import WorkerState
from stoker.ports.store import Store
from stoker.sim.invariants import InvariantChecker
from stoker.sim.replicas import PolicyReplicas
from stoker.sim.scenario import PolicyEntry, RolloutConfig
from stoker.sim.sessions import Attempt

#: How often the run looks at the rollout (seconds of run time).
WATCH_S = 1.0
#: The settings of the scenario's rollout that are its canary, in the strategy's JSON form.
_CANARY = {"steps", "step_interval_s", "max_failure_ratio", "hold_deadline_s"}


def strategy_for(entry: PolicyEntry, config: RolloutConfig) -> Strategy:
    """The rollout's strategy under the policy."""
    if entry.policy == "replace":
        return ReplaceStrategy()
    return strategy_from(config.model_dump(include=_CANARY))


class RolloutRun:
    """Starts the scenario's rollout at its time and watches it to completion."""

    def __init__(
        self,
        config: RolloutConfig,
        entry: PolicyEntry,
        replicas: PolicyReplicas,
        store: Store,
        checker: InvariantChecker,
        *,
        cap: int,
    ) -> None:
        """`cap`: the pool cap in force (0: none)."""
        self._config, self._entry, self._pool = config, entry, replicas.pool
        self._replicas, self._store, self._checker = replicas, store, checker
        self._now = replicas.planes[0].clock.monotonic
        self.cap = cap
        self.rollout: Rollout | None = None
        self.started_s: float | None = None
        #: When its first step took effect (a claim could route to it), and when it ended.
        self.first_step_s: float | None = None
        self.ended_s: float | None = None
        self.completed_s: float | None = None
        self.outcome: str | None = None
        self.peak_live = 0
        #: Live workers by revision and state when last watched.
        self.last_counts: dict[str, int] = {}

    @property
    def under_way(self) -> bool:
        """True from the start until the rollout completed."""
        return self.started_s is not None and self.completed_s is None

    async def run(self) -> None:
        """Wait for `at_s`, start the rollout, then watch it every second."""
        await asyncio.sleep(max(0.0, self._config.at_s - self._now()))
        await self._start()
        while self.completed_s is None:
            await asyncio.sleep(WATCH_S)
            await self._watch()

    async def _start(self) -> None:
        template = self._pool.template
        assert isinstance(template, PodTemplate), "the simulator's pools run pods"
        new = dataclasses.replace(template, image=self._config.image)
        index = self._replicas.leader()
        plane = self._replicas.planes[index if index is not None else 0]
        stored = await plane.pools.get(self._pool.name)
        strategy = strategy_for(self._entry, self._config)
        rollout = await plane.pools.propose(stored, new, now=plane.clock.now(), strategy=strategy)
        if self._config.activation_failure_rate:
            rates = self._replicas.activator.revision_failure_rate
            rates[rollout.revision] = self._config.activation_failure_rate
            self._replicas.activator.followers_only = self._config.failing_on == "followers"
        self.rollout, self.started_s = rollout, self._now()

    async def _watch(self) -> None:
        rollout = self.rollout
        assert rollout is not None and self.started_s is not None
        counts = [c for c in await self._store.count_workers() if c.pool == self._pool.name]
        live = sum(c.count for c in counts)
        self.last_counts = {
            f"{c.revision}/{c.state.value}": c.count for c in sorted(counts, key=str) if c.count
        }
        self.peak_live = max(self.peak_live, live)
        if self.cap and live > self.cap:
            self._checker.violation(
                "I8", self._pool.name, f"{live} live workers during a rollout, cap {self.cap}"
            )
        if self.ended_s is None:
            row = await self._store.get_rollout(rollout.id)
            if row is not None and row.share > 0 and self.first_step_s is None:
                self.first_step_s = self._now()
            if row is None or not row.state.ended:
                return
            self.rollout, self.ended_s = row, self._now()
            self.outcome = _outcome(self._entry, row)
        stored = await self._store.get_pool(self._pool.name)
        stable = stored.revision if stored is not None else self._pool.revision
        idle = (WorkerState.WARM, WorkerState.SPAWNING, WorkerState.HOT_IDLE)
        if not any(c.count for c in counts if c.revision != stable and c.state in idle):
            self.completed_s = self._now()

    def summary(self, attempts: list[Attempt]) -> dict[str, Any] | None:
        """`summary.json`'s `rollout`: the claims sent while the rollout was under way."""
        if self.started_s is None or self.rollout is None:
            return None
        until = self.completed_s if self.completed_s is not None else math.inf
        during = [a for a in attempts if self.started_s <= a.start_s <= until]
        cold = sum(1 for a in during if a.outcome == "bound" and a.source == "cold")
        failed = sum(1 for a in during if a.outcome != "bound")
        after = [a for a in attempts if a.start_s >= self.started_s]
        return {
            "id": self.rollout.id,
            "revision": self.rollout.revision,
            "strategy": self._entry.policy,
            "started_s": self.started_s,
            "claims_during": len(during),
            "cold_claims_during": cold,
            "failed_claims_during": failed,
            "cold_share_during": cold / len(during) if during else None,
            "failed_share_during": failed / len(during) if during else None,
            "claims_after_start": len(after),
            "cold_claims_after_start": sum(1 for a in after if a.source == "cold"),
            "failed_claims_after_start": sum(1 for a in after if a.outcome != "bound"),
            "peak_live": self.peak_live,
            "cap": self.cap or None,
            "completed_s": None if self.completed_s is None else self.completed_s - self.started_s,
            "first_step_s": _after(self.first_step_s, self.started_s),
            "ended_s": _after(self.ended_s, self.started_s),
            "outcome": self.outcome,
            "state": self.rollout.state.value,
            "reason": self.rollout.reason,
            "live_at_end": self.last_counts,
        }


def _after(at: float | None, start: float) -> float | None:
    return None if at is None else at - start


def _outcome(entry: PolicyEntry, row: Rollout) -> str:
    if entry.policy == "replace" and row.state.value == "promoted":
        return "replaced"
    return row.state.value
