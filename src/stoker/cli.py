"""The `stoker` command: serve, claim, release, status, scaletest, worker-check, version.

`serve` runs the control plane and its HTTP API; `scaletest` runs it against a simulated
cluster in virtual time (`stoker.sim`); `worker-check` checks a worker command against the
worker protocol (`stoker.worker_check`); the other commands are clients of a
running server (through the SDK), found at `--url` / `$STOKER_URL` (default
http://127.0.0.1:8080) with `--token` / `$STOKER_TOKEN`. Every failure is one line on
stderr and a non-zero exit status (2 for bad usage, 1 for everything else), never a
traceback.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from stoker._version import __version__
from stoker.sdk import Client, StokerError

app = typer.Typer(
    name="stoker",
    help="Keep a fleet of workers warm; claim them over HTTP.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

#: Column order of the state counts in `stoker status`.
STATES = ("spawning", "warm", "reserved", "activating", "hot", "hot_idle", "draining")

UrlOption = Annotated[
    str | None,
    typer.Option("--url", envvar="STOKER_URL", help="Server URL [default: http://127.0.0.1:8080]"),
]
TokenOption = Annotated[
    str | None,
    typer.Option("--token", envvar="STOKER_TOKEN", help="Bearer token", show_default=False),
]


class Mode(StrEnum):
    """Claim modes of `POST /v1/claims` (README, "HTTP API")."""

    prefer_warm = "prefer_warm"
    require_warm = "require_warm"
    cold = "cold"


def _fail(message: str, code: int = 1) -> NoReturn:
    print(f"stoker: {message}", file=sys.stderr)
    raise typer.Exit(code)


@contextlib.contextmanager
def _server(url: str | None, token: str | None) -> Iterator[Client]:
    """A client of the running server; an SDK error ends the command as its one line."""
    with Client(url, token=token) as client:
        try:
            yield client
        except StokerError as exc:
            _fail(str(exc))


def _console() -> Console:
    """A console for tables; piped or captured, no terminal width to fit, so never
    squeeze the columns."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def _print_json(body: Any) -> None:
    print(json.dumps(body, indent=2, ensure_ascii=False))


# -- serve ----------------------------------------------------------------------------------


@app.command()
def serve(
    config_file: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            envvar="STOKER_CONFIG",
            help="YAML config file (default: the built-in defaults)",
            dir_okay=False,
        ),
    ] = None,
    stop_workers: Annotated[
        bool,
        typer.Option(
            "--stop-workers",
            help="On shutdown, stop this server's workers instead of leaving them to adopt",
        ),
    ] = False,
) -> None:
    """Run the control plane and its HTTP API until SIGTERM or Ctrl-C."""
    # Imported here: the client commands need none of the server's code.
    from stoker.api.app import create_app
    from stoker.api.server import bind, bound_url, check_exposure
    from stoker.api.server import serve as run_server
    from stoker.api.tokens import TokenTable
    from stoker.bootstrap import build_control_plane, configure_logging
    from stoker.config import load_config
    from stoker.domain.errors import ConfigError
    from stoker.domain.errors import StokerError as ServerSideError

    try:
        loaded = load_config(config_file)
        config = loaded.config
        check_exposure(config.api)
        tokens = TokenTable(config.api)
    except ConfigError as exc:
        # Already one `config error: <key>: <problem>` line per problem.
        print(str(exc), file=sys.stderr)
        raise typer.Exit(1) from None
    configure_logging(config.log_level, config.log_format)
    try:
        sock = bind(config.api.host, config.api.port)
    except ServerSideError as exc:
        _fail(str(exc))
    url = bound_url(sock)
    try:
        plane = build_control_plane(config)
    except ConfigError as exc:
        # Kubernetes credentials are only read here: still a config error, in one line.
        sock.close()
        print(str(exc), file=sys.stderr)
        raise typer.Exit(1) from None
    if not config.is_postgres and config.sqlite_path() not in ("", ":memory:"):
        from stoker.adapters.sqlite.ownership import hold

        try:
            # Held until the process exits (the kernel drops it however it exits).
            store_lock = hold(config.sqlite_path())  # noqa: F841
        except ServerSideError as exc:
            sock.close()
            _fail(f"could not start: {exc}")
    api = create_app(plane, config.api, stop_workers=stop_workers, tokens=tokens)
    overrides = f" + {', '.join(loaded.overrides)}" if loaded.overrides else ""
    pools = ", ".join(p.name for p in config.pools)
    auth = "bearer tokens" if config.api.has_tokens else "loopback only, no tokens"
    lease = config.janitor_lease_name()
    election = f"{config.elector_kind()} {lease}" if lease else config.elector_kind()

    def announce() -> None:
        print(
            f"stoker {__version__} listening on {url} (config: {loaded.source}{overrides}; "
            f"store: {config.store_display()}; runtime: {config.runtime.kind}; "
            f"leader election: {election}; pools: {pools}; auth: {auth})",
            flush=True,
        )

    try:
        run_server(
            api,
            sock,
            api=config.api,
            shutdown_grace_s=config.intervals.shutdown_grace_s,
            on_started=announce,
        )
    except ServerSideError as exc:
        _fail(str(exc))
    print("stoker stopped", flush=True)


