"""The app's first middleware: who is calling, how big the body may be.

`Guard` authenticates `/v1/` requests and bounds request bodies before anything reads or
parses them; `principal_of` tells a route who is calling. `ApiState` is what the HTTP layer
knows beyond the plane (draining, a failed start).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from stoker.api import problems
from stoker.api.connections import RefusalLog
from stoker.api.tokens import ANONYMOUS_ADMIN, Principal, TokenTable

__all__ = ["ANONYMOUS_ADMIN", "ApiState", "Guard", "Principal", "principal_of", "send_problem"]
from stoker.config import ApiConfig

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Scope key under which `Guard` leaves the authenticated caller.
PRINCIPAL_KEY = "stoker.principal"
#: Methods whose requests carry a body worth limiting.
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def principal_of(scope: Scope) -> Principal:
    """The caller `Guard` authenticated for this `/v1/` request."""
    principal = scope.get(PRINCIPAL_KEY)
    assert isinstance(principal, Principal), "Guard runs before every /v1/ route"
    return principal


class ApiState:
    """What the HTTP layer knows beyond the plane: draining, and a failed start."""

    def __init__(self) -> None:
        #: Set on SIGTERM: readiness drops and new claims are refused.
        self.draining = False
        self.startup_error: str | None = None


# -- the guard: auth and body size, before any route ----------------------------------------


@functools.lru_cache(maxsize=1024)
def _is_loopback(host: str) -> bool:
    # Cached: the same few client addresses come back on every request.
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return host == "localhost"


class Guard:
    """ASGI middleware: authenticates `/v1/` requests and bounds request bodies.

    With tokens configured, a `/v1/` request needs `Authorization: Bearer <token>` (401
    otherwise); with none configured, only loopback clients are served (403 otherwise).
    A body longer than `max_body_bytes` gets 413, by its Content-Length before it is read,
    or as soon as a chunked body grows past the limit.
    """

    def __init__(
        self,
        app: ASGIApp,
        api: ApiConfig,
        tokens: TokenTable,
        refusals: RefusalLog | None = None,
    ) -> None:
        self.app = app
        self.refusals = refusals or RefusalLog()
        self.max_body = api.max_body_bytes
        self.open = not api.has_tokens
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"].startswith("/v1/"):
            principal, refusal = self._authenticate(scope)
            if refusal is not None:
                await refusal(send)
                return
            scope[PRINCIPAL_KEY] = principal
        if scope["method"] in BODY_METHODS:
            length = _content_length(scope)
            if length is not None and length > self.max_body:
                self._refused_body(scope)
                await send_problem(send, 413, "body-too-large", self._too_large())
                return
            receive = self._limited(scope, receive)
        await self.app(scope, receive, send)

    def _too_large(self) -> str:
        return f"the request body exceeds {self.max_body} bytes"

    def _refused_body(self, scope: Scope) -> None:
        client = scope.get("client")
        where = f"{client[0]}:{client[1]}" if client else "-"
        now = asyncio.get_running_loop().time()
        self.refusals.refused(now, "body_too_large", 413, where, self._too_large())

    def _authenticate(
        self, scope: Scope
    ) -> tuple[Principal | None, Callable[[Send], Awaitable[None]] | None]:
        if self.open:
            client = scope.get("client")
            if client is not None and not _is_loopback(str(client[0])):
                detail = "this server has no tokens configured and serves loopback clients only"
                return None, lambda send: send_problem(send, 403, "forbidden", detail)
            return ANONYMOUS_ADMIN, None
        credential = _bearer(scope)
        if credential is None:
            detail = "missing bearer token (Authorization: Bearer <token>)"
            return None, lambda send: send_problem(send, 401, "unauthorized", detail, bearer=True)
        principal = self.tokens.match(credential)
        if principal is None:
            detail = "unknown bearer token"
            return None, lambda send: send_problem(send, 401, "unauthorized", detail, bearer=True)
        return principal, None

    def _limited(self, scope: Scope, receive: Receive) -> Receive:
        limit, seen = self.max_body, 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    self._refused_body(scope)
                    raise HTTPException(413, self._too_large())
            return message

        return limited_receive


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, credential = bytes(value).partition(b" ")
            if scheme.lower() != b"bearer" or not credential.strip():
                return None
            return credential.strip()
    return None


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def send_problem(
    send: Send, status: int, code: str, detail: str, *, bearer: bool = False
) -> None:
    """Answer with one problem, before any route ran."""
    body = problems.problem_bytes(status, code, detail)
    length = str(len(body)).encode()
    headers = [(b"content-type", problems.PROBLEM_JSON.encode()), (b"content-length", length)]
    if bearer:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
