"""The statements and rows of stored pools, written once for both SQL stores.

Every write of a pool is a compare-and-set on its generation: the first statement of a
`PoolWrite` bumps the generation where it still has the value the writer read, and the
rest runs only when that statement changed the row, in the same transaction. A store runs
a `PoolWrite` in one transaction of its own (`PoolRows._pool_write`) and reads with
`_pool_rows`: the port's methods are written here once (`PoolRows`). What differs between
the stores is the spelling of a parameter (`:name` or `%(name)s`), of a JSON value and the
tables' schema (`PoolSql`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stoker.adapters._rows import LIVE_SQL, RecordRows, dump_json, load_json_object
from stoker.adapters._schema import (
    CLAIMS,
    DEMAND,
    FORECAST,
    ORG_FORECAST,
    POOL_SIZING,
    POOL_TABLES,
    POOLS,
    REVISIONS,
    ROLLOUT_OUTCOMES,
    ROLLOUTS,
    WORKERS,
)
from stoker.domain.errors import NotFound
from stoker.domain.pools import (
    ACTIVE_ROLLOUT_STATES,
    DeletedPool,
    Rollout,
    StaleGeneration,
    StoredPool,
    StoredRevision,
    check_deletable,
    spec_from_json,
    spec_settings,
    template_from_json,
    template_json,
)
from stoker.domain.rollouts import RolloutState, strategy_from, strategy_json
from stoker.domain.specs import RuntimeTemplate

Params = Mapping[str, Any]
Statement = tuple[str, Params]

_ACTIVE_SQL = "(" + ", ".join(f"'{s.value}'" for s in sorted(ACTIVE_ROLLOUT_STATES)) + ")"
_ROLLOUT_COLUMNS = ", ".join(ROLLOUTS.names)
_ROLLOUT_ROWS = RecordRows(
    Rollout,
    ROLLOUTS,
    decode={
        "strategy": lambda value: strategy_from(load_json_object(value)),
        "state": RolloutState,
    },
    encode={"strategy": lambda strategy: dump_json(strategy_json(strategy))},
)
#: A `PoolSql.rollout_select` row.
rollout_from_row = _ROLLOUT_ROWS.from_row


def rollout_params(rollout: Rollout) -> dict[str, Any]:
    """The parameters of a rollout's insert or update."""
    return dict(zip(ROLLOUTS.names, _ROLLOUT_ROWS.to_row(rollout), strict=True))


@dataclass(frozen=True, slots=True)
class PoolWrite:
    """One atomic write of a pool: `cas` must change one row, then `rest` runs."""

    pool: str
    generation: int
    cas: Statement
    rest: list[Statement] = field(default_factory=list)
    #: Set when the last of `rest` must change a row: the `NotFound` detail if it did not.
    required: str | None = None

    def conflict(self, current: int | None) -> Exception:
        """What a write whose CAS missed raises: the pool is gone or has moved on."""
        if current is None:
            return NotFound(f"unknown pool {self.pool!r}")
        return StaleGeneration(self.pool, self.generation, current)


