"""The command-line reference: every command of `stoker` and its arguments and options,
from the command definitions (the commands typer builds from `stoker.cli.app`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import typer.main
from typer.core import TyperArgument, TyperGroup, TyperOption

from stoker.cli.app import app


@dataclass(frozen=True)
class Command:
    """One command of the command line, and its parameters."""

    #: The words that run it: `stoker pools set`.
    path: str
    help: str
    #: (declaration, type, default, help) of each argument and option.
    params: list[tuple[str, str, str, str]]
    #: Whether it groups other commands.
    is_group: bool


Parameter = TyperOption | TyperArgument


def _type(param: Parameter) -> str:
    if isinstance(param, TyperOption) and param.is_flag:
        return "flag"
    described = param.type_descriptor
    if described.is_choice:
        return "one of " + ", ".join(f"`{c}`" for c in described.choices or ())
    text = param.bare_type()
    names = {"str": "text", "int": "integer", "float": "number", "Path": "path"}
    if text.startswith("list[") and text.endswith("]"):
        inner = text[len("list[") : -1]
        return f"{names.get(inner, inner)}, repeatable"
    return names.get(text, text)


def _param(param: Parameter) -> tuple[str, str, str, str]:
    if isinstance(param, TyperOption):
        names = ", ".join([*param.opts, *param.secondary_opts])
    else:
        names = (param.name or "").upper()
    kind = _type(param)
    if param.required:
        default = "required"
    elif isinstance(param, TyperOption) and param.is_flag and not param.default:
        default = "off"
    elif param.default is None or param.default == () or callable(param.default):
        default = "-"
    else:
        default = f"`{param.default}`"
    about = getattr(param, "help", None) or ""
    return names, kind, default, about


def _walk(command: typer.core.TyperCommand | TyperGroup, path: str) -> Iterator[Command]:
    params = [
        _param(p)
        for p in command.params
        if isinstance(p, TyperOption | TyperArgument) and not p.hidden and p.name not in _BUILT_IN
    ]
    group = isinstance(command, TyperGroup)
    yield Command(path, (command.help or "").strip(), params, group)
    if isinstance(command, TyperGroup):
        for name, sub in command.commands.items():
            if isinstance(sub, typer.core.TyperCommand | TyperGroup) and not sub.hidden:
                yield from _walk(sub, f"{path} {name}")


#: Options click or typer add to every command by themselves.
_BUILT_IN = {"help", "install_completion", "show_completion"}


def commands(root_app: typer.Typer = app) -> list[Command]:
    """Every visible command of `root_app`, the root first, groups before their commands."""
    root = typer.main.get_command(root_app)
    assert isinstance(root, TyperGroup)
    return list(_walk(root, "stoker"))


def undocumented(root_app: typer.Typer = app) -> list[str]:
    """Commands and parameters without help (a test fails while there is one)."""
    missing = []
    for command in commands(root_app):
        if not command.help:
            missing.append(command.path)
        missing += [f"{command.path} {names}" for names, _, _, about in command.params if not about]
    return missing


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown() -> str:
    """The command-line reference page."""
    lines = [
        "# Command-line reference",
        "",
        "<!-- Generated from the command definitions (stoker.reference.commands) at every "
        "build of the site; edit the commands' help, not this page. -->",
        "",
        "Every command of `stoker`, with its arguments and options. `stoker COMMAND --help` "
        "prints the same. A failure prints one line and exits non-zero.",
        "",
    ]
    for command in commands():
        depth = min(command.path.count(" ") + 1, 3) + 1
        lines += [f"{'#' * depth} `{command.path}`", "", command.help or "", ""]
        if command.params:
            lines += ["| argument or option | type | default | help |", "|---|---|---|---|"]
            for names, kind, default, about in command.params:
                lines.append(
                    f"| `{_cell(names)}` | {_cell(kind)} | {_cell(default)} | {_cell(about)} |"
                )
            lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"
