"""Binding: activate a reserved worker for the claim's org and bind the claim to it.

Activation goes through the `Activator` port; a worker whose activation outlasts a third
of its timeout gets its heartbeat re-stamped so the stuck sweep leaves it alone. A worker
whose requester left goes back: to `warm` if it was never activated, else to its org's
`hot_idle`; when neither write is possible it retires rather than leaks.
"""

from __future__ import annotations

import asyncio

from stoker.control import logs
from stoker.control.attempt import Attempt
from stoker.control.journal import EventKind
from stoker.control.pins import Pins
from stoker.control.retiring import Retirer
from stoker.control.rollouts import Outcome
from stoker.control.shared import Shared
from stoker.domain import idempotency
from stoker.domain.errors import ClaimKeyTaken, RuntimeFailure
from stoker.domain.records import Claim, Worker
from stoker.domain.specs import Activation
from stoker.domain.states import ClaimSource, ClaimState, RetireReason, Reuse, WorkerState
from stoker.ports.activator import ActivationPayload, Activator


class Binder:
    """Activates reserved workers and binds their claims; gives back what is not bound."""

    def __init__(
        self, shared: Shared, *, retirer: Retirer, activator: Activator, pins: Pins
    ) -> None:
        self._book, self._lifecycle = shared.book, shared.lifecycle
        self._catalog, self._clock = shared.catalog, shared.clock
        self._metrics, self._ids = shared.metrics, shared.ids
        self._retirer = retirer
        self._journal = shared.journal
        self._rollouts = shared.rollouts
        self._activator = activator
        self._pins = pins
        self._tracer = shared.tracer

    async def activate_and_bind(
        self, a: Attempt, worker: Worker, source: ClaimSource
    ) -> Claim | None:
        """Move the reserved worker to activating, activate it, and bind the claim (hot).

        None when any step failed or the requester left: the worker was given back or
        retired, and the claim tries again.
        """
        pool, book = a.pool, self._book
        if a.abandoned:
            await self.give_back(worker)
            return None
        book.mark_in_flight(worker.id)
        try:
            if worker.state is WorkerState.ACTIVATING:
                # The store moved it on with the reservation (one write for both).
                activating: Worker | None = worker
            else:
                activating = await self._lifecycle.move(
                    worker, WorkerState.ACTIVATING, activated=True, heartbeat_at=self._clock.now()
                )
            if activating is None:
                # The reservation stands in the store; give it back rather than strand it.
                await self.give_back(worker)
                return None
            book.remember(activating)
            if source is not ClaimSource.REUSE:
                # First activation (warm and cold workers have never held an org's data):
                # from now on it does. A reused worker is still marked busy from its first.
                self._pins.pin_soon(activating)
            token = self._ids.token()
            started = self._clock.monotonic()
            if pool.activation is Activation.HTTP:
                payload = ActivationPayload(
                    worker_id=worker.id,
                    org=a.req.org,
                    epoch=activating.epoch,
                    token=token,
                    config=dict(a.req.config),
                )
                # The heartbeat starts only if activation outlasts one interval: most take
                # milliseconds, and a timer is cheaper than a task on the claim path.
                heartbeat = asyncio.get_running_loop().call_later(
                    pool.timeouts.activation_s / 3, self._start_heartbeat, activating.id
                )
                rollouts, revision = self._rollouts, activating.revision
                rollouts.note(pool.name, revision, Outcome.ACTIVATION)
                try:
                    with self._tracer.span("stoker.activate", worker=worker.id):
                        await self._activator.activate(
                            activating, payload, pool.timeouts.activation_s
                        )
                except RuntimeFailure as exc:
                    self._metrics.spawn_failures.labels(pool.name, "activation").inc()
                    self._metrics.revision_failures.labels(pool.name, revision, "activation").inc()
                    rollouts.note(pool.name, revision, Outcome.ACTIVATION_FAILURE)
                    logs.worker_event("activation_failed", activating, error=str(exc))
                    self._journal.worker(EventKind.ACTIVATION_FAILED, activating, detail=str(exc))
                    await self._retirer.retire(
                        book.known(worker.id) or activating, RetireReason.ACTIVATION_FAILURE
                    )
                    return None
                finally:
                    heartbeat.cancel()
            self._metrics.activation_seconds.labels(pool.name).observe(
                self._clock.monotonic() - started
            )
            activating = book.known(worker.id) or activating
            if a.gone():
                await self.give_back(activating)
                return None
            now = self._clock.now()
            lease_s = a.req.lease_s if a.req.lease_s is not None else pool.lease_s
            max_claim_s = self._catalog.max_claim_s(pool.name, a.req.org)
            if max_claim_s > 0:
                # The lease never runs past the session's hard cap (renewals neither).
                lease_s = min(lease_s, max_claim_s)
            claim = Claim(
                id=self._ids.claim(),
                pool=pool.name,
                org=a.req.org,
                worker_id=worker.id,
                worker_epoch=activating.epoch,
                source=source,
                mode=a.req.mode,
                state=ClaimState.BOUND,
                token=token if pool.activation is Activation.HTTP else "",
                endpoint=activating.endpoint or "",
                lease_s=lease_s,
                expires_at=now + lease_s,
                created_at=now,
                updated_at=now,
                owner=book.instance_id,
                ttl_s=a.req.ttl_s,
            )
            key = a.req.idempotency_key
            if key is not None:
                claim = claim.evolve(
                    idempotency_key=idempotency.key_digest(key),
                    request_digest=idempotency.request_digest(a.req),
                    sealed_token=idempotency.seal(claim.token, key, claim.id),
                )
            try:
                with self._tracer.span("stoker.bind", worker=worker.id):
                    hot = await self._lifecycle.bind(activating, claim)
            except ClaimKeyTaken:
                # Another request with the key bound first (on another replica): this
                # worker goes back, and the requester answers with that claim.
                await self.give_back(activating)
                raise
            if hot is None:
                await self.give_back(activating)
                return None
            book.remember(hot)
            book.remember_bound(claim)
        finally:
            book.clear_in_flight(worker.id)
        self._metrics.claims.labels(pool.name, source.value, "bound").inc()
        self._metrics.claim_seconds.labels(pool.name, source.value).observe(
            self._clock.monotonic() - a.started
        )
        logs.event(
            "claim_bound",
            claim=claim.id,
            worker=worker.id,
            pool=pool.name,
            org=claim.org,
            epoch=claim.worker_epoch,
            source=source.value,
        )
        return claim

    async def give_back(self, worker: Worker) -> None:
        """A reserved worker whose requester left: warm if never activated, else hot_idle."""
        book = self._book
        if not worker.activated:
            back = await self._lifecycle.move(worker, WorkerState.WARM, org=None)
            if back is not None:
                book.offer_warm(book.remember(back))
                return
        elif worker.state in (WorkerState.RESERVED, WorkerState.ACTIVATING):
            pool = self._catalog.get(worker.pool)
            if pool is not None and pool.reuse is Reuse.SAME_ORG and worker.org is not None:
                ttl = self._catalog.hot_idle_ttl(pool, worker.org, None)
                back = await self._lifecycle.move(
                    worker, WorkerState.HOT_IDLE, idle_since=self._clock.now(), ttl_s=ttl
                )
                if back is not None:
                    book.offer_hot_idle(book.remember(back))
                    return
        # Keeping it is not possible (or the write failed): retire rather than leak.
        await self._retirer.retire(worker, RetireReason.NO_REUSE)

    def _start_heartbeat(self, worker_id: str) -> None:
        self._book.spawn_task(self._heartbeat(worker_id), f"hb:{worker_id}")

    async def _heartbeat(self, worker_id: str) -> None:
        """Re-stamp an activating worker so the stuck sweep knows its activation is alive."""
        worker = self._book.known(worker_id)
        if worker is None:
            return
        pool = self._catalog.get(worker.pool)
        interval = (pool.timeouts.activation_s if pool else 30.0) / 3
        while True:
            current = self._book.known(worker_id)
            if current is None or current.state is not WorkerState.ACTIVATING:
                return
            stamped = await self._lifecycle.heartbeat(current)
            if stamped is not None:
                self._book.remember(stamped)
            await self._clock.sleep(interval)
