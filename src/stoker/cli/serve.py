"""`serve`: the control plane and its HTTP API in this process."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from stoker._version import __version__
from stoker.cli.output import fail, print_json


def serve(
    config_file: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            envvar="STOKER_CONFIG",
            help="YAML config file (default: the built-in defaults)",
            dir_okay=False,
        ),
    ] = None,
    stop_workers: Annotated[
        bool,
        typer.Option(
            "--stop-workers",
            help="On shutdown, stop this server's workers instead of leaving them to adopt",
        ),
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Announce start and stop as JSON objects, and log JSON lines"),
    ] = False,
    stop_stranded: Annotated[
        bool,
        typer.Option(
            "--stop-stranded",
            help="Also stop stranded workers of replicas the store has no record of (after "
            "a lost or replaced database); without it they are reported and kept",
        ),
    ] = False,
) -> None:
    """Run the control plane and its HTTP API until SIGTERM or Ctrl-C."""
    # Imported here: the client commands need none of the server's code.
    from stoker.api.app import create_app
    from stoker.api.server import bind, bound_url, check_exposure
    from stoker.api.server import serve as run_server
    from stoker.api.tokens import TokenTable
    from stoker.bootstrap import build_control_plane, configure_logging
    from stoker.config import load_config
    from stoker.domain.errors import ConfigError
    from stoker.domain.errors import StokerError as ServerSideError

    try:
        loaded = load_config(config_file)
        config = loaded.config
        with loaded.checking():
            check_exposure(config.api)
            tokens = TokenTable(config.api)
    except ConfigError as exc:
        # Already one `config error: <key>: <problem>` line per problem.
        print(str(exc), file=sys.stderr)
        raise typer.Exit(1) from None
    configure_logging(config.log_level, "json" if as_json else config.log_format)
    try:
        sock = bind(config.api.host, config.api.port)
    except ServerSideError as exc:
        fail(str(exc))
    url = bound_url(sock)
    try:
        with loaded.checking():
            plane = build_control_plane(config)
    except ConfigError as exc:
        # Kubernetes credentials are only read here: still a config error, in one line.
        sock.close()
        print(str(exc), file=sys.stderr)
        raise typer.Exit(1) from None
    plane.janitor.stop_unseen = stop_stranded
    if not config.is_postgres and config.sqlite_path() not in ("", ":memory:"):
        from stoker.adapters.sqlite.ownership import hold

        try:
            # Held until the process exits (the kernel drops it however it exits).
            store_lock = hold(config.sqlite_path())  # noqa: F841
        except ServerSideError as exc:
            sock.close()
            fail(f"could not start: {exc}")
    api = create_app(plane, config.api, stop_workers=stop_workers, tokens=tokens)
    overrides = f" + {', '.join(loaded.overrides)}" if loaded.overrides else ""
    pools = ", ".join(p.name for p in config.pools)
    auth = "bearer tokens" if config.api.has_tokens else "loopback only, no tokens"
    lease = config.janitor_lease_name()
    election = f"{config.elector_kind()} {lease}" if lease else config.elector_kind()

    def announce() -> None:
        if as_json:
            print_json(
                {
                    "event": "listening",
                    "version": __version__,
                    "url": url,
                    "config": [loaded.source, *loaded.overrides],
                    "store": config.store_display(),
                    "runtime": config.runtime.kind,
                    "leader_election": election,
                    "pools": [p.name for p in config.pools],
                    "auth": auth,
                },
                indent=None,
            )
            return
        print(
            f"stoker {__version__} listening on {url} (config: {loaded.source}{overrides}; "
            f"store: {config.store_display()}; runtime: {config.runtime.kind}; "
            f"leader election: {election}; pools: {pools}; auth: {auth})",
            flush=True,
        )

    try:
        run_server(
            api,
            sock,
            api=config.api,
            shutdown_grace_s=config.intervals.shutdown_grace_s,
            on_started=announce,
        )
    except ServerSideError as exc:
        fail(str(exc))
    if as_json:
        print_json({"event": "stopped"}, indent=None)
    else:
        print("stoker stopped", flush=True)
