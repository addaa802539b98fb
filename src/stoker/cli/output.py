"""What every client command shares: the server's options, the client, the console and
the one-line failure."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Annotated, Any, NoReturn, Protocol, TypeVar

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stoker.sdk import Client, Retries, StokerError

#: The server's URL and token: options of `stoker` itself (before the command, where the
#: environment is read), of a group (`stoker rollout --url ...`) and of each command that
#: talks to the server (after it); the one given nearest the command wins.
DEFAULT_URL = "http://127.0.0.1:8080"
UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        help="Server URL (before the command too; $STOKER_URL)",
        show_default=DEFAULT_URL,
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token", help="Bearer token (before the command too; $STOKER_TOKEN)", show_default=False
    ),
]
#: The `--url` and `--token` given before the command (`remember_server`): one command
#: runs per process, and `stoker` itself sets them afresh at each.
_given: dict[str, str] = {}
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print the server's JSON instead of a table")
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of text")]
LimitOption = Annotated[
    int, typer.Option("--limit", "-n", min=1, max=10000, help="At most this many rows")
]
AllOption = Annotated[
    bool, typer.Option("--all", help="Every row, fetched --limit at a time (page after page)")
]
AfterOption = Annotated[
    str | None,
    typer.Option(
        "--after",
        help="The rows after a previous page: its `next` (in --json, or its title)",
        show_default=False,
    ),
]


def fail(message: str, code: int = 1) -> NoReturn:
    """End the command with `message` as one line on stderr and exit status `code`."""
    print(f"stoker: {message}", file=sys.stderr)
    raise typer.Exit(code)


def remember_server(url: str | None, token: str | None, *, first: bool = False) -> None:
    """Keep the `--url` and `--token` given before a command (to `stoker`, `first`, or to
    a group) for the commands under it; given again nearer the command, that one wins."""
    if first:
        _given.clear()
    if url is not None:
        _given["url"] = url
    if token is not None:
        _given["token"] = token


def given_server(url: str | None, token: str | None) -> tuple[str | None, str | None]:
    """`url` and `token` as given to a command, else as given before it (to `stoker` or
    a group, or `$STOKER_URL` and `$STOKER_TOKEN`); None for what nothing gave."""
    return (
        url if url is not None else _given.get("url"),
        token if token is not None else _given.get("token"),
    )


def _server_url(url: str | None) -> str | None:
    """`url` checked: an http(s) URL with a host, or None for the default."""
    if not url:
        return None
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        fail(f"--url: {url!r} is not a URL ({exc})", code=2)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        fail(f"--url: {url!r} is not a server URL such as {DEFAULT_URL}", code=2)
    return url


def check_input(model: str, body: Mapping[str, Any]) -> None:
    """End the command (status 2) when `body` does not fit the server's `model` (the
    `SettingsChange` of `PATCH`, the `RolloutConfig` of a rollout's strategy), with the
    first problem in the words the server would answer: nothing is sent."""
    # Imported here: the server's models are for the commands that change a pool only.
    from pydantic import BaseModel, ValidationError

    from stoker.api.problems import each_problem, plain_message
    from stoker.config.changes import SettingsChange
    from stoker.config.pools import RolloutConfig

    # Each model, and where the server's request body holds it.
    models: dict[str, tuple[type[BaseModel], tuple[str, ...]]] = {
        "settings": (SettingsChange, ()),
        "strategy": (RolloutConfig, ("strategy",)),
    }
    checked, within = models[model]
    try:
        checked.model_validate(dict(body))
    except ValidationError as exc:
        error = each_problem(exc.errors(include_url=False))[0]
        at = ".".join(str(p) for p in (*within, *error["loc"]))
        fail(f"{at or model}: {plain_message(error)}", code=2)


def client_of(url: str | None, token: str | None) -> Client:
    """A client of the running server that sends each request once: a command says at
    once that the server does not answer (the SDK's retries, up to a claim's wait plus
    30 s, are for applications). `url` and `token` not given to the command are those
    given before it (`remember_server`)."""
    given, token = given_server(url, token)
    url = _server_url(given)
    try:
        return Client(url, token=token, retries=Retries(enabled=False))
    except (httpx.InvalidURL, ValueError) as exc:
        fail(f"--url: {url!r} is not a server URL ({exc})", code=2)


@contextlib.contextmanager
def server(url: str | None, token: str | None) -> Iterator[Client]:
    """A client of the running server; an SDK error ends the command as its one line."""
    with client_of(url, token) as client:
        try:
            yield client
        except StokerError as exc:
            fail(str(exc))


#: The options every command that talks to the server takes after its own, in this order.
_SERVER_OPTIONS = tuple(
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=option)
    for name, default, option in (
        ("as_json", False, JsonOption),
        ("url", None, UrlOption),
        ("token", None, TokenOption),
    )
)


def server_command(
    app: typer.Typer, name: str
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register the decorated function as the command `name` of `app`, on the server: the
    command takes its own options and then `--json`, `--url` and `--token`, and the function
    is called with its own and `client` (inside `server`) and `as_json`."""

    def register(command: Callable[..., None]) -> Callable[..., None]:
        own = inspect.signature(command, eval_str=True)
        params = [p for p in own.parameters.values() if p.name not in ("client", "as_json")]

        @functools.wraps(command)
        def run(
            *args: Any, as_json: bool, url: str | None, token: str | None, **kwargs: Any
        ) -> None:
            with server(url, token) as client:
                command(*args, client=client, as_json=as_json, **kwargs)

        # typer reads a command's options off its signature.
        signature = own.replace(parameters=[*params, *_SERVER_OPTIONS])
        run.__signature__ = signature  # type: ignore[attr-defined]
        app.command(name)(run)
        return command

    return register


