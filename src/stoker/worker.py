"""The worker side of stoker's worker protocol, for Python workers: standard library only.

A worker is an HTTP server the control plane starts, probes and activates for one org
(`docs/worker-protocol.md`). This module answers the protocol's part of each request,
whatever HTTP server the worker runs on:

    from stoker.worker import WorkerProtocol

    protocol = WorkerProtocol.from_env()       # STOKER_WORKER_ID, STOKER_ACTIVATION_SECRET
    reply = protocol.answer(method, path, headers, body)
    if reply is not None:                      # /healthz, /activate, or a refusal (401)
        send(reply.status, reply.headers, reply.json())
    else:                                      # the tenant's request, token checked
        ...                                    # serve it

- `GET /healthz` is 200 once the worker is ready (`protocol.ready`), else 503.
- `POST /activate` is 401 unless its `Stoker-Signature` header is the HMAC of the request
  under the worker's activation secret (`signature`); then 400 for a malformed body, 409
  for another worker's id, a second org or an epoch not newer than the one held, and 200
  binds the org and its session token (a newer epoch replaces the token, revoking the old).
- Every other request needs `Authorization: Bearer <token>` once activated (401 else).

It imports nothing but the standard library (hundreds of workers run on one machine, and
a worker image need not install stoker's server): the file may also be copied as is.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

#: The environment variable holding the worker's activation secret.
SECRET_ENV = "STOKER_ACTIVATION_SECRET"
#: The environment variable holding the worker's id.
WORKER_ID_ENV = "STOKER_WORKER_ID"
#: The request header carrying the signature of a control-plane request.
SIGNATURE_HEADER = "Stoker-Signature"
#: The signature scheme: HMAC-SHA256 over method, path and body (see `signature`).
SIGNATURE_SCHEME = "v1"

#: The W3C Trace Context header an activation carries when the control plane traces.
TRACEPARENT_HEADER = "traceparent"

#: The protocol's own paths (the control plane's channel and the readiness probe).
HEALTHZ_PATH = "/healthz"
ACTIVATE_PATH = "/activate"


def _phrase(status: int) -> str:
    """The reason phrase of an HTTP status ("Error" for one the standard does not name)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


class MissingSecret(RuntimeError):
    """The worker was started without its activation secret (or without its id)."""


def signature(secret: str, method: str, path: str, body: bytes) -> str:
    """The `Stoker-Signature` value of a request: `v1=<hex HMAC-SHA256>`.

    The MAC is keyed with the activation secret (its UTF-8 bytes) over
    `METHOD + "\\n" + path + "\\n" + body`, the body being the exact bytes sent. The body
    names the worker and the epoch, so a signature is good for one worker (each has its
    own secret) and one activation.
    """
    # One call of the C implementation: the same MAC as `hmac.new(...).update(...)`.
    message = f"{method.upper()}\n{path}\n".encode() + body
    return f"{SIGNATURE_SCHEME}={hmac.digest(secret.encode(), message, 'sha256').hex()}"


def signature_valid(secret: str, method: str, path: str, body: bytes, given: str | None) -> bool:
    """True when `given` is the signature of this request; compared in constant time."""
    if not given:
        return False
    expected = signature(secret, method, path, body)
    return hmac.compare_digest(given.strip().encode(), expected.encode())


def header(headers: Mapping[str, str], name: str) -> str | None:
    """The value of header `name` in `headers`, whatever the case of its key."""
    wanted = name.lower()
    for key, value in headers.items():
        if key.lower() == wanted:
            return value
    return None