class PoolSql:
    """The statements of one store, on its (qualified) table names."""

    def __init__(self, *, schema: str | None = None) -> None:
        """SQLite's statements, or PostgreSQL's on the tables of `schema` (quoted)."""
        p: Callable[[str], str]
        q: Callable[[str], str]
        if schema is None:
            p = ":{}".format
            j, q = p, "{}".format
        else:
            p, j = "%({})s".format, "%({})s::jsonb".format
            q = f"{schema}.{{}}".format
        pools, revisions, rollouts = (q(t.name) for t in POOL_TABLES)
        pool_select = (
            "SELECT p.name, p.generation, p.revision, p.settings, p.strategy, p.draining, "
            f"p.created_at, p.updated_at, p.seed, r.template FROM {pools} p JOIN {revisions} r "
            "ON r.pool = p.name AND r.revision = p.revision"
        )
        rollout_select = f"SELECT {_ROLLOUT_COLUMNS} FROM {rollouts}"
        by_pool = f"WHERE pool = {p('pool')}"
        #: Reads: the pools at their stable revision's template, a pool's revisions and
        #: rollouts, every active rollout, and the generations alone (every pass reads them).
        self.pool_by_name, self.all_pools, self.revisions_of = (
            f"{pool_select} WHERE p.name = {p('name')}",
            f"{pool_select} ORDER BY p.name",
            f"SELECT pool, revision, template, created_at FROM {revisions} {by_pool} "
            "ORDER BY created_at, revision",
        )
        self.rollout_by_id, self.rollouts_of, self.active_rollouts = (
            f"{rollout_select} WHERE id = {p('id')}",
            f"{rollout_select} {by_pool} ORDER BY started_at, id",
            f"{rollout_select} WHERE state IN {_ACTIVE_SQL} ORDER BY started_at, id",
        )
        self.generations, self.generation_of = (
            f"SELECT name, generation FROM {pools} ORDER BY name",
            f"SELECT generation FROM {pools} WHERE name = {p('name')}",
        )
        self._insert_pool = (
            f"INSERT INTO {pools} (name, generation, revision, settings, strategy, draining, "
            f"created_at, updated_at, seed) VALUES ({p('name')}, 1, {p('revision')}, "
            f"{j('settings')}, {j('strategy')}, {p('draining')}, {p('now')}, {p('now')}, "
            f"{j('seed')}) "
            "ON CONFLICT (name) DO NOTHING"
        )
        self._insert_revision = (
            f"INSERT INTO {revisions} (pool, revision, template, created_at) "
            f"VALUES ({p('pool')}, {p('revision')}, {j('template')}, {p('now')}) "
            "ON CONFLICT (pool, revision) DO NOTHING"
        )
        cas = f"WHERE name = {p('name')} AND generation = {p('generation')}"
        self._update_pool = (
            f"UPDATE {pools} SET generation = generation + 1, settings = {j('settings')}, "
            f"strategy = {j('strategy')}, draining = {p('draining')}, updated_at = {p('now')}, "
            f"seed = {j('seed')} " + cas
        )
        self._bump = (
            f"UPDATE {pools} SET generation = generation + 1, updated_at = {p('now')} " + cas
        )
        self._promote = (
            f"UPDATE {pools} SET generation = generation + 1, updated_at = {p('now')}, "
            f"revision = {p('revision')} " + cas
        )
        self._supersede = (
            f"UPDATE {rollouts} SET state = '{RolloutState.SUPERSEDED.value}', share = 0, "
            f"ended_at = {p('now')}, reason = {p('reason')} "
            f"WHERE pool = {p('pool')} AND state IN {_ACTIVE_SQL}"
        )
        self._insert_rollout = (
            f"INSERT INTO {rollouts} ({_ROLLOUT_COLUMNS}) VALUES ({p('id')}, {p('pool')}, "
            f"{p('revision')}, {p('base_revision')}, {j('strategy')}, {p('state')}, "
            f"{p('step')}, {p('share')}, {p('started_at')}, {p('step_started_at')}, "
            f"{p('ended_at')}, {p('reason')})"
        )
        self._update_rollout = (
            f"UPDATE {rollouts} SET state = {p('state')}, step = {p('step')}, "
            f"share = {p('share')}, step_started_at = {p('step_started_at')}, "
            f"ended_at = {p('ended_at')}, reason = {p('reason')} "
            f"WHERE id = {p('id')} AND pool = {p('pool')}"
        )

        # A deletion: the pool's row (locked until the transaction ends on PostgreSQL),
        # what still uses it, then its rows in every table keyed by it, the pool's last.
        self.pool_to_delete = f"SELECT generation, draining FROM {pools} WHERE name = {p('pool')}"
        if schema is not None:
            self.pool_to_delete += " FOR UPDATE"
        self.pool_in_use = (
            f"SELECT (SELECT count(*) FROM {q(WORKERS.name)} WHERE pool = {p('pool')} "
            f"AND state IN {LIVE_SQL}), "
            f"(SELECT count(*) FROM {q(CLAIMS.name)} WHERE pool = {p('pool')} "
            "AND state = 'bound'), "
            f"(SELECT min(id) FROM {rollouts} {by_pool} AND state IN {_ACTIVE_SQL})"
        )
        #: (table, statement) in order: the rollouts' outcome counts before the rollouts.
        self.pool_cascade: list[tuple[str, str]] = [
            (
                ROLLOUT_OUTCOMES.name,
                f"DELETE FROM {q(ROLLOUT_OUTCOMES.name)} "
                f"WHERE rollout IN (SELECT id FROM {rollouts} {by_pool})",
            ),
            *(
                (t.name, f"DELETE FROM {q(t.name)} {by_pool}")
                for t in (ROLLOUTS, REVISIONS, FORECAST, ORG_FORECAST, POOL_SIZING, DEMAND)
            ),
            (POOLS.name, f"DELETE FROM {pools} WHERE name = {p('pool')}"),
        ]

    # -- writes --------------------------------------------------------------------------

    def create(self, pool: StoredPool, now: float) -> PoolWrite:
        """Insert a pool at generation 1 with its stable revision (the CAS: no such pool)."""
        return PoolWrite(
            pool.name,
            0,
            (self._insert_pool, pool_params(pool, now)),
            [self._revision(pool.name, pool.revision, pool.spec.template, now)],
        )

    def update(self, pool: StoredPool, now: float) -> PoolWrite:
        """Write a pool's settings, strategy and draining flag at its generation."""
        return PoolWrite(pool.name, pool.generation, (self._update_pool, pool_params(pool, now)))

    def start_rollout(
        self, rollout: Rollout, template: RuntimeTemplate, generation: int, now: float
    ) -> PoolWrite:
        """Record the revision, supersede the pool's active rollout, insert `rollout`."""
        return PoolWrite(
            rollout.pool,
            generation,
            self._cas(rollout, generation, now),
            [
                self._revision(rollout.pool, rollout.revision, template, now),
                (
                    self._supersede,
                    {"pool": rollout.pool, "now": now, "reason": f"superseded by {rollout.id}"},
                ),
                (self._insert_rollout, rollout_params(rollout)),
            ],
        )

    def change_rollout(self, rollout: Rollout, generation: int, now: float) -> PoolWrite:
        """Write a rollout's ramp (and, once promoted, the pool's stable revision)."""
        return PoolWrite(
            rollout.pool,
            generation,
            self._cas(rollout, generation, now),
            [(self._update_rollout, rollout_params(rollout))],
            required=f"unknown rollout {rollout.id!r} of pool {rollout.pool!r}",
        )

    def _cas(self, rollout: Rollout, generation: int, now: float) -> Statement:
        cas = {"name": rollout.pool, "generation": generation, "now": now}
        if rollout.state is RolloutState.PROMOTED:
            return self._promote, {**cas, "revision": rollout.revision}
        return self._bump, cas

    def _revision(
        self, pool: str, revision: str, template: RuntimeTemplate, now: float
    ) -> Statement:
        body = {"pool": pool, "revision": revision, "now": now}
        return self._insert_revision, {**body, "template": dump_json(template_json(template))}


