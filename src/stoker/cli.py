"""The `stoker` command: serve, claim, release, claims, workers, pools, status, config,
scaletest, worker-check, version.

`serve` runs the control plane and its HTTP API; `config check` validates a config file
as `serve` would; `scaletest` runs it against a simulated cluster in virtual time
(`stoker.sim`); `worker-check` checks a worker command against the worker protocol
(`stoker.worker_check`); the other commands are clients of a running server (through the
SDK), found at `--url` / `$STOKER_URL` (default http://127.0.0.1:8080) with `--token` /
`$STOKER_TOKEN`, and print a table, or with `--json` the server's JSON. Every failure is
one line on stderr and a non-zero exit status (2 for bad usage, 1 for everything else),
never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from stoker._version import __version__
from stoker.sdk import ClaimInfo, Client, PoolInfo, Retries, StokerError

HELP = "Keep a fleet of workers warm; claim them over HTTP."
app = typer.Typer(
    name="stoker",
    help=HELP,
    add_completion=True,
    invoke_without_command=True,
    pretty_exceptions_enable=False,
    context_settings={"show_default": True},
)
claims_app = typer.Typer(
    name="claims", help="Claims on the server (admin token).", no_args_is_help=True
)
workers_app = typer.Typer(
    name="workers", help="Workers on the server (admin token).", no_args_is_help=True
)
config_app = typer.Typer(name="config", help="The server's configuration.", no_args_is_help=True)
app.add_typer(claims_app)
app.add_typer(workers_app)
app.add_typer(config_app)

#: Column order of the state counts in `stoker status`.
STATES = ("spawning", "warm", "reserved", "activating", "hot", "hot_idle", "draining")

UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url", envvar="STOKER_URL", help="Server URL", show_default="http://127.0.0.1:8080"
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option("--token", envvar="STOKER_TOKEN", help="Bearer token", show_default=False),
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print the server's JSON instead of a table")
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
    """A client of the running server; an SDK error ends the command as its one line.

    Each request is sent once: a command says at once that the server does not answer
    (the SDK's retries, up to a claim's wait plus 30 s, are for applications)."""
    with Client(url, token=token, retries=Retries(enabled=False)) as client:
        try:
            yield client
        except StokerError as exc:
            _fail(str(exc))


def _console(*, fit: bool = False) -> Console:
    """A console for tables; piped or captured there is no terminal width to fit, so the
    columns are never squeezed — unless `fit` (`status`, which splits its table to fit)
    and `$COLUMNS` gives a width."""
    console = Console()
    if console.is_terminal or (fit and os.environ.get("COLUMNS", "").isdigit()):
        return console
    return Console(width=200)


def _print_json(body: Any) -> None:
    print(json.dumps(body, indent=2, ensure_ascii=False))


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit", is_eager=True)
    ] = False,
) -> None:
    if version:
        print(f"stoker {__version__}")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        # Bare `stoker`: the help, on stdout, and success.
        print(ctx.get_help())
        raise typer.Exit(0)


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


# -- config check ---------------------------------------------------------------------------

#: What a secret is shown as.
MASK = "***"


@config_app.command("check")
def config_check(
    config_file: Annotated[
        Path,
        typer.Option(
            "--config",
            "-c",
            envvar="STOKER_CONFIG",
            help="YAML config file, as `stoker serve -c` takes it",
            dir_okay=False,
            show_default=False,
        ),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of YAML")] = False,
) -> None:
    """Validate a config file (with the `STOKER_*` overrides) as `serve` would, and print
    the effective config with its secrets masked; exit 1 with the errors otherwise."""
    import yaml

    from stoker.api.server import check_exposure
    from stoker.api.tokens import TokenTable
    from stoker.config import load_config
    from stoker.domain.errors import ConfigError

    try:
        loaded = load_config(config_file)
        check_exposure(loaded.config.api)
        TokenTable(loaded.config.api)
    except ConfigError as exc:
        # One `config error: <key>: <problem>` line per problem, as `serve` prints them.
        print(str(exc), file=sys.stderr)
        raise typer.Exit(1) from None
    effective = _masked(loaded.config.model_dump(mode="json"))
    if as_json:
        _print_json(effective)
        return
    overrides = f" + {', '.join(loaded.overrides)}" if loaded.overrides else ""
    print(f"# effective config of {loaded.source}{overrides} (valid; secrets masked)")
    print(yaml.safe_dump(effective, sort_keys=False, allow_unicode=True), end="")


def _masked(config: dict[str, Any]) -> dict[str, Any]:
    """The config's JSON form with the store password, API tokens and activation key masked."""
    scheme, sep, rest = str(config["store"]).partition("://")
    userinfo, at, host = rest.rpartition("@")
    if at and ":" in userinfo:
        config["store"] = f"{scheme}{sep}{userinfo.split(':', 1)[0]}:{MASK}@{host}"
    api = config["api"]
    api["admin_tokens"] = [MASK for _ in api["admin_tokens"]]
    # Tokens are the keys of org_tokens: each becomes a numbered mask, to stay distinct.
    api["org_tokens"] = {
        f"{MASK}{n}": org for n, org in enumerate(api["org_tokens"].values(), start=1)
    }
    if config["activation"]["key"] is not None:
        config["activation"]["key"] = MASK
    return config


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
        typer.Option(
            "--mode", "-m", help="How the claim may be served", show_default="prefer_warm"
        ),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            "-t",
            min=0,
            max=3600,
            help="Seconds to wait for a worker",
            show_default="the pool's claim_timeout_s",
        ),
    ] = None,
    lease: Annotated[
        float | None,
        typer.Option(
            "--lease",
            min=1,
            max=86400,
            help="Lease length in seconds",
            show_default="the pool's lease_s",
        ),
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
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (the output anyway)")] = False,
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
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (the output anyway)")] = False,
) -> None:
    """Release a claim and print it as JSON: the worker parks for its org or retires."""
    with _server(url, token) as client:
        info = client.release(claim_id)
    _print_json(dict(info.raw))


