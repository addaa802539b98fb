"""The lifecycle's writes carry the version of the record they were decided on."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from stoker.adapters.sqlite import SqliteStore
from stoker.control.lifecycle import Lifecycle
from stoker.control.metrics import Metrics
from stoker.domain.records import Worker
from stoker.domain.states import WorkerState
from stoker.ports.clock import VirtualClock
from store_contract import Fleet, make_claim, must

S = WorkerState


async def _activating(tmp_path: Path) -> tuple[SqliteStore, Lifecycle, Worker]:
    store = SqliteStore(str(tmp_path / "stoker.db"))
    await store.open()
    lifecycle = Lifecycle(store, VirtualClock(), Metrics(CollectorRegistry()))
    return store, lifecycle, await Fleet(store).activating("org-a")


async def test_a_move_from_a_stale_read_misses_even_when_it_keeps_the_state(
    tmp_path: Path,
) -> None:
    store, lifecycle, a = await _activating(tmp_path)
    try:
        adopted = must(await lifecycle.move(a, S.ACTIVATING, owner="cp-b"))
        assert adopted.version == a.version + 1
        assert await lifecycle.move(a, S.ACTIVATING, owner="cp-c") is None
        assert await store.get_worker(a.id) == adopted
    finally:
        await store.close()


async def test_bind_after_the_activations_own_heartbeat_wrote_the_row(tmp_path: Path) -> None:
    """The heartbeat's write can land between the read the bind was decided on and the
    bind: the bind goes through on the row as the heartbeat left it."""
    store, lifecycle, a = await _activating(tmp_path)
    try:
        beat = must(await lifecycle.heartbeat(a))
        assert beat.version == a.version + 1
        hot = must(await lifecycle.bind(a, make_claim(a, "c-1", lifecycle.clock.now())))
        assert (hot.state, hot.claim_id, hot.version) == (S.HOT, "c-1", beat.version + 1)
        assert not lifecycle._beats  # the activation is over: its heartbeat is let go
    finally:
        await store.close()


async def test_bind_misses_once_another_replica_adopted_the_worker(tmp_path: Path) -> None:
    store, lifecycle, a = await _activating(tmp_path)
    try:
        adopted = must(await lifecycle.move(a, S.ACTIVATING, owner="cp-b"))
        assert await lifecycle.bind(a, make_claim(a, "c-1", lifecycle.clock.now())) is None
        assert await store.get_worker(a.id) == adopted
        assert await store.get_claim("c-1") is None
    finally:
        await store.close()
