"""The one error hierarchy of stoker. Each class maps to one HTTP status in `stoker.api`."""

from __future__ import annotations


class StokerError(Exception):
    """Base of every error stoker raises on purpose."""

    #: A stable machine-readable code, the last segment of the problem `type`.
    code = "error"


class InvalidRequest(StokerError):
    """The request is malformed or names something impossible (HTTP 400/422)."""

    code = "invalid-request"


class ConfigError(StokerError):
    """The configuration is invalid; the message names the key and the problem."""

    code = "invalid-config"


class NotFound(StokerError):
    """An unknown pool, claim or worker (HTTP 404)."""

    code = "not-found"


class Unauthorized(StokerError):
    """No token or an unknown token (HTTP 401)."""

    code = "unauthorized"


class Forbidden(StokerError):
    """A token acting for another org (HTTP 403)."""

    code = "forbidden"


class ClaimConflict(StokerError):
    """The claim is not in a state that allows the operation, e.g. renewing a released claim."""

    code = "claim-conflict"


class OrgCapError(StokerError):
    """The org holds as many workers of the pool as its cap allows (HTTP 429)."""

    code = "org-cap"

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class CapacityError(StokerError):
    """No worker became available within the claim's timeout (HTTP 503)."""

    code = "no-capacity"

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class Unavailable(StokerError):
    """The control plane cannot serve right now: shutting down, store down (HTTP 503)."""

    code = "unavailable"


class IllegalTransition(StokerError):
    """A worker state change that the transition table forbids (a programming error)."""

    code = "illegal-transition"


class StoreError(StokerError):
    """A durable write or read failed; the caller keeps its old state and retries later."""

    code = "store-error"


class RuntimeFailure(StokerError):
    """The runtime could not create, activate or stop a worker."""

    code = "runtime-failure"


class ActivationRejected(RuntimeFailure):
    """The worker refused the activation (HTTP 409 from the worker: second org, stale epoch)."""

    code = "activation-rejected"
