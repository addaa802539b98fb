"""The PNG plots of a scaletest report (matplotlib, Agg).

- `workers_by_state.png`: live workers stacked by state, a panel per policy;
- `nodes.png`: nodes, node cost per hour and cumulative node cost, every policy;
- `pending_pods.png`: pending pods, cold claims and failed claim attempts over time;
- `demand_vs_target.png`: the leader's demand and desired warm against the warm workers,
  every janitor pass (`passes.csv`), a panel per policy on an axis of their own;
- `claim_latency_cdf.png`: claim latency by source, and each session's time to a worker
  (failures and back-offs included);
- `vcpu.png`: busy and idle workers' and placeholders' vCPU, a panel per policy.

Every panel against time shades the scenario's fault windows (red) and bursts (blue),
and every panel has its legend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stoker.sim.runner import PolicyResult, ScenarioResult
from stoker.sim.scenario import Scenario

PLOTS = {
    "workers_by_state.png": "Workers by state",
    "nodes.png": "Nodes and their cost",
    "pending_pods.png": "Pending pods, cold claims and failed claims",
    "demand_vs_target.png": "Demand, desired and warm workers, every janitor pass",
    "claim_latency_cdf.png": "Claim latency by source and time to a worker per session",
    "vcpu.png": "Idle against busy vCPU",
}

#: Worker states stacked in the workers plot, bottom up.
_STACK = ("hot", "reserved", "activating", "hot_idle", "warm", "spawning", "draining")
_SOURCES = ("warm", "reuse", "cold")
#: Bins of the event timelines (cold claims, failures) over a run.
_BINS = 96
_LEGEND: dict[str, Any] = {"fontsize": 7, "loc": "upper left", "framealpha": 0.8}


def windows(scenario: Scenario) -> list[tuple[float, float, str]]:
    """(start, end, kind) of the scenario's faults (`fault`) and bursts (`burst`)."""
    found: list[tuple[float, float, str]] = []
    for fault in scenario.cluster_config().faults:
        found.append((fault.at, fault.at + max(fault.duration, 1.0), "fault"))
    for group in scenario.tenants:
        for burst in group.arrival.bursts:
            end = burst.at_s + max(burst.duration_s, 1.0)
            if (burst.at_s, end, "burst") not in found:
                found.append((burst.at_s, end, "burst"))
    return found


def write_plots(result: ScenarioResult, out: Path) -> list[Path]:
    """The PNGs of `PLOTS`, written into `out`."""
    return _Plotter(result, out).all()


