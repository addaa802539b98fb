"""The policy kinds a scenario may name, and each kind's parameters.

`stoker` is stoker as `stoker serve` runs it; `stoker-reactive` is stoker with the learned
forecast off (the warm target and headroom from the reactive estimate alone). The rest are
the baselines stoker is compared with (`stoker.sim.baselines`, `stoker.sim.kpa`):
historical failures re-enacted, and the strongest reactive peer. `replace`,
`canary-pool-default` and `canary-others-capacity` differ from stoker only in how a
rollout ramps (`stoker.sim.rollout`).
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

#: The policy kinds a scenario may name (see `stoker.sim.replicas` and `stoker.sim.baselines`).
POLICY_KINDS = (
    "stoker",
    "stoker-reactive",
    "static-target",
    "static-target-uncapped",
    "knative-kpa",
    "run-once-elector",
    "percent-headroom",
    "replace",
    "canary-pool-default",
    "canary-others-capacity",
)


class ParamsModel(BaseModel):
    """A policy kind's parameters: unknown keys refused, frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class StaticTargetParams(ParamsModel):
    """duckgres #597: a static warm target with 1:1 replenish (demand never counts), three
    spawns at a time each held until its pod is ready, and a cap derived from memory."""

    #: duckgres #597: "a semaphore of 3 under a QPS-50 client was the real limit".
    spawn_concurrency: int = Field(3, ge=1)
    #: The cap is this budget divided by one worker's memory: 44 GiB / 4 GiB = 11 workers
    #: with the default pool, the plateau duckgres #597 hit.
    memory_budget_mib: int = Field(45_056, ge=1)


class PercentHeadroomParams(ParamsModel):
    """duckgres #757/#894: placeholders as a share of live workers, idle ones included."""

    #: duckgres #757: headroom configured for 20 % (it held 57 % of the node pool).
    percent: float = Field(20.0, gt=0)


class KnativeKpaParams(ParamsModel):
    """Knative's KPA (`stoker.sim.kpa`); the defaults are `config-autoscaler`'s
    (https://knative.dev/docs/serving/autoscaling/kpa-specific/)."""

    #: `stable-window`: 60 s.
    stable_window_s: float = Field(60.0, ge=6)
    #: `panic-window-percentage`: 10 % of the stable window (6 s).
    panic_window_percentage: float = Field(10.0, gt=0, le=100)
    #: `panic-threshold-percentage`: 200 % (panic at twice the ready pods).
    panic_threshold_percentage: float = Field(200.0, ge=110)
    #: A worker serves one session: `containerConcurrency: 1`, so the target is 1.
    target: float = Field(1.0, gt=0)
    #: `container-concurrency-target-percentage`: 70 %.
    target_utilization: float = Field(0.7, gt=0, le=1)
    #: The autoscaler scrapes queue-proxy's concurrency every second.
    scrape_s: float = Field(1.0, gt=0)


class NoParams(ParamsModel):
    """A policy without parameters."""


POLICY_PARAMS: Mapping[str, type[ParamsModel]] = {
    "stoker": NoParams,
    "stoker-reactive": NoParams,
    "static-target": StaticTargetParams,
    # static-target's demand logic without its memory cap or spawn semaphore.
    "static-target-uncapped": NoParams,
    "knative-kpa": KnativeKpaParams,
    "run-once-elector": NoParams,
    "percent-headroom": PercentHeadroomParams,
    # A rollout switches every new claim at once: stoker before canaries.
    "replace": NoParams,
    # A canary whose ramp is sized from the pool's default target, never from the other
    # revisions' load (picchu #602's first bug).
    "canary-pool-default": NoParams,
    # A canary sized from the other revisions' busy and warm workers times its share:
    # stoker's rule before #25, a second fleet when sessions are long.
    "canary-others-capacity": NoParams,
}
