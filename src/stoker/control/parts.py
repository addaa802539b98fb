"""The parts of one replica and how they are put together.

Only the lifecycle gets the store's writer side; every other part is handed the store as
a `StoreReader` (or, for the demand rows and the janitor's housekeeping, a
`ReplicaStore`), so the type checker refuses a worker or claim write anywhere else.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from stoker.control.binding import Binder
from stoker.control.book import Book
from stoker.control.catalog import Catalog
from stoker.control.claims import Claims
from stoker.control.demand import DemandPublisher
from stoker.control.events import RuntimeEvents
from stoker.control.ids import Ids
from stoker.control.janitor import DemandSource, Janitor
from stoker.control.lifecycle import Lifecycle
from stoker.control.metrics import Metrics
from stoker.control.reservations import Reservations
from stoker.control.retiring import Retirer
from stoker.control.sessions import Sessions
from stoker.control.spawning import Spawner
from stoker.control.world import Reach, WorldReader
from stoker.domain.specs import OrgSpec, PlaneSettings, PoolSpec
from stoker.ports.activator import Activator
from stoker.ports.clock import Clock
from stoker.ports.runtime import Runtime
from stoker.ports.store import Store


@dataclass(frozen=True, slots=True)
class Parts:
    """The parts a `ControlPlane` calls (the others are inside these)."""

    catalog: Catalog
    book: Book
    claims: Claims
    sessions: Sessions
    retirer: Retirer
    spawner: Spawner
    events: RuntimeEvents
    demand: DemandPublisher
    janitor: Janitor
    reaper: Janitor


def assemble(
    *,
    store: Store,
    runtime: Runtime,
    activator: Activator,
    pools: Iterable[PoolSpec],
    orgs: Iterable[OrgSpec],
    settings: PlaneSettings,
    clock: Clock,
    metrics: Metrics,
    ids: Ids,
    instance_id: str,
    demand: DemandSource | None,
) -> Parts:
    """Build one replica's parts; `demand` replaces the leader's demand read (simulator)."""
    catalog = Catalog(
        {p.name: p for p in pools}, {o.name: o for o in orgs}, derived_cap=runtime.derived_cap
    )
    book = Book(reader=store, instance_id=instance_id)
    lifecycle = Lifecycle(store, clock, metrics)
    retirer = Retirer(
        book=book,
        lifecycle=lifecycle,
        reader=store,
        runtime=runtime,
        catalog=catalog,
        metrics=metrics,
    )
    spawner = Spawner(
        book=book,
        lifecycle=lifecycle,
        retirer=retirer,
        runtime=runtime,
        catalog=catalog,
        clock=clock,
        metrics=metrics,
        ids=ids,
        settings=settings,
    )
    sessions = Sessions(
        book=book,
        lifecycle=lifecycle,
        retirer=retirer,
        reader=store,
        catalog=catalog,
        clock=clock,
        metrics=metrics,
    )
    events = RuntimeEvents(
        book=book, lifecycle=lifecycle, retirer=retirer, reader=store, metrics=metrics
    )
    publisher = DemandPublisher(
        book=book, store=store, catalog=catalog, clock=clock, settings=settings
    )
    reservations = Reservations(
        book=book,
        lifecycle=lifecycle,
        retirer=retirer,
        spawner=spawner,
        runtime=runtime,
        clock=clock,
    )
    binder = Binder(
        book=book,
        lifecycle=lifecycle,
        retirer=retirer,
        activator=activator,
        runtime=runtime,
        catalog=catalog,
        clock=clock,
        metrics=metrics,
        ids=ids,
    )
    claims = Claims(
        book=book,
        catalog=catalog,
        reservations=reservations,
        spawner=spawner,
        binder=binder,
        sessions=sessions,
        demand=publisher,
        clock=clock,
        metrics=metrics,
        settings=settings,
    )

    def janitor(reach: Reach, demand: DemandSource | None) -> Janitor:
        world = WorldReader(
            reach=reach,
            store=store,
            runtime=runtime,
            clock=clock,
            settings=settings,
            instance_id=instance_id,
        )
        return Janitor(
            world=world,
            demand=demand,
            store=store,
            runtime=runtime,
            book=book,
            catalog=catalog,
            lifecycle=lifecycle,
            retirer=retirer,
            spawner=spawner,
            sessions=sessions,
            events=events,
            publisher=publisher,
            metrics=metrics,
            settings=settings,
        )

    return Parts(
        catalog=catalog,
        book=book,
        claims=claims,
        sessions=sessions,
        retirer=retirer,
        spawner=spawner,
        events=events,
        demand=publisher,
        janitor=janitor(Reach.FLEET, demand),
        reaper=janitor(Reach.OWN, None),
    )
