"""The tables of the SQL stores, described once: both adapters render their DDL from here.

A column has a kind (text, a 64- or 32-bit integer, a float, a flag, a JSON object) that
each store spells in its own SQL (`SQLITE`, `POSTGRES`); what differs between the stores
beyond that (indexes, upgrades of older databases) stays in each store's `schema` module. The
column order of `WORKERS` and `CLAIMS` is the order of the rows `_rows` reads and writes.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum

from stoker.domain.ledger import INT_FIELDS, SCALAR_FIELDS


class Kind(Enum):
    """What a column holds, whatever the store."""

    TEXT = "text"
    INT = "int"
    INT32 = "int32"
    REAL = "real"
    FLAG = "flag"
    JSON = "json"


@dataclass(frozen=True, slots=True)
class Column:
    """One column: its kind, whether it may be NULL, and its default (written as the
    store's literal of that kind: 0, false, an empty object)."""

    name: str
    kind: Kind
    nullable: bool = False
    has_default: bool = False


@dataclass(frozen=True, slots=True)
class Table:
    """A table: its columns in row order and its primary key."""

    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...] = ("id",)

    @property
    def names(self) -> tuple[str, ...]:
        """The column names, in row order."""
        return tuple(c.name for c in self.columns)

    def without(self, *names: str) -> Table:
        """The table as an older version made it: without the columns `names`."""
        return Table(self.name, tuple(c for c in self.columns if c.name not in names), self.key)

    def column(self, name: str) -> Column:
        """The column called `name` (KeyError if there is none)."""
        for column in self.columns:
            if column.name == name:
                return column
        raise KeyError(f"{self.name} has no column {name!r}")


def _text(*names: str, nullable: bool = False) -> tuple[Column, ...]:
    return tuple(Column(name, Kind.TEXT, nullable) for name in names)


def _real(*names: str, nullable: bool = False) -> tuple[Column, ...]:
    return tuple(Column(name, Kind.REAL, nullable) for name in names)


