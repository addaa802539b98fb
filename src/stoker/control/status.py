"""What a replica shows of its pools: `GET /v1/pools`, `stoker status` and the samples of
the dashboard's chart, read off the catalog, the store's counts, the spawner's trouble and
the janitor's last sizing."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from stoker.control.catalog import Catalog
from stoker.control.history import History, PoolSample
from stoker.control.janitor import Janitor
from stoker.control.sizing import SizingStatus
from stoker.control.spawning import Spawner
from stoker.domain.states import LIVE
from stoker.ports.store import StoreReader


@dataclass(frozen=True, slots=True)
class PoolStatus:
    """What `GET /v1/pools/{name}` and `stoker status` show of one pool."""

    name: str
    revision: str
    warm_target: int
    desired_warm: int
    demand: int
    cap: int
    max_workers_per_org: int
    reuse: str
    counts: Mapping[str, int]
    #: True while spawns of the current revision fail in a row and the pool backs off.
    spawn_failing: bool = False
    #: Spawns of the current revision that failed in a row.
    spawn_failures: int = 0
    #: The last of those failures, as the runtime reported it.
    last_spawn_error: str | None = None
    #: How the last janitor pass sized the pool; null on a replica that does not lead.
    sizing: SizingStatus | None = None


async def pool_statuses(
    store: StoreReader, catalog: Catalog, spawner: Spawner, janitor: Janitor
) -> list[PoolStatus]:
    """Targets, demand and counts by state of every pool."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for c in await store.count_workers():
        counts[c.pool][c.state.value] += c.count
    out = []
    for name, pool in catalog.pools.items():
        trouble = spawner.trouble(pool)
        out.append(
            PoolStatus(
                name=name,
                revision=pool.revision,
                warm_target=pool.warm_target,
                desired_warm=janitor.desired.get(name, pool.warm_target),
                demand=janitor.demand.get(name, 0),
                cap=catalog.pool_cap(pool),
                max_workers_per_org=pool.max_workers_per_org,
                reuse=pool.reuse.value,
                counts={s.value: counts[name].get(s.value, 0) for s in LIVE},
                spawn_failing=trouble is not None,
                spawn_failures=trouble.failures if trouble else 0,
                last_spawn_error=trouble.last_error if trouble else None,
                sizing=SizingStatus.of(sized) if (sized := janitor.sizing(name)) else None,
            )
        )
    return out


def add_samples(history: History, statuses: Iterable[PoolStatus], now: float) -> None:
    """One sample of each pool in `history`, taken at `now`."""
    for status in statuses:
        counts = status.counts
        history.add(
            status.name,
            PoolSample(
                at=now,
                warm_target=status.warm_target,
                desired_warm=status.desired_warm,
                demand=status.demand,
                warm=counts.get("warm", 0),
                hot=counts.get("hot", 0),
                hot_idle=counts.get("hot_idle", 0),
                spawning=counts.get("spawning", 0),
            ),
        )
