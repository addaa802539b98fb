"""Claims: `claim` and `release` (the client's own), and `claims list|show|renew`
(admin token)."""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from stoker.cli.output import (
    AfterOption,
    AllOption,
    LimitOption,
    TokenOption,
    UrlOption,
    fail,
    make_console,
    print_json,
    print_listing,
    server,
    server_command,
    when,
)
from stoker.sdk import ClaimFilters, ClaimInfo, Client, Listing

#: Claim log entries per request of an export: the API's largest page (a million claims
#: in 12 s against 48 s by pages of 1,000).
LOG_PAGE = 10_000

claims_app = typer.Typer(
    name="claims", help="Claims on the server (admin token).", no_args_is_help=True
)


class Mode(StrEnum):
    """Claim modes of `POST /v1/claims` (docs/concepts/claims.md)."""

    prefer_warm = "prefer_warm"
    require_warm = "require_warm"
    cold = "cold"


def _parse_settings(items: Sequence[str]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            fail(f"--set expects KEY=VALUE, got {item!r}", code=2)
        try:
            # Numbers, booleans, null and JSON objects keep their type; the rest is text.
            config[key] = json.loads(raw)
        except ValueError:
            config[key] = raw
    return config


def _lease_option(help_text: str, shown: str) -> Any:
    """`--lease-s`: seconds, within what the server takes (a second to a day)."""
    return typer.Option("--lease-s", min=1, max=86400, help=help_text, show_default=shown)


#: `--lease`, the name `--lease-s` had before 0.2 (hidden; said to be deprecated).
OldLease = Annotated[float | None, typer.Option("--lease", min=1, max=86400, hidden=True)]


def renamed(new: float | None, old: float | None, old_name: str, new_name: str) -> float | None:
    """The value of an option given under its new name, or (with a note on stderr that
    the name is deprecated) under its old one."""
    if old is None:
        return new
    print(f"stoker: {old_name} is deprecated; use {new_name}", file=sys.stderr)
    return new if new is not None else old


def claim(
    pool: Annotated[str, typer.Option("--pool", "-p", help="Pool to claim from")],
    org: Annotated[str, typer.Option("--org", "-o", help="Org the session belongs to")],
    mode: Annotated[
        Mode | None,
        typer.Option(
            "--mode", "-m", help="How the claim may be served", show_default="prefer_warm"
        ),
    ] = None,
    timeout_s: Annotated[
        float | None,
        typer.Option(
            "--timeout-s",
            "-t",
            min=0,
            max=3600,
            help="Seconds to wait for a worker",
            show_default="the pool's claim_timeout_s",
        ),
    ] = None,
    lease_s: Annotated[
        float | None, _lease_option("Lease length in seconds", "the pool's lease_s")
    ] = None,
    ttl_s: Annotated[
        float | None,
        typer.Option(
            "--ttl-s",
            min=0,
            max=86400,
            help="Seconds the worker stays parked for the org after release",
            show_default="the org's or pool's hot_idle_ttl",
        ),
    ] = None,
    settings: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="KEY=VALUE handed to the worker at activation (repeatable; the claim's config)",
            show_default=False,
        ),
    ] = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (the output anyway)")] = False,
    old_timeout: Annotated[
        float | None, typer.Option("--timeout", min=0, max=3600, hidden=True)
    ] = None,
    old_lease: OldLease = None,
) -> None:
    """Claim a worker and print the claim as JSON (release it with `stoker release ID`)."""
    config = _parse_settings(settings or [])
    timeout_s = renamed(timeout_s, old_timeout, "--timeout", "--timeout-s")
    lease_s = renamed(lease_s, old_lease, "--lease", "--lease-s")
    with server(url, token) as client:
        info = client.create_claim(
            pool,
            org,
            mode=mode.value if mode is not None else None,
            timeout_s=timeout_s,
            lease_s=lease_s,
            ttl_s=ttl_s,
            config=config,
        )
    print_json(dict(info.raw))


def release(
    claim_id: Annotated[str, typer.Argument(metavar="ID", help="Claim id")],
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (the output anyway)")] = False,
) -> None:
    """Release a claim and print it as JSON: the worker parks for its org or retires."""
    with server(url, token) as client:
        info = client.release(claim_id)
    print_json(dict(info.raw))


class ClaimStateChoice(StrEnum):
    """Claim states `GET /v1/claims` lists by."""

    bound = "bound"
    released = "released"
    expired = "expired"
    failed = "failed"


ClaimIdArgument = Annotated[str, typer.Argument(metavar="ID", help="Claim id")]


_CLAIM_COLUMNS = ("id", "pool", "org", "state", "source", "worker", "created", "expires")


