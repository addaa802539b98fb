"""`worker-check`: a worker command checked against the worker protocol
(`stoker.worker_check`)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from stoker.cli.output import JsonFlag, fail, make_console, print_json


def worker_check(
    command: Annotated[
        list[str],
        typer.Argument(
            help="The worker's argv after `--`; {port}, {worker_id} and {python} are replaced",
            show_default=False,
        ),
    ],
    host: Annotated[str, typer.Option(help="Address the worker listens on")] = "127.0.0.1",
    ready_timeout_s: Annotated[
        float,
        typer.Option(
            "--ready-timeout-s", help="Seconds the worker has to answer /healthz", min=0.1
        ),
    ] = 30.0,
    as_json: JsonFlag = False,
    old_ready_timeout: Annotated[
        float | None, typer.Option("--ready-timeout", min=0.1, hidden=True)
    ] = None,
) -> None:
    """Start a worker as stoker would and check it against the worker protocol."""
    from stoker.worker_check import CannotStart, check_worker

    if old_ready_timeout is not None:
        print("stoker: --ready-timeout is deprecated; use --ready-timeout-s", file=sys.stderr)
        ready_timeout_s = old_ready_timeout

    try:
        report = check_worker(command, host=host, ready_timeout_s=ready_timeout_s)
    except CannotStart as exc:
        fail(str(exc))
    failed = sum(not row.passed for row in report.rows)
    if as_json:
        print_json(
            {
                "command": command,
                "passed": report.passed,
                "rules": [dataclasses.asdict(row) for row in report.rows],
                "output": report.output or None,
            }
        )
        if not report.passed:
            fail(f"{failed} of {len(report.rows)} rules failed")
        return
    table = Table(title=escape(f"worker-check: {' '.join(command)}"))
    for column in ("rule", "expected", "got", "result"):
        table.add_column(column)
    for row in report.rows:
        result = "[green]pass[/green]" if row.passed else "[bold red]FAIL[/bold red]"
        table.add_row(row.rule, row.expected, row.got, result)
    console = make_console()
    console.print(table)
    if report.passed:
        console.print(f"all {len(report.rows)} rules passed")
        return
    if report.output:
        console.print("worker output (last lines):", markup=False)
        console.print(report.output.rstrip(), markup=False, highlight=False)
    fail(f"{failed} of {len(report.rows)} rules failed")
