"""`AsyncClient`: the asynchronous client of the stoker API, the same calls awaited.

A session is a claim held for the duration of an `async with` block::

    async with stoker.AsyncClient() as client:
        async with client.claim(pool="demo", org="acme") as session:
            ...

What each call sends and how its answer reads is in `_calls`; this module only sends it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Generator, Mapping
from types import TracebackType
from typing import Any, TypeVar, Unpack

import httpx

from stoker.sdk._calls import (
    READY_PATH,
    BaseClient,
    Call,
    ClaimFilters,
    ClaimOptions,
    PoolChanges,
    TemplateChanges,
    WorkerFilters,
)
from stoker.sdk._errors import StokerError
from stoker.sdk._models import (
    ClaimInfo,
    DeletedPool,
    Listing,
    PoolInfo,
    RolloutInfo,
    WorkerInfo,
)
from stoker.sdk._session import OnLost, SessionState

T = TypeVar("T")


class AsyncClient(BaseClient[httpx.AsyncBaseTransport]):
    """Asynchronous client; the same methods as `Client`, awaited."""

    def _connect(self, transport: httpx.AsyncBaseTransport | None) -> None:
        self._http = httpx.AsyncClient(transport=transport, **self._calls.http_options())
        self._renewals = httpx.AsyncClient(
            transport=transport, **self._calls.http_options(renewals=True)
        )

    async def aclose(self) -> None:
        """Close the connection pools."""
        await self._http.aclose()
        await self._renewals.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(
        self,
        call: Call[T],
        *,
        deadline_s: float | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> T:
        """Send `call`, again on a retryable failure (`Retries`) until its deadline."""
        http = http or self._http
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._budget(call, deadline_s)
        attempt = 0
        while True:
            try:
                response = await http.request(
                    call.method,
                    call.path,
                    json=call.json,
                    params=call.params,
                    headers=call.headers,
                    timeout=call.timeout_within(deadline - loop.time()),
                )
                return call.answer(response)
            except (httpx.TransportError, StokerError) as exc:
                error = self._failed(exc)
            delay = self._retries.delay(attempt, error, deadline - loop.time())
            if delay is None:
                raise error
            await asyncio.sleep(delay)
            attempt += 1

    async def create_claim(self, pool: str, org: str, **options: Unpack[ClaimOptions]) -> ClaimInfo:
        """Claim a worker and return the claim; nothing renews or releases it.

        `options` (mode, timeout_s, lease_s, ttl_s, config) are those of `ClaimOptions`.
        """
        return await self._send(self._calls.create_claim(pool, org, options))

    def claim(
        self,
        pool: str,
        org: str,
        *,
        renew: bool = True,
        on_lost: OnLost | None = None,
        **options: Unpack[ClaimOptions],
    ) -> AsyncClaim:
        """Claim a worker for a session: `async with client.claim(...) as session:`.

        Renews the lease in a background task (over connections of its own) and releases
        on exit, also on an exception. A lost session calls `on_lost(error)` from the
        renewing task and makes the block's exit raise `SessionLost` (see `SessionState`).
        `await client.claim(...)` returns the session without the block (release it).
        """
        call = self._calls.create_claim(pool, org, options)
        return AsyncClaim(self, call, renew, on_lost)

    async def claims(self, **filters: Unpack[ClaimFilters]) -> Listing[ClaimInfo]:
        """Claims (admin token): the open ones, or those in `state` (see `ClaimFilters`);
        one page of at most `limit`, a list whose `next` is the `after` of the page after
        it (None at the end; see `Listing`)."""
        return await self._send(self._calls.claims(filters))

    def iter_claims(self, **filters: Unpack[ClaimFilters]) -> AsyncIterator[ClaimInfo]:
        """Every claim `claims` would list, oldest first (`async for`), fetched a page
        (`limit`) at a time as the iteration goes on."""
        return self._pages(self._calls.claim_pages(filters), filters.get("after"))

    async def get_claim(self, claim_id: str) -> ClaimInfo:
        """A claim by id."""
        return await self._send(self._calls.get_claim(claim_id))

    async def renew(self, claim_id: str, lease_s: float | None = None) -> ClaimInfo:
        """Extend a claim's lease by `lease_s` (default: its own) from now."""
        return await self._send(self._calls.renew(claim_id, lease_s))

    async def release(self, claim_id: str) -> ClaimInfo:
        """Release a claim (a claim that already ended is returned as it is)."""
        return await self._send(self._calls.release(claim_id))

    async def pools(self) -> list[PoolInfo]:
        """Every pool."""
        return await self._send(self._calls.pools())

    async def pool(self, name: str) -> PoolInfo:
        """One pool by name."""
        return await self._send(self._calls.pool(name))

    async def update_pool(self, name: str, **changes: Unpack[PoolChanges]) -> PoolInfo:
        """Change a pool's settings (admin token); in force on every replica within a
        janitor pass. The pool as changed."""
        return await self._send(self._calls.update_pool(name, changes))

    async def pool_ledger(
        self,
        name: str,
        *,
        since: str | None = None,
        until: str | None = None,
        by: str | None = None,
    ) -> dict[str, Any]:
        """What the pool's warmth cost and bought (admin token; docs/warmth.md): every
        replica's ledger in [since, until) per hour (and per `by`: "org" or "revision"),
        with `total`. Times are unix seconds or a duration before now ("24h", "7d")."""
        return await self._send(self._calls.pool_ledger(name, since=since, until=until, by=by))

    def iter_claim_log(
        self,
        *,
        since: str | None = None,
        until: str | None = None,
        pool: str | None = None,
        page_size: int = 1000,
    ) -> AsyncIterator[dict[str, Any]]:
        """Every claim of the log in [since, until) (admin token), by arrival, each in the
        export form of docs/claim-log.md, fetched a page at a time."""
        pages = self._calls.claim_log_pages(since=since, until=until, pool=pool, limit=page_size)
        return self._pages(pages, None)

    async def drain_pool(self, name: str, *, draining: bool = True) -> PoolInfo:
        """Stop handing out the pool's new claims (admin token; `draining=False` resumes
        them): its sessions end as usual, its warm workers retire."""
        return await self._send(self._calls.drain_pool(name, draining=draining))

    async def delete_pool(self, name: str, *, generation: int | None = None) -> DeletedPool:
        """Delete a pool gone from the config file (admin token): it must be drained, with
        no live workers, open claims or rollout under way, and declared by no config file
        of the server that answers (else `PoolInUse`, saying why). Its revisions,
        rollouts, forecast, published sizing and demand rows go; its ledger and claim log
        rows stay. `generation`: the one it was read at; a pool changed since is
        `StaleGeneration`."""
        return await self._send(self._calls.delete_pool(name, generation))

    async def start_rollout(
        self,
        pool: str,
        template: TemplateChanges | Mapping[str, Any],
        *,
        strategy: Mapping[str, Any] | None = None,
        generation: int | None = None,
    ) -> RolloutInfo:
        """Roll a new revision of the pool out (admin token): `template` fields laid over
        its stable template (`TemplateChanges`: a process's `command`, ...), `strategy` a
        canary's or `{"kind": "replace"}` (None: the pool's default). `generation`: the
        pool's generation it is made from (`PoolInfo.generation`); a pool changed since is
        `StaleGeneration`. The template the pool serves or rolls out already is a 409."""
        return await self._send(self._calls.start_rollout(pool, template, strategy, generation))

    async def rollout(
        self,
        pool: str,
        rollout_id: str,
        action: str | None = None,
        *,
        generation: int | None = None,
    ) -> RolloutInfo:
        """A rollout of the pool (admin token); with `action` (pause, resume, abort or
        promote) act on it first (`ClaimConflict`-like 409 once it has ended; with
        `generation`, `StaleGeneration` when the pool has moved past it)."""
        return await self._send(self._calls.rollout(pool, rollout_id, action, generation))

    async def workers(self, **filters: Unpack[WorkerFilters]) -> Listing[WorkerInfo]:
        """Workers (admin token): live ones, or those in `state` (see `WorkerFilters`); one
        page of at most `limit`, a list whose `next` is the `after` of the page after it
        (None at the end; see `Listing`)."""
        return await self._send(self._calls.workers(filters))

    def iter_workers(self, **filters: Unpack[WorkerFilters]) -> AsyncIterator[WorkerInfo]:
        """Every worker `workers` would list, oldest first (`async for`), fetched a page
        (`limit`) at a time as the iteration goes on."""
        return self._pages(self._calls.worker_pages(filters), filters.get("after"))

    async def _pages(
        self, page: Callable[[str | None], Call[Listing[T]]], after: str | None
    ) -> AsyncIterator[T]:
        """The items of `page(after)`, then of each page after it (`async for`)."""
        got = await self._send(page(after))
        for item in got:
            yield item
        while got.next is not None:
            got = await self._send(page(got.next))
            for item in got:
                yield item

    async def ready(self) -> bool:
        """True when the server answers `/readyz` with 200."""
        try:
            return (await self._http.get(READY_PATH)).status_code == 200
        except httpx.TransportError:
            return False