def _claim_row(c: ClaimInfo) -> tuple[str, ...]:
    expires = when(c.expires_at) if c.bound else "-"
    return (c.id, c.pool, c.org, c.state, c.source, c.worker.id, when(c.created_at), expires)


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
        "created": when(c.created_at),
        "expires": when(c.expires_at),
        "ended": when(c.ended_at),
        "reason": c.reason or "-",
        "ttl_s": "-" if c.ttl_s is None else f"{c.ttl_s:g}",
    }
    for name, value in rows.items():
        table.add_row(name, escape(value))
    return table


@server_command(claims_app, "list")
def claims_list(
    state: Annotated[
        ClaimStateChoice, typer.Option("--state", "-s", help="Claims in this state")
    ] = ClaimStateChoice.bound,
    limit: LimitOption = 1000,
    every: AllOption = False,
    after: AfterOption = None,
    *,
    client: Client,
    as_json: bool,
) -> None:
    """Claims in a state (the open ones by default), oldest first: one page, or with
    `--all` every one. A full page's `next` (in `--json`) is the `--after` of the next."""
    filters = ClaimFilters(state=state.value, limit=limit, after=after)
    claims = Listing(client.iter_claims(**filters)) if every else client.claims(**filters)
    what = f"{state.value} claims"
    print_listing(
        "claims", claims, _CLAIM_COLUMNS, _claim_row, as_json=as_json, what=what, more=claims.next
    )


def _print_claim(info: ClaimInfo, as_json: bool) -> None:
    """One claim: the server's JSON, or its details as a table."""
    if as_json:
        print_json(dict(info.raw))
    else:
        make_console().print(_claim_details(info))


@server_command(claims_app, "show")
def claims_show(claim_id: ClaimIdArgument, *, client: Client, as_json: bool) -> None:
    """One claim."""
    _print_claim(client.get_claim(claim_id), as_json)


@server_command(claims_app, "renew")
def claims_renew(
    claim_id: ClaimIdArgument,
    lease_s: Annotated[float | None, _lease_option("Lease in seconds from now", "its own")] = None,
    old_lease: OldLease = None,
    *,
    client: Client,
    as_json: bool,
) -> None:
    """Extend a claim's lease from now."""
    lease_s = renamed(lease_s, old_lease, "--lease", "--lease-s")
    _print_claim(client.renew(claim_id, lease_s), as_json)


@server_command(claims_app, "export")
def claims_export(
    since: Annotated[
        str, typer.Option(help="From: a duration before now (7d, 24h) or unix seconds")
    ] = "7d",
    until: Annotated[
        str | None, typer.Option(help="Until (default: now)", show_default=False)
    ] = None,
    pool: Annotated[
        str | None, typer.Option(help="Only this pool's claims", show_default=False)
    ] = None,
    out: Annotated[
        str | None,
        typer.Option(
            "--out", "-o", help="Write to this file (default: stdout)", show_default=False
        ),
    ] = None,
    *,
    client: Client,
    as_json: bool,
) -> None:
    """The claim log as JSON lines, by arrival (docs/claim-log.md): what a backtest replays.
    Its output is JSON lines with or without `--json`."""
    entries: Iterator[dict[str, Any]] = iter(
        client.iter_claim_log(since=since, until=until, pool=pool, page_size=LOG_PAGE)
    )
    first = next(entries, None)
    if first is None and pool is not None:
        # Nothing of that name: a pool that is not there (a typo) is a 404, before an
        # empty export replaces a file. A deleted pool's claims still export.
        client.pool(pool)
    if first is not None:
        entries = itertools.chain([first], entries)
    if out is None:
        for entry in entries:
            print(json.dumps(entry, separators=(",", ":")))
        return
    # Through a symlink (`claims-latest.jsonl`) to the file it names, as `open` writes.
    target = Path(os.path.realpath(out))
    if target.exists() and not target.is_file():
        # A device or a pipe (`/dev/stdout`, a FIFO): written as it is.
        count = _write_log(entries, target, out)
    else:
        count = _replace_with_log(entries, target, out)
    print(f"wrote {count} claims to {out}", file=sys.stderr)


def _write_log(entries: Iterable[dict[str, Any]], path: Path, out: str) -> int:
    """Write `entries` as JSON lines to `path`; the count written."""
    count = 0
    try:
        with path.open("w", encoding="utf-8") as file:
            for entry in entries:
                file.write(json.dumps(entry, separators=(",", ":")) + "\n")
                count += 1
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}")
    return count


def _replace_with_log(entries: Iterable[dict[str, Any]], target: Path, out: str) -> int:
    """Write `entries` into a file beside `target`, renamed over it once the whole log is
    in: a refused window or a failure part-way leaves an earlier export as it was."""
    try:
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}")
    os.close(fd)
    partial = Path(name)
    try:
        count = _write_log(entries, partial, out)
        # mkstemp's file is private (0600); the export gets the mode `open` would give.
        partial.chmod(0o666 & ~_umask())
        partial.replace(target)
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}")
    finally:
        partial.unlink(missing_ok=True)
    return count


def _umask() -> int:
    """The process's umask (read by setting it and back): the mode `open` would give."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
