"""Wall and CPU time of a backtest replay, and of the `weekly` scenario.

    python benchmarks/backtest_speed.py [--claims 1000000] [--days 7] [--settings 1]
                                        [--jobs N] [--weekly]

Writes a synthetic claim log (`synthetic_claims`: `--claims` claims over `--days` days on a
daily cycle, 30 orgs, holds of 15 minutes on average), replays it for `--settings` settings
(the current one and warm_target 4, 8, ... candidates) in `--jobs` processes, and prints
the wall time, the CPU time per process, claims per CPU second and the time a million
claims would take at that rate (`--claims 0`: no replay). `--weekly` also runs `weekly`
(every policy) as `stoker scaletest weekly` does, and prints its wall time and the CPU
time of its processes. Targets on this 2-core machine: a week of 1,000,000 claims
within 300 s per setting; `weekly` within 300 s.

Shared machines change speed: each figure comes with a fixed pure-Python loop's time run
just before it (`reference_s`); compare runs at similar reference times, or as ratios
against a baseline run in the same session.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

from stoker.sim.backtest import Backtest, all_figures
from stoker.sim.claimlog import read_claim_log, synthetic_claims
from stoker.sim.runner import run_scenario
from stoker.sim.scenario import load_scenario

#: Wall-time targets (seconds).
TARGET_PER_SETTING_S = 300.0
TARGET_WEEKLY_S = 300.0


def reference_s() -> float:
    """CPU seconds of a fixed pure-Python loop (about 0.8 s on a fast core)."""
    started = time.process_time()
    sum(i * i for i in range(10_000_000))
    return time.process_time() - started


def children_cpu_s() -> float:
    """CPU seconds of the finished child processes so far (the forked runs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def replay(claims: int, days: float, settings: int, jobs: int) -> None:
    """Replay `claims` synthetic claims over `days` for `settings` settings."""
    path = Path(tempfile.mkdtemp(prefix="stoker-backtest-")) / "claims.jsonl"
    started = time.perf_counter()
    with path.open("w") as out:
        for line in synthetic_claims(claims, span_s=days * 86_400):
            out.write(json.dumps(line) + "\n")
    log = read_claim_log(path)
    read_s = time.perf_counter() - started
    runs = [("current", {})] + [
        (f"warm_target={4 * 2**i}", {"warm_target": 4 * 2**i}) for i in range(settings - 1)
    ]
    ref = reference_s()
    cpu0, own0 = children_cpu_s(), time.process_time()
    started = time.perf_counter()
    result = Backtest(replay=log, current={"warm_target": 2}, jobs=jobs).run(runs)
    wall = time.perf_counter() - started
    cpu = children_cpu_s() - cpu0 + time.process_time() - own0
    per_setting = cpu / len(runs)
    print(
        f"backtest: {len(log):,} claims over {days:g} d, {len(runs)} settings, jobs {jobs}: "
        f"wall {wall:.1f} s, CPU {per_setting:.1f} s per setting "
        f"({len(log) / per_setting:,.0f} claims per CPU second; log read in {read_s:.1f} s; "
        f"reference {ref:.2f} s)"
    )
    million = 1_000_000 / (len(log) / per_setting)
    verdict = "met" if million <= TARGET_PER_SETTING_S else "NOT met"
    print(
        f"  a million claims at that rate: {million:,.0f} CPU s per setting "
        f"(target <= {TARGET_PER_SETTING_S:.0f} s: {verdict})"
    )
    for f in all_figures(result):
        cold = "-" if f.cold_share is None else f"{f.cold_share:.2%}"
        print(
            f"  {f.name}: cold {cold}, idle {f.idle_worker_hours:,.0f} worker-h, ${f.cost_usd:,.0f}"
        )


def weekly(jobs: int) -> None:
    """`weekly`, every policy, as `stoker scaletest weekly` runs it."""
    scenario = load_scenario("weekly")
    ref = reference_s()
    cpu0, own0 = children_cpu_s(), time.process_time()
    result = run_scenario(scenario, jobs=jobs or len(scenario.policies))
    cpu = children_cpu_s() - cpu0 + time.process_time() - own0
    verdict = "met" if result.wall_s <= TARGET_WEEKLY_S else "NOT met"
    print(
        f"weekly: {len(result.policies)} policies, jobs {result.jobs}: wall "
        f"{result.wall_s:.1f} s (target <= {TARGET_WEEKLY_S:.0f} s: {verdict}; "
        f"reference {ref:.2f} s); CPU {cpu:.0f} s, {cpu / len(result.policies):.0f} s "
        "per policy"
    )
    for p in result.policies:
        print(f"  {p.name}: wall {p.wall_s:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=1_000_000, help="0: no replay")
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--settings", type=int, default=1, help="settings replayed")
    parser.add_argument("--jobs", type=int, default=0, help="processes [one per setting]")
    parser.add_argument("--weekly", action="store_true", help="also run weekly")
    args = parser.parse_args()
    if args.claims:
        replay(args.claims, args.days, args.settings, args.jobs or args.settings)
    if args.weekly:
        weekly(args.jobs)


if __name__ == "__main__":
    main()
