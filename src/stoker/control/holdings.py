"""What an org holds of a pool, and when the soonest of it frees: the 429's `Retry-After`.

A claim refused for its org's cap (HTTP 429) can succeed once one of the org's workers in
the pool frees: a `hot` one when its lease runs out (unless renewed or released earlier),
a `hot_idle` one when its TTL ends (or at once, for the org's next claim, when the pool
reuses it). The answer says how long until the soonest of those moments, bounded between
one second and the configured `org_cap_retry_after_s`, which is also the answer when the
org's holdings say nothing (none found, or the store failed).
"""

from __future__ import annotations

from stoker.domain.errors import StoreError
from stoker.domain.records import Worker
from stoker.domain.states import WorkerState
from stoker.ports.store import StoreReader

#: Workers read at most: a cap is small, and a 429 must not cost a scan.
HOLDINGS_READ_MAX = 64
#: The shortest wait advertised: a retry sooner would find the same holdings.
RETRY_AFTER_MIN_S = 1.0


async def frees_at(store: StoreReader, worker: Worker) -> float | None:
    """The wall time at which `worker` frees its org's slot, if its record says."""
    if worker.state is WorkerState.HOT_IDLE:
        if worker.idle_since is None or worker.ttl_s is None:
            return None
        return worker.idle_since + worker.ttl_s
    if worker.claim_id is None:
        return None
    claim = await store.get_claim(worker.claim_id)
    return claim.expires_at if claim is not None else None


async def org_cap_retry_after(
    store: StoreReader, *, pool: str, org: str, now: float, longest: float
) -> float:
    """Seconds until the soonest of the org's `hot`/`hot_idle` workers in `pool` frees,
    within [`RETRY_AFTER_MIN_S`, `longest`]; `longest` when that cannot be told."""
    try:
        workers = await store.list_workers(
            pool=pool,
            states=(WorkerState.HOT, WorkerState.HOT_IDLE),
            org=org,
            limit=HOLDINGS_READ_MAX,
        )
        moments = [await frees_at(store, w) for w in workers]
    except StoreError:
        return longest
    known = [m for m in moments if m is not None]
    if not known:
        return longest
    return max(min(RETRY_AFTER_MIN_S, longest), min(longest, min(known) - now))
