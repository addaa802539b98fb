"""The report of a scaletest: summary.json, timeseries.csv, plots and report.md.

- `summary.json`: per policy, claim latency percentiles by source, the warm hit ratio,
  failures by reason, time to reach the target, idle and busy vCPU-hours, spawns,
  retirements by reason, nodes launched and reclaimed, invariant violations (with their
  traces). Keys are sorted and floats rounded, and nothing in it depends on the wall
  clock, so the same scenario and seed give the same bytes.
- `timeseries.csv`: one row per policy and sample (workers by state, nodes, pending pods,
  sessions, warm target and demand, vCPU by use, the leader).
- PNG plots (matplotlib, Agg): workers by state, nodes, pending pods, demand against
  the warm target, the claim-latency CDF by source, idle against busy vCPU.
- `report.md`: the comparison table, the invariant verdicts and the plots, with the wall
  time and the virtual-time speed-up of the run.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoker.sim.passlog import COLUMNS as PASS_COLUMNS
from stoker.sim.runner import STOKER_KINDS, PolicyResult, ScenarioResult

#: Decimals kept for floats in summary.json and timeseries.csv.
DECIMALS = 4

PLOTS = {
    "workers_by_state.png": "Workers by state",
    "nodes.png": "Nodes",
    "pending_pods.png": "Pending pods",
    "demand_vs_target.png": "Demand against the warm target",
    "claim_latency_cdf.png": "Claim latency CDF by source",
    "vcpu.png": "Idle against busy vCPU",
}

#: Worker states stacked in the workers plot, bottom up.
_STACK = ("hot", "reserved", "activating", "hot_idle", "warm", "spawning", "draining")
_SOURCES = ("warm", "reuse", "cold")


@dataclass(frozen=True)
class Headline:
    """One row of the comparison table (formatted)."""

    policy: str
    cells: dict[str, str]


COLUMNS = (
    "claims bound",
    "failed claims",
    "latency p50 / p90 / p99",
    "warm hit",
    "time to target",
    "busy / idle vCPU-h",
    "placeholder vCPU-h",
    "spawns",
    "retired",
    "nodes launched / reclaimed",
    "violations",
)


# -- summary.json ----------------------------------------------------------------------------


def summary(result: ScenarioResult) -> dict[str, Any]:
    """The JSON-ready summary of a scenario run (deterministic; see the module docstring)."""
    scenario = result.scenario
    rounded: dict[str, Any] = _rounded(
        {
            "scenario": scenario.name,
            "description": scenario.description.strip(),
            "seed": scenario.seed,
            "short": result.short,
            "duration_s": scenario.duration_s,
            "target_hot": scenario.target_hot,
            "policies": {
                p.name: {
                    **p.summary,
                    "violations": [v.as_dict() for v in p.violations],
                    "warnings": p.warnings,
                }
                for p in result.policies
            },
        }
    )
    return rounded


def summary_bytes(result: ScenarioResult) -> bytes:
    """summary.json's exact bytes."""
    text = json.dumps(summary(result), sort_keys=True, indent=2, ensure_ascii=False)
    return (text + "\n").encode()


def _rounded(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v) for v in value]
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        rounded = round(value, DECIMALS)
        return 0.0 if rounded == 0 else rounded
    return value


# -- timeseries.csv ---------------------------------------------------------------------------


def write_timeseries(result: ScenarioResult, path: Path) -> None:
    """Every sample of every policy, one row each."""
    columns: list[str] = ["policy"]
    for policy in result.policies:
        for row in policy.samples:
            columns += [key for key in row if key not in columns]
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(columns)
        for policy in result.policies:
            for row in policy.samples:
                values = {"policy": policy.name, **row}
                writer.writerow([_cell(values.get(column)) for column in columns])


def write_claims(result: ScenarioResult, path: Path) -> None:
    """claims.jsonl: every claim attempt of every policy, one JSON object a line."""
    with path.open("w", encoding="utf-8") as handle:
        for policy in result.policies:
            for attempt in policy.attempts:
                row = _rounded({"policy": policy.name, **attempt.as_dict()})
                handle.write(json.dumps(row, sort_keys=True) + "\n")


