"""The baselines behave as specified: Knative's KPA on its own (pure arithmetic on
samples), then every policy on one small scenario.

The scenario runs the real control plane against `SimCluster` (no Kubernetes cluster
here; virtual time): 20 tenants on a pool with a static warm target of 2, with a burst of
ten times the arrival rate a quarter of an hour in.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest

from stoker.adapters.sqlite import SqliteStore
from stoker.sim.kpa import KnativeKpa
from stoker.sim.plots import PLOTS, windows
from stoker.sim.report import write_report
from stoker.sim.runner import PolicyResult, ScenarioResult, run_scenario
from stoker.sim.scenario import KnativeKpaParams, scenario_from_mapping

SMALL: dict[str, Any] = {
    "name": "small",
    "duration_s": 1500,
    "sample_interval_s": 10,
    "check_interval_s": 10,
    "policies": ["stoker", "static-target", "static-target-uncapped", "knative-kpa"],
    "control_plane": {"replicas": 1},
    "pool": {"warm_target": 2},
    "tenants": [
        {
            "name": "t",
            "count": 20,
            "arrival": {
                "rate_per_h": 6,
                "start_s": 60,
                "bursts": [{"at_s": 900, "duration_s": 120, "factor": 10}],
            },
            "duration": {"kind": "exponential", "mean": 600},
            "retries": 3,
        }
    ],
    "cluster": {
        "node_pools": [
            {
                "name": "workers",
                "instance_types": ["m5.4xlarge"],
                "initial_nodes": {"m5.4xlarge": 10},
            }
        ]
    },
}


@cache
def _small() -> ScenarioResult:
    return run_scenario(scenario_from_mapping(SMALL), jobs=2)


def _run(name: str) -> PolicyResult:
    return next(p for p in _small().policies if p.name == name)


def _kpa(**params: Any) -> KnativeKpa:
    return KnativeKpa(KnativeKpaParams(**params), store=SqliteStore(":memory:"), warm_target=0)


def test_the_kpa_sizes_to_the_stable_average_over_the_target_utilization() -> None:
    kpa = _kpa()
    for t in range(1, 121):
        kpa.sample(float(t), 7)
    # 7 sessions at 70 % of one per pod: 10 pods; no panic at 10 ready pods.
    assert kpa.desired(120.0, ready=10) == 10
    assert not kpa.panicking


def test_the_kpa_panics_at_twice_the_ready_pods_and_does_not_scale_down_in_panic() -> None:
    kpa = _kpa()
    for t in range(1, 61):
        kpa.sample(float(t), 2)
    assert kpa.desired(60.0, ready=3) == 3
    # A burst: 14 sessions over the 6 s panic window = 20 pods, >= 2 x 3 ready.
    for t in range(61, 67):
        kpa.sample(float(t), 14)
    assert kpa.desired(66.0, ready=3) == 20
    assert kpa.panicking
    # The burst is gone, but panic holds the pod count for a stable window...
    for t in range(67, 100):
        kpa.sample(float(t), 2)
    assert kpa.desired(99.0, ready=20) == 20
    # ...and ends a stable window after the threshold was last crossed.
    for t in range(100, 130):
        kpa.sample(float(t), 2)
    # 2 sessions at 70 %: 3 pods.
    assert kpa.desired(129.0, ready=20) == 3
    assert not kpa.panicking


def test_the_kpa_defaults_are_knatives() -> None:
    params = KnativeKpaParams()
    assert params.stable_window_s == 60
    assert params.stable_window_s * params.panic_window_percentage / 100 == pytest.approx(6)
    assert params.panic_threshold_percentage == 200
    assert params.target_utilization == 0.7


def test_static_target_uncapped_keeps_the_static_target_without_the_memory_cap() -> None:
    capped, uncapped = _run("static-target"), _run("static-target-uncapped")
    # The memory budget caps static-target at 11 workers; without it the fleet grows.
    assert capped.summary["workers"]["peak"]["live"] <= 11
    assert capped.summary["claims"]["failures"].get("pool_cap", 0) > 0
    assert uncapped.summary["workers"]["peak"]["live"] > 11
    assert "pool_cap" not in uncapped.summary["claims"]["failures"]
    # Its demand logic is static-target's: the leader never wants more than the target.
    desired = {row[2] for row in uncapped.passes.rows if row[2] is not None}
    assert desired == {2}


def test_knative_kpa_raises_the_warm_pool_with_concurrency() -> None:
    kpa = _run("knative-kpa")
    desired = [row[2] for row in kpa.passes.rows if row[2] is not None]
    assert max(desired) > 2
    assert (
        kpa.summary["workers"]["peak"]["warm"]
        > _run("static-target-uncapped").summary["workers"]["peak"]["warm"]
    )


@pytest.mark.parametrize(
    "name", [p["policy"] if isinstance(p, dict) else p for p in SMALL["policies"]]
)
def test_every_policy_binds_its_sessions_without_an_invariant_violation(name: str) -> None:
    run = _run(name)
    assert run.summary["claims"]["bound"] > 0
    assert run.summary["invariants"]["checks"] > 0
    assert run.violations == []


def test_the_plots_shade_the_bursts_and_faults_of_the_scenario() -> None:
    data = {
        **SMALL,
        "cluster": {
            **SMALL["cluster"],
            "faults": [{"at": 300, "duration": 60, "kind": "lease_blip", "client": "cp-0"}],
        },
    }
    assert windows(scenario_from_mapping(data)) == [
        (300.0, 360.0, "fault"),
        (900.0, 1020.0, "burst"),
    ]


def test_the_report_draws_every_plot_for_every_policy(tmp_path: Path) -> None:
    written = {p.name for p in write_report(_small(), tmp_path)}
    assert set(PLOTS) <= written
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
