"""Runs the API app on uvicorn: socket binding, graceful SIGTERM, and the exposure rule.

`serve` binds the listening socket itself, so an address in use is one clear error rather
than a log line and an exit from deep inside the server. SIGTERM (or Ctrl-C) first marks
the API as draining — `/readyz` turns 503 and new claims are refused — then uvicorn stops
accepting connections, lets in-flight requests finish (up to the shutdown grace), and the
app's lifespan stops the control plane, leaving live workers for the next start to adopt.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import ipaddress
import logging
import resource
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn

from stoker.api.app import StokerApp
from stoker.api.connections import ClientLimits, bounded_protocol
from stoker.config import ApiConfig, ConfigKeyError
from stoker.domain.errors import StokerError

logger = logging.getLogger("stoker.api")

#: Open files kept for everything but client connections: the store, the runtime's pipes
#: and log files, activation requests to workers.
_RESERVED_FILES = 64


class ServeError(StokerError):
    """The server could not start: address in use, exposure without tokens, failed start."""

    code = "serve-failed"


def loopback_only(host: str) -> bool:
    """True when every address `host` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    addresses = {str(info[4][0]) for info in infos}
    return bool(addresses) and all(
        ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addresses
    )


def check_exposure(api: ApiConfig) -> None:
    """Refuse a non-loopback address without tokens (docs/concepts/claims.md), saying why."""
    if api.has_tokens or loopback_only(api.host):
        return
    raise ConfigKeyError(
        ("api", "host"),
        f"{api.host!r} is reachable from other machines, and no tokens are configured; set "
        "api.admin_tokens or api.org_tokens (for example STOKER_API__ADMIN_TOKENS=<a random "
        "token of 16+ characters>), or listen on 127.0.0.1",
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port` (port 0: any free port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _name, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def bound_url(sock: socket.socket) -> str:
    """`http://host:port` of a bound socket."""
    host, port = sock.getsockname()[:2]
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"http://{authority}"


def client_limits(api: ApiConfig) -> ClientLimits:
    """The client bounds of `api`, with the connection cap fitted to the open-files limit.

    The soft limit is first raised to the hard one; if that still leaves too little room,
    the cap is lowered (one log line), so that at the limit new connections are refused
    by the server's own rule rather than by a failing accept() that tells nobody.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    cap = api.max_connections
    if soft != resource.RLIM_INFINITY and cap > soft - 2 * _RESERVED_FILES:
        cap = max(16, soft - 2 * _RESERVED_FILES)
        logger.warning(
            "event=connection_limit_lowered max_connections=%d to=%d open_files_limit=%d",
            api.max_connections,
            cap,
            soft,
        )
    return ClientLimits.of(api, cap)


def fast_loop() -> str:
    """uvloop when installed (it serves HTTP noticeably faster), else asyncio."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def settle_heap() -> None:
    """Move everything alive after start-up out of the collector's sight.

    The objects of a started plane (modules, the app, its routes and models) live as long
    as the process; left tracked, each full collection walks all of them again, which paused
    the server for 60-280 ms at a time under load (the tail of every claim latency). After
    `gc.freeze()` a full collection looks only at what was made since. (No collection
    first: one over a fresh fleet's start-up took 0.7 s, and what it would free is small
    and made once.)
    """
    gc.freeze()


class _Server(uvicorn.Server):
    """uvicorn's server with draining on the first signal and an exit status of 0 after it."""

    def __init__(
        self, config: uvicorn.Config, app: StokerApp, on_started: Callable[[], None]
    ) -> None:
        super().__init__(config)
        self.app = app
        self.on_started = on_started

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain and shut down gracefully; a second Ctrl-C forces the exit."""
        self.app.api_state.draining = True
        # Unlike uvicorn's own handler, the signal is not re-raised after the graceful
        # shutdown: a SIGTERM that was handled is a clean exit (status 0).
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's periodic check (every 0.1 s); also leaves when this replica's identity
        expired, and reloads the tokens when a token file changed (checked every second)."""
        if counter % 10 == 0:
            self.app.tokens.reload_if_changed()
        if self.app.plane.expired and not self.should_exit:
            self.app.api_state.draining = True
            self.should_exit = True
        return await super().on_tick(counter)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start (plane first, via the lifespan), then announce the address."""
        await super().startup(sockets)
        if not self.should_exit:
            # SIGHUP rereads the token files (rotation without a restart).
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.app.tokens.reload)
            settle_heap()
            self.on_started()


def serve(
    app: StokerApp,
    sock: socket.socket,
    *,
    api: ApiConfig,
    shutdown_grace_s: float,
    on_started: Callable[[], None],
) -> None:
    """Serve `app` on `sock` until SIGTERM/SIGINT (or until the replica finds its registration
    expired). Raises `ServeError` if it could not start or its identity expired."""
    config = uvicorn.Config(
        app,
        loop=fast_loop(),
        http=bounded_protocol(client_limits(api), app.refusals),
        lifespan="on",
        access_log=False,
        log_config=None,
        server_header=False,
        timeout_graceful_shutdown=max(1, int(shutdown_grace_s)),
        backlog=2048,
    )
    server = _Server(config, app, on_started)
    try:
        server.run(sockets=[sock])
    except SystemExit as exc:
        # uvicorn exits this way when the lifespan start failed.
        error = app.api_state.startup_error or f"the server exited with status {exc.code}"
        raise ServeError(f"could not start: {error}") from None
    finally:
        sock.close()
    if app.api_state.startup_error is not None:
        raise ServeError(f"could not start: {app.api_state.startup_error}")
    if app.plane.expired:
        raise ServeError(
            f"instance {app.plane.instance_id} expired while running (no heartbeat reached "
            "the store within instance_expiry_s); its workers were adopted by the other "
            "replicas; exiting so that a fresh instance starts"
        )
