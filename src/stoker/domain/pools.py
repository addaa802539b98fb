"""Pools as stored objects: a pool row with its generation, its revisions, and rollouts.

The store holds each pool (`StoredPool`: its spec at the stable revision, the default
rollout strategy, the draining flag) with a *generation* that every change bumps and
every write compares, the templates it has had (`StoredRevision`, keyed by `revision_of`)
and its rollouts (`Rollout`, with the states and strategies of `stoker.domain.rollouts`).
A rollout's ramp (state, step, share) lives in its row alone: what a revision's share is
at any moment is derived from it by one function (`stoker.policy.rollout`).

Specs and templates are kept as JSON objects (`spec_settings`, `template_json` and back).
A process template's command line is stored under `argv`, which every release reads;
`template_from_json` also reads it under `command`, the name every surface uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from stoker.domain.errors import InvalidRequest, StokerError
from stoker.domain.rollouts import CanaryStrategy, RolloutState, Strategy, strategy_json
from stoker.domain.specs import (
    Activation,
    CostSpec,
    DemandSpec,
    PodTemplate,
    PoolSpec,
    ProcessTemplate,
    RuntimeTemplate,
    SpawnBackoff,
    Timeouts,
)
from stoker.domain.states import Reuse


class StaleGeneration(StokerError, code="stale-generation"):
    """A write of a pool compared a generation the pool has moved past (HTTP 412)."""

    def __init__(self, pool: str, expected: int, current: int | None) -> None:
        now = "gone" if current is None else f"at generation {current}"
        super().__init__(f"pool {pool!r} is {now}, not {expected}: read it again")
        self.pool, self.expected, self.current = pool, expected, current


class InvalidSettings(InvalidRequest, code="invalid-request"):
    """Settings that are each valid but do not fit together or the pool (HTTP 422), such
    as a warm target above the pool's cap."""


class SameTemplate(StokerError, code="same-template"):
    """A rollout of the template the pool already serves or already rolls out (HTTP 409):
    it would ramp nothing."""


