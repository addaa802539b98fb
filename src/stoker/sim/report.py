"""The report of a scaletest: summary.json, timeseries.csv, plots and report.md.

- `summary.json`: per policy, claim latency percentiles by source, the warm hit ratio,
  failures by reason, time to reach the target, idle and busy vCPU-hours, spawns,
  retirements by reason, nodes launched and reclaimed, invariant violations (with their
  traces). Keys are sorted and floats rounded, and nothing in it depends on the wall
  clock, so the same scenario and seed give the same bytes.
- `timeseries.csv`: one row per policy and sample (workers by state, nodes, pending pods,
  sessions, warm target and demand, vCPU by use, the leader).
- `claims.jsonl` (every claim attempt) and `passes.csv` (every janitor pass);
- PNG plots (`stoker.sim.plots`): workers by state, nodes and cost, pending pods with
  cold and failed claims, demand and desired warm every pass, latency and time-to-worker
  CDFs, idle against busy vCPU.
- `report.md`: the comparison table, the invariant verdicts and the plots, with the wall
  time and the virtual-time speed-up of the run.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoker.sim.passlog import COLUMNS as PASS_COLUMNS
from stoker.sim.plots import PLOTS, duration_text, write_plots
from stoker.sim.runner import STOKER_KINDS, PolicyResult, ScenarioResult
from stoker.sim.sessions import DAY_S, per_day

#: Decimals kept for floats in summary.json and timeseries.csv.
DECIMALS = 4


@dataclass(frozen=True)
class Headline:
    """One row of the comparison table (formatted)."""

    policy: str
    cells: dict[str, str]


COLUMNS = (
    "bound / failed claims",
    "cold share",
    "claim p50 / p90 / p99",
    "session p50 / p99",
    "waited >= timeout",
    "time to target",
    "busy / idle / placeholder vCPU-h",
    "spawns / retired",
    "nodes launched / reclaimed",
    "cost per day",
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
                    **_days(result, p),
                    "violations": [v.as_dict() for v in p.violations],
                    "warnings": p.warnings,
                }
                for p in result.policies
            },
        }
    )
    return rounded


def _days(result: ScenarioResult, p: PolicyResult) -> dict[str, Any]:
    """`days`, the figures day by day, in a run longer than a day."""
    duration = result.scenario.duration_s
    if duration <= DAY_S:
        return {}
    timeout = p.summary["sessions"]["claim_timeout_s"]
    days = per_day(
        p.attempts,
        p.samples,
        duration_s=duration,
        claim_timeout_s=timeout,
        timeouts=p.claim_timeouts,
    )
    return {"days": days}


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
    sessions = s["sessions"]
    waited = sessions["time_to_worker_s"]
    cold = claims["cold_share"]
    return {
        "bound / failed claims": f"{claims['bound']} / {failures}",
        "cold share": "-" if cold is None else f"{cold:.1%}",
        "claim p50 / p90 / p99": _three(latency, ("p50", "p90", "p99")),
        "session p50 / p99": _three(waited, ("p50", "p99")),
        "waited >= timeout": str(sessions["waited_ge_claim_timeout"]),
        "time to target": target,
        "busy / idle / placeholder vCPU-h": (
            f"{vcpu['busy']:.1f} / {vcpu['idle']:.1f} / {vcpu['placeholder']:.1f}"
        ),
        "spawns / retired": f"{sum(spawns.values())} / {s['workers']['retired']}",
        "nodes launched / reclaimed": f"{s['nodes']['launched']} / {s['nodes']['reclaimed']}",
        "cost per day": f"${s['nodes']['cost_usd_per_day']:,.1f}",
        "violations": str(violations),
    }


#: The rollout table (`stoker.sim.rollout`): the claims sent while it was under way.
ROLLOUT_COLUMNS = (
    "outcome",
    "claims during",
    "cold during",
    "failed during",
    "cold / failed after start",
    "peak live / cap",
    "completed after",
)


def rollout_rows(result: ScenarioResult) -> list[Headline]:
    """The rollout table's rows, one per policy whose run rolled a revision out."""
    rows = []
    for p in result.policies:
        r = p.summary.get("rollout")
        if r is None:
            continue
        claims = r["claims_during"]

        def share(count: int, of: int) -> str:
            return f"{count} ({count / of:.1%})" if of else str(count)

        completed = r["completed_s"]
        cells = {
            "outcome": r["outcome"] or f"{r['state']} at the end",
            "claims during": str(claims),
            "cold during": share(r["cold_claims_during"], claims),
            "failed during": share(r["failed_claims_during"], claims),
            "cold / failed after start": (
                f"{r['cold_claims_after_start']} / {r['failed_claims_after_start']} "
                f"of {r['claims_after_start']}"
            ),
            "peak live / cap": f"{r['peak_live']} / {r['cap'] or '-'}",
            "completed after": "never" if completed is None else _seconds(completed),
        }
        rows.append(Headline(p.name, cells))
    return rows