def write_passes(result: ScenarioResult, path: Path) -> None:
    """passes.csv: the leader's demand and desired warm, and the pool, every janitor pass."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(["policy", *PASS_COLUMNS])
        for policy in result.policies:
            for row in policy.passes.rows:
                writer.writerow([policy.name, *(_cell(v) for v in row)])


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(_rounded(value))
    return str(value)


# -- the comparison table -----------------------------------------------------------------------


def headlines(result: ScenarioResult) -> list[Headline]:
    """The comparison table's rows, one per policy."""
    return [Headline(p.name, _cells(p.summary, len(p.violations))) for p in result.policies]


def _cells(s: dict[str, Any], violations: int) -> dict[str, str]:
    claims = s["claims"]
    latency = claims["latency_s"]["all"]
    failures = sum(claims["failures"].values())
    vcpu = s["vcpu_hours"]
    ttt = s["time_to_target_s"]
    target = "-" if s["target_hot"] is None else ("never" if ttt is None else _seconds(ttt))
    spawns = s["workers"]["spawns"]
    return {
        "claims bound": str(claims["bound"]),
        "failed claims": str(failures),
        "latency p50 / p90 / p99": (
            "-"
            if latency is None
            else " / ".join(_seconds(latency[q]) for q in ("p50", "p90", "p99"))
        ),
        "warm hit": "-" if claims["warm_hit_ratio"] is None else f"{claims['warm_hit_ratio']:.0%}",
        "time to target": target,
        "busy / idle vCPU-h": f"{vcpu['busy']:.1f} / {vcpu['idle']:.1f}",
        "placeholder vCPU-h": f"{vcpu['placeholder']:.1f}",
        "spawns": str(sum(spawns.values())),
        "retired": str(s["workers"]["retired"]),
        "nodes launched / reclaimed": f"{s['nodes']['launched']} / {s['nodes']['reclaimed']}",
        "violations": str(violations),
    }


def _seconds(value: float) -> str:
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{value / 60:.1f} min"


def markdown_table(rows: Sequence[Headline], columns: Sequence[str] = COLUMNS) -> str:
    """The comparison table in Markdown."""
    lines = ["| policy | " + " | ".join(columns) + " |"]
    lines.append("|---|" + "---|" * len(columns))
    for row in rows:
        lines.append(f"| {row.policy} | " + " | ".join(row.cells[c] for c in columns) + " |")
    return "\n".join(lines)


# -- plots ---------------------------------------------------------------------------------------


