"""The `pools` section: one pool with its worker template, derived from the domain's specs.

A pool's settings are `PoolSpec`'s fields, a local worker's are `ProcessTemplate`'s and a
pod's are `PodTemplate`'s (`schema.derived_section`): their defaults, bounds and docs are
declared there, once. This module adds what only the config knows: the pool's `command` or
`pod`, the text a worker can be handed, and Kubernetes' rules for a pod's names,
quantities and tolerations.

The worker template is one model, `ProcessConfig` or `PodConfig`, whichever surface it
comes from: the config file, `PATCH`/rollouts of the HTTP API, the CLI and the SDK
(`stoker.config.changes`). Both are strict: a JSON request's `true` or `"64"` is not a
number there. The config file is read leniently (`load_config`): its `STOKER_*` overrides
are text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, model_validator

from stoker.config.names import (
    DnsSubdomain,
    EnvName,
    Image,
    LabelValue,
    NonEmptyWorkerText,
    PoolName,
    QualifiedName,
    Quantity,
    WorkerText,
)
from stoker.config.problems import Loc, raise_problems
from stoker.config.schema import DerivedSection, Section, derived_section, spec_fields
from stoker.domain.rollouts import (
    DEFAULT_HOLD_DEADLINE_S,
    DEFAULT_MAX_FAILURE_RATIO,
    DEFAULT_STEP_INTERVAL_S,
    DEFAULT_STEPS,
    Strategy,
    canary_problems,
    strategy_from,
)
from stoker.domain.specs import PodTemplate, PoolSpec, ProcessTemplate

#: The demo worker shipped with stoker; `{python}` is the interpreter running the server.
DEMO_COMMAND = [
    "{python}",
    "-m",
    "stoker.demo_worker",
    "--port",
    "{port}",
    "--worker-id",
    "{worker_id}",
]
#: A worker process's command line: the program and its arguments, none of them empty.
Command = Annotated[list[NonEmptyWorkerText], Field(min_length=1, max_length=4096)]

#: Labels and annotations the Kubernetes runtime sets itself; a template may not set them.
_RESERVED_LABEL_PREFIX = "stoker.dev/"
_RESERVED_LABELS = frozenset({"app.kubernetes.io/managed-by"})
_RESERVED_ANNOTATIONS = frozenset({"karpenter.sh/do-not-disrupt"})
#: The API server's limit on an object's annotations, keys and values together.
_ANNOTATIONS_MAX_BYTES = 256 * 1024


class TolerationConfig(Section):
    """One toleration of a worker pod (Kubernetes' `tolerationSeconds` spelling accepted)."""

    #: The taint key the toleration matches; null with `Exists` matches every taint.
    key: QualifiedName | None = None
    #: `Equal` matches the taint's value; `Exists` any value.
    operator: Literal["Equal", "Exists"] = "Equal"
    #: The taint value to match (with `Equal`).
    value: LabelValue | None = None
    #: The taint effect to match; null: every effect.
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    #: With `NoExecute`: how long the pod stays on a tainted node.
    toleration_seconds: int | None = Field(None, alias="tolerationSeconds", ge=0)

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, strict=True)

    @model_validator(mode="after")
    def _consistent(self) -> TolerationConfig:
        # The API server's own rules; a pod breaking them is refused at every spawn.
        if self.key is None and self.operator != "Exists":
            raise ValueError("a toleration without a key must use operator Exists")
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("a toleration with operator Exists takes no value")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds needs effect NoExecute")
        return self

    def as_mapping(self) -> dict[str, Any]:
        """The toleration in Kubernetes' spelling, without unset fields."""
        body = {
            "key": self.key,
            "operator": self.operator,
            "value": self.value,
            "effect": self.effect,
            "tolerationSeconds": self.toleration_seconds,
        }
        return {k: v for k, v in body.items() if v is not None}


#: `PodTemplate`'s fields the config checks further: what the API server would refuse at
#: every spawn is refused at start-up. A toleration is validated, then kept as the mapping
#: the template holds.
_POD_RULES: dict[str, Any] = {
    "image": Image,
    "command": list[WorkerText],
    "args": list[WorkerText],
    "env": dict[EnvName, WorkerText],
    "cpu": Quantity,
    "memory": Quantity,
    "node_selector": dict[QualifiedName, LabelValue],
    "tolerations": list[Annotated[TolerationConfig, AfterValidator(TolerationConfig.as_mapping)]],
    "priority_class": DnsSubdomain | None,
    "service_account": DnsSubdomain | None,
    "labels": dict[QualifiedName, LabelValue],
    "annotations": dict[QualifiedName, WorkerText],
}


class _PodBase(DerivedSection):
    model_config = ConfigDict(strict=True)

    @model_validator(mode="after")
    def _not_stokers_own(self) -> _PodBase:
        # The runtime sets these itself (the fleet label scopes every list and watch;
        # do-not-disrupt follows the worker's state): a template value would be dropped.
        problems: list[tuple[Loc, str]] = []
        for key in self.labels:
            if key.startswith(_RESERVED_LABEL_PREFIX) or key in _RESERVED_LABELS:
                problems.append((("labels", key), "is set by stoker itself"))
        for key in self.annotations:
            if key in _RESERVED_ANNOTATIONS:
                problems.append((("annotations", key), "is set by stoker itself"))
        size = sum(len(k.encode()) + len(v.encode()) for k, v in self.annotations.items())
        if size > _ANNOTATIONS_MAX_BYTES:
            problems.append(
                (
                    ("annotations",),
                    f"total {size:,} bytes (keys and values), more than the API server's "
                    f"{_ANNOTATIONS_MAX_BYTES:,} (256 KiB)",
                )
            )
        raise_problems(problems)
        return self


