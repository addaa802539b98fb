"""The metrics reference is generated from a control plane's registry: every series
`/metrics` shows is on the page with its type, labels and help, and a metric without help
is reported (the test below fails until it gets one)."""

from __future__ import annotations

import re

from prometheus_client import generate_latest

from stoker.control.metrics import Gauge, Metrics
from stoker.reference import metrics


def test_every_metric_has_a_description() -> None:
    assert metrics.undocumented() == []


def test_a_metric_without_help_is_reported() -> None:
    plane = Metrics()
    plane.extra = Gauge("stoker_undocumented", "", registry=plane.registry)  # type: ignore[attr-defined]
    assert metrics.undocumented(plane) == ["stoker_undocumented"]


def test_the_page_lists_every_family_metrics_serves() -> None:
    text = generate_latest(Metrics().registry).decode()
    served = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert len(served) >= 25
    page = metrics.markdown()
    listed = {m.name: m for m in metrics.metrics()}
    for family, kind in served.items():
        name = family + "_total" if kind == "counter" and not family.endswith("_total") else family
        assert name in listed, name
        assert listed[name].type == kind
        assert f"| `{name}` | {kind} |" in page
    assert len(listed) == len(served)
    assert "| `stoker_claims_total` | counter | `pool`, `source`, `outcome` |" in page
