"""Rollouts of a pool's new revision: their strategies and states (docs/guides/rollouts.md).

A *canary* rollout hands a growing share of the pool's new claims to the new revision, one
step at a time; a *replace* rollout switches every new claim at once (stoker's behaviour
before canaries). What a rollout does at any moment is decided by one pure function,
`stoker.policy.rollout.rollout_plan`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from stoker.domain.errors import InvalidRequest


class RolloutState(StrEnum):
    """Where a rollout stands; the last four are final."""

    RAMPING = "ramping"
    PAUSED = "paused"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"
    ABORTED = "aborted"
    #: A newer rollout of the same pool started while this one was under way.
    SUPERSEDED = "superseded"

    @property
    def ended(self) -> bool:
        """Whether the rollout is over (nothing can change it any more)."""
        return self not in (RolloutState.RAMPING, RolloutState.PAUSED)


#: A canary's defaults: 10 %, then half, then every new claim, a minute apart.
DEFAULT_STEPS = (10, 50, 100)
DEFAULT_STEP_INTERVAL_S = 60.0
DEFAULT_MAX_FAILURE_RATIO = 0.2
#: How long a step may wait for the new revision's warm workers before the rollout pauses.
DEFAULT_HOLD_DEADLINE_S = 600.0


class StrategyKind(StrEnum):
    """How a new revision takes over a pool."""

    CANARY = "canary"
    REPLACE = "replace"


@dataclass(frozen=True, slots=True)
class CanaryStrategy:
    """Shares of new claims (percent, increasing, 1-100) the new revision gets, one step
    per `step_interval_s`; the rollout rolls back when the revision's spawn, activation or
    claim failures reach `max_failure_ratio` of its attempts. A step takes effect once the
    revision holds its warm workers; one that cannot within `hold_deadline_s` of being due
    pauses the rollout."""

    steps: tuple[int, ...] = DEFAULT_STEPS
    step_interval_s: float = DEFAULT_STEP_INTERVAL_S
    max_failure_ratio: float = DEFAULT_MAX_FAILURE_RATIO
    hold_deadline_s: float = DEFAULT_HOLD_DEADLINE_S

    def __post_init__(self) -> None:
        problems = canary_problems(
            self.steps, self.step_interval_s, self.max_failure_ratio, self.hold_deadline_s
        )
        if problems:
            key, problem = problems[0]
            name = "".join(f"[{k}]" if isinstance(k, int) else k for k in key)
            raise InvalidRequest(f"{name}: {problem}")

    @property
    def kind(self) -> StrategyKind:
        """`canary`."""
        return StrategyKind.CANARY

    def share(self, step: int) -> float:
        """The share (0-1) of new claims the new revision gets at `step` (an index)."""
        return self.steps[min(max(step, 0), len(self.steps) - 1)] / 100


def canary_problems(
    steps: Sequence[int], step_interval_s: float, max_failure_ratio: float, hold_deadline_s: float
) -> list[tuple[tuple[str | int, ...], str]]:
    """What is wrong with a canary's settings, each problem under its key (`("steps", 1)`
    for the second step); empty when nothing is."""
    problems: list[tuple[tuple[str | int, ...], str]] = []
    if not steps:
        problems.append((("steps",), "a canary needs at least one step"))
    for i, step in enumerate(steps):
        if not 1 <= step <= 100:
            problems.append((("steps", i), "must lie within 1-100 percent"))
        elif i > 0 and step <= steps[i - 1]:
            problems.append((("steps", i), f"must exceed the step before ({steps[i - 1]})"))
    for name, value, most, said in (
        ("step_interval_s", step_interval_s, 86_400, "a day"),
        ("max_failure_ratio", max_failure_ratio, 1, "1"),
        ("hold_deadline_s", hold_deadline_s, 86_400, "a day"),
    ):
        if not 0 < value <= most:
            problems.append(((name,), f"must be > 0 and at most {said}"))
    return problems


@dataclass(frozen=True, slots=True)
class ReplaceStrategy:
    """Every new claim goes to the new revision at once; the old one's warm workers retire."""

    @property
    def kind(self) -> StrategyKind:
        """`replace`."""
        return StrategyKind.REPLACE


Strategy = CanaryStrategy | ReplaceStrategy


def strategy_from(body: Mapping[str, Any]) -> Strategy:
    """A strategy from its JSON form (`{"kind": "canary", "steps": [...], ...}`);
    `InvalidRequest` when it is malformed."""
    kind = body.get("kind", StrategyKind.CANARY.value)
    if kind == StrategyKind.REPLACE.value:
        return ReplaceStrategy()
    if kind != StrategyKind.CANARY.value:
        raise InvalidRequest(f"unknown strategy kind {kind!r} (canary or replace)")
    steps = body.get("steps", DEFAULT_STEPS)
    if not isinstance(steps, Sequence) or isinstance(steps, str):
        raise InvalidRequest("steps must be a list of percentages")
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise InvalidRequest("steps must be whole percentages")
    numbers = {}
    defaults = {
        "step_interval_s": DEFAULT_STEP_INTERVAL_S,
        "max_failure_ratio": DEFAULT_MAX_FAILURE_RATIO,
        "hold_deadline_s": DEFAULT_HOLD_DEADLINE_S,
    }
    for name, default in defaults.items():
        value = body.get(name, default)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise InvalidRequest(f"{name} must be a number")
        numbers[name] = float(value)
    return CanaryStrategy(steps=tuple(steps), **numbers)


def strategy_json(strategy: Strategy) -> dict[str, Any]:
    """The JSON form of a strategy (what `strategy_from` reads back)."""
    if isinstance(strategy, ReplaceStrategy):
        return {"kind": StrategyKind.REPLACE.value}
    return {
        "kind": StrategyKind.CANARY.value,
        "steps": list(strategy.steps),
        "step_interval_s": strategy.step_interval_s,
        "max_failure_ratio": strategy.max_failure_ratio,
        "hold_deadline_s": strategy.hold_deadline_s,
    }