#: The width of a console with no terminal: wider than any table, so each row is one line.
PIPED_WIDTH = 4096


def make_console(*, fit: bool = False) -> Console:
    """A console for tables; piped or captured there is no terminal width to fit, so the
    columns are never squeezed and each row is one line (for grep, awk and files) —
    unless `fit` (`status`, which splits its table to fit) and `$COLUMNS` gives a width."""
    found = Console()
    if found.is_terminal or (fit and os.environ.get("COLUMNS", "").isdigit()):
        return found
    return Console(width=PIPED_WIDTH)


def print_json(body: Any, *, indent: int | None = 2) -> None:
    """`body` as JSON on stdout, indented unless `indent` is None (one line)."""
    print(json.dumps(body, indent=indent, ensure_ascii=False), flush=True)


class _Answer(Protocol):
    @property
    def raw(self) -> Mapping[str, Any]: ...


A = TypeVar("A", bound=_Answer)


def print_listing(
    name: str,
    answers: Sequence[A],
    columns: Sequence[str],
    row: Callable[[A], Sequence[str]],
    *,
    as_json: bool,
    what: str | None = None,
    more: str | None = None,
) -> None:
    """A listing of `answers`: the server's JSON (`{name: [...], "next": more}`), or a table
    titled with their number and `what` they are (`name` by default) of `columns`, with the
    `row` of each answer, its long cells folded. `more` is the server's `next`, the cursor
    of the page after this one (None: the listing ended here, or every page was fetched);
    the table's title says how to ask for that page."""
    if as_json:
        print_json({name: [dict(a.raw) for a in answers], "next": more})
        return
    title = f"{len(answers)} {what or name}"
    if more is not None:
        title += f" (a full page: more may follow; --after={more} lists them, --all every one)"
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    for answer in answers:
        # A cell is text a client or a worker chose (an org `[/x]`, a reason): shown as it
        # is, never read as markup.
        table.add_row(*(escape(cell) for cell in row(answer)))
    make_console().print(table)


def when(value: datetime | None) -> str:
    """A timestamp as UTC, to the second; '-' for none."""
    return value.strftime("%Y-%m-%d %H:%M:%SZ") if value is not None else "-"
