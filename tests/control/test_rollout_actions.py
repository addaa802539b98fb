"""An admin's pause, resume, abort and promote of a rollout, on the real SQLite store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from stoker.adapters.sqlite import SqliteStore
from stoker.control.catalog import Catalog
from stoker.control.metrics import Metrics
from stoker.control.rollout_actions import Action, RolloutActions
from stoker.control.rollouts import Rollouts
from stoker.domain.errors import NotFound, RolloutEnded
from stoker.domain.pools import Rollout, StoredPool, StoredRevision
from stoker.domain.rollouts import CanaryStrategy, RolloutState
from stoker.domain.specs import PoolSpec, ProcessTemplate, revision_of
from stoker.ports.clock import VirtualClock

OLD = ProcessTemplate(argv=("worker", "{port}"))
NEW = ProcessTemplate(argv=("worker", "--v2", "{port}"))


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[tuple[SqliteStore, Catalog, RolloutActions]]:
    store = SqliteStore(str(tmp_path / "stoker.db"))
    await store.open()
    spec = PoolSpec(name="p", template=OLD, warm_target=2)
    stored = await store.create_pool(StoredPool(spec=spec, generation=0), now=0.0)
    assert stored is not None
    rollout = Rollout(
        id="ro-1",
        pool="p",
        revision=revision_of(NEW),
        base_revision=spec.revision,
        strategy=CanaryStrategy(),
        state=RolloutState.RAMPING,
        started_at=0.0,
        share=10,
        step_started_at=0.0,
    )
    await store.start_rollout(rollout, NEW, generation=stored.generation, now=0.0)
    catalog = Catalog({"p": spec}, {}, derived_cap=lambda _pool: 0)
    catalog.adopt(rollout, StoredRevision("p", rollout.revision, NEW, 0.0))
    rollouts = Rollouts(catalog, Metrics())
    clock = VirtualClock()
    yield (
        store,
        catalog,
        RolloutActions(store=store, catalog=catalog, rollouts=rollouts, clock=clock),
    )
    await store.close()


async def test_pause_and_resume_are_written_and_served(
    parts: tuple[SqliteStore, Catalog, RolloutActions],
) -> None:
    store, catalog, actions = parts
    paused = await actions.act("p", "ro-1", Action.PAUSE)
    assert paused.state is RolloutState.PAUSED
    stored = await store.get_rollout("ro-1")
    assert stored is not None and stored.state is RolloutState.PAUSED
    resumed = await actions.act("p", "ro-1", Action.RESUME)
    assert resumed.state is RolloutState.RAMPING
    assert resumed.step_started_at is not None and resumed.step_started_at > 0
    current = catalog.rollout("p")
    assert current is not None and current.state is RolloutState.RAMPING


async def test_promote_makes_the_new_revision_stable_at_once(
    parts: tuple[SqliteStore, Catalog, RolloutActions],
) -> None:
    store, catalog, actions = parts
    promoted = await actions.act("p", "ro-1", Action.PROMOTE)
    assert promoted.state is RolloutState.PROMOTED and promoted.share == 100
    assert catalog.pool("p").revision == revision_of(NEW)
    pool = await store.get_pool("p")
    assert pool is not None and pool.revision == revision_of(NEW)


async def test_an_ended_rollout_refuses_every_action(
    parts: tuple[SqliteStore, Catalog, RolloutActions],
) -> None:
    store, _catalog, actions = parts
    aborted = await actions.act("p", "ro-1", Action.ABORT)
    assert aborted.state is RolloutState.ABORTED and aborted.share == 0
    for action in Action:
        with pytest.raises(RolloutEnded):
            await actions.act("p", "ro-1", action)
    pool = await store.get_pool("p")
    assert pool is not None and pool.revision == revision_of(OLD)


async def test_unknown_pools_and_rollouts_are_not_found(
    parts: tuple[SqliteStore, Catalog, RolloutActions],
) -> None:
    _store, _catalog, actions = parts
    with pytest.raises(NotFound):
        await actions.get("p", "ro-nope")
    with pytest.raises(NotFound):
        await actions.get("other", "ro-1")
