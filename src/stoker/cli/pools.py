"""`pools` and `status`: the pools as tables, `status` fitted to the terminal and
optionally refreshed in place; `pools show|set|drain|delete` change a stored pool (admin
token).

`stoker pools list` (or `stoker pools`) lists the pools; `stoker pools NAME` shows one: a
first argument that names no subcommand is a pool's name (`_PoolsGroup`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, NoReturn

import typer
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from stoker.cli.output import (
    JsonOption,
    TokenOption,
    UrlOption,
    check_input,
    client_of,
    fail,
    make_console,
    print_json,
    server,
    server_command,
)
from stoker.domain.comments import field_description
from stoker.domain.specs import PoolSpec
from stoker.sdk import Client, PoolChanges, PoolInfo, StokerError

#: Column order of the state counts in `stoker status`.
STATES = ("spawning", "warm", "reserved", "activating", "hot", "hot_idle", "draining")


class _PoolsGroup(typer.core.TyperGroup):
    """`pools NAME` shows the pool NAME: a first argument that is no subcommand is a name."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["show", *args]
        return super().resolve_command(ctx, args)


pools_app = typer.Typer(
    name="pools",
    cls=_PoolsGroup,
    invoke_without_command=True,
    help="Pools: list (also `stoker pools`), show, set, drain and delete "
    "(docs/guides/rollouts.md).",
)

NameArgument = Annotated[str, typer.Argument(help="The pool's name", show_default=False)]


