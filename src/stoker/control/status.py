"""What a replica shows of its pools: `GET /v1/pools`, `stoker status` and the samples of
the dashboard's charts, read off the catalog, the store's counts, the spawner's trouble,
the janitor's last sizing and the rollout plan."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from stoker.control.catalog import Catalog
from stoker.control.history import History, PoolSample, RevisionSample
from stoker.control.janitor import Janitor
from stoker.control.rollouts import Rollouts
from stoker.control.sizing import SizingStatus
from stoker.control.spawning import Spawner
from stoker.control.stored_pools import revision_shares
from stoker.domain.specs import PoolSpec
from stoker.domain.states import LIVE, WorkerState
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
    #: Why the pool's rollout under way waits, as the last janitor pass planned it ("": it
    #: does not); null without a rollout or on a replica that does not lead.
    rollout_waits: str | None = None


async def pool_statuses(
    store: StoreReader,
    catalog: Catalog,
    spawner: Spawner,
    janitor: Janitor,
    rollouts: Rollouts | None = None,
) -> list[PoolStatus]:
    """Targets, demand and counts by state of every pool."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for c in await store.count_workers():
        counts[c.pool][c.state.value] += c.count
    out = []
    for name, pool in catalog.pools.items():
        plan = rollouts.plans.get(name) if rollouts is not None else None
        ramp = catalog.rollout(name)
        waits = None
        if plan is not None and plan.ramp is not None and ramp is not None and ramp.active:
            waits = plan.waits
        trouble = spawner.trouble(pool)
        out.append(
            PoolStatus(
                name=name,
                revision=pool.revision,
                warm_target=pool.warm_target,
                desired_warm=janitor.desired.get(name, pool.warm_target),
                demand=janitor.demand.get(name, 0),
                cap=_cap(catalog, pool),
                max_workers_per_org=pool.max_workers_per_org,
                reuse=pool.reuse.value,
                counts={s.value: counts[name].get(s.value, 0) for s in LIVE},
                spawn_failing=trouble is not None,
                spawn_failures=trouble.failures if trouble else 0,
                last_spawn_error=trouble.last_error if trouble else None,
                sizing=SizingStatus.of(sized) if (sized := janitor.sizing(name)) else None,
                rollout_waits=waits,
            )
        )
    return out


def _cap(catalog: Catalog, pool: PoolSpec) -> int:
    """The pool cap in force; when the pool's template gives none (a stored template the
    runtime cannot read, which `/readyz` reports), the configured `max_workers`, so that
    one broken pool never breaks the listing of all."""
    try:
        return catalog.pool_cap(pool)
    except Exception:  # whatever the template holds; the janitor's faults name it
        return pool.max_workers


async def revision_samples(
    store: StoreReader, catalog: Catalog
) -> dict[str, tuple[RevisionSample, ...]]:
    """Each pool's revisions now: share by the stored rollout, warm and busy workers."""
    warm: dict[tuple[str, str], int] = defaultdict(int)
    busy: dict[tuple[str, str], int] = defaultdict(int)
    for c in await store.count_workers():
        if c.state is WorkerState.WARM:
            warm[c.pool, c.revision] += c.count
        elif c.state not in (WorkerState.SPAWNING, WorkerState.DRAINING):
            busy[c.pool, c.revision] += c.count
    out = {}
    for name, pool in catalog.pools.items():
        shares = revision_shares(pool.revision, catalog.rollout(name))
        live = sorted({rev for p, rev in (*warm, *busy) if p == name} - set(shares))
        out[name] = tuple(
            RevisionSample(
                rev,
                shares[rev][1] / 100 if rev in shares else 0.0,
                warm[name, rev],
                busy[name, rev],
            )
            for rev in [*shares, *live]
        )
    return out


def add_samples(
    history: History,
    statuses: Iterable[PoolStatus],
    now: float,
    revisions: Mapping[str, tuple[RevisionSample, ...]] | None = None,
) -> None:
    """One sample of each pool in `history`, taken at `now` (with its `revisions`)."""
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
                revisions=(revisions or {}).get(status.name, ()),
            ),
        )
