"""`scaletest`: the real control plane against a simulated cluster in virtual time
(`stoker.sim`), with a progress bar and a table of headline figures."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from stoker.cli.output import JsonFlag, fail, make_console, print_json


def scaletest(
    scenario: Annotated[
        str,
        typer.Argument(
            metavar="SCENARIO",
            help="A scenario file, or a scenario name (shipped, or in ./scenarios)",
        ),
    ],
    out: Annotated[
        Path,
        typer.Option("--out", "-o", help="Directory for the report", file_okay=False),
    ],
    seed: Annotated[
        int | None, typer.Option("--seed", help="Seed", show_default="the scenario's")
    ] = None,
    short: Annotated[
        bool, typer.Option("--short", help="Run the scenario's short form (seconds, for CI)")
    ] = False,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy", "-p", help="Run only this policy (repeatable)", show_default=False
        ),
    ] = None,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="No progress bar")] = False,
    jobs: Annotated[
        int,
        typer.Option(
            "--jobs",
            "-j",
            min=0,
            help="Policies run at once, each in a process (0: all of them, up to 8 or two per CPU)",
        ),
    ] = 0,
    as_json: JsonFlag = False,
) -> None:
    """Run the real control plane against a simulated cluster in virtual time.

    Writes summary.json, timeseries.csv, PNG plots and report.md into --out;
    exits 1 when stoker's own policy breaks an invariant (the trace is printed).
    """
    # Imported here: the client commands need none of the simulator.
    from stoker.extras import missing_extra

    # Before the run, not at its end: the report's plots need matplotlib.
    problem = missing_extra("sim", "the scale test")
    if problem is not None:
        fail(problem)

    from stoker.domain.errors import ConfigError
    from stoker.sim.report import (
        ROLLOUT_COLUMNS,
        check_out,
        headlines,
        rollout_rows,
        write_report,
    )
    from stoker.sim.runner import run_scenario
    from stoker.sim.scenario import load_scenario

    try:
        loaded = load_scenario(scenario, short=short)
        if seed is not None:
            loaded = loaded.model_copy(update={"seed": seed})
        names = list(dict.fromkeys(policy or [p.name for p in loaded.policies]))
        for name in names:
            loaded.policy(name)
    except ConfigError as exc:
        fail(str(exc))
    try:
        check_out(out)
    except OSError as exc:
        fail(f"cannot write the report to {out}: {exc}")
    # Policies are independent runs: all at once by default. Runs of about one length
    # then end together, where rounds of one per CPU leave the last alone on one core
    # (weekly's five policies on two cores: four, then one). At most two per CPU beyond
    # eight, since each holds its own simulated fleet in memory.
    workers = jobs or min(len(names), max(8, 2 * (os.cpu_count() or 1)))
    bar = _ScaletestProgress(enabled=not no_progress)
    try:
        result = run_scenario(
            loaded, policies=names, short=short, progress=bar.update, jobs=workers
        )
    except ConfigError as exc:
        bar.stop()
        fail(str(exc))
    finally:
        bar.stop()
    try:
        write_report(result, out)
    except OSError as exc:
        fail(f"cannot write the report to {out}: {exc}")
    rows = headlines(result)
    broken = result.stoker_violations()
    if as_json:
        print_json(
            {
                "scenario": loaded.name,
                "short": short,
                "report": str(out),
                "wall_s": round(result.wall_s, 3),
                "stoker_violations": len(broken),
                # Per policy: the figures of summary.json, and the table's headlines.
                "policies": {
                    p.name: {"summary": p.summary, "violations": len(p.violations)}
                    for p in result.policies
                },
                "headlines": {row.policy: row.cells for row in rows},
            }
        )
    else:
        _print_headlines(loaded.name, short, rows)
        rollouts = rollout_rows(result)
        if rollouts:
            _print_headlines(f"{loaded.name}: the rollout", short, rollouts, ROLLOUT_COLUMNS)
        virtual = loaded.duration_s * len(result.policies)
        print(
            f"wall {result.wall_s:.1f} s for {virtual / 3600:.2f} h of virtual time "
            f"(x{virtual / max(result.wall_s, 1e-9):,.0f}); report in {out}",
            flush=True,
        )
    if broken:
        print(
            f"stoker: scenario {loaded.name}: stoker's policy broke invariants "
            f"({len(broken)} violations)",
            file=sys.stderr,
        )
        for name, violation in broken[:10]:
            print(
                f"  [{name}] t={violation.t:.1f}s {violation.invariant} {violation.subject}: "
                f"{violation.detail}",
                file=sys.stderr,
            )
            for line in violation.trace:
                print(f"      {line}", file=sys.stderr)
        raise typer.Exit(1)


def _print_headlines(
    name: str, short: bool, rows: list[Any], columns: Sequence[str] | None = None
) -> None:
    """The headline figures of each policy, as a table."""
    table = Table(title=f"scaletest {name}" + (" (short)" if short else ""))
    columns = list(columns or (rows[0].cells if rows else []))
    table.add_column("policy")
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row.policy, *(row.cells[c] for c in columns))
    make_console().print(table)


class _ScaletestProgress:
    """A rich progress bar of virtual time, one task per policy, started on first use
    (after the runner has forked its processes)."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}

    def update(self, policy: str, done: float, total: float) -> None:
        """Show `done` of `total` virtual seconds for `policy`."""
        if not self.enabled:
            return
        if self._progress is None:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[virtual]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )
            self._progress.start()
        task = self._tasks.get(policy)
        if task is None:
            task = self._tasks[policy] = self._progress.add_task(policy, total=total, virtual="")
        done = min(done, total)  # the last step may end past a run that ends mid-step
        self._progress.update(task, completed=done, virtual=_virtual(done, total))

    def stop(self) -> None:
        """Take the bar down."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _virtual(done: float, total: float) -> str:
    """`done` of `total` virtual seconds, both to a tenth of the unit."""
    if total >= 3 * 3600:
        return f"{done / 3600:.1f}/{total / 3600:.1f} h virtual"
    return f"{done / 60:.1f}/{total / 60:.1f} min virtual"
