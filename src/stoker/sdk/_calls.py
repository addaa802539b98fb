"""The API's calls without I/O: what each call sends and how its answer is read.

`Client` and `AsyncClient` (both on `BaseClient`) only send what `Calls` builds, each
through its own httpx client, so paths, bodies, timeouts and the mapping of answers onto
results and exceptions exist once, whichever way the request travels (the sans-I/O shape
of h11 and httpx).
"""

from __future__ import annotations

import abc
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypedDict, TypeVar
from urllib.parse import quote

import httpx

from stoker.sdk._errors import InvalidRequest, ServerUnreachable, StokerError, error_from_response
from stoker.sdk._models import (
    ClaimInfo,
    DeletedPool,
    Listing,
    PoolInfo,
    RolloutInfo,
    WorkerInfo,
)
from stoker.sdk._retry import Retries

T = TypeVar("T")
TransportT = TypeVar("TransportT", httpx.BaseTransport, httpx.AsyncBaseTransport)

DEFAULT_URL = "http://127.0.0.1:8080"
#: How long a claim sent without `timeout_s` is waited for (the server's default
#: `claim_timeout_s` of a pool); pass `timeout_s` for a pool that waits longer.
DEFAULT_CLAIM_WAIT_S = 30.0
#: The header that makes a claim safe to send again (the server answers with one claim).
IDEMPOTENCY_KEY = "Idempotency-Key"
#: Connections kept for the background renewals of a client's sessions, apart from the
#: others, so that claims waiting for workers never hold a renewal up.
RENEWAL_CONNECTIONS = 8
#: The readiness probe: 200 once the server serves claims.
READY_PATH = "/readyz"


class ClaimOptions(TypedDict, total=False):
    """How a claim may be served; each option left out (or None) takes the server's default."""

    #: prefer_warm, require_warm or cold.
    mode: str | None
    #: Seconds to wait for a worker.
    timeout_s: float | None
    #: Lease length in seconds: the claim expires unless renewed within it.
    lease_s: float | None
    #: Seconds the worker stays parked (hot_idle) for the org after release before it
    #: retires; by default the org's or the pool's TTL.
    ttl_s: float | None
    #: Handed to the worker at activation.
    config: Mapping[str, Any] | None


class WorkerFilters(TypedDict, total=False):
    """Which workers `workers()` lists; each filter left out (or None) selects all."""

    pool: str | None
    #: Live workers when left out.
    state: str | None
    org: str | None
    #: The most rows in the answer (a page of `iter_workers`).
    limit: int | None
    #: The rows after the last of a previous page (its `next`, see `Listing`).
    after: str | None


class ClaimFilters(TypedDict, total=False):
    """Which claims `claims()` lists; each filter left out (or None) takes the server's
    default."""

    #: bound (the open claims, when left out), released, expired or failed.
    state: str | None
    #: The most claims in the answer (a page of `iter_claims`).
    limit: int | None
    #: The claims after the last of a previous page (its `next`, see `Listing`).
    after: str | None


class PoolChanges(TypedDict, total=False):
    """What `update_pool` changes (admin token); each left out keeps its value."""

    warm_target: int
    max_workers: int
    max_workers_per_org: int
    hot_idle_ttl: float
    max_ttl: float
    min_hot_idle: int
    lease_s: float
    claim_timeout_s: float
    scale_down_delay: float
    max_claim_s: float
    #: The generation the change is made from (`PoolInfo.generation`): a pool changed since
    #: answers 412 (`StaleGeneration`) and keeps the other change.
    generation: int


class TemplateChanges(TypedDict, total=False):
    """Fields of a pool's new template (`start_rollout`), laid over its stable one: a
    process pool's `command`, `env`, `cwd` and `memory_mb`, a pod pool's `pod:` keys (see
    the config file). The server validates them as its config does, strictly: a field that
    does not fit is `InvalidRequest` (422), naming it."""

    #: A process's command line (never run through a shell): the program, then its
    #: arguments, none empty; `{port}` and `{worker_id}` are replaced.
    command: list[str]
    #: Environment variables, names to text.
    env: dict[str, str]
    cwd: str | None
    memory_mb: int
    #: A pod's image (its `command` above replaces the image's entrypoint).
    image: str
    args: list[str]
    cpu: str
    memory: str
    port: int


