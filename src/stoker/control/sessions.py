"""Sessions after binding: read, renew, release and expire a claim.

A release parks the worker as its org's hot_idle (reuse: same_org) or retires it; a lease
that ran out ends the claim and retires its worker.
"""

from __future__ import annotations

from stoker.control.retiring import Retirer
from stoker.control.shared import Shared
from stoker.domain.errors import ClaimConflict, NotFound, unknown_claim
from stoker.domain.records import Claim
from stoker.domain.states import ClaimState, RetireReason, Reuse, WorkerState
from stoker.policy.reaping import session_left
from stoker.ports.store import StoreReader


class Sessions:
    """Claims once bound: the session's lease."""

    def __init__(self, shared: Shared, *, retirer: Retirer, reader: StoreReader) -> None:
        self._book, self._lifecycle = shared.book, shared.lifecycle
        self._rollouts = shared.rollouts
        self._catalog, self._clock, self._metrics = shared.catalog, shared.clock, shared.metrics
        self._retirer = retirer
        self._reader = reader

    async def get_claim(self, claim_id: str) -> Claim:
        """A claim by id, or NotFound."""
        claim = await self._reader.get_claim(claim_id)
        if claim is None:
            raise NotFound(unknown_claim(claim_id))
        return claim

    async def renew(self, claim_id: str, lease_s: float | None = None) -> Claim:
        """Extend a bound claim's lease by `lease_s` (default: the claim's own) from now,
        never past the session's `max_claim_s`; a claim past it ends (`ClaimConflict`)."""
        claim = self._book.bound_claim(claim_id) or await self.get_claim(claim_id)
        _check_bound(claim)
        lease = lease_s if lease_s is not None else claim.lease_s
        max_claim_s = self._catalog.max_claim_s(claim.pool, claim.org)
        left = session_left(claim.created_at, max_claim_s, self._clock.now())
        if left is not None:
            if left <= 0:
                await self.expire(claim, RetireReason.MAX_CLAIM)
                raise ClaimConflict(
                    f"claim {claim_id!r} reached its max_claim_s of {max_claim_s:g}s and ended"
                )
            lease = min(lease, left)
        renewed = await self._lifecycle.renew(claim_id, lease_s=lease)
        if renewed is None:
            # Ended meanwhile, or before: a claim remembered here is not read first.
            self._book.drop_bound(claim_id)
            _check_bound(await self.get_claim(claim_id))
            raise ClaimConflict(f"claim {claim_id!r} ended while renewing")
        return renewed

    async def release(self, claim_id: str) -> Claim:
        """End a session: the worker parks as hot_idle (reuse: same_org) or retires.

        Releasing a claim that already ended returns it unchanged. A claim bound here is
        not read first: the write ends it only if it is still bound, and a miss reads it.
        """
        claim = self._book.bound_claim(claim_id) or await self.get_claim(claim_id)
        if claim.state is not ClaimState.BOUND:
            return claim
        return await self._end(claim, ClaimState.RELEASED)

    async def expire(self, claim: Claim, why: RetireReason = RetireReason.LEASE_EXPIRED) -> bool:
        """End a claim whose lease ran out (or that reached its `max_claim_s`) and retire
        its worker."""
        return await self._retirer.end_session(
            claim, ClaimState.EXPIRED, why, claim_reason=why.value
        )

    async def _end(self, claim: Claim, state: ClaimState) -> Claim:
        pool = self._catalog.get(claim.pool)
        # Only the revision is needed, which never changes: memory will do when it knows.
        worker = self._book.known(claim.worker_id) or await self._reader.get_worker(claim.worker_id)
        reuse = (
            pool is not None
            and pool.reuse is Reuse.SAME_ORG
            and worker is not None
            and self._rollouts.serving(pool.name, worker.revision)
            and not self._book.closing
        )
        if pool is not None and reuse:
            ended = await self._lifecycle.end_claim(
                claim,
                state=state,
                worker_to=WorkerState.HOT_IDLE,
                idle_since=self._clock.now(),
                ttl_s=self._catalog.hot_idle_ttl(pool, claim.org, claim.ttl_s),
            )
        else:
            why = (
                self._rollouts.retire_reason(pool.name, worker.revision if worker else "")
                if pool is not None and pool.reuse is Reuse.SAME_ORG
                else RetireReason.NO_REUSE
            )
            ended = await self._lifecycle.end_claim(
                claim, state=state, worker_to=WorkerState.DRAINING, reason=why.value
            )
        if ended is None:
            # Someone else ended it meanwhile (lease expiry, a lost worker): report that.
            self._book.drop_bound(claim.id)
            return await self.get_claim(claim.id)
        done, moved = ended
        self._metrics.claims.labels(claim.pool, claim.source.value, state.value).inc()
        if moved.state is WorkerState.HOT_IDLE:
            if moved.owner == self._book.instance_id:
                self._book.offer_hot_idle(self._book.remember(moved))
            else:
                self._book.hot_idle_parked(moved.pool, moved.org)
        else:
            self._book.remember(moved)
            self._retirer.stop_soon(moved, stop=True)
        return done


def _check_bound(claim: Claim) -> None:
    """Raise `ClaimConflict` unless `claim` is bound."""
    if claim.state is not ClaimState.BOUND:
        raise ClaimConflict(f"claim {claim.id!r} is {claim.state.value}, not bound")
