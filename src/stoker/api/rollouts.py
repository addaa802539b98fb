"""The rollout routes (admin token only): start a pool's new revision, read a rollout,
pause, resume, abort or promote it (docs/guides/rollouts.md).

`POST /v1/pools/{name}/rollouts` takes the new template as fields laid over the pool's
stable one (a process pool: `command`, `env`, `cwd`, `memory_mb`; a pod pool: the `pod:`
keys of the config file), validated as a whole by the config's template model
(`stoker.config.changes`), and a strategy (`{"kind": "canary", "steps": [10, 50, 100],
"step_interval_s": 60, "max_failure_ratio": 0.2}` or `{"kind": "replace"}`; none: the
pool's default). It answers 201 with the rollout; a template or strategy that does not fit
is a 422 (`argv` is a 422 naming `command`), the template the pool serves or rolls out
already a 409, an action on a rollout that has ended a 409. Every write honours `If-Match`
(the pool's generation, its `ETag`): a stale one is a 412.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Header, Path, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema
from starlette.responses import Response

from stoker.api.asgi import principal_of
from stoker.api.pools import PoolName, RolloutOut, expected_generation
from stoker.api.problems import openapi_responses
from stoker.config.changes import changed_template
from stoker.config.pools import PodConfig, ProcessConfig, RolloutConfig
from stoker.control.plane import ControlPlane
from stoker.control.rollout_actions import Action
from stoker.control.stored_pools import current
from stoker.domain.specs import RuntimeTemplate

RolloutId = Annotated[str, Path(max_length=128)]
#: What every rollout route may answer besides its success; its writes also answer a
#: malformed `If-Match` (400) and a stale one (412).
_ERRORS = (401, 403, 404, 422, 503)


def _changes_schema(model: type[BaseModel], title: str) -> dict[str, dict[str, Any]]:
    """The JSON schema of some of `model`'s fields (any of them, none required) under
    `title`, with the schemas of its nested models, for the document's components."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    nested: dict[str, dict[str, Any]] = schema.pop("$defs", {})
    schema.pop("required", None)
    return {**nested, title: {**schema, "title": title, "minProperties": 1}}


#: The schemas of a template's fields, a process's or a pod's (`_document` adds them to
#: the OpenAPI document's components).
TEMPLATE_SCHEMAS = {
    **_changes_schema(ProcessConfig, "ProcessTemplateChanges"),
    **_changes_schema(PodConfig, "PodTemplateChanges"),
}
_TEMPLATE_SCHEMA = {
    "description": "Fields of the new template, laid over the pool's stable one: a "
    "process pool's `command`, `env`, `cwd`, `memory_mb`; a pod pool's `pod:` keys.",
    "anyOf": [
        {"$ref": "#/components/schemas/ProcessTemplateChanges"},
        {"$ref": "#/components/schemas/PodTemplateChanges"},
    ],
}


class RolloutIn(BaseModel):
    """`POST /v1/pools/{name}/rollouts`: the new template and how to roll it out."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    #: Fields of the new template, laid over the pool's stable template (validated by the
    #: template model of the pool's kind).
    template: Annotated[dict[str, Any], WithJsonSchema(_TEMPLATE_SCHEMA)] = Field(min_length=1)
    #: How to roll it out; None: the pool's default strategy.
    strategy: RolloutConfig | None = None


def new_template(stable: RuntimeTemplate, fields: dict[str, Any]) -> RuntimeTemplate:
    """The pool's stable template with `fields` laid over it; a 422 names each field that
    does not fit, in the words of the request's other problems."""
    try:
        return changed_template(stable, fields)
    except ValidationError as exc:
        raw = exc.errors(include_url=False, include_input=False)
        errors = [{**e, "loc": ("body", "template", *e["loc"])} for e in raw]
        raise RequestValidationError(errors) from None


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
            409,
            412,
            422,
            503,
        ),
    )
    async def start_rollout(
        request: Request,
        name: PoolName,
        body: RolloutIn,
        if_match: Annotated[str | None, Header()] = None,
    ) -> Response:
        """Start rolling the pool's new template out (superseding a rollout under way)."""
        principal_of(request.scope).check_admin()
        stored = current(await plane.pools.get(name), expected_generation(if_match))
        template = new_template(stored.spec.template, body.template)
        strategy = None if body.strategy is None else body.strategy.strategy()
        rollout = await plane.pools.propose(
            stored, template, now=plane.clock.now(), strategy=strategy
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
            f"{action.value}_rollout",
            f"{action.value.capitalize()} a rollout",
            200,
            400,
            409,
            412,
            *_ERRORS,
        ),
    )
    async def act(
        request: Request,
        name: PoolName,
        rollout_id: RolloutId,
        if_match: Annotated[str | None, Header()] = None,
    ) -> Response:
        """Pause (its share holds), resume (its step's interval starts again), abort (its
        revision retires, the stable one takes every claim) or promote (every new claim
        goes to its revision at once) a rollout under way; 409 once it has ended."""
        principal_of(request.scope).check_admin()
        generation = expected_generation(if_match)
        written = await plane.rollout_actions.act(name, rollout_id, action, generation=generation)
        return _answer(RolloutOut.of(written))
