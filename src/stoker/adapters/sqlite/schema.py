"""SQLite's tables (rendered from the shared description in `_schema`), its indexes, and
the upgrades of a database an older version made.

A new database gets the current tables and indexes at once and every version recorded; an
older one applies each version it lacks, once, in order, in the transaction of `migrate`.
"""

from __future__ import annotations

import sqlite3

from stoker.adapters._schema import DEMAND, SQLITE, pending
from stoker.adapters._upgrades import TableChanges
from stoker.domain.records import token_digest

#: The ledger's reads and bounded purges go by hour, the claim log's by arrival.
LEDGER_INDEXES = (
    "CREATE INDEX ledger_hour ON ledger (hour)",
    "CREATE INDEX claim_log_at ON claim_log (at, id)",
)

#: A replica's last ledger write (`ledger_written_at`, read for each replica whose workers
#: are adopted): without it, a scan of every cell the retention keeps.
LEDGER_WRITTEN_INDEX = "CREATE INDEX ledger_written ON ledger (instance, updated_at)"

#: The indexes of the current version. Each index is one page more written by every write
#: that touches its columns, and a claim + release cycle makes four: only what a query
#: needs. `workers_live` finds rows by state (the live ones, a pool's warm or hot_idle ones
#: to pick, the retired ones to list or purge); counts by pool and org come from the live
#: rows in memory.
INDEXES = (
    "CREATE INDEX workers_live ON workers (state, pool, revision)",
    "CREATE INDEX claims_state_expires ON claims (state, expires_at)",
    # An org's Idempotency-Key names one claim (NULLs, claims without a key, never clash).
    "CREATE UNIQUE INDEX claims_idempotency ON claims (org, idempotency_key)",
    *LEDGER_INDEXES,
    LEDGER_WRITTEN_INDEX,
)

_TABLES = TableChanges(SQLITE)

#: What each version changed, for a database an older version made (version 1 made the
#: first tables; a new database starts from the current ones).
UPGRADES: list[tuple[int, list[str]]] = [
    (
        2,
        [
            SQLITE.create_table(DEMAND),
            "CREATE INDEX workers_purge ON workers (state, updated_at)",
            "CREATE INDEX claims_purge ON claims (state, updated_at)",
        ],
    ),
    (
        3,
        [
            "DROP INDEX workers_purge",
            "DROP INDEX workers_owner",
            "DROP INDEX claims_purge",
            "DROP INDEX claims_worker",
        ],
    ),
    (
        4,
        [
            "DROP INDEX workers_pool_state",
            "DROP INDEX workers_pool_org",
            "DROP INDEX workers_state",
            "CREATE INDEX workers_live ON workers (state, pool, revision)",
        ],
    ),
    (5, _TABLES.row_version),
    # Session tokens are kept as digests (`records.token_digest`), never in plain text.
    (
        6,
        [
            "UPDATE claims SET token = stoker_token_digest(token) "
            "WHERE token != '' AND substr(token, 1, 7) != 'sha256:'"
        ],
    ),
    (
        7,
        [
            *_TABLES.idempotency,
            "CREATE UNIQUE INDEX claims_idempotency ON claims (org, idempotency_key)",
        ],
    ),
    (8, _TABLES.stored_pools),
    (9, _TABLES.demand_rate),
    (10, _TABLES.pool_seed),
    (11, _TABLES.org_forecast),
    (12, _TABLES.rollout_outcomes),
    (13, [*_TABLES.ledger, *LEDGER_INDEXES]),
    (14, _TABLES.pool_sizing),
    (15, [LEDGER_WRITTEN_INDEX]),
    (16, _TABLES.placeholder_requests),
    (17, _TABLES.worker_taken_at),
    (18, _TABLES.worker_takes),
]


def migrate(tx: sqlite3.Connection) -> None:
    """Bring the database up to the current version (`tx` is in a write transaction)."""
    tx.create_function("stoker_token_digest", 1, token_digest, deterministic=True)
    tx.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY)")
    applied = {r[0] for r in tx.execute("SELECT version FROM schema_migrations")}
    current = [*_TABLES.current, *INDEXES]
    for version, statements in pending(applied, current, UPGRADES):
        for sql in statements:
            tx.execute(sql)
        tx.execute("INSERT INTO schema_migrations (version) VALUES (?)", (version,))