@pools_app.callback()
def pools(
    ctx: typer.Context,
    as_json: JsonOption = False,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Pools with their settings, target, demand and workers by state."""
    if ctx.invoked_subcommand is None:
        with server(url, token) as client:
            _print_pools(client.url, client.pools(), as_json=as_json, one=False)


@server_command(pools_app, "list")
def pools_list(*, client: Client, as_json: bool) -> None:
    """Pools with their settings, target, demand and workers by state (`stoker pools`)."""
    _print_pools(client.url, client.pools(), as_json=as_json, one=False)


@server_command(pools_app, "show")
def pools_show(name: NameArgument, *, client: Client, as_json: bool) -> None:
    """One pool, with its stored generation, settings and revisions."""
    _print_pools(client.url, [client.pool(name)], as_json=as_json, one=True)


def _setting(name: str) -> Any:
    """The option of the pool setting `name`: its help is the setting's own doc comment."""
    about = field_description(PoolSpec, name)
    return typer.Option(min=0, show_default=False, help=about)


#: A count or a duration in seconds to set; left out, the setting keeps its value.
Count = int | None
Seconds = float | None


@server_command(pools_app, "set")
def pools_set(
    name: NameArgument,
    warm_target: Annotated[Count, _setting("warm_target")] = None,
    max_workers: Annotated[Count, _setting("max_workers")] = None,
    max_workers_per_org: Annotated[Count, _setting("max_workers_per_org")] = None,
    hot_idle_ttl: Annotated[Seconds, _setting("hot_idle_ttl")] = None,
    max_ttl: Annotated[Seconds, _setting("max_ttl")] = None,
    min_hot_idle: Annotated[Count, _setting("min_hot_idle")] = None,
    lease_s: Annotated[Seconds, _setting("lease_s")] = None,
    claim_timeout_s: Annotated[Seconds, _setting("claim_timeout_s")] = None,
    scale_down_delay: Annotated[Seconds, _setting("scale_down_delay")] = None,
    max_claim_s: Annotated[Seconds, _setting("max_claim_s")] = None,
    generation: Annotated[
        int | None,
        typer.Option(help="Change only if the pool is still at this generation", min=1),
    ] = None,
    *,
    client: Client,
    as_json: bool,
) -> None:
    """Change a pool's settings: in force on every replica within one janitor pass.

    Each option sets the pool's setting of its name (seconds; caps of 0: unbounded).
    """
    given = {
        "warm_target": warm_target,
        "max_workers": max_workers,
        "max_workers_per_org": max_workers_per_org,
        "hot_idle_ttl": hot_idle_ttl,
        "max_ttl": max_ttl,
        "min_hot_idle": min_hot_idle,
        "lease_s": lease_s,
        "claim_timeout_s": claim_timeout_s,
        "scale_down_delay": scale_down_delay,
        "max_claim_s": max_claim_s,
        "generation": generation,
    }
    changes: PoolChanges = {k: v for k, v in given.items() if v is not None}  # type: ignore[assignment]
    if set(changes) <= {"generation"}:
        fail("nothing to change: give at least one setting (see --help)", code=2)
    check_input("settings", changes)
    changed = client.update_pool(name, **changes)
    _print_pools(client.url, [changed], as_json=as_json, one=True)


@server_command(pools_app, "drain")
def pools_drain(
    name: NameArgument,
    undo: Annotated[
        bool, typer.Option("--undo", help="Hand out the pool's claims again (undrain)")
    ] = False,
    *,
    client: Client,
    as_json: bool,
) -> None:
    """Stop handing out a pool's new claims: sessions end as usual, warm workers retire."""
    changed = client.drain_pool(name, draining=not undo)
    _print_pools(client.url, [changed], as_json=as_json, one=True)


@server_command(pools_app, "delete")
def pools_delete(
    name: NameArgument,
    yes: Annotated[
        bool, typer.Option("--yes", help="Delete without asking (it cannot be undone)")
    ] = False,
    generation: Annotated[
        int | None,
        typer.Option(help="Delete only if the pool is still at this generation", min=1),
    ] = None,
    *,
    client: Client,
    as_json: bool,
) -> None:
    """Delete a drained pool gone from the config file, once its sessions have ended.

    Its revisions, rollouts, forecast and published sizing go; its ledger and claim log
    stay. Every replica stops serving it within one janitor pass.
    """
    if not yes:
        if not sys.stdin.isatty():
            fail(f"deleting pool {name!r} cannot be undone: add --yes to confirm", code=2)
        if not typer.confirm(f"Delete pool {name!r}? It cannot be undone"):
            fail("nothing deleted", code=1)
    deleted = client.delete_pool(name, generation=generation)
    if as_json:
        print_json(deleted.raw)
        return
    removed = ", ".join(f"{table}: {n}" for table, n in deleted.removed.items() if n)
    print(f"deleted pool {deleted.name} (generation {deleted.generation}): removed {removed}")


@server_command(pools_app, "ledger")
def pools_ledger(
    name: NameArgument,
    since: Annotated[
        str, typer.Option(help="From: a duration before now (24h, 7d) or unix seconds")
    ] = "24h",
    until: Annotated[
        str | None, typer.Option(help="Until (default: now)", show_default=False)
    ] = None,
    by: Annotated[
        str | None,
        typer.Option(help="One row per hour and org, or revision", show_default=False),
    ] = None,
    *,
    client: Client,
    as_json: bool,
) -> None:
    """What the pool's warmth cost and bought, per hour (docs/warmth.md)."""
    if by not in (None, "org", "revision"):
        fail("--by takes org or revision", code=2)
    body = client.pool_ledger(name, since=since, until=until, by=by)
    if as_json:
        print_json(body)
        return
    make_console().print(_ledger_table(body))


#: The ledger table's columns: header and how a row's value is shown.
_LEDGER_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("warm h", lambda r: _hours(r["warm_s"])),
    ("hot h", lambda r: _hours(r["hot_s"])),
    ("parked h", lambda r: _hours(r["hot_idle_s"])),
    ("starting h", lambda r: _hours(r["starting_s"])),
    ("draining h", lambda r: _hours(r.get("draining_s", 0.0))),
    ("headroom h", lambda r: _hours(r["placeholder_s"])),
    ("spawns", lambda r: str(r["spawns"])),
    ("ready s", lambda r: _num(r["mean_ready_s"])),
    ("reuse/warm/cold", lambda r: f"{r['claims_reuse']}/{r['claims_warm']}/{r['claims_cold']}"),
    ("failed", lambda r: str(r["failed"])),
    ("idle warm $", lambda r: _price(r["idle_warm_cost"])),
    ("parked $", lambda r: _price(r["idle_parked_cost"])),
    ("headroom $", lambda r: _price(r["headroom_cost"])),
    ("total $", lambda r: _price(r["total_cost"])),
    ("cold s avoided", lambda r: _num(r["cold_start_s_avoided"])),
)


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _price(value: float | None) -> str:
    # Cents of an hour of a few workers are still worth showing.
    return "-" if value is None else f"{value:.2f}" if abs(value) >= 10 else f"{value:.4f}"


def _ledger_table(body: dict[str, Any]) -> Table:
    """The ledger's rows (hour, group) and its total as a table."""
    table = Table(title=f"ledger of pool {escape(body['pool'])}", title_justify="left")
    table.add_column("hour (UTC)")
    if body.get("by"):
        table.add_column(str(body["by"]), overflow="fold")
    for header, _ in _LEDGER_COLUMNS:
        table.add_column(header, justify="right")

    def add(label: str, row: dict[str, Any]) -> None:
        # An org is any text a client sent (`[/x]`): shown as it is, never as markup.
        group = [escape(row["group"]) or "-"] if body.get("by") else []
        table.add_row(label, *group, *(show(row) for _, show in _LEDGER_COLUMNS))

    for row in body["rows"]:
        add(datetime.fromtimestamp(row["hour"], UTC).strftime("%Y-%m-%d %H:00"), row)
    add("total", {**body["total"], "group": ""})
    return table


