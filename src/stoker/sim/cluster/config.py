"""`SimClusterConfig`: every knob of the simulated cluster, and its YAML form.

The dataclasses of each part (node pools, scheduler, kubelet, autoscaler, controllers,
background, API server, faults) carry the defaults and say where each comes from; this
module gathers them and reads a plain mapping (a scenario's YAML) into them, refusing
unknown keys with a `ConfigError` that names the key. A sketch of the YAML form:

    tick_s: 0.5
    priority_classes: {stoker-worker: 10000, stoker-placeholder: -10}
    node_pools:
      - name: default
        instance_types: [m5.xlarge, m5.2xlarge, {name: big, cpu: 96, memory_gib: 384,
                                                 price_per_hour: 4.6}]
        consolidate_after_s: 30          # null: Never
        budget_nodes: "10%"
        initial_nodes: {m5.2xlarge: 3}
        provisioning: {kind: lognormal, median: 60, sigma: 0.35}
    scheduler: {bind_rate: 50, bind_burst: 100}
    kubelet: {container_start: {kind: uniform, low: 3, high: 5}}
    autoscaler: {consolidation_interval_s: 10}
    background:
      target: {kind: diurnal, low: 2000, high: 6000, peak_s: 50400}
      archetypes: [tiny-stateless, {name: stateful-db, machine_share: 5}]
    api: {client_qps: 50, client_burst: 100, client_latency: {kind: lognormal,
                                                              median: 0.01, sigma: 0.5}}
    faults: [{at: 600, duration: 30, kind: lease_blip, client: replica-1}]
    track_labels: [stoker.dev/pool]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from stoker.domain.errors import ConfigError
from stoker.sim.cluster.autoscaler import AutoscalerConfig
from stoker.sim.cluster.client import FaultSpec
from stoker.sim.cluster.distributions import Distribution, distribution_from
from stoker.sim.cluster.kubelet import KubeletConfig
from stoker.sim.cluster.resources import INSTANCE_TYPES_BY_NAME, InstanceType
from stoker.sim.cluster.scheduler import SchedulerConfig
from stoker.sim.cluster.specs import (
    Archetype,
    ConsolidationPolicy,
    NodePoolConfig,
    Shape,
    Taint,
    WorkloadKind,
)
from stoker.sim.cluster.workloads import (
    BACKGROUND_PRIORITY_CLASSES,
    BIGFLEET_ARCHETYPES,
    BackgroundConfig,
    ConstantProfile,
    ControllerConfig,
    DemandProfile,
    DiurnalProfile,
    StepProfile,
)

#: Priority classes every simulated cluster knows: the background's and Kubernetes'
#: built-in system classes. `SimClusterConfig.priority_classes` adds to (or overrides)
#: these; a pod naming an unknown class gets priority 0.
DEFAULT_PRIORITY_CLASSES: Mapping[str, int] = {
    **BACKGROUND_PRIORITY_CLASSES,
    "system-cluster-critical": 2_000_000_000,
    "system-node-critical": 2_000_001_000,
}


@dataclass(frozen=True)
class ApiConfig:
    """The API server and the defaults of its client views.

    - `history_size` 10,000 changes of watch history per namespace (the fake's own
      default of 1,000 is for tests; a busy simulated namespace needs more);
    - `default_grace_s` 30 s: Kubernetes' default `terminationGracePeriodSeconds`;
    - `client_qps` 50 / `client_burst` 100: the per-client budget the duckgres
      incident ran under (a QPS-50 client), also kube-scheduler's client defaults;
    - `client_latency` none: every distinct latency is an instant the virtual clock must
      visit, so latency is opt-in (e.g. log-normal, median 10 ms);
    - `watch_latency_s` 0: how much later than its write a watch delivers a change
      (opt-in likewise; the scale test's scenarios set one, `stoker.sim.scenario`).
    """

    history_size: int = 10_000
    default_grace_s: float = 30.0
    client_qps: float = 50.0
    client_burst: int = 100
    client_latency: Distribution | None = None
    watch_latency_s: float = 0.0


@dataclass(frozen=True)
class SimClusterConfig:
    """Everything about one simulated cluster.

    `namespace` is the workers' namespace (what `SimCluster.api` and client views act
    in); the background runs in `background.namespace`. `tick_s` is the grid the
    cluster's own events fall on (see `stoker.sim.cluster.timeline`). `track_labels` are pod
    label keys whose values the snapshot breaks requested resources down by.
    """

    namespace: str = "default"
    tick_s: float = 0.5
    priority_classes: Mapping[str, int] = field(default_factory=dict)
    node_pools: tuple[NodePoolConfig, ...] = field(default_factory=lambda: (NodePoolConfig(),))
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kubelet: KubeletConfig = field(default_factory=KubeletConfig)
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    controllers: ControllerConfig = field(default_factory=ControllerConfig)
    background: BackgroundConfig = field(default_factory=BackgroundConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    faults: tuple[FaultSpec, ...] = ()
    track_labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.tick_s <= 0:
            raise ConfigError("tick_s must be > 0")
        if not self.node_pools:
            raise ConfigError("at least one node pool is needed")
        names = [pool.name for pool in self.node_pools]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate node pool names in {names}")

    def priorities(self) -> dict[str, int]:
        """The priority of every known class (defaults plus this config's)."""
        return {**DEFAULT_PRIORITY_CLASSES, **self.priority_classes}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> SimClusterConfig:
        """Read the YAML form (see the module docstring); unknown keys are errors."""
        return _build(
            cls,
            data,
            "cluster",
            {
                "priority_classes": lambda v: _int_map(v, "priority_classes"),
                "node_pools": lambda v: tuple(_node_pool(item) for item in _list(v, "node_pools")),
                "scheduler": lambda v: _build(SchedulerConfig, _map(v, "scheduler"), "scheduler"),
                "kubelet": _kubelet,
                "autoscaler": lambda v: _build(
                    AutoscalerConfig, _map(v, "autoscaler"), "autoscaler"
                ),
                "controllers": lambda v: _build(
                    ControllerConfig, _map(v, "controllers"), "controllers"
                ),
                "background": _background,
                "api": lambda v: _build(
                    ApiConfig,
                    _map(v, "api"),
                    "api",
                    {"client_latency": lambda d: _optional_distribution(d, "client_latency")},
                ),
                "faults": lambda v: tuple(
                    FaultSpec.from_mapping(_map(item, "fault")) for item in _list(v, "faults")
                ),
                "track_labels": lambda v: tuple(
                    _str(item, "track_labels") for item in _list(v, "track_labels")
                ),
            },
        )


T = TypeVar("T")
Converter = Callable[[Any], Any]


def _build(
    cls: type[T], data: Mapping[str, Any], what: str, special: Mapping[str, Converter] | None = None
) -> T:
    """A dataclass from a mapping: special converters by key, else scalar checks by type."""
    special = special or {}
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - set(fields)
    if unknown:
        raise ConfigError(f"{what}: unknown keys {sorted(unknown)}; known: {sorted(fields)}")
    values: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{what}.{key}"
        if key in special:
            values[key] = special[key](value)
        else:
            values[key] = _scalar(str(fields[key].type), value, where)
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{what}: {error}") from None


def _scalar(annotation: str, value: Any, where: str) -> Any:
    optional = annotation.endswith(" | None")
    base = annotation.removesuffix(" | None")
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: a value is required")
    if base == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if base == "str":
        return _str(value, where)
    if base == "Distribution":
        return distribution_from(value, what=where)
    raise ConfigError(f"{where}: cannot be set from configuration")


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def _map(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    return value


def _list(value: Any, where: str) -> Sequence[Any]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ConfigError(f"{where}: expected a list, got {value!r}")
    return value


def _int_map(value: Any, where: str) -> dict[str, int]:
    result: dict[str, int] = {}
    for key, item in _map(value, where).items():
        result[_str(key, where)] = _scalar("int", item, f"{where}.{key}")
    return result


def _optional_distribution(value: Any, where: str) -> Distribution | None:
    return None if value is None else distribution_from(value, what=where)


def _instance_type(value: Any) -> InstanceType:
    if isinstance(value, str):
        known = INSTANCE_TYPES_BY_NAME.get(value)
        if known is None:
            raise ConfigError(
                f"unknown instance type {value!r}; known: {sorted(INSTANCE_TYPES_BY_NAME)}"
            )
        return known
    return _build(InstanceType, _map(value, "instance type"), "instance type")


def _node_pool(value: Any) -> NodePoolConfig:
    data = _map(value, "node pool")
    where = f"node pool {data.get('name', 'default')!r}"
    return _build(
        NodePoolConfig,
        data,
        where,
        {
            "instance_types": lambda v: tuple(_instance_type(t) for t in _list(v, where)),
            "labels": lambda v: {_str(k, where): _str(x, where) for k, x in _map(v, where).items()},
            "taints": lambda v: tuple(
                _build(Taint, _map(t, "taint"), f"{where} taint") for t in _list(v, where)
            ),
            "provisioning": lambda v: distribution_from(v, what=f"{where}.provisioning"),
            "consolidation_policy": lambda v: _enum(ConsolidationPolicy, v, where),
            "consolidate_after_s": lambda v: (
                None if v in (None, "Never") else _scalar("float", v, where)
            ),
            "budget_nodes": lambda v: str(v),
            "initial_nodes": lambda v: _int_map(v, f"{where}.initial_nodes"),
        },
    )


def _kubelet(value: Any) -> KubeletConfig:
    return _build(
        KubeletConfig,
        _map(value, "kubelet"),
        "kubelet",
        {
            "image_pull_by_image": lambda v: {
                _str(k, "kubelet"): distribution_from(d, what=f"kubelet.image_pull_by_image.{k}")
                for k, d in _map(v, "kubelet.image_pull_by_image").items()
            },
        },
    )


def _profile(value: Any) -> DemandProfile:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return ConstantProfile(float(value))
    data = dict(_map(value, "background.target"))
    kind = data.pop("kind", None)
    if kind == "constant":
        return _build(ConstantProfile, data, "background.target")
    if kind == "diurnal":
        return _build(DiurnalProfile, data, "background.target")
    if kind == "steps":
        steps = tuple(
            _step(s, f"background.target.steps[{i}]")
            for i, s in enumerate(_list(data.pop("steps", ()), "background.target.steps"))
        )
        if data:
            raise ConfigError(f"background.target: unknown keys {sorted(data)}")
        return StepProfile(tuple(sorted(steps)))
    raise ConfigError("background.target: a number or {kind: constant|diurnal|steps, ...}")


def _step(value: Any, where: str) -> tuple[float, float]:
    """One `[at_s, target]` step of a stepped profile."""
    pair = _list(value, where)
    if len(pair) != 2:
        raise ConfigError(f"{where}: expected [at_s, target], got {value!r}")
    return _scalar("float", pair[0], where), _scalar("float", pair[1], where)


def _archetype(value: Any) -> Archetype:
    catalogue = {archetype.name: archetype for archetype in BIGFLEET_ARCHETYPES}
    if isinstance(value, str):
        if value not in catalogue:
            raise ConfigError(f"unknown archetype {value!r}; known: {sorted(catalogue)}")
        return catalogue[value]
    data = dict(_map(value, "archetype"))
    name = _str(data.get("name"), "archetype.name")
    where = f"archetype {name!r}"
    special: dict[str, Converter] = {
        "shapes": lambda v: tuple(_build(Shape, _map(s, where), where) for s in _list(v, where)),
        "kind": lambda v: _enum(WorkloadKind, v, where),
        "replicas": lambda v: distribution_from(v, what=f"{where}.replicas"),
        "lifetime": lambda v: distribution_from(v, what=f"{where}.lifetime"),
        "pdb_max_unavailable": lambda v: _int_or_percent(v, where),
        "pdb_min_available": lambda v: _int_or_percent(v, where),
    }
    if name in catalogue:
        overrides = _build_partial(Archetype, data, where, special)
        try:
            return dataclasses.replace(catalogue[name], **overrides)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{where}: {error}") from None
    return _build(Archetype, data, where, special)


def _build_partial(
    cls: type[Any], data: Mapping[str, Any], what: str, special: Mapping[str, Converter]
) -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
        raise ConfigError(f"{what}: unknown keys {sorted(unknown)}")
    return {
        key: special[key](value) if key in special else _scalar(str(fields[key].type), value, key)
        for key, value in data.items()
    }


def _int_or_percent(value: Any, where: str) -> int | str | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, str) and value.endswith("%"):
        return value
    raise ConfigError(f"{where}: expected an integer or a percentage, got {value!r}")


def _background(value: Any) -> BackgroundConfig:
    return _build(
        BackgroundConfig,
        _map(value, "background"),
        "background",
        {
            "target": _profile,
            "archetypes": lambda v: tuple(_archetype(a) for a in _list(v, "archetypes")),
        },
    )


E = TypeVar("E")


def _enum(enum: Callable[[str], E], value: Any, where: str) -> E:
    try:
        return enum(_str(value, where))
    except ValueError:
        raise ConfigError(f"{where}: invalid value {value!r}") from None
