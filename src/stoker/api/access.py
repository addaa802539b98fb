"""The access log: one line per HTTP request, when `api.access_log` is on.

`event=http_request method=... path=... status=... ms=...` and who called: `org=<org>` for
an org token, `admin=true` for an admin token. The path only (no query string), and never
a header: a token cannot reach the line. Off by default: a claim and its release are
already logged as events, and a line per request costs the claim path.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stoker.api.asgi import PRINCIPAL_KEY
from stoker.api.tokens import Principal
from stoker.control import logs


class AccessLog:
    """ASGI middleware logging each HTTP request once its answer started (or failed)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            principal = scope.get(PRINCIPAL_KEY)
            known = principal if isinstance(principal, Principal) else None
            logs.event(
                "http_request",
                method=scope["method"],
                path=scope["path"],
                status=status or None,
                ms=round((loop.time() - started) * 1000, 1),
                org=known.org if known is not None and not known.admin else None,
                admin=True if known is not None and known.admin else None,
            )
