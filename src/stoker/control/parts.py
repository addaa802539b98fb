"""The parts of one replica and how they are put together.

The store's writer side is reachable only through the lifecycle (in `Shared`); every
other part is handed the store as a `StoreReader` (or, for the demand rows and the
janitor's housekeeping, a `ReplicaStore`), so the type checker refuses a worker or claim
write anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from stoker.control.binding import Binder
from stoker.control.claims import Claims
from stoker.control.demand import DemandPublisher
from stoker.control.events import RuntimeEvents
from stoker.control.idempotency import IdempotentClaims
from stoker.control.janitor import Janitor
from stoker.control.pins import Pins
from stoker.control.reservations import Reservations
from stoker.control.retiring import Retirer
from stoker.control.scaler import DemandSource
from stoker.control.sessions import Sessions
from stoker.control.shared import Shared
from stoker.control.spawning import Spawner
from stoker.control.stored_pools import StoredPools
from stoker.control.world import Reach, WorldReader
from stoker.ports.activator import Activator
from stoker.ports.runtime import Runtime
from stoker.ports.store import Store


@dataclass(frozen=True, slots=True)
class Parts:
    """The parts a `ControlPlane` calls (the others are inside these)."""

    claims: Claims
    #: Claims through their Idempotency-Key (the API's entry).
    idempotent: IdempotentClaims
    sessions: Sessions
    retirer: Retirer
    spawner: Spawner
    events: RuntimeEvents
    demand: DemandPublisher
    janitor: Janitor
    reaper: Janitor
    pins: Pins


def assemble(
    shared: Shared,
    pools: StoredPools,
    store: Store,
    runtime: Runtime,
    activator: Activator,
    *,
    demand: DemandSource | None,
) -> Parts:
    """Build one replica's parts; `pools` reloads the catalog before each janitor and
    reaper pass, `demand` replaces the leader's demand read (simulator)."""
    retirer = Retirer(shared, reader=store, runtime=runtime)
    spawner = Spawner(shared, retirer=retirer, runtime=runtime)
    sessions = Sessions(shared, retirer=retirer, reader=store)
    events = RuntimeEvents(shared, retirer=retirer, spawner=spawner, reader=store)
    publisher = DemandPublisher(shared, store=store)
    pins = Pins(shared, runtime=runtime, reader=store)
    claims = Claims(
        shared,
        reservations=Reservations(shared, retirer=retirer, spawner=spawner, runtime=runtime),
        spawner=spawner,
        binder=Binder(shared, retirer=retirer, activator=activator, pins=pins),
        sessions=sessions,
        demand=publisher,
    )

    def janitor(reach: Reach, demand: DemandSource | None) -> Janitor:
        return Janitor(
            shared,
            world=WorldReader(shared, reach=reach, store=store, runtime=runtime),
            store=store,
            runtime=runtime,
            retirer=retirer,
            spawner=spawner,
            sessions=sessions,
            events=events,
            publisher=publisher,
            pins=pins,
            demand=demand,
            pools=pools,
        )

    return Parts(
        claims=claims,
        idempotent=IdempotentClaims(shared, claims=claims, reader=store),
        sessions=sessions,
        retirer=retirer,
        spawner=spawner,
        events=events,
        demand=publisher,
        janitor=janitor(Reach.FLEET, demand),
        reaper=janitor(Reach.OWN, None),
        pins=pins,
    )
