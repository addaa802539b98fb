"""The metrics reference: every series `/metrics` exports, from the Prometheus registry of
a control plane (`stoker.control.metrics.Metrics`), with its type, labels and help."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.metrics import MetricWrapperBase

from stoker.control.metrics import Metrics


@dataclass(frozen=True)
class Metric:
    """One metric family."""

    name: str
    type: str
    labels: tuple[str, ...]
    help: str


def metrics(plane: Metrics | None = None) -> list[Metric]:
    """Every metric of a control plane's registry, by name (counters with `_total`)."""
    plane = plane or Metrics()
    found = {}
    for value in vars(plane).values():
        if isinstance(value, MetricWrapperBase):
            [family] = value.describe()
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = tuple(value._labelnames)
            found[name] = Metric(name, family.type, labels, family.documentation)
    return [found[name] for name in sorted(found)]


def undocumented(plane: Metrics | None = None) -> list[str]:
    """The metrics without help (a test fails while there is one)."""
    return [m.name for m in metrics(plane) if not m.help.strip()]


def markdown() -> str:
    """The metrics reference page."""
    lines = [
        "# Metrics reference",
        "",
        "<!-- Generated from the Prometheus registry (stoker.reference.metrics) at every "
        "build of the site; edit the metrics' help, not this page. -->",
        "",
        "Every series a control plane exports at `GET /metrics` (Prometheus text format). "
        "Each replica exports its own; sum over replicas where a figure is per replica. "
        "The alerts that use them are in [Operations](../operations.md).",
        "",
        "| metric | type | labels | help |",
        "|---|---|---|---|",
    ]
    for m in metrics():
        labels = ", ".join(f"`{label}`" for label in m.labels) or "-"
        about = " ".join(m.help.split()).replace("|", "\\|")
        lines.append(f"| `{m.name}` | {m.type} | {labels} | {about} |")
    return "\n".join(lines) + "\n"
