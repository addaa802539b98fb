"""`config check`: a config file validated as `serve` would, printed with its secrets
masked."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from stoker.cli.output import print_json

config_app = typer.Typer(name="config", help="The server's configuration.", no_args_is_help=True)

#: What a secret is shown as.
MASK = "***"


@config_app.command("check")
def config_check(
    config_file: Annotated[
        Path,
        typer.Option(
            "--config",
            "-c",
            envvar="STOKER_CONFIG",
            help="YAML config file, as `stoker serve -c` takes it",
            dir_okay=False,
            show_default=False,
        ),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of YAML")] = False,
) -> None:
    """Validate a config file (with the `STOKER_*` overrides) as `serve` would, and print
    the effective config with its secrets masked; exit 1 with the errors otherwise."""
    import yaml

    from stoker.api.server import check_exposure
    from stoker.api.tokens import TokenTable
    from stoker.bootstrap import check_extras
    from stoker.config import load_config
    from stoker.domain.errors import ConfigError

    try:
        loaded = load_config(config_file)
        check_exposure(loaded.config.api)
        TokenTable(loaded.config.api)
        # A part the config names whose extra is missing stops `serve` as it would.
        check_extras(loaded.config)
    except ConfigError as exc:
        # One `config error: <key>: <problem>` line per problem, as `serve` prints them.
        print(str(exc), file=sys.stderr)
        raise typer.Exit(1) from None
    effective = _masked(loaded.config.model_dump(mode="json"))
    if as_json:
        print_json(effective)
        return
    overrides = f" + {', '.join(loaded.overrides)}" if loaded.overrides else ""
    print(f"# effective config of {loaded.source}{overrides} (valid; secrets masked)")
    print(yaml.safe_dump(effective, sort_keys=False, allow_unicode=True), end="")


def _masked(config: dict[str, Any]) -> dict[str, Any]:
    """The config's JSON form with the passwords of the store's and the tracing collector's
    URLs, the API tokens and the activation key masked."""
    config["store"] = _without_password(config["store"])
    if config["tracing"]["endpoint"] is not None:
        config["tracing"]["endpoint"] = _without_password(config["tracing"]["endpoint"])
    api = config["api"]
    api["admin_tokens"] = [MASK for _ in api["admin_tokens"]]
    # Tokens are the keys of org_tokens: each becomes a numbered mask, to stay distinct.
    api["org_tokens"] = {
        f"{MASK}{n}": org for n, org in enumerate(api["org_tokens"].values(), start=1)
    }
    if config["activation"]["key"] is not None:
        config["activation"]["key"] = MASK
    return config


def _without_password(url: str) -> str:
    """`url` with the password of its user info, if any, masked."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if at and ":" in userinfo:
        return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:{MASK}@{host}"
    return url
