"""Verdicts from every replica: each replica's outcome counts of a rollout's revision go to
the store in batches, and the leader's verdict sums them (docs/guides/rollouts.md).

A claim, a spawn or an activation only adds one to a counter in memory (`Rollouts.note`);
every pass of this replica (the janitor's or the fallback reaper's) writes the counters
that changed since the last write, off the claim path, and so does a background write
`FAILURE_FLUSH_S` after a failure (one per interval however many fail), so that a bad
revision's failures reach the leader before a slow fallback-reaper pass. The rows are
cumulative per replica, so a failed write loses nothing: the next one writes them again.
The leader reads the sums of the active rollouts once per pass, before it plans.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from stoker.control import logs
from stoker.control.shared import Shared
from stoker.domain.errors import StoreError
from stoker.policy.rollout import RevisionFailures
from stoker.ports.store import ReplicaStore

#: How long after a failure its counts are written (the failures of that time ride along).
FAILURE_FLUSH_S = 1.0


class OutcomeCounts:
    """Writes this replica's outcome counts; reads every replica's summed."""

    def __init__(self, shared: Shared, *, store: ReplicaStore) -> None:
        self._rollouts, self._book, self._clock = shared.rollouts, shared.book, shared.clock
        self._store = store
        #: The counts last written, by rollout id.
        self._written: dict[str, dict[str, int]] = {}
        self._flush: asyncio.Task[None] | None = None
        shared.rollouts.on_failure = self.publish_soon

    def publish_soon(self) -> None:
        """Write the counts `FAILURE_FLUSH_S` from now (coalesced: one write at a time)."""
        if self._flush is None or self._flush.done():
            self._flush = self._book.spawn_task(self._publish_later(), "outcomes")

    async def _publish_later(self) -> None:
        await self._clock.sleep(FAILURE_FLUSH_S)
        await self.publish()

    async def publish(self) -> None:
        """Write the counts that changed since the last write (nothing when none did)."""
        changed = {
            rollout: counts
            for rollout, counts in self._rollouts.counted().items()
            if self._written.get(rollout) != counts
        }
        if not changed:
            return
        try:
            await self._store.record_outcomes(
                self._book.instance_id, changed, now=self._clock.now()
            )
        except StoreError as exc:
            # Cumulative: the next pass writes them again, nothing is lost.
            logs.event("outcomes_publish_failed", error=str(exc), level=logs.WARNING)
            return
        self._written.update(changed)

    async def summed(self, rollout_ids: Iterable[str]) -> dict[str, RevisionFailures] | None:
        """Every replica's counts of the rollouts, summed (None when the store failed: the
        leader then judges from its own counts)."""
        ids = sorted(set(rollout_ids))
        if not ids:
            return {}
        try:
            rows = await self._store.read_outcomes(ids)
        except StoreError as exc:
            logs.event("outcomes_read_failed", error=str(exc), level=logs.WARNING)
            return None
        return {rollout: self._rollouts.failures_of(rows.get(rollout, {})) for rollout in ids}
