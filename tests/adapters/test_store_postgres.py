"""The Store contract on PostgreSQL, plus what only PostgreSQL has to prove.

Each test runs in a fresh, uniquely named schema of the database in
STOKER_TEST_POSTGRES_URL (default: database `test` on 127.0.0.1), dropped afterwards.
Without a reachable server the tests skip, except under CI=true, where they fail: a CI
run must not go green by skipping them.

The contract runs twice: with every statement prepared on the server, and with prepared
statements off (what a transaction-mode pooler needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, ClassVar

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from stoker.adapters import _schema
from stoker.adapters._schema import (
    CLAIM_IDEMPOTENCY_COLUMNS,
    CLAIMS,
    POOL_TABLES,
    POSTGRES,
    WORKER_TAKEN_COLUMNS,
    WORKERS,
    Table,
    before_rate,
)
from stoker.adapters.postgres import PostgresStore
from stoker.adapters.postgres.locks import LOCK, lock_key
from stoker.adapters.postgres.schema import IDEMPOTENCY_INDEX, indexes, upgrades
from stoker.domain.errors import ClaimKeyTaken, StoreError
from stoker.domain.ledger import ClaimEnding, ClaimLogEntry, LedgerCounts, LedgerKey
from stoker.domain.records import (
    Claim,
    OrgForecastBucket,
    PoolSizingRecord,
    Worker,
    token_digest,
)
from stoker.domain.states import ClaimState, WorkerState
from stoker.ports.store import ReserveResult, SpawnRequest
from store_contract import (
    T0,
    Fleet,
    MakeStore,
    StoreContract,
    make_claim,
    must,
    store_factory,
    stored,
)

pytestmark = pytest.mark.postgres

S = WorkerState
TABLES = {t.name for t in _schema.TABLES} | {"schema_migrations"}


@pytest.fixture
async def schema(postgres_url: str) -> AsyncIterator[str]:
    """A schema name no other test uses; dropped with everything in it afterwards."""
    name = f"stoker_test_{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


async def sql(url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    """Run one statement on a connection of the test's own (not the store's)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(query, params)
        return await cur.fetchall() if cur.description else []


class TestPostgresStore(StoreContract):
    """The contract with every statement prepared on the server at first use."""

    prepare_threshold: ClassVar[int | None] = 0

    @pytest.fixture
    async def make_store(self, postgres_url: str, schema: str) -> AsyncIterator[MakeStore]:
        threshold = self.prepare_threshold
        async with store_factory(
            lambda: PostgresStore(postgres_url, schema=schema, prepare_threshold=threshold)
        ) as make:
            yield make


class TestPostgresStoreUnprepared(TestPostgresStore):
    """The contract with prepared statements off, as behind a transaction-mode pooler."""

    prepare_threshold = None


@pytest.fixture
async def make_pg(postgres_url: str, schema: str) -> AsyncIterator[Callable[..., PostgresStore]]:
    """Unopened stores on the test schema (any constructor option, another schema too); all
    closed afterwards."""
    made: list[PostgresStore] = []

    def make(url: str | None = None, **kw: Any) -> PostgresStore:
        store = PostgresStore(url or postgres_url, **{"schema": schema, **kw})
        made.append(store)
        return store

    try:
        yield make
    finally:
        for store in made:
            await store.close()


async def test_all_tables_live_in_the_configured_schema(
    make_pg: Callable[..., PostgresStore], postgres_url: str, schema: str
) -> None:
    store = make_pg()
    await store.open()
    rows = await sql(
        postgres_url,
        "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
        schema,
    )
    assert {r[0] for r in rows} == TABLES
    versions = await sql(postgres_url, f'SELECT version FROM "{schema}".schema_migrations')
    assert sorted(versions) == [(v,) for v in range(1, await store.schema_version() + 1)]


async def test_sql_is_schema_qualified_whatever_the_search_path(
    make_pg: Callable[..., PostgresStore], postgres_url: str
) -> None:
    # A search_path that hides the store's schema: any unqualified name would fail.
    hidden = make_conninfo(postgres_url, options="-c search_path=pg_catalog")
    store = make_pg(hidden, prepare_threshold=None)
    await store.open()
    fleet = Fleet(store)
    hot, claim = await fleet.hot("org-a")
    idle = must(
        await store.end_claim(
            claim.id, state=ClaimState.RELEASED, worker_to=S.HOT_IDLE, now=T0 + 50
        )
    )[1]
    again = await store.reserve_any(
        "p", "r1", expect=S.HOT_IDLE, org="org-a", org_cap=1, owner="cp-a", now=T0 + 51
    )
    assert must(again.worker).id == idle.id == hot.id
    await fleet.warm()
    capped = await store.reserve_any(
        "p", "r1", expect=S.WARM, org="org-a", org_cap=1, owner="cp-a", now=T0 + 52
    )
    assert capped.at_org_cap
    assert must(await store.acquire_lease("j", holder="a", now=T0, duration_s=5.0)).epoch == 1
    await store.register_instance("cp-a", now=T0, meta={"k": "v"})
    assert [i.id for i in await store.list_instances()] == ["cp-a"]


