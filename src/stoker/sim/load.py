"""The load driver: tenants open sessions, each claims a worker, holds it, and releases it.

Every tenant (org) has its own arrival process, a Poisson process whose rate varies with
time (ramps, bursts, a daily cycle; `Arrival.rate_at`), sampled by thinning. A session
draws its duration and whether its client will vanish when it arrives, from the tenant's
own generator seeded by the run's seed and the org's name. Arrivals and sessions
therefore do not depend on what the control plane does: every policy of a scenario faces
the very same sessions (common random numbers), so their differences are the policies'.

A session claims through the control plane's in-process interface (`ControlPlane.claim`,
`renew`, `release`), on the replica a load balancer would pick (round robin over the
tenant's sessions and attempts), renews its lease at half of it while it lasts, and
releases at the end. A failed claim is retried `retries` times, as a client would: after
`retry_backoff_s`, growing `retry_backoff_factor` times per failure up to
`retry_backoff_max_s`, with equal jitter (half fixed, half drawn from the session's own
generator, so the arrivals stay common to every policy). A client that vanishes
(`abandon`) neither renews nor releases, so its lease must expire. A session whose claim
ends under it (its worker lost) opens a new claim after the same back-off, for the time it
still needed, up to `retries` times: its demand is not lost.

Every attempt and each session's time to a worker go to `LoadDriver.log`
(`stoker.sim.sessions`): the per-claim log and `sessions.time_to_worker_s`.

Given a `ClaimReplay` (`stoker.sim.claimlog`, a pool's recorded claims), the driver sends
those claims instead, each at its recorded time with its org and mode, and holds each
worker for the recorded time; the tenants' arrival processes do not run. The client's
behaviour (lease, retries, back-off) is `REPLAY_CLIENT`'s: no retries, since a client's
retries are claims of the log already.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from stoker.domain.errors import CapacityError, ClaimConflict, OrgCapError, StokerError
from stoker.domain.records import Claim, ClaimRequest
from stoker.domain.states import ClaimMode, ClaimState
from stoker.ports.clock import Clock
from stoker.sim.claimlog import ClaimReplay
from stoker.sim.scenario import TenantGroup
from stoker.sim.sessions import Attempt, SessionLog


class ClaimTarget(Protocol):
    """What a session talks to: one control-plane replica's claim interface."""

    async def claim(self, req: ClaimRequest) -> Claim:
        """Claim a worker."""
        ...

    async def renew(self, claim_id: str, lease_s: float | None = None) -> Claim:
        """Extend a claim's lease."""
        ...

    async def release(self, claim_id: str) -> Claim:
        """End the session."""
        ...


class SessionObserver(Protocol):
    """Told about every bound and ended session (the invariant checker)."""

    def session_bound(self, claim: Claim, latency_s: float) -> None:
        """A claim was bound to a worker and handed to its client."""
        ...

    def session_ended(self, claim: Claim, how: str) -> None:
        """The client released the claim (`released`) or learnt that it ended (`failed`)."""
        ...


def failure_reason(exc: StokerError) -> str:
    """The reason a failed claim is counted under."""
    if isinstance(exc, OrgCapError):
        return "org_cap"
    if isinstance(exc, CapacityError):
        return exc.reason
    return exc.code.replace("-", "_")


@dataclass
class LoadStats:
    """What the sessions saw."""

    #: Claim latency in seconds by source (reuse, warm, cold).
    latencies: dict[str, list[float]] = field(default_factory=dict)
    #: Failed claim attempts by reason.
    failures: Counter[str] = field(default_factory=Counter)
    sessions: int = 0
    #: Sessions whose every attempt failed.
    sessions_lost: int = 0
    #: Sessions whose claim ended under them (their worker was lost, their lease expired).
    sessions_failed: int = 0
    #: Claims opened again by such sessions, after a back-off, for the time left.
    sessions_reopened: int = 0
    abandoned: int = 0
    released: int = 0
    renewals: int = 0
    #: Renewals and releases the control plane refused for another reason than the
    #: claim having ended (a store outage, a replica shutting down).
    renew_errors: int = 0
    release_errors: int = 0
    #: Seconds (of run time) of the first arrival, and when bound sessions first reached
    #: the scenario's target.
    first_arrival_s: float | None = None
    target_reached_s: float | None = None
    peak_bound: int = 0

    @property
    def bound(self) -> int:
        """Claims that were bound."""
        return sum(len(samples) for samples in self.latencies.values())

    @property
    def time_to_target_s(self) -> float | None:
        """From the first arrival to the target reached (None: never reached)."""
        if self.target_reached_s is None or self.first_arrival_s is None:
            return None
        return self.target_reached_s - self.first_arrival_s


