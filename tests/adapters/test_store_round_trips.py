"""How many times the control plane talks to its store per claim, release and renewal.

A claim on the warm path, a release that parks the worker and a renewal, each through a
real control plane (in-memory workers: see tests/fakes.py) on each real store, counted
where the store meets its database: for PostgreSQL every round trip of a pooled
connection (`AsyncConnection.wait`, which every statement, BEGIN and COMMIT goes
through), for SQLite every statement the connection runs (its trace callback, statements
of triggers left out). The counts are asserted exactly, so that a change that adds one
fails here and says so; `benchmarks/stores.py` prints them beside the time they cost.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fakes import MemoryRuntime
from stoker.adapters.postgres import PostgresStore
from stoker.adapters.sqlite import SqliteStore
from stoker.control.plane import ControlPlane
from stoker.domain.errors import StoreError
from stoker.domain.records import ClaimRequest
from stoker.domain.specs import PlaneSettings, PoolSpec, ProcessTemplate
from stoker.domain.states import ClaimSource, WorkerState
from stoker.ports.clock import LoopClock
from stoker.ports.store import Store

POSTGRES_URL = os.environ.get(
    "STOKER_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
POOL = PoolSpec(name="p", template=ProcessTemplate(argv=("worker", "{port}")), warm_target=2)

#: Round trips (PostgreSQL) or statements (SQLite) of each step, as the stores do them now.
EXPECTED = {
    # A warm claim: a look for a parked worker of the org in the store (the replica's own
    # queues are only hints) that reserves the next warm worker of the queue when it finds
    # none, moved on to activating (PostgreSQL: one statement; SQLite: the look, then the
    # reservation, moved on in the same UPDATE), and the bind with the claim's row. A
    # renewal and a release write at once: the replica that bound the claim remembers what
    # never changes in it (another replica reads it first). SQLite reads a live worker's
    # row from the live rows in memory, not the table, before its compare-and-set.
    "postgres": {"warm claim": 2, "renew": 1, "release": 1, "reuse claim": 2},
    "sqlite": {"warm claim": 3, "renew": 1, "release": 3, "reuse claim": 3},
}


class Counter:
    """Counts what `count()` is told about, between `start()` and `take()`."""

    def __init__(self) -> None:
        self.n = 0
        self.on = False

    def count(self) -> None:
        if self.on:
            self.n += 1

    def start(self) -> None:
        self.n, self.on = 0, True

    def take(self) -> int:
        self.on = False
        return self.n


class SqliteStatements:
    """A trace callback counting the statements that read or write rows: transaction
    control (BEGIN, COMMIT, savepoints, shared by a whole group commit) and pragmas are
    left out, and so are the repeats SQLite reports for each trigger a statement fires."""

    ROWS = ("SELECT", "INSERT", "UPDATE", "DELETE", "WITH")

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.last = ""

    def __call__(self, sql: str) -> None:
        if sql == self.last or sql.startswith("--"):
            return
        self.last = sql
        if sql.lstrip().upper().startswith(self.ROWS):
            self.counter.count()


@contextmanager
def counting_postgres(counter: Counter) -> Iterator[None]:
    """Count every round trip of every psycopg async connection: each operation the
    connection waits for (`AsyncConnection.wait`) that has to wait on the socket at all (a
    COMMIT outside a transaction, say, sends nothing)."""
    wait = psycopg.AsyncConnection.wait

    def watched(gen: Generator[Any, Any, Any]) -> Generator[Any, Any, Any]:
        try:
            step = next(gen)
        except StopIteration as done:
            return done.value
        counter.count()
        while True:
            ready = yield step
            try:
                step = gen.send(ready)
            except StopIteration as done:
                return done.value

    async def counted(
        self: psycopg.AsyncConnection[Any], gen: Generator[Any, Any, Any], *args: Any, **kw: Any
    ) -> Any:
        return await wait(self, watched(gen), *args, **kw)

    psycopg.AsyncConnection.wait = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        psycopg.AsyncConnection.wait = wait  # type: ignore[method-assign]


@asynccontextmanager
async def plane_on(
    kind: str,
    tmp_path: Path,
    counter: Counter,
    *,
    joining: str | None = None,
    runtime: MemoryRuntime | None = None,
) -> AsyncIterator[ControlPlane]:
    """A started control plane (no background loops) on a fresh store of `kind` whose
    pool it fills, or, `joining` a PostgreSQL schema, a replica of a fleet already there."""
    store: Store
    schema = joining or f"stoker_test_{uuid.uuid4().hex[:12]}"
    if kind == "postgres":
        store = PostgresStore(POSTGRES_URL, schema=schema, max_size=2)
    else:
        store = SqliteStore(str(tmp_path / "stoker.db"))
    runtime = runtime or MemoryRuntime(ready_delay=0.0)
    plane = ControlPlane(
        store=store,
        runtime=runtime,
        activator=runtime,
        pools=[POOL],
        settings=PlaneSettings(),
        clock=LoopClock(),
    )
    try:
        await plane.start(loops=False)
    except StoreError as exc:
        if kind == "sqlite" or os.environ.get("CI") == "true":
            raise
        pytest.skip(f"PostgreSQL is not reachable: {exc}")
    if isinstance(store, SqliteStore):
        store.db.set_trace_callback(SqliteStatements(counter))
    try:
        if not joining:
            await plane.run_janitor_pass()  # fills the warm target
            for _ in range(200):
                if len(await store.list_workers(states=[WorkerState.WARM])) == POOL.warm_target:
                    break
                await asyncio.sleep(0.01)
        yield plane
    finally:
        await plane.stop()
        if kind == "postgres" and not joining:
            async with await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True) as c:
                await c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def settled(plane: ControlPlane) -> None:
    """Wait until the plane's background writes (busy marks, refills) are done."""
    for _ in range(100):
        await asyncio.sleep(0.01)
        if not plane.book.background_tasks():
            return


