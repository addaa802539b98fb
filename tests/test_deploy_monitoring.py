"""The monitoring of deploy/kubernetes/components/monitoring: scrape, alerts, dashboard.

Rendered from the overlays with `kubectl kustomize` (see kustomize.py). The Prometheus
Operator's custom resources are not in the Kubernetes schema, so their shape is checked
here; every PromQL expression (alert rules, dashboard panels, dashboard variables) is
parsed with a real PromQL parser, and every metric it names is checked against the
`/metrics` of a real `stoker serve` that has served a claim.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kustomize import OVERLAYS, one
from servers import STOKER, environment, kill_fleet, start_server
from stoker.config import StokerConfig
from stoker.config.sections import LeaderElectionConfig

#: The alerts the operations guide relies on.
REQUIRED_ALERTS = {
    "StokerNoJanitorLeader",
    "StokerWarmHitRatioLow",
    "StokerSpawnFailuresRising",
    "StokerActivationFailuresRising",
    "StokerPersistFailures",
    "StokerIdleWorkersPastTTL",
    "StokerReaperStalled",
    "StokerPoolPassesFailing",
}
#: Grafana's variables, replaced by a value of the right kind before parsing.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$namespace": "stoker",
    "$pool": ".*",
}


def rules(overlay: str = "ha") -> list[dict[str, Any]]:
    """Every rule of the PrometheusRule."""
    spec = one("PrometheusRule", "stoker", overlay)["spec"]
    return [rule for group in spec["groups"] for rule in group["rules"]]


def dashboard(overlay: str = "ha") -> dict[str, Any]:
    """The Grafana dashboard, as the generated ConfigMap carries it."""
    config_map = one("ConfigMap", "stoker-dashboard", overlay)
    [(name, text)] = config_map["data"].items()
    assert name.endswith(".json")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def dashboard_expressions(board: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for panel in board["panels"]:
        for target in panel["targets"]:
            yield f"panel {panel['title']!r}", target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(SELECTOR, label): the selector is PromQL.
            match = re.fullmatch(r"label_values\((.*), *\w+\)", variable["query"]["query"])
            assert match, variable["query"]
            yield f"variable {variable['name']!r}", match.group(1)


def grafana_to_promql(expression: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expression = expression.replace(variable, value)
    assert "$" not in expression, f"an unknown Grafana variable in {expression!r}"
    return expression


def metric_names(expression: str) -> set[str]:
    """The metric names a PromQL expression selects (raises ValueError if it does not
    parse)."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name is not None:
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expression), visit)
    return names


def used_metrics() -> dict[str, set[str]]:
    """Metric name -> where it is used, over the alerts and the dashboard."""
    used: dict[str, set[str]] = {}
    for rule in rules():
        for name in metric_names(rule["expr"]):
            used.setdefault(name, set()).add(f"alert {rule['alert']}")
    for where, expression in dashboard_expressions(dashboard()):
        for name in metric_names(grafana_to_promql(expression)):
            used.setdefault(name, set()).add(where)
    return used


def exported_names(text: str) -> set[str]:
    """The series names an exposition declares: a counter's `_total`, a histogram's
    `_bucket`/`_sum`/`_count`, a gauge's own name (declared, even before a sample)."""
    suffixes = {
        "counter": ["_total"],
        "histogram": ["_bucket", "_sum", "_count"],
        "gauge": [""],
        "summary": ["_sum", "_count", ""],
    }
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + suffix for suffix in suffixes.get(family.type, [""])}
        names |= {sample.name for sample in family.samples}
    return names


# -- shape -----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_service_monitor_scrapes_every_replica(overlay: str) -> None:
    """It selects the Service by its labels and scrapes /metrics on its named port."""
    monitor = one("ServiceMonitor", "stoker", overlay)
    service = one("Service", "stoker", overlay)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}


def test_each_alert_is_complete() -> None:
    """Every rule is an alert with an expression that parses, a severity, a summary and
    a description; the required alerts are all there, each once."""
    found = rules()
    names = [rule["alert"] for rule in found]
    assert len(names) == len(set(names))
    assert set(names) >= REQUIRED_ALERTS
    for rule in found:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert metric_names(rule["expr"]), rule["alert"]


def test_no_leader_fires_after_two_lease_durations() -> None:
    """The leader alert waits two of the default lease durations (a handover takes up
    to one) before it fires."""
    [rule] = [r for r in rules() if r["alert"] == "StokerNoJanitorLeader"]
    assert metric_names(rule["expr"]) == {"stoker_janitor_is_leader"}
    lease = LeaderElectionConfig().lease_duration_s
    assert rule["for"] == f"{round(2 * lease)}s"


def selectors(expression: str, metric: str) -> list[set[tuple[str, str, str]]]:
    """The label matchers (name, operator, value) of each selector of `metric`."""
    found: list[set[tuple[str, str, str]]] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name == metric:
            found.append({(m.name, str(m.op), m.value) for m in node.matchers.matchers})

    promql_parser.walk(promql_parser.parse(expression), visit)
    return found