class _Plotter:
    def __init__(self, result: ScenarioResult, out: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt = plt
        self.result = result
        self.out = out
        self.policies = result.policies
        hours = result.scenario.duration_s > 3 * 3600
        self.unit, self.scale = ("h", 3600.0) if hours else ("min", 60.0)
        self.windows = windows(result.scenario)
        self.written: list[Path] = []

    def all(self) -> list[Path]:
        self.workers()
        self.nodes()
        self.pending()
        self.demand()
        self.cdfs()
        self.vcpu()
        return self.written

    # -- helpers -----------------------------------------------------------------------------

    def save(self, fig: Any, name: str) -> None:
        fig.suptitle(f"{self.result.scenario.name}: {PLOTS[name].lower()}")
        fig.tight_layout()
        path = self.out / name
        fig.savefig(path, dpi=90, metadata={"Software": None})
        self.plt.close(fig)
        self.written.append(path)

    def times(self, p: PolicyResult) -> list[float]:
        return [row["t_s"] / self.scale for row in p.samples]

    def per_policy(self, height: float = 2.4) -> tuple[Any, list[Any]]:
        n = len(self.policies)
        fig, axes = self.plt.subplots(
            n, 1, figsize=(10, height * n + 0.6), squeeze=False, sharex=True
        )
        return fig, list(axes[:, 0])

    def shade(self, ax: Any) -> None:
        """Shade fault and burst windows; each kind labelled once per panel."""
        labelled: set[str] = set()
        for start, end, kind in self.windows:
            color = "tab:red" if kind == "fault" else "tab:blue"
            label = None if kind in labelled else f"{kind} window"
            labelled.add(kind)
            ax.axvspan(start / self.scale, end / self.scale, color=color, alpha=0.12, label=label)

    def finish(self, ax: Any, ylabel: str, *, title: str | None = None, ncol: int = 1) -> None:
        self.shade(ax)
        ax.set_ylabel(ylabel)
        ax.set_xlabel(f"time ({self.unit})")
        ax.set_xlim(0, self.result.scenario.duration_s / self.scale)
        if title:
            ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            # Room above the data for the legend.
            low, high = ax.get_ylim()
            ax.set_ylim(low, high + (high - low) * 0.15 * (1 + (len(ax.lines) > 3)))
            ax.legend(ncol=ncol, **_LEGEND)

    # -- the plots ---------------------------------------------------------------------------

    def workers(self) -> None:
        fig, axes = self.per_policy()
        for ax, p in zip(axes, self.policies, strict=True):
            series = [[row[s] for row in p.samples] for s in _STACK]
            ax.stackplot(self.times(p), *series, labels=_STACK)
            self.finish(ax, "workers", title=p.name, ncol=4)
        self.save(fig, "workers_by_state.png")

    def nodes(self) -> None:
        fig, axes = self.plt.subplots(3, 1, figsize=(10, 8), sharex=True)
        duration = self.result.scenario.duration_s
        # Hourly bins over a day or more; finer ones in a short run (still USD per hour).
        width = 3600.0 if duration > 3 * 3600 else max(60.0, duration / 24)
        for i, p in enumerate(self.policies):
            t = self.times(p)
            style = {"label": p.name, "color": f"C{i}"}
            axes[0].plot(t, [row["nodes"] for row in p.samples], **style)
            costs = [row["cost_usd"] for row in p.samples]
            axes[2].plot(t, costs, **style)
            edges, rates = _rate_per_hour([row["t_s"] for row in p.samples], costs, width)
            axes[1].step([e / self.scale for e in edges], rates, where="post", **style)
        self.finish(axes[0], "nodes", title="nodes (launching ones included)")
        self.finish(
            axes[1], "USD per hour", title=f"node cost per hour (over {duration_text(width)})"
        )
        self.finish(axes[2], "USD", title="cumulative node cost")
        self.save(fig, "nodes.png")

    def pending(self) -> None:
        fig, axes = self.plt.subplots(3, 1, figsize=(10, 8), sharex=True)
        width = self.result.scenario.duration_s / _BINS
        for i, p in enumerate(self.policies):
            style = {"label": p.name, "color": f"C{i}"}
            axes[0].plot(self.times(p), [row["pods_pending"] for row in p.samples], **style)
            cold = [a.end_s for a in p.attempts if a.source == "cold"]
            failed = [a.end_s for a in p.attempts if a.outcome != "bound"]
            for ax, events in ((axes[1], cold), (axes[2], failed)):
                edges, counts = _binned(events, width, self.result.scenario.duration_s)
                ax.step([e / self.scale for e in edges], counts, where="post", **style)
        self.finish(axes[0], "pending pods", title="pending pods")
        per = duration_text(width)
        self.finish(
            axes[1], f"per {per}", title=f"cold claims (bound by their own spawn), per {per}"
        )
        self.finish(axes[2], f"per {per}", title=f"failed claim attempts, per {per}")
        self.save(fig, "pending_pods.png")

    def demand(self) -> None:
        fig, axes = self.per_policy()
        for ax, p in zip(axes, self.policies, strict=True):
            rows = p.passes.rows
            bins = _pass_bins(len(rows))
            note = "" if bins == 1 else f", mean of {bins} passes"
            t = [rows[i][0] / self.scale for i in range(0, len(rows), bins)]
            low, warm, high = _binned_column(rows, 3, bins)
            if bins > 1:
                ax.fill_between(t, low, high, alpha=0.25, step="post", label="warm: min-max")
            ax.step(t, warm, where="post", label=f"warm workers{note}", linewidth=0.9)
            desired = _binned_column(rows, 2, bins)[1]
            ax.step(t, desired, where="post", label="desired warm (leader)", linestyle="--")
            demand = _binned_column(rows, 1, bins)[1]
            ax.step(t, demand, where="post", label="demand (leader)", linewidth=0.9)
            warm_target = self.result.scenario.for_policy(p.name).pool.warm_target
            ax.axhline(warm_target, color="grey", linestyle=":", label="static warm target")
            self.finish(ax, "workers", title=p.name, ncol=5)
        self.save(fig, "demand_vs_target.png")

    def cdfs(self) -> None:
        fig, axes = self.plt.subplots(2, 2, figsize=(11, 7))
        panels = [*zip(axes.flat, _SOURCES, strict=False)]
        for ax, source in panels:
            for i, p in enumerate(self.policies):
                _cdf(ax, p.latencies.get(source, []), p.name, i)
            _cdf_axes(ax, f"claim attempts bound from: {source}", "claim latency (s)")
        ax = axes.flat[3]
        for i, p in enumerate(self.policies):
            _cdf(ax, _session_times(p), p.name, i)
        _cdf_axes(ax, "sessions: time to a worker (failures, back-offs included)", "seconds")
        self.save(fig, "claim_latency_cdf.png")

    def vcpu(self) -> None:
        fig, axes = self.per_policy()
        keys = ("busy_vcpu", "idle_vcpu", "placeholder_vcpu")
        for ax, p in zip(axes, self.policies, strict=True):
            ax.stackplot(
                self.times(p),
                *[[row[k] for row in p.samples] for k in keys],
                labels=("busy workers", "idle workers", "placeholders"),
            )
            self.finish(ax, "vCPU", title=p.name, ncol=3)
        self.save(fig, "vcpu.png")


def _session_times(p: PolicyResult) -> list[float]:
    first: dict[int, float] = {}
    bound: dict[int, float] = {}
    for a in p.attempts:
        first.setdefault(a.session, a.start_s)
        if a.outcome == "bound":
            bound[a.session] = a.end_s
    return [bound[s] - first[s] for s in bound]


def _cdf(ax: Any, values: Sequence[float], label: str, index: int) -> None:
    ordered = sorted(values)
    if ordered:
        ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
        xs = [max(x, 1e-3) for x in ordered]
        ax.step(xs, ys, where="post", label=label, color=f"C{index}")


def _cdf_axes(ax: Any, title: str, xlabel: str) -> None:
    ax.set_xscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("share")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="lower right")
    else:
        ax.text(0.5, 0.5, "none", transform=ax.transAxes, ha="center")


