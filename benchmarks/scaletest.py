"""Wall-clock time of every scenario in its full form, and its comparison table.

    python benchmarks/scaletest.py [SCENARIO ...] [--out DIR] [--short] [--jobs N]

Runs each shipped scenario (all of them by default) as `stoker scaletest` does,
writes its report into `DIR/<scenario>/` (default: a temporary directory), and prints,
per scenario: the wall time, the virtual time it covered (duration x policies), the
speed-up, the peak nodes and live workers of its largest run, and its comparison table.
Targets on a 2-core machine: `diurnal` within 60 s, `large` within 120 s.

Shared machines change speed (this one's single-core speed was seen to vary by 1.7x within
minutes), so each scenario's line also gives the time of a fixed pure-Python loop run just
before and after it: compare wall times at similar reference times.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from stoker.sim.report import headlines, markdown_table, write_report
from stoker.sim.runner import run_scenario
from stoker.sim.scenario import load_scenario, scenario_names

#: Wall-time targets of the full forms (seconds).
TARGETS = {"diurnal": 60.0, "large": 120.0}


def reference_s() -> float:
    """CPU seconds of a fixed pure-Python loop (about 0.8 s on a fast core)."""
    started = time.process_time()
    sum(i * i for i in range(10_000_000))
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", help="scenario names [default: all]")
    parser.add_argument("--out", type=Path, help="where the reports go")
    parser.add_argument("--short", action="store_true", help="the short forms instead")
    parser.add_argument("--jobs", type=int, default=0, help="policies at once [all]")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="stoker-scaletest-"))
    for name in args.scenarios or scenario_names():
        scenario = load_scenario(name, short=args.short)
        jobs = args.jobs or len(scenario.policies)
        before = reference_s()
        result = run_scenario(scenario, short=args.short, jobs=jobs)
        after = reference_s()
        write_report(result, out / name)
        virtual = scenario.duration_s * len(result.policies)
        peak_nodes = max(p.summary["nodes"]["peak"] for p in result.policies)
        peak_live = max(p.summary["workers"]["peak"]["live"] for p in result.policies)
        target = TARGETS.get(name)
        verdict = ""
        if target is not None and not args.short:
            verdict = (
                f"  target <= {target:.0f} s: {'met' if result.wall_s <= target else 'NOT met'}"
            )
        print(
            f"\n## {name}{' (short)' if args.short else ''}: wall {result.wall_s:.1f} s "
            f"({result.jobs} processes) for {virtual / 3600:.1f} h of virtual time "
            f"(x{virtual / result.wall_s:,.0f}); peak {peak_nodes} nodes, "
            f"{peak_live} live workers{verdict}; reference loop {before:.2f} s before, "
            f"{after:.2f} s after"
        )
        print(markdown_table(headlines(result)))
        violations = sum(len(p.violations) for p in result.policies if p.kind == "stoker")
        print(f"stoker's invariant violations: {violations}; report in {out / name}")


if __name__ == "__main__":
    main()