def test_a_pool_whose_passes_keep_failing_pages_once_per_pool() -> None:
    """The failures of one pool's step (`pool` set) page per pool and only once they
    persist; the failures of whole passes (`pool` empty) stay with StokerPassesFailing,
    so a bad pool does not fire both."""
    by_name = {rule["alert"]: rule for rule in rules()}
    pool_rule, pass_rule = by_name["StokerPoolPassesFailing"], by_name["StokerPassesFailing"]
    not_empty = ("pool", str(promql_parser.MatchOp.NotEqual), "")
    empty = ("pool", str(promql_parser.MatchOp.Equal), "")
    assert selectors(pool_rule["expr"], "stoker_pass_failures_total") == [{not_empty}]
    assert selectors(pass_rule["expr"], "stoker_pass_failures_total") == [{empty}]
    expression = promql_parser.parse(pool_rule["expr"])
    assert isinstance(expression, promql_parser.BinaryExpr)
    assert isinstance(expression.lhs, promql_parser.AggregateExpr)
    assert expression.lhs.modifier is not None
    assert expression.lhs.modifier.labels == ["namespace", "pool"]
    assert pool_rule["for"] == "10m" and pool_rule["labels"]["severity"] == "critical"
    assert "docs/operations.md" in pool_rule["annotations"]["description"]


def test_the_dashboard_is_complete() -> None:
    """A dashboard with a stable uid; every panel has a query on the datasource
    variable, and the namespace and pool variables exist."""
    board = dashboard()
    assert board["uid"] == "stoker" and board["panels"]
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "namespace", "pool"}
    for panel in board["panels"]:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
    titles = [panel["title"] for panel in board["panels"]]
    assert len(titles) == len(set(titles))
    assert "Warm target vs demand vs hot workers" in titles


def test_the_dashboard_carries_the_sidecars_label() -> None:
    """Grafana's dashboard sidecar picks up ConfigMaps labelled grafana_dashboard."""
    labels = one("ConfigMap", "stoker-dashboard")["metadata"]["labels"]
    assert labels["grafana_dashboard"] == "1"


def test_an_expression_that_does_not_parse_is_caught() -> None:
    """The parser is strict (a test that can fail)."""
    with pytest.raises(ValueError, match="parenthesis"):
        metric_names("sum(rate(stoker_spawns_total[5m])")
    with pytest.raises(AssertionError, match="unknown Grafana variable"):
        grafana_to_promql("rate(stoker_spawns_total[$interval])")


def test_both_overlays_carry_the_same_monitoring() -> None:
    for kind, name in (
        ("PrometheusRule", "stoker"),
        ("ServiceMonitor", "stoker"),
        ("ConfigMap", "stoker-dashboard"),
    ):
        assert one(kind, name, "single") == one(kind, name, "ha")


# -- against a real server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def exposition(tmp_path_factory: pytest.TempPathFactory) -> str:
    """/metrics of a real `stoker serve` (the built-in defaults: the demo pool on local
    workers) after one claim was bound and released, so that the labelled series exist."""
    workdir: Path = tmp_path_factory.mktemp("metrics")
    fleet = StokerConfig(store=f"sqlite:///{workdir}/stoker.db").fleet_name()
    server = start_server(workdir, env=environment(STOKER_API__PORT="0"), args=["--stop-workers"])
    try:
        claim = subprocess.run(
            [STOKER, "claim", "--pool", "demo", "--org", "acme"],
            env=environment(STOKER_URL=server.url),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        claim_id = json.loads(claim.stdout)["id"]
        subprocess.run(
            [STOKER, "release", claim_id],
            env=environment(STOKER_URL=server.url),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        answer = httpx.get(f"{server.url}/metrics", timeout=10)
        assert answer.status_code == 200
        return answer.text
    finally:
        server.stop()
        kill_fleet(fleet)


@pytest.mark.processes
def test_every_metric_the_alerts_and_the_dashboard_name_is_exported(exposition: str) -> None:
    exported = exported_names(exposition)
    assert "stoker_claims_total" in exported  # the claim was counted
    used = used_metrics()
    missing = {name: sorted(where) for name, where in used.items() if name not in exported}
    assert not missing, f"not in a real server's /metrics: {missing}"


@pytest.mark.processes
def test_the_dashboard_shows_every_ledger_series(exposition: str) -> None:
    """What warmth costs and buys (docs/warmth.md) is on the dashboard: every ledger
    counter a real server exports is read by a panel."""
    ledger = {name for name in exported_names(exposition) if name.startswith("stoker_ledger_")}
    ledger = {name for name in ledger if name.endswith("_total")}
    assert len(ledger) == 3, ledger
    shown = {
        name
        for _, expression in dashboard_expressions(dashboard())
        for name in metric_names(grafana_to_promql(expression))
    }
    assert ledger <= shown, sorted(ledger - shown)


@pytest.mark.processes
def test_a_metric_the_server_does_not_export_is_caught(exposition: str) -> None:
    """The check compares names, not prefixes (a test that can fail)."""
    exported = exported_names(exposition)
    assert metric_names("stoker_claims_total") <= exported
    assert not metric_names("stoker_claims") <= exported  # a counter is read as _total
    assert not metric_names("stoker_claim_duration_seconds") <= exported
    assert not metric_names("stoker_no_such_metric") <= exported
