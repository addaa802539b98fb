"""The elector loop every lease elector shares (store lease, Kubernetes Lease).

A `LeaseElector` contends for a lease through a `LeaseBackend` and keeps contending for as
long as it runs. A single acquire-and-hold that returned on the first renewal blip stopped
fleet-wide reaping for good and leaked thousands of idle workers (duckgres #820); here
neither a lost lease nor a backend error ever ends `run()`: the elector steps down and
contends again.

Timings follow client-go's leader election (15 s lease, 10 s renew deadline, 2 s retry):

- not leading, it tries to acquire every `retry_period_s`;
- leading, it renews every `retry_period_s`; when no renewal succeeded within
  `renew_deadline_s` of the last good one it steps down, well before the lease
  (`lease_duration_s`) can expire for the other replicas, then contends again;
- `is_leader` is computed from the clock on every read, so a leader whose loop is stalled
  (a blocked event loop, a hung backend call) stops claiming leadership on time.

Every wait goes through the injected `Clock`, so the loop runs unchanged on virtual time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypedDict, TypeVar

from stoker.adapters._deadlines import DeadlinePassed, within
from stoker.adapters._logs import EventLog
from stoker.ports.clock import Clock

_log = EventLog("stoker.elector")

T = TypeVar("T")

#: Called with the fencing epoch when this replica starts leading.
StartedLeading = Callable[[int], None]
#: Called when this replica stops leading (lost, deadline passed, resigned, cancelled).
StoppedLeading = Callable[[], None]


class ElectorOptions(TypedDict, total=False):
    """The timings and callbacks of a `LeaseElector`, as every elector's constructor takes them.

    The electors on a particular backend pass these on unchanged (`**options`), so the
    defaults and their rules live once, in `LeaseElector.__init__`.
    """

    lease_duration_s: float
    renew_deadline_s: float
    retry_period_s: float
    on_started_leading: StartedLeading | None
    on_stopped_leading: StoppedLeading | None


class LeaseBackend(Protocol):
    """Where a lease lives: a store row, a Kubernetes Lease. One backend per lease name."""

    async def try_acquire(self, holder: str, now: float, duration_s: float) -> int | None:
        """Take the lease if it is free or expired, or renew it if `holder` holds it.

        Returns the fencing epoch (bumped whenever the holder changes), or None when
        another holder holds an unexpired lease or won a race for it. Raises on a backend
        failure (the elector retries). `now` is wall time in seconds since the epoch.
        """
        ...

    async def release(self, holder: str, now: float) -> None:
        """Free the lease if `holder` holds it, so another replica can take it at once."""
        ...


class _Timeout(Exception):
    """A backend call outlived the time the elector could wait for it."""


def check_timings(lease_duration_s: float, renew_deadline_s: float, retry_period_s: float) -> None:
    """Raise ValueError unless the timings keep client-go's rule: the deadline leaves room
    for a few retries, and a leader steps down before its lease can expire for the others."""
    if not retry_period_s > 0:
        raise ValueError(f"retry_period_s ({retry_period_s:g}) must be > 0")
    if not renew_deadline_s > 1.2 * retry_period_s:
        raise ValueError(
            f"renew_deadline_s ({renew_deadline_s:g}) must exceed 1.2 x retry_period_s "
            f"({retry_period_s:g}), i.e. {1.2 * retry_period_s:g}"
        )
    if not lease_duration_s > renew_deadline_s:
        raise ValueError(
            f"lease_duration_s ({lease_duration_s:g}) must exceed "
            f"renew_deadline_s ({renew_deadline_s:g})"
        )


class LeaseElector:
    """Leader election on a `LeaseBackend`; implements `stoker.ports.elector.Elector`.

    `identity` must be unique per replica start (the instance id). The callbacks run in
    the elector's task; an exception in one is logged and never stops the loop.
    """

    def __init__(
        self,
        backend: LeaseBackend,
        *,
        clock: Clock,
        identity: str,
        lease_duration_s: float = 15.0,
        renew_deadline_s: float = 10.0,
        retry_period_s: float = 2.0,
        on_started_leading: StartedLeading | None = None,
        on_stopped_leading: StoppedLeading | None = None,
    ) -> None:
        check_timings(lease_duration_s, renew_deadline_s, retry_period_s)
        if not identity:
            raise ValueError("identity must not be empty")
        self._backend = backend
        self._clock = clock
        self.identity = identity
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self._on_started = on_started_leading
        self._on_stopped = on_stopped_leading
        self._leading = False
        self._epoch = 0
        #: Clock.monotonic() at the start of the last successful acquire or renewal; the
        #: backend stamped the lease with the wall time of that same moment.
        self._renewed_at = 0.0
        self._resigned = False
        #: Terms led so far, and backend calls that failed (for metrics and tests).
        self.terms = 0
        self.failures = 0

    # -- the Elector port -------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True while leading and the last renewal is younger than the renew deadline."""
        if not self._leading:
            return False
        return self._clock.monotonic() < self._renewed_at + self.renew_deadline_s

    @property
    def epoch(self) -> int:
        """The fencing epoch of the current (or last) term; 0 before the first one."""
        return self._epoch

    async def run(self) -> None:
        """Contend, lead, renew and re-contend until cancelled or resigned."""
        try:
            while not self.resigned():
                await self._contend()
                if self._leading:
                    await self._hold()
                if self.resigned():
                    break
                await self._clock.sleep(self.retry_period_s)
        finally:
            self._step_down("stopped")

    def resigned(self) -> bool:
        """True once `resign` was called (a method, so that checks are never narrowed away)."""
        return self._resigned

    async def resign(self) -> None:
        """Stop leading and free the lease; `run()` then returns instead of contending.

        Backend errors propagate: the lease then simply expires after its duration.
        """
        self._resigned = True
        self._step_down("resigned")
        await self._backend.release(self.identity, self._clock.now())
        _log("lease_released", identity=self.identity)

    # -- the loop ---------------------------------------------------------------------------

    async def _contend(self) -> None:
        """One attempt to acquire; on success this replica leads from that attempt's start."""
        started = self._clock.monotonic()
        try:
            epoch = await self._try_acquire(self.renew_deadline_s)
        except Exception as exc:
            # Any failure of the backend, a bug in it included: contend again next period.
            self._failed("lease_acquire_failed", exc)
            return
        if epoch is None:
            return
        if self.resigned():
            # resign() ran while this attempt was in flight: give the lease straight back.
            await self._backend.release(self.identity, self._clock.now())
            return
        self._start_term(epoch, started)

    async def _hold(self) -> None:
        """Renew every retry period; return once this replica stepped down."""
        while self._leading:
            await self._clock.sleep(self.retry_period_s)
            if self.resigned() or not self._leading:
                return
            started = self._clock.monotonic()
            remaining = self._renewed_at + self.renew_deadline_s - started
            if remaining <= 0:
                self._step_down("renew_deadline_passed")
                return
            try:
                epoch = await self._try_acquire(remaining)
            except _Timeout:
                self.failures += 1
                self._step_down("renew_deadline_passed")
                return
            except Exception as exc:
                # Keep trying until the deadline: one failed renewal is not a lost lease.
                self._failed("lease_renew_failed", exc)
                continue
            if epoch is None:
                self._step_down("taken_by_another_holder")
                return
            if epoch != self._epoch:
                # The lease lapsed and was re-acquired (possibly by someone in between):
                # a new term with a new fencing epoch.
                self._step_down("epoch_changed")
                self._start_term(epoch, started)
                continue
            self._renewed_at = started

    async def _try_acquire(self, seconds: float) -> int | None:
        """One bounded acquire-or-renew call, stamped with the wall time of its start.

        A cancellation passes through: callers catch `Exception` only, never `CancelledError`.
        """
        call = self._backend.try_acquire(self.identity, self._clock.now(), self.lease_duration_s)
        return await self._bounded(call, seconds)

    def _failed(self, event: str, exc: Exception) -> None:
        """Count a failed backend call and log it as `event`, a warning."""
        self.failures += 1
        _log(event, level=logging.WARNING, identity=self.identity, error=repr(exc))

    def _start_term(self, epoch: int, started: float) -> None:
        self._leading = True
        self._epoch = epoch
        self._renewed_at = started
        self.terms += 1
        _log("leader_elected", identity=self.identity, epoch=epoch)
        if self._on_started is not None:
            _notify(self._on_started, epoch)

    def _step_down(self, reason: str) -> None:
        if not self._leading:
            return
        self._leading = False
        _log("leader_stepped_down", identity=self.identity, epoch=self._epoch, reason=reason)
        if self._on_stopped is not None:
            _notify(self._on_stopped)

    async def _bounded(self, call: Awaitable[T], seconds: float) -> T:
        """Await `call`, but give up after `seconds` of the clock (raises `_Timeout`).

        A hung backend call must not keep a leader leading: the wait is bounded on the
        injected clock, so it also holds on virtual time.
        """
        if getattr(self._clock, "loop_timers", False):
            # The clock is the loop's: one timer instead of two tasks and a wait.
            deadline = asyncio.timeout(seconds)
            try:
                async with deadline:
                    return await call
            except TimeoutError:
                if deadline.expired():
                    raise _Timeout(f"no answer within {seconds:g}s") from None
                raise
        try:
            return await within(self._clock, call, seconds)
        except DeadlinePassed:
            raise _Timeout(f"no answer within {seconds:g}s") from None


def _notify(callback: Callable[..., None], *args: int) -> None:
    try:
        callback(*args)
    except Exception as exc:
        _log("elector_callback_failed", level=logging.ERROR, error=repr(exc))
