"""From the validated config to the domain objects the control plane runs on."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from stoker.config.changes import template_of
from stoker.config.models import StokerConfig
from stoker.config.pools import PoolConfig, ProcessConfig
from stoker.config.problems import ConfigKeyError
from stoker.config.schema import spec_values
from stoker.config.sections import KubernetesRuntimeConfig
from stoker.domain.errors import ConfigError
from stoker.domain.rollouts import Strategy
from stoker.domain.specs import (
    OrgSpec,
    PlaneSettings,
    PoolSpec,
    ProcessTemplate,
    RuntimeTemplate,
)


@dataclass(frozen=True, slots=True)
class DomainConfig:
    """What the control plane is built from."""

    pools: list[PoolSpec]
    orgs: list[OrgSpec]
    settings: PlaneSettings
    #: Each pool's default rollout strategy.
    strategies: dict[str, Strategy] = dataclasses.field(default_factory=dict)


def to_domain(config: StokerConfig) -> DomainConfig:
    """Convert the validated config into `PoolSpec`, `OrgSpec` and `PlaneSettings`.

    Raises `ConfigKeyError` when a domain object rejects a value (naming the pool).
    """
    pools = []
    for i, pool in enumerate(config.pools):
        template = _template(i, pool)
        try:
            settings = spec_values(pool, PoolSpec, omit={"name", "template", "revision"})
            pools.append(PoolSpec(name=pool.name, template=template, **settings))
        except ConfigError as exc:
            raise ConfigKeyError(("pools", i), str(exc)) from None
    return DomainConfig(
        pools=pools,
        orgs=list(config.orgs),
        settings=plane_settings(config),
        strategies={pool.name: pool.rollout.strategy() for pool in config.pools},
    )


def _template(i: int, pool: PoolConfig) -> RuntimeTemplate:
    """The pool's `pod` as a `PodTemplate`, or its `command` and process keys as a
    `ProcessTemplate`: through the one template model the API validates with too."""
    if pool.pod is not None:
        return template_of(pool.pod)
    if pool.command is not None:
        process = spec_values(pool, ProcessTemplate, omit={"argv"})
        # The file's values were read leniently already (`load_config`).
        model = ProcessConfig.model_validate({"command": pool.command, **process}, strict=False)
        return template_of(model)
    # Only a config built without validation (model_construct) gets here.
    raise ConfigKeyError(("pools", i), "needs a command or a pod")


def plane_settings(config: StokerConfig) -> PlaneSettings:
    """`intervals`, with the spawn budget sized to the runtime's API budget.

    On Kubernetes every spawn is a request against the client's qps/burst budget: the spawn
    bucket is that budget, or an explicitly configured `intervals.spawn_rate`/`spawn_burst`
    when it is smaller (a larger one would only queue spawns inside the client).
    """
    settings = config.intervals
    runtime = config.runtime
    if not isinstance(runtime, KubernetesRuntimeConfig):
        return settings
    given = config.intervals_given()
    rate = min(settings.spawn_rate, runtime.qps) if "spawn_rate" in given else runtime.qps
    burst = min(settings.spawn_burst, runtime.burst) if "spawn_burst" in given else runtime.burst
    return dataclasses.replace(settings, spawn_rate=rate, spawn_burst=burst)