async def measured(
    counter: Counter, plane: ControlPlane, step: Callable[[], Any]
) -> tuple[int, Any]:
    await settled(plane)
    counter.start()
    result = await step()
    return counter.take(), result


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_round_trips_per_claim_release_and_renewal(kind: str, tmp_path: Path) -> None:
    counter = Counter()
    with counting_postgres(counter):
        async with plane_on(kind, tmp_path, counter) as plane:
            request = ClaimRequest(pool="p", org="acme", timeout_s=5)
            counts: dict[str, int] = {}
            counts["warm claim"], first = await measured(
                counter, plane, lambda: plane.claim(request)
            )
            assert first.source is ClaimSource.WARM
            counts["renew"], _ = await measured(counter, plane, lambda: plane.renew(first.id))
            counts["release"], _ = await measured(counter, plane, lambda: plane.release(first.id))
            parked = await plane.store.get_worker(first.worker_id)
            assert parked is not None and parked.state is WorkerState.HOT_IDLE
            counts["reuse claim"], again = await measured(
                counter, plane, lambda: plane.claim(request)
            )
            assert again.source is ClaimSource.REUSE
    assert counts == EXPECTED[kind]
    if kind == "postgres":
        # The targets of the PostgreSQL claim path (see docs/guides/replicas.md).
        assert counts["warm claim"] <= 3 and counts["reuse claim"] <= 3
        assert counts["release"] <= 2


@pytest.mark.postgres
async def test_a_replica_that_spawned_no_worker_claims_warm_in_two_round_trips(
    tmp_path: Path,
) -> None:
    """Its queues hold none of the warm workers: the look for a parked worker and the
    store's pick of a warm one are one statement, then the bind."""
    counter, runtime = Counter(), MemoryRuntime(ready_delay=0.0)
    with counting_postgres(counter):
        async with plane_on("postgres", tmp_path, counter, runtime=runtime) as spawner:
            schema = spawner.store.schema  # type: ignore[attr-defined]
            async with plane_on(
                "postgres", tmp_path, counter, joining=schema, runtime=runtime
            ) as other:
                await settled(spawner)
                request = ClaimRequest(pool="p", org="acme", timeout_s=5)
                n, claim = await measured(counter, other, lambda: other.claim(request))
                spawned = await other.store.get_worker(claim.worker_id)
    assert claim.source is ClaimSource.WARM and spawned is not None
    assert spawned.owner == other.book.instance_id
    assert n == 2
