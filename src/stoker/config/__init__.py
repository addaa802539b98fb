"""Configuration: one YAML file validated by pydantic, plus `STOKER_*` environment overrides.

`load_config(path)` reads the file (or nothing: every key has an embedded default), applies
the environment overrides and validates the result. Every model forbids unknown keys, so a
typo is an error that names the key, never a silently ignored setting. `to_domain` turns the
validated config into the domain objects the control plane runs on.

`runtime.kind` picks the workers' runtime (`local` processes with a `command` per pool, or
`kubernetes` pods with a `pod` per pool) and `leader_election` the janitor's elector
(`none`, `store`, `kubernetes`, or `auto`: `store` on PostgreSQL, `none` on SQLite).
Rules that span sections (a pool's template must match the runtime, headroom needs a
placeholder priority class, ...) are checked on the whole config and reported under the
key to change.

The parts, one job each:

- `names`: Kubernetes names and quantities, checked at start-up;
- `schema`: the base of every section, and sections derived from the domain's dataclasses
  (a setting's default, bounds and doc are declared once, in `stoker.domain.specs`);
- `sections`: the store's options, the runtime, leader election, the HTTP API;
- `activation`: the fleet activation key (the key, its file, or one next to SQLite);
- `pools`: a pool and its worker template (`PoolSpec`, `ProcessTemplate`, `PodTemplate`);
- `rules`: checks that span sections; `problems`: problems under the key to change;
- `models`: `StokerConfig`, the whole config, and the values it derives;
- `loading`: the YAML file, the environment, one error line per problem;
- `convert`: the domain objects.
"""

from stoker.config.activation import ActivationConfig, load_activation_key
from stoker.config.convert import DomainConfig, plane_settings, to_domain
from stoker.config.loading import ENV_PREFIX, LoadedConfig, format_errors, load_config
from stoker.config.models import StokerConfig
from stoker.config.names import LABEL_VALUE_RULE, is_label_value
from stoker.config.pools import DEMO_COMMAND, PodConfig, PoolConfig, TolerationConfig
from stoker.config.problems import ConfigKeyError, ConfigProblems
from stoker.config.sections import (
    RUNTIME_KINDS,
    ApiConfig,
    KubernetesRuntimeConfig,
    LeaderElectionConfig,
    LocalRuntimeConfig,
    PlaceholderSize,
    PostgresOptions,
    RuntimeConfig,
)
from stoker.config.tracing import TracingConfig

__all__ = [
    "DEMO_COMMAND",
    "ENV_PREFIX",
    "LABEL_VALUE_RULE",
    "RUNTIME_KINDS",
    "ActivationConfig",
    "ApiConfig",
    "ConfigKeyError",
    "ConfigProblems",
    "DomainConfig",
    "KubernetesRuntimeConfig",
    "LeaderElectionConfig",
    "LoadedConfig",
    "LocalRuntimeConfig",
    "PlaceholderSize",
    "PodConfig",
    "PoolConfig",
    "PostgresOptions",
    "RuntimeConfig",
    "StokerConfig",
    "TolerationConfig",
    "TracingConfig",
    "format_errors",
    "is_label_value",
    "load_activation_key",
    "load_config",
    "plane_settings",
    "to_domain",
]