# -- client commands ------------------------------------------------------------------------


def _parse_config_items(items: Sequence[str]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            _fail(f"--config expects KEY=VALUE, got {item!r}", code=2)
        try:
            # Numbers, booleans, null and JSON objects keep their type; the rest is text.
            config[key] = json.loads(raw)
        except ValueError:
            config[key] = raw
    return config


@app.command()
def claim(
    pool: Annotated[str, typer.Option("--pool", "-p", help="Pool to claim from")],
    org: Annotated[str, typer.Option("--org", "-o", help="Org the session belongs to")],
    mode: Annotated[
        Mode | None,
        typer.Option("--mode", "-m", help="How the claim may be served [default: prefer_warm]"),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option("--timeout", "-t", min=0, max=3600, help="Seconds to wait for a worker"),
    ] = None,
    lease: Annotated[
        float | None, typer.Option("--lease", min=1, max=86400, help="Lease length in seconds")
    ] = None,
    config: Annotated[
        list[str] | None,
        typer.Option(
            "--config",
            "-c",
            help="KEY=VALUE handed to the worker at activation (repeatable)",
            show_default=False,
        ),
    ] = None,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Claim a worker and print the claim as JSON (release it with `stoker release ID`)."""
    settings = _parse_config_items(config or [])
    with _server(url, token) as client:
        info = client.create_claim(
            pool,
            org,
            mode=mode.value if mode is not None else None,
            timeout_s=timeout,
            lease_s=lease,
            config=settings,
        )
    _print_json(dict(info.raw))


@app.command()
def release(
    claim_id: Annotated[str, typer.Argument(metavar="ID", help="Claim id")],
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Release a claim and print it as JSON: the worker parks for its org or retires."""
    with _server(url, token) as client:
        info = client.release(claim_id)
    _print_json(dict(info.raw))


def _status_table(client: Client) -> Table:
    """The pools as the server reports them now."""
    pools = client.pools()
    table = Table(title=f"stoker at {client.url}", title_justify="left")
    table.add_column("pool")
    for name in ("target", "desired", "demand", "cap", *STATES):
        table.add_column(name, justify="right")
    for p in pools:
        cap = str(p.cap) if p.cap else "-"
        counts = [str(p.counts.get(s, 0)) for s in STATES]
        table.add_row(p.name, str(p.warm_target), str(p.desired_warm), str(p.demand), cap, *counts)
    return table


@app.command()
def status(
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C")] = False,
    interval: Annotated[
        float, typer.Option("--interval", min=0.2, max=3600, help="Seconds between refreshes")
    ] = 2.0,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Pools with their target, demand and workers by state."""
    console = _console()
    with _server(url, token) as client:
        table = _status_table(client)
        try:
            if watch and console.is_terminal:
                _watch_live(client, console, table, interval)
                return
            console.print(table)
            # Piped: a table per refresh, one after the other (a log of the pools).
            while watch:
                time.sleep(interval)
                console.print(_status_table(client))
        except KeyboardInterrupt:
            return


def _watch_live(client: Client, console: Console, table: Table, interval: float) -> None:
    """Redraw the table in place until Ctrl-C."""
    with Live(table, console=console, auto_refresh=False, transient=False) as live:
        while True:
            time.sleep(interval)
            live.update(_status_table(client), refresh=True)


@app.command()
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
        int | None, typer.Option("--seed", help="Seed [default: the scenario's]")
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
            help="Policies run at once, each in a process [default: 0 = all of them]",
        ),
    ] = 0,
) -> None:
    """Run the real control plane against a simulated cluster in virtual time.

    Writes summary.json, timeseries.csv, PNG plots and report.md into --out; exits 1
    when stoker's own policy breaks an invariant (the trace is printed).
    """
    # Imported here: the client commands need none of the simulator.
    import os

    from stoker.extras import missing_extra

    # Before the run, not at its end: the report's plots need matplotlib.
    problem = missing_extra("sim", "the scale test")
    if problem is not None:
        _fail(problem)

    from stoker.domain.errors import ConfigError
    from stoker.sim.report import headlines, write_report
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
        _fail(str(exc))
    # Policies are independent runs: all at once by default (more processes than CPUs
    # still finish sooner than rounds of one per CPU), at most two per CPU.
    workers = jobs or min(len(names), 2 * (os.cpu_count() or 1))
    bar = _ScaletestProgress(enabled=not no_progress)
    try:
        result = run_scenario(
            loaded, policies=names, short=short, progress=bar.update, jobs=workers
        )
    finally:
        bar.stop()
    try:
        write_report(result, out)
    except OSError as exc:
        _fail(f"cannot write the report to {out}: {exc}")
    console = _console()
    table = Table(title=f"scaletest {loaded.name}" + (" (short)" if short else ""))
    rows = headlines(result)
    columns = list(rows[0].cells) if rows else []
    table.add_column("policy")
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row.policy, *(row.cells[c] for c in columns))
    console.print(table)
    virtual = loaded.duration_s * len(result.policies)
    print(
        f"wall {result.wall_s:.1f} s for {virtual / 3600:.2f} h of virtual time "
        f"(x{virtual / max(result.wall_s, 1e-9):,.0f}); report in {out}",
        flush=True,
    )
    broken = result.stoker_violations()
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
        self._progress.update(task, completed=done, virtual=_virtual(done, total))

    def stop(self) -> None:
        """Take the bar down."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _virtual(done: float, total: float) -> str:
    if total >= 3 * 3600:
        return f"{done / 3600:.1f}/{total / 3600:g} h virtual"
    return f"{done / 60:.1f}/{total / 60:g} min virtual"


@app.command(
    "worker-check",
    context_settings={"allow_interspersed_args": False},
)
def worker_check(
    command: Annotated[
        list[str],
        typer.Argument(
            help="The worker's argv after `--`; {port}, {worker_id} and {python} are replaced",
            show_default=False,
        ),
    ],
    host: Annotated[str, typer.Option(help="Address the worker listens on")] = "127.0.0.1",
    ready_timeout: Annotated[
        float, typer.Option(help="Seconds the worker has to answer /healthz", min=0.1)
    ] = 30.0,
) -> None:
    """Start a worker as stoker would and check it against the worker protocol."""
    from stoker.worker_check import CannotStart, check_worker

    try:
        report = check_worker(command, host=host, ready_timeout_s=ready_timeout)
    except CannotStart as exc:
        _fail(str(exc))
    table = Table(title=escape(f"worker-check: {' '.join(command)}"))
    for column in ("rule", "expected", "got", "result"):
        table.add_column(column)
    for row in report.rows:
        result = "[green]pass[/green]" if row.passed else "[bold red]FAIL[/bold red]"
        table.add_row(row.rule, row.expected, row.got, result)
    console = _console()
    console.print(table)
    failed = sum(not row.passed for row in report.rows)
    if report.passed:
        console.print(f"all {len(report.rows)} rules passed")
        return
    if report.output:
        console.print("worker output (last lines):", markup=False)
        console.print(report.output.rstrip(), markup=False, highlight=False)
    _fail(f"{failed} of {len(report.rows)} rules failed")


@app.command()
def version() -> None:
    """Print the version."""
    print(f"stoker {__version__}")


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console entry point: run a command, turning every failure into one line."""
    command = typer.main.get_command(app)
    try:
        result = command.main(
            args=list(argv) if argv is not None else None, prog_name="stoker", standalone_mode=False
        )
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("stoker: interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.TyperException as exc:
        # Bad usage (exit status 2) and other command-line errors.
        code = int(getattr(exc, "exit_code", 1))
        format_message = getattr(exc, "format_message", None)
        message = format_message() if callable(format_message) else str(exc)
        if "\n" in message:
            # `stoker` alone: the help text.
            print(message, file=sys.stderr)
        else:
            ctx = getattr(exc, "ctx", None)
            path = getattr(ctx, "command_path", None)
            hint = f" (see '{path} --help')" if code == 2 and path else ""
            print(f"stoker: {message}{hint}", file=sys.stderr)
        sys.exit(code)
    sys.exit(result if isinstance(result, int) else 0)
