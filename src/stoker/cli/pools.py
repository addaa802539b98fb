"""`pools` and `status`: the pools as tables, `status` fitted to the terminal and
optionally refreshed in place."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated, Any, NoReturn

import typer
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from stoker.cli.output import (
    JsonOption,
    TokenOption,
    UrlOption,
    client_of,
    fail,
    make_console,
    print_json,
    server,
)
from stoker.sdk import Client, PoolInfo, StokerError

#: Column order of the state counts in `stoker status`.
STATES = ("spawning", "warm", "reserved", "activating", "hot", "hot_idle", "draining")


def pools(
    name: Annotated[
        str | None, typer.Argument(metavar="[NAME]", help="Only this pool", show_default=False)
    ] = None,
    as_json: JsonOption = False,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Pools with their settings, target, demand and workers by state."""
    with server(url, token) as client:
        found = [client.pool(name)] if name is not None else client.pools()
    if as_json:
        if name is not None:
            print_json(dict(found[0].raw))
        else:
            print_json({"pools": [dict(p.raw) for p in found]})
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
    make_console().print(table)


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