#: Passes drawn one by one up to this many; beyond, in bins (mean, and a min-max band).
_MAX_POINTS = 1500


def _pass_bins(passes: int) -> int:
    """How many passes one plotted point stands for."""
    return max(1, math.ceil(passes / _MAX_POINTS))


def _binned_column(
    rows: Sequence[Sequence[Any]], column: int, bins: int
) -> tuple[list[float], list[float], list[float]]:
    """Min, mean and max of a passes.csv column over each run of `bins` rows."""
    low: list[float] = []
    mean: list[float] = []
    high: list[float] = []
    for start in range(0, len(rows), bins):
        values = [row[column] for row in rows[start : start + bins] if row[column] is not None]
        if not values:
            low.append(math.nan)
            mean.append(math.nan)
            high.append(math.nan)
            continue
        low.append(min(values))
        mean.append(sum(values) / len(values))
        high.append(max(values))
    return low, mean, high


def _rate_per_hour(
    t: Sequence[float], cumulative: Sequence[float], width: float
) -> tuple[list[float], list[float]]:
    """USD per hour in each bin of `width` seconds, from cumulative cost samples."""
    edges: list[float] = []
    rates: list[float] = []
    start, spent_at_start = 0.0, 0.0
    for when, total in zip(t, cumulative, strict=True):
        if when - start >= width - 1e-9:
            edges.append(start)
            rates.append((total - spent_at_start) * 3600 / (when - start))
            start, spent_at_start = when, total
    if edges:
        edges.append(start)
        rates.append(rates[-1])
    return edges, rates


def _binned(events: Sequence[float], width: float, end: float) -> tuple[list[float], list[int]]:
    bins = max(1, math.ceil(end / width))
    counts = [0] * bins
    for t in events:
        counts[min(bins - 1, int(t // width))] += 1
    edges = [i * width for i in range(bins)]
    return [*edges, end], [*counts, counts[-1]]


def duration_text(seconds: float) -> str:
    """A duration in the largest unit that fits: `2 h`, `15 min`, `30 s`."""
    if seconds >= 3600:
        return f"{seconds / 3600:g} h"
    if seconds >= 60:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"
