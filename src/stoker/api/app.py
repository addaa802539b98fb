"""The HTTP API (docs/concepts/claims.md, docs/api.md): `create_app(plane, api_config)` builds it.

Every route is in the app's router, and the OpenAPI document describes them all. The claim
routes (`stoker.api.claims`) are the path every session takes; they are `DirectRoute`s,
whose plain requests skip the framework's request handling (`stoker.api.routing`). Pools,
workers, claim listings, the dashboard's events and history, health and metrics are plain
FastAPI routes, below; the pages a browser loads (`/ui`, `/docs`, `/redoc`) are in
`stoker.api.pages`.

Every request passes the app's middleware: `Guard` (`stoker.api.asgi`) authenticates `/v1/`
requests and bounds request bodies, so an unauthenticated or oversized request is turned
away before its body is read or parsed; `JsonBodies` (`stoker.api.bodies`) turns away a
body that is not JSON (415) or names a key twice (400); then `DirectRoutes` serves the
direct routes.
Middleware added to the app later runs outside both and sees every request.

The app's lifespan starts the control plane (the store is migrated and the runtime
reconciled before the first request is served) and stops it on shutdown.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.telemetry import TelemetryConfig
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import Response

from stoker._version import __version__
from stoker.api import problems
from stoker.api.access import AccessLog
from stoker.api.asgi import ApiState, Guard, Receive, Scope, Send, principal_of
from stoker.api.bodies import JsonBodies
from stoker.api.claims import add_claim_routes
from stoker.api.connections import RefusalLog
from stoker.api.cursors import next_cursor, read_after
from stoker.api.ledger import add_ledger_routes
from stoker.api.models import (
    ClaimList,
    ClaimOut,
    DegradedPool,
    EventList,
    EventOut,
    Health,
    ModelResponse,
    PoolHistory,
    Problem,
    Readiness,
    WorkerList,
    WorkerOut,
)
from stoker.api.pages import add_pages
from stoker.api.pools import add_pool_routes
from stoker.api.problems import openapi_responses
from stoker.api.rollouts import TEMPLATE_SCHEMAS, add_rollout_routes
from stoker.api.routing import DirectRoutes
from stoker.api.tokens import TokenTable
from stoker.config import ApiConfig
from stoker.control.plane import ControlPlane
from stoker.domain.errors import StokerError, Unavailable
from stoker.domain.states import LIVE, ClaimState, WorkerState

logger = logging.getLogger("stoker.api")

# -- the app --------------------------------------------------------------------------------

#: The framework's OpenTelemetry instrumentation, off: stoker reports its own metrics
#: (Prometheus, `/metrics`) and configures no OpenTelemetry provider, and with the
#: instrumentation on, every request first looked the global providers up (~10 us).
_NO_TELEMETRY: TelemetryConfig = {
    "tracing": False,
    "metrics": False,
    "logs": False,
    "operation_spans": False,
}


class StokerApp(FastAPI):
    """FastAPI with a lifespan that starts and stops the control plane.

    The lifespan is handled here rather than by the framework so that a failed start is
    reported in one line (`state.startup_error`) instead of a traceback; every other
    connection goes to the framework (its middleware, then its router).
    """

    plane: ControlPlane
    api_state: ApiState
    stop_workers: bool
    manage_plane: bool
    #: Where the API and its connections log and count what they refuse.
    refusals: RefusalLog
    #: The admin and org tokens in force (reloaded on SIGHUP or a token file's change).
    tokens: TokenTable

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
    tokens: TokenTable | None = None,
) -> StokerApp:
    """The API app serving `plane`.

    With `manage_plane` the ASGI lifespan starts the plane and stops it (leaving workers
    for the next start to adopt, or stopping them with `stop_workers`); tests that drive
    the plane themselves pass False. `tokens`: the table the server reloads (default: read
    from `api_config` now).
    """
    api = api_config or ApiConfig()
    app = StokerApp(
        title="stoker",
        version=__version__,
        summary="Claims of warm workers, pools and workers of one stoker control plane.",
        # Served by `add_pages` from the package's own files, not from a CDN.
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        telemetry=_NO_TELEMETRY,
    )
    app.plane = plane
    app.api_state = ApiState()
    app.stop_workers = stop_workers
    app.manage_plane = manage_plane
    app.add_exception_handler(StokerError, problems.handle_domain_error)
    app.add_exception_handler(HTTPException, problems.handle_http_error)
    app.add_exception_handler(RequestValidationError, problems.handle_validation_error)
    app.add_exception_handler(Exception, problems.handle_unexpected)
    # Added first, the direct routes run inside the guard; middleware added later wraps both.
    app.add_middleware(DirectRoutes, routes=app.router.routes, handlers=app.exception_handlers)
    # Inside the guard (bounded, authenticated bodies), outside the direct routes.
    app.add_middleware(JsonBodies)
    app.refusals = RefusalLog(plane.metrics.api_refusals)
    app.tokens = tokens or TokenTable(api)
    app.add_middleware(Guard, api=api, tokens=app.tokens, refusals=app.refusals)
    if api.access_log:
        # Outside the guard: it logs refused requests too, and who the guard let in.
        app.add_middleware(AccessLog)
    # Before the claim routes: `GET /v1/claims/log` is no claim's id.
    add_ledger_routes(app, plane)
    add_claim_routes(app, plane, app.api_state)
    _routes(app, plane, app.api_state)
    add_pool_routes(app, plane)
    add_rollout_routes(app, plane)
    _dashboard_routes(app, plane)
    add_pages(app, openapi_url="/openapi.json")
    _document(app, secured=api.has_tokens, pools=list(plane.catalog.pools))
    return app


#: The problems an admin route may answer: no token, not an admin's, a bad query.
_ADMIN = (401, 403, 422)
#: And a listing, which reads the store: 503 while the plane is not running.
_LISTING = (*_ADMIN, 503)
#: A listing's `after`: the `next` of the page before.
_AFTER = "The `next` of the previous page: list the rows after its last."
_CURSOR_MAX = 512


def _doc(operation: str, summary: str, tag: str, model: Any, *statuses: int) -> dict[str, Any]:
    """The OpenAPI description of one route of this module."""
    return {
        "operation_id": operation,
        "summary": summary,
        "response_model": model,
        "responses": openapi_responses(*statuses),
        "tags": [tag],
    }


def _check_listing(request: Request, plane: ControlPlane) -> None:
    """Let an admin list the store's workers or claims once the plane is running."""
    principal_of(request.scope).check_admin()
    if not plane.started:
        raise Unavailable("control plane is not running")


