"""The simulator's two input files, fed generated bad input: a scenario (`stoker scaletest
FILE`) and a claim log (`stoker backtest --from FILE`). Whatever the file, the reader
returns what a run can go on with, or raises `ConfigError` (one line, which the commands
print with status 1 or 2); never another exception.

Scenarios start from the ones stoker ships; a mutation replaces the value at any key path,
adds an unknown key at any level or deletes a key. Claim logs start from lines
`stoker claims export` writes; a mutation replaces a field's value, deletes or adds a
field, or puts a line out of order or out of JSON.

A scenario that loads must also run, and a claim log that reads must replay: some of the
mutated scenarios, cut to a couple of minutes and to sizes a test can afford, run one of
their policies to the end; well-formed logs of odd shapes replay in a backtest.

`STOKER_INPUT_FUZZ_EXAMPLES` sets the number of generated files of each kind;
`STOKER_INPUT_FUZZ_RUNS` the number of scenarios run, and of claim logs replayed.
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

from stoker.domain.errors import ConfigError
from stoker.domain.ledger import OUTCOMES, SOURCES
from stoker.domain.states import ClaimMode
from stoker.sim.backtest import Backtest, all_figures
from stoker.sim.claimlog import read_claim_log, synthetic_claims
from stoker.sim.runner import run_scenario
from stoker.sim.scenario import (
    MAX_RUN_S,
    SCENARIO_DIRS,
    Scenario,
    load_scenario,
    scenario_from_mapping,
)

EXAMPLES = int(os.environ.get("STOKER_INPUT_FUZZ_EXAMPLES", "300"))
RUNS = int(os.environ.get("STOKER_INPUT_FUZZ_RUNS", "20"))
SHIPPED = sorted((SCENARIO_DIRS[-1]).glob("*.yaml"))
BASES = [yaml.safe_load(path.read_text()) for path in SHIPPED]

#: Values that broke readers before, or could.
ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**63, -(2**63), 1e309, -1e309, math.nan, 0.0, -0.0,
    1e-320, 1e12, 3.5, "", " ", "x", "nan", "inf", "-1", "1e12", "ünïcödé", "\x00",
    "x" * 300, [], [1], ["x"], {}, {"k": "v"}, {"at_s": 1}, [{"name": "t"}],
]  # fmt: skip

values = st.recursive(
    st.one_of(
        # A fresh copy each time: one list drawn twice into a document would alias.
        st.sampled_from(ODD_VALUES).map(copy.deepcopy),
        st.integers(),
        st.floats(),
        st.text(max_size=10),
    ),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path in `node` (mapping keys and list indexes), the root excluded."""
    found: list[tuple[Any, ...]] = []
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, child in items:
        found.append((*prefix, key))
        found += _paths(child, (*prefix, key))
    return found


