"""The janitor's passive *sync*: what one pass reads of the world.

A pass reads the store (rows, replicas, claims past their lease) and, now and then, the
runtime's objects into a `World` snapshot; the janitor's step decides from it alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from stoker.control import logs
from stoker.control.shared import Shared
from stoker.domain.errors import RuntimeFailure
from stoker.domain.records import Claim, Worker
from stoker.domain.states import LIVE, ClaimState, WorkerState
from stoker.ports.runtime import Runtime, RuntimeObject
from stoker.ports.store import ReplicaStore, StateCount

#: States a worker passes through on its way somewhere (the stuck-row sweep watches them).
_IN_FLIGHT = frozenset(
    {WorkerState.SPAWNING, WorkerState.RESERVED, WorkerState.ACTIVATING, WorkerState.DRAINING}
)


class Reach(Enum):
    """Fleet: the leader's janitor. Own: a replica's fallback reaper."""

    FLEET = "fleet"
    OWN = "own"


@dataclass(slots=True)
class World:
    """What one sync read."""

    now: float
    counts: list[StateCount] = field(default_factory=list)
    warm: list[Worker] = field(default_factory=list)
    hot_idle: list[Worker] = field(default_factory=list)
    in_flight: list[Worker] = field(default_factory=list)
    expired: list[Claim] = field(default_factory=list)
    live_instances: set[str] = field(default_factory=set)
    #: Every replica the store has a record of, gone ones included.
    known_instances: set[str] = field(default_factory=set)
    orphans: list[Worker] = field(default_factory=list)
    objects: list[RuntimeObject] | None = None


class WorldReader:
    """Reads the world for one kind of pass (the fleet's, or this replica's own)."""

    def __init__(
        self, shared: Shared, *, reach: Reach, store: ReplicaStore, runtime: Runtime
    ) -> None:
        self.reach = reach
        self._clock, self._settings = shared.clock, shared.settings
        self._instance_id = shared.book.instance_id
        self._store = store
        self._runtime = runtime
        self._last_scan: float | None = None

    async def read(self) -> World:
        """Passive: read the world (store rows, replicas, runtime objects)."""
        store, now, mine = self._store, self._clock.now(), self._instance_id
        world = World(now=now)
        # Liveness by heartbeat age, not only by state: the fallback reaper must recognise
        # a dead replica's orphans while no leader runs the instance expiry.
        fresh_after = now - self._settings.instance_expiry_s
        instances = await store.list_instances()
        world.live_instances = {
            i.id for i in instances if i.state == "active" and i.heartbeat_at >= fresh_after
        }
        if self.reach is Reach.FLEET:
            stale = {i.id for i in instances if i.state == "active"} - world.live_instances
            stale.discard(mine)
            if stale:
                # A stale replica whose heartbeat lands after the listing is not expired:
                # only those the expiry took are gone, the others keep their workers.
                expired = await store.expire_instances(before=fresh_after, now=now, keep=mine)
                world.live_instances |= stale - set(expired)
        world.live_instances.add(mine)
        world.known_instances = {i.id for i in instances} | {mine}
        # Every claim past its lease, whoever served it: the fallback reaper ends its own
        # and those of replicas that are gone (the janitor's step sorts them out), so a
        # dead replica's sessions end while nobody leads too.
        world.expired = await store.list_claims(states=[ClaimState.BOUND], expires_before=now)
        if self.reach is Reach.OWN:
            world.hot_idle = await store.list_workers(states=[WorkerState.HOT_IDLE])
        else:
            world.counts = await store.count_workers()
            # Every live row but the hot ones, sorted out here (oldest first, as listed);
            # of the hot ones (most of a busy fleet) only those of dead replicas.
            idle = await store.list_workers(states=LIVE - {WorkerState.HOT})
            world.hot_idle = [w for w in idle if w.state is WorkerState.HOT_IDLE]
            world.warm = [w for w in idle if w.state is WorkerState.WARM]
            world.in_flight = [w for w in idle if w.state in _IN_FLIGHT]
            world.orphans = [w for w in idle if w.owner not in world.live_instances]
            world.orphans += await store.list_workers(
                states=[WorkerState.HOT], not_owners=sorted(world.live_instances)
            )
            scan_due = self._clock.monotonic() - self._settings.stranded_scan_s
            if self._last_scan is None or self._last_scan <= scan_due:
                self._last_scan = self._clock.monotonic()
                try:
                    world.objects = await self._runtime.list_objects()
                except RuntimeFailure as exc:
                    logs.event("list_objects_failed", error=str(exc), level=logs.WARNING)
        return world