class AsyncClaim:
    """A pending claim: `async with` it for a session, or await it for the session."""

    def __init__(
        self, client: AsyncClient, call: Call[ClaimInfo], renew: bool, on_lost: OnLost | None
    ) -> None:
        self._client = client
        self._call = call
        self._renew = renew
        self._on_lost = on_lost
        self._session: AsyncSession | None = None

    async def _open(self) -> AsyncSession:
        claim = await self._client._send(self._call)
        return AsyncSession(self._client, claim, self._renew, self._on_lost)

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
        release_error = None
        try:
            await session.release()
        except StokerError as error:
            release_error = error
        session._exit_error(exc, release_error)


class AsyncSession(SessionState):
    """A claimed worker renewed by a background task until released."""

    def __init__(
        self, client: AsyncClient, claim: ClaimInfo, renew: bool, on_lost: OnLost | None
    ) -> None:
        super().__init__(claim, on_lost, asyncio.get_running_loop().time)
        self._client = client
        self._renewer: asyncio.Task[None] | None = None
        if renew:
            self._renewer = asyncio.get_running_loop().create_task(
                self._renew_loop(), name=f"stoker-renew-{claim.id}"
            )

    async def _renew_loop(self) -> None:
        interval: float | None = self._first_renewal()
        client = self._client
        while interval is not None:
            await asyncio.sleep(interval)
            sent_at = self._now()
            try:
                # Its own connections, and a deadline within what is left of the lease.
                renewed = await client._send(
                    client._calls.renew(self.id, None),
                    deadline_s=max(self._lease_left(), 0.0),
                    http=client._renewals,
                )
                interval = self._renewed(renewed, sent_at)
            except StokerError as exc:
                interval = self._renewal_failed(exc)

    async def renew(self, lease_s: float | None = None) -> ClaimInfo:
        """Renew now (the background task does this by itself)."""
        self._claim = await self._client.renew(self.id, lease_s)
        return self._claim

    async def release(self) -> ClaimInfo:
        """Stop renewing and release the claim (once; later calls return the same)."""
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
        if self._released is None:
            self._released = self._claim = await self._client.release(self.id)
        return self._released
