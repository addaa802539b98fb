"""`Client`: the synchronous client of the stoker API (docs/concepts/claims.md).

A session is a claim held for the duration of a `with` block::

    with stoker.Client() as client:
        with client.claim(pool="demo", org="acme", config={"role": "ro"}) as session:
            httpx.get(session.endpoint, headers=session.headers)

The lease is renewed in the background (every third of it, over connections of its own)
while the block runs, and the claim is released on exit, also when the block raises. A
session lost meanwhile (see `SessionState`) makes the exit raise `SessionLost`. What each
call sends and how its answer reads is in `_calls`; this module only sends it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
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
from stoker.sdk._retry import now
from stoker.sdk._session import OnLost, SessionState

T = TypeVar("T")


class Client(BaseClient[httpx.BaseTransport]):
    """Synchronous client. `url` defaults to `$STOKER_URL` or http://127.0.0.1:8080 and
    `token` to `$STOKER_TOKEN`; `timeout` bounds every request but a claim's wait."""

    def _connect(self, transport: httpx.BaseTransport | None) -> None:
        self._http = httpx.Client(transport=transport, **self._calls.http_options())
        self._renewals = httpx.Client(
            transport=transport, **self._calls.http_options(renewals=True)
        )

    def close(self) -> None:
        """Close the connection pools."""
        self._http.close()
        self._renewals.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(
        self, call: Call[T], *, deadline_s: float | None = None, http: httpx.Client | None = None
    ) -> T:
        """Send `call`, again on a retryable failure (`Retries`) until its deadline."""
        http = http or self._http
        deadline = now() + self._budget(call, deadline_s)
        attempt = 0
        while True:
            try:
                response = http.request(
                    call.method,
                    call.path,
                    json=call.json,
                    params=call.params,
                    headers=call.headers,
                    timeout=call.timeout_within(deadline - now()),
                )
                return call.answer(response)
            except (httpx.TransportError, StokerError) as exc:
                error = self._failed(exc)
            delay = self._retries.delay(attempt, error, deadline - now())
            if delay is None:
                raise error
            time.sleep(delay)
            attempt += 1

    def create_claim(self, pool: str, org: str, **options: Unpack[ClaimOptions]) -> ClaimInfo:
        """Claim a worker and return the claim; nothing renews or releases it.

        `options` (mode, timeout_s, lease_s, ttl_s, config) are those of `ClaimOptions`.
        """
        return self._send(self._calls.create_claim(pool, org, options))

    def claim(
        self,
        pool: str,
        org: str,
        *,
        renew: bool = True,
        on_lost: OnLost | None = None,
        **options: Unpack[ClaimOptions],
    ) -> Session:
        """Claim a worker for a session: use as `with client.claim(...) as session:`.

        The lease is renewed in the background (unless `renew=False`) and the claim is
        released when the block ends, also on an exception. A lost session calls
        `on_lost(error)` from the renewing thread and makes the block's exit raise
        `SessionLost` (see `SessionState`).
        """
        claim = self.create_claim(pool, org, **options)
        return Session(self, claim, renew, on_lost)

    def claims(self, **filters: Unpack[ClaimFilters]) -> Listing[ClaimInfo]:
        """Claims (admin token): the open ones, or those in `state` (see `ClaimFilters`);
        one page of at most `limit`, a list whose `next` is the `after` of the page after
        it (None at the end; see `Listing`)."""
        return self._send(self._calls.claims(filters))

    def iter_claims(self, **filters: Unpack[ClaimFilters]) -> Iterator[ClaimInfo]:
        """Every claim `claims` would list, oldest first, fetched a page (`limit`) at a
        time as the iteration goes on."""
        return self._pages(self._calls.claim_pages(filters), filters.get("after"))

    def get_claim(self, claim_id: str) -> ClaimInfo:
        """A claim by id."""
        return self._send(self._calls.get_claim(claim_id))

    def renew(self, claim_id: str, lease_s: float | None = None) -> ClaimInfo:
        """Extend a claim's lease by `lease_s` (default: its own) from now."""
        return self._send(self._calls.renew(claim_id, lease_s))

    def release(self, claim_id: str) -> ClaimInfo:
        """Release a claim (a claim that already ended is returned as it is)."""
        return self._send(self._calls.release(claim_id))

    def pools(self) -> list[PoolInfo]:
        """Every pool."""
        return self._send(self._calls.pools())

    def pool(self, name: str) -> PoolInfo:
        """One pool by name."""
        return self._send(self._calls.pool(name))

    def update_pool(self, name: str, **changes: Unpack[PoolChanges]) -> PoolInfo:
        """Change a pool's settings (admin token); in force on every replica within a
        janitor pass. The pool as changed."""
        return self._send(self._calls.update_pool(name, changes))

    def pool_ledger(
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
        return self._send(self._calls.pool_ledger(name, since=since, until=until, by=by))

    def iter_claim_log(
        self,
        *,
        since: str | None = None,
        until: str | None = None,
        pool: str | None = None,
        page_size: int = 1000,
    ) -> Iterator[dict[str, Any]]:
        """Every claim of the log in [since, until) (admin token), by arrival, each in the
        export form of docs/claim-log.md, fetched a page at a time."""
        pages = self._calls.claim_log_pages(since=since, until=until, pool=pool, limit=page_size)
        return self._pages(pages, None)

    def drain_pool(self, name: str, *, draining: bool = True) -> PoolInfo:
        """Stop handing out the pool's new claims (admin token; `draining=False` resumes
        them): its sessions end as usual, its warm workers retire."""
        return self._send(self._calls.drain_pool(name, draining=draining))

    def delete_pool(self, name: str, *, generation: int | None = None) -> DeletedPool:
        """Delete a pool gone from the config file (admin token): it must be drained, with
        no live workers, open claims or rollout under way, and declared by no config file
        of the server that answers (else `PoolInUse`, saying why). Its revisions,
        rollouts, forecast, published sizing and demand rows go; its ledger and claim log
        rows stay. `generation`: the one it was read at; a pool changed since is
        `StaleGeneration`."""
        return self._send(self._calls.delete_pool(name, generation))

    def start_rollout(
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
        return self._send(self._calls.start_rollout(pool, template, strategy, generation))

    def rollout(
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
        return self._send(self._calls.rollout(pool, rollout_id, action, generation))

    def workers(self, **filters: Unpack[WorkerFilters]) -> Listing[WorkerInfo]:
        """Workers (admin token): live ones, or those in `state` (see `WorkerFilters`); one
        page of at most `limit`, a list whose `next` is the `after` of the page after it
        (None at the end; see `Listing`)."""
        return self._send(self._calls.workers(filters))

    def iter_workers(self, **filters: Unpack[WorkerFilters]) -> Iterator[WorkerInfo]:
        """Every worker `workers` would list, oldest first, fetched a page (`limit`) at a
        time as the iteration goes on."""
        return self._pages(self._calls.worker_pages(filters), filters.get("after"))

    def _pages(
        self, page: Callable[[str | None], Call[Listing[T]]], after: str | None
    ) -> Iterator[T]:
        """The items of `page(after)`, then of each page after it."""
        while True:
            got = self._send(page(after))
            yield from got
            if got.next is None:
                return
            after = got.next

    def ready(self) -> bool:
        """True when the server answers `/readyz` with 200."""
        try:
            return self._http.get(READY_PATH).status_code == 200
        except httpx.TransportError:
            return False


class Session(SessionState):
    """A claimed worker for the duration of a `with` block (see `Client.claim`)."""

    def __init__(
        self, client: Client, claim: ClaimInfo, renew: bool, on_lost: OnLost | None
    ) -> None:
        super().__init__(claim, on_lost)
        self._client = client
        # Guards the claim and its release between the renewing thread and the caller's.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        if renew:
            self._renewer = threading.Thread(
                target=self._renew_loop, name=f"stoker-renew-{claim.id}", daemon=True
            )
            self._renewer.start()

    def _renew_loop(self) -> None:
        interval: float | None = self._first_renewal()
        client = self._client
        while interval is not None and not self._stop.wait(interval):
            sent_at = now()
            try:
                # Its own connections, and a deadline within what is left of the lease.
                renewed = client._send(
                    client._calls.renew(self.id, None),
                    deadline_s=max(self._lease_left(), 0.0),
                    http=client._renewals,
                )
                interval = self._renewed(renewed, sent_at)
            except StokerError as exc:
                with self._lock:
                    interval = self._renewal_failed(exc)

    def _renewed(self, renewed: ClaimInfo, sent_at: float) -> float:
        with self._lock:
            return super()._renewed(renewed, sent_at)

    def renew(self, lease_s: float | None = None) -> ClaimInfo:
        """Renew now (the background renewal does this by itself)."""
        renewed = self._client.renew(self.id, lease_s)
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
        released = self._client.release(self.id)
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
        release_error = None
        try:
            self.release()
        except StokerError as error:
            release_error = error
        self._exit_error(exc, release_error)
