"""What a replica shows of its pools: `GET /v1/pools`, `stoker status` and the samples of
the dashboard's charts, read off the catalog, the store's counts, the spawner's trouble and
the leader's last sizing as published in the store (`control.published_sizing`): every
replica shows the same figures, whichever leads, and the spawn trouble of the leader's warm
spawns as well as of its own (`shown_trouble`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from stoker.control.catalog import Catalog
from stoker.control.history import History, PoolSample, RevisionSample
from stoker.control.published_sizing import PublishedTrouble, ShownSizing, read_shown
from stoker.control.sizing import SizingStatus
from stoker.control.spawning import Spawner, SpawnsFailing
from stoker.control.stored_pools import revision_shares
from stoker.domain.specs import PoolSpec
from stoker.domain.states import LIVE, WorkerState
from stoker.ports.runtime import StartSlots
from stoker.ports.store import StateCount, StoreReader


@dataclass(frozen=True, slots=True)
class PoolStatus:
    """What `GET /v1/pools/{name}` and `stoker status` show of one pool."""

    name: str
    revision: str
    warm_target: int
    #: Warm workers the leader's last janitor pass wants, and how many of them beyond
    #: `warm_target` (as published to the store: the same on every replica);
    #: `warm_target` and 0 before any replica sized the pool.
    desired_warm: int
    demand: int
    cap: int
    max_workers_per_org: int
    reuse: str
    counts: Mapping[str, int]
    #: True while spawns of the current revision fail: from a failure until a worker
    #: asked for after the last one gets ready (or the failed pods kept waiting for a node
    #: do), not when one asked for before the failures does (`SpawnsFailing`). This
    #: replica's spawns, or the leader's as it published them with its fresh sizing
    #: (`shown_trouble`): every replica shows the leader's warm spawns failing.
    spawn_failing: bool = False
    #: Spawns of the current revision that failed since its spawns last worked.
    spawn_failures: int = 0
    #: The last of those failures, as the runtime reported it.
    last_spawn_error: str | None = None
    #: How the leader's last janitor pass sized the pool, as it published it to the store
    #: (the same on every replica); null before any replica sized it.
    sizing: SizingStatus | None = None
    #: Why the pool's rollout under way waits, as the leader's last janitor pass planned it
    #: ("": it does not); null without a rollout.
    rollout_waits: str | None = None
    #: The replica whose janitor sized the pool (the leader then), and when (seconds since
    #: the Unix epoch); null before any replica sized it.
    sized_by: str | None = None
    sized_at: float | None = None
    #: Seconds since that pass, by this replica's clock.
    sizing_age_s: float | None = None
    #: True when the sizing is older than three janitor intervals: no replica sizes the pool
    #: now (none leads, or the leader's passes fail), and `desired_warm`, `demand`,
    #: `sizing` and `rollout_waits` are the last figures published, not current ones.
    sizing_stale: bool = False
    #: This replica's janitor and fallback-reaper intervals (its config's `intervals`), the
    #: passes a backtest of the pool replays its replicas at (`stoker backtest --url`).
    janitor_interval_s: float | None = None
    reaper_interval_s: float | None = None
    #: This replica's start-up slots, when its runtime bounds start-ups (local processes:
    #: `runtime.start_limit`), and the mean seconds a start-up held one (null before one
    #: ended): spawns beyond them queue, which a backtest of the pool replays.
    start_limit: int | None = None
    start_slot_s: float | None = None


async def pool_statuses(
    store: StoreReader,
    catalog: Catalog,
    spawner: Spawner,
    *,
    now: float,
    janitor_interval_s: float,
    reaper_interval_s: float | None = None,
    counted: Sequence[StateCount] | None = None,
    instance: str | None = None,
    slots: StartSlots | None = None,
) -> list[PoolStatus]:
    """Targets, demand and counts by state of every pool at `now`, sized as the leader last
    published it (stale after three `janitor_interval_s`); `counted`: the store's
    `count_workers` already read (one read for the pools and their revisions);
    `instance`: this replica's id (what it published itself it knows fresher); `slots`:
    its runtime's start-up slots, if it bounds start-ups."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for c in await store.count_workers() if counted is None else counted:
        counts[c.pool][c.state.value] += c.count
    sizings = await read_shown(store, catalog, now=now, janitor_interval_s=janitor_interval_s)
    out = []
    for name, pool in catalog.pools.items():
        sized = sizings[name]
        trouble = shown_trouble(spawner.failing(pool), sized, instance=instance)
        out.append(
            PoolStatus(
                name=name,
                revision=pool.revision,
                warm_target=pool.warm_target,
                desired_warm=sized.desired_warm,
                demand=sized.demand,
                cap=_cap(catalog, pool),
                max_workers_per_org=pool.max_workers_per_org,
                reuse=pool.reuse.value,
                counts={s.value: counts[name].get(s.value, 0) for s in LIVE},
                spawn_failing=trouble is not None,
                spawn_failures=trouble.failures if trouble else 0,
                last_spawn_error=trouble.last_error if trouble else None,
                sizing=sized.sizing,
                rollout_waits=sized.rollout_waits,
                sized_by=sized.sized_by,
                sized_at=sized.sized_at,
                sizing_age_s=sized.age_s,
                sizing_stale=sized.stale,
                janitor_interval_s=janitor_interval_s,
                reaper_interval_s=reaper_interval_s,
                start_limit=slots.limit if slots else None,
                start_slot_s=slots.hold_s if slots else None,
            )
        )
    return out


def shown_trouble(
    own: SpawnsFailing | None, sized: ShownSizing, *, instance: str | None
) -> SpawnsFailing | PublishedTrouble | None:
    """The spawn trouble a pool's status shows: this replica's own (`own`), or the one the
    leader published with its sizing (`sized.trouble`, fresh and of the current revision
    only), whichever counts more failures; this replica's own on a tie, being current where
    the published one is up to a pass old. More failures is the longer view of the same
    trouble: the leader makes the warm spawns, most of the attempts, while another replica
    tries only a cold spawn now and then; a replica whose own cold spawns fail while the
    leader's warm ones work (or that spawns nothing) still shows its own. What this replica
    published itself (it leads, or led a moment ago) is never read back: its spawner knows
    it fresher, and an older row would show trouble that is over already."""
    published = sized.trouble if sized.sized_by != instance else None
    if published is None or (own is not None and own.failures >= published.failures):
        return own
    return published


def _cap(catalog: Catalog, pool: PoolSpec) -> int:
    """The pool cap in force; when the pool's template gives none (a stored template the
    runtime cannot read, which `/readyz` reports), the configured `max_workers`, so that
    one broken pool never breaks the listing of all."""
    try:
        return catalog.pool_cap(pool)
    except Exception:  # whatever the template holds; the janitor's faults name it
        return pool.max_workers


def revision_samples(
    counted: Iterable[StateCount], catalog: Catalog
) -> dict[str, tuple[RevisionSample, ...]]:
    """Each pool's revisions now (the store's `count_workers` as `counted`): share by the
    stored rollout, warm and busy workers."""
    warm: dict[tuple[str, str], int] = defaultdict(int)
    busy: dict[tuple[str, str], int] = defaultdict(int)
    for c in counted:
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
                sizing_stale=status.sizing_stale,
            ),
        )