#: Rejected arrival candidates past the run's end after which a tenant's arrival search
#: gives up. A rate that is not 0 accepts a candidate in (its rate / the envelope) on
#: average: one in 108 at the night of a tenant with a daily cycle (0.8) and a burst of 12.
PAST_END_CANDIDATES = 10_000


class LoadDriver:
    """Runs every tenant's sessions against `targets` (the replicas) until `stop`."""

    def __init__(
        self,
        *,
        tenants: Sequence[TenantGroup],
        pool: str,
        targets: Sequence[ClaimTarget],
        clock: Clock,
        seed: int,
        observer: SessionObserver | None = None,
        target_hot: int | None = None,
        replay: ClaimReplay | None = None,
        until_s: float = math.inf,
    ) -> None:
        if not targets:
            raise ValueError("the load driver needs at least one replica")
        self._tenants = tenants
        self._pool = pool
        self._targets = list(targets)
        self._clock = clock
        self._seed = seed
        self._observer = observer
        self._target_hot = target_hot
        self._replay = replay
        #: The run's length (seconds from `start`): no arrival after it is opened.
        self._until_s = until_s
        self._t0 = 0.0
        self.stats = LoadStats()
        self.log = SessionLog()
        #: Sessions holding a worker now, and claims waiting for one.
        self.active = 0
        self.waiting = 0
        #: When each waiting claim attempt was sent (run seconds), by session.
        self._waiting_since: dict[int, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None

    # -- running -------------------------------------------------------------------------

    def start(self) -> None:
        """Start every tenant's arrival process on the running loop (time 0 is now)."""
        self._t0 = self._clock.monotonic()
        if self._replay is not None:
            self._spawn(self._replayed(self._replay), "replay")
            return
        index = 0
        for group in self._tenants:
            for org in group.org_names():
                self._spawn(self._tenant(group, org, index), f"tenant:{org}")
                index += 1

    async def stop(self) -> None:
        """Cancel every arrival process and session (their workers stay as they are)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    def raise_if_failed(self) -> None:
        """Re-raise an unexpected error of a session (a bug, not a refused claim)."""
        if self._failure is not None:
            raise RuntimeError("a simulated session failed") from self._failure

    def now(self) -> float:
        """Seconds since `start`."""
        return self._clock.monotonic() - self._t0

    def waiting_longer_than(self, seconds: float) -> int:
        """Claim attempts that have waited longer than `seconds` so far."""
        cutoff = self._clock.monotonic() - seconds
        return sum(1 for since in self._waiting_since.values() if since < cutoff)

    def _spawn(self, coro: Any, name: str) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._failure = self._failure or exc

    # -- one tenant ------------------------------------------------------------------------

    async def _tenant(self, group: TenantGroup, org: str, index: int) -> None:
        """Open sessions at the tenant's arrival times, forever (until cancelled)."""
        rng = random.Random(f"{self._seed}/{org}")
        arrival = group.arrival
        # Sessions opened at once: at the start, and at each burst that brings some.
        batches = [(arrival.start_s, arrival.initial)]
        batches += [(burst.at_s, burst.sessions) for burst in arrival.bursts]
        batches = sorted(b for b in batches if b[1] > 0)
        envelope = arrival.max_rate()
        poisson = self._next_poisson(rng, group, arrival.start_s) if envelope > 0 else None
        seq = 0
        while batches or poisson is not None:
            if batches and (poisson is None or batches[0][0] <= poisson):
                at, count = batches.pop(0)
            else:
                assert poisson is not None
                at, count = poisson, 1
                poisson = self._next_poisson(rng, group, poisson)
            delay = at - self.now()
            if delay > 0:
                await self._clock.sleep(delay)
            for _ in range(count):
                duration = group.duration.sample(rng)
                abandon = rng.random() < group.abandon
                if self.stats.first_arrival_s is None:
                    self.stats.first_arrival_s = self.now()
                self.stats.sessions += 1
                number = self.stats.sessions
                self.log.arrived(number, self.now(), group.claim_timeout_s)
                self._spawn(
                    self._session(group, org, index + seq, duration, abandon, number),
                    f"session:{org}:{seq}",
                )
                seq += 1

    async def _replayed(self, replay: ClaimReplay) -> None:
        """Open a session at each recorded arrival, for the recorded org, mode and hold."""
        clients = {mode: REPLAY_CLIENT.model_copy(update={"mode": mode}) for mode in ClaimMode}
        orgs, lead = replay.orgs, replay.lead_s
        for i, at in enumerate(replay.at_s):
            delay = lead + at - self.now()
            if delay > 0:
                await self._clock.sleep(delay)
            if self.stats.first_arrival_s is None:
                self.stats.first_arrival_s = self.now()
            self.stats.sessions += 1
            number = self.stats.sessions
            self.log.arrived(number, self.now())
            self._spawn(
                self._session(
                    clients[replay.mode(i)],
                    orgs[replay.org_index[i]],
                    i,
                    replay.hold_s[i],
                    False,
                    number,
                ),
                f"session:{number}",
            )

    def _next_poisson(self, rng: random.Random, group: TenantGroup, after: float) -> float | None:
        """The next arrival after `after` by thinning (None once arrivals stop).

        An arrival at or after the run's end is never opened, but the search draws on
        past it as it always did (the tenant's task then sleeps until it), so that no
        run's figures depend on where the run ends. It gives up after
        `PAST_END_CANDIDATES` rejected candidates past the end: a rate of 0 from some time
        on (a burst of factor 0 that outlasts the run) was searched forever.
        """
        arrival = group.arrival
        envelope = arrival.max_rate()
        t = after
        past_end = 0
        while True:
            t += rng.expovariate(envelope)
            if arrival.stop_s is not None and t >= arrival.stop_s:
                return None
            if rng.random() * envelope <= arrival.rate_at(t):
                return t
            if t >= self._until_s:
                past_end += 1
                if past_end >= PAST_END_CANDIDATES:
                    return None

    # -- one session -----------------------------------------------------------------------

    async def _session(
        self,
        group: TenantGroup,
        org: str,
        route: int,
        duration: float,
        abandon: bool,
        number: int = 0,
    ) -> None:
        jitter = SessionJitter(f"{self._seed}/{org}/{number}")
        got = await self._claim_for(group, org, route, number, jitter)
        if got is None:
            self.stats.sessions_lost += 1
            self.log.gave_up(number, self.now())
            return
        self.log.bound(number, self.now())
        if abandon:
            # The client is gone: nothing renews or releases the claim any more.
            self.stats.abandoned += 1
            self.active -= 1
            return
        left, reopened = duration, 0
        while True:
            target, claim, tries = got
            try:
                left = await self._hold(target, claim, left, group.lease_s)
                if left <= 0:
                    await self._release(target, claim)
                    return
            finally:
                self.active -= 1
            # The claim ended under the session (its worker was lost): the client opens it
            # again after a back-off, for the time it still needs, as a client would.
            if reopened >= group.retries:
                return
            await self._clock.sleep(retry_backoff_s(group, reopened, jitter.rng))
            reopened += 1
            self.stats.sessions_reopened += 1
            got = await self._claim_for(group, org, route + tries, number, jitter, tries)
            if got is None:
                return

    async def _claim_for(
        self,
        group: TenantGroup,
        org: str,
        route: int,
        number: int,
        jitter: SessionJitter,
        first: int = 0,
    ) -> tuple[ClaimTarget, Claim, int] | None:
        """Claim, retrying `group.retries` times after back-offs: (the replica, the claim,
        the attempts so far); None when every attempt failed. Attempts are numbered from
        `first` (a session opened again goes on counting)."""
        for attempt in range(first, first + group.retries + 1):
            replica = (route + attempt - first) % len(self._targets)
            target = self._targets[replica]
            started = self._clock.monotonic()
            self.waiting += 1
            self._waiting_since[number] = started
            # Set when the attempt failed: the client's back-off before the next one.
            backoff: float | None = None
            try:
                claim = await target.claim(
                    ClaimRequest(
                        pool=self._pool,
                        org=org,
                        mode=group.mode,
                        timeout_s=group.claim_timeout_s,
                        lease_s=group.lease_s,
                        ttl_s=group.ttl_s,
                    )
                )
            except StokerError as exc:
                reason = failure_reason(exc)
                self.stats.failures[reason] += 1
                backoff = 0.0
                if attempt < first + group.retries:
                    backoff = retry_backoff_s(group, attempt - first, jitter.rng)
                self._attempt(number, org, attempt, replica, started, reason, None, backoff)
            finally:
                self.waiting -= 1
                self._waiting_since.pop(number, None)
            if backoff is not None:
                # The back-off is the client's own sleep, after the attempt: no claim waits
                # in the control plane meanwhile (`waiting`, `waiting_longer_than`).
                if backoff > 0:
                    await self._clock.sleep(backoff)
                continue
            self._attempt(number, org, attempt, replica, started, "bound", claim.source.value, 0.0)
            self._bound(claim, self._clock.monotonic() - started)
            return target, claim, attempt + 1
        return None

    async def _release(self, target: ClaimTarget, claim: Claim) -> None:
        try:
            ended = await target.release(claim.id)
        except StokerError:
            self.stats.release_errors += 1
            return
        # Releasing a claim that already ended (its worker was lost) returns it.
        how = "released" if ended.state is ClaimState.RELEASED else "failed"
        if how == "released":
            self.stats.released += 1
        else:
            self.stats.sessions_failed += 1
        if self._observer is not None:
            self._observer.session_ended(claim, how)

    def _attempt(
        self,
        session: int,
        org: str,
        attempt: int,
        replica: int,
        started: float,
        outcome: str,
        source: str | None,
        backoff: float,
    ) -> None:
        self.log.attempts.append(
            Attempt(
                session=session,
                org=org,
                attempt=attempt,
                replica=replica,
                start_s=started - self._t0,
                end_s=self.now(),
                outcome=outcome,
                source=source,
                backoff_s=backoff,
            )
        )

    def _bound(self, claim: Claim, latency: float) -> None:
        self.stats.latencies.setdefault(claim.source.value, []).append(latency)
        self.active += 1
        self.stats.peak_bound = max(self.stats.peak_bound, self.active)
        if (
            self._target_hot is not None
            and self.stats.target_reached_s is None
            and self.active >= self._target_hot
        ):
            self.stats.target_reached_s = self.now()
        if self._observer is not None:
            self._observer.session_bound(claim, latency)

    async def _hold(
        self, target: ClaimTarget, claim: Claim, duration: float, lease: float
    ) -> float:
        """Hold the worker for `duration`, renewing at half the lease; the seconds the
        session still needed when the claim ended under it (its worker was lost or its
        lease expired), 0 when it lasted."""
        left = duration
        while left > 0:
            step = min(left, lease / 2)
            await self._clock.sleep(step)
            left -= step
            if left <= 0:
                break
            try:
                await target.renew(claim.id, lease)
                self.stats.renewals += 1
            except ClaimConflict:
                self.stats.sessions_failed += 1
                if self._observer is not None:
                    self._observer.session_ended(claim, "failed")
                return left
            except StokerError:
                # The lease still runs for its other half: the next renewal may succeed.
                self.stats.renew_errors += 1
        return 0.0


class SessionJitter:
    """A session's own generator of back-off jitter, seeded from `seed` when first drawn
    from: the same draws as one seeded at the session's start, and most sessions never
    back off (seeding from a string, a SHA-512 and the twister's set-up, was about 1 % of
    a backtest)."""

    __slots__ = ("_rng", "_seed")

    def __init__(self, seed: str) -> None:
        self._seed = seed
        self._rng: random.Random | None = None

    @property
    def rng(self) -> random.Random:
        """The generator (seeded now, the first time)."""
        if self._rng is None:
            self._rng = random.Random(self._seed)
        return self._rng


#: How a replayed claim's client behaves: the tenants' defaults, without retries.
REPLAY_CLIENT = TenantGroup(name="recorded", retries=0)


def retry_backoff_s(group: TenantGroup, failures: int, rng: random.Random) -> float:
    """The back-off after failed attempt number `failures` (0-based): exponential, capped,
    with equal jitter (half of it fixed, half uniform)."""
    try:
        growth = group.retry_backoff_factor**failures
    except OverflowError:
        # A thousand doublings leave a float's range, long after the cap was reached.
        growth = math.inf
    base = group.retry_backoff_s * growth if group.retry_backoff_s else 0.0
    capped = min(base, group.retry_backoff_max_s)
    return capped / 2 + rng.uniform(0, capped / 2)