def _parent(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path[:-1]:
        doc = doc[key]
    return doc


@st.composite
def mutated_scenarios(draw: st.DrawFn) -> Any:
    doc = json.loads(json.dumps(draw(st.sampled_from(BASES))))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        kind = draw(st.sampled_from(["replace", "replace", "delete", "add", "root"]))
        if kind == "root" or not paths:
            doc = draw(values) if draw(st.integers(0, 9)) == 0 else doc
            continue
        path = draw(st.sampled_from(paths))
        parent = _parent(doc, path)
        if kind == "replace":
            parent[path[-1]] = draw(values)
        elif kind == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(values)
        if not isinstance(doc, dict | list):
            break
    return doc


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(doc=mutated_scenarios(), short=st.booleans())
def test_a_mutated_scenario_loads_or_says_why_in_one_line(doc: Any, short: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scenario.yaml"
        try:
            path.write_text(yaml.safe_dump(doc, allow_unicode=True))
        except (ValueError, yaml.YAMLError):
            return  # not a document YAML can hold (NaN keys and the like)
        refused: str | None = None
        try:
            scenario = load_scenario(str(path), short=short)
        except ConfigError as exc:
            refused = str(exc)
    if refused is not None:
        assert refused.startswith("scenario ") and "\n" not in refused, refused
        return
    assert isinstance(scenario, Scenario)
    assert 0 < scenario.duration_s <= MAX_RUN_S
    for policy in scenario.policies:
        # What a run does first with each policy: its parameters as its kind's model.
        policy.typed_params()


#: How long a generated scenario runs: long enough for spawns, claims, leases and passes.
RUN_S = 120.0


def _affordable(scenario: Scenario) -> bool:
    """Sizes a test can run in seconds (the loader's own bounds are for days)."""
    cluster = scenario.cluster_config()
    pool, plane = scenario.pool, scenario.control_plane
    intervals = [interval for _, interval in scenario.periodic_intervals(cluster)]
    return (
        sum(group.arrival_bound(scenario.duration_s) for group in scenario.tenants) <= 2_000
        and sum(group.count for group in scenario.tenants) <= 200
        and max(pool.warm_target, pool.min_hot_idle, pool.headroom_nodes) <= 100
        and plane.replicas <= 6
        and min(intervals) >= 0.5
        and cluster.tick_s >= 0.01
        and sum(sum(p.initial_nodes.values()) for p in cluster.node_pools) <= 100
        and cluster.background.target.peak() <= 5_000
    )


@settings(
    max_examples=RUNS,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(doc=mutated_scenarios(), short=st.booleans(), pick=st.integers(0, 99))
def test_a_mutated_scenario_that_loads_also_runs(doc: Any, short: bool, pick: int) -> None:
    assume(isinstance(doc, dict))
    doc = {**doc, "duration_s": RUN_S}
    if isinstance(doc.get("short"), dict):
        doc["short"] = {**doc["short"], "duration_s": RUN_S}
    try:
        scenario = scenario_from_mapping(doc, short=short)
    except ConfigError:
        assume(False)
    assume(_affordable(scenario))
    entry = scenario.policies[pick % len(scenario.policies)]
    view = scenario.for_policy(entry.name)
    assume(_affordable(view))
    note(yaml.safe_dump(view.model_dump(mode="json"), allow_unicode=True))
    run = run_scenario(view, jobs=1).policies[0]
    # It ran to the end, and its figures agree with each other.
    sessions, claims = run.summary["sessions"], run.summary["claims"]
    assert (sessions["time_to_worker_s"] or {"count": 0})["count"] == sessions["started"]
    assert sessions["without_worker"] == sessions["lost"] + sessions["still_trying"]
    assert len(run.attempts) == claims["attempts"]
    assert sum(a.outcome == "bound" for a in run.attempts) == claims["bound"]


GOOD_LINES = list(synthetic_claims(6, span_s=3600.0, orgs=3, seed=4))
FIELDS = list(GOOD_LINES[0])


@st.composite
def mutated_logs(draw: st.DrawFn) -> list[str]:
    lines: list[Any] = [dict(line) for line in GOOD_LINES]
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(lines) - 1))
        kind = draw(
            st.sampled_from(["replace", "replace", "replace", "delete", "add", "swap", "raw"])
        )
        line = lines[i]
        if not isinstance(line, dict):
            continue
        if kind == "replace":
            line[draw(st.sampled_from(FIELDS))] = draw(values)
        elif kind == "delete":
            line.pop(draw(st.sampled_from(FIELDS)), None)
        elif kind == "add":
            line[draw(st.text(max_size=8))] = draw(values)
        elif kind == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        else:
            lines[i] = draw(
                st.one_of(st.text(max_size=20), st.sampled_from(["{", "[]", "null", "{}"]))
            )
    return [json.dumps(line) if isinstance(line, dict) else line for line in lines]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=mutated_logs())