class PoolInUse(StokerError, code="pool-in-use"):
    """A pool that cannot be deleted now (HTTP 409): it is not drained, or was drained a
    moment ago (another replica may not have read it), still has live workers or open
    claims, rolls a template out, or this replica's config declares it. `reason` names
    which (`not_draining`, `just_drained`, `in_use`, `rollout_active`, `in_config`)."""

    def __init__(
        self, message: str, *, reason: str, live_workers: int = 0, open_claims: int = 0
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.live_workers, self.open_claims = live_workers, open_claims


@dataclass(frozen=True, slots=True)
class DeletedPool:
    """What deleting a stored pool removed: the generation it had, and the rows deleted
    from each table (`pools`, `revisions`, `rollouts`, ...), by table."""

    name: str
    generation: int
    removed: Mapping[str, int]


def check_deletable(
    pool: str,
    expected: int | None,
    *,
    generation: int,
    draining: bool,
    live_workers: int,
    open_claims: int,
    active_rollout: str | None,
) -> None:
    """Raise why the stored pool (at `generation`) cannot be deleted now, if it cannot:
    `StaleGeneration` when the caller read another generation (`expected`; None: any),
    `PoolInUse` when it is not drained, rolls a template out, or still has live workers or
    open claims. The store calls it with what it read in the deleting transaction."""
    if expected is not None and expected != generation:
        raise StaleGeneration(pool, expected, generation)
    if not draining:
        raise PoolInUse(
            f"pool {pool!r} is not drained: drain it first (stoker pools drain {pool}), "
            "then delete it once its sessions have ended",
            reason="not_draining",
        )
    if active_rollout is not None:
        raise PoolInUse(
            f"pool {pool!r} is rolling a template out (rollout {active_rollout!r}): "
            "abort or promote the rollout first",
            reason="rollout_active",
        )
    if live_workers or open_claims:
        raise PoolInUse(
            f"pool {pool!r} still has {_many(live_workers, 'live worker')} and "
            f"{_many(open_claims, 'open claim')}: delete it once its sessions have ended "
            "and its workers have retired",
            reason="in_use",
            live_workers=live_workers,
            open_claims=open_claims,
        )


def _many(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


#: The largest generation a pool can reach: the store keeps it as a signed 64-bit integer.
GENERATION_MAX = 2**63 - 1

#: The states of a rollout that has not ended: at most one per pool.
ACTIVE_ROLLOUT_STATES = frozenset(s for s in RolloutState if not s.ended)


#: The settings of a stored pool that `PATCH /v1/pools/{name}` may change.
TUNABLE_SETTINGS = (
    "warm_target",
    "max_workers",
    "max_workers_per_org",
    "hot_idle_ttl",
    "max_ttl",
    "min_hot_idle",
    "lease_s",
    "claim_timeout_s",
    "scale_down_delay",
    "max_claim_s",
)


@dataclass(frozen=True, slots=True)
class StoredPool:
    """A pool as the store holds it: its spec at the stable revision (`spec.revision`)."""

    spec: PoolSpec
    #: Bumped by every change of the pool, its rollouts included; every write compares it.
    generation: int
    #: The strategy of a rollout a changed template proposes.
    strategy: Strategy = field(default_factory=CanaryStrategy)
    #: True while the pool hands out no new claims (its sessions end, its warm workers go).
    draining: bool = False
    created_at: float = 0.0
    updated_at: float = 0.0
    #: The settings a config file last seeded (`seed_settings`): a file changes the stored
    #: settings only while they are still what a file wrote, never after an API change.
    seed: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The pool's name."""
        return self.spec.name

    @property
    def revision(self) -> str:
        """The stable revision: what the pool serves outside a rollout."""
        return self.spec.revision

    def evolve(self, **changes: Any) -> StoredPool:
        """A copy with `changes` applied (the generation is the store's to bump)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class StoredRevision:
    """One template a pool has had, under its hash (`revision_of`)."""

    pool: str
    revision: str
    template: RuntimeTemplate
    created_at: float


@dataclass(frozen=True, slots=True)
class Rollout:
    """One rollout of a pool's revision: the only place its ramp is kept."""

    id: str
    pool: str
    revision: str
    #: The stable revision when the rollout started (what a rollback returns to).
    base_revision: str
    strategy: Strategy
    state: RolloutState
    started_at: float
    #: Index into `strategy.steps` of the current step.
    step: int = 0
    #: Percent of new claims the revision gets now (0 once it ended other than promoted).
    share: int = 0
    step_started_at: float | None = None
    ended_at: float | None = None
    reason: str | None = None

    @property
    def active(self) -> bool:
        """True while ramping or paused."""
        return self.state in ACTIVE_ROLLOUT_STATES

    def evolve(self, **changes: Any) -> Rollout:
        """A copy with `changes` applied."""
        return dataclasses.replace(self, **changes)


# -- JSON of specs and templates -----------------------------------------------------------

#: The fields of `PoolSpec` kept elsewhere than in its settings: the name is the key, the
#: template lives in the revision row, the revision is the stable revision column.
_NOT_SETTINGS = frozenset({"name", "template", "revision"})


def template_json(template: RuntimeTemplate) -> dict[str, Any]:
    """A template as a JSON object, tagged with its kind (`process` or `pod`)."""
    kind = "process" if isinstance(template, ProcessTemplate) else "pod"
    body = _plain(dataclasses.asdict(template))
    return {"kind": kind, **body}


def template_from_json(body: Mapping[str, Any]) -> RuntimeTemplate:
    """The template `template_json` wrote."""
    data = {k: v for k, v in body.items() if k != "kind"}
    if body.get("kind", "process") == "process":
        command = data.pop("command", None)
        data["argv"] = tuple(data.get("argv", command or ()))
        return ProcessTemplate(**data)
    for name in ("command", "args"):
        data[name] = tuple(data.get(name, ()))
    data["tolerations"] = tuple(dict(t) for t in data.get("tolerations", ()))
    return PodTemplate(**data)


def spec_settings(spec: PoolSpec) -> dict[str, Any]:
    """Every setting of a pool spec but its name, template and revision, as JSON."""
    return {
        f.name: _plain(getattr(spec, f.name))
        for f in dataclasses.fields(spec)
        if f.name not in _NOT_SETTINGS
    }


def seed_settings(spec: PoolSpec, strategy: Strategy) -> dict[str, Any]:
    """A pool's settings and default strategy as JSON: what a seed compares and records."""
    return {**spec_settings(spec), "rollout": strategy_json(strategy)}


def spec_from_json(
    name: str, settings: Mapping[str, Any], template: RuntimeTemplate, revision: str
) -> PoolSpec:
    """The pool spec `spec_settings` wrote, at `revision` with its `template`."""
    known = {f.name for f in dataclasses.fields(PoolSpec)} - _NOT_SETTINGS
    data: dict[str, Any] = {k: v for k, v in settings.items() if k in known}
    if "timeouts" in data:
        data["timeouts"] = Timeouts(**data["timeouts"])
    if "spawn_backoff" in data:
        data["spawn_backoff"] = SpawnBackoff(**data["spawn_backoff"])
    if "demand" in data:
        data["demand"] = DemandSpec(**data["demand"])
    if data.get("cost") is not None:
        data["cost"] = CostSpec(**data["cost"])
    if "reuse" in data:
        data["reuse"] = Reuse(data["reuse"])
    if "activation" in data:
        data["activation"] = Activation(data["activation"])
    return PoolSpec(name=name, template=template, revision=revision, **data)


def with_settings(spec: PoolSpec, changes: Mapping[str, Any]) -> PoolSpec:
    """`spec` with tunable settings changed; `InvalidSettings` names an unknown setting or
    a combination the spec refuses (warm_target above max_workers, say). The values' types
    and bounds are the caller's to have checked (`stoker.config.changes.SettingsChange`)."""
    unknown = sorted(set(changes) - set(TUNABLE_SETTINGS))
    if unknown:
        raise InvalidSettings(f"not a tunable pool setting: {', '.join(unknown)}")
    try:
        return dataclasses.replace(spec, **changes)
    except StokerError as exc:
        raise InvalidSettings(str(exc)) from None


def _plain(value: Any) -> Any:
    """`value` with tuples as lists, mappings as dicts and enums as their values."""
    if isinstance(value, StrEnum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
