"""`config check`: a config file validated as `serve` would, printed with its secrets
masked."""

from __future__ import annotations

import re
import sys
import urllib.parse
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
            help="YAML config file, as `stoker serve --config` takes it",
            dir_okay=False,
            show_default=False,
        ),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of YAML")] = False,
    connect: Annotated[
        bool,
        typer.Option(
            "--connect",
            help="Also reach the store and the Kubernetes API with the config's credentials "
            "and check what stoker needs there (changes nothing)",
        ),
    ] = False,
) -> None:
    """Validate a config file (with the `STOKER_*` overrides) as `serve` would, and print
    the effective config with its secrets masked; exit 1 with the errors otherwise.

    With `--connect`, also reach the store (PostgreSQL: connect, the schema's privileges)
    and, for the Kubernetes runtime, the API server (may these credentials create, delete,
    get, list, patch and watch pods, and the leader election's leases, in the namespace?),
    saying on stderr what answered; exit 1 with a `connect error` line otherwise."""
    import asyncio

    import yaml

    from stoker.api.server import check_exposure
    from stoker.api.tokens import TokenTable
    from stoker.bootstrap import check_connections, check_extras
    from stoker.config import load_config
    from stoker.domain.errors import ConfigError

    try:
        loaded = load_config(config_file)
        with loaded.checking():
            check_exposure(loaded.config.api)
            TokenTable(loaded.config.api)
            # A part the config names whose extra is missing stops `serve` as it would.
            check_extras(loaded.config)
    except ConfigError as exc:
        # One `config error: <key>: <problem>` line per problem, as `serve` prints them.
        print(str(exc), file=sys.stderr)
        raise typer.Exit(1) from None
    if connect:
        try:
            for line in asyncio.run(check_connections(loaded.config)):
                print(f"connected: {line}", file=sys.stderr)
        except ConfigError as exc:
            print(str(exc), file=sys.stderr)
            raise typer.Exit(1) from None
    # The file's names (`store_options.schema`), as the documentation gives them.
    # (A pod template's empty lists default to the domain's empty tuples: serialized as
    # lists all the same, without pydantic's warning about the type on stderr.)
    dumped = loaded.config.model_dump(mode="json", by_alias=True, warnings=False)
    effective = _masked(dumped)
    if as_json:
        print_json(effective)
        return
    overrides = f" + {', '.join(loaded.overrides)}" if loaded.overrides else ""
    print(f"# effective config of {loaded.source}{overrides} (valid; secrets masked)")
    print(yaml.safe_dump(effective, sort_keys=False, allow_unicode=True), end="")


#: Keys whose values are secrets, wherever they are (a URL's query string, a pool's env,
#: a section of the config): passwords, secrets, tokens, keys, credentials.
_SECRET_KEY = re.compile(r"pass|secret|token|key$|credential|auth", re.IGNORECASE)


def _masked(config: dict[str, Any]) -> dict[str, Any]:
    """The config's JSON form (the file's key names) with every secret masked: the API
    tokens, the activation key, the passwords of every URL (user info and query string)
    and every value whose key looks like a secret."""
    api = config["api"]
    api["admin_tokens"] = [MASK for _ in api["admin_tokens"]]
    # Tokens are the keys of org_tokens: each becomes a numbered mask, to stay distinct.
    api["org_tokens"] = {
        f"{MASK}{n}": org for n, org in enumerate(api["org_tokens"].values(), start=1)
    }
    masked: dict[str, Any] = _mask_tree(config, None)
    return masked


def _mask_tree(value: Any, key: str | None) -> Any:
    """`value` with the secrets under it masked (`key`: the name it is found under)."""
    if isinstance(value, dict):
        return {k: _mask_tree(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask_tree(v, key) for v in value]
    if isinstance(value, str):
        # A file that holds secrets is named, not masked (`admin_tokens_file`).
        if key is not None and _SECRET_KEY.search(key) and not key.endswith("_file"):
            return MASK
        if "://" in value:
            return _without_secrets(value)
    return value


def _without_secrets(url: str) -> str:
    """`url` with the password of its user info and the secrets of its query string
    (`password`, `sslpassword`, any `...token`, `...key`, ...) masked."""
    scheme, sep, rest = url.partition("://")
    rest, hashmark, fragment = rest.partition("#")
    rest, question, query = rest.partition("?")
    userinfo, at, host = rest.rpartition("@")
    if at and ":" in userinfo:
        rest = f"{userinfo.split(':', 1)[0]}:{MASK}@{host}"
    if question:
        pairs = []
        for pair in query.split("&"):
            name, equals, _value = pair.partition("=")
            secret = equals and _SECRET_KEY.search(urllib.parse.unquote_plus(name))
            pairs.append(f"{name}={MASK}" if secret else pair)
        rest = f"{rest}?{'&'.join(pairs)}"
    return f"{scheme}{sep}{rest}{hashmark}{fragment}"