WORKERS = Table(
    "workers",
    (
        *_text("id", "pool", "revision", "state"),
        Column("epoch", Kind.INT, has_default=True),
        *_text("owner"),
        *_real("created_at", "updated_at"),
        Column("version", Kind.INT, has_default=True),
        *_text("org", "claim_id", "endpoint", nullable=True),
        Column("runtime_ref", Kind.JSON, has_default=True),
        Column("activated", Kind.FLAG, has_default=True),
        *_real("heartbeat_at"),
        *_real("idle_since", "ttl_s", nullable=True),
        *_text("reason", nullable=True),
        # When the row's owner last changed, and the time before (`_rows.stamp_taken`).
        *_real("taken_at", "prior_taken_at", nullable=True),
    ),
)
CLAIMS = Table(
    "claims",
    (
        *_text("id", "pool", "org", "worker_id"),
        Column("worker_epoch", Kind.INT),
        *_text("source", "mode", "state", "token", "endpoint"),
        *_real("lease_s", "expires_at", "created_at", "updated_at"),
        *_text("owner"),
        *_real("ttl_s", "ended_at", nullable=True),
        *_text("reason", nullable=True),
        # Idempotent claims (`domain.idempotency`): unique per (org, idempotency_key).
        *_text("idempotency_key", "request_digest", "sealed_token", nullable=True),
    ),
)
#: The columns a later version added to `WORKERS`, for the upgrades of older databases.
WORKER_TAKEN_COLUMNS = ("taken_at", "prior_taken_at")
#: The columns each version added to `CLAIMS`, for the upgrades of older databases.
CLAIM_IDEMPOTENCY_COLUMNS = ("idempotency_key", "request_digest", "sealed_token")
INSTANCES = Table(
    "instances",
    (
        *_text("id"),
        *_real("started_at", "heartbeat_at"),
        *_text("state"),
        Column("meta", Kind.JSON, has_default=True),
    ),
)
LEASES = Table(
    "leases",
    (*_text("name", "holder"), Column("epoch", Kind.INT), *_real("renewed_at", "duration_s")),
    key=("name",),
)
DEMAND = Table(
    "demand",
    (
        *_text("pool", "instance"),
        Column("misses", Kind.INT),
        Column("waiting", Kind.INT32),
        *_real("updated_at"),
        # Cumulative claims that wanted a neutral worker: the demand rate's counter.
        Column("claims", Kind.INT, has_default=True),
    ),
    key=("pool", "instance"),
)
#: Stored pools (`domain.pools`): a pool's settings at its stable revision, compared and
#: bumped by `generation`; the templates it has had; its rollouts, the one home of a ramp.
POOLS = Table(
    "pools",
    (
        *_text("name"),
        Column("generation", Kind.INT),
        *_text("revision"),
        Column("settings", Kind.JSON, has_default=True),
        Column("strategy", Kind.JSON, has_default=True),
        Column("draining", Kind.FLAG, has_default=True),
        *_real("created_at", "updated_at"),
        # What the last seed from a config file wrote (`StoredPool.seed`).
        Column("seed", Kind.JSON, has_default=True),
    ),
    key=("name",),
)
REVISIONS = Table(
    "revisions",
    (*_text("pool", "revision"), Column("template", Kind.JSON), *_real("created_at")),
    key=("pool", "revision"),
)
ROLLOUTS = Table(
    "rollouts",
    (
        *_text("id", "pool", "revision", "base_revision"),
        Column("strategy", Kind.JSON),
        *_text("state"),
        Column("step", Kind.INT32),
        Column("share", Kind.INT32),
        *_real("started_at"),
        *_real("step_started_at", "ended_at", nullable=True),
        *_text("reason", nullable=True),
    ),
)
#: The tables of stored pools, in the order a database creates them.
POOL_TABLES = (POOLS, REVISIONS, ROLLOUTS)
#: A pool's learned new-session rate (`policy.forecast`): at most 216 rows per pool.
FORECAST = Table(
    "forecast",
    (
        *_text("pool", "level"),
        Column("bucket", Kind.INT32),
        *_real("mean", "var"),
        Column("seen", Kind.INT),
        *_real("updated_at"),
    ),
    key=("pool", "level", "bucket"),
)
#: An org's learned new-session rate in a pool (`policy.org_forecast`): 48 rows per org, for
#: at most `demand.org_forecast_orgs` orgs per pool.
ORG_FORECAST = Table(
    "org_forecast",
    (
        *_text("pool", "org"),
        Column("bucket", Kind.INT32),
        *_real("mean", "var"),
        Column("seen", Kind.INT),
        *_real("updated_at"),
    ),
    key=("pool", "org", "bucket"),
)
#: Each replica's cumulative outcome counts of a rollout's revision (`control.outcomes`):
#: the leader's verdict sums every replica's rows.
ROLLOUT_OUTCOMES = Table(
    "rollout_outcomes",
    (
        *_text("rollout", "instance", "outcome"),
        Column("count", Kind.INT),
        *_real("updated_at"),
    ),
    key=("rollout", "instance", "outcome"),
)
#: The ledger's counts added after its table: rows written before hold 0.
LEDGER_LATER = frozenset({"placeholder_cpu_s", "placeholder_gib_s"})
#: Each replica's cumulative counts of one ledger cell (`control.ledger`, docs/warmth.md):
#: pool, revision, org and hour; readers sum every replica's rows.
LEDGER = Table(
    "ledger",
    (
        *_text("pool", "revision", "org"),
        Column("hour", Kind.INT),
        *_text("instance"),
        *(
            Column(n, Kind.INT if n in INT_FIELDS else Kind.REAL, has_default=n in LEDGER_LATER)
            for n in SCALAR_FIELDS
        ),
        Column("hists", Kind.JSON, has_default=True),
        *_real("updated_at"),
    ),
    key=("pool", "revision", "org", "hour", "instance"),
)
#: One row per claim (docs/claim-log.md): arrival, org, mode, wait, hold and outcome.
CLAIM_LOG = Table(
    "claim_log",
    (
        *_text("id"),
        *_real("at"),
        *_text("pool", "org", "mode"),
        *_text("source", nullable=True),
        *_real("wait_s"),
        *_real("held_s", nullable=True),
        *_text("outcome"),
        *_text("revision", nullable=True),
    ),
)
#: Each pool's last sizing, as the leading replica's janitor published it after its pass
#: (`control.published_sizing`): one row per pool, replaced by every pass of the leader.
POOL_SIZING = Table(
    "pool_sizing",
    (
        *_text("pool", "instance"),
        *_real("sized_at"),
        Column("desired_warm", Kind.INT32),
        Column("demand", Kind.INT32),
        Column("sizing", Kind.JSON, has_default=True),
        *_text("rollout_waits", nullable=True),
    ),
    key=("pool",),
)
#: Every change of a worker's owner (a replica took it for a claim, or adopted it), at the
#: row's `taken_at` (`_rows.stamp_taken`): the ledger of a replica a worker left between
#: two of its flushes, however often it changed hands since, reads when it left
#: (`ReplicaStore.first_takes`). Purged with the history.
WORKER_TAKES = Table(
    "worker_takes", (*_text("worker_id"), *_real("taken_at")), key=("worker_id", "taken_at")
)
#: The stored pools' tables as the version that added them made them.
FIRST_POOL_TABLES = (POOLS.without("seed"), REVISIONS, ROLLOUTS)
#: The tables added since demand became a rate (with it: the forecast), in the order a new
#: database creates them.
_SINCE_RATE = (
    FORECAST,
    ORG_FORECAST,
    ROLLOUT_OUTCOMES,
    LEDGER,
    CLAIM_LOG,
    POOL_SIZING,
    WORKER_TAKES,
)
#: Every table, in the order a new database creates them.
TABLES = (WORKERS, CLAIMS, INSTANCES, LEASES, DEMAND, *POOL_TABLES, *_SINCE_RATE)