def _print_pools(url: str, found: Sequence[PoolInfo], *, as_json: bool, one: bool) -> None:
    if as_json:
        if one:
            print_json(dict(found[0].raw))
        else:
            print_json({"pools": [dict(p.raw) for p in found]})
        return
    table = Table(title=f"pools at {url}", title_justify="left")
    table.add_column("pool", overflow="fold")
    table.add_column("revision", overflow="fold")
    table.add_column("reuse")
    for column in ("target", "desired", "demand", "cap", "per org", "workers"):
        table.add_column(column, justify="right")
    for p in found:
        table.add_row(
            p.name + (" (draining)" if p.draining else ""),
            p.revision,
            p.reuse,
            str(p.warm_target),
            str(p.desired_warm),
            str(p.demand),
            str(p.cap) if p.cap else "-",
            str(p.max_workers_per_org) if p.max_workers_per_org else "-",
            str(sum(p.counts.values())),
        )
    console = make_console()
    console.print(table)
    for line in _spawn_trouble(found):
        console.print(line)
    if one and found[0].revisions:
        console.print(_revisions_table(found[0]))


def _spawn_trouble(pools: Sequence[PoolInfo]) -> list[Text]:
    """A line for each pool whose spawns fail (how many since they last worked, and how
    the last did), and for each whose sizing is stale (no replica sizes it: its desired
    and demand are the last ones published)."""
    lines = []
    for p in pools:
        if p.spawn_failing:
            lines.append(
                Text(
                    f"pool {p.name}: spawns failing ({p.spawn_failures} since they last "
                    f"worked); last error: {p.last_spawn_error or '-'}",
                    style="yellow",
                )
            )
        if p.sizing_stale:
            age = f"{p.sizing_age_s:.0f} s" if p.sizing_age_s is not None else "a while"
            lines.append(
                Text(
                    f"pool {p.name}: no replica has sized it for {age} (none leads?); "
                    "desired and demand are the last figures published",
                    style="yellow",
                )
            )
    return lines


def _revisions_table(pool: PoolInfo) -> Table:
    table = Table(title=f"revisions (generation {pool.generation})", title_justify="left")
    table.add_column("revision", overflow="fold")
    table.add_column("state")
    table.add_column("share", justify="right")
    table.add_column("workers", justify="right")
    for r in pool.revisions:
        table.add_row(
            str(r["revision"]), str(r["state"]), f"{r['share']} %", str(sum(r["counts"].values()))
        )
    return table


def _status_tables(pools: Sequence[PoolInfo], width: int) -> list[Table]:
    """The pools as one table, or as two (targets; workers by state) when one would not
    fit in `width` columns, and more, each led by the pool, when those would not either: a
    header is never cut short and no row loses its pool."""
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
    tables = []
    for title, columns in (
        (None, range(1, split)),
        ("workers by state", range(split, len(headers))),
    ):
        # Each table led by the pool, in as many tables as the width needs (a compact
        # table's columns are a space either side and a rule apart).
        groups: list[list[int]] = [[]]
        for i in columns:
            group = groups[-1]
            if group and sum(cells[j] for j in (0, *group, i)) + 3 * (len(group) + 1) > width:
                groups.append(group := [])
            group.append(i)
        for n, group in enumerate(groups):
            tables.append(
                _pool_table(
                    title if n == 0 else None,
                    (headers[0], *(headers[i] for i in group)),
                    [(r[0], *(r[i] for i in group)) for r in rows],
                    **compact,
                )
            )
    return tables


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
        pools = self.pools or []
        parts: list[Any] = [headline, *_status_tables(pools, self.width), *_spawn_trouble(pools)]
        if self.error is not None:
            parts.append(Text(f"{self.error} (retrying every {interval:g} s)", style="bold red"))
        return Group(*parts)


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
            fail("--json and --watch do not go together", code=2)
        with server(url, token) as client:
            found = client.pools()
        print_json({"pools": [dict(p.raw) for p in found]})
        return
    console = make_console(fit=True)
    if not watch:
        with server(url, token) as client:
            view = _StatusView(client, console.width)
            view.pools = client.pools()
            view.updated = time.strftime("%H:%M:%S")
            console.print(view.render(interval))
        return
    # Watching: the next refresh is the retry, and the error is on screen meanwhile.
    with client_of(url, token) as client:
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
