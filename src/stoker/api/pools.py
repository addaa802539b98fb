"""The routes of one stored pool: its detail with revisions, and an admin's changes.

`GET /v1/pools/{name}` shows the pool with its generation, its active rollout and each
revision's share, state and workers by state. `PATCH /v1/pools/{name}` changes its tunable
settings, `POST /v1/pools/{name}/drain` and `/undrain` stop and resume handing out its new
claims, `DELETE /v1/pools/{name}` deletes a drained pool nobody uses any more (admin token
only). Every write compares the pool's generation: the one the caller
read (`If-Match` or `generation`), else the one read now; a lost race is a 412. A write
that changes nothing leaves the generation as it is.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from typing import Annotated, Any

from fastapi import FastAPI, Header, Path, Request
from pydantic import BaseModel, Field, TypeAdapter
from pydantic.dataclasses import dataclass as pydantic_dataclass
from starlette.responses import Response

from stoker.api.asgi import principal_of
from stoker.api.models import PoolOut
from stoker.api.problems import openapi_responses
from stoker.api.tokens import ANONYMOUS_ADMIN, Principal
from stoker.config.changes import SettingsChange
from stoker.control.plane import ControlPlane
from stoker.control.stored_pools import revision_shares
from stoker.domain.errors import InvalidRequest, NotFound
from stoker.domain.pools import GENERATION_MAX, TUNABLE_SETTINGS, Rollout
from stoker.domain.rollouts import strategy_json
from stoker.domain.specs import OrgSpec
from stoker.domain.states import LIVE

PoolName = Annotated[str, Path(max_length=128)]


class RevisionOut(BaseModel):
    """One revision of a pool: its share of new claims, its state and its live workers."""

    revision: str
    #: `stable`, the rollout's state for its revision, or `retiring`.
    state: str
    #: Percent of the pool's new claims it gets.
    share: int
    counts: dict[str, int]


class RolloutOut(BaseModel):
    """A pool's rollout as stored."""

    id: str
    revision: str
    base_revision: str
    state: str
    step: int
    share: int
    strategy: dict[str, Any]
    started_at: float
    ended_at: float | None
    reason: str | None

    @classmethod
    def of(cls, rollout: Rollout) -> RolloutOut:
        """The response body of a rollout."""
        same = {name: getattr(rollout, name) for name in cls.model_fields}
        return cls(
            **{**same, "state": rollout.state.value, "strategy": strategy_json(rollout.strategy)}
        )


@pydantic_dataclass(frozen=True)
class PoolDetail(PoolOut):
    """A pool with its stored generation, draining flag, active rollout and revisions."""

    generation: int = 0
    draining: bool = False
    #: The stored tunable settings (what `PATCH` changes).
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    rollout: RolloutOut | None = None
    revisions: list[RevisionOut] = dataclasses.field(default_factory=list)
    #: The per-org overrides (the config's `orgs:`) its claims get, by org: the settings
    #: each org sets (`max_workers`, `hot_idle_ttl`, `min_hot_idle`, `max_claim_s`). An
    #: org's token sees its own only.
    org_overrides: dict[str, dict[str, int | float]] = dataclasses.field(default_factory=dict)


class PoolDeleted(BaseModel):
    """`DELETE /v1/pools/{name}`: the pool deleted, the generation it had, and the rows
    deleted from each table of the store (the ledger and the claim log keep theirs)."""

    name: str = Field(description="The pool deleted.")
    generation: int = Field(description="The generation the pool had when it was deleted.")
    removed: dict[str, int] = Field(
        description="Rows deleted, by table of the store (`pools`, `revisions`, `rollouts`, "
        "`rollout_outcomes`, `forecast`, `org_forecast`, `pool_sizing`, `demand`)."
    )


#: `PATCH /v1/pools/{name}`: the config's settings model, strict (`true` is no count).
PoolPatch = SettingsChange


def expected_generation(if_match: str | None, body: int | None = None) -> int | None:
    """The generation a write compares: `If-Match` (`"3"`, `W/"3"` or `3`; `*`: any),
    else `body`. An `If-Match` that can name no generation is malformed (400)."""
    if if_match is None:
        return body
    text = if_match.strip().removeprefix("W/").strip('"')
    if text == "*":
        return body
    # Checked before int(): a generation has at most 19 digits, and int() of thousands of
    # digits is refused outright.
    if not (text.isascii() and text.isdigit()) or len(text) > 19:
        raise InvalidRequest(f"If-Match must name a pool generation, got {if_match[:40]!r}")
    value = int(text)
    if not 1 <= value <= GENERATION_MAX:
        raise InvalidRequest(f"If-Match names no generation a pool can have: {value}")
    return value


async def pool_details(
    plane: ControlPlane, viewer: Principal = ANONYMOUS_ADMIN
) -> list[PoolDetail]:
    """Every pool's status, stored generation and settings, rollout and revisions, and the
    per-org overrides: all of them for an admin, an org's own for an org's token."""
    # One read of the counts: a pool's and its revisions' counts always agree.
    counted = await plane.store.count_workers()
    statuses = await plane.pool_status(counted)
    counts: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: {s.value: 0 for s in LIVE})
    for c in counted:
        counts[c.pool, c.revision][c.state.value] += c.count
    overrides = org_overrides(
        o for o in plane.catalog.orgs.values() if viewer.admin or o.name == viewer.org
    )
    details = []
    for status in statuses:
        name = status.name
        stored, rollout = plane.catalog.stored(name), plane.catalog.rollout(name)
        shares = revision_shares(status.revision, rollout)
        others = sorted(rev for pool, rev in counts if pool == name and rev not in shares)
        revisions = [
            RevisionOut(revision=rev, state=state, share=share, counts=counts[name, rev])
            for rev, (state, share) in [*shares.items(), *((r, ("retiring", 0)) for r in others)]
        ]
        fields = {f.name: getattr(status, f.name) for f in dataclasses.fields(status)}
        details.append(
            PoolDetail(
                **fields,
                generation=stored.generation if stored else 0,
                draining=stored.draining if stored else False,
                settings={k: getattr(stored.spec, k) for k in TUNABLE_SETTINGS} if stored else {},
                rollout=RolloutOut.of(rollout) if rollout else None,
                revisions=revisions,
                org_overrides=overrides,
            )
        )
    return details