@dataclass(frozen=True, slots=True)
class Reply:
    """The protocol's answer to one request: a status, a JSON body, extra headers."""

    status: int
    body: Mapping[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def content_type(self) -> str:
        """`application/problem+json` for an error, else `application/json`."""
        return "application/problem+json" if self.status >= 400 else "application/json"

    def json(self) -> bytes:
        """The body, serialised."""
        return json.dumps(self.body, separators=(",", ":")).encode()


def problem(status: int, code: str, detail: str, headers: Mapping[str, str] | None = None) -> Reply:
    """An RFC 9457 problem answer; `code` is a stable machine-readable extension member."""
    body = {
        "type": "about:blank",
        "title": _phrase(status),
        "status": status,
        "detail": detail,
        "code": code,
    }
    return Reply(status, body, dict(headers or {}))


@dataclass(slots=True)
class WorkerProtocol:
    """One worker's side of the protocol: its identity, secret and org binding."""

    worker_id: str
    #: The activation secret the control plane handed this worker (never logged).
    secret: str = field(repr=False)
    #: False while the worker's engine is still starting: /healthz answers 503.
    ready: bool = True
    org: str | None = None
    epoch: int | None = None
    token: str | None = field(default=None, repr=False)
    config: dict[str, Any] = field(default_factory=dict, repr=False)
    #: The W3C trace context (`traceparent`) the last accepted activation carried, when
    #: the control plane traces: a worker that traces continues the claim's trace from it.
    traceparent: str | None = None

    def __post_init__(self) -> None:
        # The first HMAC of a process initialises the crypto library (0.1 to several ms of
        # CPU): paid here, while the worker starts, rather than by its first activation,
        # when a burst of claims activates every warm worker at once.
        signature(self.secret, "POST", ACTIVATE_PATH, b"")

    @classmethod
    def from_env(
        cls, worker_id: str | None = None, environ: Mapping[str, str] | None = None
    ) -> WorkerProtocol:
        """The protocol of a worker stoker started: its id and secret from the environment.

        `worker_id` overrides `STOKER_WORKER_ID`. Raises `MissingSecret` when either is
        missing: a worker that cannot check activations must not start.
        """
        environ = os.environ if environ is None else environ
        worker_id = worker_id or environ.get(WORKER_ID_ENV)
        if not worker_id:
            raise MissingSecret(f"no worker id: pass one or set {WORKER_ID_ENV}")
        secret = environ.get(SECRET_ENV)
        if not secret:
            raise MissingSecret(
                f"{SECRET_ENV} is not set: the control plane hands each worker its "
                "activation secret in the environment"
            )
        return cls(worker_id=worker_id, secret=secret)

    def answer(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes
    ) -> Reply | None:
        """The protocol's answer to a request, or None when the worker serves it itself.

        `path` excludes the query string; `headers` may use any case. None means the
        request is neither `/healthz` nor `/activate` and is authorized (the current
        session's bearer token, or no session yet).
        """
        if path == HEALTHZ_PATH:
            if method != "GET":
                return problem(405, "method-not-allowed", f"{method} not allowed", {"Allow": "GET"})
            if not self.ready:
                return problem(503, "starting", "the worker is still starting")
            return Reply(200, {"status": "ok"})
        if path == ACTIVATE_PATH:
            if method != "POST":
                allow = {"Allow": "POST"}
                return problem(405, "method-not-allowed", f"{method} not allowed", allow)
            reply = self.activate(method, path, body, header(headers, SIGNATURE_HEADER))
            if reply.status == 200:
                # Not covered by the signature: it places the activation in a trace and
                # grants nothing.
                self.traceparent = header(headers, TRACEPARENT_HEADER)
            return reply
        if not self.authorized(header(headers, "Authorization")):
            challenge = {"WWW-Authenticate": "Bearer"}
            return problem(401, "unauthorized", "missing or wrong bearer token", challenge)
        return None

    def activate(self, method: str, path: str, body: bytes, signed: str | None) -> Reply:
        """Apply a signed activation; nothing changes unless the answer is 200.

        401 without a valid signature (checked first, so an unsigned caller learns
        nothing); 400 for a malformed body; 409 for another worker's id, a second org, or
        an epoch not strictly newer than the one held. The same org at a newer epoch
        replaces the token, which revokes the previous session's.
        """
        if not signature_valid(self.secret, method, path, body, signed):
            return problem(
                401,
                "activation-unauthenticated",
                f"missing or wrong {SIGNATURE_HEADER}: activations come from the control plane",
            )
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, ValueError):
            return problem(400, "invalid-json", "the body is not valid JSON")
        if not isinstance(payload, dict):
            return problem(400, "invalid-activation", "the body must be a JSON object")
        worker_id = payload.get("worker_id")
        org = payload.get("org")
        epoch = payload.get("epoch")
        token = payload.get("token")
        config = payload.get("config", {})
        if not isinstance(worker_id, str) or not worker_id:
            return problem(400, "invalid-activation", "worker_id must be a non-empty string")
        if not isinstance(org, str) or not org:
            return problem(400, "invalid-activation", "org must be a non-empty string")
        # bool is an int subclass; an epoch of `true` is malformed, not epoch 1.
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            return problem(400, "invalid-activation", "epoch must be a non-negative integer")
        if not isinstance(token, str) or not token:
            return problem(400, "invalid-activation", "token must be a non-empty string")
        if not isinstance(config, dict):
            return problem(400, "invalid-activation", "config must be an object")
        if worker_id != self.worker_id:
            return problem(409, "wrong-worker", f"this is worker {self.worker_id!r}")
        if self.org is not None and org != self.org:
            return problem(409, "second-org", "worker already activated for another org")
        if self.epoch is not None and epoch <= self.epoch:
            return problem(409, "stale-epoch", f"epoch {epoch} is not newer than {self.epoch}")
        self.org, self.epoch, self.token, self.config = org, epoch, token, config
        return Reply(200, {"worker_id": self.worker_id, "org": org, "epoch": epoch})

    def authorized(self, authorization: str | None) -> bool:
        """True before activation, else only for `Bearer <current token>`."""
        if self.token is None:
            return True
        if authorization is None:
            return False
        scheme, _, credential = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        # Constant-time, so the token cannot be guessed byte by byte from response times.
        return hmac.compare_digest(credential.strip().encode(), self.token.encode())


__all__ = [
    "ACTIVATE_PATH",
    "HEALTHZ_PATH",
    "SECRET_ENV",
    "SIGNATURE_HEADER",
    "SIGNATURE_SCHEME",
    "TRACEPARENT_HEADER",
    "WORKER_ID_ENV",
    "MissingSecret",
    "Reply",
    "WorkerProtocol",
    "header",
    "problem",
    "signature",
    "signature_valid",
]
