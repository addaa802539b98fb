"""The only module that writes a worker's state or a claim.

It alone holds the store's writer side (`StoreWriter`); every other part of the control
plane reads the store and asks the lifecycle to write (tests/control/test_store_writer_rule.py
checks). Every write goes to the store first (persist before mutate). A write that fails keeps the
worker in its old state: the caller gets None, `stoker_persist_failures` counts it, and the
next pass retries. A CAS that finds the row changed also returns None and counts a fence
miss. Every write carries the version of the record it was decided on, so a decision made
from a stale read misses even when it keeps the state. On success one structured log line
records the change.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Unpack

from stoker.control import logs
from stoker.control.journal import EventKind, Journal
from stoker.control.metrics import Metrics
from stoker.domain.errors import StoreError
from stoker.domain.records import Claim, Worker
from stoker.domain.states import ClaimState, WorkerState
from stoker.ports.clock import Clock
from stoker.ports.store import (
    ParkedFirst,
    ParkedOrWarm,
    Reservation,
    ReserveResult,
    SpawnRequest,
    SpawnResult,
    StoreWriter,
    fence,
)

#: The label of a bind in `stoker_persist_failures` and `stoker_fence_misses`.
_BIND_LABEL = "activating->hot"


def _label(before: WorkerState, to: WorkerState) -> str:
    """A transition's label in the metrics and logs, e.g. `warm->reserved`.

    Built only when a write failed or missed its fence: a written transition never needs it.
    """
    return f"{before.value}->{to.value}"


class Lifecycle:
    """Fenced, persisted worker transitions, each logged and counted."""

    def __init__(
        self, writer: StoreWriter, clock: Clock, metrics: Metrics, journal: Journal | None = None
    ) -> None:
        self._writer = writer
        #: The store looks for a parked worker and reserves a warm one in one write.
        self._parked_first = writer if isinstance(writer, ParkedFirst) else None
        self.clock = clock
        self.metrics = metrics
        self.journal = journal or Journal(clock.now)
        #: The last heartbeat of each activating worker (in flight or written), by id.
        self._beats: dict[str, asyncio.Future[Worker | None]] = {}
        #: (monotonic time, error) of the last write the store failed, if any.
        self.last_store_failure: tuple[float, str] | None = None
        #: Told of every state written (the state before, None for a new row; the row the
        #: write was fenced on, when the write was a `move`) and of every claim ended: the
        #: ledger's hooks (`control.ledger`), in memory only.
        self.on_moved: Callable[[WorkerState | None, Worker, Worker | None], None] | None = None
        self.on_claim_ended: Callable[[Claim], None] | None = None
        #: Told of every adoption (the row as the previous owner left it, the row written).
        self.on_adopted: Callable[[Worker, Worker], None] | None = None

    def _persist_failed(self, label: str, exc: StoreError) -> None:
        self.last_store_failure = (self.clock.monotonic(), str(exc))
        self.metrics.persist_failures.labels(label).inc()
        logs.event("persist_failed", transition=label, error=str(exc), level=logs.WARNING)
        self.journal.record(EventKind.PERSIST_FAILED, reason=label, detail=str(exc))

    def _fence_missed(self, label: str) -> None:
        self.metrics.fence_misses.labels(label).inc()

    def _written(
        self,
        old_state: WorkerState | None,
        new: Worker,
        reason: str | None,
        *,
        previous: Worker | None = None,
        **fields: Any,
    ) -> None:
        self.metrics.transitions.labels(new.pool, new.state.value).inc()
        logs.worker_event(
            "worker_transition",
            new,
            **{"from": old_state.value if old_state else None},
            reason=reason,
            **fields,
        )
        if old_state is None:
            self.journal.worker(EventKind.SPAWNED, new)
        if self.on_moved is not None:
            self.on_moved(old_state, new, previous)

    async def move(
        self,
        worker: Worker,
        to: WorkerState,
        *,
        bump_epoch: bool = False,
        **changes: Any,
    ) -> Worker | None:
        """CAS `worker` (as last read) to `to` with `changes`; None if not written."""
        try:
            new = await self._writer.transition(
                worker.id,
                **fence(worker),
                to=to,
                now=self.clock.now(),
                bump_epoch=bump_epoch,
                changes=changes,
            )
        except StoreError as exc:
            self._persist_failed(_label(worker.state, to), exc)
            return None
        if new is None:
            self._fence_missed(_label(worker.state, to))
            return None
        if to is not worker.state:
            if self._beats:
                self._beats.pop(worker.id, None)  # its activation, if any, is over
            self._written(worker.state, new, changes.get("reason"), previous=worker)
        return new

    async def reserve_slots(self, req: SpawnRequest, ids: Sequence[str]) -> SpawnResult:
        """Spawn slots within caps and target; an empty result when the write failed."""
        try:
            result = await self._writer.reserve_spawn_slots(req, ids, self.clock.now())
        except StoreError as exc:
            self._persist_failed("new->spawning", exc)
            return SpawnResult([], "store")
        for w in result.workers:
            self._written(None, w, None)
        return result

    async def reserve(
        self, worker: Worker, *, org: str, org_cap: int, owner: str, activate: bool = False
    ) -> ReserveResult:
        """CAS a warm or hot_idle worker to reserved for `org` (epoch bumped); with
        `activate`, the store may move it on to activating in the same write."""
        try:
            result = await self._writer.reserve(
                worker.id,
                **fence(worker),
                org=org,
                org_cap=org_cap,
                owner=owner,
                now=self.clock.now(),
                activate=activate,
            )
        except StoreError as exc:
            self._persist_failed(_label(worker.state, WorkerState.RESERVED), exc)
            return ReserveResult(None)
        if result.worker is not None:
            self._reserved(worker.state, result.worker, None)
        elif not result.at_org_cap:
            self._fence_missed(_label(worker.state, WorkerState.RESERVED))
        return result

    async def reserve_any(
        self, pool: str, revision: str, **by: Unpack[Reservation]
    ) -> ReserveResult:
        """Reserve any matching worker found in the store (the queues are only hints)."""
        try:
            result = await self._writer.reserve_any(pool, revision, now=self.clock.now(), **by)
        except StoreError as exc:
            self._persist_failed(_label(by["expect"], WorkerState.RESERVED), exc)
            return ReserveResult(None)
        if result.worker is not None:
            self._reserved(by["expect"], result.worker, "store_pick")
        return result

    @property
    def folds_parked_look(self) -> bool:
        """Whether `reserve_parked_or` costs one write (else the caller makes two)."""
        return self._parked_first is not None

    async def reserve_parked_or(
        self, warm: Worker, *, revisions: Sequence[str], org: str, org_cap: int, owner: str
    ) -> ReserveResult:
        """A worker `org` parked at `revisions` (the first that has one), else the known
        `warm` worker within `org_cap`, reserved and moved on to activating in one write;
        the result's `parked` says which (`folds_parked_look` stores only)."""
        assert self._parked_first is not None
        by: ParkedOrWarm = {
            "pool": warm.pool,
            "revisions": revisions,
            "org": org,
            "org_cap": org_cap,
            "owner": owner,
            "activate": True,
            "revision": warm.revision,
            **fence(warm),
        }
        try:
            result = await self._parked_first.reserve_parked_or(warm.id, now=self.clock.now(), **by)
        except StoreError as exc:
            self._persist_failed(_label(WorkerState.WARM, WorkerState.RESERVED), exc)
            return ReserveResult(None)
        new = result.worker
        if new is not None and result.parked:
            self._reserved(WorkerState.HOT_IDLE, new, "store_pick")
        elif new is not None:
            self._reserved(WorkerState.WARM, new, None)
        elif not result.at_org_cap:
            self._fence_missed(_label(WorkerState.WARM, WorkerState.RESERVED))
        return result

    async def reserve_parked_or_any(
        self, pool: str, revision: str, *, revisions: Sequence[str], org: str, owner: str
    ) -> ReserveResult:
        """A worker `org` parked at `revisions`, else any warm worker of `pool` at
        `revision` (no org cap), reserved and moved on to activating in one write; the
        result's `parked` says which (`folds_parked_look` stores only)."""
        assert self._parked_first is not None
        try:
            result = await self._parked_first.reserve_parked_or_any(
                revision,
                now=self.clock.now(),
                pool=pool,
                revisions=revisions,
                expect=WorkerState.WARM,
                org=org,
                org_cap=0,
                owner=owner,
                activate=True,
            )
        except StoreError as exc:
            self._persist_failed(_label(WorkerState.WARM, WorkerState.RESERVED), exc)
            return ReserveResult(None)
        if result.worker is not None:
            before = WorkerState.HOT_IDLE if result.parked else WorkerState.WARM
            self._reserved(before, result.worker, "store_pick")
        return result

    def _reserved(self, before: WorkerState, new: Worker, reason: str | None) -> None:
        """Log and count a reservation, and the move on to activating made with it (one
        write, one line: `from=warm` and `via=reserved` on the activating worker)."""
        if new.state is WorkerState.ACTIVATING:
            self.metrics.transitions.labels(new.pool, WorkerState.RESERVED.value).inc()
            self._written(before, new, reason, via=WorkerState.RESERVED.value)
        else:
            self._written(before, new, reason)

    async def bind(self, worker: Worker, claim: Claim) -> Worker | None:
        """activating -> hot with the claim inserted, atomically."""
        try:
            new = await self._writer.bind(
                worker.id,
                epoch=worker.epoch,
                version=worker.version,
                claim=claim,
                now=self.clock.now(),
            )
            if new is None:
                new = await self._bind_after_heartbeat(worker, claim)
            elif self._beats:
                self._beats.pop(worker.id, None)
        except StoreError as exc:
            self._persist_failed(_BIND_LABEL, exc)
            return None
        if new is None:
            self._fence_missed(_BIND_LABEL)
            return None
        self._written(worker.state, new, None)
        return new

    async def _bind_after_heartbeat(self, worker: Worker, claim: Claim) -> Worker | None:
        """Bind once more after a miss if the activation's own heartbeat wrote the row
        meanwhile (its write can land between the read of `worker` and the bind): on the
        record that heartbeat wrote, still activating at the same epoch."""
        beat = self._beats.pop(worker.id, None)
        if beat is None:
            return None
        stamped = await asyncio.shield(beat)
        if (
            stamped is None
            or stamped.version <= worker.version
            or (stamped.state, stamped.epoch) != (WorkerState.ACTIVATING, worker.epoch)
        ):
            return None
        return await self._writer.bind(
            stamped.id,
            epoch=stamped.epoch,
            version=stamped.version,
            claim=claim,
            now=self.clock.now(),
        )

    async def end_claim(
        self,
        claim: Claim,
        *,
        state: ClaimState,
        worker_to: WorkerState,
        claim_reason: str | None = None,
        **worker_changes: Any,
    ) -> tuple[Claim, Worker] | None:
        """End a bound claim and move its hot worker in one write; None if not written.

        `claim_reason` is recorded on the claim; `worker_changes` (including a retire
        `reason`) on the worker.
        """
        try:
            result = await self._writer.end_claim(
                claim.id,
                state=state,
                worker_to=worker_to,
                now=self.clock.now(),
                reason=claim_reason,
                worker_changes=worker_changes,
            )
        except StoreError as exc:
            self._persist_failed(_label(WorkerState.HOT, worker_to), exc)
            raise
        if result is None:
            self._fence_missed(_label(WorkerState.HOT, worker_to))
            return None
        logs.event(
            "claim_ended", claim=claim.id, org=claim.org, state=state.value, reason=claim_reason
        )
        self._written(WorkerState.HOT, result[1], worker_changes.get("reason"))
        if self.on_claim_ended is not None:
            self.on_claim_ended(result[0])
        return result

    async def renew(self, claim_id: str, *, lease_s: float) -> Claim | None:
        """Extend a bound claim's lease to `lease_s` from now; None if it is not bound.

        A store error is raised: the caller answers it.
        """
        now = self.clock.now()
        return await self._writer.renew_claim(claim_id, expires_at=now + lease_s, now=now)

    async def adopt(self, worker: Worker, owner: str) -> Worker | None:
        """Take over a worker of an expired replica in its current state."""
        adopted = await self.move(worker, worker.state, owner=owner)
        if adopted is not None and self.on_adopted is not None:
            self.on_adopted(worker, adopted)
        return adopted

    async def heartbeat(self, worker: Worker) -> Worker | None:
        """Re-stamp `heartbeat_at` of an activating worker (keeps the stuck sweep away).

        The record it writes is kept for the bind of the same activation (see `bind`) until
        the worker leaves `activating`.
        """
        beat: asyncio.Future[Worker | None] = asyncio.get_running_loop().create_future()
        self._beats[worker.id] = beat
        stamped: Worker | None = None
        try:
            stamped = await self.move(worker, worker.state, heartbeat_at=self.clock.now())
        finally:
            beat.set_result(stamped)
            if stamped is None and self._beats.get(worker.id) is beat:
                del self._beats[worker.id]
        return stamped

    def retired(self, worker: Worker) -> None:
        """Count and journal a retirement by its reason (called once the row is terminal)."""
        self.metrics.retirements.labels(worker.pool, worker.reason or "unknown").inc()
        self.journal.worker(EventKind.RETIRED, worker)
