"""The HTTP API of DESIGN.md §7: `create_app(plane, api_config)` builds it.

Where a claim enters over HTTP: `POST /v1/claims` -> `ControlPlane.claim`. The handler
watches the connection while the claim waits; a client that disconnects cancels the claim,
which takes the pool manager's abandonment path (a worker reserved for it goes back to
`warm` or to its org's `hot_idle`), so a vanished client leaves nothing behind.

Authentication and the request-size limit run in `Guard`, a plain ASGI layer in front of
the routes, so an unauthenticated or oversized request is turned away before its body is
read or parsed. The app's lifespan starts the control plane (the store is migrated and the
runtime reconciled before the first request is served) and stops it on shutdown.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Body, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import Response

from stoker._version import __version__
from stoker.api import problems
from stoker.api.models import (
    ClaimCreate,
    ClaimOut,
    ClaimRenew,
    Health,
    PoolList,
    PoolOut,
    Problem,
    WorkerList,
    WorkerOut,
)
from stoker.config import ApiConfig
from stoker.control.plane import ControlPlane
from stoker.domain.errors import Forbidden, NotFound, StokerError, Unavailable
from stoker.domain.records import Claim, ClaimRequest
from stoker.domain.states import LIVE, WorkerState

logger = logging.getLogger("stoker.api")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Scope key under which `Guard` leaves the authenticated caller.
PRINCIPAL_KEY = "stoker.principal"
#: Methods whose requests carry a body worth limiting.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
CLAIM_ID_MAX = 128


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: an admin (every org) or one org."""

    admin: bool
    org: str | None = None

    def check_org(self, org: str) -> None:
        """Raise `Forbidden` unless this caller may act for `org`."""
        if not self.admin and self.org != org:
            raise Forbidden(f"this token acts for org {self.org!r}, not for {org!r}")

    def check_admin(self) -> None:
        """Raise `Forbidden` unless this caller holds an admin token."""
        if not self.admin:
            raise Forbidden("an admin token is required")


ANONYMOUS_ADMIN = Principal(admin=True)


class ApiState:
    """What the HTTP layer knows beyond the plane: draining, and a failed start."""

    def __init__(self) -> None:
        #: Set on SIGTERM: readiness drops and new claims are refused.
        self.draining = False
        self.startup_error: str | None = None


# -- the guard: auth and body size, before the framework ------------------------------------


@functools.lru_cache(maxsize=1024)
def _is_loopback(host: str) -> bool:
    # Cached: the same few client addresses come back on every request.
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return host == "localhost"