def test_a_mutated_claim_log_reads_or_says_why_in_one_line(lines: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "claims.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
        refused: str | None = None
        try:
            replay = read_claim_log(path)
        except ConfigError as exc:
            refused = str(exc)
    if refused is not None:
        assert "\n" not in refused, refused
        return
    # What a replay runs on: finite, ordered arrivals within a year, finite holds.
    assert len(replay) > 0
    assert all(math.isfinite(t) for t in replay.at_s)
    assert list(replay.at_s) == sorted(replay.at_s)
    assert 0 <= replay.span_s <= MAX_RUN_S
    assert all(math.isfinite(h) and h >= 0 for h in replay.hold_s)
    assert all(org for org in replay.orgs)


@st.composite
def odd_logs(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Well-formed claim logs of odd shapes: arrivals in one instant or spread over two
    hours, holds from 0 to days, one org or many, every mode, source and outcome."""
    start = 1_700_000_000.0
    offsets = st.sampled_from([0.0, 0.0, 1e-3, 1.0, 7200.0]) | st.floats(0, 7200)
    holds = st.sampled_from([0.0, 1e-3, 1.0, 600.0, 86_400.0, 1e7]) | st.floats(0, 1e5)
    line = st.fixed_dictionaries(
        {
            "at": offsets.map(lambda offset: start + offset),
            "pool": st.just("workers"),
            "org": st.sampled_from(["a", "b"]) | st.text(min_size=1, max_size=8),
            "mode": st.sampled_from([mode.value for mode in ClaimMode]),
            "source": st.sampled_from([None, *SOURCES]),
            "wait_s": st.sampled_from([0.0, 0.02, 60.0]),
            "held_s": holds,
            "outcome": st.sampled_from(OUTCOMES),
            "revision": st.just("r-1"),
        }
    )
    return sorted(draw(st.lists(line, min_size=1, max_size=40)), key=lambda line: line["at"])


@settings(max_examples=RUNS, deadline=None, suppress_health_check=list(HealthCheck))
@given(lines=odd_logs())
def test_an_odd_claim_log_replays_to_figures_that_agree(lines: list[dict[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "claims.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
        try:
            replay = read_claim_log(path)
        except ConfigError:
            assume(False)
    result = Backtest(replay=replay).run([("current", {})])
    run = result.policies[0]
    assert run.summary["sessions"]["started"] == len(replay)
    assert len(run.attempts) == run.summary["claims"]["attempts"]
    (figures,) = all_figures(result)
    assert figures.cold_share is None or 0 <= figures.cold_share <= 1
    assert figures.failed >= 0
    assert math.isfinite(figures.cost_usd) and figures.cost_usd >= 0


# -- what the fuzz found, kept as cases ------------------------------------------------------


def _load(tmp_path: Path, text: str) -> str:
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_scenario(str(path))
    return str(refused.value)


def test_a_step_of_a_stepped_background_that_is_not_a_pair_is_named(tmp_path: Path) -> None:
    # It raised IndexError.
    message = _load(
        tmp_path,
        "name: x\nduration_s: 60\npolicies: [stoker]\n"
        "cluster: {background: {target: {kind: steps, steps: [[0]]}}}\n",
    )
    assert "background.target.steps[0]: expected [at_s, target], got [0]" in message


def test_an_unknown_key_that_holds_a_newline_is_quoted_on_one_line(tmp_path: Path) -> None:
    message = _load(tmp_path, 'name: x\nduration_s: 60\npolicies: [stoker]\n"\\n": 1\n')
    assert message.endswith(": '\\n': unknown key") and "\n" not in message


def test_a_run_longer_than_a_year_is_refused(tmp_path: Path) -> None:
    # Milliseconds for seconds: a run of 31 years, which would have gone on for days.
    message = _load(tmp_path, "name: x\nduration_s: 1e12\npolicies: [stoker]\n")
    assert "duration_s" in message and str(int(MAX_RUN_S)) in message


def test_a_claim_log_spanning_more_than_a_year_is_refused(tmp_path: Path) -> None:
    # Two claims 95 years apart: the replay ran until killed.
    first, second = (dict(line) for line in GOOD_LINES[:2])
    second["at"] = first["at"] + 3e9
    path = tmp_path / "claims.jsonl"
    path.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    with pytest.raises(ConfigError, match=r"span 34,722 days; a replay covers at most 366"):
        read_claim_log(path)


def test_lease_timings_the_elector_refuses_are_refused_at_load(tmp_path: Path) -> None:
    # They loaded, and the run then raised ValueError building the replicas' electors.
    message = _load(
        tmp_path,
        "name: x\nduration_s: 60\npolicies: [stoker]\n"
        "control_plane: {lease_duration_s: 15, renew_deadline_s: 15}\n",
    )
    assert "control_plane: lease_duration_s (15) must exceed renew_deadline_s (15)" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Each would have been built (a billion org names) or run for days.
        ("tenants: [{name: t, count: 100000000}]", "tenants.0.count: Input should be less"),
        (
            "tenants: [{name: t, count: 1000, arrival: {rate_per_h: 1.0e+9}}]",
            "tenants: up to 16,666,666,667 arrivals over the run",
        ),
        (
            "tenants: [{name: t, arrival: {rate_per_h: 1,"
            " bursts: [{at_s: 0, duration_s: 1, factor: 1.0e+12}]}}]",
            "arrivals over the run",
        ),
        ("sample_interval_s: 1.0e-6", "sample_interval_s: 1e-06 s is 60,000,000 rounds"),
        ("control_plane: {janitor_interval_s: 1.0e-6}", "control_plane.janitor_interval_s: "),
        ("pool: {warm_target: 1000000000}", "pool.warm_target: Input should be less"),
        (
            "cluster: {node_pools: [{name: w, initial_nodes: {m5.large: 1000000}}]}",
            "cluster.node_pools: 1,000,000 initial nodes; at most 5,000",
        ),
        (
            "cluster: {background: {target: 1.0e+9}}",
            "cluster.background.target: 1,000,000,000 cores; at most 500,000",
        ),
        # It ended in OverflowError; a lease under a second renewed every 0.1 s (the API
        # refuses such a claim).
        ("epoch_s: 1.0e+300", "epoch_s: the run would end after 9999-12-31"),
        ("tenants: [{name: t, lease_s: 0.2}]", "tenants.0.lease_s: Input should be greater"),
        ("pool: {lease_s: 0.5}", "pool.lease_s: Input should be greater"),
    ],
)
def test_sizes_no_run_could_finish_are_refused_at_load(
    tmp_path: Path, text: str, expected: str
) -> None:
    message = _load(tmp_path, f"name: x\nduration_s: 60\npolicies: [stoker]\n{text}\n")
    assert expected in message and "\n" not in message, message
