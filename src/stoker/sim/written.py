"""`WrittenRows`: the shared store's live workers and bound claims, as the writes left them.

The invariant checker reads the fleet from here, not from the store: every worker and
claim write of every replica reaches it (`ObservedStore` reports each one the store
acknowledged, with the row as written), so it holds what the store holds, on any store,
and keeps the counts the checks need up to date as it goes instead of reading and
decoding every row at every check. It also remembers the order rows were created in:
a check reports in that order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from stoker.domain.records import Claim, Worker
from stoker.domain.states import WorkerState


class WrittenRows:
    """Live workers (by id and by state), bound claims, and counts of both."""

    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}
        self.by_state: dict[WorkerState, dict[str, Worker]] = {}
        #: Bound claims by id, and how many each worker has.
        self.claims: dict[str, Claim] = {}
        self.claims_per_worker: Counter[str] = Counter()
        #: Live workers per (pool, org) (org None: neutral), and per pool.
        self.per_org: Counter[tuple[str, str | None]] = Counter()
        self.per_pool: Counter[str] = Counter()
        #: Warm, and neutral spawning, workers per (pool, revision).
        self.neutral: Counter[tuple[str, str]] = Counter()
        #: Creation order of every worker and claim row.
        self.born: dict[str, int] = {}

    def worker_written(self, worker: Worker) -> None:
        """A worker row as a write left it (a new row, a move, or a same-state update)."""
        self.born.setdefault(worker.id, len(self.born))
        old = self.workers.pop(worker.id, None)
        if old is not None:
            del self.by_state[old.state][old.id]
            self._count(old, -1)
        if worker.state is WorkerState.RETIRED:
            return
        self.workers[worker.id] = worker
        self.by_state.setdefault(worker.state, {})[worker.id] = worker
        self._count(worker, 1)

    def _count(self, worker: Worker, n: int) -> None:
        self.per_org[(worker.pool, worker.org)] += n
        self.per_pool[worker.pool] += n
        if worker.state is WorkerState.WARM or (
            worker.state is WorkerState.SPAWNING and worker.org is None
        ):
            self.neutral[(worker.pool, worker.revision)] += n

    def claim_bound(self, claim: Claim) -> None:
        """A claim was stored bound."""
        self.born.setdefault(claim.id, len(self.born))
        self.claims[claim.id] = claim
        self.claims_per_worker[claim.worker_id] += 1

    def claim_renewed(self, claim: Claim) -> None:
        """A bound claim's lease was extended (`claim` as stored now)."""
        if claim.id in self.claims:
            self.claims[claim.id] = claim

    def claim_ended(self, claim: Claim) -> None:
        """A bound claim was ended."""
        if self.claims.pop(claim.id, None) is not None:
            self.claims_per_worker[claim.worker_id] -= 1
            if not self.claims_per_worker[claim.worker_id]:
                del self.claims_per_worker[claim.worker_id]

    def in_states(self, *states: WorkerState) -> list[Worker]:
        """Live workers in `states`, as an index on (state, pool, revision) lists them:
        by state, pool and revision, oldest row first."""
        return self.workers_in_order(
            w for state in states for w in self.by_state.get(state, {}).values()
        )

    def bound_claims(self) -> list[Claim]:
        """Bound claims by lease expiry, oldest row first among equals."""
        return self.claims_in_order(self.claims.values())

    def workers_in_order(self, workers: Iterable[Worker]) -> list[Worker]:
        """`workers` in `in_states`' order: a check sorts the few it reports, not the
        fleet it looks at."""
        born = self.born
        return sorted(workers, key=lambda w: (w.state.value, w.pool, w.revision, born[w.id]))

    def claims_in_order(self, claims: Iterable[Claim]) -> list[Claim]:
        """`claims` in `bound_claims`' order."""
        born = self.born
        return sorted(claims, key=lambda c: (c.expires_at, born[c.id]))

    def still_bound(self, claim_id: str) -> bool:
        """Whether the claim is bound now."""
        return claim_id in self.claims

    def org_counts(self) -> Iterable[tuple[str, str | None, int]]:
        """(pool, org, live workers) by pool, then org, the neutral ones first."""
        keys = sorted(
            (key for key, n in self.per_org.items() if n),
            key=lambda k: (k[0], k[1] is not None, k[1] or ""),
        )
        return [(pool, org, self.per_org[(pool, org)]) for pool, org in keys]
