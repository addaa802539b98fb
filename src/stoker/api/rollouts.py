"""The rollout routes (admin token only): start a pool's new revision, read a rollout,
pause, resume, abort or promote it (README, "Rolling out a new worker").

`POST /v1/pools/{name}/rollouts` takes the new template as fields laid over the pool's
stable one (a process pool: `argv`, `env`, `cwd`; a pod pool: `image`, `command`, ...)
and a strategy (`{"kind": "canary", "steps": [10, 50, 100], "step_interval_s": 60,
"max_failure_ratio": 0.2}` or `{"kind": "replace"}`; none: the pool's default). It answers
201 with the rollout; a strategy whose steps do not increase within 1-100 is a 422, an
action on a rollout that has ended a 409.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Path, Request
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from starlette.responses import Response

from stoker.api.asgi import principal_of
from stoker.api.pools import PoolName, RolloutOut
from stoker.api.problems import openapi_responses
from stoker.control.plane import ControlPlane
from stoker.control.rollout_actions import Action
from stoker.domain.errors import InvalidRequest, StokerError
from stoker.domain.pools import template_from_json, template_json
from stoker.domain.rollouts import Strategy, strategy_from
from stoker.domain.specs import RuntimeTemplate

RolloutId = Annotated[str, Path(max_length=128)]
#: What every rollout route may answer besides its success.
_ERRORS = (401, 403, 404, 412, 422, 503)


def _valid_strategy(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A strategy `strategy_from` reads (its problem is a 422)."""
    if value is None:
        return None
    try:
        strategy_from(value)
    except InvalidRequest as exc:
        raise ValueError(str(exc)) from None
    return value


class RolloutIn(BaseModel):
    """`POST /v1/pools/{name}/rollouts`: the new template and how to roll it out."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    #: Fields of the new template, laid over the pool's stable template.
    template: dict[str, Any] = Field(min_length=1)
    #: `{"kind": "canary", "steps": [...], ...}` or `{"kind": "replace"}`; None: the
    #: pool's default strategy.
    strategy: Annotated[dict[str, Any] | None, AfterValidator(_valid_strategy)] = None

    def parsed_strategy(self) -> Strategy | None:
        """The strategy, validated (None: the pool's default)."""
        return None if self.strategy is None else strategy_from(self.strategy)


def new_template(stable: RuntimeTemplate, fields: dict[str, Any]) -> RuntimeTemplate:
    """The pool's stable template with `fields` laid over it; InvalidRequest names what
    does not fit."""
    body = {**template_json(stable), **fields}
    try:
        return template_from_json(body)
    except (TypeError, ValueError, StokerError) as exc:
        raise InvalidRequest(f"template: {exc}") from None


def _doc(operation: str, summary: str, status: int, *statuses: int) -> dict[str, Any]:
    return {
        "operation_id": operation,
        "summary": summary,
        "response_model": RolloutOut,
        "status_code": status,
        "responses": openapi_responses(*statuses),
        "tags": ["rollouts"],
    }


def _answer(out: RolloutOut, status: int = 200) -> Response:
    return Response(out.model_dump_json(), status_code=status, media_type="application/json")


def add_rollout_routes(app: FastAPI, plane: ControlPlane) -> None:
    """Register the rollout routes."""

    @app.post(
        "/v1/pools/{name}/rollouts",
        **_doc(
            "start_rollout",
            "Roll a new revision out (admin)",
            201,
            400,
            401,
            403,
            404,
            412,
            422,
            503,
        ),
    )
    async def start_rollout(request: Request, name: PoolName, body: RolloutIn) -> Response:
        """Start rolling the pool's new template out (superseding a rollout under way)."""
        principal_of(request.scope).check_admin()
        stored = await plane.pools.get(name)
        template = new_template(stored.spec.template, body.template)
        rollout = await plane.pools.propose(
            stored, template, now=plane.clock.now(), strategy=body.parsed_strategy()
        )
        return _answer(RolloutOut.of(rollout), 201)

    @app.get(
        "/v1/pools/{name}/rollouts/{rollout_id}",
        **_doc("get_rollout", "Get a rollout (admin)", 200, *_ERRORS),
    )
    async def get_rollout(request: Request, name: PoolName, rollout_id: RolloutId) -> Response:
        """A rollout of the pool, under way or ended."""
        principal_of(request.scope).check_admin()
        return _answer(RolloutOut.of(await plane.rollout_actions.get(name, rollout_id)))

    for action in Action:
        _action_route(app, plane, action)


def _action_route(app: FastAPI, plane: ControlPlane, action: Action) -> None:
    @app.post(
        f"/v1/pools/{{name}}/rollouts/{{rollout_id}}/{action.value}",
        **_doc(
            f"{action.value}_rollout", f"{action.value.capitalize()} a rollout", 200, 409, *_ERRORS
        ),
    )
    async def act(request: Request, name: PoolName, rollout_id: RolloutId) -> Response:
        """Pause (its share holds), resume (its step's interval starts again), abort (its
        revision retires, the stable one takes every claim) or promote (every new claim
        goes to its revision at once) a rollout under way; 409 once it has ended."""
        principal_of(request.scope).check_admin()
        written = await plane.rollout_actions.act(name, rollout_id, action)
        return _answer(RolloutOut.of(written))
