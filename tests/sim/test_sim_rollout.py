"""The rollout scenarios: a good revision (also on a pool of long sessions), a bad image,
and a bad image whose failures only the replicas that do not lead see, each rolled out by
stoker's canary, by replace and by a ramp sized from the pool's default (#14, #25).

They run the real control plane against `SimCluster` in virtual time (no Kubernetes
cluster here); the full forms are what `stoker scaletest rollout` reports.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from stoker.sim.report import markdown, rollout_rows
from stoker.sim.runner import ScenarioResult, run_policy, run_scenario
from stoker.sim.scenario import load_scenario, scenario_from_mapping


@cache
def _short(name: str) -> ScenarioResult:
    return run_scenario(load_scenario(name, short=True), short=True)


@cache
def _full(name: str) -> ScenarioResult:
    return run_scenario(load_scenario(name))


def _summary(name: str, policy: str, *, short: bool = True) -> dict[str, Any]:
    for result in (_short(name) if short else _full(name)).policies:
        if result.name == policy:
            return result.summary
    raise AssertionError(f"{name} has no policy {policy}")


def _rollout(name: str, policy: str, *, short: bool = True) -> dict[str, Any]:
    rollout: dict[str, Any] = _summary(name, policy, short=short)["rollout"]
    return rollout


@pytest.mark.parametrize("name", ["rollout", "rollout-long-sessions"])
def test_the_canary_costs_about_what_switching_at_once_does(name: str) -> None:
    """The full form: promoted with no cold and no failed claim from its start until the
    old revision's last idle worker is gone, within the cap, for at most 1.15x the idle
    vCPU-hours of `replace` in the same run, within twice its nominal schedule."""
    stoker = _rollout(name, "stoker", short=False)
    assert stoker["outcome"] == "promoted"
    assert stoker["cold_claims_during"] == 0 and stoker["failed_claims_during"] == 0
    assert stoker["peak_live"] <= stoker["cap"]
    idle = _summary(name, "stoker", short=False)["vcpu_hours"]["idle"]
    assert idle <= 1.15 * _summary(name, "replace", short=False)["vcpu_hours"]["idle"]
    scenario = load_scenario(name)
    assert scenario.rollout is not None
    nominal = len(scenario.rollout.steps) * scenario.rollout.step_interval_s
    assert stoker["completed_s"] <= 2 * nominal


def test_a_canary_sized_from_the_other_revisions_holds_a_second_fleet() -> None:
    """Sessions never move: sized from the sessions the old revision serves, the canary
    holds idle workers no claim uses (stoker's rule before #25)."""
    name = "rollout-long-sessions"
    replace = _summary(name, "replace")["vcpu_hours"]["idle"]
    others = _summary(name, "canary-others-capacity")
    assert others["rollout"]["outcome"] == "promoted"
    assert others["vcpu_hours"]["idle"] > 1.5 * replace
    assert others["rollout"]["peak_live"] > _rollout(name, "stoker")["peak_live"]


def test_failures_only_the_replicas_that_do_not_lead_see_roll_the_canary_back() -> None:
    """Three replicas; the bad image fails only on the two that do not lead: the leader's
    verdict sums every replica's counts, within two step intervals of the first step."""
    stoker = _rollout("rollout-bad-image-followers", "stoker", short=False)
    assert stoker["outcome"] == "rolled_back" and "activation" in stoker["reason"]
    assert stoker["ended_s"] - stoker["first_step_s"] <= 2 * 120
    violations = _full("rollout-bad-image-followers").stoker_violations()
    assert violations == [], [str(v) for _, v in violations]


def test_the_canary_promotes_a_good_revision_with_few_cold_claims() -> None:
    stoker = _rollout("rollout", "stoker")
    replace = _rollout("rollout", "replace")
    assert stoker["outcome"] == "promoted" and stoker["completed_s"] is not None
    assert stoker["claims_during"] > 50
    assert stoker["cold_claims_during"] <= 0.05 * stoker["claims_during"]
    assert stoker["failed_claims_during"] == 0
    # replace sends every claim to a revision that has no worker yet: never fewer cold
    # claims than the canary (the full form shows its cliff: `stoker scaletest rollout`).
    assert replace["outcome"] == "replaced"
    assert replace["cold_claims_after_start"] >= stoker["cold_claims_after_start"]


def test_a_ramp_sized_from_the_pool_default_never_completes() -> None:
    stuck = _rollout("rollout", "canary-pool-default")
    assert stuck["outcome"] is None and stuck["completed_s"] is None


def test_a_bad_image_rolls_back_within_the_first_steps_share_of_failed_claims() -> None:
    stoker = _rollout("rollout-bad-image", "stoker")
    assert stoker["outcome"] == "rolled_back"
    assert "activation" in stoker["reason"]
    assert stoker["failed_claims_during"] <= 0.10 * stoker["claims_during"]
    assert _rollout("rollout-bad-image", "replace")["outcome"] == "replaced"


def test_stoker_keeps_every_invariant_and_i8_through_the_rollouts() -> None:
    for name in ("rollout", "rollout-bad-image", "rollout-long-sessions"):
        result = _short(name)
        assert result.stoker_violations() == [], [str(v) for _, v in result.stoker_violations()]
        stoker = _rollout(name, "stoker")
        assert stoker["peak_live"] <= stoker["cap"]


def test_the_report_shows_the_rollouts_side_by_side() -> None:
    result = _short("rollout")
    rows = {row.policy: row.cells for row in rollout_rows(result)}
    assert set(rows) == {"stoker", "replace", "canary-pool-default"}
    assert rows["stoker"]["outcome"] == "promoted"
    assert "## Rollout" in markdown(result)


def test_a_rollout_that_cannot_start_fails_the_run_instead_of_vanishing() -> None:
    """A rollout to the image the pool runs already is refused by the control plane; the
    run used to go on without it and report no rollout at all (exit 0). `run_scenario`
    refuses it before it runs; a policy run whose rollout fails raises."""
    view = scenario_from_mapping(
        {
            "name": "same-image",
            "duration_s": 120,
            "policies": ["stoker"],
            "control_plane": {"replicas": 1},
            "rollout": {"at_s": 30, "image": "registry.sim.example/worker:1"},
        }
    )
    with pytest.raises(RuntimeError, match=r"a part of the run failed: .*nothing to roll out"):
        run_policy(view.for_policy("stoker"))


@pytest.mark.parametrize("part", ["_sample_every", "passes"])
def test_a_sampler_or_pass_log_that_fails_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, part: str
) -> None:
    """The timeseries' sampler and the pass log run as tasks of their own: one that ended
    with an error left the summary without its samples or passes, and the run exit 0."""
    import stoker.sim.passlog as passlog
    import stoker.sim.runner as runner

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise ValueError("the part broke")

    if part == "passes":
        monkeypatch.setattr(passlog.PassLog, "run", broken)
    else:
        monkeypatch.setattr(runner._PolicyRun, "_sample_every", broken)
    view = scenario_from_mapping({"name": "broken", "duration_s": 120, "policies": ["stoker"]})
    with pytest.raises(RuntimeError, match=r"a part of the run failed: the part broke"):
        run_policy(view.for_policy("stoker"))