def write_plots(result: ScenarioResult, out: Path) -> list[Path]:
    """The PNGs of `PLOTS`, written into `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = result.scenario.duration_s > 3 * 3600
    unit, scale = ("h", 3600.0) if hours else ("min", 60.0)
    policies = result.policies
    written = []

    def save(fig: Any, name: str) -> None:
        fig.suptitle(f"{result.scenario.name}: {PLOTS[name].lower()}")
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=90, metadata={"Software": None})
        plt.close(fig)
        written.append(path)

    def times(p: PolicyResult) -> list[float]:
        return [row["t_s"] / scale for row in p.samples]

    fig, axes = plt.subplots(len(policies), 1, figsize=(9, 2.6 * len(policies)), squeeze=False)
    for ax, p in zip(axes[:, 0], policies, strict=True):
        ax.stackplot(times(p), *[[row[s] for row in p.samples] for s in _STACK], labels=_STACK)
        ax.set_title(p.name, fontsize=10)
        ax.set_ylabel("workers")
        ax.set_xlabel(f"time ({unit})")
    axes[0, 0].legend(loc="upper left", fontsize=7, ncol=4)
    save(fig, "workers_by_state.png")

    for name, key, label in (
        ("nodes.png", "nodes", "nodes"),
        ("pending_pods.png", "pods_pending", "pending pods"),
    ):
        fig, ax = plt.subplots(figsize=(9, 3.5))
        for p in policies:
            ax.plot(times(p), [row[key] for row in p.samples], label=p.name)
        ax.set_ylabel(label)
        ax.set_xlabel(f"time ({unit})")
        ax.legend(fontsize=8)
        save(fig, name)

    fig, axes = plt.subplots(len(policies), 1, figsize=(9, 2.6 * len(policies)), squeeze=False)
    for ax, p in zip(axes[:, 0], policies, strict=True):
        t = times(p)
        wanting = [row["sessions_active"] + row["claims_waiting"] for row in p.samples]
        ax.plot(t, wanting, label="sessions wanting a worker")
        ax.plot(t, [row["warm"] for row in p.samples], label="warm")
        desired = [
            math.nan if row["desired_warm"] is None else row["desired_warm"] for row in p.samples
        ]
        ax.plot(t, desired, label="desired warm (leader)", linestyle="--")
        ax.plot(
            t, [row["warm_target"] for row in p.samples], label="static warm target", linestyle=":"
        )
        ax.set_title(p.name, fontsize=10)
        ax.set_xlabel(f"time ({unit})")
    axes[0, 0].legend(loc="upper left", fontsize=7, ncol=2)
    save(fig, "demand_vs_target.png")

    fig, axes = plt.subplots(1, len(_SOURCES), figsize=(12, 3.5), squeeze=False)
    for ax, source in zip(axes[0], _SOURCES, strict=True):
        for p in policies:
            samples = sorted(p.latencies.get(source, []))
            if samples:
                ys = [(i + 1) / len(samples) for i in range(len(samples))]
                ax.step([max(x, 1e-4) for x in samples], ys, where="post", label=p.name)
        ax.set_xscale("log")
        ax.set_title(f"source: {source}", fontsize=10)
        ax.set_xlabel("claim latency (s)")
        ax.set_ylim(0, 1.02)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    save(fig, "claim_latency_cdf.png")

    fig, axes = plt.subplots(len(policies), 1, figsize=(9, 2.6 * len(policies)), squeeze=False)
    for ax, p in zip(axes[:, 0], policies, strict=True):
        keys = ("busy_vcpu", "idle_vcpu", "placeholder_vcpu")
        ax.stackplot(
            times(p),
            *[[row[k] for row in p.samples] for k in keys],
            labels=("busy workers", "idle workers", "placeholders"),
        )
        ax.set_title(p.name, fontsize=10)
        ax.set_ylabel("vCPU")
        ax.set_xlabel(f"time ({unit})")
    axes[0, 0].legend(loc="upper left", fontsize=7, ncol=3)
    save(fig, "vcpu.png")
    return written


# -- report.md -------------------------------------------------------------------------------------


def markdown(result: ScenarioResult) -> str:
    """report.md: the run, the comparison table, the invariant verdicts, the plots."""
    scenario = result.scenario
    virtual = scenario.duration_s * len(result.policies)
    lines = [
        f"# Scaletest: {scenario.name}" + (" (short form)" if result.short else ""),
        "",
        scenario.description.strip(),
        "",
        f"Seed {scenario.seed}; {_duration(scenario.duration_s)} of virtual time for each of "
        f"{len(result.policies)} policies; wall time {result.wall_s:.1f} s "
        f"({result.jobs} process{'es' if result.jobs > 1 else ''}), a virtual-time speed-up "
        f"of x{virtual / max(result.wall_s, 1e-9):,.0f} over the whole run.",
        "",
        "## Comparison",
        "",
        markdown_table(headlines(result)),
        "",
        "Latency is from the claim to the bound worker, over every bound claim; *warm hit* is "
        "the share of bound claims served by a warm or a parked (reuse) worker; *time to "
        "target* runs from the first arrival until the sessions holding a worker reach the "
        "scenario's target; vCPU-hours integrate the workers' requests (busy: reserved, "
        "activating, hot; idle: warm, hot_idle) and the placeholders'.",
        "",
        "## Invariants (I1-I7, stoker.sim.invariants)",
        "",
    ]
    for p in result.policies:
        if not p.violations:
            lines.append(
                f"- **{p.name}**: no violation in {p.summary['invariants']['checks']} "
                "checks and every event."
            )
            continue
        by = ", ".join(f"{k} x{v}" for k, v in p.summary["invariants"]["by_invariant"].items())
        verdict = "fails the scenario" if p.kind in STOKER_KINDS else "expected of this baseline"
        lines.append(f"- **{p.name}**: {len(p.violations)} violations ({by}), {verdict}:")
        for violation in p.violations[:5]:
            lines.append(
                f"  - t={violation.t:.0f}s {violation.invariant} {violation.subject}: "
                f"{violation.detail}"
            )
        first = p.violations[0]
        lines += ["", "  Trace of the first one:", "", "  ```"]
        lines += [f"  {line}" for line in first.trace]
        lines += ["  ```"]
    lines += ["", "## Plots", ""]
    for name, title in PLOTS.items():
        lines += [f"### {title}", "", f"![{title}]({name})", ""]
    lines += ["## Per policy", ""]
    for p in result.policies:
        s = p.summary
        lines.append(f"### {p.name} ({p.kind})")
        lines.append("")
        lines.append("| source | claims | p50 | p90 | p99 | max |")
        lines.append("|---|---|---|---|---|---|")
        for source, q in s["claims"]["latency_s"].items():
            if q is not None:
                cells = " | ".join(_seconds(q[k]) for k in ("p50", "p90", "p99", "max"))
                lines.append(f"| {source} | {q['count']} | {cells} |")
        lines.append("")
        lines.append(f"- failures by reason: {_pairs(s['claims']['failures'])}")
        lines.append(
            f"- spawns: {_pairs(s['workers']['spawns'])}; retirements by reason: "
            f"{_pairs(s['workers']['retirements'])}"
        )
        lines.append(
            f"- peak workers: {_pairs(s['workers']['peak'])}; at the end: "
            f"{_pairs({k: v for k, v in s['workers']['final'].items() if v})}"
        )
        lines.append(
            f"- nodes: launched {s['nodes']['launched']}, reclaimed "
            f"{s['nodes']['reclaimed']}, peak {s['nodes']['peak']}, cost "
            f"${s['nodes']['cost_usd']:.2f}"
        )
        lead = s["leadership"]
        lines.append(
            f"- leadership: {lead['terms']} terms, "
            f"{lead['time_without_leader_s']:.0f} s without a leader"
        )
        if p.warnings:
            lines.append(f"- warnings logged: {_pairs(p.warnings)}")
        lines.append(f"- wall time {p.wall_s:.1f} s (x{p.virtual_s / max(p.wall_s, 1e-9):,.0f})")
        lines.append("")
    return "\n".join(lines)


def _pairs(mapping: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in mapping.items()) or "none"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:g} h"
    if seconds >= 60:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


# -- everything ----------------------------------------------------------------------------


def write_report(result: ScenarioResult, out: Path) -> list[Path]:
    """Write summary.json, timeseries.csv, the plots and report.md into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_bytes(summary_bytes(result))
    write_timeseries(result, out / "timeseries.csv")
    write_claims(result, out / "claims.jsonl")
    write_passes(result, out / "passes.csv")
    plots = write_plots(result, out)
    (out / "report.md").write_text(markdown(result) + "\n", encoding="utf-8")
    written = [
        out / "summary.json",
        out / "timeseries.csv",
        out / "claims.jsonl",
        out / "passes.csv",
        *plots,
        out / "report.md",
    ]
    lines = [f"[{p.name}] {line}" for p in result.policies for line in p.log_lines]
    if lines:
        (out / "warnings.log").write_text("\n".join(lines) + "\n", encoding="utf-8")
        written.append(out / "warnings.log")
    return written