async def test_no_lock_outlives_its_transaction(
    make_pg: Callable[..., PostgresStore], postgres_url: str
) -> None:
    # Only transaction-scoped locks: nothing may stay held on a pooled session.
    app = f"stoker-test-{uuid.uuid4().hex[:8]}"
    store = make_pg(make_conninfo(postgres_url, application_name=app))
    await store.open()
    fleet = Fleet(store)
    for _ in range(3):
        await fleet.warm()
    req = SpawnRequest(
        pool="p", revision="r1", count=2, owner="cp-a", org="org-a", pool_cap=9, org_cap=5, target=9
    )
    assert len((await store.reserve_spawn_slots(req, ["s-1", "s-2"], T0 + 50)).workers) == 2
    w = await fleet.warm()
    reserved = await store.reserve(
        w.id,
        expect=S.WARM,
        epoch=w.epoch,
        version=w.version,
        org="org-a",
        org_cap=5,
        owner="cp-a",
        now=T0 + 51,
    )
    assert reserved.worker is not None
    picked = await store.reserve_any(
        "p", "r1", expect=S.WARM, org="org-b", org_cap=5, owner="cp-a", now=T0 + 52
    )
    assert picked.worker is not None
    sessions = await sql(
        postgres_url, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", app
    )
    assert sessions[0][0] >= 1  # the pool's sessions are still open, and hold nothing
    locks = await sql(
        postgres_url,
        "SELECT count(*) FROM pg_locks JOIN pg_stat_activity USING (pid) "
        "WHERE pg_locks.locktype = 'advisory' AND application_name = %s",
        app,
    )
    assert locks == [(0,)]


async def test_a_stalled_lock_holder_blocks_the_others_only_for_the_lock_idle_timeout(
    make_pg: Callable[..., PostgresStore], schema: str
) -> None:
    # A replica stopped (SIGSTOP, a frozen VM) inside a transaction that holds a pool's lock
    # would block every other replica's spawns in that pool until it ran again: PostgreSQL
    # ends its transaction after lock_idle_timeout_s instead, and the others go on.
    stalled = make_pg(lock_idle_timeout_s=0.5)
    other = make_pg()
    await stalled.open()
    await other.open()
    locked = asyncio.Event()
    ended: list[StoreError] = []

    async def stall() -> None:
        try:
            async with stalled._db.tx() as conn:
                key = lock_key(schema, "pool", "p")
                await conn.execute(LOCK, (stalled._lock_idle_ms, key))
                locked.set()
                await asyncio.sleep(3)  # stopped, holding the lock
                await conn.execute("SELECT 1")  # the server ended the session meanwhile
        except StoreError as exc:
            ended.append(exc)

    holder = asyncio.create_task(stall())
    await asyncio.wait_for(locked.wait(), 5)
    req = SpawnRequest(pool="p", revision="r1", count=1, owner="cp-b", pool_cap=9, target=9)
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await asyncio.wait_for(other.reserve_spawn_slots(req, ["s-1"], T0), 2.5)
    waited = loop.time() - started
    assert len(result.workers) == 1
    assert 0.3 < waited < 2.5, waited  # it did wait for the lock, and not for the stall
    await holder
    assert len(ended) == 1, "the server should have ended the stalled transaction"


async def test_a_stalled_transaction_holding_a_row_blocks_the_others_only_for_a_while(
    make_pg: Callable[..., PostgresStore],
) -> None:
    # The same for a row lock taken without any advisory lock (a claim's end, a bind): every
    # pooled connection bounds how long its transactions may sit idle, not only the ones
    # that take a lock.
    stalled = make_pg(lock_idle_timeout_s=0.5)
    other = make_pg()
    await stalled.open()
    await other.open()
    w = await Fleet(other).warm()
    locked = asyncio.Event()
    ended: list[StoreError] = []

    async def stall() -> None:
        try:
            async with stalled._db.tx() as conn:
                await conn.execute(
                    f"SELECT id FROM {stalled._names.workers} WHERE id = %s FOR UPDATE", (w.id,)
                )
                locked.set()
                await asyncio.sleep(3)  # stopped, holding the row
                await conn.execute("SELECT 1")  # the server ended the session meanwhile
        except StoreError as exc:
            ended.append(exc)

    holder = asyncio.create_task(stall())
    await asyncio.wait_for(locked.wait(), 5)
    moved = await asyncio.wait_for(
        other.transition(
            w.id,
            expect=WorkerState.WARM,
            epoch=w.epoch,
            version=w.version,
            to=WorkerState.WARM,
            now=T0 + 10,
            changes={"heartbeat_at": T0 + 10},
        ),
        2.5,
    )
    assert moved is not None and moved.version == w.version + 1
    await holder
    assert len(ended) == 1, "the server should have ended the stalled transaction"


