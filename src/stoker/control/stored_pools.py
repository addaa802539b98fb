"""Stored pools: the seed from the config file, the catalog's refresh, and the admin's changes.

The store holds the truth about pools (`stoker.domain.pools`); every replica serves what it
holds. At start a replica *seeds* the store from its config file, one log line per pool:

- a pool the store lacks is created from the file;
- the file's settings replace the stored ones only while those are still what a file wrote
  (`StoredPool.seed`): a change made through the API since is never silently undone;
- a template the pool has never had *proposes* a rollout with the pool's default strategy;
  a template the pool had before (an older file) changes nothing.

Each janitor and fallback-reaper pass reads the pools' generations (one small query) and
reloads the catalog when they changed, so an admin change is in force on every replica
within a pass, without a restart. A pool deleted from the store (`delete`: drained,
unused, and named by no config file of this replica) leaves every replica's catalog at its
next load, and each listener of `forgotten` drops what the replica kept of it. Every write
compares the pool's generation. A pool whose stored row cannot be read (written before the
API checked what it stores) keeps what the catalog served before, is named in `broken`,
and never keeps the others from loading.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from stoker.control import logs
from stoker.control.catalog import Catalog
from stoker.control.faults import describe
from stoker.control.ids import Ids
from stoker.domain.errors import NotFound, StoreError
from stoker.domain.pools import (
    DeletedPool,
    PoolInUse,
    Rollout,
    SameTemplate,
    StaleGeneration,
    StoredPool,
    StoredRevision,
    seed_settings,
    with_settings,
)
from stoker.domain.rollouts import CanaryStrategy, ReplaceStrategy, RolloutState, Strategy
from stoker.domain.specs import PoolSpec, RuntimeTemplate, revision_of
from stoker.policy.rollout import routing_plan
from stoker.ports.clock import Clock
from stoker.ports.store import ReplicaStore


def new_rollout(
    rollout_id: str, pool: StoredPool, template: RuntimeTemplate, strategy: Strategy, now: float
) -> Rollout:
    """A rollout of `template` as it starts: a canary prepares its first step (share 0:
    no claim routes to it before it holds that step's warm workers), a replace is
    promoted at once."""
    rollout = Rollout(
        id=rollout_id,
        pool=pool.name,
        revision=revision_of(template),
        base_revision=pool.revision,
        strategy=strategy,
        state=RolloutState.RAMPING,
        started_at=now,
        step_started_at=now,
    )
    if isinstance(strategy, ReplaceStrategy):
        return rollout.evolve(state=RolloutState.PROMOTED, share=100, ended_at=now)
    return rollout


def revision_shares(stable: str, rollout: Rollout | None) -> dict[str, tuple[str, int]]:
    """Each serving revision's state and percent of new claims: the stable one's and the
    active rollout's, as the rollout plan (`stoker.policy.rollout`) routes them."""
    plan = routing_plan(stable, rollout)
    return {
        part.revision: (part.role.value, round(part.share * 100))
        for part in plan.revisions.values()
        if plan.serving(part.revision)
    }


class StoredPools:
    """This replica's view of the stored pools, and the writes an admin makes to them."""

    def __init__(
        self,
        catalog: Catalog,
        store: ReplicaStore,
        clock: Clock,
        ids: Ids,
        seeds: Mapping[str, PoolSpec],
        strategies: Mapping[str, Strategy] | None = None,
        *,
        settle_s: float = 0.0,
    ) -> None:
        """`seeds`: the pools of the config file; `strategies`: their default rollout
        strategies (a canary of 10, 50 and 100 % when a pool names none); `settle_s`: how
        long after its last change (its drain) a pool may be deleted, so that every
        replica has read the drain (and serves no claim that would spawn for it)."""
        self.catalog, self.store, self._clock, self._ids = catalog, store, clock, ids
        self._settle_s = settle_s
        self._seeds = dict(seeds)
        self._strategies = dict(strategies or {})
        #: The generations the catalog was loaded at (None: never loaded).
        self._loaded: dict[str, int] | None = None
        #: Pools whose stored row or revisions could not be read at the last load, with
        #: why (they are read again at every refresh until they load).
        self.broken: dict[str, str] = {}
        #: Called with the name of each pool a load finds deleted from the store.
        self.forgotten: list[Callable[[str], None]] = []

    # -- seed and refresh -----------------------------------------------------------------

    async def seed(self) -> None:
        """Seed the store from the config file's pools, then load the catalog; a stored
        pool the file does not name, still served, is logged as a warning."""
        for spec in self._seeds.values():
            strategy = self._strategies.get(spec.name) or CanaryStrategy()
            await self._seed_one(spec, strategy)
        await self.refresh(force=True)
        for name in sorted(set(self.catalog.pools) - set(self._seeds)):
            stored = self.catalog.stored(name)
            if stored is not None and not stored.draining:
                # The store is the truth (another replica's file, or the API, may have
                # made it): removing a pool from one file neither stops nor deletes it.
                logs.event(
                    "pool_not_in_config",
                    pool=name,
                    served="yes",
                    hint=f"stoker pools drain {name} stops its new claims, "
                    f"stoker pools delete {name} then removes it",
                    level=logs.WARNING,
                )

    async def _seed_one(self, spec: PoolSpec, strategy: Strategy) -> None:
        now = self._clock.now()
        seed = seed_settings(spec, strategy)
        fresh = StoredPool(spec, 0, strategy, created_at=now, updated_at=now, seed=seed)
        created = await self.store.create_pool(fresh, now=now)
        if created is not None:
            logs.event("pool_seeded", pool=spec.name, generation=1, settings="created")
            return
        for _ in range(3):  # another replica may write the pool meanwhile: read it again
            stored = await self.store.get_pool(spec.name)
            if stored is None:
                return
            try:
                await self._reconcile_seed(stored, spec, strategy, seed)
                return
            except StaleGeneration:
                continue

    async def _reconcile_seed(
        self, stored: StoredPool, spec: PoolSpec, strategy: Strategy, seed: dict[str, Any]
    ) -> None:
        now = self._clock.now()
        if seed == stored.seed:
            settings = "unchanged"
        elif seed_settings(stored.spec, stored.strategy) == stored.seed:
            changed = with_file_settings(stored, spec, strategy, seed)
            stored = await self.store.update_pool(changed, now=now)
            settings = "updated"
        else:
            # Changed through the API since a file last wrote them: the store's are newer.
            differ = sorted(k for k, v in seed.items() if stored.seed.get(k) != v)
            settings = f"kept stored (changed since the last seed; file differs in {differ})"
        template = await self._seed_template(stored, spec, now)
        logs.event(
            "pool_seeded",
            pool=spec.name,
            generation=stored.generation,
            settings=settings,
            template=template,
        )

    async def _seed_template(self, stored: StoredPool, spec: PoolSpec, now: float) -> str:
        """What the file's template does: nothing, or propose a rollout."""
        if spec.revision == stored.revision:
            return "same"
        active = [r for r in await self.store.list_rollouts(pool=spec.name) if r.active]
        if any(r.revision == spec.revision for r in active):
            return f"rolling out ({spec.revision})"
        known = {r.revision for r in await self.store.list_revisions(spec.name)}
        if spec.revision in known:
            return f"older ({spec.revision}); the store has moved on to {stored.revision}"
        rollout = await self.propose(stored, spec.template, now=now)
        return f"rollout {rollout.id} proposed ({rollout.revision})"

    async def refresh(self, *, force: bool = False) -> bool:
        """Reload the catalog when the stored generations changed (or with `force`); True
        when it reloaded."""
        generations = await self.store.pool_generations()
        if not force and not self.broken and generations == self._loaded:
            return False
        broken: dict[str, str] = {}
        pools = await self._read_pools(generations, broken)
        rollouts = await self.store.list_rollouts()
        revisions: list[StoredRevision] = []
        for pool in list(pools):
            try:
                revisions += await self.store.list_revisions(pool.name)
            except StoreError:
                raise
            except Exception as exc:
                broken[pool.name] = f"its revisions cannot be read: {describe(exc)}"
                pools.remove(pool)
        for name, why in broken.items():
            if name not in self.broken:
                logs.event("pool_unreadable", pool=name, error=why, level=logs.ERROR)
            # Served as it was before, while its row cannot be read.
            before = self.catalog.stored(name)
            if before is not None:
                pools.append(before)
                revisions += self.catalog.revisions_of(name)
        self.broken = broken
        if pools or self._loaded is not None:
            # Once loaded, an empty store serves no pool (the last one was deleted).
            served = set(self.catalog.pools)
            self.catalog.load(pools, rollouts, revisions)
            for name in sorted(served - set(self.catalog.pools)):
                self._forget(name)
        self._loaded = {p.name: p.generation for p in pools if p.name not in broken}
        return True

    def _forget(self, name: str) -> None:
        logs.event("pool_forgotten", pool=name, why="deleted from the store")
        for listener in self.forgotten:
            listener(name)

    async def _read_pools(
        self, generations: Mapping[str, int], broken: dict[str, str]
    ) -> list[StoredPool]:
        """Every stored pool; when one row cannot be read, each pool on its own, the ones
        that fail named in `broken`."""
        try:
            return await self.store.list_pools()
        except StoreError:
            raise
        except Exception:
            pass
        pools = []
        for name in sorted(generations):
            try:
                pool = await self.store.get_pool(name)
            except StoreError:
                raise
            except Exception as exc:
                broken[name] = f"its stored row cannot be read: {describe(exc)}"
                continue
            if pool is not None:
                pools.append(pool)
        return pools

    # -- an admin's writes ------------------------------------------------------------------

    async def get(self, name: str) -> StoredPool:
        """The stored pool, read now; NotFound when the store has none of that name."""
        pool = await self.store.get_pool(name)
        if pool is None:
            raise NotFound(f"unknown pool {name!r}")
        return pool

    async def update(
        self, name: str, changes: Mapping[str, Any], *, generation: int | None = None
    ) -> StoredPool:
        """Change tunable settings (`TUNABLE_SETTINGS`), by CAS on `generation` (None: the
        generation read now); the catalog serves the result at once. A change to the values
        the pool has already writes nothing: its generation stays."""
        pool = current(await self.get(name), generation)
        spec = with_settings(pool.spec, changes)
        if spec == pool.spec:
            return pool
        changed = pool.evolve(spec=spec)
        return await self._written(await self.store.update_pool(changed, now=self._clock.now()))

    async def set_draining(
        self, name: str, draining: bool, *, generation: int | None = None
    ) -> StoredPool:
        """Stop (or resume) handing out new claims of the pool (already so: no write)."""
        pool = current(await self.get(name), generation)
        if pool.draining == draining:
            return pool
        changed = pool.evolve(draining=draining)
        return await self._written(await self.store.update_pool(changed, now=self._clock.now()))

    async def delete(self, name: str, *, generation: int | None = None) -> DeletedPool:
        """Delete the pool from the store (`ReplicaStore.delete_pool`, which refuses a pool
        that is not drained, rolls out, or has live workers or open claims), by CAS on
        `generation` if given; this replica forgets it at once, the others at their next
        pass. Refused while this replica's config file declares the pool: its next start
        would seed it again."""
        if name in self._seeds:
            raise PoolInUse(
                f"pool {name!r} is declared in this replica's config file: remove it from "
                "the file (on every replica, then restart them) first, or the next start "
                "seeds it again",
                reason="in_config",
            )
        stored = await self.get(name)
        since = self._clock.now() - stored.updated_at
        if stored.draining and since < self._settle_s:
            raise PoolInUse(
                f"pool {name!r} was drained {since:.1f}s ago: another replica may not have "
                f"read the drain yet and still serve its claims; delete it in "
                f"{self._settle_s - since:.1f}s",
                reason="just_drained",
            )
        deleted = await self.store.delete_pool(name, generation=generation)
        removed = ",".join(f"{table}:{n}" for table, n in deleted.removed.items() if n)
        logs.event("pool_deleted", pool=name, generation=deleted.generation, removed=removed)
        await self.refresh()
        return deleted

    async def propose(
        self,
        pool: StoredPool,
        template: RuntimeTemplate,
        *,
        now: float,
        strategy: Strategy | None = None,
    ) -> Rollout:
        """Start a rollout of `template` (superseding the pool's active one) at the
        generation `pool` was read at; `SameTemplate` when the pool serves it already or
        rolls it out already (it would ramp nothing)."""
        revision = revision_of(template)
        active = [r for r in await self.store.list_rollouts(pool=pool.name) if r.active]
        for r in active:
            if r.revision == revision:
                raise SameTemplate(
                    f"rollout {r.id!r} of pool {pool.name!r} is rolling revision "
                    f"{revision} out already"
                )
        if revision == pool.revision:
            hint = f": abort rollout {active[0].id!r} to go back to it" if active else ""
            raise SameTemplate(
                f"pool {pool.name!r} serves this template already (revision {revision}), "
                f"nothing to roll out{hint}"
            )
        rollout = new_rollout(self._ids.rollout(), pool, template, strategy or pool.strategy, now)
        await self.store.start_rollout(rollout, template, generation=pool.generation, now=now)
        r = rollout
        logs.event(
            "rollout_started", pool=r.pool, rollout=r.id, revision=r.revision, base=pool.revision
        )
        await self.refresh()
        return rollout

    async def _written(self, pool: StoredPool) -> StoredPool:
        logs.event(
            "pool_changed", pool=pool.name, generation=pool.generation, draining=pool.draining
        )
        await self.refresh()
        return pool


def current(pool: StoredPool, generation: int | None) -> StoredPool:
    """`pool` when the caller's `generation` is its own (or None: the one read now);
    `StaleGeneration` (412) otherwise, before anything is written."""
    if generation is not None and generation != pool.generation:
        raise StaleGeneration(pool.name, generation, pool.generation)
    return pool


def with_file_settings(
    stored: StoredPool, spec: PoolSpec, strategy: Strategy, seed: dict[str, Any]
) -> StoredPool:
    """`stored` with the file's settings and strategy (its revision stays: a template change
    is a rollout)."""
    settings = dataclasses.replace(spec, template=stored.spec.template, revision=stored.revision)
    return stored.evolve(spec=settings, strategy=strategy, seed=seed)
