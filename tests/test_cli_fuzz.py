"""Every command of `stoker`, driven with generated bad arguments: whatever the input, the
command ends with a status and lines of its own (`stoker: ...`, `config error: ...`,
`connect error: ...` or the usage), never a traceback and never an unexpected error.

The commands run in this process (`stoker.cli.main`), against a server address where
nothing listens, so that each input takes milliseconds. Inputs that would make a command
run on (`serve` with a config that loads, `status --watch`) are kept out: their length
is the point of those commands, not a failure.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.cli import main
from stoker.cli.app import app

#: Nothing listens there: a client command fails at once, as with a server that is down.
NOWHERE = "http://127.0.0.1:9"
#: Options that make a command run until interrupted.
RUNS_ON = {"--watch", "-w"}
#: Values that broke commands before, or could: bad URLs, unbalanced quotes, odd numbers.
BAD_VALUES = [
    "http://[::1",
    "http://[::1]:99999",
    "ftp://example.invalid",
    "x y",
    "http://",
    "http://127.0.0.1:99999",
    "'unbalanced",
    '"also unbalanced',
    "",
    " ",
    "=",
    "k=",
    "=v",
    "a=b=c",
    "--",
    "-",
    "0",
    "-1",
    "nan",
    "inf",
    "1e309",
    "99999999999999999999",
    "0.0001",
    "ünïcödé",
    "\x00",
    "x" * 300,
    "../../etc/passwd",
    "/",
    "10,50,abc",
    "{port}",
    "$(true)",
    NOWHERE,
]
UNKNOWN_OPTIONS = ["--frobnicate", "-z", "--url=", "--lease", "--json=yes", "--no-such-flag"]


def _leaves(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for name, command in getattr(group, "commands", {}).items():
        if getattr(command, "commands", None):
            # A group alone, and each of its commands.
            yield (*path, name), command
            yield from _leaves(command, (*path, name))
        else:
            yield (*path, name), command


COMMANDS = [((), typer.main.get_command(app)), *_leaves(typer.main.get_command(app))]


def _options(command: Any) -> list[str]:
    names = [opt for p in command.params for opt in getattr(p, "opts", ()) if opt.startswith("-")]
    return [n for n in names if n not in RUNS_ON]


values = st.one_of(
    st.sampled_from(BAD_VALUES),
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12).filter(
        lambda v: v.strip() not in RUNS_ON
    ),
)


@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    """A command's path and generated arguments: its own options with bad values, unknown
    options, stray words; and maybe server options before the command."""
    path, command = draw(st.sampled_from(COMMANDS))
    options = _options(command)
    # Mostly as many words as the command takes arguments (a pool, an id...), sometimes not.
    arguments = sum(1 for p in command.params if not getattr(p, "opts", [""])[0].startswith("-"))
    takes = draw(st.sampled_from([arguments, arguments, arguments, 0, arguments + 1]))
    words: list[str] = [draw(values) for _ in range(takes)]
    # Mostly the options the command requires, so that it gets past the parser.
    for param in command.params:
        required = getattr(param, "required", False) and param.opts[0].startswith("-")
        if required and draw(st.integers(0, 3)):
            words += [param.opts[0], draw(values)]
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["own", "own", "own", "unknown", "word"]))
        if kind == "own" and options:
            words.append(draw(st.sampled_from(options)))
            if draw(st.booleans()):
                words.append(draw(values))
        elif kind == "unknown":
            words.append(draw(st.sampled_from(UNKNOWN_OPTIONS)))
        else:
            words.append(draw(values))
    before: list[str] = []
    if draw(st.booleans()):
        before = [draw(st.sampled_from(["--url", "--token"])), draw(values)]
    line = [*before, *path, *words]
    if path[:1] == ("serve",):
        # A config that loads would serve until stopped: this one never loads.
        line += ["--config", "/nonexistent/stoker.yaml"]
    return line


def run_in_process(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    # HOME in the test's folder: `--install-completion` writes a shell's start-up files.
    env = {"STOKER_URL": NOWHERE, "STOKER_TOKEN": "", "COLUMNS": "100", "HOME": str(cwd)}
    with (
        mock.patch.dict(os.environ, env),
        contextlib.chdir(cwd),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        pytest.raises(SystemExit) as ended,
    ):
        main(argv)
    code = ended.value.code
    return (code if isinstance(code, int) else 1), out.getvalue(), err.getvalue()


def assert_clean(argv: list[str], code: int, out: str, err: str) -> None:
    assert "Traceback" not in out + err, (argv, err)
    assert "unexpected error" not in err, (argv, err)
    if code == 0:
        return
    assert code in (1, 2), (argv, code, err)
    lines = err.strip().splitlines()
    assert lines, (argv, code)
    # The usage (a group without its command), or lines of stoker's own.
    if not lines[0].startswith("Usage:"):
        own = ("stoker: ", "config error: ", "connect error: ")
        assert all(line.startswith(own) for line in lines), (argv, err)


@settings(
    max_examples=int(os.environ.get("STOKER_CLI_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(argv=command_lines())
def test_no_input_makes_a_command_fail_with_a_traceback(argv: list[str], tmp_path: Path) -> None:
    code, out, err = run_in_process(argv, tmp_path)
    assert_clean(argv, code, out, err)


def test_every_command_is_driven() -> None:
    # Each leaf command of the table is among the ones the generator picks from.
    paths = {path for path, _ in COMMANDS}
    for expected in (
        ("claim",),
        ("claims", "renew"),
        ("pools", "list"),
        ("pools", "set"),
        ("pools", "delete"),
        ("rollout", "start"),
        ("config", "check"),
        ("scaletest",),
        ("worker-check",),
        ("serve",),
        ("version",),
    ):
        assert expected in paths


@pytest.mark.parametrize(
    "argv",
    [
        ["claim", "--url", "http://[::1", "-p", "demo", "-o", "acme"],
        ["rollout", "start", "demo", "--command", "'unbalanced"],
        ["--url", "http://[::1]:99999", "pools", "list"],
        ["claims", "renew", "c-1", "--lease-s", "nan"],
        ["pools", "set", "demo", "--warm-target", "99999999999999999999"],
        ["pools", "delete", "demo"],
        ["backtest", "--from", "-"],
        # A control character in a path split the message over two lines.
        ["config", "check", "--config", "\x1e"],
        ["backtest", "--from", "\x1e"],
        ["pools", "delete", "demo", "--yes", "--generation", "0"],
    ],
)
def test_known_bad_inputs_are_clean(argv: list[str], tmp_path: Path) -> None:
    code, out, err = run_in_process(argv, tmp_path)
    assert code != 0
    assert_clean(argv, code, out, err)
