"""`workers list` (admin token)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from stoker.cli.output import (
    JsonOption,
    LimitOption,
    TokenOption,
    UrlOption,
    make_console,
    print_json,
    server,
    when,
)

workers_app = typer.Typer(
    name="workers", help="Workers on the server (admin token).", no_args_is_help=True
)


class WorkerStateChoice(StrEnum):
    """Worker states `GET /v1/workers` lists by (docs/architecture.md, "The lifecycle of a
    worker")."""

    spawning = "spawning"
    warm = "warm"
    reserved = "reserved"
    activating = "activating"
    hot = "hot"
    hot_idle = "hot_idle"
    draining = "draining"
    retired = "retired"


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
    with server(url, token) as client:
        workers = client.workers(
            pool=pool, state=state.value if state else None, org=org, limit=limit
        )
    if as_json:
        print_json({"workers": [dict(w.raw) for w in workers]})
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
            when(w.created_at),
            escape(w.reason or "-"),
        )
    make_console().print(table)
