"""What a session is, whichever client holds it: the claim it carries and when to renew.

`Session` (a thread renews) and `AsyncSession` (a task renews) only wait and send; what a
renewal's outcome means for the session is decided here, once.
"""

from __future__ import annotations

from stoker.sdk._errors import ClaimConflict, NotFound, StokerError
from stoker.sdk._models import ClaimInfo

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
    """A claimed worker: the latest claim, how renewals went and whether it was released."""

    def __init__(self, claim: ClaimInfo) -> None:
        self._claim = claim
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

    def _first_renewal(self) -> float:
        """Seconds until the first background renewal."""
        return renew_interval(self._claim.lease_s)

    def _renewed(self, renewed: ClaimInfo) -> float:
        """Take a renewal's answer; returns the seconds until the next renewal."""
        if self._released is None:
            self._claim = renewed
        self.renewal_error = None
        return renew_interval(renewed.lease_s)

    def _renewal_failed(self, error: StokerError) -> float | None:
        """Take a renewal's failure; returns the seconds until the next try, or None when
        renewing again is pointless."""
        self.renewal_error = error
        if isinstance(error, ClaimConflict | NotFound):
            # The session ended on the server; renewing again cannot bring it back.
            return None
        # Transient (server restarting, network): retry sooner, within the lease.
        return renew_interval(self._claim.lease_s) / 2
