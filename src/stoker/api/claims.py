"""The claim routes: the path every session takes.

`POST /v1/claims`, `GET` and `DELETE /v1/claims/{id}` and `POST /v1/claims/{id}/renew`, each
written once as an endpoint (parse: its signature; call: the plane; render: `ClaimOut`).
They are `DirectRoute`s (`stoker.api.routing`): routes of the app like any other, behind
its middleware and in its OpenAPI document, whose plain requests skip the framework's
request handling.

Where a claim enters over HTTP: `POST /v1/claims` -> `ControlPlane.claim`. The handler
watches the connection while the claim waits; a client that disconnects cancels the claim,
which takes the pool manager's abandonment path (a worker reserved for it goes back to
`warm` or to its org's `hot_idle`), so a vanished client leaves nothing behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Body, FastAPI, Path
from pydantic import AfterValidator
from starlette.requests import Request
from starlette.responses import Response

from stoker.api.asgi import ApiState, Principal, Receive, principal_of
from stoker.api.models import ClaimCreate, ClaimOut, ClaimRenew, ModelResponse
from stoker.api.problems import openapi_responses, reason_of, status_of
from stoker.api.routing import DirectRoute
from stoker.control import logs
from stoker.control.plane import ControlPlane
from stoker.domain import idempotency
from stoker.domain.errors import (
    InvalidRequest,
    NotFound,
    OrgCapError,
    StokerError,
    Unavailable,
    unknown_claim,
)
from stoker.domain.records import Claim, ClaimRequest

PREFIX = "/v1/claims"
#: The header that makes a claim idempotent (lower-case, as ASGI spells headers).
IDEMPOTENCY_KEY = "idempotency-key"
IDEMPOTENCY_KEY_PARAMETER: dict[str, Any] = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": (
        "A key that names this claim (e.g. a UUID4), unique per org: a request with a key "
        "already used by the org gets that claim (200, `Idempotent-Replayed: true`, with "
        "its token while bound) instead of a second worker; the same key with another "
        "body (pool, mode, lease_s, ttl_s, config) is 422 `idempotency-key-reused`."
    ),
    "schema": {"type": "string", "minLength": 1, "maxLength": idempotency.KEY_MAX},
}
#: Longest claim id a path may carry.
CLAIM_ID_MAX = 128


def _not_a_route(claim_id: str) -> str:
    """`log` names the claim log's route (`api.ledger`), never a claim."""
    if claim_id == "log":
        raise ValueError("log is not a claim id")
    return claim_id


ClaimId = Annotated[str, Path(min_length=1, max_length=CLAIM_ID_MAX), AfterValidator(_not_a_route)]
Endpoint = Callable[..., Any]


def add_claim_routes(app: FastAPI, plane: ControlPlane, state: ApiState) -> None:
    """Register the four claim routes of `plane` on `app`."""

    def route(
        method: str,
        path: str,
        summary: str,
        *problems: int,
        status: int = 200,
        openapi_extra: dict[str, Any] | None = None,
        answers: dict[int | str, dict[str, Any]] | None = None,
    ) -> Callable[[Endpoint], Endpoint]:
        """Register the endpoint it decorates; `problems`: the error statuses it may answer,
        `answers`: success statuses besides `status`."""

        def register(endpoint: Endpoint) -> Endpoint:
            app.router.add_api_route(
                PREFIX + path,
                endpoint,
                methods=[method],
                route_class_override=DirectRoute,
                status_code=status,
                response_model=ClaimOut,
                responses={**(answers or {}), **openapi_responses(*problems)},
                tags=["claims"],
                summary=summary,
                operation_id=endpoint.__name__,
                openapi_extra=openapi_extra,
            )
            return endpoint

        return register

    @route(
        "POST",
        "",
        "Claim a worker",
        400,
        401,
        403,
        404,
        409,
        413,
        415,
        422,
        429,
        503,
        status=201,
        openapi_extra={"parameters": [IDEMPOTENCY_KEY_PARAMETER]},
        answers={
            200: {
                "model": ClaimOut,
                "description": "A repeat of an earlier request with the same Idempotency-Key: "
                "its claim (header `Idempotent-Replayed: true`)",
            }
        },
    )
    async def create_claim(request: Request, body: ClaimCreate) -> Response:
        """Bind a worker of `pool` to `org`: reuse, then warm, then (by mode) a cold spawn.

        Waits up to `timeout_s` for a worker; 503 when none came, 429 when the org holds
        its cap. A client that disconnects while waiting cancels the claim. With an
        `Idempotency-Key`, a request that repeats an earlier one gets its claim (200,
        `Idempotent-Replayed: true`) instead of a second worker.
        """
        key = request.headers.get(IDEMPOTENCY_KEY)
        started = plane.clock.monotonic()
        try:
            req = claim_request(principal_of(request.scope), state, body, key)
            # A client's `traceparent` makes the claim's span a child of its own.
            with plane.tracer.continued(request.headers):
                outcome = await claim_while_connected(plane, req, request.receive, state)
        except StokerError as exc:
            log_refusal(body, exc, plane.clock.monotonic() - started)
            raise
        if outcome is None:
            # Nobody is listening any more; the status only shows in access logs.
            logs.event(
                "claim_abandoned",
                pool=body.pool,
                org=body.org,
                waited_s=round(plane.clock.monotonic() - started, 3),
            )
            return Response(status_code=499)
        claim, replayed = outcome
        answer = ModelResponse(
            ClaimOut.of(claim, new=True), 200 if replayed else 201, location=f"{PREFIX}/{claim.id}"
        )
        if replayed:
            answer.raw_headers.append((b"idempotent-replayed", b"true"))
        return answer

    @route("GET", "/{claim_id}", "Get a claim", 401, 404, 422, 503)
    async def get_claim(request: Request, claim_id: ClaimId) -> Response:
        """The claim, in any state (bound, released, expired, failed)."""
        claim = await plane.get_claim(claim_id)
        check_visible(principal_of(request.scope), claim)
        return ModelResponse(ClaimOut.of(claim))

    @route(
        "POST", "/{claim_id}/renew", "Renew a claim's lease", 400, 401, 404, 409, 413, 415, 422, 503
    )
    async def renew_claim(
        request: Request,
        claim_id: ClaimId,
        body: Annotated[ClaimRenew | None, Body()] = None,
    ) -> Response:
        """Extend the lease by `lease_s` (default: the claim's own) from now, never past the
        pool's or org's `max_claim_s`; 409 once ended, or once the claim reached its
        `max_claim_s` (the claim then ends)."""
        await check_owner(plane, principal_of(request.scope), claim_id)
        lease_s = body.lease_s if body is not None else None
        return ModelResponse(ClaimOut.of(await plane.renew(claim_id, lease_s)))

    @route("DELETE", "/{claim_id}", "Release a claim", 401, 404, 422, 503)
    async def release_claim(request: Request, claim_id: ClaimId) -> Response:
        """End the session: the worker parks as hot_idle (reuse: same_org) or retires.

        Releasing a claim that already ended returns it unchanged.
        """
        await check_owner(plane, principal_of(request.scope), claim_id)
        return ModelResponse(ClaimOut.of(await plane.release(claim_id)))


