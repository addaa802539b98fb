"""The diurnal scenario over several days: from day 2 on, the forecast has learned a day.

    python benchmarks/learned_day.py [--days 2] [--seed 9] [--out DIR] [--policy NAME ...]
        [--scenario NAME] [--reference NAME]

Runs the shipped `diurnal` scenario stretched to `--days` days (the same tenants and daily
cycle) for `stoker` and `stoker-reactive` (the forecast off) by default, writes the report
into DIR (default: a temporary directory), and prints per policy and day: sessions, claims
served cold and their share, the sessions' time to a worker (p99, max), the node cost of
the day, and that cost against stoker-reactive's of the same day. The targets of #17, from
day 2: cold <= 0.5 % of claims, session p99 <= 200 ms, cost <= stoker-reactive's.
`--scenario orgs --policy stoker --policy stoker-org-off --reference stoker-org-off`
measures the per-org forecast the same way (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections import defaultdict
from pathlib import Path

from stoker.sim.report import write_report
from stoker.sim.runner import PolicyResult, run_scenario
from stoker.sim.scenario import load_scenario

DAY_S = 86_400.0


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (inf when empty)."""
    if not values:
        return math.inf
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def by_day(result: PolicyResult, days: int) -> list[dict[str, float]]:
    """Per day (by when each session began): sessions, claims bound, cold claims, session
    time to a worker p99 and max (s), node cost (USD)."""
    sessions: dict[int, list[tuple[float, float | None, str | None]]] = defaultdict(list)
    for a in result.attempts:
        sessions[a.session].append((a.start_s, a.end_s if a.outcome == "bound" else None, a.source))
    costs = [(float(s["t_s"]), float(s["cost_usd"])) for s in result.samples]
    out = []
    for day in range(days):
        lo, hi = day * DAY_S, (day + 1) * DAY_S
        waits, cold, reuse, claims = [], 0, 0, 0
        for tries in sessions.values():
            start = min(t for t, _, _ in tries)
            if not lo <= start < hi:
                continue
            bound = [(end, source) for _, end, source in tries if end is not None]
            waits.append(bound[0][0] - start if bound else math.inf)
            cold += sum(1 for _, source in bound if source == "cold")
            reuse += sum(1 for _, source in bound if source == "reuse")
            claims += len(bound)
        spent = [c for t, c in costs if t <= hi]
        before = [c for t, c in costs if t <= lo]
        out.append(
            {
                "sessions": len(waits),
                "claims": claims,
                "reuse": reuse,
                "cold": cold,
                "p99_s": percentile(waits, 0.99),
                "max_s": max(waits, default=0.0),
                "cost": (spent[-1] if spent else 0.0) - (before[-1] if before else 0.0),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--days", type=int, default=2, help="days to run [2]")
    parser.add_argument("--seed", type=int, default=9, help="the scenario's seed [9]")
    parser.add_argument("--out", type=Path, help="where the report goes")
    parser.add_argument(
        "--policy", action="append", help="policies to run [stoker, stoker-reactive]"
    )
    parser.add_argument("--scenario", default="diurnal", help="a shipped scenario [diurnal]")
    parser.add_argument(
        "--reference", default="stoker-reactive", help="the policy costs are compared with"
    )
    args = parser.parse_args()
    policies = args.policy or ["stoker", "stoker-reactive"]
    scenario = load_scenario(args.scenario).model_copy(
        update={"duration_s": args.days * DAY_S, "seed": args.seed}
    )
    result = run_scenario(scenario, policies=policies, jobs=len(policies))
    out = args.out or Path(tempfile.mkdtemp(prefix="stoker-learned-day-"))
    write_report(result, out)
    days: dict[str, list[dict[str, float]]] = {
        r.name: by_day(r, args.days) for r in result.policies
    }
    reference = days.get(args.reference)
    print(f"{args.scenario} over {args.days} days, seed {args.seed}; report in {out}")
    print(
        "policy           day  sessions  cold of claims   reuse   p99 ms   max s   cost $  "
        f"vs {args.reference}"
    )
    for name, rows in days.items():
        for day, row in enumerate(rows):
            share = 100 * row["cold"] / max(1, row["claims"])
            ratio = f"{row['cost'] / reference[day]['cost']:.3f}" if reference else "-"
            print(
                f"{name:16s} {day + 1:3d} {row['sessions']:9d} {row['cold']:5d} ({share:4.2f} %)"
                f" {row['reuse']:7d} {1000 * row['p99_s']:9.1f} {row['max_s']:7.1f}"
                f" {row['cost']:8.1f}  {ratio}"
            )
    violations = sum(len(r.violations) for r in result.policies)
    print(f"violations: {violations}; wall {result.wall_s:.1f} s")


if __name__ == "__main__":
    main()