async def test_a_cancellation_racing_the_hand_over_is_delivered(
    make_pg: Callable[..., PostgresStore],
) -> None:
    # A task waiting for the pool's only connection is cancelled just as the connection
    # is handed to it, at every step of the hand-over: each time it ends cancelled (on
    # Python 3.11 the pool alone lost the cancellation in the first few steps, and a
    # stopped loop went on running).
    store = make_pg(min_size=1, max_size=1)
    await store.open()
    db = store._db
    ran_on: list[int] = []
    cancelled: list[int] = []
    for steps in range(8):
        holder_has_it = asyncio.Event()
        give_back = asyncio.Event()

        async def hold(has_it: asyncio.Event, give_back: asyncio.Event) -> None:
            async with db.connection():
                has_it.set()
                await give_back.wait()

        async def wait_for_it(steps: int = steps) -> None:
            async with db.connection() as conn:
                await conn.execute("SELECT 1")
                ran_on.append(steps)

        holder = asyncio.create_task(hold(holder_has_it, give_back))
        await holder_has_it.wait()
        waiter = asyncio.create_task(wait_for_it())
        for _ in range(3):
            await asyncio.sleep(0)  # the waiter queues for the connection
        give_back.set()
        await holder
        for _ in range(steps):
            await asyncio.sleep(0)
        if waiter.cancel():
            cancelled.append(steps)
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
        else:
            await waiter  # it was through before the cancellation: nothing to deliver
    assert cancelled, "no step cancelled the waiter in time"
    lost = [steps for steps in cancelled if steps in ran_on]
    assert lost == [], f"cancelled waiters went on running (steps {lost})"
    # The pool kept its connection through all of it.
    assert await store.schema_version() > 0


@pytest.mark.parametrize(("synchronous", "shown"), [(True, "on"), (False, "off")])
async def test_each_connection_has_the_stores_session_settings(
    make_pg: Callable[..., PostgresStore], synchronous: bool, shown: str
) -> None:
    store = make_pg(lock_idle_timeout_s=2.5, synchronous_commit=synchronous, min_size=2)
    await store.open()
    async with store._db.connection() as a, store._db.connection() as b:
        for conn in (a, b):
            cur = await conn.execute(
                "SELECT current_setting('synchronous_commit'), "
                "current_setting('idle_in_transaction_session_timeout')"
            )
            assert await cur.fetchone() == (shown, "2500ms")


async def test_open_fails_with_store_error_when_the_server_is_unreachable(
    make_pg: Callable[..., PostgresStore],
) -> None:
    store = make_pg("postgresql://postgres@127.0.0.1:1/test", timeout_s=0.5)
    with pytest.raises(StoreError, match="cannot open postgres store"):
        await store.open()
    with pytest.raises(StoreError, match="not open"):
        await store.get_worker("w-1")


async def test_a_lost_connection_is_a_store_error_and_the_pool_recovers(
    make_pg: Callable[..., PostgresStore], postgres_url: str
) -> None:
    app = f"stoker-test-{uuid.uuid4().hex[:8]}"
    store = make_pg(make_conninfo(postgres_url, application_name=app), min_size=1, max_size=1)
    await store.open()
    w = await Fleet(store).warm()
    killed = await sql(
        postgres_url,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
        app,
    )
    assert killed == [(True,)]
    with pytest.raises(StoreError):
        await store.transition(
            w.id, expect=S.WARM, epoch=w.epoch, version=w.version, to=S.DRAINING, now=T0 + 50
        )
    assert await store.get_worker(w.id) == w  # a fresh connection, and nothing was written


async def test_a_failed_claim_write_rolls_the_worker_back(
    make_pg: Callable[..., PostgresStore], postgres_url: str, schema: str
) -> None:
    store = make_pg()
    await store.open()
    fleet = Fleet(store)
    hot, claim = await fleet.hot("org-a")
    a = await fleet.activating("org-a")
    # The claim write fails after the worker write succeeded, inside the same transaction.
    await sql(
        postgres_url,
        f"""CREATE FUNCTION "{schema}".fail() RETURNS trigger LANGUAGE plpgsql AS
            $$ BEGIN RAISE EXCEPTION 'injected failure'; END $$""",
    )
    await sql(
        postgres_url,
        f'CREATE TRIGGER fail BEFORE INSERT OR UPDATE ON "{schema}".claims '
        f'FOR EACH ROW EXECUTE FUNCTION "{schema}".fail()',
    )
    with pytest.raises(StoreError, match="injected failure"):
        await store.end_claim(
            claim.id, state=ClaimState.RELEASED, worker_to=S.HOT_IDLE, now=T0 + 50
        )
    with pytest.raises(StoreError, match="injected failure"):
        await store.bind(
            a.id,
            epoch=a.epoch,
            version=a.version,
            claim=make_claim(a, "c-new", T0 + 51),
            now=T0 + 51,
        )
    assert await store.get_worker(hot.id) == hot
    assert await store.get_claim(claim.id) == stored(claim)
    assert await store.get_worker(a.id) == a
    assert await store.get_claim("c-new") is None


async def test_a_store_pick_takes_the_newest_warm_worker_and_the_oldest_parked_one(
    make_pg: Callable[..., PostgresStore],
) -> None:
    # The replica that spawned the warm workers hands them out oldest first from its
    # queue: the others' store picks start at the other end, where it does not reserve.
    store = make_pg()
    await store.open()
    fleet = Fleet(store)
    warm = [await fleet.warm() for _ in range(3)]
    parked = [await fleet.hot_idle("org-a") for _ in range(2)]
    for expected in reversed(warm):
        got = await store.reserve_any(
            "p", "r1", expect=S.WARM, org="org-b", org_cap=0, owner="cp-b", now=T0 + 100
        )
        assert must(got.worker).id == expected.id
    for expected in parked:
        got = await store.reserve_any(
            "p", "r1", expect=S.HOT_IDLE, org="org-a", org_cap=0, owner="cp-b", now=T0 + 100
        )
        assert must(got.worker).id == expected.id


