"""The ledger and the claim log over HTTP (docs/warmth.md, docs/claim-log.md).

`GET /v1/pools/{name}/ledger` sums every replica's cells of one pool per hour (and per org
or revision with `by`), with what they read in money when the pool declares prices.
`GET /v1/claims/log` pages through the claim log by arrival, each entry in the fixed
export form. Both are admin routes: they name every org.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import FastAPI, Path, Query, Request
from pydantic import BaseModel
from starlette.responses import Response

from stoker.api.asgi import principal_of
from stoker.api.cursors import page_cursor, read_after
from stoker.api.problems import openapi_responses
from stoker.control.plane import ControlPlane
from stoker.domain.errors import InvalidRequest, NotFound
from stoker.domain.ledger import (
    SPAWN_BUCKETS,
    WAIT_BUCKETS,
    LedgerCounts,
    money,
    summed,
    window,
)
from stoker.domain.specs import CostSpec

PoolName = Annotated[str, Path(max_length=128)]
#: A time: unix seconds, or a duration before now (`24h`, `7d`).
TimeText = Annotated[str | None, Query(max_length=32, examples=["24h", "1733400000"])]


class LedgerRow(BaseModel):
    """One pool's ledger for one hour (and org or revision): worker-seconds by state,
    resource-seconds, spawns, claims by source with their waits, failures, and what they
    read in money (docs/warmth.md). Its counts are `LedgerCounts`'s fields."""

    #: Start of the hour, unix seconds (0 in the total).
    hour: int
    #: The org ("" for neutral workers) or the revision (`by`), else "".
    group: str
    warm_s: float
    hot_s: float
    hot_idle_s: float
    #: spawning, reserved and activating.
    starting_s: float
    draining_s: float
    #: Kubernetes headroom placeholders, in worker slots.
    placeholder_s: float
    cpu_s: float
    gib_s: float
    #: The placeholders' resource-seconds (their own requests); headroom is priced by them.
    placeholder_cpu_s: float
    placeholder_gib_s: float
    spawns: int
    ready: int
    ready_sum_s: float
    ready_hist: list[int]
    claims_reuse: int
    claims_warm: int
    claims_cold: int
    wait_reuse_s: float
    wait_warm_s: float
    wait_cold_s: float
    wait_hist: list[int]
    failed: int
    failed_wait_s: float
    mean_ready_s: float | None = None
    #: Claims served warm or by reuse x the mean spawn-to-ready time they did not wait.
    cold_start_s_avoided: float | None = None
    idle_warm_cost: float | None = None
    idle_parked_cost: float | None = None
    headroom_cost: float | None = None
    total_cost: float | None = None


class LedgerOut(BaseModel):
    """`GET /v1/pools/{name}/ledger`: every replica's cells summed, per hour and group."""

    pool: str
    since: float
    until: float
    by: str | None
    #: The pool's prices, if it declares any.
    cost: dict[str, float | None] | None
    #: Upper bounds (seconds) of `ready_hist`'s buckets; the last bucket is open.
    spawn_buckets: list[float]
    #: Upper bounds (seconds) of `wait_hist`'s buckets; the last bucket is open.
    wait_buckets: list[float]
    total: LedgerRow
    rows: list[LedgerRow]


class ClaimLogRow(BaseModel):
    """One claim of the log, in the fixed export form (docs/claim-log.md)."""

    at: float
    pool: str
    org: str
    mode: Literal["prefer_warm", "require_warm", "cold"]
    source: Literal["reuse", "warm", "cold"] | None
    wait_s: float
    held_s: float | None
    outcome: Literal["released", "expired", "failed", "no_capacity", "org_cap", "pool_cap", "open"]
    revision: str | None


class ClaimLogPage(BaseModel):
    """`GET /v1/claims/log`: entries by arrival; `next` pages on when the page is full."""

    entries: list[ClaimLogRow]
    next: str | None


def _row(
    hour: int, group: str, counts: LedgerCounts, cost: CostSpec | None, mean_ready: float | None
) -> LedgerRow:
    return LedgerRow(
        hour=hour,
        group=group,
        **counts.scalars(),
        **counts.hists(),
        **money(counts, cost, mean_ready_s=mean_ready),
    )


