"""What to reap: TTL resolution, expired hot_idle workers under the org floor, parked
workers that make room at a full pool, stuck rows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from stoker.domain.records import Claim, SpawnProgress, Worker
from stoker.domain.specs import DEFAULT_HOT_IDLE_TTL_S, Timeouts
from stoker.domain.states import ClaimState, WorkerState


def resolve_ttl(
    claim_ttl: float | None,
    org_ttl: float | None,
    pool_ttl: float | None,
    max_ttl: float,
) -> float:
    """TTL of a hot_idle worker: claim -> org -> pool -> 60 s, clamped by `max_ttl` (> 0)."""
    for ttl in (claim_ttl, org_ttl, pool_ttl):
        if ttl is not None:
            chosen = ttl
            break
    else:
        chosen = DEFAULT_HOT_IDLE_TTL_S
    if max_ttl > 0:
        chosen = min(chosen, max_ttl)
    return max(0.0, chosen)


def idle_expires_at(worker: Worker) -> float:
    """When a hot_idle worker's TTL runs out."""
    ttl = worker.ttl_s if worker.ttl_s is not None else DEFAULT_HOT_IDLE_TTL_S
    return _idle_since(worker) + ttl


def hot_idle_to_reap(
    hot_idle: Iterable[Worker],
    now: float,
    floor: Callable[[str, str], int],
) -> list[Worker]:
    """Expired hot_idle workers to retire, oldest first, keeping each org's `min_hot_idle`.

    `hot_idle` must hold *every* hot_idle worker of the pools concerned, expired or not,
    because the floor counts all of an org's parked workers.
    """
    parked = [w for w in hot_idle if w.state is WorkerState.HOT_IDLE and w.org is not None]
    expired = sorted(
        (w for w in parked if idle_expires_at(w) <= now), key=lambda w: (idle_expires_at(w), w.id)
    )
    if not expired:
        return []  # most passes: nothing to group
    # Per (pool, org): how many may go, keeping the floor; the earliest expired go first.
    size = Counter(_group(w) for w in parked)
    room = {group: max(0, size[group] - floor(*group)) for group in map(_group, expired)}
    victims: list[Worker] = []
    for w in expired:
        if room[_group(w)] > 0:
            room[_group(w)] -= 1
            victims.append(w)
    return victims


def hot_idle_to_reclaim(
    hot_idle: Iterable[Worker], org: str, floor: Callable[[str, str], int]
) -> list[Worker]:
    """Parked workers of orgs other than `org` that may make room in a pool at its cap,
    least recently used first, keeping each org's `min_hot_idle`.

    `hot_idle` must hold every hot_idle worker of the pool (the floor counts them all).
    """
    parked = [w for w in hot_idle if w.state is WorkerState.HOT_IDLE and w.org is not None]
    size = Counter(_group(w) for w in parked)
    room = {group: max(0, count - floor(*group)) for group, count in size.items()}
    victims: list[Worker] = []
    for w in sorted(parked, key=lambda w: (_idle_since(w), w.id)):
        if w.org != org and room[_group(w)] > 0:
            room[_group(w)] -= 1
            victims.append(w)
    return victims


#: A parked worker makes room for the warm pool before its TTL only when its org's forecast
#: gives less than this chance that the org claims again before the TTL runs out.
RETURN_CHANCE = 0.5


def hot_idle_to_free(
    hot_idle: Iterable[Worker],
    wanted: int,
    chance: Callable[[Worker], float | None],
    floor: Callable[[str, str], int],
) -> list[Worker]:
    """Up to `wanted` parked workers to retire before their TTL so that a pool at its cap
    can refill its warm pool: those whose org is unlikely to claim again before the TTL
    runs out (`chance` below `RETURN_CHANCE`), least likely first, keeping each org's
    `min_hot_idle`. `chance` is None for an org without a forecast: its workers stay.

    `hot_idle` must hold every hot_idle worker of the pool (the floor counts them all).
    """
    if wanted <= 0:
        return []
    parked = [w for w in hot_idle if w.state is WorkerState.HOT_IDLE and w.org is not None]
    scored = []
    for w in parked:
        p = chance(w)
        if p is not None and p < RETURN_CHANCE:
            scored.append((p, _idle_since(w), w.id, w))
    size = Counter(_group(w) for w in parked)
    room = {group: max(0, count - floor(*group)) for group, count in size.items()}
    victims: list[Worker] = []
    for *_, w in sorted(scored, key=lambda s: s[:3]):
        if len(victims) < wanted and room[_group(w)] > 0:
            room[_group(w)] -= 1
            victims.append(w)
    return victims


def _idle_since(worker: Worker) -> float:
    return worker.idle_since if worker.idle_since is not None else worker.updated_at


def _group(worker: Worker) -> tuple[str, str]:
    return worker.pool, worker.org or ""


def stuck_deadline(
    worker: Worker, timeouts: Timeouts, progress: SpawnProgress | None = None
) -> float | None:
    """When an in-flight or draining worker counts as stuck, or None for other states.

    A spawning worker gets `spawn_s`; `pending_s` (if longer) while its runtime `progress`
    says it waits on the cluster (a node, an image), and `spawn_s` again from the start
    of its process.
    """
    match worker.state:
        case WorkerState.SPAWNING:
            deadline = worker.updated_at + timeouts.spawn_s
            if progress is not None and progress.waiting:
                deadline = max(deadline, worker.updated_at + timeouts.pending_s)
            if progress is not None and progress.started_at is not None:
                deadline = max(deadline, progress.started_at + timeouts.spawn_s)
            return deadline
        case WorkerState.RESERVED:
            return worker.updated_at + timeouts.reserve_s
        case WorkerState.ACTIVATING:
            # The owner re-stamps heartbeat_at while activation lasts: a live one is not stuck.
            return max(worker.heartbeat_at, worker.updated_at) + timeouts.activation_s
        case WorkerState.DRAINING:
            return worker.updated_at + timeouts.drain_s
        case _:
            return None


def stuck_workers(
    workers: Iterable[Worker],
    now: float,
    timeouts_of: Mapping[str, Timeouts],
    progress_of: Mapping[str, SpawnProgress] | None = None,
) -> list[Worker]:
    """In-flight rows that outlived their timeout (I4); unknown pools use default timeouts.
    `progress_of` holds the runtime's view of spawning workers, by worker id."""
    default = Timeouts()
    progress_of = progress_of or {}
    out = []
    for w in workers:
        deadline = stuck_deadline(w, timeouts_of.get(w.pool, default), progress_of.get(w.id))
        if deadline is not None and now >= deadline:
            out.append(w)
    return out


def session_left(created_at: float, max_claim_s: float, now: float) -> float | None:
    """Seconds a session may still last under `max_claim_s` (never below 0); None when
    there is no limit (0)."""
    if max_claim_s <= 0:
        return None
    return max(0.0, created_at + max_claim_s - now)


def expired_claims(claims: Iterable[Claim], now: float) -> list[Claim]:
    """Bound claims whose lease ran out."""
    return [c for c in claims if c.state is ClaimState.BOUND and c.expires_at <= now]
