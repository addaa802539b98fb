"""Direct routes: routes of the app whose plain requests skip the framework's request handling.

The claim routes are the path every session takes (a claim and a release per session), and
the framework's work for a request — its exception and exit-stack layers, the router's
search, solving the endpoint's dependencies, decoding the JSON body into Python objects
and validating them afterwards — cost about a fifth of the server's CPU in a claim +
release cycle.

A `DirectRoute` is an ordinary route of the app's router, described in the OpenAPI document
from its endpoint's signature and served by FastAPI like any other. `DirectRoutes`, the
innermost of the app's own middleware, answers the requests to these routes that it can
take as given by calling the endpoint directly:

- its path parameters validate as declared;
- it has no body where the body is optional, or a JSON body (`application/json`) that parses
  and validates straight into the declared model in one step (pydantic's `validate_json`).

Every other request, to these routes or any other, goes on to the router (a body already
read is replayed), so every error answer about a request is the framework's own; errors the
endpoint raises are answered by the app's exception handlers, as in the framework.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any

from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match

from stoker.api.asgi import ASGIApp, Message, Receive, Scope, Send

#: Content types whose bodies a direct route parses itself (as sent, lower-cased).
JSON_TYPES = frozenset({b"application/json", b"application/json; charset=utf-8"})

ExceptionHandler = Callable[[Request, Exception], Any]


class DirectRoute(APIRoute):
    """A route that `DirectRoutes` may serve by calling its endpoint directly.

    The endpoint takes the `Request`, path parameters and at most one body parameter, and
    returns a `Response`; routes that need more of the framework (query parameters,
    dependencies) are plain `APIRoute`s.
    """

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        dependant = self.dependant
        others = (
            dependant.query_params,
            dependant.header_params,
            dependant.cookie_params,
            dependant.dependencies,
        )
        if dependant.request_param_name is None or any(others) or len(dependant.body_params) > 1:
            raise TypeError(
                f"{path}: a direct route takes the request, path parameters and one body only"
            )
        self.request_name = dependant.request_param_name
        self.path_fields = [
            (field.name, field.alias, _adapter(field.field_info)) for field in dependant.path_params
        ]
        body = self.body_field
        self.body_name = body.name if body is not None else None
        self.body_adapter = _adapter(body.field_info) if body is not None else None
        self.body_required = body is not None and body.field_info.is_required()

    async def arguments(
        self, scope: Scope, receive: Receive, send: Send, otherwise: ASGIApp
    ) -> dict[str, Any] | None:
        """The endpoint's arguments for this request, parsed as declared.

        None when the request needs nothing more: it was not taken as given and went to
        `otherwise` (its body replayed), or the client left before its body was complete.
        """
        values: dict[str, Any] = {}
        path_params = scope["path_params"]
        for name, alias, adapter in self.path_fields:
            try:
                values[name] = adapter.validate_python(path_params[alias])
            except ValidationError:
                await otherwise(scope, receive, send)
                return None
        if self.body_name is not None:
            raw = await read_body(receive)
            if raw is None:
                return None  # nobody to answer
            body = self.parse_body(scope, raw)
            if body is DECLINED:
                await otherwise(scope, replay(raw, receive), send)
                return None
            values[self.body_name] = body
        values[self.request_name] = Request(scope, receive, send)
        return values

    def parse_body(self, scope: Scope, raw: bytes) -> Any:
        """The body as declared; `DECLINED` when the framework should judge it."""
        if not raw:
            return DECLINED if self.body_required else None
        if content_type(scope) not in JSON_TYPES:
            return DECLINED
        assert self.body_adapter is not None
        try:
            return self.body_adapter.validate_json(raw)
        except Exception:
            # Not JSON, not valid, nested past the parser's limit, ...
            return DECLINED


#: `DirectRoute.parse_body`'s answer for a body that goes on to the framework.
DECLINED = object()


class DirectRoutes:
    """ASGI middleware: serves the app's `DirectRoute`s directly where it can.

    Added first, it runs inside every other middleware of the app, which therefore sees
    every request. The app's exception handlers answer what the endpoint raises (the
    catch-all one excepted: an unexpected error goes on up, as from any route).
    """

    def __init__(
        self,
        app: ASGIApp,
        routes: Sequence[BaseRoute],
        handlers: Mapping[Any, ExceptionHandler],
    ) -> None:
        self.app = app
        self.handlers = handlers
        self.routes: dict[str, list[DirectRoute]] = {}
        for route in routes:
            if isinstance(route, DirectRoute):
                for method in route.methods or ():
                    self.routes.setdefault(method, []).append(route)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._match(scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        # Parse, call, render, in this frame: the claim's task resumes through every frame
        # of the call chain each time it waits, so the chain is kept short.
        try:
            arguments = await route.arguments(scope, receive, send, self.app)
            if arguments is not None:
                response: Response = await route.endpoint(**arguments)
                await response(scope, receive, send)
        except Exception as exc:
            await self._answer(exc, scope, receive, send)

    def _match(self, scope: Scope) -> DirectRoute | None:
        """The direct route for this request (its path parameters put in `scope`), if any."""
        if scope["type"] == "http":
            for route in self.routes.get(scope["method"], ()):
                match, child_scope = route.matches(scope)
                if match is Match.FULL:
                    scope.update(child_scope)
                    return route
        return None

    async def _answer(self, exc: Exception, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer `exc` by the handler of its most specific class, as the framework does."""
        for cls in type(exc).__mro__:
            if cls is Exception:
                break
            handler = self.handlers.get(cls)
            if handler is not None:
                response: Response = await handler(Request(scope, receive), exc)
                await response(scope, receive, send)
                return
        raise exc


def _adapter(field_info: FieldInfo) -> TypeAdapter[Any]:
    """A validator of one declared parameter: its type with its constraints."""
    declared: Any = field_info.annotation
    if field_info.metadata:
        declared = Annotated[(declared, *field_info.metadata)]
    return TypeAdapter(declared)


def content_type(scope: Scope) -> bytes | None:
    """The request's content type, lower-cased, with one space after each `;`."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return bytes(value).lower().replace(b"; ", b";").replace(b";", b"; ")
    return None


async def read_body(receive: Receive) -> bytes | None:
    """The whole body; None if the client disconnected first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """`receive` as if the body had not been read yet."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