_CLAIM_OPTIONS = tuple(ClaimOptions.__annotations__)
_POOL_CHANGES = tuple(PoolChanges.__annotations__)
_WORKER_FILTERS = tuple(WorkerFilters.__annotations__)
_CLAIM_FILTERS = tuple(ClaimFilters.__annotations__)


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request to send, and how to read its answer into a `T`."""

    method: str
    path: str
    timeout: httpx.Timeout
    read: Callable[[Any], T]
    json: Any = None
    params: Mapping[str, Any] | None = None
    headers: Mapping[str, str] | None = None
    #: Seconds this call may take beyond the retry deadline (a claim's wait).
    wait_s: float = 0.0

    def timeout_within(self, left: float) -> httpx.Timeout:
        """The timeout of one try with `left` seconds to the call's deadline."""
        left = max(left, 0.001)
        t = self.timeout
        return httpx.Timeout(
            connect=_at_most(t.connect, left),
            read=_at_most(t.read, left),
            write=_at_most(t.write, left),
            pool=_at_most(t.pool, left),
        )

    def answer(self, response: httpx.Response) -> T:
        """The result of a response, or the `StokerError` of an error answer."""
        if not response.is_success:
            raise error_from_response(response)
        try:
            body = response.json()
        except ValueError as exc:
            raise StokerError(
                f"the server answered {response.status_code} with a body that is not JSON",
                status=response.status_code,
            ) from exc
        return self.read(body)