def parked_or_warm(
    store: PostgresStore, w: Worker, org: str, *, cap: int = 0, revisions: Any = ("r1",)
) -> Coroutine[Any, Any, ReserveResult]:
    """`reserve_parked_or` as replica cp-b calls it in pool p at revision r1: the org's
    parked worker of `revisions`, else the warm `w`, moved on to activating."""
    return store.reserve_parked_or(
        w.id,
        pool="p",
        revision="r1",
        revisions=revisions,
        expect=S.WARM,
        epoch=w.epoch,
        version=w.version,
        org=org,
        org_cap=cap,
        owner="cp-b",
        now=T0 + 100,
        activate=True,
    )


async def test_the_one_statement_reservations_stamp_an_owner_change(
    make_pg: Callable[..., PostgresStore],
) -> None:
    """The parked-or-warm statements (alone, and batched per loop iteration) stamp
    `taken_at`, keep `prior_taken_at` and keep the change (`first_takes`) as every other
    write that changes the owner."""
    store = make_pg()
    await store.open()
    fleet = Fleet(store)
    warm = await fleet.warm()
    parked = await fleet.hot_idle("org-a")
    got = must((await parked_or_warm(store, warm, "org-a")).worker)
    assert got.id == parked.id
    assert (got.owner, got.taken_at, got.prior_taken_at) == ("cp-b", T0 + 100, None)
    others = [await fleet.warm() for _ in range(2)]
    batched = await asyncio.gather(
        parked_or_warm(store, others[0], "org-b"), parked_or_warm(store, others[1], "org-c")
    )
    for result, w in zip(batched, others, strict=True):
        taken = must(result.worker)
        assert (taken.id, taken.owner, taken.taken_at, taken.prior_taken_at) == (
            w.id,
            "cp-b",
            T0 + 100,
            None,
        )
        assert await store.get_worker(w.id) == taken
    # Each change of owner is kept for the ledger of the replica the worker left.
    since = [(w.id, T0) for w in (parked, *others)]
    assert await store.first_takes(since) == [T0 + 100] * 3
    assert await store.first_takes([(parked.id, T0 + 100), (warm.id, T0)]) == [None, None]


async def test_a_parked_worker_first_else_the_warm_one_in_one_statement(
    make_pg: Callable[..., PostgresStore],
) -> None:
    store = make_pg()
    await store.open()
    fleet = Fleet(store)
    warm = await fleet.warm()
    other = await fleet.hot_idle("org-a", revision="r0")
    first = await fleet.hot_idle("org-a")
    second = await fleet.hot_idle("org-a")

    async def take(w: Worker, org: str = "org-a", cap: int = 0, revs: Any = ("r1", "r0")) -> Any:
        return await parked_or_warm(store, w, org, cap=cap, revisions=revs)

    # The org's oldest parked worker of the first revision that has one; the warm one
    # stays as it was.
    result = await take(warm)
    got = must(result.worker)
    assert (got.id, got.state, got.epoch) == (first.id, S.ACTIVATING, first.epoch + 1)
    assert result.parked
    assert await store.get_worker(warm.id) == warm
    got = must((await take(warm, revs=("r0",))).worker)
    assert got.id == other.id
    # The worker named as warm (a replica's memory of it) was parked by the org since: it
    # is reserved as the parked one, and said so.
    result = await take(second)
    assert must(result.worker).id == second.id and result.parked
    # No parked worker of the org: the warm one, within the org's cap.
    reserved = await fleet.reserved("org-c")
    capped = await take(warm, org="org-c", cap=1)
    assert capped.worker is None and capped.at_org_cap
    result = await take(warm, org="org-b", cap=1)
    got = must(result.worker)
    assert (got.id, got.state, got.org, got.owner) == (warm.id, S.ACTIVATING, "org-b", "cp-b")
    assert not result.parked
    assert got.epoch == warm.epoch + 1 and got.activated
    # A stale fence misses, and says nothing of a cap.
    missed = await take(warm, org="org-d")
    assert missed.worker is None and not missed.at_org_cap
    assert must(await store.get_worker(reserved.id)).state is S.RESERVED
    with pytest.raises(ValueError):
        await store.reserve_parked_or(
            warm.id,
            pool="p",
            revision="r1",
            revisions=("r1",),
            expect=S.HOT_IDLE,
            epoch=0,
            version=0,
            org="org-a",
            org_cap=0,
            owner="cp-b",
            now=T0,
        )


