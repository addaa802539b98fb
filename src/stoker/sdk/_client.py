"""`Client` and `AsyncClient`: thin httpx clients of the stoker API (DESIGN.md §7).

A session is a claim held for the duration of a `with` block::

    with stoker.Client() as client:
        with client.claim(pool="demo", org="acme", config={"role": "ro"}) as session:
            httpx.get(session.endpoint, headers=session.headers)

The lease is renewed in the background (every third of it) while the block runs, and the
claim is released on exit, also when the block raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Generator, Mapping
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx

from stoker.sdk._errors import (
    ClaimConflict,
    NotFound,
    ServerUnreachable,
    StokerError,
    error_from_response,
)
from stoker.sdk._models import ClaimInfo, PoolInfo, WorkerInfo

DEFAULT_URL = "http://127.0.0.1:8080"
#: Longest claim wait the server accepts; bounds the read timeout of a claim request.
MAX_CLAIM_WAIT_S = 3600.0
#: Renew when this fraction of the lease has passed.
RENEW_FRACTION = 1 / 3
#: Never renew more often than this (a lease of 1 s still leaves room for a slow answer).
MIN_RENEW_INTERVAL_S = 0.05


def _claim_body(
    pool: str,
    org: str,
    mode: str | None,
    timeout_s: float | None,
    lease_s: float | None,
    ttl_s: float | None,
    config: Mapping[str, Any] | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"pool": pool, "org": org}
    for key, value in (
        ("mode", mode),
        ("timeout_s", timeout_s),
        ("lease_s", lease_s),
        ("ttl_s", ttl_s),
    ):
        if value is not None:
            body[key] = value
    if config:
        body["config"] = dict(config)
    return body


def _claim_path(claim_id: str) -> str:
    return f"/v1/claims/{quote(claim_id, safe='')}"


class _Settings:
    """What both clients share: base URL, token and timeouts."""

    def __init__(self, url: str | None, token: str | None, timeout: float) -> None:
        self.url = (url or os.environ.get("STOKER_URL") or DEFAULT_URL).rstrip("/")
        self.token = token if token is not None else os.environ.get("STOKER_TOKEN") or None
        self.timeout = timeout
        self.headers = {"Accept": "application/json, application/problem+json"}
        if self.token:
            self.headers["Authorization"] = f"Bearer {self.token}"

    def claim_timeout(self, timeout_s: float | None) -> httpx.Timeout:
        # The server holds the request while it waits for a worker: read past that wait.
        wait = MAX_CLAIM_WAIT_S if timeout_s is None else timeout_s
        return httpx.Timeout(self.timeout, read=wait + self.timeout)

    def unreachable(self, exc: httpx.TransportError) -> ServerUnreachable:
        if isinstance(exc, httpx.TimeoutException):
            return ServerUnreachable(f"no answer from stoker at {self.url} in time ({exc!r})")
        return ServerUnreachable(f"cannot reach stoker at {self.url}: {exc}")


def _parse(response: httpx.Response) -> Any:
    if response.is_success:
        try:
            return response.json()
        except ValueError as exc:
            raise StokerError(
                f"the server answered {response.status_code} with a body that is not JSON",
                status=response.status_code,
            ) from exc
    raise error_from_response(response)


def _renew_interval(lease_s: float) -> float:
    return max(MIN_RENEW_INTERVAL_S, lease_s * RENEW_FRACTION)


# -- sync -----------------------------------------------------------------------------------


class Client:
    """Synchronous client. `url` defaults to `$STOKER_URL` or http://127.0.0.1:8080 and
    `token` to `$STOKER_TOKEN`; `timeout` bounds every request but a claim's wait."""

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._settings = _Settings(url, token, timeout)
        self._http = httpx.Client(
            base_url=self._settings.url,
            headers=self._settings.headers,
            timeout=timeout,
            transport=transport,
            trust_env=False,
        )

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self._settings.url

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        timeout: httpx.Timeout | None = None,
    ) -> Any:
        try:
            response = self._http.request(
                method,
                path,
                json=json,
                params=params,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.TransportError as exc:
            raise self._settings.unreachable(exc) from None
        return _parse(response)

    def create_claim(
        self,
        pool: str,
        org: str,
        *,
        mode: str | None = None,
        timeout_s: float | None = None,
        lease_s: float | None = None,
        ttl_s: float | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> ClaimInfo:
        """Claim a worker and return the claim; nothing renews or releases it."""
        body = _claim_body(pool, org, mode, timeout_s, lease_s, ttl_s, config)
        answer = self._request(
            "POST", "/v1/claims", json=body, timeout=self._settings.claim_timeout(timeout_s)
        )
        return ClaimInfo.from_json(answer)

    def claim(
        self,
        pool: str,
        org: str,
        *,
        mode: str | None = None,
        timeout_s: float | None = None,
        lease_s: float | None = None,
        ttl_s: float | None = None,
        config: Mapping[str, Any] | None = None,
        renew: bool = True,
    ) -> Session:
        """Claim a worker for a session: use as `with client.claim(...) as session:`.

        The lease is renewed in the background (unless `renew=False`) and the claim is
        released when the block ends, also on an exception.
        """
        info = self.create_claim(
            pool, org, mode=mode, timeout_s=timeout_s, lease_s=lease_s, ttl_s=ttl_s, config=config
        )
        return Session(self, info, renew=renew)

    def get_claim(self, claim_id: str) -> ClaimInfo:
        """A claim by id."""
        return ClaimInfo.from_json(self._request("GET", _claim_path(claim_id)))

    def renew(self, claim_id: str, lease_s: float | None = None) -> ClaimInfo:
        """Extend a claim's lease by `lease_s` (default: its own) from now."""
        body = {"lease_s": lease_s} if lease_s is not None else None
        return ClaimInfo.from_json(
            self._request("POST", _claim_path(claim_id) + "/renew", json=body)
        )

    def release(self, claim_id: str) -> ClaimInfo:
        """Release a claim (a claim that already ended is returned as it is)."""
        return ClaimInfo.from_json(self._request("DELETE", _claim_path(claim_id)))

    def pools(self) -> list[PoolInfo]:
        """Every pool."""
        return [PoolInfo.from_json(p) for p in self._request("GET", "/v1/pools")["pools"]]

    def pool(self, name: str) -> PoolInfo:
        """One pool by name."""
        return PoolInfo.from_json(self._request("GET", f"/v1/pools/{quote(name, safe='')}"))

    def workers(
        self,
        *,
        pool: str | None = None,
        state: str | None = None,
        org: str | None = None,
        limit: int | None = None,
    ) -> list[WorkerInfo]:
        """Workers (admin token): live ones, or those in `state`."""
        params = {
            k: v
            for k, v in (("pool", pool), ("state", state), ("org", org), ("limit", limit))
            if v is not None
        }
        answer = self._request("GET", "/v1/workers", params=params)
        return [WorkerInfo.from_json(w) for w in answer["workers"]]

    def ready(self) -> bool:
        """True when the server answers `/readyz` with 200."""
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False


class Session:
    """A claimed worker for the duration of a `with` block (see `Client.claim`)."""

    def __init__(self, client: Client, claim: ClaimInfo, *, renew: bool = True) -> None:
        self._client = client
        self._claim = claim
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._released: ClaimInfo | None = None
        #: The last renewal failure (None while renewals succeed). A `ClaimConflict` or
        #: `NotFound` here means the session ended on the server (lease expired, worker lost).
        self.renewal_error: StokerError | None = None
        self._renewer: threading.Thread | None = None
        if renew:
            self._renewer = threading.Thread(
                target=self._renew_loop, name=f"stoker-renew-{claim.id}", daemon=True
            )
            self._renewer.start()

    # -- what the session holds -------------------------------------------------------------

    @property
    def claim(self) -> ClaimInfo:
        """The latest state of the claim (updated by each renewal)."""
        return self._claim

    @property
    def id(self) -> str:
        """The claim id."""
        return self._claim.id

    @property
    def endpoint(self) -> str:
        """Base URL of the worker."""
        return self._claim.worker.endpoint

    @property
    def token(self) -> str | None:
        """The session token the worker demands."""
        return self._claim.worker.token

    @property
    def worker_id(self) -> str:
        """The worker's id."""
        return self._claim.worker.id

    @property
    def headers(self) -> dict[str, str]:
        """Headers that authenticate a request to the worker."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    # -- lease ------------------------------------------------------------------------------

    def _renew_loop(self) -> None:
        interval = _renew_interval(self._claim.lease_s)
        while not self._stop.wait(interval):
            try:
                renewed = self._client.renew(self._claim.id)
            except (ClaimConflict, NotFound) as exc:
                # The session ended on the server; renewing again cannot bring it back.
                self.renewal_error = exc
                return
            except StokerError as exc:
                # Transient (server restarting, network): retry sooner, within the lease.
                self.renewal_error = exc
                interval = _renew_interval(self._claim.lease_s) / 2
                continue
            with self._lock:
                if self._released is None:
                    self._claim = renewed
            self.renewal_error = None
            interval = _renew_interval(renewed.lease_s)

    def renew(self, lease_s: float | None = None) -> ClaimInfo:
        """Renew now (the background renewal does this by itself)."""
        renewed = self._client.renew(self._claim.id, lease_s)
        self._claim = renewed
        return renewed

    def _stop_renewing(self) -> None:
        self._stop.set()
        renewer = self._renewer
        if renewer is not None and renewer is not threading.current_thread():
            renewer.join()

    def release(self) -> ClaimInfo:
        """Stop renewing and release the claim (once; later calls return the same)."""
        self._stop_renewing()
        with self._lock:
            if self._released is not None:
                return self._released
        released = self._client.release(self._claim.id)
        with self._lock:
            self._released = self._claim = released
        return released

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.release()
        except StokerError as error:
            if exc is None:
                raise
            # The block's own exception matters more; keep the release failure as a note.
            exc.add_note(f"stoker: releasing claim {self.id} failed too: {error}")


# -- async ----------------------------------------------------------------------------------


class AsyncClient:
    """Asynchronous client; the same methods as `Client`, awaited."""

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._settings = _Settings(url, token, timeout)
        self._http = httpx.AsyncClient(
            base_url=self._settings.url,
            headers=self._settings.headers,
            timeout=timeout,
            transport=transport,
            trust_env=False,
        )

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self._settings.url

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        timeout: httpx.Timeout | None = None,
    ) -> Any:
        try:
            response = await self._http.request(
                method,
                path,
                json=json,
                params=params,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.TransportError as exc:
            raise self._settings.unreachable(exc) from None
        return _parse(response)

    async def create_claim(
        self,
        pool: str,
        org: str,
        *,
        mode: str | None = None,
        timeout_s: float | None = None,
        lease_s: float | None = None,
        ttl_s: float | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> ClaimInfo:
        """Claim a worker and return the claim; nothing renews or releases it."""
        body = _claim_body(pool, org, mode, timeout_s, lease_s, ttl_s, config)
        answer = await self._request(
            "POST", "/v1/claims", json=body, timeout=self._settings.claim_timeout(timeout_s)
        )
        return ClaimInfo.from_json(answer)

    def claim(
        self,
        pool: str,
        org: str,
        *,
        mode: str | None = None,
        timeout_s: float | None = None,
        lease_s: float | None = None,
        ttl_s: float | None = None,
        config: Mapping[str, Any] | None = None,
        renew: bool = True,
    ) -> AsyncClaim:
        """Claim a worker for a session: `async with client.claim(...) as session:`.

        Renews the lease in a background task and releases on exit, also on an exception.
        `await client.claim(...)` returns the session without the block (release it).
        """
        body = _claim_body(pool, org, mode, timeout_s, lease_s, ttl_s, config)
        return AsyncClaim(self, body, timeout_s, renew)

    async def get_claim(self, claim_id: str) -> ClaimInfo:
        """A claim by id."""
        return ClaimInfo.from_json(await self._request("GET", _claim_path(claim_id)))

    async def renew(self, claim_id: str, lease_s: float | None = None) -> ClaimInfo:
        """Extend a claim's lease by `lease_s` (default: its own) from now."""
        body = {"lease_s": lease_s} if lease_s is not None else None
        answer = await self._request("POST", _claim_path(claim_id) + "/renew", json=body)
        return ClaimInfo.from_json(answer)

    async def release(self, claim_id: str) -> ClaimInfo:
        """Release a claim (a claim that already ended is returned as it is)."""
        return ClaimInfo.from_json(await self._request("DELETE", _claim_path(claim_id)))

    async def pools(self) -> list[PoolInfo]:
        """Every pool."""
        answer = await self._request("GET", "/v1/pools")
        return [PoolInfo.from_json(p) for p in answer["pools"]]

    async def pool(self, name: str) -> PoolInfo:
        """One pool by name."""
        return PoolInfo.from_json(await self._request("GET", f"/v1/pools/{quote(name, safe='')}"))

    async def workers(
        self,
        *,
        pool: str | None = None,
        state: str | None = None,
        org: str | None = None,
        limit: int | None = None,
    ) -> list[WorkerInfo]:
        """Workers (admin token): live ones, or those in `state`."""
        params = {
            k: v
            for k, v in (("pool", pool), ("state", state), ("org", org), ("limit", limit))
            if v is not None
        }
        answer = await self._request("GET", "/v1/workers", params=params)
        return [WorkerInfo.from_json(w) for w in answer["workers"]]

    async def ready(self) -> bool:
        """True when the server answers `/readyz` with 200."""
        try:
            return (await self._http.get("/readyz")).status_code == 200
        except httpx.TransportError:
            return False


class AsyncClaim:
    """A pending claim: `async with` it for a session, or await it for the session."""

    def __init__(
        self, client: AsyncClient, body: dict[str, Any], timeout_s: float | None, renew: bool
    ) -> None:
        self._client = client
        self._body = body
        self._timeout_s = timeout_s
        self._renew = renew
        self._session: AsyncSession | None = None

    async def _open(self) -> AsyncSession:
        answer = await self._client._request(
            "POST",
            "/v1/claims",
            json=self._body,
            timeout=self._client._settings.claim_timeout(self._timeout_s),
        )
        return AsyncSession(self._client, ClaimInfo.from_json(answer), renew=self._renew)

    def __await__(self) -> Generator[Any, None, AsyncSession]:
        return self._open().__await__()

    async def __aenter__(self) -> AsyncSession:
        self._session = await self._open()
        return self._session

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        try:
            await session.release()
        except StokerError as error:
            if exc is None:
                raise
            exc.add_note(f"stoker: releasing claim {session.id} failed too: {error}")


class AsyncSession:
    """A claimed worker renewed by a background task until released."""

    def __init__(self, client: AsyncClient, claim: ClaimInfo, *, renew: bool = True) -> None:
        self._client = client
        self._claim = claim
        self._released: ClaimInfo | None = None
        #: The last renewal failure (None while renewals succeed); see `Session`.
        self.renewal_error: StokerError | None = None
        self._renewer: asyncio.Task[None] | None = None
        if renew:
            self._renewer = asyncio.get_running_loop().create_task(
                self._renew_loop(), name=f"stoker-renew-{claim.id}"
            )

    @property
    def claim(self) -> ClaimInfo:
        """The latest state of the claim."""
        return self._claim

    @property
    def id(self) -> str:
        """The claim id."""
        return self._claim.id

    @property
    def endpoint(self) -> str:
        """Base URL of the worker."""
        return self._claim.worker.endpoint

    @property
    def token(self) -> str | None:
        """The session token the worker demands."""
        return self._claim.worker.token

    @property
    def worker_id(self) -> str:
        """The worker's id."""
        return self._claim.worker.id

    @property
    def headers(self) -> dict[str, str]:
        """Headers that authenticate a request to the worker."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def _renew_loop(self) -> None:
        interval = _renew_interval(self._claim.lease_s)
        while True:
            await asyncio.sleep(interval)
            try:
                renewed = await self._client.renew(self._claim.id)
            except (ClaimConflict, NotFound) as exc:
                self.renewal_error = exc
                return
            except StokerError as exc:
                self.renewal_error = exc
                interval = _renew_interval(self._claim.lease_s) / 2
                continue
            if self._released is None:
                self._claim = renewed
            self.renewal_error = None
            interval = _renew_interval(renewed.lease_s)

    async def renew(self, lease_s: float | None = None) -> ClaimInfo:
        """Renew now (the background task does this by itself)."""
        self._claim = await self._client.renew(self._claim.id, lease_s)
        return self._claim

    async def release(self) -> ClaimInfo:
        """Stop renewing and release the claim (once; later calls return the same)."""
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
        if self._released is None:
            self._released = self._claim = await self._client.release(self._claim.id)
        return self._released