@dataclass(frozen=True, slots=True)
class WriteOutcome:
    """What running a `PoolWrite` gave: the pool's row after it, or (its CAS missed) the
    pool's generation now (None: no such pool)."""

    row: Sequence[Any] | None
    current: int | None = None


#: What a deletion's check is handed: the pool's row (`PoolSql.pool_to_delete`; None when
#: there is none) and the row of `PoolSql.pool_in_use`; it raises to refuse.
DeletionCheck = Callable[[Sequence[Any] | None, Sequence[Any]], None]


def check_deletion(name: str, expected: int | None) -> DeletionCheck:
    """The check of deleting pool `name` (read at generation `expected`, None: any)."""

    def check(pool: Sequence[Any] | None, in_use: Sequence[Any]) -> None:
        if pool is None:
            raise NotFound(f"unknown pool {name!r}")
        workers, claims, rollout = in_use
        check_deletable(
            name,
            expected,
            generation=int(pool[0]),
            draining=bool(pool[1]),
            live_workers=int(workers),
            open_claims=int(claims),
            active_rollout=None if rollout is None else str(rollout),
        )

    return check


class PoolRows:
    """The port's methods on stored pools, over a store's three hooks."""

    _pool_sql: PoolSql

    @abstractmethod
    async def _pool_rows(self, sql: str, params: Params) -> Sequence[Sequence[Any]]:
        """The rows of one query."""

    @abstractmethod
    async def _pool_write(self, write: PoolWrite) -> WriteOutcome:
        """Run `write` in one transaction: its CAS, then (if that changed a row) the rest,
        raising `NotFound(write.required)` and undoing everything when the last statement
        changed no row though it had to; the pool's row is read in the same transaction."""

    @abstractmethod
    async def _pool_delete(self, name: str, check: DeletionCheck) -> tuple[int, dict[str, int]]:
        """In one transaction: read the pool's row (`PoolSql.pool_to_delete`, locked) and,
        in a later statement, what uses it (`pool_in_use`); hand both to `check`, whose
        raise deletes nothing; then run `pool_cascade`. The pool's generation, and the rows
        each statement deleted by table."""

    async def list_pools(self) -> list[StoredPool]:
        """Every stored pool, by name."""
        return [pool_from_row(r) for r in await self._pool_rows(self._pool_sql.all_pools, {})]

    async def get_pool(self, name: str) -> StoredPool | None:
        """One stored pool."""
        rows = await self._pool_rows(self._pool_sql.pool_by_name, {"name": name})
        return pool_from_row(rows[0]) if rows else None

    async def pool_generations(self) -> dict[str, int]:
        """Each pool's generation."""
        rows = await self._pool_rows(self._pool_sql.generations, {})
        return {name: int(g) for name, g in rows}

    async def list_revisions(self, pool: str) -> list[StoredRevision]:
        """The pool's revisions, oldest first."""
        rows = await self._pool_rows(self._pool_sql.revisions_of, {"pool": pool})
        return [revision_from_row(r) for r in rows]

    async def get_rollout(self, rollout_id: str) -> Rollout | None:
        """One rollout."""
        rows = await self._pool_rows(self._pool_sql.rollout_by_id, {"id": rollout_id})
        return rollout_from_row(rows[0]) if rows else None

    async def list_rollouts(self, *, pool: str | None = None) -> list[Rollout]:
        """A pool's rollouts, or every active one."""
        sql = self._pool_sql
        if pool is None:
            rows = await self._pool_rows(sql.active_rollouts, {})
        else:
            rows = await self._pool_rows(sql.rollouts_of, {"pool": pool})
        return [rollout_from_row(r) for r in rows]

    async def create_pool(self, pool: StoredPool, *, now: float) -> StoredPool | None:
        """Insert the pool unless the store has it."""
        outcome = await self._pool_write(self._pool_sql.create(pool, now))
        return None if outcome.row is None else pool_from_row(outcome.row)

    async def update_pool(self, pool: StoredPool, *, now: float) -> StoredPool:
        """CAS the pool's settings, strategy and draining flag."""
        return await self._written(self._pool_sql.update(pool, now))

    async def start_rollout(
        self, rollout: Rollout, template: RuntimeTemplate, *, generation: int, now: float
    ) -> StoredPool:
        """CAS: the revision, the superseded rollout and the new one, in one write."""
        return await self._written(self._pool_sql.start_rollout(rollout, template, generation, now))

    async def update_rollout(self, rollout: Rollout, *, generation: int, now: float) -> StoredPool:
        """CAS: the rollout's ramp (and the stable revision once promoted)."""
        return await self._written(self._pool_sql.change_rollout(rollout, generation, now))

    async def delete_pool(self, name: str, *, generation: int | None = None) -> DeletedPool:
        """Delete a drained, unused pool and what is its alone, in one transaction."""
        had, removed = await self._pool_delete(name, check_deletion(name, generation))
        return DeletedPool(name, had, removed)

    async def _written(self, write: PoolWrite) -> StoredPool:
        outcome = await self._pool_write(write)
        if outcome.row is None:
            raise write.conflict(outcome.current)
        return pool_from_row(outcome.row)


