"""Workers decoded from SQLite rows and kept (`DecodedRows`), and a write's own record of
the row it wrote taken as that row's decoding only when it reads back the same."""

from __future__ import annotations

import math
from typing import Any

import pytest

from stoker.adapters._rows import WORKER_SELECT, worker_from_row, worker_to_row
from stoker.adapters.sqlite import SqliteStore
from stoker.adapters.sqlite.decoded import DecodedRows, reads_back
from stoker.domain.records import Worker
from stoker.domain.states import WorkerState
from store_contract import T0, spawn_req

S = WorkerState


def copy_of(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """An equal row, another object (`tuple(row)` would be the row itself)."""
    return row[:1] + row[1:]


def warm(**changes: Any) -> Worker:
    worker = Worker("w1", "p", "r1", S.WARM, 1, "cp-a", T0, T0, version=3)
    return worker.evolve(**changes)


@pytest.mark.parametrize(
    ("name", "value", "back"),
    [
        ("owner", "cp-b", True),
        ("org", None, True),  # nullable
        ("owner", None, False),  # NOT NULL: the write fails
        ("epoch", 2, True),
        ("epoch", True, False),  # a bool reads back as an int
        ("activated", True, True),
        ("activated", 1, False),  # an int reads back as a bool
        ("heartbeat_at", 1700000018.5, True),
        ("heartbeat_at", 0.0, True),
        ("heartbeat_at", 12, False),  # an int reads back as a float
        ("heartbeat_at", -0.0, False),  # SQLite reads it back as 0.0
        ("ttl_s", math.nan, False),  # SQLite stores NaN as NULL
        ("ttl_s", math.inf, True),
        ("runtime_ref", {"pod": "w1"}, False),  # JSON: a sorted copy
    ],
)
def test_a_value_reads_back_only_as_itself(name: str, value: Any, back: bool) -> None:
    assert reads_back(name, value) is back


def test_the_same_row_object_is_decoded_once_and_an_equal_one_shares_the_decoding() -> None:
    decoded = DecodedRows()
    row = worker_to_row(warm())
    first = decoded.worker(row)
    assert first == warm() and decoded.worker(row) is first
    assert decoded.worker(copy_of(row)) is first  # equal row, another object


def test_a_writes_record_is_the_rows_decoding_when_it_reads_back() -> None:
    decoded = DecodedRows()
    moved = warm(state=S.RESERVED, epoch=2, version=4, updated_at=T0 + 1, org="acme")
    row = worker_to_row(moved)
    decoded.written(row, moved, {"org": "acme"})
    assert decoded.worker(row) is moved
    # Another object for the row (read again from the table): decoded from it.
    again = decoded.worker(copy_of(row))
    assert again == moved and again is not moved


@pytest.mark.parametrize(
    "changes",
    [{"heartbeat_at": 5}, {"runtime_ref": {"pod": "w1"}}, {"activated": 1}],
)
def test_a_writes_record_that_would_not_read_back_is_left_to_the_decoder(
    changes: dict[str, Any],
) -> None:
    decoded = DecodedRows()
    moved = warm(state=S.RESERVED, org="acme", **changes)
    row = worker_to_row(moved)
    decoded.written(row, moved, changes)
    worker = decoded.worker(row)
    assert worker is not moved and worker == worker_from_row(row)


async def test_the_stores_reads_after_its_writes_are_the_tables_rows() -> None:
    """Every worker the store hands out after its compare-and-sets (from memory) is the
    table's row decoded, field by field and type by type."""
    store = SqliteStore(":memory:")
    await store.open()
    try:
        (spawned,) = (await store.reserve_spawn_slots(spawn_req(), ["w1"], T0)).workers
        ready = await store.transition(
            "w1",
            expect=S.SPAWNING,
            to=S.WARM,
            epoch=spawned.epoch,
            version=spawned.version,
            now=T0 + 1,
            changes={"endpoint": "http://w1", "runtime_ref": {"pod": "w1", "node": "n"}},
        )
        assert ready is not None
        taken = await store.reserve(
            "w1",
            now=T0 + 2.5,
            expect=S.WARM,
            epoch=ready.epoch,
            version=ready.version,
            org="acme",
            org_cap=0,
            owner="cp-a",
            activate=True,
        )
        assert taken.worker is not None
        for _ in range(2):  # the first read of a row, then the kept one
            read = await store.get_worker("w1")
            (row,) = store.db.execute(f"SELECT {WORKER_SELECT} FROM workers").fetchall()
            table = worker_from_row(row)
            assert read == table
            assert [type(v) for v in vars_of(read)] == [type(v) for v in vars_of(table)]
            assert read is taken.worker  # the write's own record, not decoded again
    finally:
        await store.close()


def vars_of(worker: Worker) -> list[Any]:
    return [getattr(worker, name) for name in Worker.__slots__]
