"""Scenarios of `stoker scaletest`: what to run, against which cluster, under which load.

A scenario is one YAML file (the shipped ones: `stoker/sim/scenarios/`). Every key has a
default here, and the comment next to each default says where it comes from (a research
finding, a Kubernetes or stoker default, or an assumption made explicit). Unknown keys are
refused with the key named, so a typo never silently falls back to a default. A sketch:

    name: cold-ramp
    duration_s: 900
    target_hot: 30
    policies: [stoker, static-target]
    control_plane: {replicas: 2}
    pool: {warm_target: 5}
    tenants:
      - {name: tenant, count: 30, arrival: {initial: 1, start_s: 60}, duration: 3600}
    cluster: {node_pools: [{name: workers, initial_nodes: {m5.4xlarge: 12}}]}
    short: {duration_s: 300}

- `cluster` is the simulated cluster in `SimClusterConfig`'s YAML form (see
  `stoker.sim.cluster.config`), laid over `BASE_CLUSTER` (the priority classes of workers and
  placeholders, the labels the report breaks resources down by);
- `policies` lists what to compare, each run from a fresh cluster and store with the same
  seed: a policy kind's name, or `{name, policy, params, pool, control_plane, cluster,
  activator}` where the mappings are laid over the scenario's own sections for that run
  only (e.g. headroom off, a bare-pod background);
- `short` is laid over the whole file by `--short`: the CI form, seconds of wall time.

Laying over (`deep_merge`) merges mappings key by key and replaces everything else,
lists included.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)

from stoker.adapters._election import check_timings
from stoker.config.sections import SessionNodes
from stoker.domain.errors import ConfigError
from stoker.domain.states import ClaimMode, Reuse
from stoker.sim.cluster.config import SimClusterConfig
from stoker.sim.cluster.distributions import (
    Buckets,
    Constant,
    Distribution,
    Exponential,
    LogNormal,
    Uniform,
    distribution_from,
)
from stoker.sim.cluster.resources import cpu_millis, memory_bytes
from stoker.sim.defaults import (
    BASE_CLUSTER,
    PLACEHOLDER_PRIORITY_CLASS,
    WORKER_PRIORITY_CLASS,
    with_node_pool_defaults,
)
from stoker.sim.policies import (
    POLICY_KINDS,
    POLICY_PARAMS,
    KnativeKpaParams,
    NoParams,
    ParamsModel,
    PercentHeadroomParams,
    StaticTargetParams,
)

__all__ = [
    "BASE_CLUSTER",
    "PLACEHOLDER_PRIORITY_CLASS",
    "POLICY_KINDS",
    "WORKER_PRIORITY_CLASS",
    "KnativeKpaParams",
    "NoParams",
    "PercentHeadroomParams",
    "StaticTargetParams",
]


#: Where `load_scenario` looks for a scenario given by name: ./scenarios (a user's own),
#: then the scenarios shipped in the package (`stoker/sim/scenarios/`).
SCENARIO_DIRS = (Path("scenarios"), Path(__file__).resolve().parent / "scenarios")

_HOUR = 3600.0
#: The longest run the simulator takes (a scenario's duration, a replayed log's span): a
#: year. Beyond it is a typo (milliseconds for seconds, a stray digit), and a run of it
#: would go on for days of wall time.
MAX_RUN_S = 366 * 24 * _HOUR
#: The latest wall-clock second a run may reach: 9999-12-31T23:59:59Z, the last second a
#: date can name (the store keeps times as dates and integers).
LATEST_S = 253_402_300_799.0
#: Kubernetes' largest tested cluster ("Considerations for large clusters"): 5,000 nodes
#: and 150,000 pods. A simulated cluster, pool or headroom beyond them is a typo.
MAX_NODES = 5_000
MAX_PODS = 150_000
#: The background's largest target: 5,000 nodes of 100 cores.
MAX_BACKGROUND_CORES = 500_000.0
#: Control-plane replicas (duckgres ran 6).
MAX_REPLICAS = 100
#: Tenants (orgs) of one scenario.
MAX_ORGS = 100_000
#: Sessions one run may open, and candidates its arrival search may draw (each tenant's
#: peak rate over the run: `count x rate_per_h x (1 + daily amplitude) x burst factors`).
#: Twenty times a week of a million claims; a run of them would take days.
MAX_ARRIVALS = 20_000_000
#: Rounds of one periodic activity over a run (samples, checks, passes, renewals...):
#: ten million, a sample every 3 s for a year.
MAX_ROUNDS = 10_000_000


def _distribution(value: Any) -> Distribution:
    try:
        return distribution_from(value)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def _optional_distribution(value: Any) -> Distribution | None:
    return None if value is None else _distribution(value)


def distribution_form(value: Distribution | None) -> Any:
    """A distribution in the YAML form `distribution_from` reads (None stays None)."""
    if value is None:
        return None
    if isinstance(value, Constant):
        return value.value
    if isinstance(value, Uniform):
        return {"kind": "uniform", "low": value.low, "high": value.high}
    if isinstance(value, Exponential):
        return {"kind": "exponential", "mean": value.mean_value}
    if isinstance(value, LogNormal):
        form: dict[str, Any] = {"kind": "lognormal", "median": value.median, "sigma": value.sigma}
        if value.cap is not None:
            form["cap"] = value.cap
        return form
    if isinstance(value, Buckets):
        rows = [[b.weight, b.low, b.high] for b in value.buckets]
        return {"kind": "buckets", "buckets": rows, "cap": value.cap}
    raise TypeError(f"no YAML form for {value!r}")


# Dumped in the YAML form, so that a dumped scenario validates again (policy views).
Dist = Annotated[
    Distribution,
    PlainValidator(_distribution),
    PlainSerializer(distribution_form, return_type=Any),
]
OptionalDist = Annotated[
    Distribution | None,
    PlainValidator(_optional_distribution),
    PlainSerializer(distribution_form, return_type=Any),
]


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, arbitrary_types_allowed=True, allow_inf_nan=False
    )


# -- the load ------------------------------------------------------------------------------


class DailyCycle(_Model):
    """A cosine day laid over a tenant's arrival rate: the rate times
    `1 + amplitude * cos(2 pi (t - peak_s) / period_s)`, so `rate_per_h` is the daily mean."""

    #: 0.8: the night's rate is a ninth of the afternoon's ((1 - 0.8) / (1 + 0.8)), an
    #: assumption for interactive use concentrated in working hours.
    amplitude: float = Field(0.8, ge=0, le=1)
    #: 14:00, the peak of the cluster's own diurnal background (`DiurnalProfile`).
    peak_s: float = 14 * _HOUR
    period_s: float = Field(24 * _HOUR, gt=0)


class Burst(_Model):
    """A window in which the rate is multiplied by `factor`; `sessions` open at its start."""

    at_s: float = Field(ge=0)
    duration_s: float = Field(0.0, ge=0)
    factor: float = Field(1.0, ge=0)
    sessions: int = Field(0, ge=0)


class Arrival(_Model):
    """When a tenant's sessions arrive: a Poisson process with a time-varying rate.

    The rate is `rate_per_h`, ramped linearly from 0 over `ramp_s` after `start_s`, times
    the daily cycle, times any burst's factor, and 0 outside [start_s, stop_s). `initial`
    sessions open at once at `start_s` (a tenant that arrives with work to do).
    """

    rate_per_h: float = Field(0.0, ge=0)
    start_s: float = Field(0.0, ge=0)
    stop_s: float | None = None
    initial: int = Field(0, ge=0)
    ramp_s: float = Field(0.0, ge=0)
    daily: DailyCycle | None = None
    bursts: tuple[Burst, ...] = ()

    def rate_at(self, t: float) -> float:
        """Sessions per second at `t` seconds after the run started."""
        if t < self.start_s or (self.stop_s is not None and t >= self.stop_s):
            return 0.0
        rate = self.rate_per_h / _HOUR
        if self.ramp_s > 0:
            rate *= min(1.0, (t - self.start_s) / self.ramp_s)
        if self.daily is not None:
            phase = 2 * math.pi * (t - self.daily.peak_s) / self.daily.period_s
            rate *= 1 + self.daily.amplitude * math.cos(phase)
        for burst in self.bursts:
            if burst.at_s <= t < burst.at_s + burst.duration_s:
                rate *= burst.factor
        return rate

    def max_rate(self) -> float:
        """An upper bound of `rate_at` (the thinning envelope)."""
        rate = self.rate_per_h / _HOUR
        if self.daily is not None:
            rate *= 1 + self.daily.amplitude
        factors = [burst.factor for burst in self.bursts if burst.factor > 1]
        return rate * math.prod(factors)


class TenantGroup(_Model):
    """`count` tenants (orgs) with the same behaviour, named `name-000`, `name-001`, ...
    (just `name` when `count` is 1)."""

    name: str = Field(min_length=1)
    count: int = Field(1, ge=1, le=MAX_ORGS)
    arrival: Arrival = Arrival()
    #: How long a session holds its worker. Exponential, mean 10 minutes: an assumption
    #: (interactive query sessions; duckgres' hot-idle TTLs are minutes).
    duration: Dist = Exponential(600.0)
    mode: ClaimMode = ClaimMode.PREFER_WARM
    #: The lease each claim asks for; the client renews at half of it. 10 minutes, an
    #: assumption that keeps renewals (one store write each) a small share of the work.
    #: 1 s to a day, as the API takes a claim's lease.
    lease_s: float = Field(600.0, ge=1, le=86_400)
    #: The claim's own hot_idle TTL (None: the org's, then the pool's, then 60 s).
    ttl_s: float | None = None
    #: How long a claim may wait for a worker (None: the pool's `claim_timeout_s`).
    claim_timeout_s: float | None = None
    #: The org's cap in the pool (None: the pool's `max_workers_per_org`).
    max_workers: int | None = Field(None, ge=0)
    hot_idle_ttl_s: float | None = None
    min_hot_idle: int | None = Field(None, ge=0)
    #: Share of sessions whose client vanishes right after the claim (never renews, never
    #: releases): the lease must expire. 0: every client behaves.
    abandon: float = Field(0.0, ge=0, le=1)
    #: A failed claim is tried again this many times (a client reconnecting); 0: the
    #: session is lost. The back-off starts at `retry_backoff_s` and doubles up to 60 s,
    #: with equal jitter: AWS's "Exponential Backoff And Jitter" (2015), as client-go's
    #: and gRPC's reconnect back-offs grow (x2 and x1.6, capped).
    retries: int = Field(0, ge=0)
    retry_backoff_s: float = Field(5.0, ge=0)
    retry_backoff_factor: float = Field(2.0, ge=1)
    retry_backoff_max_s: float = Field(60.0, ge=0)

    def org_names(self) -> list[str]:
        """The orgs of this group."""
        if self.count == 1:
            return [self.name]
        width = max(3, len(str(self.count - 1)))
        return [f"{self.name}-{i:0{width}d}" for i in range(self.count)]

    def arrival_bound(self, duration_s: float) -> float:
        """An upper bound of the sessions this group opens in a run of `duration_s`, and of
        the candidates its arrival search draws: its peak rate over its active span, plus
        the sessions it opens at once."""
        arrival = self.arrival
        end = duration_s if arrival.stop_s is None else min(arrival.stop_s, duration_s)
        span = end - arrival.start_s
        drawn = arrival.max_rate() * span if span > 0 else 0.0
        batches = arrival.initial if arrival.start_s < duration_s else 0
        batches += sum(burst.sessions for burst in arrival.bursts if burst.at_s < duration_s)
        return self.count * (drawn + batches)


# -- the control plane ---------------------------------------------------------------------


class PoolConfig(_Model):
    """The one pool the scenario's tenants claim from (a Kubernetes pod template)."""

    name: str = "workers"
    image: str = "registry.sim.example/worker:1"
    #: 2 cores / 4 GiB: an assumption (duckgres' default is 8 / 16 GiB; smaller workers
    #: put more of them on a node, which is what a fleet simulation exercises).
    cpu: str = "2"
    memory: str = "4Gi"
    warm_target: int = Field(0, ge=0, le=MAX_PODS)
    #: 0 = unbounded: in cluster mode the cluster bounds the fleet (duckgres #597).
    max_workers: int = Field(0, ge=0, le=MAX_PODS)
    max_workers_per_org: int = Field(0, ge=0, le=MAX_PODS)
    #: stoker's and duckgres' built-in hot_idle TTL: 60 s.
    hot_idle_ttl_s: float | None = 60.0
    max_ttl_s: float = Field(0.0, ge=0)
    min_hot_idle: int = Field(0, ge=0, le=MAX_PODS)
    reuse: Reuse = Reuse.SAME_ORG
    #: stoker's per-org forecast (`demand.org_forecast`); false: the pool without it.
    org_forecast: bool = True
    #: The warm pool's Poisson quantile (`demand.quantile`); None: stoker's default.
    demand_quantile: float | None = Field(None, ge=0.5, le=0.9999)
    #: stoker's `demand.headroom`: `paying` (placeholders only while they avoid cold
    #: starts) or `constant` (`headroom_nodes` at all times).
    headroom: Literal["paying", "constant"] = "paying"
    #: stoker's defaults (`PoolSpec`).
    lease_s: float = Field(60.0, ge=1, le=86_400)
    scale_down_delay_s: float = Field(60.0, ge=0)
    #: duckgres' acquire budget, `DUCKGRES_WORKER_QUEUE_TIMEOUT` 60 s.
    claim_timeout_s: float = Field(60.0, ge=0)
    #: Constant node-sized placeholders, a constant (duckgres #820); 0 turns headroom off.
    headroom_nodes: int = Field(0, ge=0, le=MAX_NODES)
    #: Size of one placeholder: None = the worker's size. A node-sized placeholder holds
    #: a whole spare node (e.g. 15 cores / 56 GiB of an m5.4xlarge).
    placeholder_cpu: str | None = None
    placeholder_memory: str | None = None
    #: Where workers (and placeholders) may run: a dedicated node pool, typically.
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    #: duckgres' stuck cutoff for spawning rows is 10 minutes (#772: it must exceed the
    #: pod-ready budget, and a simulated node can take up to 10 minutes to launch).
    spawn_timeout_s: float = Field(600.0, gt=0)
    #: stoker's defaults (`Timeouts`).
    reserve_timeout_s: float = Field(30.0, gt=0)
    activation_timeout_s: float = Field(30.0, gt=0)
    drain_timeout_s: float = Field(120.0, gt=0)
    stop_grace_s: float = Field(10.0, ge=0)

    @field_validator("cpu", "memory", "placeholder_cpu", "placeholder_memory")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                cpu_millis(value)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> PoolConfig:
        if (self.placeholder_cpu is None) != (self.placeholder_memory is None):
            raise ValueError("placeholder_cpu and placeholder_memory go together")
        if self.max_workers and self.warm_target > self.max_workers:
            raise ValueError(f"warm_target {self.warm_target} exceeds max_workers")
        return self

    @property
    def cpu_cores(self) -> float:
        """Cores one worker requests."""
        return cpu_millis(self.cpu) / 1000

    @property
    def memory_mib(self) -> int:
        """MiB one worker requests."""
        return memory_bytes(self.memory) // (1 << 20)