def _routes(app: FastAPI, plane: ControlPlane, state: ApiState) -> None:
    """Register the routes other than the claim routes: pools, workers, health, metrics."""

    @app.get(
        "/v1/workers",
        **_doc("list_workers", "List workers (admin)", "workers", WorkerList, *_LISTING),
    )
    async def list_workers(
        request: Request,
        pool: Annotated[str | None, Query(max_length=128)] = None,
        state_: Annotated[WorkerState | None, Query(alias="state")] = None,
        org: Annotated[str | None, Query(max_length=128)] = None,
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
        after: Annotated[str | None, Query(max_length=_CURSOR_MAX, description=_AFTER)] = None,
    ) -> Response:
        """Workers, oldest first; live ones unless `state` asks for another (e.g. retired).
        A full page carries `next`: pass it as `after` for the page after it."""
        _check_listing(request, plane)
        states = [state_] if state_ else LIVE
        workers = await plane.store.list_workers(
            pool=pool, states=states, org=org, after=read_after(after), limit=limit
        )
        listed = [WorkerOut.of(w) for w in workers]
        page = WorkerList.model_construct(workers=listed, next=next_cursor(workers, limit))
        return ModelResponse(page)

    @app.get(
        "/v1/claims", **_doc("list_claims", "List claims (admin)", "claims", ClaimList, *_LISTING)
    )
    async def list_claims(
        request: Request,
        state_: Annotated[ClaimState, Query(alias="state")] = ClaimState.BOUND,
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
        after: Annotated[str | None, Query(max_length=_CURSOR_MAX, description=_AFTER)] = None,
    ) -> Response:
        """Claims in `state` (default: the open ones, `bound`), oldest first, without
        their session tokens (the server keeps only digests). A full page carries `next`:
        pass it as `after` for the page after it."""
        _check_listing(request, plane)
        claims = await plane.store.list_claims(
            states=[state_], after=read_after(after), limit=limit
        )
        listed = [ClaimOut.of(c) for c in claims]
        page = ClaimList.model_construct(claims=listed, next=next_cursor(claims, limit))
        return ModelResponse(page)

    @app.get("/healthz", **_doc("healthz", "Liveness", "health", Health))
    async def healthz() -> Response:
        """200 while the process runs, with the version it runs."""
        return ModelResponse(Health(status="ok", version=__version__))

    @app.get("/readyz", **_doc("readyz", "Readiness", "health", Readiness, 503))
    async def readyz() -> Response:
        """200 once the store is migrated and the runtime reconciled; 503 while shutting
        down and while the store fails (the last heartbeat's write failed). A pool whose
        passes or spawns keep failing makes the answer `degraded` (still 200: the fault is
        the pool's, and every replica shares it; taking replicas out of the load balancer
        would stop the other pools' claims too)."""
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
        if plane.store_error is not None:
            return problems.problem_response(
                503, "not-ready", plane.store_error, reason="store_unavailable"
            )
        degraded = [
            DegradedPool(
                pool=p.pool,
                problem=p.problem,
                in_a_row=p.in_a_row,
                detail=p.detail,
                revision=p.revision,
            )
            for p in plane.degraded()
        ]
        status: Literal["ready", "degraded"] = "degraded" if degraded else "ready"
        return ModelResponse(Readiness(status=status, degraded=degraded))

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


def _dashboard_routes(app: FastAPI, plane: ControlPlane) -> None:
    """What the dashboard (`/ui`) reads beyond pools, workers and claims: this replica's
    recent events and the last hour of its pool samples (admin)."""

    @app.get(
        "/v1/events",
        **_doc(
            "list_events", "Recent events of this replica (admin)", "dashboard", EventList, *_ADMIN
        ),
    )
    async def list_events(
        request: Request,
        after: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> Response:
        """Spawns, retirements with their reasons, and failures this replica recorded,
        newest first; `after`: only events with a greater `seq`."""
        principal_of(request.scope).check_admin()
        events = plane.journal.recent(after=after, limit=limit)
        return ModelResponse(
            EventList.model_construct(
                replica=plane.instance_id, events=[EventOut.of(e) for e in events]
            )
        )

    @app.get(
        "/v1/history",
        **_doc(
            "pool_history", "The last hour of each pool (admin)", "dashboard", PoolHistory, *_ADMIN
        ),
    )
    async def pool_history(
        request: Request, since: Annotated[float, Query(ge=0)] = 0.0
    ) -> Response:
        """Each pool's warm target, demand and workers sampled every `interval_s` by this
        replica over the last hour, oldest first; `since`: only later samples."""
        principal_of(request.scope).check_admin()
        history = plane.history
        return ModelResponse(
            PoolHistory.of(
                plane.instance_id,
                history.interval_s,
                plane.clock.now(),
                history.samples(since=since),
            )
        )


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
        schemas.update(TEMPLATE_SCHEMAS)
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
