"""Problem details (RFC 9457): the one mapping from stoker's errors to HTTP answers.

Every error the API returns goes through `problem_response`, with `application/problem+json`
as its media type: domain errors by `STATUS_OF`, request validation as 422, malformed JSON
as 400, routing as 404/405, oversized bodies as 413. Nothing here ever puts a traceback or
the offending input into a response.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from stoker.config.problems import ConfigProblems
from stoker.domain import errors
from stoker.domain.pools import InvalidSettings, PoolInUse, SameTemplate, StaleGeneration

PROBLEM_JSON = "application/problem+json"

#: HTTP status of each error class; the most specific class in the MRO wins.
STATUS_OF: dict[type[errors.StokerError], int] = {
    errors.InvalidRequest: 400,
    errors.IdempotencyKeyReused: 422,
    # Pool settings that are each valid but do not fit together (warm_target > max_workers).
    InvalidSettings: 422,
    errors.Unauthorized: 401,
    errors.Forbidden: 403,
    errors.NotFound: 404,
    errors.ClaimConflict: 409,
    errors.RolloutEnded: 409,
    # A rollout of the template the pool serves or rolls out already.
    SameTemplate: 409,
    # A deletion of a pool that is not drained, still used, rolling out or in the config.
    PoolInUse: 409,
    # A write of a pool from a generation it has moved past (`If-Match` is stale).
    StaleGeneration: 412,
    errors.OrgCapError: 429,
    errors.CapacityError: 503,
    errors.Unavailable: 503,
    # A store or runtime that fails under a request is an outage, not the caller's fault;
    # 503 tells a client that the same request may succeed later.
    errors.StoreError: 503,
    errors.RuntimeFailure: 503,
    errors.ConfigError: 500,
    errors.IllegalTransition: 500,
    errors.StokerError: 500,
}

#: `code` of the problems that do not come from a domain error.
CODE_OF_STATUS = {
    400: "malformed-request",
    401: "unauthorized",
    403: "forbidden",
    404: "not-found",
    405: "method-not-allowed",
    412: "stale-generation",
    413: "body-too-large",
    415: "unsupported-media-type",
    422: "invalid-request",
    500: "internal-error",
}


def status_of(exc: errors.StokerError) -> int:
    """The HTTP status of a domain error."""
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return 500


def problem_body(status: int, code: str, detail: str, **extra: Any) -> dict[str, Any]:
    """The JSON members of one problem."""
    body: dict[str, Any] = {
        "type": f"urn:stoker:problem:{code}",
        "title": title(status),
        "status": status,
        "detail": detail,
        "code": code,
    }
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


def title(status: int) -> str:
    """The reason phrase of `status` (the problem `title`)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def problem_response(
    status: int,
    code: str,
    detail: str,
    *,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> Response:
    """A `application/problem+json` response."""
    content = json.dumps(problem_body(status, code, detail, **extra), ensure_ascii=False)
    return Response(content, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def problem_bytes(status: int, code: str, detail: str, **extra: Any) -> bytes:
    """The encoded body of one problem (for answers sent below the framework)."""
    return json.dumps(problem_body(status, code, detail, **extra), ensure_ascii=False).encode()


def openapi_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the problem answers a route may give."""
    ref = {"$ref": "#/components/schemas/Problem"}
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {
            "description": title(status),
            "content": {PROBLEM_JSON: {"schema": ref}},
        }
        if status == 429:
            entry["headers"] = {
                "Retry-After": {
                    "description": "Seconds after which a retry may succeed.",
                    "schema": {"type": "integer"},
                }
            }
        out[status] = entry
    return out


def from_domain(exc: errors.StokerError) -> Response:
    """The answer to a domain error."""
    status = status_of(exc)
    headers: dict[str, str] = {}
    extra: dict[str, Any] = {}
    if isinstance(exc, errors.OrgCapError):
        # Retry-After takes whole seconds; round up so a client never retries too early.
        seconds = max(1, math.ceil(exc.retry_after))
        headers["Retry-After"] = str(seconds)
        extra["retry_after"] = round(exc.retry_after, 3)
    elif status == 503:
        extra["reason"] = reason_of(exc)
    elif isinstance(exc, errors.Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    elif isinstance(exc, PoolInUse):
        extra["reason"] = exc.reason
        if exc.reason == "in_use":
            extra.update(live_workers=exc.live_workers, open_claims=exc.open_claims)
    if status == 503:
        # A worker may free up any moment; a store, a runtime or a restart takes longer.
        headers["Retry-After"] = "1" if isinstance(exc, errors.CapacityError) else "5"
    detail = str(exc) if status < 500 or status == 503 else "internal error"
    return problem_response(status, exc.code, detail, headers=headers, **extra)


def reason_of(exc: errors.StokerError) -> str | None:
    """Why a claim was refused, as the problem's `reason` says (None for a client error)."""
    if isinstance(exc, errors.OrgCapError):
        return "org_cap"
    if isinstance(exc, errors.CapacityError):
        return exc.reason
    if isinstance(exc, errors.Unavailable):
        return "shutting_down" if "shutting down" in str(exc) else "unavailable"
    if isinstance(exc, errors.StoreError):
        return "store_unavailable"
    if isinstance(exc, errors.RuntimeFailure):
        return "runtime_unavailable"
    return None


async def handle_domain_error(request: Request, exc: Exception) -> Response:
    """Exception handler for `StokerError`."""
    assert isinstance(exc, errors.StokerError)
    return from_domain(exc)


async def handle_http_error(request: Request, exc: Exception) -> Response:
    """Exception handler for routing and framework errors (404, 405, 400, 413, ...)."""
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
    if status == 404 and detail == "Not Found":
        detail = f"no route for {request.url.path!r}"
    elif status == 405 and detail == "Method Not Allowed":
        detail = f"{request.method} is not allowed on {request.url.path!r}"
    elif status == 400 and detail == "There was an error parsing the body":
        detail = "the body is not valid JSON"
    code = CODE_OF_STATUS.get(status, "error")
    return problem_response(status, code, detail, headers=exc.headers)


async def handle_validation_error(request: Request, exc: Exception) -> Response:
    """Exception handler for request validation: 400 for broken JSON, else 422."""
    assert isinstance(exc, RequestValidationError)
    raw = each_problem(exc.errors())
    if any(e.get("type") == "json_invalid" for e in raw):
        return problem_response(400, "malformed-request", "the body is not valid JSON")
    return problem_response(
        422,
        "invalid-request",
        _summary(raw),
        errors=[
            {
                "loc": [p if isinstance(p, int) else str(p) for p in e.get("loc", ())],
                "msg": plain_message(e),
                "type": str(e.get("type", "")),
            }
            for e in raw[:20]
        ],
    )


def each_problem(raw: Sequence[Any]) -> list[Any]:
    """`raw`, with the problems a model raised together (`ConfigProblems`: a rollout
    strategy's) each at its own field (`strategy.steps.1`), as the other errors are."""
    out: list[Any] = []
    for error in raw:
        cause = (error.get("ctx") or {}).get("error")
        if not isinstance(cause, ConfigProblems):
            out.append(error)
            continue
        for loc, message in cause.problems:
            out.append({**error, "loc": (*error.get("loc", ()), *loc), "ctx": {"error": message}})
    return out


def _summary(raw: Sequence[Any]) -> str:
    if not raw:
        return "the request is invalid"
    first = raw[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    more = f" (and {len(raw) - 1} more)" if len(raw) > 1 else ""
    return f"{loc or 'body'}: {plain_message(first)}{more}"


#: The words of each validation error type, free of the framework's (its `msg` begins
#: "Input should be", "Value error, ", "Field required"): a client may show them as they
#: are, and they do not change when the framework rewords its own. `{name}`: the
#: error's context value of that name.
PLAIN_MESSAGES = {
    "missing": "is required",
    "extra_forbidden": "is not a known field",
    "string_type": "must be a string",
    "float_type": "must be a number",
    "int_type": "must be a whole number",
    "float_parsing": "must be a number",
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "bool_type": "must be true or false",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "list_type": "must be an array",
    "too_short": "must have at least {min_length} item(s)",
    "too_long": "must have at most {max_length} item(s)",
    "string_pattern_mismatch": "must match {pattern}",
    "bool_parsing": "must be true or false",
    "missing_argument": "is required",
    "unexpected_keyword_argument": "is not a known field",
    "finite_number": "must be a finite number",
    "enum": "must be one of {expected}",
    "literal_error": "must be one of {expected}",
    "greater_than_equal": "must be at least {ge}",
    "greater_than": "must be greater than {gt}",
    "less_than_equal": "must be at most {le}",
    "less_than": "must be less than {lt}",
    "string_too_short": "must have at least {min_length} characters",
    "string_too_long": "must have at most {max_length} characters",
    "json_invalid": "is not valid JSON",
}
#: How the framework's messages begin, and what a plain one says instead.
_PREFIXES = (
    ("Value error, ", ""),
    ("Assertion failed, ", ""),
    ("Input should be ", "must be "),
    ("Input should ", "must "),
)


def plain_message(error: Mapping[str, Any]) -> str:
    """The message of one validation error in stoker's words (see `PLAIN_MESSAGES`)."""
    kind = str(error.get("type", ""))
    ctx = error.get("ctx") or {}
    if kind == "value_error" and "error" in ctx:
        return str(ctx["error"])
    if kind == "string_too_short" and ctx.get("min_length") == 1:
        return "must not be empty"
    template = PLAIN_MESSAGES.get(kind)
    if template is not None:
        try:
            return template.format(**{k: _shown(v) for k, v in ctx.items()})
        except (KeyError, IndexError, ValueError):
            pass
    message = str(error.get("msg", "")) or "is invalid"
    for prefix, plain in _PREFIXES:
        if message.startswith(prefix):
            return plain + message.removeprefix(prefix)
    return message


def _shown(value: Any) -> str:
    """A bound as a client wrote it: 0, not 0.0."""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    """Last resort: a 500 problem without any detail of the failure (it is logged)."""
    return problem_response(500, "internal-error", "internal error")
