"""The command-line reference is generated from the command definitions: every command
and option is on the page with its help, the page agrees with `--help`, and a command or
option without help is reported (the test below fails until it gets one)."""

from __future__ import annotations

from typing import Annotated

import typer
from typer.testing import CliRunner

from stoker.cli.app import app
from stoker.reference import commands


def test_every_command_and_option_has_help() -> None:
    assert commands.undocumented() == []


def test_a_command_or_option_without_help_is_reported() -> None:
    demo = typer.Typer(help="A demo.")

    @demo.command()
    def told(
        bare: Annotated[int, typer.Option()] = 1,
        helped: Annotated[int, typer.Option(help="Helped")] = 2,
    ) -> None:
        """Told."""

    @demo.command()
    def silent() -> None:
        pass

    assert commands.undocumented(demo) == ["stoker told --bare", "stoker silent"]


def test_the_page_lists_what_each_commands_help_shows() -> None:
    listed = commands.commands()
    paths = [c.path for c in listed]
    for expected in ("stoker serve", "stoker claim", "stoker pools set", "stoker rollout"):
        assert expected in paths, expected
    page = commands.markdown()
    runner = CliRunner()
    for command in listed:
        assert f"`{command.path}`" in page
        words = command.path.split()[1:]
        result = runner.invoke(app, [*words, "--help"], terminal_width=200)
        assert result.exit_code == 0, (command.path, result.output)
        for names, _, _, _ in command.params:
            first = names.split(", ")[0]
            if first.startswith("-"):
                assert first in result.output, (command.path, first)
