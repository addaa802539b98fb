"""The `stoker` command: its table of commands and groups, its own options, `version`,
and the entry point that turns every failure into one line and an exit status.

A command lives in the module of its job (`claims`, `pools`, `serve`...) as a plain
function, a group as a `typer.Typer` of its own; both are registered here, in the order
`stoker --help` lists them."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import Annotated, NoReturn

import typer

from stoker._version import __version__
from stoker.cli.backtest import backtest
from stoker.cli.claims import claim, claims_app, release
from stoker.cli.config import config_app
from stoker.cli.output import DEFAULT_URL, JsonFlag, print_json, remember_server
from stoker.cli.pools import pools_app, status
from stoker.cli.rollouts import rollout_app
from stoker.cli.scaletest import scaletest
from stoker.cli.serve import serve
from stoker.cli.worker_check import worker_check
from stoker.cli.workers import workers_app

HELP = "Keep a fleet of workers warm; claim them over HTTP."
app = typer.Typer(
    name="stoker",
    help=HELP,
    add_completion=True,
    invoke_without_command=True,
    pretty_exceptions_enable=False,
    context_settings={"show_default": True},
)


@app.callback()
def _root(
    ctx: typer.Context,
    url: Annotated[
        str | None,
        typer.Option(
            "--url",
            envvar="STOKER_URL",
            help="Server URL, for the commands that talk to one",
            show_default=DEFAULT_URL,
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token", envvar="STOKER_TOKEN", help="Bearer token for the server", show_default=False
        ),
    ] = None,
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit", is_eager=True)
    ] = False,
) -> None:
    remember_server(url, token, first=True)
    if version:
        print(f"stoker {__version__}")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        # Bare `stoker`: the help, on stdout, and success.
        print(ctx.get_help())
        raise typer.Exit(0)


def version(as_json: JsonFlag = False) -> None:
    """Print the version."""
    if as_json:
        print_json({"version": __version__})
    else:
        print(f"stoker {__version__}")


app.command()(serve)
app.command()(claim)
app.command()(release)
app.command()(status)
app.command()(scaletest)
app.command()(backtest)
app.command("worker-check", context_settings={"allow_interspersed_args": False})(worker_check)
app.command()(version)
app.add_typer(claims_app)
app.add_typer(pools_app)
app.add_typer(rollout_app)
app.add_typer(workers_app)
app.add_typer(config_app)


def _paragraphs_on_one_line(typer_app: typer.Typer) -> None:
    """Each command's help is its docstring with every paragraph on one line, so that the
    terminal wraps it once: the help keeps a docstring's line breaks after its first
    paragraph, and a terminal narrower than them (80 columns) broke each line twice."""
    for info in typer_app.registered_commands:
        doc = inspect.getdoc(info.callback) if info.callback is not None else None
        if info.help is None and doc:
            info.help = "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n"))
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _paragraphs_on_one_line(group.typer_instance)


_paragraphs_on_one_line(app)


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
            # The option parser's validation words are not the user's concern.
            message = message.replace("Value error, ", "")
            print(f"stoker: {message}{hint}", file=sys.stderr)
        sys.exit(code)
    except Exception as exc:
        # A defect, not the user's: still one line (the tests drive every command with
        # generated arguments and fail on this line).
        print(f"stoker: unexpected error: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
    sys.exit(result if isinstance(result, int) else 0)
