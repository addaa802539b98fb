"""The built-in demo worker: a tiny HTTP/1.1 server speaking the worker protocol.

Run as ``python -m stoker.demo_worker --port P --worker-id W [--host 127.0.0.1]`` with the
activation secret in ``STOKER_ACTIVATION_SECRET`` (the control plane sets it).

It implements the worker side of `docs/worker-protocol.md` through the kit
(`stoker.worker`): ``GET /healthz`` answers once the socket listens; ``POST /activate``,
signed with the worker's activation secret, binds the worker to one org for good, fenced
by a strictly increasing epoch; afterwards every request but ``/healthz`` and
``/activate`` must carry the current session token. ``GET /`` shows what the worker holds.

Standard library only, and nothing from stoker but the kit: hundreds of these run on one
machine, so every imported module is resident memory multiplied by the fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from stoker.worker import MissingSecret, Reply, WorkerProtocol, problem

#: Largest request body accepted (an activation carries a config, not a data set).
MAX_BODY_BYTES = 1024 * 1024
#: Largest request line plus headers.
MAX_HEAD_BYTES = 16 * 1024
#: An idle keep-alive connection is closed after this long; it outlives the control plane's
#: pooled client expiry (httpx: 5 s), so the client is the side that normally closes.
IDLE_TIMEOUT_S = 30.0
#: A client that stalls in the middle of a request body is dropped after this long.
BODY_TIMEOUT_S = 10.0
#: At shutdown, connections get this long to finish the response they are writing.
SHUTDOWN_GRACE_S = 1.0


def _phrase(status: int) -> str:
    """The reason phrase of an HTTP status ("Error" for one the standard does not name)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


#: Allowed methods of the worker's own paths (the protocol's are the kit's).
_ROUTES: dict[str, tuple[str, ...]] = {"/": ("GET",)}


def describe(protocol: WorkerProtocol) -> dict[str, Any]:
    """The body of `GET /`: what the worker holds (config keys only, never values), and
    the trace context of its activation when the control plane traces."""
    held: dict[str, Any] = {
        "worker_id": protocol.worker_id,
        "org": protocol.org,
        "epoch": protocol.epoch,
        "config_keys": sorted(protocol.config),
    }
    if protocol.traceparent is not None:
        held["traceparent"] = protocol.traceparent
    return held


@dataclass(slots=True)
class Request:
    """One parsed HTTP request."""

    method: str
    path: str
    version: str
    headers: dict[str, str]
    body: bytes = b""

    def keep_alive(self) -> bool:
        """HTTP/1.1 keeps the connection unless told otherwise; HTTP/1.0 only if asked."""
        connection = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.0":
            return connection == "keep-alive"
        return connection != "close"


