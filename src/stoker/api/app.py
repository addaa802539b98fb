"""The HTTP API of DESIGN.md §7: `create_app(plane, api_config)` builds it.

Where a claim enters over HTTP: `POST /v1/claims` -> `ControlPlane.claim`. The handler
watches the connection while the claim waits; a client that disconnects cancels the claim,
which takes the pool manager's abandonment path (a worker reserved for it goes back to
`warm` or to its org's `hot_idle`), so a vanished client leaves nothing behind.

Authentication and the request-size limit run in `Guard` (`stoker.api.asgi`), a plain ASGI
layer in front of the routes, so an unauthenticated or oversized request is turned away
before its body is read or parsed. The claim routes are served below the framework by
`stoker.api.claims`; their FastAPI routes here describe them in the OpenAPI document and
answer what that layer hands on (bodies it does not take as given). The app's lifespan
starts the control plane (the store is migrated and the runtime reconciled before the first
request is served) and stops it on shutdown.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import Body, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import Response

from stoker._version import __version__
from stoker.api import problems
from stoker.api.asgi import (
    CLAIM_ID_MAX,
    ApiState,
    ASGIApp,
    Guard,
    Principal,
    Receive,
    Scope,
    Send,
    principal_of,
)
from stoker.api.claims import ClaimRoutes, check_owner, claim_request, claim_while_connected
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
from stoker.domain.errors import NotFound, StokerError, Unavailable
from stoker.domain.states import LIVE, WorkerState

logger = logging.getLogger("stoker.api")

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
    reported in one line (`state.startup_error`) instead of a traceback. A request goes
    through `front`: the guard, then the claim routes, then the framework.
    """

    plane: ControlPlane
    api_state: ApiState
    stop_workers: bool
    manage_plane: bool
    front: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI connection; the lifespan protocol is handled here."""
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        await self.front(scope, receive, send)

    async def framework(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The FastAPI app itself, behind `front`."""
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
    app.front = Guard(ClaimRoutes(app.framework, plane, app.api_state), api)
    _routes(app, plane, app.api_state)
    _document(app, secured=api.has_tokens, pools=list(plane.catalog.pools))
    return app


def _principal(request: Request) -> Principal:
    return principal_of(request.scope)


ClaimId = Annotated[str, Path(min_length=1, max_length=CLAIM_ID_MAX)]


def _routes(app: FastAPI, plane: ControlPlane, state: ApiState) -> None:
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
        req = claim_request(_principal(request), state, body)
        claim = await claim_while_connected(plane, req, request.receive)
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
        await check_owner(plane, _principal(request), claim_id)
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
        await check_owner(plane, _principal(request), claim_id)
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
