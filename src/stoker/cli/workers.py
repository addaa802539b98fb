"""`workers list` (admin token)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from stoker.cli.output import (
    AfterOption,
    AllOption,
    LimitOption,
    print_listing,
    server_command,
    when,
)
from stoker.sdk import Client, Listing, WorkerFilters, WorkerInfo

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
    every: AllOption = False,
    after: AfterOption = None,
    *,
    client: Client,
    as_json: bool,
) -> None:
    """Workers, oldest first: the live ones, or those in `--state`; one page, or with
    `--all` every one. A full page's `next` (in `--json`) is the `--after` of the next."""
    state_ = state.value if state else None
    filters = WorkerFilters(pool=pool, state=state_, org=org, limit=limit, after=after)
    workers = Listing(client.iter_workers(**filters)) if every else client.workers(**filters)
    print_listing(
        "workers", workers, _WORKER_COLUMNS, _worker_row, as_json=as_json, more=workers.next
    )


_WORKER_COLUMNS = ("id", "pool", "state", "org", "claim", "revision", "created", "reason")


def _worker_row(w: WorkerInfo) -> tuple[str, ...]:
    return (
        w.id,
        w.pool,
        w.state,
        w.org or "-",
        w.claim_id or "-",
        w.revision,
        when(w.created_at),
        w.reason or "-",
    )
