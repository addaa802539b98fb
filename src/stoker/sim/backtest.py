"""The backtest: a pool's recorded claims replayed through the simulator, for its current
settings and for candidates, and a search for the cheapest settings that meet a target.

Each setting is one policy run of a scenario built here (`backtest_scenario`): the pool on
a dedicated, consolidating node pool (as `diurnal`'s), the kubelet's start-up drawn from
the pool's spawn-to-ready distribution (`SpawnToReady`), the load the recorded claims
(`stoker.sim.claimlog`). Runs are independent: they go in parallel processes
(`run_scenario(jobs=...)`), and the same log, settings and seed give the same figures.

Settings are written `KEY=VALUE` (`parse_settings`, `SETTINGS`): the pool's keys in the
words of its config file, plus `policy` (a simulator policy kind, e.g. `percent-headroom`).
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any, get_type_hints

from pydantic import TypeAdapter, ValidationError

from stoker.domain.errors import ConfigError
from stoker.domain.ledger import LedgerCounts, money
from stoker.domain.specs import CostSpec, DemandSpec, PlaneSettings, PoolSpec
from stoker.sim.claimlog import ClaimReplay
from stoker.sim.policies import POLICY_KINDS
from stoker.sim.runner import PolicyResult, ProgressCallback, ScenarioResult, run_scenario
from stoker.sim.scenario import Scenario, scenario_from_mapping

#: Setting key -> (the scenario pool's field, the value's type). `ttl` keys are seconds.
SETTINGS: Mapping[str, tuple[str, type]] = {
    "warm_target": ("warm_target", int),
    "max_workers": ("max_workers", int),
    "max_workers_per_org": ("max_workers_per_org", int),
    "hot_idle_ttl": ("hot_idle_ttl_s", float),
    "max_ttl": ("max_ttl_s", float),
    "min_hot_idle": ("min_hot_idle", int),
    "scale_down_delay": ("scale_down_delay_s", float),
    "lease_s": ("lease_s", float),
    "claim_timeout_s": ("claim_timeout_s", float),
    "headroom_nodes": ("headroom_nodes", int),
    "demand.quantile": ("demand_quantile", float),
    "demand.org_forecast": ("org_forecast", bool),
    "demand.headroom": ("headroom", str),
    "reuse": ("reuse", str),
}
#: Settings `PATCH /v1/pools/{name}` (`stoker pools set`) changes; the others are the
#: config file's (or the pool's stored spec).
PATCHABLE = (
    "warm_target",
    "max_workers",
    "max_workers_per_org",
    "hot_idle_ttl",
    "max_ttl",
    "min_hot_idle",
    "scale_down_delay",
    "lease_s",
    "claim_timeout_s",
)
#: The per-org overrides a replay runs (an org's setting, as the config's `orgs:` and a
#: pool's `org_overrides` name it -> its scenario tenant's field). Others (`max_claim_s`:
#: the simulator ends no session at a maximum) are reported as not replayed.
ORG_SETTINGS: Mapping[str, str] = {
    "max_workers": "max_workers",
    "hot_idle_ttl": "hot_idle_ttl_s",
    "min_hot_idle": "min_hot_idle",
}
#: The policy kind a setting runs under unless it names one.
DEFAULT_POLICY = "stoker"
#: Targets `--recommend` knows: the figure and whether lower is better (all are).
TARGETS = ("cold_share", "session_p99_ms", "claim_p99_ms")


def parse_settings(text: str) -> dict[str, Any]:
    """`'warm_target=8,demand.quantile=0.99'` as {key: typed value}; ConfigError on an
    unknown key, a bad value or a key given twice. `policy=NAME` picks the policy kind."""
    settings: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, raw = part.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not raw:
            raise ConfigError(f"setting {part!r}: expected KEY=VALUE")
        if key in settings:
            # `warm_target=1,warm_target=2` is no setting: which one was meant?
            raise ConfigError(f"setting {key} given twice in {text!r}")
        settings[key] = parse_value(key, raw)
    return settings


#: What a setting's value must be, in words.
_KIND_NAMES: dict[type, str] = {int: "a whole number", float: "a number", bool: "true or false"}


def parse_value(key: str, raw: str) -> Any:
    """One setting's value, typed; ConfigError naming the key."""
    if key == "policy":
        if raw not in POLICY_KINDS:
            raise ConfigError(f"unknown policy {raw!r}; one of {', '.join(POLICY_KINDS)}")
        return raw
    if key not in SETTINGS:
        known = ", ".join([*SETTINGS, "policy"])
        raise ConfigError(f"unknown setting {key!r}; one of {known}")
    kind = SETTINGS[key][1]
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false"):
                raise ValueError(raw)
            return raw.lower() == "true"
        value = kind(raw)
    except ValueError:
        wanted = _KIND_NAMES.get(kind, kind.__name__)
        raise ConfigError(f"setting {key}: {raw!r} is not {wanted}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"setting {key}: {raw!r} is not a finite number")
    try:
        _pool_field(key).validate_python(value)
    except ValidationError as exc:
        message = exc.errors()[0]["msg"]
        raise ConfigError(f"setting {key}: {raw!r}: the pool refuses it ({message})") from None
    return value


@cache
def _pool_field(key: str) -> TypeAdapter[Any]:
    """The type, with its bounds, that the pool's own spec gives setting `key` (PoolSpec's
    field of that name, or DemandSpec's for `demand.*`): what the config file and the API
    refuse, a backtest refuses too."""
    spec, _, name = key.rpartition(".")
    hints = get_type_hints(DemandSpec if spec == "demand" else PoolSpec, include_extras=True)
    return TypeAdapter(hints[name])


def settings_text(settings: Mapping[str, Any]) -> str:
    """Settings back in `KEY=VALUE,...` form (sorted; `policy` first)."""
    keys = sorted(settings, key=lambda k: (k != "policy", k))
    return ",".join(f"{k}={_fmt(settings[k])}" for k in keys)


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


#: Cold claims a log needs for its waits to stand for the pool's spawn-to-ready time.
MIN_COLD_WAITS = 5


@dataclass(frozen=True)
class SpawnToReady:
    """The pool's spawn-to-ready time, as a log-normal with this median and p99 (seconds):
    the kubelet's container start, with the image already on every node."""

    p50_s: float = 5.0
    p99_s: float = 12.0

    def __post_init__(self) -> None:
        if not (0 < self.p50_s <= self.p99_s) or not math.isfinite(self.p99_s):
            raise ConfigError(
                f"spawn-to-ready: need 0 < p50 <= p99, got {self.p50_s:g} and {self.p99_s:g}"
            )

    @classmethod
    def parse(cls, text: str) -> SpawnToReady:
        """`P50` or `P50:P99` (seconds)."""
        head, _, tail = text.partition(":")
        try:
            p50 = float(head)
            p99 = float(tail) if tail else p50 * cls.p99_s / cls.p50_s
        except ValueError:
            raise ConfigError(f"--spawn-s {text!r}: expected P50 or P50:P99 seconds") from None
        return cls(p50, p99)

    @classmethod
    def of_waits(cls, waits: Sequence[float]) -> SpawnToReady | None:
        """The median and p99 (nearest rank) of the waits of a log's cold claims: the
        spawn-to-ready time their users saw. None for fewer than `MIN_COLD_WAITS` waits,
        or a median of 0 (no spawn is that fast)."""
        if len(waits) < MIN_COLD_WAITS:
            return None
        ordered = sorted(waits)
        p50 = statistics.median(ordered)
        if p50 <= 0:
            return None
        return cls(p50, ordered[math.ceil(0.99 * len(ordered)) - 1])

    def distribution(self) -> dict[str, Any]:
        """The scenario's form: log-normal, sigma from the p99 (z = 2.326)."""
        sigma = math.log(self.p99_s / self.p50_s) / 2.326
        if sigma <= 0:
            return {"kind": "constant", "value": self.p50_s}
        return {"kind": "lognormal", "median": self.p50_s, "sigma": sigma}


@dataclass
class Backtest:
    """What a backtest replays and against what."""

    replay: ClaimReplay
    #: The pool's current settings (`KEY: value`, keys of `SETTINGS`, maybe `policy`).
    current: dict[str, Any] = field(default_factory=dict)
    spawn: SpawnToReady = field(default_factory=SpawnToReady)
    #: The replicas' intervals (`ControlPlaneConfig` keys) over the backtest's defaults:
    #: the live fleet's janitor interval, read from its config.
    control_plane: dict[str, Any] = field(default_factory=dict)
    seed: int = 1
    jobs: int = 1
    progress: ProgressCallback | None = None
    #: The pool's prices (its config's `cost`): figures read in them, and `recommend`
    #: compares by them. None: by the simulated nodes' cost.
    cost: CostSpec | None = None
    #: The live pool's (CPUs, GiB) per worker (`stoker.domain.ledger.resources_of` of its
    #: template), which per-resource prices apply to; None: the simulated workers'.
    resources: tuple[float, float] | None = None
    #: The per-org overrides in force (org -> its settings, `OrgSpec.overrides`): every
    #: setting replays them, those of `ORG_SETTINGS` (`replayed_orgs`).
    orgs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: The live pool runs local processes: no spawn waits for a node (`backtest_scenario`).
    machine: bool = False
    #: The live machine's start-up slots (a local pool's `runtime.start_limit`) and the
    #: seconds a start-up holds one (None: all of its start); None: no bound replayed.
    start_slots: tuple[int, float | None] | None = None

    def __post_init__(self) -> None:
        self.replay.lead_s = LEAD_S

    def scenario(self, candidates: Sequence[tuple[str, Mapping[str, Any]]]) -> Scenario:
        """The scenario whose policies are `current` and the (name, changes) candidates."""
        return backtest_scenario(
            self.replay,
            [(name, {**self.current, **changes}) for name, changes in candidates],
            spawn=self.spawn,
            seed=self.seed,
            control_plane=self.control_plane,
            orgs=self.orgs,
            machine=self.machine,
            start_slots=self.start_slots,
        )

    def run(self, candidates: Sequence[tuple[str, Mapping[str, Any]]]) -> ScenarioResult:
        """Replay the log once per candidate (in `jobs` processes)."""
        return run_scenario(
            self.scenario(candidates),
            progress=self.progress,
            jobs=self.jobs,
            replay=self.replay,
        )

    def accepts(self, settings: Mapping[str, Any]) -> bool:
        """Whether the pool takes `settings` (e.g. no warm target above its cap)."""
        try:
            backtest_scenario(
                self.replay, [("check", settings)], spawn=self.spawn, seed=self.seed, orgs=self.orgs
            )
        except ConfigError:
            return False
        return True

    def figures(self, candidates: Sequence[tuple[str, Mapping[str, Any]]]) -> list[Figures]:
        """Each candidate's figures (`run`), at the pool's prices when it has them."""
        return all_figures(self.run(candidates), self.cost, self.resources)


#: The scenario a backtest lays its pool, policies and spawn times into.
BASE: Mapping[str, Any] = {
    "name": "backtest",
    "description": "a pool's recorded claims, replayed",
    "sample_interval_s": 60,
    "check_interval_s": 30,
    "control_plane": {
        "replicas": 1,
        # `stoker serve`'s own passes (`PlaneSettings`), not the simulator's duckgres-like
        # defaults (5 s and 60 s): a replay of stoker's log runs stoker as it ran.
        "janitor_interval_s": PlaneSettings().janitor_interval_s,
        "reaper_interval_s": PlaneSettings().reaper_interval_s,
        "lease_duration_s": 20,
        "renew_deadline_s": 15,
        "retry_period_s": 5,
    },
    "pool": {
        "placeholder_cpu": "15",
        "placeholder_memory": "56Gi",
        "node_selector": {"stoker.dev/nodepool": "workers"},
        "tolerations": [
            {"key": "stoker.dev/workers", "operator": "Exists", "effect": "NoSchedule"}
        ],
    },
    "cluster": {
        "node_pools": [
            {
                "name": "workers",
                "instance_types": ["m5.4xlarge"],
                "labels": {"stoker.dev/nodepool": "workers"},
                "taints": [{"key": "stoker.dev/workers", "effect": "NoSchedule"}],
                "initial_nodes": {"m5.4xlarge": 2},
            }
        ],
    },
}
#: Seconds the replay runs past the last arrival, so its claims are served and measured.
TAIL_S = 120.0
#: Seconds the pool runs before the first recorded arrival: it fills to its settings
#: (the live pool was running when the log began). Costs count them too.
LEAD_S = 300.0


#: The cluster of a local pool's replay (`machine`): nodes launched at once, as soon as a
#: spawn needs one, for a machine that is always there.
MACHINE_CLUSTER: Mapping[str, Any] = {
    "node_pools": [
        {
            **BASE["cluster"]["node_pools"][0],
            "provisioning": {"kind": "constant", "value": 0.0},
        }
    ],
    "autoscaler": {"batch_idle_s": 0.0, "batch_max_s": 0.0},
}


def backtest_scenario(
    replay: ClaimReplay,
    runs: Sequence[tuple[str, Mapping[str, Any]]],
    *,
    spawn: SpawnToReady,
    seed: int,
    control_plane: Mapping[str, Any] | None = None,
    orgs: Mapping[str, Mapping[str, Any]] | None = None,
    machine: bool = False,
    start_slots: tuple[int, float | None] | None = None,
) -> Scenario:
    """The backtest's scenario: one policy per (name, settings), the per-org overrides
    `orgs` of the log's orgs as its tenants' (`replayed_orgs`); ConfigError on settings
    the pool refuses (e.g. warm_target above max_workers). `machine`: the live pool runs
    local processes, so no spawn waits for a node: a node the replay needs is there at
    once (the simulated nodes still come and go with the workers, for their cost), and
    `start_slots` (limit, hold seconds or None) bound how many start at once, as the live
    machine's start-up slots did (`KubeletConfig.start_limit`)."""
    policies = []
    for name, settings in runs:
        pool = {SETTINGS[k][0]: v for k, v in settings.items() if k != "policy"}
        policy = settings.get("policy", DEFAULT_POLICY)
        policies.append({"name": name, "policy": policy, "pool": pool})
    data: dict[str, Any] = {
        **BASE,
        "seed": seed,
        # A log from the first minutes of 1970 starts its lead at 1970 (no earlier epoch).
        "epoch_s": max(0, math.floor(replay.start - replay.lead_s)),
        "duration_s": replay.lead_s + replay.span_s + TAIL_S,
        "policies": policies,
        # Tenants with no arrivals of their own (the log's claims are the load): each
        # carries one org's overrides into every policy's control plane.
        "tenants": [
            {"name": org, **{ORG_SETTINGS[k]: v for k, v in given.items()}}
            for org, given in replayed_orgs(replay, orgs or {}).items()
        ],
        "control_plane": {**BASE["control_plane"], **(control_plane or {})},
        "pool": {**BASE["pool"], "name": replay.pool},
        "cluster": {
            **BASE["cluster"],
            **(MACHINE_CLUSTER if machine else {}),
            # The measured spawn-to-ready time is all of it: images are on the nodes
            # and the process answers its readiness probe as it starts.
            "kubelet": {
                "image_pull": 0.0,
                "image_pull_by_image": {},
                "container_start": spawn.distribution(),
                "ready_delay": 0.0,
                **(
                    {"start_limit": start_slots[0], "start_hold_s": start_slots[1]}
                    if start_slots is not None
                    else {}
                ),
            },
        },
    }
    try:
        return scenario_from_mapping(data, source="backtest")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def replayed_orgs(
    replay: ClaimReplay, orgs: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The overrides a replay runs: those of `ORG_SETTINGS` of the orgs in the log."""
    return _logged_overrides(replay, orgs, replayable=True)


def unreplayed_orgs(
    replay: ClaimReplay, orgs: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The overrides of the log's orgs a replay cannot run (not in `ORG_SETTINGS`)."""
    return _logged_overrides(replay, orgs, replayable=False)


def _logged_overrides(
    replay: ClaimReplay, orgs: Mapping[str, Mapping[str, Any]], *, replayable: bool
) -> dict[str, dict[str, Any]]:
    """The overrides set of each org in the log, those of `ORG_SETTINGS` (`replayable`) or
    the others, by org in order; orgs that set none are left out."""
    logged = set(replay.orgs)
    out = {}
    for org in sorted(orgs):
        given = {
            k: v
            for k, v in orgs[org].items()
            if (k in ORG_SETTINGS) == replayable and v is not None
        }
        if org in logged and given:
            out[org] = given
    return out


# -- figures -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    """One setting's outcome on the log."""

    name: str
    cold_share: float | None
    claim_p50_ms: float | None
    claim_p99_ms: float | None
    session_p50_ms: float | None
    session_p99_ms: float | None
    #: Claims refused, or still waiting for a worker when the replay ended.
    failed: int
    idle_worker_hours: float
    #: What the simulated cluster's nodes cost (on-demand prices of its instance types).
    cost_usd: float
    #: All worker time (placeholders included) at the pool's own prices, and its idle warm
    #: part, from the run's ledger (docs/warmth.md); None without prices.
    priced_cost: float | None = None
    idle_warm_cost: float | None = None

    @property
    def cost(self) -> float:
        """The cost settings are compared by: at the pool's prices when it has them, else
        the nodes'."""
        return self.cost_usd if self.priced_cost is None else self.priced_cost

    def meets(self, target: str, bound: float, failed: int = 0) -> bool:
        """Whether the figure `target` is at most `bound` (None never meets it), with at
        most `failed` claims failed."""
        value = getattr(self, target)
        return value is not None and value <= bound and self.failed <= failed

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def figures(
    result: PolicyResult,
    cpu_per_worker: float,
    cost: CostSpec | None = None,
    resources: tuple[float, float] | None = None,
) -> Figures:
    """The table's figures of one run; `cost` the pool's prices (None: none), per CPU and
    GiB of `resources` per worker (None: the simulated workers')."""
    s = result.summary
    counts = LedgerCounts.from_parts(s["ledger"], {})
    if resources is not None:
        counts = _resized(counts, resources)
    priced = money(counts, cost)
    claims = s["claims"]
    latency = claims["latency_s"]["all"] or {}
    waited = s["sessions"]["time_to_worker_s"] or {}
    return Figures(
        name=result.name,
        cold_share=claims["cold_share"],
        claim_p50_ms=_ms(latency.get("p50")),
        claim_p99_ms=_ms(latency.get("p99")),
        session_p50_ms=_ms(waited.get("p50")),
        session_p99_ms=_ms(waited.get("p99")),
        # A claim still waiting when the replay ends (a claim timeout longer than its
        # tail) got no worker either: left out, it would flatter the setting.
        failed=sum(claims["failures"].values()) + s["sessions"]["still_trying"],
        idle_worker_hours=s["vcpu_hours"]["idle"] / cpu_per_worker,
        cost_usd=s["nodes"]["cost_usd"],
        priced_cost=priced["total_cost"],
        idle_warm_cost=priced["idle_warm_cost"],
    )


def _resized(counts: LedgerCounts, resources: tuple[float, float]) -> LedgerCounts:
    """`counts` with the resource-seconds of workers of `resources` (CPUs, GiB): the
    replay's workers are the simulator's pods (`PoolConfig`'s 2 CPUs and 4 GiB), whose
    resource-seconds would price another pool's. Its placeholders (node-sized for the
    simulator's nodes) are priced as the worker slots they hold room for."""
    cpus, gib = resources
    worker_s = counts.warm_s + counts.hot_s + counts.hot_idle_s + counts.starting_s
    worker_s += counts.draining_s
    out = counts.copy()
    out.cpu_s, out.gib_s = worker_s * cpus, worker_s * gib
    out.placeholder_cpu_s = counts.placeholder_s * cpus
    out.placeholder_gib_s = counts.placeholder_s * gib
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def all_figures(
    result: ScenarioResult,
    cost: CostSpec | None = None,
    resources: tuple[float, float] | None = None,
) -> list[Figures]:
    """Every run's figures, in the scenario's order; `cost` the pool's prices, for
    workers of `resources` (CPUs, GiB; None: the simulated workers')."""
    cpu = result.scenario.pool.cpu_cores
    return [figures(p, cpu, cost, resources) for p in result.policies]


# -- the search --------------------------------------------------------------------------------


#: The values `--recommend` tries per setting (around the current one).
WARM_TARGETS = (0, 1, 2, 4, 8, 16, 32)
QUANTILES = (0.9, 0.99, 0.999, 0.9999)
HOT_IDLE_TTLS = (30.0, 60.0, 300.0, 900.0)
HEADROOM_NODES = (0, 1, 2)
#: Rounds of the coordinate search at most.
ROUNDS = 3


@dataclass
class Recommendation:
    """The search's answer: the cheapest settings that met the target, and their re-run."""

    target: str
    bound: float
    settings: dict[str, Any] | None
    found: Figures | None
    confirmed: Figures | None
    tried: list[tuple[dict[str, Any], Figures]]
    #: The claims a setting may fail: as many as the current settings do (claims refused at
    #: the pool cap, which the search does not change, fail whatever the warmth).
    failed_allowed: int = 0

    @property
    def confirmed_ok(self) -> bool:
        """The re-run (another seed) meets the target too."""
        return self.confirmed is not None and self.confirmed.meets(
            self.target, self.bound, self.failed_allowed
        )


#: The settings `--recommend` searches, and the values it tries for each.
SEARCHED: Mapping[str, Sequence[Any]] = {
    "warm_target": WARM_TARGETS,
    "demand.quantile": QUANTILES,
    "hot_idle_ttl": HOT_IDLE_TTLS,
    "headroom_nodes": HEADROOM_NODES,
}


def neighbours(
    settings: Mapping[str, Any], keys: Sequence[str] = tuple(SEARCHED)
) -> list[dict[str, Any]]:
    """Settings that differ from `settings` in one searched key."""
    out: list[dict[str, Any]] = []
    for key in keys:
        for value in SEARCHED[key]:
            if settings.get(key) != value:
                out.append({**settings, key: value})
    return out


def recommend(
    backtest: Backtest,
    target: str,
    bound: float,
    *,
    keys: Sequence[str] = tuple(SEARCHED),
    on_round: Callable[[int, list[Figures]], None] | None = None,
) -> Recommendation:
    """Coordinate search from the current settings: each round runs every one-key change
    of the best settings so far (in parallel) and keeps the cheapest that meets the
    target; it stops when a round finds nothing cheaper. The winner is re-run at another
    seed to confirm it."""
    if target not in TARGETS:
        raise ConfigError(f"unknown target {target!r}; one of {', '.join(TARGETS)}")
    for key in keys:
        if key not in SEARCHED:
            raise ConfigError(f"cannot search {key!r}; one of {', '.join(SEARCHED)}")
    best: dict[str, Any] = dict(backtest.current)
    current = backtest.figures([("current", {})])[0]
    tried: list[tuple[dict[str, Any], Figures]] = [(dict(best), current)]
    # No worse than today: the claims the current settings fail (at the cap, say) may fail.
    allowed = current.failed
    best_figures = current if current.meets(target, bound, allowed) else None
    seen = {settings_text(best)}
    for round_number in range(1, ROUNDS + 1):
        batch = [
            n
            for n in neighbours(best, keys)
            if settings_text(n) not in seen and backtest.accepts(n)
        ]
        seen.update(settings_text(n) for n in batch)
        if not batch:
            break
        named = [(settings_text(_changes(backtest.current, n)), {**n}) for n in batch]
        found = backtest.figures(named)
        tried += list(zip(batch, found, strict=True))
        if on_round is not None:
            on_round(round_number, found)
        winners = [(f.cost, i) for i, f in enumerate(found) if f.meets(target, bound, allowed)]
        if not winners:
            if best_figures is not None:
                break
            # Nothing meets it yet: go on from the change that came closest.
            closest = min(range(len(found)), key=lambda i: _distance(found[i], target))
            best = batch[closest]
            continue
        cost, index = min(winners)
        if best_figures is not None and cost >= best_figures.cost:
            break
        best, best_figures = batch[index], found[index]
    if best_figures is None:
        return Recommendation(target, bound, None, None, None, tried, allowed)
    # The same backtest (log, spawn times, intervals, prices, per-org overrides) from the
    # winner, at the next seed.
    again = dataclasses.replace(backtest, current=best, seed=backtest.seed + 1, jobs=1)
    confirmed = again.figures([("confirm", {})])[0]
    return Recommendation(target, bound, best, best_figures, confirmed, tried, allowed)


def _distance(f: Figures, target: str) -> tuple[int, float]:
    value = getattr(f, target)
    return (f.failed, math.inf if value is None else value)


def _changes(current: Mapping[str, Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if current.get(k) != v}


def parse_target(text: str) -> tuple[str, float]:
    """`cold_share=0.005` as ("cold_share", 0.005); ConfigError otherwise."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or key not in TARGETS:
        raise ConfigError(f"--target {text!r}: expected one of {', '.join(TARGETS)}=NUMBER")
    try:
        bound = float(raw)
    except ValueError:
        raise ConfigError(f"--target {text!r}: {raw.strip()!r} is not a number") from None
    if not math.isfinite(bound) or bound < 0:
        raise ConfigError(f"--target {text!r}: expected a number >= 0")
    return key, bound


def patch_line(
    pool: str, settings: Mapping[str, Any], url: str | None = None
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(`stoker pools set ...` line, PATCH JSON body, the settings only the config file
    sets) for `settings`. The line names `url`, the server whose log was replayed, when
    there is one: run as printed, it changes that server's pool, not the default one's
    (the token stays out of it, as out of every line printed)."""
    patch = {k: v for k, v in settings.items() if k in PATCHABLE}
    rest = {k: v for k, v in settings.items() if k not in PATCHABLE}
    words = [
        "stoker",
        "pools",
        "set",
        shlex.quote(pool),
        *(f"--{k.replace('_', '-')} {_fmt(v)}" for k, v in sorted(patch.items())),
    ]
    if url is not None and patch:
        words += ["--url", shlex.quote(url)]
    return " ".join(words), patch, rest
