"""What a session is, whichever client holds it: the claim it carries and when to renew.

`Session` (a thread renews) and `AsyncSession` (a task renews) only wait and send; what a
renewal's outcome means for the session is decided here, once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from stoker.sdk._errors import ClaimConflict, NotFound, SessionLost, StokerError
from stoker.sdk._models import ClaimInfo
from stoker.sdk._retry import now

log = logging.getLogger("stoker.sdk")

#: What a session calls, once, when it is lost (from the thread or task that renews it).
OnLost = Callable[[SessionLost], object]

#: Renew when this fraction of the lease has passed.
RENEW_FRACTION = 1 / 3
#: Never renew more often than this (a lease of 1 s still leaves room for a slow answer).
MIN_RENEW_INTERVAL_S = 0.05


def renew_interval(lease_s: float) -> float:
    """How long to wait before renewing a lease of `lease_s`."""
    return max(MIN_RENEW_INTERVAL_S, lease_s * RENEW_FRACTION)


def release_note(claim_id: str, error: StokerError) -> str:
    """The note a failed release leaves on the exception that ended the session's block
    (the block's own exception matters more than the release's)."""
    return f"stoker: releasing claim {claim_id} failed too: {error}"


class SessionState:
    """A claimed worker: the latest claim, how renewals went and whether it was released
    or lost.

    A session is *lost* when it ended without its holder releasing it: a renewal answered
    that the claim ended (lease expired, worker died, claim failed: 409) or is unknown
    (404: e.g. the server's store was reset), or renewals kept failing until the lease
    ran out. Then `lost` holds a `SessionLost`, the `on_lost` callback (if any) is called
    with it once, `check()` raises it, and leaving the session's `with` block raises it
    (or, when the block raised, adds a note to that exception).
    """

    def __init__(
        self, claim: ClaimInfo, on_lost: OnLost | None = None, clock: Callable[[], float] = now
    ) -> None:
        self._claim = claim
        self._now = clock
        #: When the lease runs out, by `clock` (monotonic; counted from when the answer
        #: came, so never later than the server's).
        self._expires = clock() + claim.lease_s
        self._on_lost = on_lost
        #: Set once the session is lost (see the class docstring).
        self.lost: SessionLost | None = None
        #: Only the claim's answer carries the token: later reads of the claim do not.
        self._token = claim.worker.token
        self._released: ClaimInfo | None = None
        #: The last renewal failure (None while renewals succeed). A `ClaimConflict` or
        #: `NotFound` here means the session ended on the server (lease expired, worker lost).
        self.renewal_error: StokerError | None = None

    @property
    def claim(self) -> ClaimInfo:
        """The latest state of the claim (updated by each renewal)."""
        return self._claim

    @property
    def id(self) -> str:
        """The claim id."""
        return self._claim.id

    @property
    def endpoint(self) -> str:
        """Base URL of the worker."""
        return self._claim.worker.endpoint

    @property
    def token(self) -> str | None:
        """The session token the worker demands."""
        return self._token

    @property
    def worker_id(self) -> str:
        """The worker's id."""
        return self._claim.worker.id

    @property
    def headers(self) -> dict[str, str]:
        """Headers that authenticate a request to the worker."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def check(self) -> None:
        """Raise `SessionLost` if the session was lost (see the class docstring)."""
        if self.lost is not None:
            raise self.lost

    def _first_renewal(self) -> float:
        """Seconds until the first background renewal."""
        return renew_interval(self._claim.lease_s)

    def _lease_left(self) -> float:
        """Seconds until the lease runs out unless renewed: a renewal's deadline."""
        return self._expires - self._now()

    def _renewed(self, renewed: ClaimInfo, sent_at: float) -> float:
        """Take a renewal's answer (to a renewal sent at `sent_at`); returns the seconds
        until the next renewal."""
        if self._released is None:
            self._claim = renewed
        self._expires = sent_at + renewed.lease_s
        self.renewal_error = None
        return renew_interval(renewed.lease_s)

    def _renewal_failed(self, error: StokerError) -> float | None:
        """Take a renewal's failure; returns the seconds until the next try, or None when
        renewing again is pointless (the session is lost)."""
        self.renewal_error = error
        left = self._lease_left()
        if isinstance(error, ClaimConflict | NotFound) or left <= 0:
            # The session ended on the server; renewing again cannot bring it back.
            self._lose(error)
            return None
        # Transient (server restarting, network): retry sooner, within the lease.
        return max(MIN_RENEW_INTERVAL_S, min(renew_interval(self._claim.lease_s), left) / 2)

    def _lose(self, error: StokerError) -> None:
        if self.lost is not None or self._released is not None:
            return
        why = "its lease ran out" if self._lease_left() <= 0 else "the server ended it"
        self.lost = SessionLost(
            f"session of claim {self.id} was lost ({why}): {error}", claim_id=self.id, cause=error
        )
        if self._on_lost is not None:
            try:
                self._on_lost(self.lost)
            except Exception:
                # The renewing thread or task must not die of the application's callback.
                log.exception("stoker: on_lost callback of claim %s raised", self.id)

    def _exit_error(self, exc: BaseException | None, release_error: StokerError | None) -> None:
        """What leaving the session's block raises, once the release was tried."""
        if self.lost is not None:
            if exc is None:
                raise self.lost
            exc.add_note(f"stoker: {self.lost}")
            return
        if release_error is not None:
            if exc is None:
                raise release_error
            exc.add_note(release_note(self.id, release_error))