# -- rows ------------------------------------------------------------------------------------


def pool_from_row(row: Sequence[Any]) -> StoredPool:
    """A `PoolSql.pool_select` row."""
    name, generation, revision, settings, strategy, draining, created, updated, seed, template = row
    spec = spec_from_json(
        name,
        load_json_object(settings),
        template_from_json(load_json_object(template)),
        revision,
    )
    return StoredPool(
        spec=spec,
        generation=int(generation),
        strategy=strategy_from(load_json_object(strategy)),
        draining=bool(draining),
        created_at=float(created),
        updated_at=float(updated),
        seed=load_json_object(seed),
    )


def revision_from_row(row: Sequence[Any]) -> StoredRevision:
    """A `PoolSql.revisions_of` row."""
    pool, revision, template, created_at = row
    return StoredRevision(
        pool, revision, template_from_json(load_json_object(template)), float(created_at)
    )


def pool_params(pool: StoredPool, now: float) -> dict[str, Any]:
    """The parameters of a pool's insert or update (at `pool.generation`)."""
    return {
        "name": pool.name,
        "generation": pool.generation,
        "revision": pool.revision,
        "settings": dump_json(spec_settings(pool.spec)),
        "strategy": dump_json(strategy_json(pool.strategy)),
        "draining": pool.draining,
        "now": now,
        "seed": dump_json(pool.seed),
    }
