"""`rollout start|status|pause|resume|abort|promote`: roll a pool's new revision out and
follow it (admin token; docs/guides/rollouts.md)."""

from __future__ import annotations

import shlex
import sys
import time
from typing import Annotated, Any

import typer

from stoker.cli.output import (
    JsonFlag,
    TokenOption,
    UrlOption,
    check_input,
    fail,
    print_json,
    remember_server,
    server,
)
from stoker.sdk import Client, RolloutInfo

rollout_app = typer.Typer(
    name="rollout",
    no_args_is_help=True,
    help="Roll a pool's new revision out: start, status, pause, resume, abort, promote "
    "(docs/guides/rollouts.md).",
)


@rollout_app.callback()
def rollout(url: UrlOption = None, token: TokenOption = None) -> None:
    """The server every rollout command talks to (--url, --token before or after the
    command)."""
    remember_server(url, token)


PoolArgument = Annotated[str, typer.Argument(help="The pool's name", show_default=False)]
IdArgument = Annotated[str, typer.Argument(help="The rollout's id", show_default=False)]
WatchOption = Annotated[
    bool, typer.Option("--watch", "-w", help="Follow the rollout until it ends (or Ctrl-C)")
]
IntervalOption = Annotated[
    float, typer.Option("--interval", min=0.2, max=3600, help="Seconds between looks")
]


def describe(r: RolloutInfo) -> str:
    """One line about a rollout."""
    steps = r.strategy.get("steps")
    where = f"step {r.step + 1} of {len(steps)}, " if steps and not r.ended else ""
    if steps and not r.ended and r.share == 0:
        # A canary's first step takes effect once the new revision holds its workers.
        where = f"preparing step 1 ({steps[0]} %), "
    reason = f" ({r.reason})" if r.reason else ""
    return (
        f"rollout {r.id}: {r.state}{reason}, {where}{r.share} % of new claims to "
        f"{r.revision} (from {r.base_revision})"
    )


def _show(r: RolloutInfo, as_json: bool) -> None:
    if as_json:
        print_json(dict(r.raw))
    else:
        print(describe(r), flush=True)


def _follow(client: Client, pool: str, first: RolloutInfo, interval: float) -> None:
    """Print the rollout each time it changes, until it ends; Ctrl-C stops quietly."""
    last = describe(first)
    current = first
    try:
        while not current.ended:
            time.sleep(interval)
            current = client.rollout(pool, current.id)
            line = describe(current)
            if line != last:
                print(line, flush=True)
                last = line
    except KeyboardInterrupt:
        return


@rollout_app.command("start")
def start(
    pool: PoolArgument,
    command: Annotated[
        str | None,
        typer.Option(
            "--command",
            help="A process pool's new command line, split as a shell would but never run "
            "by one ({port} is the port)",
        ),
    ] = None,
    image: Annotated[str | None, typer.Option("--image", help="A pod pool's new image")] = None,
    env: Annotated[
        list[str] | None, typer.Option("--env", help="KEY=VALUE of the new template (repeat)")
    ] = None,
    steps: Annotated[
        str | None, typer.Option("--steps", help="The canary's steps, e.g. 10,50,100")
    ] = None,
    step_interval_s: Annotated[
        float | None,
        typer.Option("--step-interval-s", min=0, help="Seconds each step lasts at least"),
    ] = None,
    max_failure_ratio: Annotated[
        float | None, typer.Option("--max-failure-ratio", help="Failures that roll back")
    ] = None,
    replace: Annotated[
        bool, typer.Option("--replace", help="Switch every new claim at once, no canary")
    ] = False,
    as_json: JsonFlag = False,
    url: UrlOption = None,
    token: TokenOption = None,
    old_step_interval: Annotated[
        float | None, typer.Option("--step-interval", min=0, hidden=True)
    ] = None,
) -> None:
    """Start rolling a new template of the pool out (the pool's default strategy unless
    --steps or --replace say otherwise); follow it with `status --watch`."""
    template: dict[str, Any] = {}
    if command is not None:
        try:
            words = shlex.split(command)
        except ValueError as exc:
            fail(f"--command: {exc}", code=2)
        if not words or not all(words):
            fail("--command needs a program (and no empty argument)", code=2)
        template["command"] = words
    if image is not None:
        template["image"] = image
    if env:
        pairs = [item.partition("=") for item in env]
        if any(not key or not sep for key, sep, _ in pairs):
            fail("--env takes KEY=VALUE", code=2)
        template["env"] = {key: value for key, _, value in pairs}
    if not template:
        fail("say what changes: --command, --image or --env", code=2)
    if old_step_interval is not None:
        print("stoker: --step-interval is deprecated; use --step-interval-s", file=sys.stderr)
        step_interval_s = step_interval_s if step_interval_s is not None else old_step_interval
    strategy = _strategy(steps, step_interval_s, max_failure_ratio, replace)
    if strategy is not None:
        check_input("strategy", strategy)
    with server(url, token) as client:
        _show(client.start_rollout(pool, template, strategy=strategy), as_json)


def _strategy(
    steps: str | None, interval: float | None, ratio: float | None, replace: bool
) -> dict[str, Any] | None:
    if replace:
        if steps is not None or interval is not None or ratio is not None:
            fail("--replace takes no canary options", code=2)
        return {"kind": "replace"}
    if steps is None and interval is None and ratio is None:
        return None
    body: dict[str, Any] = {"kind": "canary"}
    if steps is not None:
        try:
            body["steps"] = [int(s) for s in steps.split(",")]
        except ValueError:
            fail(f"--steps takes whole percentages separated by commas, got {steps!r}", code=2)
    if interval is not None:
        body["step_interval_s"] = interval
    if ratio is not None:
        body["max_failure_ratio"] = ratio
    return body


@rollout_app.command("status")
def status(
    pool: PoolArgument,
    rollout_id: IdArgument,
    watch: WatchOption = False,
    interval: IntervalOption = 2.0,
    as_json: JsonFlag = False,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """A rollout's state, step and share (--watch: each change, until it ends)."""
    with server(url, token) as client:
        current = client.rollout(pool, rollout_id)
        _show(current, as_json)
        if watch:
            _follow(client, pool, current, interval)


def _action(verb: str, doc: str) -> None:
    def act(
        pool: PoolArgument,
        rollout_id: IdArgument,
        as_json: JsonFlag = False,
        url: UrlOption = None,
        token: TokenOption = None,
    ) -> None:
        with server(url, token) as client:
            _show(client.rollout(pool, rollout_id, verb), as_json)

    act.__doc__ = doc
    rollout_app.command(verb)(act)


for _verb, _doc in (
    ("pause", "Hold the rollout's share where it is."),
    ("resume", "Go on ramping (the step's interval starts again)."),
    ("abort", "Stop: the new revision retires, the stable one takes every claim."),
    ("promote", "Every new claim to the new revision at once."),
):
    _action(_verb, _doc)
