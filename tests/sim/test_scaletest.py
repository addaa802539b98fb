"""Every shipped scenario in its short form, with assertions on what it shows.

These run the real control plane (replicas, pool managers, janitors, fallback reapers,
electors, the Kubernetes runtime) against `SimCluster`, the in-process cluster: there is
no Kubernetes cluster on this machine, and the point of the simulator is virtual time.
Each short run takes a few seconds of wall time; the scenarios' full forms are measured
by `benchmarks/scaletest.py`.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from stoker.cli import app
from stoker.sim.report import summary_bytes, write_report
from stoker.sim.runner import ScenarioResult, run_scenario
from stoker.sim.scenario import load_scenario

SCENARIOS = (
    "cold-ramp",
    "leader-blip",
    "claim-burst",
    "consolidation",
    "diurnal",
    "large",
    "orgs",
)


@cache
def _short(name: str) -> ScenarioResult:
    """The short form of a scenario, every policy, run once per test session."""
    return run_scenario(load_scenario(name, short=True), short=True)


def _policy(name: str, policy: str) -> dict[str, Any]:
    for result in _short(name).policies:
        if result.name == policy:
            return result.summary
    raise AssertionError(f"{name} has no policy {policy}")


@pytest.mark.parametrize("name", SCENARIOS)
def test_stokers_policy_breaks_no_invariant_in_any_scenario(name: str) -> None:
    result = _short(name)
    runs = [r for r in result.policies if r.kind == "stoker"]
    assert runs, f"{name} runs no stoker policy"
    for run in runs:
        assert run.summary["invariants"]["checks"] > 0
        assert result.stoker_violations() == [], [str(v) for _, v in result.stoker_violations()]
        assert run.summary["claims"]["bound"] > 0
        assert run.summary["sessions"]["failed"] == 0


def test_cold_ramp_reaches_target_in_one_tick_plus_a_pod_start_while_static_plateaus() -> None:
    scenario = load_scenario("cold-ramp", short=True)
    stoker = _policy("cold-ramp", "stoker")
    static = _policy("cold-ramp", "static-target")

    assert stoker["claims"]["bound"] == scenario.target_hot == 30
    assert stoker["time_to_target_s"] is not None
    # One reconcile tick (janitor pass) plus the slowest pod start of the run.
    bound = scenario.control_plane.janitor_interval_s + stoker["workers"]["pod_start_s"]["max"]
    assert stoker["time_to_target_s"] <= bound
    assert stoker["workers"]["peak"]["hot"] == 30

    # duckgres #597: 1:1 replenish, 3 spawns at a time and a memory-derived cap of 11.
    assert static["time_to_target_s"] is None
    assert static["workers"]["peak"]["hot"] == 11
    assert static["claims"]["failures"].get("pool_cap", 0) > 0


def test_run_once_elector_leaks_idle_workers_after_the_blips_while_stoker_does_not() -> None:
    stoker = _policy("leader-blip", "stoker")
    once = _policy("leader-blip", "run-once-elector")

    # Without re-contention the last blip leaves nobody leading; without a fallback reaper
    # parked workers outlive their TTL (I3), which the checker reports.
    assert once["invariants"]["by_invariant"].get("I3", 0) > 0
    assert once["leadership"]["time_without_leader_s"] > 600
    assert once["workers"]["final"]["hot_idle"] > 5 * max(1, stoker["workers"]["final"]["hot_idle"])

    # stoker re-contends: a leader is back within a blip plus a lease, every time.
    assert stoker["invariants"]["violations"] == 0
    assert stoker["leadership"]["terms"] >= 2
    assert stoker["leadership"]["time_without_leader_s"] <= 3 * (60 + 15 + 2 * 5)
    assert stoker["workers"]["retirements"].get("ttl", 0) > once["workers"]["retirements"].get(
        "ttl", 0
    )


def test_a_claim_burst_is_served_from_the_warm_pool_in_milliseconds() -> None:
    scenario = load_scenario("claim-burst", short=True)
    stoker = _policy("claim-burst", "stoker")
    claims = stoker["claims"]

    assert claims["bound"] == scenario.target_hot
    assert claims["failures"] == {}
    assert claims["warm_hit_ratio"] == 1.0
    # The modelled API latency is ~10 ms a call (p99 ~32 ms) and activation ~20 ms; the
    # assignment itself adds nothing that grows with the pool (agent-sandbox saw 4.4 s).
    assert claims["latency_s"]["all"]["p99"] < 0.25
    static = _policy("claim-burst", "static-target")
    assert static["claims"]["bound"] < claims["bound"]


def test_bare_pod_background_loses_demand_to_consolidation_while_controllers_conserve_it() -> None:
    managed = _policy("consolidation", "controller-managed")["background"]
    bare = _policy("consolidation", "bare-pods")["background"]

    # Controller-managed: every evicted pod is recreated, so the background keeps what it
    # asked for and consolidation stops at the true surplus.
    assert managed["pods_destroyed"] == 0
    assert managed["pods_replaced"] > 0
    assert managed["bound_cores"] >= 0.99 * managed["target_cores"]
    # Bare pods: each eviction destroys demand for good (the reclaim cascade).
    assert bare["pods_destroyed"] > 0
    assert bare["pods_replaced"] == 0
    assert bare["bound_cores"] < 0.9 * bare["target_cores"]


def test_diurnal_headroom_is_kept_only_while_spawns_wait_for_nodes() -> None:
    on = _policy("diurnal", "stoker")
    off = _policy("diurnal", "stoker-headroom-off")

    # No forecast in two hours, and a claim waits for a worker to start near the peak
    # (2.3 s); but its spawn found room on the nodes there were (a node takes about a
    # minute to launch here): a spare node would have bought nothing, and stoker holds none.
    assert off["vcpu_hours"]["placeholder"] == on["vcpu_hours"]["placeholder"] == 0
    assert on["claims"]["cold_share"] <= 0.005
    assert on["claims"]["latency_s"]["all"]["max"] < 10
    assert sum(on["claims"]["failures"].values()) <= sum(off["claims"]["failures"].values())


def test_a_burst_whose_spawns_wait_for_nodes_keeps_the_headroom() -> None:
    # A burst nobody forecast, beyond the nodes there are: claims go cold while their spawns
    # wait for new nodes, and the pool keeps its spare nodes for the hold.
    burst = run_scenario(load_scenario("burst", short=True), policies=["stoker"], short=True)
    stoker = burst.policies[0].summary
    assert stoker["claims"]["cold_share"] > 0
    assert stoker["vcpu_hours"]["placeholder"] > 0


def test_the_large_scenario_binds_every_claim_without_waiting_for_nodes() -> None:
    stoker = _policy("large", "stoker")
    assert stoker["claims"]["failures"] == {}
    assert stoker["claims"]["bound"] == stoker["claims"]["attempts"]
    assert stoker["nodes"]["launched"] > 100


def test_the_same_scenario_and_seed_give_the_same_summary_byte_for_byte() -> None:
    scenario = load_scenario("consolidation", short=True)
    once = run_scenario(scenario, short=True)
    # Again, this time each policy in its own process.
    again = run_scenario(scenario, short=True, jobs=2)
    assert summary_bytes(once) == summary_bytes(again)
    other = run_scenario(scenario.model_copy(update={"seed": scenario.seed + 1}), short=True)
    assert summary_bytes(other) != summary_bytes(once)


def test_the_report_holds_the_summary_the_timeseries_the_plots_and_the_markdown(
    tmp_path: Path,
) -> None:
    result = _short("cold-ramp")
    written = {p.name for p in write_report(result, tmp_path)}
    assert {"summary.json", "timeseries.csv", "report.md"} <= written
    assert len([n for n in written if n.endswith(".png")]) == 6
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["policies"]) == {"stoker", "static-target"}
    header, *rows = (tmp_path / "timeseries.csv").read_text().splitlines()
    assert header.startswith("policy,")
    assert {row.split(",")[0] for row in rows} == {"stoker", "static-target"}
    report = (tmp_path / "report.md").read_text()
    assert "| stoker |" in report
    assert "| static-target |" in report


def test_a_report_written_over_another_keeps_none_of_its_warnings(tmp_path: Path) -> None:
    result = _short("cold-ramp")
    assert any(p.log_lines for p in result.policies)
    write_report(result, tmp_path)
    assert (tmp_path / "warnings.log").is_file()
    quiet = dataclasses.replace(
        result, policies=[dataclasses.replace(p, log_lines=[]) for p in result.policies]
    )
    written = write_report(quiet, tmp_path)
    assert not (tmp_path / "warnings.log").exists()
    assert all(p.name != "warnings.log" for p in written)


def test_scaletest_command_writes_the_report_and_prints_the_table(tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = CliRunner().invoke(
        app, ["scaletest", "cold-ramp", "--short", "--out", str(out), "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    assert "static-target" in result.output
    assert "virtual time" in result.output
    assert (out / "summary.json").is_file()
    assert (out / "report.md").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no-such-scenario"], "no scenario file 'no-such-scenario' (known scenarios: "),
        (["cold-ramp", "--policy", "nope"], "nope"),
    ],
)
def test_scaletest_refuses_bad_input_in_one_line(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = CliRunner().invoke(app, ["scaletest", *args, "--out", str(tmp_path / "r")])
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "r").exists()


def test_a_scenario_with_a_wrong_key_names_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nduration_s: 60\npool: {warm_targt: 3}\n")
    result = CliRunner().invoke(app, ["scaletest", str(bad), "--out", str(tmp_path / "r")])
    assert result.exit_code != 0
    assert "pool.warm_targt: unknown key" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            "rollout: {at_s: 60, steps: [50, 10]}",
            "policy 'stoker': rollout.steps[1]: must exceed the step before (50)",
        ),
        (
            "rollout: {at_s: 60, step_interval_s: 100000}",
            "policy 'stoker': rollout.step_interval_s: must be > 0 and at most a day",
        ),
        (
            "rollout: {at_s: 60, image: 'registry.sim.example/worker:1'}",
            "policy 'stoker': rollout.image: the pool runs 'registry.sim.example/worker:1' "
            "already: nothing to roll out",
        ),
    ],
)
def test_a_scenario_the_control_plane_refuses_fails_before_it_runs(
    tmp_path: Path, section: str, message: str
) -> None:
    """The scenario file takes these, the control plane does not: the run used to go on
    without its rollout (the canary's steps). (A pool's `lease_s` under a second, which
    ended the run in `unexpected error`, is now refused as the file loads.)"""
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"name: bad\nduration_s: 120\npolicies: [stoker]\n{section}\n")
    out = tmp_path / "r"
    result = CliRunner().invoke(app, ["scaletest", str(bad), "--out", str(out), "--no-progress"])
    assert result.exit_code == 1
    assert f"stoker: scenario bad: {message}" in result.output
    assert "unexpected error" not in result.output
    assert not out.exists()


def test_a_report_that_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--out` under a file: said at once, where it was said after minutes of running."""
    import stoker.sim.runner

    ran: list[object] = []
    monkeypatch.setattr(stoker.sim.runner, "run_scenario", lambda *a, **k: ran.append(a))
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "r"
    args = ["scaletest", "cold-ramp", "--short", "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and not ran
    assert f"cannot write the report to {out}" in result.output
    assert "Traceback" not in result.output


def test_the_report_directory_check_leaves_what_it_found(tmp_path: Path) -> None:
    """The check makes what it needs to write and removes what it made."""
    from stoker.sim.report import check_out

    check_out(tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    check_out(tmp_path / "kept")
    assert (tmp_path / "kept").is_dir() and list((tmp_path / "kept").iterdir()) == []


@pytest.mark.parametrize("name", ["diurnal", "weekly"])
def test_the_gathered_benchmark_scenarios_are_the_shipped_ones_with_the_preference(
    name: str,
) -> None:
    """benchmarks/scenarios/NAME-gathered.yaml is the shipped scenario with only the
    runtime's `prefer_session_nodes` turned on always (and its own name); the shipped one
    gathers as `stoker serve` does by default, while the forecast says so."""
    path = Path(__file__).parents[2] / "benchmarks" / "scenarios" / f"{name}-gathered.yaml"
    gathered, shipped = load_scenario(str(path)), load_scenario(name)
    assert gathered.control_plane.prefer_session_nodes is True
    assert shipped.control_plane.prefer_session_nodes == "forecast"
    same = gathered.model_copy(
        update={
            "name": shipped.name,
            "control_plane": gathered.control_plane.model_copy(
                update={"prefer_session_nodes": "forecast"}
            ),
        }
    )
    assert same == shipped


def test_the_progress_shows_a_run_that_ends_mid_step_as_done_to_a_tenth() -> None:
    """A backtest's run ends at the log's last arrival plus a tail (538.1 s here), its
    last step past it: the bar read "9.0/8.96828 min virtual"."""
    from stoker.cli.scaletest import _ScaletestProgress

    shown = _ScaletestProgress(enabled=True)
    shown.update("current", 540.0, 538.097)
    assert shown._progress is not None
    (task,) = shown._progress.tasks
    assert task.completed == task.total == 538.097
    assert task.fields["virtual"] == "9.0/9.0 min virtual"
    shown.update("weekly", 7200.0, 10800.0)
    assert shown._progress.tasks[1].fields["virtual"] == "2.0/3.0 h virtual"
    shown.stop()