def log_refusal(body: ClaimCreate, exc: StokerError, waited_s: float) -> None:
    """One `claim_refused` line for a claim answered 429 or 503 (a client's own mistake,
    4xx, is the access log's business): its pool, org, status and reason, never a token."""
    status = status_of(exc)
    if status not in (429, 503):
        return
    logs.event(
        "claim_refused",
        level=logs.WARNING if status == 503 else logs.INFO,
        pool=body.pool,
        org=body.org,
        status=status,
        reason=reason_of(exc),
        waited_s=round(waited_s, 3),
        retry_after_s=round(exc.retry_after, 3) if isinstance(exc, OrgCapError) else None,
    )


async def check_owner(plane: ControlPlane, principal: Principal, claim_id: str) -> None:
    """Raise unless `principal` may act on the claim."""
    # An admin may act on any claim: the plane's own lookup answers 404 for a missing one,
    # so only an org token costs a read here.
    if not principal.admin:
        check_visible(principal, await plane.get_claim(claim_id))


def check_visible(principal: Principal, claim: Claim) -> None:
    """Raise `NotFound` unless `principal` may see `claim`: to another org's token a claim
    id answers exactly as an unknown one would, so it learns nothing of who owns it."""
    if not principal.admin and principal.org != claim.org:
        raise NotFound(unknown_claim(claim.id))


def claim_request(
    principal: Principal, state: ApiState, body: ClaimCreate, key: str | None = None
) -> ClaimRequest:
    """The plane's request for `body` (and the `Idempotency-Key` header's value, if any),
    once `principal` may claim for its org and the server still takes claims."""
    principal.check_org(body.org)
    if key is not None:
        problem = idempotency.check_key(key)
        if problem is not None:
            raise InvalidRequest(problem)
    if state.draining:
        raise Unavailable("control plane is shutting down")
    return ClaimRequest(
        pool=body.pool,
        org=body.org,
        mode=body.mode,
        timeout_s=body.timeout_s,
        lease_s=body.lease_s,
        ttl_s=body.ttl_s,
        config=body.config,
        idempotency_key=key,
    )


async def claim_while_connected(
    plane: ControlPlane, req: ClaimRequest, receive: Receive, state: ApiState
) -> tuple[Claim, bool] | None:
    """`plane.claim_once(req)`, cancelled if the client disconnects first (None then).

    The claim runs in this request's own task; a watcher task cancels it when the client
    goes, which is the pool manager's abandonment path (cheaper than running the claim in
    a task of its own: this is the hot path). A claim that was bound just as the client
    left is released at once. A claim the server cancels because its shutdown grace ended
    raises `Unavailable` (503 `shutting_down`) instead of leaving the server a bare 500.
    """
    task = asyncio.current_task()
    assert task is not None
    gone = asyncio.ensure_future(_cancel_on_disconnect(receive, task))
    try:
        claim, replayed = await plane.claim_once(req)
    except asyncio.CancelledError:
        if gone.done() and not gone.cancelled() and gone.result():
            # Our own watcher cancelled the claim: the request ends here, quietly.
            task.uncancel()
            return None
        if state.draining:
            # The server cancels the requests still running when its shutdown grace ends;
            # the client still gets an answer it can act on.
            task.uncancel()
            raise Unavailable(
                "control plane is shutting down: the claim was still waiting when the "
                "shutdown grace ended"
            ) from None
        raise
    finally:
        gone.cancel()
    if gone.done() and not gone.cancelled() and gone.result():
        if not replayed:
            # A replayed claim was the earlier request's; its client may still retry.
            await plane.release(claim.id)
        return None
    return claim, replayed


async def _cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any]) -> bool:
    """Cancel `task` when the client disconnects (the body was read before the handler)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            task.cancel()
            return True