def _window(
    since: str | None, until: str | None, now: float, default_s: float
) -> tuple[float, float]:
    try:
        return window(since, until, now, default_s)
    except ValueError as exc:
        raise InvalidRequest(f"bad time window: {exc}") from None


def add_ledger_routes(app: FastAPI, plane: ControlPlane) -> None:
    """Register `GET /v1/pools/{name}/ledger` and `GET /v1/claims/log` (before the claim
    routes: `log` is no claim id)."""

    @app.get(
        "/v1/pools/{name}/ledger",
        operation_id="get_pool_ledger",
        summary="What a pool's warmth cost and bought (admin)",
        response_model=LedgerOut,
        responses=openapi_responses(400, 401, 403, 404, 422, 503),
        tags=["pools"],
    )
    async def get_pool_ledger(
        request: Request,
        name: PoolName,
        since: TimeText = None,
        until: TimeText = None,
        by: Annotated[Literal["org", "revision"] | None, Query()] = None,
    ) -> Response:
        """Every replica's ledger of the pool in [since, until) (default: the last 24
        hours), per hour, and per org or revision with `by`; `total` sums them all."""
        principal_of(request.scope).check_admin()
        spec = plane.catalog.get(name)
        if spec is None:
            raise NotFound(f"unknown pool {name!r}")
        start, end = _window(since, until, plane.clock.now(), 86400.0)
        cells = await plane.store.read_ledger(name, since=start, until=end)
        grouped = summed(cells, by)
        total = LedgerCounts()
        for counts in grouped.values():
            total.merge(counts)
        # Cold starts avoided at the pool's mean spawn-to-ready time over the window: a
        # group (an org) whose own spawns are few is not left without one.
        mean_ready = total.ready_sum_s / total.ready if total.ready else None
        rows = []
        for slot in sorted(grouped, key=lambda s: (int(s.split("|", 1)[0]), s)):
            hour, group = slot.split("|", 1)
            rows.append(_row(int(hour), group, grouped[slot], spec.cost, mean_ready))
        body = LedgerOut(
            pool=name,
            since=start,
            until=end,
            by=by,
            cost=None if spec.cost is None else _cost(spec.cost),
            spawn_buckets=list(SPAWN_BUCKETS),
            wait_buckets=list(WAIT_BUCKETS),
            total=_row(0, "", total, spec.cost, mean_ready),
            rows=rows,
        )
        return Response(body.model_dump_json(), media_type="application/json")

    @app.get(
        "/v1/claims/log",
        operation_id="get_claim_log",
        summary="The claim log, for replay (admin)",
        response_model=ClaimLogPage,
        responses=openapi_responses(400, 401, 403, 422, 503),
        tags=["claims"],
    )
    async def get_claim_log(
        request: Request,
        since: TimeText = None,
        until: TimeText = None,
        pool: Annotated[str | None, Query(min_length=1, max_length=128)] = None,
        after: Annotated[str | None, Query(max_length=512)] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> Response:
        """Claims that arrived in [since, until) (default: the last 24 hours), of `pool`
        if given, by arrival; a full page's `next` is the `after` of the next one. The log
        is kept as long as the ledger (`ledger_retention_s`, default 35 days)."""
        principal_of(request.scope).check_admin()
        start, end = _window(since, until, plane.clock.now(), 86400.0)
        page = await plane.store.read_claim_log(
            since=start, until=end, pool=pool, after=read_after(after), limit=limit
        )
        full = len(page) == limit and page
        body = ClaimLogPage(
            entries=[ClaimLogRow(**e.export()) for e in page],
            next=page_cursor(page[-1].at, page[-1].id) if full else None,
        )
        return Response(body.model_dump_json(), media_type="application/json")


def _cost(cost: CostSpec) -> dict[str, float | None]:
    return {
        "per_cpu_hour": cost.per_cpu_hour,
        "per_gib_hour": cost.per_gib_hour,
        "per_worker_hour": cost.per_worker_hour,
    }
