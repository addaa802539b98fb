"""`workers list` (admin token)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from stoker.cli.output import LimitOption, make_console, print_json, server_command, when
from stoker.sdk import Client

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


@server_command(workers_app, "list")
def workers_list(
    pool: Annotated[str | None, typer.Option("--pool", "-p", help="Only this pool")] = None,
    state: Annotated[
        WorkerStateChoice | None,
        typer.Option("--state", "-s", help="Only this state", show_default="the live ones"),
    ] = None,
    org: Annotated[str | None, typer.Option("--org", "-o", help="Only this org")] = None,
    limit: LimitOption = 1000,
    *,
    client: Client,
    as_json: bool,
) -> None:
    """Workers, oldest first: the live ones, or those in `--state`."""
    workers = client.workers(pool=pool, state=state.value if state else None, org=org, limit=limit)
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