def org_overrides(orgs: Iterable[OrgSpec]) -> dict[str, dict[str, int | float]]:
    """Each org that sets any override, with the settings it sets."""
    return {org.name: given for org in orgs if (given := org.overrides())}


async def pool_detail(
    plane: ControlPlane, name: str, viewer: Principal = ANONYMOUS_ADMIN
) -> PoolDetail:
    """One pool's detail (as `viewer` sees it); NotFound for a pool the replica does not
    serve."""
    for detail in await pool_details(plane, viewer):
        if detail.name == name:
            return detail
    raise NotFound(f"unknown pool {name!r}")


class PoolList(BaseModel):
    """`GET /v1/pools`."""

    pools: list[PoolDetail]


_DETAIL_JSON: TypeAdapter[PoolDetail] = TypeAdapter(PoolDetail)


def _answer(detail: PoolDetail) -> Response:
    """The detail, with the generation as its `ETag` (what `If-Match` sends back)."""
    return Response(
        _DETAIL_JSON.dump_json(detail),
        media_type="application/json",
        headers={"ETag": f'"{detail.generation}"'},
    )


#: The problems a read of one pool may answer, and a write's model and problems.
_READ = (401, 403, 404, 422, 503)
_WRITE = (PoolDetail, 400, 401, 403, 404, 412, 422, 503)


def _doc(operation: str, summary: str, model: Any, *statuses: int) -> dict[str, Any]:
    """The OpenAPI description of one route of the `pools` tag."""
    return {
        "operation_id": operation,
        "summary": summary,
        "response_model": model,
        "responses": openapi_responses(*statuses),
        "tags": ["pools"],
    }


def add_pool_routes(app: FastAPI, plane: ControlPlane) -> None:
    """Register `GET`/`PATCH /v1/pools/{name}` and the drain routes."""

    @app.get("/v1/pools", **_doc("list_pools", "List pools", PoolList, 401, 403, 503))
    async def list_pools(request: Request) -> Response:
        """Every pool as `GET /v1/pools/{name}` shows it."""
        return Response(
            PoolList(
                pools=await pool_details(plane, principal_of(request.scope))
            ).model_dump_json(),
            media_type="application/json",
        )

    @app.get("/v1/pools/{name}", **_doc("get_pool", "Get a pool", PoolDetail, *_READ))
    async def get_pool(request: Request, name: PoolName) -> Response:
        """One pool with its targets, demand, cap, workers by state, stored generation
        (also its `ETag`), active rollout and revisions."""
        return _answer(await pool_detail(plane, name, principal_of(request.scope)))

    @app.patch("/v1/pools/{name}", **_doc("update_pool", "Change a pool (admin)", *_WRITE))
    async def update_pool(
        request: Request,
        name: PoolName,
        body: PoolPatch,
        if_match: Annotated[str | None, Header()] = None,
    ) -> Response:
        """Change tunable settings; in force on every replica within one janitor pass."""
        principal_of(request.scope).check_admin()
        changes = body.model_dump(exclude_none=True, exclude={"generation"})
        if "hot_idle_ttl" in body.model_fields_set and body.hot_idle_ttl is None:
            changes["hot_idle_ttl"] = None  # back to the default
        generation = expected_generation(if_match, body.generation)
        await plane.pools.update(name, changes, generation=generation)
        return _answer(await pool_detail(plane, name))

    @app.delete(
        "/v1/pools/{name}",
        **_doc(
            "delete_pool",
            "Delete a drained pool (admin)",
            PoolDeleted,
            400,
            401,
            403,
            404,
            409,
            412,
            422,
            503,
        ),
    )
    async def delete_pool(
        request: Request, name: PoolName, if_match: Annotated[str | None, Header()] = None
    ) -> PoolDeleted:
        """Delete a pool and what is its alone (revisions, rollouts, forecast, published
        sizing, demand rows); its ledger and claim log rows stay. 409 while it is not
        drained, rolls out, has live workers or open claims, or this replica's config file
        declares it; every replica forgets it within one janitor pass."""
        principal_of(request.scope).check_admin()
        deleted = await plane.pools.delete(name, generation=expected_generation(if_match))
        return PoolDeleted(
            name=deleted.name, generation=deleted.generation, removed=dict(deleted.removed)
        )

    for path, draining, summary in (
        ("drain", True, "Stop handing out a pool's new claims (admin)"),
        ("undrain", False, "Hand out a drained pool's claims again (admin)"),
    ):
        _drain_route(app, plane, path, draining, summary)


def _drain_route(
    app: FastAPI,
    plane: ControlPlane,
    path: str,
    draining: bool,
    summary: str,
) -> None:
    @app.post(f"/v1/pools/{{name}}/{path}", **_doc(f"{path}_pool", summary, *_WRITE))
    async def drain(
        request: Request, name: PoolName, if_match: Annotated[str | None, Header()] = None
    ) -> Response:
        """Drain: new claims of the pool get 503, sessions end as usual, warm workers
        retire. Undrain: the pool serves claims again."""
        principal_of(request.scope).check_admin()
        generation = expected_generation(if_match)
        await plane.pools.set_draining(name, draining, generation=generation)
        return _answer(await pool_detail(plane, name))
