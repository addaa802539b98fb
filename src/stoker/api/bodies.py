"""JSON request bodies: the media type and duplicate keys, judged before any route.

Every request body of the API (`/v1/`) is a JSON document. `JsonBodies` answers, before a
route parses anything:

- 415 `unsupported-media-type` for a body sent with another content type than JSON
  (`application/json` or any `application/*+json`, with or without parameters). A body
  sent without a content type is read as JSON, as the framework does.
- 400 `duplicate-key` for a JSON object that names a key twice (`{"lease_s": 1,
  "lease_s": 600}`): a parser keeps one of the two silently, and which one the client
  meant is anyone's guess.

A body that is not JSON at all goes on: the routes answer it (400 `malformed-request`),
as they answer every other problem of a body's content.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException

from stoker.api.asgi import BODY_METHODS, ASGIApp, Receive, Scope, Send, send_problem
from stoker.api.routing import content_type, read_body, replay


class DuplicateKey(ValueError):
    """A JSON object names the same key twice."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`object_pairs_hook` of `json.loads`: the object, unless a key comes twice."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return obj


#: `json.loads` with a hook builds a decoder per call; this one is built once.
_UNIQUE_KEYS = json.JSONDecoder(object_pairs_hook=_unique)


def duplicate_key(raw: bytes) -> str | None:
    """The first key a JSON object of `raw` names twice, else None (also for non-JSON)."""
    if raw.count(b'"') < 4:
        return None  # fewer than two keys: nothing can repeat
    try:
        # The bytes are read as `json.loads` reads them (UTF-8, -16 or -32).
        _UNIQUE_KEYS.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except DuplicateKey as exc:
        return exc.key
    except Exception:
        # Not JSON, nested past the parser's limit, a number too long, ...: the route's
        # own parser judges it.
        return None
    return None


def is_json(media: bytes | None) -> bool:
    """True for a JSON media type (parameters allowed), and for none at all."""
    if media is None:
        return True
    kind = media.split(b";", 1)[0].strip()
    return kind == b"application/json" or (
        kind.startswith(b"application/") and kind.endswith(b"+json")
    )


class JsonBodies:
    """ASGI middleware: 415 for a `/v1/` body that is not JSON, 400 for a duplicate key.

    It runs inside `Guard` (so a body is bounded and its sender authenticated before it is
    read); a body it reads is replayed to the app.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] not in BODY_METHODS
            or not scope["path"].startswith("/v1/")
        ):
            await self.app(scope, receive, send)
            return
        media = content_type(scope)
        try:
            raw = await read_body(receive)
        except HTTPException as exc:
            # The guard's bound on a chunked body: answered as the guard answers it.
            await send_problem(send, exc.status_code, "body-too-large", str(exc.detail))
            return
        if raw is None:
            return  # the client left: nobody to answer
        if raw and not is_json(media):
            shown = (media or b"").decode("latin-1")
            detail = f"the body must be JSON (Content-Type: application/json), not {shown!r}"
            await send_problem(send, 415, "unsupported-media-type", detail)
            return
        key = duplicate_key(raw) if raw else None
        if key is not None:
            detail = f"the body names the key {key!r} more than once"
            await send_problem(send, 400, "duplicate-key", detail)
            return
        await self.app(scope, replay(raw, receive), send)
