"""The demand signal: every replica's misses and queued claims, summed per pool (pure).

Each replica publishes, per pool, a cumulative count of misses and the number of claims
waiting now. The leader turns the counters into misses since its last pass, so a miss
counts as demand in exactly one pass: one pass closes the gap it opened, and the next
pass does not spawn for it again.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from stoker.domain.records import DemandRecord


class DemandLedger:
    """Remembers the counters it has seen; `demand` returns what is new plus what waits."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], int] = {}
        self._last_pass: float | None = None

    def demand(
        self, rows: Iterable[DemandRecord], *, now: float, fresh_after: float
    ) -> dict[str, int]:
        """Demand per pool: misses since the last call, plus claims waiting on replicas
        whose row is younger than `fresh_after` (a dead replica's queue is not demand)."""
        out: dict[str, int] = defaultdict(int)
        for row in rows:
            key = (row.pool, row.instance)
            before = self._seen.get(key)
            self._seen[key] = row.misses
            if before is not None:
                out[row.pool] += max(0, row.misses - before)
            elif self._last_pass is not None and row.updated_at >= self._last_pass:
                # A replica that appeared since the last pass: all its misses are new.
                out[row.pool] += row.misses
            # A ledger that starts (a new leader) takes existing counters as its baseline.
            if row.updated_at >= fresh_after:
                out[row.pool] += row.waiting
        self._last_pass = now
        return dict(out)
