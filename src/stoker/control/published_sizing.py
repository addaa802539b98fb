"""Each pool's last sizing as the leader published it, so that every replica shows the same.

The leader's janitor sizes the pools in its own memory (`control.sizing`, `control.scaler`).
After each pass it writes what the pass decided of each pool (desired warm, demand, the
terms of the sizing, why a rollout waits) to the store, in one write, never on the claim
path; every replica's pool listing and the dashboard's samples read it back
(`control.status`), so replicas behind a load balancer answer alike.

A sizing older than `STALE_PASSES` janitor intervals is stale: no replica has sized the pool
since (no replica leads, or the leader's passes fail for that pool). The listing keeps its
figures, the last ones any replica decided, flagged `sizing_stale` with their age
(docs/scaling.md, "Where the figures come from").

The same row carries the leader's spawn trouble of the pool's current revision (its
`SpawnsFailing`, under `TROUBLE_KEY` of the terms, absent when its spawns work): spawn
trouble is each replica's own, and the leader makes the warm spawns, so a replica that does
not lead would otherwise show a pool all well whose warm spawns fail (`control.status`).
In the terms' JSON, not a column: a replica of an older version ignores a key it does not
know, and no migration is needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stoker.control import logs
from stoker.control.catalog import Catalog
from stoker.control.sizing import Sizing, SizingStatus
from stoker.control.spawning import SpawnsFailing
from stoker.domain.errors import StoreError
from stoker.domain.records import PoolSizingRecord
from stoker.domain.specs import PoolSpec
from stoker.ports.store import ReplicaStore, StoreReader

#: Janitor intervals after which a published sizing is stale: a pass or two may be slow,
#: three missed in a row mean nobody sizes the pool.
STALE_PASSES = 3

#: The fields of a `SizingStatus`, the keys of a record's `sizing`.
_STATUS_NAMES = tuple(f.name for f in dataclasses.fields(SizingStatus))
_STATUS_FIELDS = frozenset(_STATUS_NAMES)
#: The key of a record's `sizing` that holds the leader's spawn trouble (`PublishedTrouble`).
TROUBLE_KEY = "spawn_trouble"


@dataclass(frozen=True, slots=True)
class PublishedTrouble:
    """The spawn trouble of a pool revision as the leader published it with its sizing:
    the failures since its spawns last worked and the last error (the runtime's message,
    which the leader's own status shows too)."""

    revision: str
    failures: int
    last_error: str

    def terms(self) -> dict[str, Any]:
        """How a record's `sizing` carries it (JSON)."""
        return {
            "revision": self.revision,
            "failures": self.failures,
            "last_error": self.last_error,
        }

    @classmethod
    def of_terms(cls, terms: Mapping[str, Any]) -> PublishedTrouble | None:
        """The trouble a record's terms carry; None when they carry none, or carry it in a
        shape this version cannot read (a replica of another version wrote it)."""
        raw = terms.get(TROUBLE_KEY)
        if not isinstance(raw, Mapping):
            return None
        revision, failures, error = raw.get("revision"), raw.get("failures"), raw.get("last_error")
        if not (
            isinstance(revision, str)
            and isinstance(failures, int)
            and not isinstance(failures, bool)
            and failures > 0
            and isinstance(error, str)
        ):
            return None
        return cls(revision, failures, error)


@dataclass(frozen=True, slots=True)
class ShownSizing:
    """A pool's sizing as every replica shows it (`GET /v1/pools`, the chart's samples)."""

    desired_warm: int
    demand: int
    sizing: SizingStatus | None = None
    rollout_waits: str | None = None
    #: The replica that sized the pool, when (seconds since the Unix epoch), and how long
    #: ago as the reading replica's clock sees it; None before any replica sized it.
    sized_by: str | None = None
    sized_at: float | None = None
    age_s: float | None = None
    #: True when older than `STALE_PASSES` janitor intervals: nobody sizes the pool now.
    stale: bool = False
    #: The spawn trouble of the pool's current revision the leader published with the
    #: sizing; None when it published none, when the row is stale (nobody vouches for it
    #: now), or when it was of another revision (the leader had not read a rollout yet).
    trouble: PublishedTrouble | None = None

    @classmethod
    def unsized(cls, pool: PoolSpec) -> ShownSizing:
        """A pool no replica has sized yet: its static target, no demand."""
        return cls(desired_warm=pool.warm_target, demand=0)


def sizing_record(
    pool: str,
    *,
    instance: str,
    sized_at: float,
    desired_warm: int,
    demand: int,
    sized: Sizing | None,
    rollout_waits: str | None,
    revision: str,
    failing: SpawnsFailing | None,
) -> PoolSizingRecord:
    """The row the leader publishes of one pool's sizing, and of the spawn trouble of its
    current `revision` as the leader's spawner shows it (`failing`; None: none)."""
    # Every field is a number, a string, a bool or None: a shallow copy is the whole
    # record (`dataclasses.asdict` copies recursively, a tenth of a pass's cost here).
    terms: dict[str, Any] = {}
    if sized is not None:
        status = SizingStatus.of(sized)
        terms = {name: getattr(status, name) for name in _STATUS_NAMES}
    if failing is not None:
        terms[TROUBLE_KEY] = PublishedTrouble(
            revision, failing.failures, failing.last_error
        ).terms()
    return PoolSizingRecord(
        pool=pool,
        instance=instance,
        sized_at=sized_at,
        desired_warm=desired_warm,
        demand=demand,
        sizing=terms,
        rollout_waits=rollout_waits,
    )


def status_of(terms: Mapping[str, Any]) -> SizingStatus | None:
    """The `SizingStatus` of a published row's terms; None when there are none, or when a
    replica of another version wrote fields this one cannot read (or only the spawn
    trouble: a pool sized without its terms)."""
    known = {k: v for k, v in terms.items() if k in _STATUS_FIELDS}
    if not known:
        return None
    try:
        return SizingStatus(**known)
    except TypeError:
        return None


def shown(
    record: PoolSizingRecord,
    *,
    now: float,
    janitor_interval_s: float,
    rollout_active: bool,
    revision: str,
) -> ShownSizing:
    """How a replica shows `record` at `now`: its figures, their age, whether stale;
    `rollout_waits` only while the pool's rollout is still active; the spawn trouble only
    while fresh and of the pool's current `revision`."""
    age = max(0.0, now - record.sized_at)
    stale = age > STALE_PASSES * janitor_interval_s
    trouble = None if stale else PublishedTrouble.of_terms(record.sizing)
    return ShownSizing(
        desired_warm=record.desired_warm,
        demand=record.demand,
        sizing=status_of(record.sizing),
        rollout_waits=record.rollout_waits if rollout_active else None,
        sized_by=record.instance,
        sized_at=record.sized_at,
        age_s=round(age, 3),
        stale=stale,
        trouble=trouble if trouble is not None and trouble.revision == revision else None,
    )


async def read_shown(
    store: StoreReader, catalog: Catalog, *, now: float, janitor_interval_s: float
) -> dict[str, ShownSizing]:
    """Every pool of `catalog` as the leader last sized it (`ShownSizing.unsized` for a pool
    nobody has sized). Raises StoreError when the store cannot be read."""
    published = {r.pool: r for r in await store.read_sizing()}
    out = {}
    for name, pool in catalog.pools.items():
        record = published.get(name)
        if record is None:
            out[name] = ShownSizing.unsized(pool)
            continue
        ramp = catalog.rollout(name)
        out[name] = shown(
            record,
            now=now,
            janitor_interval_s=janitor_interval_s,
            rollout_active=ramp is not None and ramp.active,
            revision=pool.revision,
        )
    return out


async def publish(store: ReplicaStore, records: list[PoolSizingRecord]) -> bool:
    """Write the leader's sizings of one pass; False (logged) when the write failed: the
    next pass writes newer ones, and meanwhile the listing shows the older ones' age."""
    try:
        await store.record_sizing(records)
    except StoreError as exc:
        logs.event("sizing_publish_failed", error=str(exc), level=logs.WARNING)
        return False
    return True