class ControlPlaneConfig(_Model):
    """The replicas and their intervals (realistic settings, not test ones)."""

    #: Several replicas share one store and elect one janitor (duckgres ran 6, #820).
    replicas: int = Field(3, ge=1, le=MAX_REPLICAS)
    #: duckgres' janitor tick: 5 s.
    janitor_interval_s: float = Field(5.0, gt=0)
    #: duckgres' per-replica fallback hot-idle reaper: every minute.
    reaper_interval_s: float = Field(60.0, gt=0)
    #: duckgres: replicas heartbeat every 5 s and expire after 20 s.
    instance_heartbeat_s: float = Field(5.0, gt=0)
    instance_expiry_s: float = Field(20.0, gt=0)
    #: duckgres' client-go budget: QPS 50, burst 100 (the spawn bucket matches it).
    spawn_rate: float = Field(50.0, gt=0)
    spawn_burst: int = Field(100, ge=1)
    client_qps: float = Field(50.0, gt=0)
    client_burst: int = Field(100, ge=1)
    #: API latency of each replica's client: log-normal, median 10 ms, sigma 0.6 (p99
    #: ~40 ms, capped at 1 s). Measured by `python benchmarks/kube_timings.py`: pod creates
    #: and Lease renewals against kube-apiserver 1.20 on a shared 2-core machine answered
    #: in 6-13 ms at the median, log-normal fits of median 6-12 ms and sigma 0.4-0.8 over
    #: three runs. A floor: a loaded in-cluster server is slower (agent-sandbox measured
    #: APF waits up to ~359 ms p99 in a burst); Kubernetes' SLO bounds mutating calls' p99
    #: at 1 s.
    client_latency: OptionalDist = LogNormal(0.01, 0.6, cap=1.0)
    #: Each worker and claim write: log-normal, median 2 ms (capped at 200 ms), a commit on
    #: PostgreSQL in the same zone (measured: 1.6 ms of database CPU per claim cycle on 2
    #: cores, docs/benchmarks/; an in-zone round trip is well under 1 ms). An assumption.
    store_write_latency: OptionalDist = LogNormal(0.002, 0.5, cap=0.2)
    #: client-go's conventional leader-election timings, stoker's defaults: 15 / 10 / 2 s.
    #: With them a second contender took the Lease 16.1 s after the holder's last renewal
    #: (the duration plus part of a retry period; `python benchmarks/kube_timings.py`),
    #: as the simulated replicas do with the same elector code.
    lease_duration_s: float = Field(15.0, gt=0)
    renew_deadline_s: float = Field(10.0, gt=0)
    retry_period_s: float = Field(2.0, gt=0)
    #: The Kubernetes runtime's informer resync: 5 minutes (its default).
    resync_s: float = Field(300.0, gt=0)
    #: The runtime's `prefer_session_nodes` (`forecast`, its default).
    prefer_session_nodes: SessionNodes = "forecast"
    #: duckgres: stranded pods older than 2 minutes are cleaned up.
    stranded_grace_s: float = Field(120.0, ge=0)
    #: The label value every worker pod carries (`stoker.dev/fleet`).
    fleet: str = "sim"

    @model_validator(mode="after")
    def _election_timings(self) -> ControlPlaneConfig:
        # The elector's own rule, checked here so that a scenario that loads also runs.
        check_timings(self.lease_duration_s, self.renew_deadline_s, self.retry_period_s)
        return self