def _three(quantiles: dict[str, float] | None, keys: Sequence[str]) -> str:
    return "-" if quantiles is None else " / ".join(_seconds(quantiles[k]) for k in keys)


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
        f"Seed {scenario.seed}; {duration_text(scenario.duration_s)} of virtual time for each of "
        f"{len(result.policies)} policies; wall time {result.wall_s:.1f} s "
        f"({result.jobs} process{'es' if result.jobs > 1 else ''}), a virtual-time speed-up "
        f"of x{virtual / max(result.wall_s, 1e-9):,.0f} over the whole run.",
        "",
        "## Comparison",
        "",
        markdown_table(headlines(result)),
        "",
        "Latency is from the claim to the bound worker, over every bound claim; a *session* "
        "counts from its arrival to its bound worker, failed attempts and back-offs "
        "included (one that never got a worker counts with the time it waited); *cold "
        "share* is the share of bound claims served by their own spawn; *warm hit* is "
        "the share of bound claims served by a warm or a parked (reuse) worker; *time to "
        "target* runs from the first arrival until the sessions holding a worker reach the "
        "scenario's target; vCPU-hours integrate the workers' requests (busy: reserved, "
        "activating, hot; idle: warm, hot_idle) and the placeholders'; *cost per day* is the "
        "node cost of the run scaled to 24 h.",
        "",
    ]
    rollouts = rollout_rows(result)
    if rollouts:
        lines += [
            "## Rollout",
            "",
            markdown_table(rollouts, ROLLOUT_COLUMNS),
            "",
            "A new revision rolled out during the run (stoker.sim.rollout): the claims sent "
            "from its start until it *completed* (its rollout ended and no idle worker of "
            "another revision was left), those of them that went cold or failed, and the "
            "same from its start to the end of the run; *peak live* counts every "
            "revision's workers while it was under way (I8: within the cap).",
            "",
        ]
    lines += [
        "## Invariants (I1-I8, stoker.sim.invariants)",
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
    lines += _day_tables(result)
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


def _day_tables(result: ScenarioResult) -> list[str]:
    """Day by day, one row per policy and day, in a run longer than a day."""
    rows = [(p.name, day) for p in result.policies for day in _days(result, p).get("days", [])]
    if not rows:
        return []
    lines = [
        "",
        "## Day by day",
        "",
        "| policy | day | claims bound | cold share | session p50 / p99 | waited >= timeout | "
        "node cost |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, day in rows:
        cold = "-" if day["cold_share"] is None else f"{day['cold_share']:.1%}"
        lines.append(
            f"| {name} | {day['day']} | {day['claims_bound']} | {cold} | "
            f"{_three(day['time_to_worker_s'], ('p50', 'p99'))} | "
            f"{day['waited_ge_claim_timeout']} | ${day['cost_usd']:,.1f} |"
        )
    return lines


def _pairs(mapping: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in mapping.items()) or "none"


# -- everything ----------------------------------------------------------------------------


def check_out(out: Path) -> None:
    """Before a run of minutes, OSError when its report could not be written to `out`:
    the directory is made and a file written in it and deleted; the directories this
    made are removed again (a refused run leaves nothing)."""
    made = []
    missing = out
    while not missing.exists() and missing != missing.parent:
        made.append(missing)
        missing = missing.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    finally:
        for directory in made:  # the deepest first
            with contextlib.suppress(OSError):
                directory.rmdir()


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
    else:
        # A report written over an earlier one must not keep that run's warnings.
        (out / "warnings.log").unlink(missing_ok=True)
    return written
