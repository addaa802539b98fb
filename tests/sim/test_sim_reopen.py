"""A session whose claim ends under it opens a new one after a back-off, for the time it
still needs: the load driver against a fake claim interface whose first worker is lost
(a fake: only the driver's side is under test), on virtual time."""

from __future__ import annotations

import asyncio
import dataclasses

from stoker.domain.errors import CapacityError, ClaimConflict
from stoker.domain.records import Claim, ClaimRequest
from stoker.domain.states import ClaimMode, ClaimSource, ClaimState
from stoker.ports.clock import LoopClock
from stoker.sim.load import LoadDriver
from stoker.sim.scenario import TenantGroup
from stoker.sim.vloop import new_event_loop


class LosesItsFirstWorker:
    """Binds every claim; the first claim's worker is lost at its first renewal."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.claimed: list[float] = []
        self.released: list[tuple[str, float]] = []
        self.renewed = 0

    async def claim(self, req: ClaimRequest) -> Claim:
        self.claimed.append(self.loop.time())
        return dataclasses.replace(await self._claim_now(), id=f"c{len(self.claimed)}")

    async def _claim_now(self) -> Claim:
        now = self.loop.time()
        return Claim(
            id="",
            pool="p",
            org="acme",
            worker_id=f"w{len(self.claimed)}",
            worker_epoch=1,
            source=ClaimSource.WARM,
            mode=ClaimMode.PREFER_WARM,
            state=ClaimState.BOUND,
            token="",
            endpoint="http://w",
            lease_s=40.0,
            expires_at=now + 30.0,
            created_at=now,
            updated_at=now,
            owner="r",
        )

    async def renew(self, claim_id: str, lease_s: float | None = None) -> Claim:
        if claim_id == "c1":
            raise ClaimConflict("claim c1 has ended: worker_lost")
        self.renewed += 1
        return dataclasses.replace(await self._claim_now(), id=claim_id)

    async def release(self, claim_id: str) -> Claim:
        self.released.append((claim_id, self.loop.time()))
        return dataclasses.replace(await self._claim_now(), id=claim_id, state=ClaimState.RELEASED)


def test_a_session_that_lost_its_worker_claims_again_for_the_time_it_still_needed() -> None:
    loop = new_event_loop()
    target = LosesItsFirstWorker(loop)
    group = TenantGroup.model_validate(
        {
            "name": "t",
            "arrival": {"initial": 1, "start_s": 0},
            "duration": 100,
            "lease_s": 40,
            "retries": 2,
            "retry_backoff_s": 4,
        }
    )
    driver = LoadDriver(tenants=[group], pool="p", targets=[target], clock=LoopClock(), seed=1)

    async def run() -> None:
        driver.start()
        await asyncio.sleep(300)
        await driver.stop()

    try:
        loop.run_until_complete(run())
    finally:
        loop.close()
    driver.raise_if_failed()
    first, second = target.claimed
    # Lost at its first renewal (half the lease in), claimed again after 2 to 4 s of
    # back-off (equal jitter), then held for the 80 s it still needed.
    assert 20 + 2 <= second - first <= 20 + 4
    [(released, at)] = target.released
    assert released == "c2" and at - second == 80
    assert target.renewed == 3  # at 20, 40 and 60 s of its 80
    stats = driver.stats
    assert (stats.sessions, stats.sessions_failed, stats.sessions_reopened) == (1, 1, 1)
    assert (stats.released, stats.sessions_lost, driver.active) == (1, 0, 0)
    assert driver.log.bound_after_s == {1: 0.0}


class FailsItsFirstClaim(LosesItsFirstWorker):
    """The first claim fails after 10 s (no capacity); the next ones bind at once."""

    async def claim(self, req: ClaimRequest) -> Claim:
        if not self.claimed:
            self.claimed.append(self.loop.time())
            await asyncio.sleep(10)
            raise CapacityError("no worker within 10s", reason="no_capacity")
        return await super().claim(req)


def test_a_client_in_its_retry_back_off_is_no_waiting_claim() -> None:
    """The pass log's `waiting` and `waiting_with_warm` count claims the control plane
    holds: a client sleeping between two attempts has none there."""
    loop = new_event_loop()
    target = FailsItsFirstClaim(loop)
    group = TenantGroup.model_validate(
        {
            "name": "t",
            "arrival": {"initial": 1, "start_s": 0},
            "duration": 100,
            "retries": 2,
            "retry_backoff_s": 4,
        }
    )
    driver = LoadDriver(tenants=[group], pool="p", targets=[target], clock=LoopClock(), seed=1)
    seen: list[tuple[float, int, int]] = []

    async def run() -> None:
        driver.start()
        for _ in range(30):
            await asyncio.sleep(0.5)
            seen.append((loop.time(), driver.waiting, driver.waiting_longer_than(1.0)))
        await driver.stop()

    try:
        loop.run_until_complete(run())
    finally:
        loop.close()
    driver.raise_if_failed()
    first, second = target.claimed
    assert 10 + 2 <= second - first <= 10 + 4
    during_attempt = [s for s in seen if first + 1.5 < s[0] < first + 10]
    during_backoff = [s for s in seen if first + 10 < s[0] < second]
    assert during_attempt and all(s[1:] == (1, 1) for s in during_attempt)
    assert during_backoff and all(s[1:] == (0, 0) for s in during_backoff)
    assert driver.log.bound_after_s[1] == second - first