# -- claims, workers, pools ---------------------------------------------------------------


class ClaimStateChoice(StrEnum):
    """Claim states `GET /v1/claims` lists by."""

    bound = "bound"
    released = "released"
    expired = "expired"
    failed = "failed"


class WorkerStateChoice(StrEnum):
    """Worker states `GET /v1/workers` lists by (DESIGN.md §2)."""

    spawning = "spawning"
    warm = "warm"
    reserved = "reserved"
    activating = "activating"
    hot = "hot"
    hot_idle = "hot_idle"
    draining = "draining"
    retired = "retired"


ClaimIdArgument = Annotated[str, typer.Argument(metavar="ID", help="Claim id")]
LimitOption = Annotated[
    int, typer.Option("--limit", "-n", min=1, max=10000, help="At most this many rows")
]


def _when(value: datetime | None) -> str:
    """A timestamp as UTC, to the second; '-' for none."""
    return value.strftime("%Y-%m-%d %H:%M:%SZ") if value is not None else "-"


def _claims_table(claims: Sequence[ClaimInfo], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("id", "pool", "org", "state", "source", "worker", "created", "expires"):
        table.add_column(column, overflow="fold")
    for c in claims:
        table.add_row(
            c.id,
            c.pool,
            c.org,
            c.state,
            c.source,
            c.worker.id,
            _when(c.created_at),
            _when(c.expires_at) if c.bound else "-",
        )
    return table


def _claim_details(c: ClaimInfo) -> Table:
    """One claim as rows of field and value (its session token left out)."""
    table = Table(title=f"claim {c.id}", title_justify="left", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    rows = {
        "pool": c.pool,
        "org": c.org,
        "state": c.state,
        "source": c.source,
        "mode": c.mode,
        "worker": f"{c.worker.id} (epoch {c.worker.epoch})",
        "endpoint": c.worker.endpoint,
        "lease_s": f"{c.lease_s:g}",
        "created": _when(c.created_at),
        "expires": _when(c.expires_at),
        "ended": _when(c.ended_at),
        "reason": c.reason or "-",
        "ttl_s": "-" if c.ttl_s is None else f"{c.ttl_s:g}",
    }
    for name, value in rows.items():
        table.add_row(name, escape(value))
    return table


@claims_app.command("list")
def claims_list(
    state: Annotated[
        ClaimStateChoice, typer.Option("--state", "-s", help="Claims in this state")
    ] = ClaimStateChoice.bound,
    limit: LimitOption = 1000,
    as_json: JsonOption = False,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Claims in a state (the open ones by default), oldest first."""
    with _server(url, token) as client:
        claims = client.claims(state=state.value, limit=limit)
    if as_json:
        _print_json({"claims": [dict(c.raw) for c in claims]})
        return
    _console().print(_claims_table(claims, f"{len(claims)} {state.value} claims"))


def _print_claim(info: ClaimInfo, as_json: bool) -> None:
    """One claim: the server's JSON, or its details as a table."""
    if as_json:
        _print_json(dict(info.raw))
    else:
        _console().print(_claim_details(info))


@claims_app.command("show")
def claims_show(
    claim_id: ClaimIdArgument,
    as_json: JsonOption = False,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """One claim."""
    with _server(url, token) as client:
        info = client.get_claim(claim_id)
    _print_claim(info, as_json)


@claims_app.command("renew")
def claims_renew(
    claim_id: ClaimIdArgument,
    lease: Annotated[
        float | None,
        typer.Option(
            "--lease", min=1, max=86400, help="Lease in seconds from now", show_default="its own"
        ),
    ] = None,
    as_json: JsonOption = False,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Extend a claim's lease from now."""
    with _server(url, token) as client:
        info = client.renew(claim_id, lease)
    _print_claim(info, as_json)


@workers_app.command("list")
def workers_list(
    pool: Annotated[str | None, typer.Option("--pool", "-p", help="Only this pool")] = None,
    state: Annotated[
        WorkerStateChoice | None,
        typer.Option("--state", "-s", help="Only this state", show_default="the live ones"),
    ] = None,
    org: Annotated[str | None, typer.Option("--org", "-o", help="Only this org")] = None,
    limit: LimitOption = 1000,
    as_json: JsonOption = False,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Workers, oldest first: the live ones, or those in `--state`."""
    with _server(url, token) as client:
        workers = client.workers(
            pool=pool, state=state.value if state else None, org=org, limit=limit
        )
    if as_json:
        _print_json({"workers": [dict(w.raw) for w in workers]})
        return
    table = Table(title=f"{len(workers)} workers", title_justify="left")
    for column in ("id", "pool", "state", "org", "claim", "revision", "created", "reason"):
        table.add_column(column, overflow="fold")
    for w in workers:
        table.add_row(
            w.id,
            w.pool,
            w.state,
            w.org or "-",
            w.claim_id or "-",
            w.revision,
            _when(w.created_at),
            escape(w.reason or "-"),
        )
    _console().print(table)


@app.command()
def pools(
    name: Annotated[
        str | None, typer.Argument(metavar="[NAME]", help="Only this pool", show_default=False)
    ] = None,
    as_json: JsonOption = False,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Pools with their settings, target, demand and workers by state."""
    with _server(url, token) as client:
        found = [client.pool(name)] if name is not None else client.pools()
    if as_json:
        if name is not None:
            _print_json(dict(found[0].raw))
        else:
            _print_json({"pools": [dict(p.raw) for p in found]})
        return
    table = Table(title=f"pools at {client.url}", title_justify="left")
    table.add_column("pool", overflow="fold")
    table.add_column("revision", overflow="fold")
    table.add_column("reuse")
    for column in ("target", "desired", "demand", "cap", "per org", "workers"):
        table.add_column(column, justify="right")
    for p in found:
        table.add_row(
            p.name,
            p.revision,
            p.reuse,
            str(p.warm_target),
            str(p.desired_warm),
            str(p.demand),
            str(p.cap) if p.cap else "-",
            str(p.max_workers_per_org) if p.max_workers_per_org else "-",
            str(sum(p.counts.values())),
        )
    _console().print(table)


def _status_tables(pools: Sequence[PoolInfo], width: int) -> list[Table]:
    """The pools as one table, or as two (targets; workers by state) when one would not
    fit in `width` columns: a header is never cut short."""
    targets = ("target", "desired", "demand", "cap")
    rows = [
        (
            p.name,
            str(p.warm_target),
            str(p.desired_warm),
            str(p.demand),
            str(p.cap) if p.cap else "-",
            *(str(p.counts.get(s, 0)) for s in STATES),
        )
        for p in pools
    ]
    headers = ("pool", *targets, *STATES)
    cells = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    # Each column: its cells, a space either side and a rule; the left edge.
    if sum(cells) + 3 * len(cells) + 1 <= width:
        return [_pool_table(None, headers, rows)]
    split = 1 + len(targets)
    compact = {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False}
    return [
        _pool_table(None, headers[:split], [r[:split] for r in rows], **compact),
        _pool_table(
            "workers by state",
            (headers[0], *headers[split:]),
            [(r[0], *r[split:]) for r in rows],
            **compact,
        ),
    ]


def _pool_table(
    title: str | None, headers: Sequence[str], rows: Sequence[Sequence[str]], **style: Any
) -> Table:
    table = Table(title=title, title_justify="left", **style)
    table.add_column(headers[0], overflow="fold")
    for name in headers[1:]:
        table.add_column(name, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


class _StatusView:
    """What `status` shows: the pools as last fetched, when, and the last error."""

    def __init__(self, client: Client, width: int) -> None:
        self.client = client
        self.width = width
        self.pools: list[PoolInfo] | None = None
        self.updated = "never"
        self.error: str | None = None

    def refresh(self) -> None:
        """Fetch the pools; on failure keep the last ones and remember the error."""
        try:
            self.pools = self.client.pools()
        except StokerError as exc:
            self.error = f"{time.strftime('%H:%M:%S')} {exc}"
            return
        self.updated = time.strftime("%H:%M:%S")
        self.error = None

    def render(self, interval: float) -> Group:
        """The tables, and the error line while the server does not answer."""
        headline = Text(f"stoker at {self.client.url} · updated {self.updated}", style="italic")
        parts: list[Any] = [headline, *_status_tables(self.pools or [], self.width)]
        if self.error is not None:
            parts.append(Text(f"{self.error} (retrying every {interval:g} s)", style="bold red"))
        return Group(*parts)


@app.command()
def status(
    watch: Annotated[
        bool,
        typer.Option("--watch", "-w", help="Refresh until Ctrl-C, riding out server errors"),
    ] = False,
    interval: Annotated[
        float, typer.Option("--interval", min=0.2, max=3600, help="Seconds between refreshes")
    ] = 2.0,
    as_json: JsonOption = False,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Pools with their target, demand and workers by state."""
    if as_json:
        if watch:
            _fail("--json and --watch do not go together", code=2)
        with _server(url, token) as client:
            found = client.pools()
        _print_json({"pools": [dict(p.raw) for p in found]})
        return
    console = _console(fit=True)
    if not watch:
        with _server(url, token) as client:
            view = _StatusView(client, console.width)
            view.pools = client.pools()
            view.updated = time.strftime("%H:%M:%S")
            console.print(view.render(interval))
        return
    # Watching: the next refresh is the retry, and the error is on screen meanwhile.
    with Client(url, token=token, retries=Retries(enabled=False)) as client:
        view = _StatusView(client, console.width)
        try:
            view.refresh()
            if console.is_terminal:
                _watch_live(view, console, interval)
            # Piped: a table (or an error line) per refresh, one after the other.
            while True:
                if view.error is not None:
                    print(f"stoker: {view.error} (retrying every {interval:g} s)", flush=True)
                else:
                    console.print(view.render(interval))
                    console.file.flush()
                time.sleep(interval)
                view.refresh()
        except KeyboardInterrupt:
            return


def _watch_live(view: _StatusView, console: Console, interval: float) -> NoReturn:
    """Redraw the tables in place until Ctrl-C."""
    with Live(view.render(interval), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(interval)
            view.refresh()
            view.width = console.width
            live.update(view.render(interval), refresh=True)


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
            help="Policies run at once, each in a process (0: all of them)",
        ),
    ] = 0,
) -> None:
    """Run the real control plane against a simulated cluster in virtual time.

    Writes summary.json, timeseries.csv, PNG plots and report.md into --out; exits 1
    when stoker's own policy breaks an invariant (the trace is printed).
    """
    # Imported here: the client commands need none of the simulator.
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
