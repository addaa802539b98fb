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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stoker.control import logs
from stoker.control.catalog import Catalog
from stoker.control.sizing import Sizing, SizingStatus
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
) -> PoolSizingRecord:
    """The row the leader publishes of one pool's sizing."""
    # Every field is a number, a string, a bool or None: a shallow copy is the whole
    # record (`dataclasses.asdict` copies recursively, a tenth of a pass's cost here).
    terms = {}
    if sized is not None:
        status = SizingStatus.of(sized)
        terms = {name: getattr(status, name) for name in _STATUS_NAMES}
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
    replica of another version wrote fields this one cannot read."""
    if not terms:
        return None
    try:
        return SizingStatus(**{k: v for k, v in terms.items() if k in _STATUS_FIELDS})
    except TypeError:
        return None


def shown(
    record: PoolSizingRecord, *, now: float, janitor_interval_s: float, rollout_active: bool
) -> ShownSizing:
    """How a replica shows `record` at `now`: its figures, their age, whether stale;
    `rollout_waits` only while the pool's rollout is still active."""
    age = max(0.0, now - record.sized_at)
    return ShownSizing(
        desired_warm=record.desired_warm,
        demand=record.demand,
        sizing=status_of(record.sizing),
        rollout_waits=record.rollout_waits if rollout_active else None,
        sized_by=record.instance,
        sized_at=record.sized_at,
        age_s=round(age, 3),
        stale=age > STALE_PASSES * janitor_interval_s,
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