class ActivatorConfig(_Model):
    """The simulated worker side of activation (no HTTP: an in-process call)."""

    #: One in-cluster HTTP round trip plus the worker applying its config: log-normal,
    #: median 20 ms, capped at 1 s. An assumption (the demo worker answers in a few ms).
    latency: OptionalDist = LogNormal(0.02, 0.5, cap=1.0)
    #: Share of activations that fail (the worker answers 500): none by default.
    failure_rate: float = Field(0.0, ge=0, le=1)


class RolloutConfig(_Model):
    """A new revision of the pool rolled out during the run (`stoker.sim.rollout`): a new
    image at `at_s`, ramped by the policy's strategy (`stoker`: this canary)."""

    at_s: float = Field(ge=0)
    #: The new revision's image (any change of the template is a new revision).
    image: str = "registry.sim.example/worker:2"
    #: The canary's steps (percent of new claims), as `POST /v1/pools/{name}/rollouts`.
    steps: tuple[int, ...] = (10, 50, 100)
    step_interval_s: float = Field(60.0, gt=0)
    max_failure_ratio: float = Field(0.2, gt=0, le=1)
    #: Seconds a step may wait for the new revision's warm workers before it pauses.
    hold_deadline_s: float = Field(600.0, gt=0)
    #: Share of the new revision's activations that fail (a bad image): none by default.
    activation_failure_rate: float = Field(0.0, ge=0, le=1)
    #: Whose activations of the new revision fail: every replica's, or only those of the
    #: replicas that do not lead (the leader's verdict must sum the others' counts).
    failing_on: Literal["all", "followers"] = "all"