class Calls:
    """Builds every call of the API to one server: its base URL, token and timeouts.

    `url` defaults to `$STOKER_URL` or http://127.0.0.1:8080 and `token` to
    `$STOKER_TOKEN`; `timeout` bounds every request but a claim's wait.
    """

    def __init__(
        self, url: str | None, token: str | None, timeout: float, trust_env: bool = True
    ) -> None:
        self.url = (url or os.environ.get("STOKER_URL") or DEFAULT_URL).rstrip("/")
        self.token = token if token is not None else os.environ.get("STOKER_TOKEN") or None
        self.timeout = timeout
        #: What every request carries, set once on the httpx client.
        self.headers = {"Accept": "application/json, application/problem+json"}
        if self.token:
            self.headers["Authorization"] = f"Bearer {self.token}"
        self._default_timeout = httpx.Timeout(timeout)
        self.trust_env = trust_env

    def http_options(self, *, renewals: bool = False) -> dict[str, Any]:
        """The settings of the httpx client that sends the calls (`renewals`: of the one
        that sends background renewals, with its own few connections)."""
        options: dict[str, Any] = {
            "base_url": self.url,
            "headers": self.headers,
            "timeout": self.timeout,
            # The environment's proxy (HTTPS_PROXY, NO_PROXY) and CA bundle
            # (SSL_CERT_FILE, SSL_CERT_DIR) apply, as to any HTTP client of the application.
            "trust_env": self.trust_env,
        }
        if renewals:
            options["limits"] = httpx.Limits(
                max_connections=RENEWAL_CONNECTIONS, max_keepalive_connections=RENEWAL_CONNECTIONS
            )
        return options

    def create_claim(self, pool: str, org: str, options: ClaimOptions) -> Call[ClaimInfo]:
        """`POST /v1/claims`: claim a worker."""
        given = _given(options, _CLAIM_OPTIONS, "claim option")
        config = given.pop("config", None)
        body: dict[str, Any] = {"pool": pool, "org": org, **given}
        if config:
            body["config"] = dict(config)
        # The server holds the request while it waits for a worker: read past that wait.
        timeout_s = given.get("timeout_s")
        wait = DEFAULT_CLAIM_WAIT_S if timeout_s is None else float(timeout_s)
        timeout = httpx.Timeout(self.timeout, read=wait + self.timeout)
        # One key per claim, sent again with each retry of it: never a second worker.
        headers = {IDEMPOTENCY_KEY: str(uuid.uuid4())}
        return Call(
            "POST",
            "/v1/claims",
            timeout,
            ClaimInfo.from_json,
            json=body,
            headers=headers,
            wait_s=wait,
        )

    def claims(self, filters: ClaimFilters) -> Call[Listing[ClaimInfo]]:
        """`GET /v1/claims` with the filters that are set: one page, with its `next`."""
        params = _given(filters, _CLAIM_FILTERS, "claim filter")
        return Call("GET", "/v1/claims", self._default_timeout, _claim_page, params=params)

    def claim_pages(
        self, filters: ClaimFilters
    ) -> Callable[[str | None], Call[Listing[ClaimInfo]]]:
        """For each `after`, `GET /v1/claims` with the filters set, read as a `Listing`."""
        params = _given(filters, _CLAIM_FILTERS, "claim filter")
        return lambda after: Call(
            "GET", "/v1/claims", self._default_timeout, _claim_page, params=_after(params, after)
        )

    def get_claim(self, claim_id: str) -> Call[ClaimInfo]:
        """`GET /v1/claims/{id}`."""
        return Call("GET", _claim_path(claim_id), self._default_timeout, ClaimInfo.from_json)

    def renew(self, claim_id: str, lease_s: float | None) -> Call[ClaimInfo]:
        """`POST /v1/claims/{id}/renew`, for `lease_s` or the claim's own lease."""
        body = {"lease_s": lease_s} if lease_s is not None else None
        path = _claim_path(claim_id) + "/renew"
        return Call("POST", path, self._default_timeout, ClaimInfo.from_json, json=body)

    def release(self, claim_id: str) -> Call[ClaimInfo]:
        """`DELETE /v1/claims/{id}`."""
        return Call("DELETE", _claim_path(claim_id), self._default_timeout, ClaimInfo.from_json)

    def pools(self) -> Call[list[PoolInfo]]:
        """`GET /v1/pools`."""
        return Call("GET", "/v1/pools", self._default_timeout, _pools)

    def pool(self, name: str) -> Call[PoolInfo]:
        """`GET /v1/pools/{name}`."""
        return Call("GET", _pool_path(name), self._default_timeout, PoolInfo.from_json)

    def update_pool(self, name: str, changes: PoolChanges) -> Call[PoolInfo]:
        """`PATCH /v1/pools/{name}` with the changes that are set."""
        body = _given(changes, _POOL_CHANGES, "pool setting")
        path = _pool_path(name)
        return Call("PATCH", path, self._default_timeout, PoolInfo.from_json, json=body)

    def drain_pool(self, name: str, *, draining: bool = True) -> Call[PoolInfo]:
        """`POST /v1/pools/{name}/drain` (or `/undrain`)."""
        path = _pool_path(name) + ("/drain" if draining else "/undrain")
        return Call("POST", path, self._default_timeout, PoolInfo.from_json)

    def delete_pool(self, name: str, generation: int | None = None) -> Call[DeletedPool]:
        """`DELETE /v1/pools/{name}` (`If-Match: generation` when given)."""
        return Call(
            "DELETE",
            _pool_path(name),
            self._default_timeout,
            DeletedPool.from_json,
            headers=_if_match(generation),
        )

    def start_rollout(
        self,
        name: str,
        template: TemplateChanges | Mapping[str, Any],
        strategy: Mapping[str, Any] | None,
        generation: int | None = None,
    ) -> Call[RolloutInfo]:
        """`POST /v1/pools/{name}/rollouts` (`If-Match: generation` when given)."""
        body: dict[str, Any] = {"template": dict(template)}
        if strategy is not None:
            body["strategy"] = dict(strategy)
        path = _pool_path(name) + "/rollouts"
        return Call(
            "POST",
            path,
            self._default_timeout,
            RolloutInfo.from_json,
            json=body,
            headers=_if_match(generation),
        )

    def rollout(
        self,
        name: str,
        rollout_id: str,
        action: str | None = None,
        generation: int | None = None,
    ) -> Call[RolloutInfo]:
        """`GET /v1/pools/{name}/rollouts/{id}`, or `POST` its `action` (pause, resume,
        abort or promote; `If-Match: generation` when given)."""
        path = f"{_pool_path(name)}/rollouts/{quote(rollout_id, safe='')}"
        if action is None:
            return Call("GET", path, self._default_timeout, RolloutInfo.from_json)
        if action not in ROLLOUT_ACTIONS:
            raise ValueError(f"unknown rollout action {action!r}: one of {ROLLOUT_ACTIONS}")
        return Call(
            "POST",
            f"{path}/{action}",
            self._default_timeout,
            RolloutInfo.from_json,
            headers=_if_match(generation),
        )

    def pool_ledger(
        self, name: str, *, since: str | None, until: str | None, by: str | None
    ) -> Call[dict[str, Any]]:
        """`GET /v1/pools/{name}/ledger` (docs/warmth.md): the answer's JSON as it is."""
        params = {
            k: v for k, v in (("since", since), ("until", until), ("by", by)) if v is not None
        }
        path = _pool_path(name) + "/ledger"
        return Call("GET", path, self._default_timeout, _as_dict, params=params)

    def claim_log_pages(
        self, *, since: str | None, until: str | None, pool: str | None, limit: int
    ) -> Callable[[str | None], Call[Listing[dict[str, Any]]]]:
        """For each `after`, `GET /v1/claims/log` (docs/claim-log.md), read as a `Listing` of
        entries in the export form."""
        given = (("since", since), ("until", until), ("pool", pool))
        params: dict[str, Any] = {k: v for k, v in given if v is not None}
        params["limit"] = limit
        return lambda after: Call(
            "GET", "/v1/claims/log", self._default_timeout, _log_page, params=_after(params, after)
        )

    def workers(self, filters: WorkerFilters) -> Call[Listing[WorkerInfo]]:
        """`GET /v1/workers` with the filters that are set: one page, with its `next`."""
        params = _given(filters, _WORKER_FILTERS, "worker filter")
        return Call("GET", "/v1/workers", self._default_timeout, _worker_page, params=params)

    def worker_pages(
        self, filters: WorkerFilters
    ) -> Callable[[str | None], Call[Listing[WorkerInfo]]]:
        """For each `after`, `GET /v1/workers` with the filters set, read as a `Listing`."""
        params = _given(filters, _WORKER_FILTERS, "worker filter")
        return lambda after: Call(
            "GET", "/v1/workers", self._default_timeout, _worker_page, params=_after(params, after)
        )

    def unreachable(self, exc: httpx.TransportError) -> ServerUnreachable:
        """The error for a request that got no answer."""
        if isinstance(exc, httpx.TimeoutException):
            return ServerUnreachable(f"no answer from stoker at {self.url} in time ({exc!r})")
        return ServerUnreachable(f"cannot reach stoker at {self.url}: {exc}")


