"""Exceptions of the SDK: one per kind of answer, each carrying the problem details."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx


class StokerError(Exception):
    """Base of every SDK error. `status` is the HTTP status (0 when no answer came) and
    `problem` the RFC 9457 problem body the server sent (empty when none)."""

    def __init__(
        self, message: str, *, status: int = 0, problem: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.problem: dict[str, Any] = dict(problem or {})

    @property
    def code(self) -> str:
        """The problem's machine-readable code (`no-capacity`, `org-cap`, ...), or ''."""
        return str(self.problem.get("code", ""))

    @property
    def detail(self) -> str:
        """The problem's human-readable detail."""
        return str(self.problem.get("detail", self))


class InvalidRequest(StokerError):
    """400, 413 or 422: the request was malformed or out of bounds."""


class Unauthorized(StokerError):
    """401: no token, or an unknown one."""


class Forbidden(StokerError):
    """403: the token acts for another org, or an admin token is needed."""


class NotFound(StokerError):
    """404: unknown pool or claim."""


class ClaimConflict(StokerError):
    """409: the claim is not in a state that allows this (e.g. renewing a released claim)."""


class PoolInUse(StokerError):
    """409 of `delete_pool`: the pool may not be deleted now; `reason` says why."""

    @property
    def reason(self) -> str:
        """`not_draining`, `in_use` (see `live_workers`, `open_claims`), `rollout_active`,
        or `in_config` (the server's config file declares the pool)."""
        return str(self.problem.get("reason", ""))

    @property
    def live_workers(self) -> int:
        """The pool's live workers when the deletion was refused (0 if not said)."""
        return int(self.problem.get("live_workers") or 0)

    @property
    def open_claims(self) -> int:
        """The pool's open claims when the deletion was refused (0 if not said)."""
        return int(self.problem.get("open_claims") or 0)


class StaleGeneration(StokerError):
    """412: the pool changed since the generation a change was made from; read it again."""


class _RetryLater(StokerError):
    """An answer that says when to try again: after `retry_after` seconds (0 when the
    server did not say). `STATUS` is the status the error has when none is given."""

    STATUS = 0

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        problem: Mapping[str, Any] | None = None,
        retry_after: float = 0.0,
    ) -> None:
        super().__init__(message, status=self.STATUS if status is None else status, problem=problem)
        self.retry_after = retry_after


class OrgCapError(_RetryLater):
    """429: the org holds as many workers as its cap allows; retry after `retry_after` s."""

    STATUS = 429


class CapacityError(StokerError):
    """503: no worker became available within the claim's timeout; `reason` says why."""

    @property
    def reason(self) -> str:
        """`no_capacity` or `pool_cap`."""
        return str(self.problem.get("reason", ""))


class Unavailable(_RetryLater):
    """503: the server cannot serve right now (starting, shutting down, store down); the
    server's `Retry-After` is `retry_after` (0 when it sent none)."""

    STATUS = 503

    @property
    def reason(self) -> str:
        """`shutting_down`, `starting`, `store_unavailable`, ..."""
        return str(self.problem.get("reason", ""))


class SessionLost(StokerError):
    """A session ended without its holder releasing it: the lease expired, the worker
    died, the claim failed, or the server no longer knows the claim. `claim_id` names it;
    the error that showed it is the `__cause__`."""

    def __init__(self, message: str, *, claim_id: str, cause: StokerError | None = None) -> None:
        super().__init__(
            message,
            status=cause.status if cause else 0,
            problem=cause.problem if cause else None,
        )
        self.claim_id = claim_id
        self.__cause__ = cause


class ServerError(StokerError):
    """Another 5xx: a fault in the server."""


class ServerUnreachable(StokerError):
    """No answer: the server is not running at that URL, or it did not answer in time."""


_BY_STATUS: dict[int, type[StokerError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    405: InvalidRequest,
    409: ClaimConflict,
    412: StaleGeneration,
    413: InvalidRequest,
    415: InvalidRequest,
    422: InvalidRequest,
}


def error_from_response(response: httpx.Response) -> StokerError:
    """The exception for a non-2xx answer."""
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = None
    problem: dict[str, Any] = body if isinstance(body, dict) else {}
    if response.is_redirect:
        # The API never redirects: another server answers at that URL, or a path is off.
        where = response.headers.get("location", "elsewhere")
        return StokerError(
            f"{status} {response.reason_phrase}: the server sent {response.request.url.path} "
            f"to {where}; is the URL the base URL of the stoker API?",
            status=status,
        )
    detail = str(problem.get("detail") or response.reason_phrase or f"HTTP {status}")
    message = f"{status} {problem.get('title') or response.reason_phrase}: {detail}"
    if status == 429:
        return OrgCapError(message, problem=problem, retry_after=_retry_after(response, problem))
    if status == 503:
        if problem.get("code") == "no-capacity":
            return CapacityError(message, status=status, problem=problem)
        retry_after = _retry_after(response, problem)
        return Unavailable(message, status=status, problem=problem, retry_after=retry_after)
    if status >= 500:
        return ServerError(message, status=status, problem=problem)
    if status == 409 and problem.get("code") == "pool-in-use":
        return PoolInUse(message, status=status, problem=problem)
    cls = _BY_STATUS.get(status, StokerError)
    return cls(message, status=status, problem=problem)


def _retry_after(response: httpx.Response, problem: Mapping[str, Any]) -> float:
    value = problem.get("retry_after")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    header = response.headers.get("retry-after", "")
    try:
        return float(header)
    except ValueError:
        return 0.0
