"""When the SDK sends a call again: back-off with jitter, `Retry-After`, a total deadline.

A call is sent again when it got no answer (connection refused or reset, no answer in
time), a 429 (the org's cap) or a 503 other than "no capacity" (the server is starting,
shutting down, or its store is down). Every call of the API is safe to send twice: reads,
renewals and releases are idempotent, and a claim carries an `Idempotency-Key` that the
server answers with the same claim. A 503 "no capacity" is not retried: the claim already
waited its whole timeout.

The waits are "full jitter" back-off (a random wait up to `backoff_s * 2**attempt`, capped
at `max_backoff_s`), never shorter than the server's `Retry-After`, and a call gives up
when the next try would start past its deadline: it raises the last error.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from stoker.sdk._errors import OrgCapError, ServerUnreachable, StokerError, Unavailable


def now() -> float:
    """Monotonic seconds: the SDK runs in applications, which have no clock of stoker's."""
    return time.monotonic()


@dataclass(frozen=True, slots=True)
class Retries:
    """How calls are retried. `deadline_s` bounds a call with its retries (a claim: its
    wait plus this; a background renewal: what is left of the lease)."""

    deadline_s: float = 30.0
    backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    #: No retries at all (each call is sent once).
    enabled: bool = True

    def delay(
        self, attempt: int, error: StokerError, left: float, rng: random.Random | None = None
    ) -> float | None:
        """Seconds to wait before try `attempt + 1` after `error`, with `left` seconds to
        the call's deadline; None to give up."""
        if not self.enabled or not retryable(error):
            return None
        cap = min(self.max_backoff_s, self.backoff_s * 2.0**attempt)
        wait = (rng or random).uniform(0.0, cap)
        hint = retry_after(error)
        if hint is not None:
            wait = max(wait, hint)
        return wait if wait < left else None


def retryable(error: StokerError) -> bool:
    """True for an error that another try may not meet."""
    return isinstance(error, ServerUnreachable | OrgCapError | Unavailable)


def retry_after(error: StokerError) -> float | None:
    """The server's `Retry-After` for `error`, in seconds, if it sent one."""
    value = getattr(error, "retry_after", None)
    return float(value) if isinstance(value, int | float) and value > 0 else None