class Guard:
    """ASGI layer: authenticates `/v1/` requests and bounds request bodies.

    With tokens configured, a `/v1/` request needs `Authorization: Bearer <token>` (401
    otherwise); with none configured, only loopback clients are served (403 otherwise).
    A body longer than `max_body_bytes` gets 413, by its Content-Length before it is read,
    or as soon as a chunked body grows past the limit.
    """

    def __init__(self, app: ASGIApp, api: ApiConfig) -> None:
        self.app = app
        self.max_body = api.max_body_bytes
        self.open = not api.has_tokens
        self.tokens: dict[bytes, Principal] = {
            t.encode(): Principal(admin=True) for t in api.admin_tokens
        }
        self.tokens.update(
            {t.encode(): Principal(admin=False, org=o) for t, o in api.org_tokens.items()}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"].startswith("/v1/"):
            principal, refusal = self._authenticate(scope)
            if refusal is not None:
                await refusal(send)
                return
            scope[PRINCIPAL_KEY] = principal
        if scope["method"] in _BODY_METHODS:
            length = _content_length(scope)
            if length is not None and length > self.max_body:
                await _send_problem(send, 413, "body-too-large", self._too_large())
                return
            receive = self._limited(receive)
        await self.app(scope, receive, send)

    def _too_large(self) -> str:
        return f"the request body exceeds {self.max_body} bytes"

    def _authenticate(
        self, scope: Scope
    ) -> tuple[Principal | None, Callable[[Send], Awaitable[None]] | None]:
        if self.open:
            client = scope.get("client")
            if client is not None and not _is_loopback(str(client[0])):
                detail = "this server has no tokens configured and serves loopback clients only"
                return None, lambda send: _send_problem(send, 403, "forbidden", detail)
            return ANONYMOUS_ADMIN, None
        credential = _bearer(scope)
        if credential is None:
            detail = "missing bearer token (Authorization: Bearer <token>)"
            return None, lambda send: _send_problem(send, 401, "unauthorized", detail, bearer=True)
        principal = self._match(credential)
        if principal is None:
            detail = "unknown bearer token"
            return None, lambda send: _send_problem(send, 401, "unauthorized", detail, bearer=True)
        return principal, None

    def _match(self, credential: bytes) -> Principal | None:
        found = None
        # Compare with every token in constant time, so timing tells nothing about them.
        for token, principal in self.tokens.items():
            if hmac.compare_digest(token, credential):
                found = principal
        return found

    def _limited(self, receive: Receive) -> Receive:
        limit, seen = self.max_body, 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, self._too_large())
            return message

        return limited_receive


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, credential = bytes(value).partition(b" ")
            if scheme.lower() != b"bearer" or not credential.strip():
                return None
            return credential.strip()
    return None


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_problem(
    send: Send, status: int, code: str, detail: str, *, bearer: bool = False
) -> None:
    body = problems.problem_bytes(status, code, detail)
    headers = [
        (b"content-type", problems.PROBLEM_JSON.encode()),
        (b"content-length", str(len(body)).encode()),
    ]
    if bearer:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# -- the app --------------------------------------------------------------------------------


