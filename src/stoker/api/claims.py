"""The claim routes, served below the framework: the path every session takes.

`POST /v1/claims`, `GET` and `DELETE /v1/claims/{id}` and `POST /v1/claims/{id}/renew` are
answered here, behind `Guard` and in front of the FastAPI app, without the framework's
routing, dependency solving and middleware (about a sixth of the server's time in a
claim + release cycle). They validate with the same pydantic models, call the same plane
methods and answer with the same bodies as the FastAPI routes, which stay registered and
describe them in the OpenAPI document.

What this layer does not take as given goes on to the FastAPI app unchanged, its body
replayed: another content type, a body that is not JSON or does not validate, a path that is
not a plain claim id. Every 400/422 answer is therefore the framework's own.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.exceptions import HTTPException

from stoker.api import problems
from stoker.api.asgi import (
    CLAIM_ID_MAX,
    ApiState,
    ASGIApp,
    Message,
    Principal,
    Receive,
    Scope,
    Send,
    principal_of,
    send_body,
    send_problem,
)
from stoker.api.models import ClaimCreate, ClaimOut, ClaimRenew
from stoker.control.plane import ControlPlane
from stoker.domain.errors import StokerError, Unavailable
from stoker.domain.records import Claim, ClaimRequest

logger = logging.getLogger("stoker.api")

PREFIX = "/v1/claims"
_JSON = b"application/json"
#: Media types this layer parses itself; others go to the framework.
_JSON_TYPES = frozenset({b"application/json", b"application/json; charset=utf-8"})


class ClaimRoutes:
    """ASGI layer: the claim routes, falling back to `app` for anything else."""

    def __init__(self, app: ASGIApp, plane: ControlPlane, state: ApiState) -> None:
        self.app = app
        self.plane = plane
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PREFIX):
            route = self._route(scope["method"], scope["path"])
            if route is not None:
                await route(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _route(self, method: str, path: str) -> ASGIApp | None:
        if path == PREFIX:
            return self._create if method == "POST" else None
        rest = path[len(PREFIX) + 1 :] if path[len(PREFIX)] == "/" else ""
        if rest.endswith("/renew"):
            claim_id, action = rest[: -len("/renew")], "renew"
        else:
            claim_id, action = rest, ""
        if "/" in claim_id or not 0 < len(claim_id) <= CLAIM_ID_MAX:
            return None
        if action == "renew":
            return _with_id(self._renew, claim_id) if method == "POST" else None
        if method == "GET":
            return _with_id(self._get, claim_id)
        if method == "DELETE":
            return _with_id(self._release, claim_id)
        return None

    # -- the routes -------------------------------------------------------------------------

    async def _create(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._parse(scope, receive, send, ClaimCreate, required=True)
        if not isinstance(body, ClaimCreate):
            return
        async with _answering(scope, receive, send):
            req = claim_request(principal_of(scope), self.state, body)
            claim = await claim_while_connected(self.plane, req, receive)
            if claim is None:
                # Nobody is listening any more; the status only shows in access logs.
                await send_body(send, 499, _JSON, b"")
                return
            location = (b"location", f"{PREFIX}/{claim.id}".encode())
            await _send_claim(send, claim, 201, location)

    async def _get(self, claim_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        async with _answering(scope, receive, send):
            claim = await self.plane.get_claim(claim_id)
            principal_of(scope).check_org(claim.org)
            await _send_claim(send, claim)

    async def _release(self, claim_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        async with _answering(scope, receive, send):
            await check_owner(self.plane, principal_of(scope), claim_id)
            await _send_claim(send, await self.plane.release(claim_id))

    async def _renew(self, claim_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._parse(scope, receive, send, ClaimRenew, required=False)
        if body is _ANSWERED:
            return
        lease_s = body.lease_s if isinstance(body, ClaimRenew) else None
        async with _answering(scope, receive, send):
            await check_owner(self.plane, principal_of(scope), claim_id)
            await _send_claim(send, await self.plane.renew(claim_id, lease_s))

    # -- bodies -----------------------------------------------------------------------------

    async def _parse(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        model: type[BaseModel],
        *,
        required: bool,
    ) -> BaseModel | object | None:
        """The request body as `model`; None for an optional body that is absent.

        Returns `_ANSWERED` when the request was answered or handed to the framework
        instead: a body over the limit (413), or one this layer does not take as given.
        """
        try:
            raw = await _read_body(receive)
        except HTTPException as exc:
            # The guard's limit on a chunked body.
            detail = exc.detail if isinstance(exc.detail, str) else "body too large"
            await send_problem(send, exc.status_code, "body-too-large", detail)
            return _ANSWERED
        if raw is None:
            return _ANSWERED  # the client left before its body was complete
        if not raw and not required:
            return None
        if raw and _content_type(scope) in _JSON_TYPES:
            try:
                return model.model_validate(json.loads(raw))
            except Exception:
                # Not JSON, not valid, nested past the parser's recursion limit, ...
                pass
        # Not taken as given: the framework answers, with the body it would have read.
        await self.app(scope, _replay(raw, receive), send)
        return _ANSWERED


#: `_parse`'s answer when the request needs nothing more from the route.
_ANSWERED = object()


def _with_id(
    route: Callable[[str, Scope, Receive, Send], Awaitable[None]], claim_id: str
) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await route(claim_id, scope, receive, send)

    return app


def _content_type(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return bytes(value).lower().replace(b"; ", b";").replace(b";", b"; ")
    return None


async def _read_body(receive: Receive) -> bytes | None:
    """The whole body; None if the client disconnected first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` as if the body had not been read yet."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class _answering:
    """Turns a domain error into its problem answer, and anything else into a logged 500."""

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope, self.receive, self.send = scope, receive, send

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: type[BaseException] | None, exc: Any, tb: Any) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        if isinstance(exc, StokerError):
            response = problems.from_domain(exc)
        else:
            logger.error("event=request_failed error=%r", exc, exc_info=exc)
            response = problems.problem_response(500, "internal-error", "internal error")
        await response(self.scope, self.receive, self.send)
        return True


async def _send_claim(
    send: Send, claim: Claim, status: int = 200, *extra: tuple[bytes, bytes]
) -> None:
    await send_body(send, status, _JSON, ClaimOut.of(claim).model_dump_json().encode(), *extra)


async def check_owner(plane: ControlPlane, principal: Principal, claim_id: str) -> None:
    """Raise unless `principal` may act on the claim."""
    # An admin may act on any claim: the plane's own lookup answers 404 for a missing one,
    # so only an org token costs a read here.
    if not principal.admin:
        principal.check_org((await plane.get_claim(claim_id)).org)


def claim_request(principal: Principal, state: ApiState, body: ClaimCreate) -> ClaimRequest:
    """The plane's request for `body`, once `principal` may claim for its org and the
    server still takes claims."""
    principal.check_org(body.org)
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
    )


async def claim_while_connected(
    plane: ControlPlane, req: ClaimRequest, receive: Receive
) -> Claim | None:
    """`plane.claim(req)`, cancelled if the client disconnects first (None then).

    The claim runs in this request's own task; a watcher task cancels it when the client
    goes, which is the pool manager's abandonment path (cheaper than running the claim in
    a task of its own: this is the hot path). A claim that was bound just as the client
    left is released at once.
    """
    task = asyncio.current_task()
    assert task is not None
    gone = asyncio.ensure_future(_cancel_on_disconnect(receive, task))
    try:
        claim = await plane.claim(req)
    except asyncio.CancelledError:
        if gone.done() and not gone.cancelled() and gone.result():
            # Our own watcher cancelled the claim: the request ends here, quietly.
            task.uncancel()
            return None
        raise
    finally:
        gone.cancel()
    if gone.done() and not gone.cancelled() and gone.result():
        await plane.release(claim.id)
        return None
    return claim


async def _cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any]) -> bool:
    """Cancel `task` when the client disconnects (the body was read before the handler)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            task.cancel()
            return True