async def test_binds_of_one_loop_iteration_answer_as_each_alone(
    make_pg: Callable[..., PostgresStore], postgres_url: str, schema: str
) -> None:
    store = make_pg()
    await store.open()
    fleet = Fleet(store)
    ready = [await fleet.activating(f"org-{k}") for k in range(4)]
    claims = [make_claim(w, f"c-{w.id}", T0 + 100) for w in ready]
    stale = ready[1].evolve(version=ready[1].version - 1)

    async def bind(w: Worker, claim: Claim) -> Worker | None:
        return await store.bind(w.id, epoch=w.epoch, version=w.version, claim=claim, now=T0 + 100)

    # One statement: three land, the stale fence misses alone.
    binds = [bind(w, c) for w, c in zip([ready[0], stale, *ready[2:]], claims, strict=True)]
    hot = await asyncio.gather(*binds)
    assert hot[1] is None
    for w, got, claim in zip(ready, hot, claims, strict=True):
        if got is not None:
            assert (got.id, got.state, got.claim_id) == (w.id, S.HOT, claim.id)
            assert await store.get_claim(claim.id) == stored(claim)
    assert await store.get_claim(claims[1].id) is None
    # A batch the unique index refuses runs again bind by bind: only the clash fails.
    more = [await fleet.activating("org-k") for _ in range(3)]
    keyed = [
        make_claim(w, f"c-{w.id}", T0 + 200).evolve(idempotency_key="sha256:k")
        if i < 2
        else make_claim(w, f"c-{w.id}", T0 + 200)
        for i, w in enumerate(more)
    ]
    results = await asyncio.gather(
        *(bind(w, c) for w, c in zip(more, keyed, strict=True)), return_exceptions=True
    )
    assert sum(isinstance(r, ClaimKeyTaken) for r in results) == 1
    assert sum(isinstance(r, Worker) for r in results) == 2
    third = results[2]
    assert isinstance(third, Worker) and third.state is S.HOT
    rows = await sql(postgres_url, f'SELECT count(*) FROM "{schema}".claims')
    assert rows == [(5,)]