def _problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the problem answers a route may give."""
    ref = {"$ref": "#/components/schemas/Problem"}
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {
            "description": problems.title(status),
            "content": {problems.PROBLEM_JSON: {"schema": ref}},
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


def _json(model: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        model.model_dump_json(), status_code=status, media_type="application/json", headers=headers
    )


class StokerApp(FastAPI):
    """FastAPI with a lifespan that starts and stops the control plane.

    The lifespan is handled here rather than by the framework so that a failed start is
    reported in one line (`state.startup_error`) instead of a traceback.
    """

    plane: ControlPlane
    api_state: ApiState
    stop_workers: bool
    manage_plane: bool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI connection; the lifespan protocol is handled here."""
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        await super().__call__(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    if self.manage_plane:
                        await self.plane.start()
                except Exception as exc:
                    self.api_state.startup_error = str(exc) or repr(exc)
                    logger.debug("startup failed", exc_info=True)
                    await send({"type": "lifespan.startup.failed", "message": ""})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.api_state.draining = True
                try:
                    if self.manage_plane:
                        await self.plane.stop(stop_workers=self.stop_workers)
                except Exception as exc:
                    logger.error("event=shutdown_failed error=%r", exc)
                    await send({"type": "lifespan.shutdown.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.shutdown.complete"})
                return


def create_app(
    plane: ControlPlane,
    api_config: ApiConfig | None = None,
    *,
    stop_workers: bool = False,
    manage_plane: bool = True,
) -> StokerApp:
    """The API app serving `plane`.

    With `manage_plane` the ASGI lifespan starts the plane and stops it (leaving workers
    for the next start to adopt, or stopping them with `stop_workers`); tests that drive
    the plane themselves pass False.
    """
    api = api_config or ApiConfig()
    app = StokerApp(
        title="stoker",
        version=__version__,
        summary="Claims of warm workers, pools and workers of one stoker control plane.",
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.plane = plane
    app.api_state = ApiState()
    app.stop_workers = stop_workers
    app.manage_plane = manage_plane
    app.add_exception_handler(StokerError, problems.handle_domain_error)
    app.add_exception_handler(HTTPException, problems.handle_http_error)
    app.add_exception_handler(RequestValidationError, problems.handle_validation_error)
    app.add_exception_handler(Exception, problems.handle_unexpected)
    app.add_middleware(Guard, api=api)
    _routes(app, plane, app.api_state)
    _document(app, secured=api.has_tokens, pools=list(plane.manager.pools))
    return app


def _principal(request: Request) -> Principal:
    principal = request.scope.get(PRINCIPAL_KEY)
    assert isinstance(principal, Principal), "Guard runs before every /v1/ route"
    return principal


ClaimId = Annotated[str, Path(min_length=1, max_length=CLAIM_ID_MAX)]


def _routes(app: FastAPI, plane: ControlPlane, state: ApiState) -> None:
    async def check_owner(request: Request, claim_id: str) -> None:
        # An admin may act on any claim: the plane's own lookup answers 404 for a missing
        # one, so only an org token costs a read here.
        principal = _principal(request)
        if not principal.admin:
            principal.check_org((await plane.get_claim(claim_id)).org)

    @app.post(
        "/v1/claims",
        operation_id="create_claim",
        status_code=201,
        response_model=ClaimOut,
        responses=_problems(400, 401, 403, 404, 413, 422, 429, 503),
        tags=["claims"],
        summary="Claim a worker",
    )
    async def create_claim(request: Request, body: ClaimCreate) -> Response:
        """Bind a worker of `pool` to `org`: reuse, then warm, then (by mode) a cold spawn.

        Waits up to `timeout_s` for a worker; 503 when none came, 429 when the org holds
        its cap. A client that disconnects while waiting cancels the claim.
        """
        _principal(request).check_org(body.org)
        if state.draining:
            raise Unavailable("control plane is shutting down")
        req = ClaimRequest(
            pool=body.pool,
            org=body.org,
            mode=body.mode,
            timeout_s=body.timeout_s,
            lease_s=body.lease_s,
            ttl_s=body.ttl_s,
            config=body.config,
        )
        claim = await _claim_while_connected(plane, req, request.receive)
        if claim is None:
            # Nobody is listening any more; the status only shows in access logs.
            return Response(status_code=499)
        return _json(ClaimOut.of(claim), 201, {"Location": f"/v1/claims/{claim.id}"})

    @app.get(
        "/v1/claims/{claim_id}",
        operation_id="get_claim",
        response_model=ClaimOut,
        responses=_problems(401, 403, 404, 422, 503),
        tags=["claims"],
        summary="Get a claim",
    )
    async def get_claim(request: Request, claim_id: ClaimId) -> Response:
        """The claim, in any state (bound, released, expired, failed)."""
        claim = await plane.get_claim(claim_id)
        _principal(request).check_org(claim.org)
        return _json(ClaimOut.of(claim))

    @app.post(
        "/v1/claims/{claim_id}/renew",
        operation_id="renew_claim",
        response_model=ClaimOut,
        responses=_problems(400, 401, 403, 404, 409, 413, 422, 503),
        tags=["claims"],
        summary="Renew a claim's lease",
    )
    async def renew_claim(
        request: Request,
        claim_id: ClaimId,
        body: Annotated[ClaimRenew | None, Body()] = None,
    ) -> Response:
        """Extend the lease by `lease_s` (default: the claim's own) from now; 409 once ended."""
        await check_owner(request, claim_id)
        lease_s = body.lease_s if body is not None else None
        return _json(ClaimOut.of(await plane.renew(claim_id, lease_s)))

    @app.delete(
        "/v1/claims/{claim_id}",
        operation_id="release_claim",
        response_model=ClaimOut,
        responses=_problems(401, 403, 404, 422, 503),
        tags=["claims"],
        summary="Release a claim",
    )
    async def release_claim(request: Request, claim_id: ClaimId) -> Response:
        """End the session: the worker parks as hot_idle (reuse: same_org) or retires.

        Releasing a claim that already ended returns it unchanged.
        """
        await check_owner(request, claim_id)
        return _json(ClaimOut.of(await plane.release(claim_id)))

    @app.get(
        "/v1/pools",
        operation_id="list_pools",
        response_model=PoolList,
        responses=_problems(401, 403, 503),
        tags=["pools"],
        summary="List pools",
    )
    async def list_pools(request: Request) -> Response:
        """Every pool with its targets, demand, cap and workers by state."""
        statuses = await plane.pool_status()
        return _json(PoolList.model_construct(pools=[PoolOut.of(s) for s in statuses]))

    @app.get(
        "/v1/pools/{name}",
        operation_id="get_pool",
        response_model=PoolOut,
        responses=_problems(401, 403, 404, 422, 503),
        tags=["pools"],
        summary="Get a pool",
    )
    async def get_pool(request: Request, name: Annotated[str, Path(max_length=128)]) -> Response:
        """One pool with its targets, demand, cap and workers by state."""
        for status in await plane.pool_status():
            if status.name == name:
                return _json(PoolOut.of(status))
        raise NotFound(f"unknown pool {name!r}")

    @app.get(
        "/v1/workers",
        operation_id="list_workers",
        response_model=WorkerList,
        responses=_problems(401, 403, 422, 503),
        tags=["workers"],
        summary="List workers (admin)",
    )
    async def list_workers(
        request: Request,
        pool: Annotated[str | None, Query(max_length=128)] = None,
        state_: Annotated[WorkerState | None, Query(alias="state")] = None,
        org: Annotated[str | None, Query(max_length=128)] = None,
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    ) -> Response:
        """Workers, oldest first; live ones unless `state` asks for another (e.g. retired)."""
        _principal(request).check_admin()
        if not plane.started:
            raise Unavailable("control plane is not running")
        workers = await plane.store.list_workers(
            pool=pool, states=[state_] if state_ else LIVE, org=org, limit=limit
        )
        return _json(WorkerList.model_construct(workers=[WorkerOut.of(w) for w in workers]))

    @app.get(
        "/healthz",
        operation_id="healthz",
        response_model=Health,
        tags=["health"],
        summary="Liveness",
    )
    async def healthz() -> Response:
        """200 while the process runs."""
        return _json(Health(status="ok"))

    @app.get(
        "/readyz",
        operation_id="readyz",
        response_model=Health,
        responses=_problems(503),
        tags=["health"],
        summary="Readiness",
    )
    async def readyz() -> Response:
        """200 once the store is migrated and the runtime reconciled, until shutdown."""
        if state.draining:
            return problems.problem_response(
                503, "not-ready", "shutting down", reason="shutting_down"
            )
        if not (plane.started and plane.reconciled):
            return problems.problem_response(
                503,
                "not-ready",
                "the store is not migrated or the runtime not reconciled yet",
                reason="starting",
            )
        return _json(Health(status="ready"))

    @app.get(
        "/metrics",
        operation_id="metrics",
        tags=["health"],
        summary="Prometheus metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics() -> Response:
        """The plane's metrics in the Prometheus text format."""
        plane.refresh_gauges()
        return Response(generate_latest(plane.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _claim_while_connected(
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


def _document(app: FastAPI, *, secured: bool, pools: list[str]) -> None:
    """Complete the OpenAPI document: the Problem schema, this server's pool names as
    examples, links from a new claim to what can be done with it, and (with tokens
    configured) the bearer scheme."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = FastAPI.openapi(app)
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        problem = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(problem.pop("$defs", {}))
        schemas["Problem"] = problem
        if pools:
            schemas["ClaimCreate"]["properties"]["pool"]["examples"] = pools
        created = schema["paths"]["/v1/claims"]["post"]["responses"]["201"]
        created["links"] = {
            name: {
                "operationId": operation,
                "parameters": {"claim_id": "$response.body#/id"},
                "description": description,
            }
            for name, operation, description in (
                ("GetClaim", "get_claim", "The claim just created."),
                ("RenewClaim", "renew_claim", "Renew the claim just created."),
                ("ReleaseClaim", "release_claim", "Release the claim just created."),
            )
        }
        if secured:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, item in schema.get("paths", {}).items():
                if path.startswith("/v1/"):
                    for operation in item.values():
                        operation["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
