"""SQLite's tables (rendered from the shared description in `_schema`), its indexes, and
the upgrades of a database an older version made.

A new database gets the current tables and indexes at once and every version recorded; an
older one applies each version it lacks, once, in order, in the transaction of `migrate`.
"""

from __future__ import annotations

import sqlite3

from stoker.adapters._schema import (
    CLAIM_IDEMPOTENCY_COLUMNS,
    CLAIMS,
    DEMAND,
    FIRST_POOL_TABLES,
    FORECAST,
    POOLS,
    SQLITE,
    TABLES,
    WORKERS,
    pending,
)
from stoker.domain.records import token_digest

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
)

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
    # Every worker write compares and bumps the row version (a CAS on the row).
    (5, [SQLITE.add_column(WORKERS, "version")]),
    # Session tokens are kept as digests (`records.token_digest`), never in plain text.
    (
        6,
        [
            "UPDATE claims SET token = stoker_token_digest(token) "
            "WHERE token != '' AND substr(token, 1, 7) != 'sha256:'"
        ],
    ),
    # Idempotent claims: the key's digest, the request's and the sealed token.
    (
        7,
        [
            *(SQLITE.add_column(CLAIMS, name) for name in CLAIM_IDEMPOTENCY_COLUMNS),
            "CREATE UNIQUE INDEX claims_idempotency ON claims (org, idempotency_key)",
        ],
    ),
    # Stored pools: pools, their revisions and rollouts (`domain.pools`).
    (8, [SQLITE.create_table(table) for table in FIRST_POOL_TABLES]),
    # Demand as a rate: each replica's claim counter, and the learned forecast.
    (9, [SQLITE.add_column(DEMAND, "claims"), SQLITE.create_table(FORECAST)]),
    # What a config file last seeded: a file never overrides a change made since.
    (10, [SQLITE.add_column(POOLS, "seed")]),
]


def migrate(tx: sqlite3.Connection) -> None:
    """Bring the database up to the current version (`tx` is in a write transaction)."""
    tx.create_function("stoker_token_digest", 1, token_digest, deterministic=True)
    tx.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY)")
    applied = {r[0] for r in tx.execute("SELECT version FROM schema_migrations")}
    current = [*(SQLITE.create_table(table) for table in TABLES), *INDEXES]
    for version, statements in pending(applied, current, UPGRADES):
        for sql in statements:
            tx.execute(sql)
        tx.execute("INSERT INTO schema_migrations (version) VALUES (?)", (version,))