class BadRequest(Exception):
    """The bytes on the wire are not a request this server can answer."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail


def parse_head(head: bytes) -> Request:
    """Parse a request line and headers (everything up to the blank line)."""
    # Header bytes are latin-1 by definition (RFC 9110 §5.5), so decoding never fails.
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest(400, "malformed-request", "malformed request line")
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(400, "malformed-request", "malformed header line")
        headers[name.lower()] = value.strip()
    path = target.split("?", 1)[0]
    return Request(method=method, path=path, version=version, headers=headers)


def body_length(request: Request) -> int:
    """The declared Content-Length (0 when absent); rejects what this server cannot read."""
    if "transfer-encoding" in request.headers:
        raise BadRequest(
            411, "length-required", "chunked bodies are not supported; send Content-Length"
        )
    raw = request.headers.get("content-length")
    if raw is None:
        return 0
    if not raw.isdigit():
        raise BadRequest(400, "malformed-request", "Content-Length must be a non-negative integer")
    length = int(raw)
    if length > MAX_BODY_BYTES:
        raise BadRequest(413, "body-too-large", f"body larger than {MAX_BODY_BYTES} bytes")
    return length


def route(protocol: WorkerProtocol, request: Request) -> Reply:
    """Answer one request: the protocol's part (the kit), then the worker's own paths."""
    reply = protocol.answer(request.method, request.path, request.headers, request.body)
    if reply is not None:
        return reply
    allowed = _ROUTES.get(request.path)
    if allowed is None:
        return problem(404, "not-found", f"no such path {request.path!r}")
    if request.method not in allowed:
        allow = {"Allow": ", ".join(allowed)}
        return problem(405, "method-not-allowed", f"{request.method} not allowed", allow)
    return Reply(200, describe(protocol))


def render(reply: Reply, *, keep_alive: bool) -> bytes:
    """Serialise one response."""
    content = reply.json()
    lines = [
        f"HTTP/1.1 {reply.status} {_phrase(reply.status)}",
        f"Content-Type: {reply.content_type}",
        f"Content-Length: {len(content)}",
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
        *(f"{name}: {value}" for name, value in reply.headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + content


class Server:
    """Serves one worker's HTTP connections until `close`."""

    def __init__(self, protocol: WorkerProtocol) -> None:
        self.protocol = protocol
        self._connections: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve requests on one connection, one after another, while it is kept alive."""
        task = asyncio.current_task()
        if task is not None:
            self._connections[task] = writer
        try:
            while await self._serve_one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            # The peer went away or stalled: nothing left to answer.
            return
        finally:
            if task is not None:
                self._connections.pop(task, None)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read and answer one request; False when the connection should close."""
        try:
            # `asyncio.timeout`, not `wait_for`: no task of its own per read (3.11's
            # wait_for makes one), which is most of a small request's cost.
            async with asyncio.timeout(IDLE_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                await self._reject(
                    writer, BadRequest(400, "malformed-request", "incomplete request head")
                )
            return False
        except asyncio.LimitOverrunError:
            await self._reject(writer, BadRequest(431, "head-too-large", "request head too large"))
            return False
        try:
            request = parse_head(head[:-4])
            length = body_length(request)
        except BadRequest as exc:
            await self._reject(writer, exc)
            return False
        if length:
            if request.headers.get("expect", "").lower() == "100-continue":
                # curl asks before sending a larger body; the size was checked above.
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            async with asyncio.timeout(BODY_TIMEOUT_S):
                request.body = await reader.readexactly(length)
        keep_alive = request.keep_alive()
        writer.write(render(route(self.protocol, request), keep_alive=keep_alive))
        await writer.drain()
        return keep_alive

    async def _reject(self, writer: asyncio.StreamWriter, error: BadRequest) -> None:
        # The stream position is unknown after a bad head, so the connection closes.
        reply = problem(error.status, error.code, error.detail)
        writer.write(render(reply, keep_alive=False))
        await writer.drain()

    async def close(self) -> None:
        """Close every open connection and wait for their handlers to finish.

        Idle keep-alive connections would otherwise linger; waiting lets each handler end
        on its own instead of being cancelled mid-write when the loop shuts down.
        """
        for writer in self._connections.values():
            writer.close()
        handlers = set(self._connections)
        if handlers:
            _done, pending = await asyncio.wait(handlers, timeout=SHUTDOWN_GRACE_S)
            for handler in pending:
                handler.cancel()
            if pending:
                await asyncio.wait(pending)


async def serve(
    host: str,
    port: int,
    protocol: WorkerProtocol,
    start_delay: float = 0.0,
    stop_delay: float = 0.0,
) -> None:
    """Listen on `host:port` until SIGTERM or SIGINT; ready after `start_delay` seconds,
    gone `stop_delay` seconds after the signal."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    protocol.ready = start_delay <= 0
    if start_delay > 0:
        # Stands in for an engine that takes a while to start (tests of slow spawns).
        loop.call_later(start_delay, setattr, protocol, "ready", True)
    server = Server(protocol)
    worker_id = protocol.worker_id
    listener = await asyncio.start_server(server.handle, host, port, limit=MAX_HEAD_BYTES)
    bound = listener.sockets[0].getsockname()[1]
    authority = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
    print(f"demo_worker listening worker_id={worker_id} endpoint=http://{authority}", flush=True)
    async with listener:
        await stop.wait()
        if stop_delay > 0:
            # Stands in for an engine that takes a while to shut down: a pod terminates
            # (and holds its node share) until the process exits.
            await asyncio.sleep(stop_delay)
        listener.close()
        await server.close()


def _seconds(text: str) -> float:
    """A delay option's value: a finite number of seconds, 0 or more (`inf` would keep a
    worker from ever getting ready, or from ever exiting)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"not a finite number of seconds >= 0: {text!r}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m stoker.demo_worker", description="stoker's built-in demo worker"
    )
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: any free port)")
    parser.add_argument("--worker-id", required=True, help="the id this worker answers to")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument(
        "--start-delay",
        type=_seconds,
        default=0.0,
        help="seconds before /healthz answers 200 (simulates a slow engine start)",
    )
    parser.add_argument(
        "--stop-delay",
        type=_seconds,
        default=0.0,
        help="seconds from SIGTERM or SIGINT to the exit (simulates a slow engine shutdown)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the worker; returns the process exit status (0 after SIGTERM or SIGINT)."""
    args = parse_args(argv)
    try:
        protocol = WorkerProtocol.from_env(args.worker_id)
    except MissingSecret as exc:
        print(f"demo_worker cannot start: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(args.host, args.port, protocol, args.start_delay, args.stop_delay))
    except OSError as exc:
        print(f"demo_worker cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