# -- policies --------------------------------------------------------------------------------


class PolicyEntry(_Model):
    """One column of the comparison: a policy kind, its parameters and the scenario's
    sections as this policy sees them (laid over the scenario's own)."""

    name: str = Field(min_length=1)
    policy: str
    params: dict[str, Any] = Field(default_factory=dict)
    pool: dict[str, Any] = Field(default_factory=dict)
    control_plane: dict[str, Any] = Field(default_factory=dict)
    cluster: dict[str, Any] = Field(default_factory=dict)
    activator: dict[str, Any] = Field(default_factory=dict)

    @field_validator("policy")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in POLICY_KINDS:
            raise ValueError(f"unknown policy {value!r}; one of {', '.join(POLICY_KINDS)}")
        return value

    @model_validator(mode="after")
    def _params(self) -> PolicyEntry:
        try:
            POLICY_PARAMS[self.policy].model_validate(self.params)
        except ValidationError as exc:
            raise ValueError(f"params: {_first_problem(exc)}") from None
        return self

    def typed_params(self) -> ParamsModel:
        """The parameters as the policy kind's model."""
        return POLICY_PARAMS[self.policy].model_validate(self.params)


# -- the scenario ----------------------------------------------------------------------------


class Scenario(_Model):
    """One scenario file, validated; `for_policy` gives what one policy run sees."""

    name: str = Field(min_length=1)
    description: str = ""
    duration_s: float = Field(gt=0, le=MAX_RUN_S)
    #: Same seed, same summary.json, byte for byte.
    seed: int = 1
    #: The wall-clock time (UTC seconds) the run starts at: 2023-11-14T22:13:20Z by default.
    epoch_s: float = Field(1_700_000_000.0, ge=0)
    #: Timeseries resolution (and the step of the vCPU-hour integrals).
    sample_interval_s: float = Field(10.0, gt=0)
    #: How often the invariant checker reads the store and the cluster. Its bounds are in
    #: reaper intervals (minutes), so a check every 10 s loses no precision that matters.
    check_interval_s: float = Field(10.0, gt=0)
    #: Hot workers the load needs: `time_to_target_s` is when bound sessions reach it.
    target_hot: int | None = Field(None, ge=1)
    policies: tuple[PolicyEntry, ...] = Field(min_length=1)
    control_plane: ControlPlaneConfig = ControlPlaneConfig()
    pool: PoolConfig = PoolConfig()
    activator: ActivatorConfig = ActivatorConfig()
    tenants: tuple[TenantGroup, ...] = ()
    cluster: dict[str, Any] = Field(default_factory=dict)
    #: A new revision rolled out during the run (None: none).
    rollout: RolloutConfig | None = None
    #: Laid over the whole scenario by `--short` (already applied once loaded short).
    short: dict[str, Any] = Field(default_factory=dict)

    @field_validator("policies", mode="before")
    @classmethod
    def _policy_shorthand(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            return [{"name": v, "policy": v} if isinstance(v, str) else v for v in value]
        return value

    @field_validator("cluster")
    @classmethod
    def _cluster(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            SimClusterConfig.from_mapping(_full_cluster(value))
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _sizes(self) -> Scenario:
        # Sizes a run could not finish with, refused before they are built (`_whole`
        # lists every org): a typo's stray digits should not cost days of wall time.
        if self.epoch_s + self.duration_s > LATEST_S:
            raise ValueError(
                f"epoch_s: the run would end after 9999-12-31 (epoch_s + duration_s > "
                f"{LATEST_S:.0f})"
            )
        if (orgs := sum(group.count for group in self.tenants)) > MAX_ORGS:
            raise ValueError(f"tenants: {orgs:,} orgs; a scenario has at most {MAX_ORGS:,}")
        arrivals = sum(group.arrival_bound(self.duration_s) for group in self.tenants)
        if arrivals > MAX_ARRIVALS:
            raise ValueError(
                f"tenants: up to {arrivals:,.0f} arrivals over the run (each group's count "
                "x peak rate x duration, and its initial and burst sessions); a run opens "
                f"at most {MAX_ARRIVALS:,}"
            )
        cluster = self.cluster_config()
        for key, interval in self.periodic_intervals(cluster):
            if self.duration_s / interval > MAX_ROUNDS:
                raise ValueError(
                    f"{key}: {interval:g} s is {self.duration_s / interval:,.0f} rounds over "
                    f"the run's {self.duration_s:g} s; at most {MAX_ROUNDS:,} "
                    f"(at least {self.duration_s / MAX_ROUNDS:.3g} s)"
                )
        nodes = sum(sum(pool.initial_nodes.values()) for pool in cluster.node_pools)
        if nodes > MAX_NODES:
            raise ValueError(f"cluster.node_pools: {nodes:,} initial nodes; at most {MAX_NODES:,}")
        if (cores := cluster.background.target.peak()) > MAX_BACKGROUND_CORES:
            raise ValueError(
                f"cluster.background.target: {cores:,.0f} cores; at most "
                f"{MAX_BACKGROUND_CORES:,.0f}"
            )
        return self

    def periodic_intervals(self, cluster: SimClusterConfig) -> list[tuple[str, float]]:
        """Every periodic activity's interval, by the key that sets it."""
        plane = self.control_plane
        found = [
            ("sample_interval_s", self.sample_interval_s),
            ("check_interval_s", self.check_interval_s),
            ("control_plane.janitor_interval_s", plane.janitor_interval_s),
            ("control_plane.reaper_interval_s", plane.reaper_interval_s),
            ("control_plane.instance_heartbeat_s", plane.instance_heartbeat_s),
            ("control_plane.retry_period_s", plane.retry_period_s),
            ("control_plane.resync_s", plane.resync_s),
            ("cluster.autoscaler.consolidation_interval_s",
             cluster.autoscaler.consolidation_interval_s),
            ("cluster.background.reconcile_interval_s", cluster.background.reconcile_interval_s),
        ]  # fmt: skip
        for entry in self.policies:
            params = entry.typed_params()
            if isinstance(params, KnativeKpaParams):
                found.append((f"policies.{entry.name}.params.scrape_s", params.scrape_s))
        return found

    @model_validator(mode="after")
    def _whole(self) -> Scenario:
        names = [p.name for p in self.policies]
        if len(set(names)) != len(names):
            raise ValueError(f"policies: duplicate names in {names}")
        orgs = [org for group in self.tenants for org in group.org_names()]
        if len(set(orgs)) != len(orgs):
            raise ValueError("tenants: two groups produce the same org name")
        for entry in self.policies:
            # Each policy's view must be valid too, or a run would fail half-way. A view
            # carries no overrides of its own, so this does not recurse.
            if entry.pool or entry.control_plane or entry.cluster or entry.activator:
                self._view(entry)
        return self

    def cluster_config(self) -> SimClusterConfig:
        """The simulated cluster of this scenario (its `cluster` over `BASE_CLUSTER`)."""
        return SimClusterConfig.from_mapping(_full_cluster(self.cluster))

    def policy(self, name: str) -> PolicyEntry:
        """A policy entry by name; ConfigError if the scenario has none of that name."""
        for entry in self.policies:
            if entry.name == name:
                return entry
        known = ", ".join(p.name for p in self.policies)
        raise ConfigError(f"scenario {self.name!r} has no policy {name!r} (it has: {known})")

    def for_policy(self, name: str) -> Scenario:
        """The scenario as policy `name` runs it: its overrides applied, only it listed."""
        return self._view(self.policy(name))

    def _view(self, entry: PolicyEntry) -> Scenario:
        data = self.model_dump()
        sections = ("pool", "control_plane", "cluster", "activator")
        data["policies"] = [entry.model_dump(exclude=set(sections))]
        for section in sections:
            data[section] = deep_merge(data[section], getattr(entry, section))
        try:
            return Scenario.model_validate(data)
        except ValidationError as exc:
            raise ValueError(f"policy {entry.name!r}: {_first_problem(exc)}") from None

    def org_names(self) -> list[str]:
        """Every tenant org, in file order."""
        return [org for group in self.tenants for org in group.org_names()]


def _full_cluster(cluster: Mapping[str, Any]) -> dict[str, Any]:
    """A scenario's cluster over `BASE_CLUSTER`, its node pools filled with the defaults."""
    return deep_merge(BASE_CLUSTER, with_node_pool_defaults(cluster))


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` laid over `base`: mappings merge key by key, anything else is replaced."""
    merged = dict(base)
    for key, value in over.items():
        current = merged.get(key)
        if isinstance(current, Mapping) and isinstance(value, Mapping):
            merged[key] = deep_merge(current, value)
        else:
            merged[key] = value
    return merged


def _first_problem(exc: ValidationError) -> str:
    """Every problem of `exc`, on one line."""
    problems = []
    for error in exc.errors():
        where = ".".join(_key(part) for part in error["loc"])
        message = " ".join(error["msg"].removeprefix("Value error, ").split())
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        problems.append(f"{where}: {message}" if where else message)
    return "; ".join(problems)


def _key(part: str | int) -> str:
    """A key as written, quoted when it is empty or holds spaces or control characters."""
    text = str(part)
    return text if text and text.isprintable() and " " not in text else repr(text)


def scenario_names() -> list[str]:
    """The names of the scenarios in the `scenarios/` directories, sorted."""
    return sorted({p.stem for d in SCENARIO_DIRS if d.is_dir() for p in d.glob("*.yaml")})


def find_scenario(name_or_path: str) -> Path:
    """The file of a scenario given as a path, or as a name in a `scenarios/` directory."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.suffix == "" and path.parent == Path("."):
        for directory in SCENARIO_DIRS:
            candidate = directory / f"{name_or_path}.yaml"
            if candidate.is_file():
                return candidate
    names = scenario_names()
    known = f" (known scenarios: {', '.join(names)})" if names else ""
    raise ConfigError(f"no scenario file {name_or_path!r}{known}")


def load_scenario(name_or_path: str, *, short: bool = False) -> Scenario:
    """Read and validate a scenario; with `short`, its `short:` block laid over it first.

    Raises `ConfigError` with one line naming the file, the key and the problem.
    """
    path = find_scenario(name_or_path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        reason = str(exc).replace("\n", " ")
        raise ConfigError(f"scenario {path}: cannot read: {reason}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"scenario {path}: expected a mapping at the top level")
    return scenario_from_mapping(data, source=str(path), short=short)


def scenario_from_mapping(
    data: Mapping[str, Any], *, source: str = "<mapping>", short: bool = False
) -> Scenario:
    """Validate a scenario given as a mapping (see `load_scenario`)."""
    if short:
        block = data.get("short") or {}
        if not isinstance(block, Mapping):
            raise ConfigError(f"scenario {source}: short: expected a mapping")
        data = deep_merge(data, block)
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"scenario {source}: {_first_problem(exc)}") from None