class BaseClient(abc.ABC, Generic[TransportT]):
    """What `Client` and `AsyncClient` share: the calls to one server (`Calls`, which says
    what `url`, `token` and `timeout` default to) and the two httpx clients that send them
    (one for the background renewals of sessions, one for every other call).

    `retries` says how a call that got no answer, a 429 or a 503 is sent again (see
    `Retries`); `trust_env=False` ignores the environment's proxy and CA settings;
    `transport` replaces httpx's network transport (tests pass an `httpx.MockTransport`).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        retries: Retries | None = None,
        trust_env: bool = True,
        transport: TransportT | None = None,
    ) -> None:
        self._calls = Calls(url, token, timeout, trust_env)
        self._retries = retries or Retries()
        self._connect(transport)

    @abc.abstractmethod
    def _connect(self, transport: TransportT | None) -> None:
        """Open the httpx clients the calls go through (sync or async, by subclass)."""

    def _budget(self, call: Call[Any], deadline_s: float | None) -> float:
        """Seconds a call may take with its retries."""
        if deadline_s is not None:
            return deadline_s
        return call.wait_s + self._retries.deadline_s

    def _failed(self, exc: Exception) -> StokerError:
        """The SDK's error for what a try raised (re-raises what is not a call's failure)."""
        if isinstance(exc, httpx.TransportError):
            return self._calls.unreachable(exc)
        if isinstance(exc, StokerError):
            return exc
        raise exc

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self._calls.url


def _at_most(value: float | None, left: float) -> float:
    return left if value is None else min(value, left)


def _claim_path(claim_id: str) -> str:
    # An empty id would name the collection (answered with a redirect) and `.` or `..`
    # another path once the URL is normalised: refused here, before anything is sent.
    if claim_id.strip(".") == "":
        raise InvalidRequest(f"invalid claim id {claim_id!r}: expected an id such as c-...")
    return f"/v1/claims/{quote(claim_id, safe='')}"


def _if_match(generation: int | None) -> dict[str, str] | None:
    """The `If-Match` header of a write made from `generation` (None: no header)."""
    return None if generation is None else {"If-Match": f'"{generation}"'}


#: What `rollout(..., action)` may ask of a rollout under way.
ROLLOUT_ACTIONS = ("pause", "resume", "abort", "promote")


def _pool_path(name: str) -> str:
    return f"/v1/pools/{quote(name, safe='')}"


def _pools(body: Any) -> list[PoolInfo]:
    return [PoolInfo.from_json(p) for p in body["pools"]]


def _claims(body: Any) -> list[ClaimInfo]:
    return [ClaimInfo.from_json(c) for c in body["claims"]]


def _workers(body: Any) -> list[WorkerInfo]:
    return [WorkerInfo.from_json(w) for w in body["workers"]]


def _claim_page(body: Any) -> Listing[ClaimInfo]:
    return Listing(_claims(body), body.get("next"))


def _worker_page(body: Any) -> Listing[WorkerInfo]:
    return Listing(_workers(body), body.get("next"))


def _as_dict(body: Any) -> dict[str, Any]:
    return dict(body)


def _log_page(body: Any) -> Listing[dict[str, Any]]:
    return Listing([dict(e) for e in body["entries"]], body.get("next"))


def _after(params: Mapping[str, Any], after: str | None) -> dict[str, Any]:
    """`params` for the page after `after` (the first page: None)."""
    return {**params, "after": after} if after is not None else dict(params)


def _given(options: Mapping[str, Any], keys: tuple[str, ...], what: str) -> dict[str, Any]:
    """The options that are set, in declaration order."""
    # Keyword arguments gathered into a TypedDict are checked by type checkers only; an
    # unknown one must still fail at run time, as it would in an explicit signature.
    unknown = options.keys() - set(keys)
    if unknown:
        raise TypeError(f"unexpected {what}: {', '.join(sorted(unknown))}")
    return {key: options[key] for key in keys if options.get(key) is not None}
