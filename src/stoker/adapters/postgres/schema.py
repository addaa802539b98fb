"""PostgreSQL's tables (rendered from the shared description in `_schema`) in one schema,
their indexes, and the upgrades of a schema an older version made.

Replicas opening at once take turns under an advisory lock. A new schema gets the current
tables and indexes at once and every version recorded; an older one applies each version
it lacks, once, in order, in one transaction.
"""

from __future__ import annotations

from stoker.adapters._rows import CLAIM_SELECT, WORKER_COLUMNS, WORKER_SELECT
from stoker.adapters._schema import DEMAND, POSTGRES, pending
from stoker.adapters._upgrades import TableChanges
from stoker.adapters.postgres.connections import Connection
from stoker.adapters.postgres.locks import LOCK, lock_key

#: The unique index that makes an org's Idempotency-Key name one claim.
IDEMPOTENCY_INDEX = "claims_idempotency"


class Names:
    """The schema-qualified names of one store's tables (the schema name is checked to be a
    plain identifier before it gets here, and quoted)."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self.quoted = s = f'"{schema}"'
        self.workers = f"{s}.workers"
        self.claims = f"{s}.claims"
        self.instances = f"{s}.instances"
        self.leases = f"{s}.leases"
        self.demand = f"{s}.demand"
        self.forecast = f"{s}.forecast"
        self.org_forecast = f"{s}.org_forecast"
        self.rollouts = f"{s}.rollouts"
        self.rollout_outcomes = f"{s}.rollout_outcomes"
        self.ledger = f"{s}.ledger"
        self.claim_log = f"{s}.claim_log"
        self.pool_sizing = f"{s}.pool_sizing"
        self.worker_takes = f"{s}.worker_takes"
        self.versions = f"{s}.schema_migrations"
        #: The channel of the workers' change feed (`feed`), one per schema.
        self.channel = f"stoker_workers_{schema}"[:63]
        #: One row by id, the statements every read of one repeats.
        self.worker_by_id = f"SELECT {WORKER_SELECT} FROM {self.workers} WHERE id = %s"
        self.claim_by_id = f"SELECT {CLAIM_SELECT} FROM {self.claims} WHERE id = %s"
        self.claim_by_key = (
            f"SELECT {CLAIM_SELECT} FROM {self.claims} WHERE org = %s AND idempotency_key = %s"
        )


def indexes(s: str) -> list[str]:
    """The indexes of the current version in schema `s` (quoted). Each is rewritten by every
    write that touches its columns: only those a query needs."""
    return [
        # reserve_any: a pool revision's workers in a state, by age (either way)
        f"CREATE INDEX workers_pick ON {s}.workers (pool, revision, state, updated_at, id)",
        f"CREATE INDEX workers_pool_org ON {s}.workers (pool, org, state)",
        # live rows, and the purge of retired ones
        f"CREATE INDEX workers_state ON {s}.workers (state)",
        f"CREATE INDEX workers_created ON {s}.workers (created_at, id)",
        f"CREATE INDEX claims_state_expires ON {s}.claims (state, expires_at)",
        f"CREATE INDEX claims_created ON {s}.claims (created_at, id)",
        # An org's Idempotency-Key names one claim (NULLs, claims without a key, never clash).
        f"CREATE UNIQUE INDEX {IDEMPOTENCY_INDEX} ON {s}.claims (org, idempotency_key)",
    ]


def ledger_indexes(s: str) -> list[str]:
    """The ledger's reads and bounded purges go by hour, the claim log's by arrival."""
    return [
        f"CREATE INDEX ledger_hour ON {s}.ledger (hour)",
        f"CREATE INDEX claim_log_at ON {s}.claim_log (at, id)",
    ]


def ledger_written_index(s: str) -> str:
    """A replica's last ledger write (`ledger_written_at`, read for each replica whose
    workers are adopted): without it, a scan of every cell the retention keeps."""
    return f"CREATE INDEX ledger_written ON {s}.ledger (instance, updated_at)"


def feed_statements(s: str, channel: str) -> list[str]:
    """The trigger that announces, on `channel`, every worker row entering `warm` (the
    row as a JSON array in `WORKER_COLUMNS` order), sent when the writing transaction
    commits. A notifying commit holds PostgreSQL's notification lock until it is flushed,
    so only spawns, off the claim path, announce: announcing reservations or releases
    (hot_idle) would serialize the claim path's commits, and a parked worker is found by
    an indexed look-up of its org's rows in one round trip anyway. A heard entry another
    replica took since costs one missed compare-and-set."""
    row = ", ".join(f"NEW.{c}" for c in WORKER_COLUMNS)
    return [
        f"CREATE OR REPLACE FUNCTION {s}.announce_worker() RETURNS trigger "
        "LANGUAGE plpgsql AS $$ BEGIN "
        "IF NEW.state = 'warm' AND (TG_OP = 'INSERT' OR OLD.state <> NEW.state) THEN "
        f"PERFORM pg_notify('{channel}', json_build_array({row})::text); "
        "END IF; RETURN NULL; END $$",
        f"CREATE TRIGGER workers_announce AFTER INSERT OR UPDATE ON {s}.workers "
        f"FOR EACH ROW EXECUTE FUNCTION {s}.announce_worker()",
    ]


def upgrades(s: str, channel: str = "") -> list[tuple[int, list[str]]]:
    """What each version changed in schema `s` (quoted), for a schema an older version made
    (version 1 made the first tables; a new schema starts from the current ones)."""
    tables = TableChanges(POSTGRES, s)
    return [
        (
            2,
            [
                *tables.create(DEMAND),
                f"CREATE INDEX workers_purge ON {s}.workers (state, updated_at)",
                f"CREATE INDEX claims_purge ON {s}.claims (state, updated_at)",
            ],
        ),
        (
            3,
            [
                f"DROP INDEX {s}.workers_purge",
                f"DROP INDEX {s}.workers_owner",
                f"DROP INDEX {s}.claims_purge",
                f"DROP INDEX {s}.claims_worker",
            ],
        ),
        (4, tables.row_version),
        # Session tokens are kept as digests (`records.token_digest`), never in plain text.
        (
            5,
            [
                f"UPDATE {s}.claims SET token = 'sha256:' || "
                "encode(sha256(convert_to(token, 'UTF8')), 'hex') "
                "WHERE token <> '' AND left(token, 7) <> 'sha256:'"
            ],
        ),
        (
            6,
            [
                *tables.idempotency,
                f"CREATE UNIQUE INDEX {IDEMPOTENCY_INDEX} ON {s}.claims (org, idempotency_key)",
            ],
        ),
        (7, tables.stored_pools),
        (8, tables.demand_rate),
        (9, tables.pool_seed),
        # The workers' change feed: replicas hear of claimable workers (`feed`).
        (10, feed_statements(s, channel)),
        (11, tables.org_forecast),
        (12, tables.rollout_outcomes),
        (13, [*tables.ledger, *ledger_indexes(s)]),
        (14, tables.pool_sizing),
        (15, [ledger_written_index(s)]),
        (16, tables.placeholder_requests),
        (17, tables.worker_taken_at),
        (18, tables.worker_takes),
    ]


async def migrate(conn: Connection, names: Names, lock_idle_ms: str) -> None:
    """Apply pending versions under a transaction-scoped lock, so replicas take turns."""
    s = names.quoted
    async with conn.transaction():
        await conn.execute(LOCK, (lock_idle_ms, lock_key("migrate", names.schema)))
        # Create only what is missing: a role without CREATE on the database can run an
        # already migrated schema.
        cur = await conn.execute(
            "SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %s", (names.schema,)
        )
        if await cur.fetchone() is None:
            await conn.execute(f"CREATE SCHEMA {s}")
        cur = await conn.execute("SELECT to_regclass(%s)", (names.versions,))
        row = await cur.fetchone()
        if row is None or row[0] is None:
            await conn.execute(f"CREATE TABLE {names.versions} (version integer PRIMARY KEY)")
        cur = await conn.execute(f"SELECT version FROM {names.versions}")
        applied = {r[0] for r in await cur.fetchall()}
        current = TableChanges(POSTGRES, s).current + indexes(s) + ledger_indexes(s)
        current.append(ledger_written_index(s))
        current += feed_statements(s, names.channel)
        for version, statements in pending(applied, current, upgrades(s, names.channel)):
            for sql in statements:
                await conn.execute(sql)
            await conn.execute(f"INSERT INTO {names.versions} (version) VALUES (%s)", (version,))