def count_reservation_batches(store: PostgresStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the reservation batches `store` runs from now on (as they run)."""
    batches: list[int] = []
    run_all = store._db.all

    async def counted(sql_: str, params: Any = ()) -> Any:
        if isinstance(params, dict) and "n" in params:
            batches.append(len(params["n"]))
        return await run_all(sql_, params)

    monkeypatch.setattr(store._db, "all", counted)
    return batches


async def test_parked_or_warm_reservations_of_one_loop_iteration_answer_as_each_alone(
    make_pg: Callable[..., PostgresStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_pg()
    await store.open()
    fleet = Fleet(store)
    warm = [await fleet.warm() for _ in range(6)]
    parked = {org: await fleet.hot_idle(org) for org in ("org-a", "org-b")}
    run_all = store._db.all
    batches = count_reservation_batches(store, monkeypatch)

    def take(w: Worker, org: str, cap: int = 0) -> Any:
        return parked_or_warm(store, w, org, cap=cap)

    stale = warm[2].evolve(version=warm[2].version + 1)
    results = await asyncio.gather(
        take(warm[0], "org-a"),  # its parked worker
        take(warm[1], "org-c"),  # nothing parked: the warm one named
        take(stale, "org-d"),  # a stale fence: nothing
        take(warm[3], "org-b"),  # its parked worker
        take(warm[4], "org-a"),  # the same org again: alone
        take(warm[5], "org-e", cap=1),  # within a cap: alone, under the org's lock
    )
    assert batches == [4]
    a, c, d, b, a_again, e = results
    # The two of org-a race (one in the batch, one alone): one takes the parked worker,
    # the other the warm one it named.
    taken = {(must(r.worker).id, r.parked) for r in (a, a_again)}
    assert taken == {(parked["org-a"].id, True), (warm[0].id, False)} or taken == {
        (parked["org-a"].id, True),
        (warm[4].id, False),
    }
    assert must(b.worker).id == parked["org-b"].id and b.parked
    got = must(c.worker)
    assert (got.id, got.state, got.org, got.owner, c.parked) == (
        warm[1].id,
        S.ACTIVATING,
        "org-c",
        "cp-b",
        False,
    )
    assert got.epoch == warm[1].epoch + 1 and got.version == warm[1].version + 1
    assert (d.worker, d.at_org_cap) == (None, False)
    assert await store.get_worker(warm[2].id) == warm[2]
    assert must(e.worker).id == warm[5].id
    for w in (parked["org-a"], parked["org-b"]):
        assert must(await store.get_worker(w.id)).state is S.ACTIVATING
    # A batch the store refuses runs again claim by claim: each gets its own answer.
    more = [await fleet.warm() for _ in range(2)]
    failing = iter([StoreError("postgres: connection lost")])

    async def fails_once(sql_: str, params: Any = ()) -> Any:
        if isinstance(params, dict) and "n" in params and (error := next(failing, None)):
            raise error
        return await run_all(sql_, params)

    monkeypatch.setattr(store._db, "all", fails_once)
    again = await asyncio.gather(take(more[0], "org-f"), take(more[1], "org-g"))
    assert [must(r.worker).id for r in again] == [more[0].id, more[1].id]


async def test_claims_naming_no_warm_worker_take_distinct_ones_in_the_same_statement(
    make_pg: Callable[..., PostgresStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_pg()
    await store.open()
    fleet = Fleet(store)
    warm = [await fleet.warm() for _ in range(3)]
    parked = await fleet.hot_idle("org-a")
    batches = count_reservation_batches(store, monkeypatch)
    by: dict[str, Any] = {
        "pool": "p",
        "revisions": ("r1",),
        "expect": S.WARM,
        "org_cap": 0,
        "activate": True,
    }

    def anyone(org: str) -> Any:
        return store.reserve_parked_or_any("r1", org=org, owner="cp-b", now=T0 + 100, **by)

    named = store.reserve_parked_or(
        warm[0].id,
        epoch=warm[0].epoch,
        version=warm[0].version,
        revision="r1",
        org="org-d",
        owner="cp-b",
        now=T0 + 100,
        **by,
    )
    a, b, c, d, e = await asyncio.gather(
        anyone("org-a"), anyone("org-b"), anyone("org-c"), named, anyone("org-e")
    )
    assert batches == [5]
    assert must(a.worker).id == parked.id and a.parked
    assert must(d.worker).id == warm[0].id and not d.parked
    # The two free warm workers, one each, newest first; none left for the last claim.
    assert [must(r.worker).id for r in (b, c)] == [warm[2].id, warm[1].id]
    assert not (b.parked or c.parked)
    for r, org in ((b, "org-b"), (c, "org-c")):
        got = must(r.worker)
        assert (got.state, got.org, got.owner, got.activated) == (S.ACTIVATING, org, "cp-b", True)
    assert (e.worker, e.at_org_cap, e.parked) == (None, False, False)
    # Alone, it is the same statement; an org cap is refused (it is counted under a lock).
    batches.clear()
    assert (await anyone("org-f")).worker is None and batches == [1]
    with pytest.raises(ValueError):
        await store.reserve_parked_or_any(
            "r1", org="org-g", owner="cp-b", now=T0, **(by | {"org_cap": 1})
        )


async def test_replicas_reserving_and_spawning_under_load_keep_every_cap(
    make_pg: Callable[..., PostgresStore],
) -> None:
    # Three replicas with small connection pools, so tasks also queue for connections.
    replicas = [make_pg(max_size=3, prepare_threshold=None) for _ in range(3)]
    await asyncio.gather(*(r.open() for r in replicas))
    fleet = Fleet(replicas[0])
    for _ in range(30):
        await fleet.warm()
    orgs = [f"org-{k}" for k in range(4)]

    async def act(i: int) -> None:
        replica, org = replicas[i % 3], orgs[i % 4]
        if i % 3 == 0:
            req = SpawnRequest(
                pool="p", revision="r1", count=1, owner="cp", org=org, pool_cap=40, org_cap=6
            )
            result = await replica.reserve_spawn_slots(req, [f"cold-{i}"], T0 + 100)
            assert result.workers or result.limited_by in ("org_cap", "pool_cap")
        else:
            result2 = await replica.reserve_any(
                "p", "r1", expect=S.WARM, org=org, org_cap=6, owner="cp", now=T0 + 100
            )
            assert result2.worker or result2.at_org_cap

    await asyncio.gather(*(act(i) for i in range(120)))
    live = await replicas[0].list_workers(states=[S.SPAWNING, S.WARM, S.RESERVED])
    assert len(live) <= 40
    for org in orgs:  # 30 warm workers are enough for every org to reach its cap exactly
        assert len([w for w in live if w.org == org]) == 6
    for w in live:
        if w.state is S.RESERVED:
            assert w.epoch == 1  # reserved once: no warm worker went to two claims


async def test_a_schema_of_version_3_gains_the_row_version_and_idempotency_keys(
    make_pg: Callable[..., PostgresStore], postgres_url: str, schema: str
) -> None:
    s = f'"{schema}"'
    later = {"version", *WORKER_TAKEN_COLUMNS}
    before = Table(WORKERS.name, tuple(c for c in WORKERS.columns if c.name not in later))
    claims = Table(
        CLAIMS.name, tuple(c for c in CLAIMS.columns if c.name not in CLAIM_IDEMPOTENCY_COLUMNS)
    )
    await sql(postgres_url, f"CREATE SCHEMA {s}")
    for table in (
        before,
        claims,
        *(t for t in map(before_rate, _schema.TABLES[2:]) if t and t not in POOL_TABLES),
    ):
        await sql(postgres_url, POSTGRES.create_table(table, f"{s}.{table.name}"))
    for index in indexes(s):
        if IDEMPOTENCY_INDEX not in index:
            await sql(postgres_url, index)
    await sql(postgres_url, f"CREATE TABLE {s}.schema_migrations (version integer PRIMARY KEY)")
    await sql(postgres_url, f"INSERT INTO {s}.schema_migrations VALUES (1), (2), (3)")
    await sql(
        postgres_url,
        f"INSERT INTO {s}.workers (id, pool, revision, state, owner, created_at, updated_at, "
        "heartbeat_at) VALUES ('w1', 'p', 'r1', 'warm', 'cp-a', 1, 1, 1)",
    )
    store = make_pg()
    await store.open()
    assert await store.schema_version() == upgrades(s)[-1][0]
    w = must(await store.get_worker("w1"))
    assert w.version == 0
    moved = await store.transition("w1", expect=S.WARM, epoch=0, version=0, to=S.DRAINING, now=T0)
    assert must(moved).version == 1

    fresh_schema = f"{schema}_new"
    fresh = make_pg(schema=fresh_schema)
    try:
        await fresh.open()
        shape = (
            "SELECT table_name, column_name, data_type, is_nullable, column_default "
            "FROM information_schema.columns WHERE table_schema = %s"
        )
        index_names = "SELECT indexname FROM pg_indexes WHERE schemaname = %s"
        for query in (shape, index_names):
            assert set(await sql(postgres_url, query, schema)) == set(
                await sql(postgres_url, query, fresh_schema)
            )
    finally:
        await fresh.close()
        await sql(postgres_url, f'DROP SCHEMA IF EXISTS "{fresh_schema}" CASCADE')


async def test_a_schema_of_version_10_gains_the_org_forecast(
    make_pg: Callable[..., PostgresStore], postgres_url: str, schema: str
) -> None:
    store = make_pg()
    await store.open()
    await store.close()
    s = f'"{schema}"'
    # What version 10 left behind: no org_forecast table, version 11 not applied.
    await sql(postgres_url, f"DELETE FROM {s}.schema_migrations WHERE version = 11")
    await sql(postgres_url, f"DROP TABLE {s}.org_forecast")
    upgraded = make_pg()
    await upgraded.open()
    assert await upgraded.schema_version() == upgrades(s)[-1][0] == 18
    bucket = OrgForecastBucket("p", "acme", 9, 0.002, 0.0, 1, T0)
    await upgraded.record_org_forecast([bucket])
    assert await upgraded.read_org_forecast() == [bucket]


async def test_a_schema_of_version_11_gains_the_rollout_outcome_counts(
    make_pg: Callable[..., PostgresStore], postgres_url: str, schema: str
) -> None:
    store = make_pg()
    await store.open()
    await store.close()
    s = f'"{schema}"'
    # What version 11 left behind: no rollout_outcomes table, version 12 not applied.
    await sql(postgres_url, f"DELETE FROM {s}.schema_migrations WHERE version = 12")
    await sql(postgres_url, f"DROP TABLE {s}.rollout_outcomes")
    upgraded = make_pg()
    await upgraded.open()
    assert await upgraded.schema_version() == upgrades(s)[-1][0] == 18
    await upgraded.record_outcomes("cp-a", {"ro-1": {"spawn": 2}}, now=T0)
    assert await upgraded.read_outcomes(["ro-1"]) == {"ro-1": {"spawn": 2}}


async def test_a_schema_of_version_13_gains_the_published_sizing(
    make_pg: Callable[..., PostgresStore], postgres_url: str, schema: str
) -> None:
    store = make_pg()
    await store.open()
    await store.close()
    s = f'"{schema}"'
    # What version 13 left behind: no pool_sizing table, version 14 not applied.
    await sql(postgres_url, f"DELETE FROM {s}.schema_migrations WHERE version = 14")
    await sql(postgres_url, f"DROP TABLE {s}.pool_sizing")
    upgraded = make_pg()
    await upgraded.open()
    assert await upgraded.schema_version() == upgrades(s)[-1][0] == 18
    sized = PoolSizingRecord("p", "cp-a", T0, 4, 2, {"policy": "reactive"})
    await upgraded.record_sizing([sized])
    assert await upgraded.read_sizing() == [sized]


async def test_a_schema_of_version_4_keeps_its_session_tokens_as_digests(
    make_pg: Callable[..., PostgresStore], postgres_url: str, schema: str
) -> None:
    store = make_pg()
    await store.open()
    await store.close()
    s = f'"{schema}"'
    # What version 4 left behind: a token in plain text, and version 5 not applied.
    await sql(postgres_url, f"DELETE FROM {s}.schema_migrations WHERE version IN (5, 6)")
    await sql(postgres_url, f"DROP INDEX {s}.{IDEMPOTENCY_INDEX}")
    for name in CLAIM_IDEMPOTENCY_COLUMNS:
        await sql(postgres_url, f"ALTER TABLE {s}.claims DROP COLUMN {name}")
    await sql(
        postgres_url,
        f"INSERT INTO {s}.claims (id, pool, org, worker_id, worker_epoch, source, mode, state, "
        "token, endpoint, lease_s, expires_at, created_at, updated_at, owner) VALUES "
        "('c1', 'p', 'acme', 'w1', 1, 'warm', 'prefer_warm', 'bound', 'secret-token', "
        "'http://w', 30, 31, 1, 1, 'cp-a'), "
        "('c2', 'p', 'acme', 'w2', 1, 'warm', 'prefer_warm', 'bound', '', 'http://w', "
        "30, 31, 1, 1, 'cp-a')",
    )
    upgraded = make_pg()
    await upgraded.open()
    assert await upgraded.schema_version() == upgrades(s)[-1][0]
    assert must(await upgraded.get_claim("c1")).token == token_digest("secret-token")
    assert must(await upgraded.get_claim("c2")).token == ""


async def test_a_schema_of_version_14_finds_a_replicas_last_ledger_write_by_index(
    make_pg: Callable[..., PostgresStore], postgres_url: str, schema: str
) -> None:
    """`ledger_written_at` (an adopter's read, for each replica whose workers it adopts)
    scanned every cell of the ledger: its key leads with the pool and the hour."""
    store = make_pg()
    await store.open()
    await store.close()
    s = f'"{schema}"'
    # What version 14 left behind: no index of the ledger by replica, version 15 not applied.
    await sql(postgres_url, f"DELETE FROM {s}.schema_migrations WHERE version = 15")
    await sql(postgres_url, f"DROP INDEX {s}.ledger_written")
    upgraded = make_pg()
    await upgraded.open()
    assert await upgraded.schema_version() == upgrades(s)[-1][0] == 18
    await upgraded.close()
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        # An empty table is read whole anyway: ask for the plan a large one gets.
        await conn.execute("SET enable_seqscan = off")
        cur = await conn.execute(
            f"EXPLAIN SELECT max(updated_at) FROM {s}.ledger WHERE instance = 'cp-a'"
        )
        plan = str(await cur.fetchall())
    assert "ledger_written" in plan, plan


async def test_a_schema_of_version_15_keeps_the_placeholders_requests(
    make_pg: Callable[..., PostgresStore], postgres_url: str, schema: str
) -> None:
    """From version 16 the ledger keeps the placeholders' own requests; a cell written
    before reads 0 of them."""
    store = make_pg()
    await store.open()
    old = LedgerCounts(placeholder_s=40.0)
    assert await store.record_ledger("cp-a", {LedgerKey("p", "r1", "", 0): old}, now=1)
    await store.close()
    s = f'"{schema}"'
    # What version 15 left behind: the cell without the columns, version 16 not applied.
    await sql(postgres_url, f"DELETE FROM {s}.schema_migrations WHERE version = 16")
    for name in ("placeholder_cpu_s", "placeholder_gib_s"):
        await sql(postgres_url, f"ALTER TABLE {s}.ledger DROP COLUMN {name}")
    upgraded = make_pg()
    await upgraded.open()
    assert await upgraded.schema_version() == upgrades(s)[-1][0] == 18
    [(_, read)] = await upgraded.read_ledger("p", since=0, until=3600)
    assert (read.placeholder_s, read.placeholder_cpu_s, read.placeholder_gib_s) == (40, 0, 0)
    new = LedgerCounts(placeholder_s=40.0, placeholder_cpu_s=11.0, placeholder_gib_s=2.5)
    assert await upgraded.record_ledger("cp-b", {LedgerKey("p", "r1", "", 0): new}, now=2)
    rows = await upgraded.read_ledger("p", since=0, until=3600)
    assert sorted(c.placeholder_cpu_s for _, c in rows) == [0.0, 11.0]


async def test_a_schema_of_version_17_keeps_the_changes_of_owner_from_its_upgrade_on(
    make_pg: Callable[..., PostgresStore], postgres_url: str, schema: str
) -> None:
    """From version 18 every change of a worker's owner is kept (`first_takes`): a schema
    without the table gets it, and the next take is kept, by every reserving statement."""
    store = make_pg()
    await store.open()
    await store.close()
    s = f'"{schema}"'
    # What version 17 left behind: no table of changes, 18 not applied.
    await sql(postgres_url, f"DELETE FROM {s}.schema_migrations WHERE version = 18")
    await sql(postgres_url, f"DROP TABLE {s}.worker_takes")
    upgraded = make_pg()
    await upgraded.open()
    assert await upgraded.schema_version() == upgrades(s)[-1][0] == 18
    fleet = Fleet(upgraded)
    warm = await fleet.warm()
    got = must((await parked_or_warm(upgraded, warm, "org-a")).worker)
    assert (got.id, got.owner, got.taken_at) == (warm.id, "cp-b", T0 + 100)
    assert await upgraded.first_takes([(warm.id, T0)]) == [T0 + 100]


async def test_two_replicas_writing_each_others_claim_log_rows_do_not_deadlock(
    make_pg: Callable[..., PostgresStore],
) -> None:
    """One replica writes a claim's arrival and another its ending (whichever released
    it): two flushes at once, each with arrivals of its own claims and endings of the
    other's, lock the same rows. Written in the order of their ids, they cannot wait on
    each other in a cycle; in the order arrivals-then-endings they deadlocked
    (PostgreSQL aborts one: `claim_log_write_failed`). Every row ends whole."""
    a, b = make_pg(), make_pg()
    await a.open()
    await b.open()
    ids = [f"c-{i:04d}" for i in range(400)]
    mine = {store: ids[k::2] for k, store in enumerate((a, b))}

    def arrival(claim: str) -> ClaimLogEntry:
        return ClaimLogEntry(claim, T0, "p", "acme", "take", "warm", 0.01, None, "bound", "r1")

    def ending(claim: str) -> ClaimEnding:
        return ClaimEnding(claim, "p", "acme", "take", "warm", T0, 2.0, "released")

    for _ in range(5):
        # a logs the arrivals of the even claims and the endings of the odd ones; b the
        # other way round.
        await asyncio.gather(
            a.record_claim_log([arrival(c) for c in mine[a]], [ending(c) for c in mine[b]]),
            b.record_claim_log([arrival(c) for c in mine[b]], [ending(c) for c in mine[a]]),
        )
    logged = await a.read_claim_log(since=0, until=T0 + 10, limit=1000)
    assert sorted(e.id for e in logged) == ids
    assert {(e.held_s, e.outcome, e.source) for e in logged} == {(2.0, "released", "warm")}
