"""The changes later versions made to the shared tables (`_schema`), spelled for one store.

Both stores' upgrade lists take them from here, each at its own version number, beside
what is the store's own (indexes, rewritten data, PostgreSQL's change feed).
"""

from __future__ import annotations

from dataclasses import dataclass

from stoker.adapters._schema import (
    CLAIM_IDEMPOTENCY_COLUMNS,
    CLAIM_LOG,
    CLAIMS,
    DEMAND,
    FIRST_POOL_TABLES,
    FORECAST,
    LEDGER,
    LEDGER_LATER,
    ORG_FORECAST,
    POOL_SIZING,
    POOLS,
    ROLLOUT_OUTCOMES,
    TABLES,
    WORKER_TAKEN_COLUMNS,
    WORKER_TAKES,
    WORKERS,
    Dialect,
    Table,
)


@dataclass(frozen=True, slots=True)
class TableChanges:
    """The statements of each change, in `dialect`, on tables in `schema` (quoted) if given."""

    dialect: Dialect
    schema: str | None = None

    def create(self, *tables: Table) -> list[str]:
        """`CREATE TABLE` for each of `tables`."""
        return [self.dialect.create_table(t, self._name(t)) for t in tables]

    def add(self, table: Table, *names: str) -> list[str]:
        """`ADD COLUMN` for each of `names`, columns of `table`."""
        return [self.dialect.add_column(table, name, self._name(table)) for name in names]

    def _name(self, table: Table) -> str:
        return f"{self.schema}.{table.name}" if self.schema else table.name

    @property
    def current(self) -> list[str]:
        """Every table as the current version makes it."""
        return self.create(*TABLES)

    @property
    def row_version(self) -> list[str]:
        """Every worker write compares and bumps the row version (a CAS on the row)."""
        return self.add(WORKERS, "version")

    @property
    def idempotency(self) -> list[str]:
        """Idempotent claims: the key's digest, the request's and the sealed token."""
        return self.add(CLAIMS, *CLAIM_IDEMPOTENCY_COLUMNS)

    @property
    def stored_pools(self) -> list[str]:
        """Stored pools: pools, their revisions and rollouts (`domain.pools`)."""
        return self.create(*FIRST_POOL_TABLES)

    @property
    def demand_rate(self) -> list[str]:
        """Demand as a rate: each replica's claim counter, and the learned forecast."""
        return [*self.add(DEMAND, "claims"), *self.create(FORECAST)]

    @property
    def pool_seed(self) -> list[str]:
        """What a config file last seeded: a file never overrides a change made since."""
        return self.add(POOLS, "seed")

    @property
    def org_forecast(self) -> list[str]:
        """Per-org forecasts: each pool's busiest orgs' learned new-session rates."""
        return self.create(ORG_FORECAST)

    @property
    def rollout_outcomes(self) -> list[str]:
        """Verdicts from every replica: each one's outcome counts of a rollout's revision."""
        return self.create(ROLLOUT_OUTCOMES)

    @property
    def ledger(self) -> list[str]:
        """The ledger and the claim log (docs/warmth.md, docs/claim-log.md)."""
        return self.create(LEDGER.without(*LEDGER_LATER), CLAIM_LOG)

    @property
    def placeholder_requests(self) -> list[str]:
        """The ledger keeps the resource-seconds of headroom placeholders (their own
        requests, by which headroom is priced)."""
        return self.add(LEDGER, *sorted(LEDGER_LATER))

    @property
    def worker_taken_at(self) -> list[str]:
        """A worker row says when its owner last changed (and the time before): the ledger
        of the replica it left counts it up to there (docs/warmth.md)."""
        return self.add(WORKERS, *WORKER_TAKEN_COLUMNS)

    @property
    def worker_takes(self) -> list[str]:
        """Every change of a worker's owner: the ledger of a replica the worker left reads
        when, however often it changed hands before that replica's next flush."""
        return self.create(WORKER_TAKES)

    @property
    def pool_sizing(self) -> list[str]:
        """Each pool's last sizing as the leader published it: every replica shows it."""
        return self.create(POOL_SIZING)
