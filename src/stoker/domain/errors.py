"""The one error hierarchy of stoker. Each class maps to one HTTP status in `stoker.api`."""

from __future__ import annotations


def one_line(text: str) -> str:
    """`text` as a one-line message shows it: quoted when it holds a control character (a
    path with a line break in it would split the message's one line)."""
    return text if text.isprintable() else repr(text)


class StokerError(Exception):
    """Base of every error stoker raises on purpose."""

    #: A stable machine-readable code, the last segment of the problem `type`.
    code = "error"

    def __init_subclass__(cls, *, code: str | None = None, **kwargs: object) -> None:
        # The code is a class keyword (`class NotFound(StokerError, code="not-found")`),
        # so each error is declared in two lines; a subclass without one inherits its base's.
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code


class InvalidRequest(StokerError, code="invalid-request"):
    """The request is malformed or names something impossible (HTTP 400/422)."""


class ConfigError(StokerError, code="invalid-config"):
    """The configuration is invalid; the message names the key and the problem."""


class NotFound(StokerError, code="not-found"):
    """An unknown pool, claim or worker (HTTP 404)."""


def unknown_claim(claim_id: str) -> str:
    """The one detail of a 404 for a claim, whether it does not exist or is another org's."""
    return f"unknown claim {claim_id!r}"


class Unauthorized(StokerError, code="unauthorized"):
    """No token or an unknown token (HTTP 401)."""


class Forbidden(StokerError, code="forbidden"):
    """A token acting for another org (HTTP 403)."""


class ClaimConflict(StokerError, code="claim-conflict"):
    """The claim is not in a state that allows the operation, e.g. renewing a released claim."""


class IdempotencyKeyReused(InvalidRequest, code="idempotency-key-reused"):
    """An `Idempotency-Key` sent again with a different request (HTTP 422)."""


class ClaimKeyTaken(ClaimConflict, code="idempotency-key-taken"):
    """The store holds a claim with this org's `Idempotency-Key` already: another request
    with the key bound first (the caller answers with that claim)."""


class RolloutEnded(StokerError, code="rollout-ended"):
    """An action on a rollout that has ended (promoted, rolled back, aborted, superseded)."""


class OrgCapError(StokerError, code="org-cap"):
    """The org holds as many workers of the pool as its cap allows (HTTP 429)."""

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class CapacityError(StokerError, code="no-capacity"):
    """No worker became available within the claim's timeout (HTTP 503)."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class Unavailable(StokerError, code="unavailable"):
    """The control plane cannot serve right now: shutting down, store down (HTTP 503)."""


class IllegalTransition(StokerError, code="illegal-transition"):
    """A worker state change that the transition table forbids (a programming error)."""


class StoreError(StokerError, code="store-error"):
    """A durable write or read failed; the caller keeps its old state and retries later."""


class RuntimeFailure(StokerError, code="runtime-failure"):
    """The runtime could not create, activate or stop a worker."""


class ActivationRejected(RuntimeFailure, code="activation-rejected"):
    """The worker refused the activation (HTTP 409 from the worker: second org, stale epoch)."""


class SpawnWithdrawn(RuntimeFailure, code="spawn-withdrawn"):
    """A spawn queued in the runtime was withdrawn before it started (its worker was
    stopped, or the runtime closed): nothing was started and nothing failed."""
