"""The HTTP connection protocol with bounds on what one client can make the server hold.

uvicorn's httptools protocol, plus: request line and headers are bounded in size (431) and
in time from the first byte (408); a body must arrive within its own time (408); a
connection that never sends a byte is closed after the header time; open connections are
capped. At the cap a new connection closes the longest-idle one that has no whole request
in progress (idle, or still sending its headers or body), so idle or half-sent connections
can never keep `/healthz` or a claim out, and a request already being served is never cut
off; only when every open connection is serving a request does the newcomer get 503.
A timer that ends an idle connection first looks for request bytes that arrived but were
not read yet (a busy loop runs due timers before it reads): such a connection is not idle,
and closing it would reset a request the client has sent.

Each refusal is answered with a problem-details body (when there is a request to answer),
counted in `stoker_api_refusals_total{reason}`, and logged as one `event=client_refused`
line; under a flood the lines of one reason are folded to at most one a second, with the
number folded.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import struct
import termios
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from stoker.api import problems
from stoker.config import ApiConfig
from stoker.control.metrics import Counter

logger = logging.getLogger("stoker.api")

#: Seconds within which further refusals of one reason are folded into the next line.
_LOG_FOLD_S = 1.0
#: Seconds a refused connection stays open, not read, for its answer to arrive.
_LINGER_S = 2.0
#: Refused connections lingering at once at most; past it they are closed at once.
_MAX_LINGERING = 64


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """The bounds of `ApiConfig` the protocol enforces."""

    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    keep_alive_s: float
    max_connections: int

    @classmethod
    def of(cls, api: ApiConfig, max_connections: int | None = None) -> ClientLimits:
        """The limits of `api`, with the connection cap lowered to `max_connections`."""
        return cls(
            max_header_bytes=api.max_header_bytes,
            header_timeout_s=api.header_timeout_s,
            body_timeout_s=api.body_timeout_s,
            keep_alive_s=api.keep_alive_s,
            max_connections=max_connections or api.max_connections,
        )


class RefusalLog:
    """One log line and one count per refusal; a flood of one reason folds its lines.

    The first refusal of a reason is logged at once; the ones that follow within
    `_LOG_FOLD_S` are counted, and one `event=client_refused_folded` line says how many
    when that second is over.
    """

    def __init__(self, counter: Counter | None = None) -> None:
        self.counter = counter
        self._last: dict[str, float] = {}
        self._folded: dict[str, int] = {}

    def refused(
        self, now: float, reason: str, status: int | None, client: str, detail: str
    ) -> None:
        """Record one refusal at loop time `now` (called on the event loop)."""
        if self.counter is not None:
            self.counter.labels(reason).inc()
        last = self._last.get(reason)
        if last is not None and now - last < _LOG_FOLD_S:
            if reason not in self._folded:
                self._folded[reason] = 0
                asyncio.get_running_loop().call_later(
                    _LOG_FOLD_S - (now - last), self._flush, reason
                )
            self._folded[reason] += 1
            return
        self._last[reason] = now
        logger.warning(
            "event=client_refused reason=%s status=%s client=%s detail=%r",
            reason,
            status if status is not None else "-",
            client,
            detail,
        )

    def _flush(self, reason: str) -> None:
        folded = self._folded.pop(reason, 0)
        logger.warning(
            "event=client_refused_folded reason=%s count=%d within_s=%g",
            reason,
            folded,
            _LOG_FOLD_S,
        )


def bounded_protocol(limits: ClientLimits, refusals: RefusalLog) -> type[BoundedHttpProtocol]:
    """A protocol class for `uvicorn.Config(http=...)` enforcing `limits`."""
    return type(
        "BoundedHttpProtocol",
        (BoundedHttpProtocol,),
        {"limits": limits, "refusals": refusals, "lingering": set()},
    )


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with size, time and connection bounds (module doc)."""

    limits: ClassVar[ClientLimits]
    refusals: ClassVar[RefusalLog]
    #: Refused connections waiting for their answer to arrive before they close.
    lingering: ClassVar[set[BoundedHttpProtocol]]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.timeout_keep_alive = self.limits.keep_alive_s  # type: ignore[assignment]
        #: True from a request's first byte until its headers are complete.
        self._in_headers = False
        self._header_bytes = 0
        #: Bytes of the current request seen at all (0: the connection is idle).
        self._request_bytes = 0
        #: True from a request's headers until its response is complete.
        self._serving = False
        #: True once the request being served has arrived whole (its body too).
        self._arrived = False
        self._refused = False
        self._deadline: asyncio.TimerHandle | None = None
        #: Loop time since when this connection has served nothing.
        self.idle_since = self.loop.time()

    # -- connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not self._make_room():
            self._refuse(503, "connection_limit", "the server has reached its connection limit")
            return
        self._arm(self.limits.header_timeout_s, self._on_header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.lingering.discard(self)
        super().connection_lost(exc)

    def _make_room(self) -> bool:
        """Close the longest-idle connection with no whole request in progress (idle, or
        still sending headers or a body) and none waiting unread; False if there is none."""
        victim: BoundedHttpProtocol | None = None
        for connection in self.connections:
            if (
                connection is self
                or not isinstance(connection, BoundedHttpProtocol)
                or (connection._serving and connection._arrived)
                or connection._refused
                # A request is here, unread yet (see `_unread`): closing would reset it.
                or connection._unread()
            ):
                continue
            if victim is None or connection.idle_since < victim.idle_since:
                victim = connection
        if victim is None:
            return False
        victim._refuse(None, "evicted", "closed to make room for a new connection")
        return True

    # -- bytes in -------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._unset_keepalive_if_required()
        if not self._serving and self._deadline is None:
            # The first byte of a request after an idle keep-alive connection.
            self._arm(self.limits.header_timeout_s, self._on_header_timeout)
        self._request_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            # Unless a callback refused the request and so stopped the parser.
            self._refuse(400, "malformed", "the request is not valid HTTP/1.1")
            return
        if self._in_headers and not self._refused:
            if self._deadline is None and not self._serving:
                self._arm(self.limits.header_timeout_s, self._on_header_timeout)
            # Counted per chunk, before the parser has the whole header to hand over, so
            # that an endless header is cut off after one read past the limit.
            self._header_bytes += len(data)
            if self._header_bytes > self.limits.max_header_bytes:
                self._refuse(431, "headers_too_large", self._headers_too_large())

    def _headers_too_large(self) -> str:
        return f"the request line and headers exceed {self.limits.max_header_bytes} bytes"

    # -- parser callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_headers = True
        self._header_bytes = 0
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._header_bytes = 0
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_header_bytes:
            self._refuse(431, "headers_too_large", self._headers_too_large())
            raise _Refused
        self._disarm()
        if self._has_body():
            self._arm(self.limits.body_timeout_s, self._on_body_timeout)
        self._serving = True
        self._arrived = False
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._disarm()
        self._arrived = True
        super().on_message_complete()
        if not self._serving and not self.transport.is_closing():
            # Answered before its body ended (a 401, a 413): the body's bytes cancelled
            # the keep-alive timer, which is armed again from now.
            self._request_bytes = 0
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def on_response_complete(self) -> None:
        self._serving = False
        self._request_bytes = 0
        self.idle_since = self.loop.time()
        super().on_response_complete()

    def _has_body(self) -> bool:
        for name, value in self.headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
                return True
        return False

    # -- deadlines and refusals ---------------------------------------------------------------

    def _arm(self, delay: float, callback: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def timeout_keep_alive_handler(self) -> None:
        if self._unread():
            # The loop ran late: the next request arrived before this timer, unread yet.
            self.timeout_keep_alive_task = None
            return
        super().timeout_keep_alive_handler()

    def _unread(self) -> bool:
        """True when request bytes wait in the socket, not read yet.

        A busy loop runs a due timer before it reads what arrived meanwhile (uvloop runs
        timers first); closing then would reset the connection (unread data turns the
        close into a RST) and cut off a request the client has already sent.
        """
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        try:
            pending = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except (OSError, ValueError):
            return False
        return bool(struct.unpack("i", pending)[0])

    def _on_header_timeout(self) -> None:
        self._deadline = None
        if self._request_bytes == 0 and self._unread():
            # Its first bytes are here (see `_unread`): the header time runs from them.
            return
        if self._request_bytes == 0:
            # Never sent a byte: nothing to answer, the connection is just closed.
            self._refuse(None, "idle_connection", "no request within the header timeout")
        else:
            detail = f"the request headers did not arrive within {self.limits.header_timeout_s:g}s"
            self._refuse(408, "header_timeout", detail)

    def _on_body_timeout(self) -> None:
        self._deadline = None
        detail = f"the request body did not arrive within {self.limits.body_timeout_s:g}s"
        started = self.cycle is not None and self.cycle.response_started
        self._refuse(None if started else 408, "body_timeout", detail)

    def _refuse(self, status: int | None, reason: str, detail: str) -> None:
        """Answer `status` (None: no answer), close the connection, log and count it."""
        if self._refused:
            return
        self._refused = True
        self._disarm()
        if self.cycle is not None and not self.cycle.response_complete:
            # The route waiting for the rest of the body sees the client gone.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        # A refused connection no longer counts against the cap (it is on its way out).
        self.connections.discard(self)
        if not self.transport.is_closing():
            if status is not None:
                self.transport.write(_response(status, reason, detail))
                self._linger()
            else:
                self.transport.close()
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
        self.refusals.refused(self.loop.time(), reason, status, client, detail)

    def _linger(self) -> None:
        """Close after the answer had time to arrive.

        Closed at once, a connection whose client is still sending is reset, and the
        reset can destroy the answer in the client's buffers before it reads it. So the
        write side is shut, reading stops (what the client still sends waits in the
        kernel, unread, so a flood costs nothing) and the close follows `_LINGER_S`
        later; past `_MAX_LINGERING` such connections, the close is immediate.
        """
        if len(self.lingering) >= _MAX_LINGERING or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.lingering.add(self)
        self.transport.write_eof()
        self.transport.pause_reading()
        self.loop.call_later(_LINGER_S, self._stop_lingering)

    def _stop_lingering(self) -> None:
        self.lingering.discard(self)
        if not self.transport.is_closing():
            self.transport.close()


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a refused request."""


def _response(status: int, code: str, detail: str) -> bytes:
    body = problems.problem_bytes(status, code.replace("_", "-"), detail)
    head = (
        f"HTTP/1.1 {status} {_PHRASES.get(status, '')}\r\n"
        f"content-type: {problems.PROBLEM_JSON}\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


_PHRASES = {
    400: "Bad Request",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}
