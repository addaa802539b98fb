"""Idempotent claims: a claim sent again with the same `Idempotency-Key` gets the same claim.

A client that got no answer (its connection broke, its read timed out) cannot tell whether
the server bound a worker for it; it sends the claim again with the same key. Here:

- on this replica, requests with one org's key take turns (a retry waits for the request
  it repeats to finish or be cancelled), within the claim's own timeout;
- the store keeps the key's digest on the claim, unique per org (`domain.idempotency`), so
  a retry on any replica finds the claim, and two requests racing on two replicas cannot
  both bind: the second one's worker goes back and it answers with the first one's claim.

The key names its claim for as long as the store keeps the claim: a retry after the claim
ended gets it as it ended (released, expired), never a second worker.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from stoker.control.claims import Claims
from stoker.control.shared import Shared
from stoker.domain import idempotency
from stoker.domain.errors import ClaimConflict, ClaimKeyTaken, IdempotencyKeyReused
from stoker.domain.records import Claim, ClaimRequest
from stoker.domain.states import ClaimState
from stoker.ports.store import StoreReader


@dataclass(eq=False)
class _Slot:
    """The requests of one org's key on this replica: one at a time."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class IdempotentClaims:
    """Serves claims through `Claims`, answering a repeated key with its claim."""

    def __init__(self, shared: Shared, *, claims: Claims, reader: StoreReader) -> None:
        self._catalog = shared.catalog
        self._claims = claims
        self._reader = reader
        self._slots: dict[tuple[str, str], _Slot] = {}

    async def claim(self, req: ClaimRequest) -> tuple[Claim, bool]:
        """The claim for `req`, and True when it is the claim an earlier request with the
        same key made (a replay). Raises `IdempotencyKeyReused` for a key sent before with
        another request, and what `Claims.claim` raises."""
        key = req.idempotency_key
        if key is None:
            return await self._claims.claim(req), False
        digest = idempotency.key_digest(key)
        slot_key = (req.org, digest)
        slot = self._slots.get(slot_key)
        if slot is None:
            slot = self._slots[slot_key] = _Slot()
        slot.users += 1
        try:
            await self._take_turn(slot, req)
            try:
                replay = await self._replay(req, key, digest)
                if replay is not None:
                    return replay, True
                try:
                    return await self._claims.claim(req), False
                except ClaimKeyTaken:
                    # A request with the key bound first on another replica.
                    replay = await self._replay(req, key, digest)
                    if replay is None:
                        raise
                    return replay, True
            finally:
                slot.lock.release()
        finally:
            slot.users -= 1
            if not slot.users:
                del self._slots[slot_key]

    def in_progress(self) -> int:
        """Keys with a request being served on this replica."""
        return len(self._slots)

    async def _take_turn(self, slot: _Slot, req: ClaimRequest) -> None:
        """Wait for the earlier request with the key, at most the claim's timeout."""
        if not slot.lock.locked():
            await slot.lock.acquire()
            return
        pool = self._catalog.pool(req.pool)
        timeout = pool.claim_timeout_s if req.timeout_s is None else req.timeout_s
        try:
            async with asyncio.timeout(timeout):
                await slot.lock.acquire()
        except TimeoutError:
            raise ClaimConflict(
                "a claim with this Idempotency-Key is still being served; retry later"
            ) from None

    async def _replay(self, req: ClaimRequest, key: str, digest: str) -> Claim | None:
        """The stored claim of the key, with its token when still bound; None if none."""
        stored = await self._reader.claim_by_key(req.org, digest)
        if stored is None:
            return None
        if stored.request_digest != idempotency.request_digest(req):
            raise IdempotencyKeyReused(
                f"Idempotency-Key was used for claim {stored.id!r} with a different request "
                "(pool, mode, lease_s, ttl_s or config differ); use a new key for a new claim"
            )
        token = ""
        if stored.state is ClaimState.BOUND and stored.sealed_token:
            token = idempotency.unseal(stored.sealed_token, key, stored.id)
        return stored.evolve(token=token)