def before_rate(table: Table) -> Table | None:
    """A table as it was before demand became a rate: the demand table without its claim
    counter, none of the tables added since (None); the others unchanged (for the upgrade
    tests)."""
    if table in _SINCE_RATE:
        return None
    if table is DEMAND:
        return Table(
            DEMAND.name, tuple(c for c in DEMAND.columns if c.name != "claims"), DEMAND.key
        )
    return table


@dataclass(frozen=True, slots=True)
class Dialect:
    """How one store spells each kind, and the default of each kind that has one."""

    types: dict[Kind, str]
    defaults: dict[Kind, str]

    def column_sql(self, column: Column) -> str:
        """`name TYPE [NOT NULL] [DEFAULT ...]`."""
        sql = f"{column.name} {self.types[column.kind]}"
        if not column.nullable:
            sql += " NOT NULL"
        if column.has_default:
            sql += f" DEFAULT {self.defaults[column.kind]}"
        return sql

    def create_table(self, table: Table, qualified: str | None = None) -> str:
        """`CREATE TABLE` for `table`, named `qualified` (schema-qualified) if given."""
        lines = [self.column_sql(c) for c in table.columns]
        lines.append(f"PRIMARY KEY ({', '.join(table.key)})")
        body = ",\n    ".join(lines)
        return f"CREATE TABLE {qualified or table.name} (\n    {body}\n)"

    def add_column(self, table: Table, name: str, qualified: str | None = None) -> str:
        """`ALTER TABLE ... ADD COLUMN` for one column of `table` (rows present get its
        default)."""
        column = self.column_sql(table.column(name))
        return f"ALTER TABLE {qualified or table.name} ADD COLUMN {column}"


#: Each kind as (SQLite, PostgreSQL) spell it, and the literal of its default in each.
_SPELLINGS: dict[Kind, tuple[tuple[str, str], tuple[str, str] | None]] = {
    Kind.TEXT: (("TEXT", "text"), None),
    Kind.INT: (("INTEGER", "bigint"), ("0", "0")),
    Kind.INT32: (("INTEGER", "integer"), ("0", "0")),
    Kind.REAL: (("REAL", "double precision"), ("0", "0")),
    Kind.FLAG: (("INTEGER", "boolean"), ("0", "false")),
    Kind.JSON: (("TEXT", "jsonb"), ("'{}'", "'{}'")),
}


def _dialect(store: int) -> Dialect:
    return Dialect(
        types={kind: types[store] for kind, (types, _) in _SPELLINGS.items()},
        defaults={kind: d[store] for kind, (_, d) in _SPELLINGS.items() if d is not None},
    )


SQLITE = _dialect(0)
POSTGRES = _dialect(1)


def pending(
    applied: Collection[int], current: list[str], upgrades: list[tuple[int, list[str]]]
) -> list[tuple[int, list[str]]]:
    """The versions a store still has to apply, each with its statements, in order.

    A database that has applied some version applies the `upgrades` it lacks. A new one
    (nothing applied) creates the `current` schema as version 1, and records every later
    version with nothing left to do.
    """
    if applied:
        return [(version, sql) for version, sql in upgrades if version not in applied]
    return [(1, current), *((version, []) for version, _ in upgrades)]