if TYPE_CHECKING:
    PodConfig = _PodBase
else:
    PodConfig = derived_section(
        "PodConfig",
        _PodBase,
        """A worker pod (runtime.kind: kubernetes): its image, command, resources and
        placement.

        `{port}` and `{worker_id}` are replaced in `command`, `args` and `env`. Requests
        equal limits (`cpu`, `memory`), so workers get the Guaranteed QoS class.
        """,
        spec_fields(PodTemplate, refine=_POD_RULES),
    )


#: `ProcessTemplate`'s fields the config checks further: text exec can take.
_PROCESS_RULES: dict[str, Any] = {
    "env": dict[EnvName, WorkerText],
    "cwd": NonEmptyWorkerText | None,
}
#: A process template's fields but its command line: `ProcessConfig`'s, and a pool's own.
_PROCESS_FIELDS = spec_fields(ProcessTemplate, omit={"argv"}, refine=_PROCESS_RULES)


class _ProcessBase(DerivedSection):
    model_config = ConfigDict(strict=True)

    #: argv of a worker process (never run through a shell); `{port}`, `{worker_id}` and
    #: `{python}` are replaced when a worker starts.
    command: Command


if TYPE_CHECKING:
    ProcessConfig = _ProcessBase
else:
    ProcessConfig = derived_section(
        "ProcessConfig",
        _ProcessBase,
        """A worker process (runtime.kind: local): its command line, environment, working
        directory and memory. In the config file these are a pool's own keys.""",
        _PROCESS_FIELDS,
    )


class RolloutConfig(Section):
    """How a new template of the pool takes over (docs/guides/rollouts.md): a canary
    hands `steps` percent of new claims to it, one step per `step_interval_s`, and rolls
    back when its failures reach `max_failure_ratio`; `replace` switches at once."""

    model_config = ConfigDict(strict=True)

    #: `canary` hands the new revision a growing share of new claims; `replace` switches at
    #: once.
    kind: Literal["canary", "replace"] = "canary"
    #: Percent of new claims the new revision gets, step by step (increasing, ending at
    #: 100).
    steps: list[int] = Field(default_factory=lambda: list(DEFAULT_STEPS))
    #: Seconds each step lasts before the next, while the new revision is healthy.
    step_interval_s: float = DEFAULT_STEP_INTERVAL_S
    #: The share of the new revision's spawns and activations that fail at which the rollout
    #: rolls back.
    max_failure_ratio: float = DEFAULT_MAX_FAILURE_RATIO
    #: Seconds a step may wait for the new revision's warm workers before the rollout pauses.
    hold_deadline_s: float = DEFAULT_HOLD_DEADLINE_S

    @model_validator(mode="after")
    def _valid(self) -> RolloutConfig:
        # Each problem under its own key (`steps[1]`), not under the rollout's.
        if self.kind == "replace":
            canary_keys = sorted(self.model_fields_set - {"kind"})
            raise_problems([((key,), "is for a canary rollout only") for key in canary_keys])
        else:
            raise_problems(
                canary_problems(
                    self.steps, self.step_interval_s, self.max_failure_ratio, self.hold_deadline_s
                )
            )
        return self

    def strategy(self) -> Strategy:
        """The domain's strategy."""
        return strategy_from(self.model_dump())


class _PoolBase(DerivedSection):
    #: The pool's name, in URLs, metric labels and process labels.
    name: PoolName
    #: argv of a worker process (never run through a shell); `{port}`, `{worker_id}` and
    #: `{python}` are replaced when a worker starts.
    command: Command | None = None
    #: The worker pod of the kubernetes runtime.
    pod: PodConfig | None = None
    #: The default strategy of a rollout when the pool's template changes.
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)

    @model_validator(mode="after")
    def _target_within_cap(self) -> _PoolBase:
        if self.max_workers and self.warm_target > self.max_workers:
            raise ValueError(
                f"warm_target ({self.warm_target}) exceeds max_workers ({self.max_workers})"
            )
        return self


if TYPE_CHECKING:
    PoolConfig = _PoolBase
else:
    PoolConfig = derived_section(
        "PoolConfig",
        _PoolBase,
        """One pool: a name, a worker template and the settings of `PoolSpec`.

        Exactly one of `command` (runtime.kind: local) and `pod` (runtime.kind: kubernetes);
        `StokerConfig` checks which one against the runtime. `env`, `cwd` and `memory_mb`
        are `ProcessTemplate`'s: the local runtime's only.
        """,
        {
            **_PROCESS_FIELDS,
            **spec_fields(PoolSpec, omit={"name", "template", "revision"}),
        },
    )


def default_pools() -> list[PoolConfig]:
    """The pools of a config that names none: the demo worker, two kept warm."""
    return [PoolConfig.model_validate({"name": "demo", "command": DEMO_COMMAND, "warm_target": 2})]
