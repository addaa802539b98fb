"""Pure scaling and reaping policy (`stoker.policy`)."""

from __future__ import annotations

from stoker.domain.records import Claim, DemandRecord, Worker
from stoker.domain.specs import SpawnBackoff, Timeouts
from stoker.domain.states import ClaimMode, ClaimSource, ClaimState, WorkerState
from stoker.policy.demand import DemandLedger
from stoker.policy.reaping import (
    expired_claims,
    hot_idle_to_reap,
    hot_idle_to_reclaim,
    resolve_ttl,
    stuck_workers,
)
from stoker.policy.scaling import (
    PoolCounts,
    desired_warm,
    effective_cap,
    retirements_due,
    scale_down_budget,
    spawn_backoff_s,
    spawns_needed,
)

S = WorkerState


def worker(
    wid: str,
    state: WorkerState,
    *,
    org: str | None = None,
    pool: str = "p",
    updated_at: float = 0.0,
    heartbeat_at: float = 0.0,
    idle_since: float | None = None,
    ttl_s: float | None = None,
) -> Worker:
    return Worker(
        id=wid,
        pool=pool,
        revision="r1",
        state=state,
        epoch=1,
        owner="cp",
        created_at=0.0,
        updated_at=updated_at,
        org=org,
        heartbeat_at=heartbeat_at,
        idle_since=idle_since,
        ttl_s=ttl_s,
    )


# -- scaling ---------------------------------------------------------------------------


def test_desired_warm_is_target_plus_demand() -> None:
    assert desired_warm(5, 0, cap=0) == 5
    assert desired_warm(5, 30, cap=0) == 35
    assert desired_warm(0, -3, cap=0) == 0


def test_zero_cap_means_unbounded_and_a_cap_clamps() -> None:
    assert desired_warm(5, 1000, cap=0) == 1005
    assert desired_warm(5, 1000, cap=40) == 40
    assert effective_cap(0, 0) == 0
    assert effective_cap(0, 12) == 12
    assert effective_cap(7, 12) == 7


def test_one_pass_closes_the_whole_gap() -> None:
    # duckgres #597: a static target with 1:1 replenish crept 5 -> 11; one pass must close it.
    counts = PoolCounts(warm=3, spawning_neutral=2, live=20)
    assert spawns_needed(35, counts, cap=0) == 30


def test_spawns_never_exceed_the_cap() -> None:
    counts = PoolCounts(warm=0, spawning_neutral=0, live=45)
    assert spawns_needed(30, counts, cap=50) == 5
    assert spawns_needed(30, PoolCounts(live=60), cap=50) == 0


def test_no_spawns_when_at_or_above_desired() -> None:
    assert spawns_needed(5, PoolCounts(warm=4, spawning_neutral=1, live=5), cap=0) == 0
    assert spawns_needed(5, PoolCounts(warm=9, live=9), cap=0) == 0


def test_scale_down_waits_for_the_delay() -> None:
    counts = PoolCounts(warm=20, live=100)
    assert retirements_due(5, counts, excess_since=None, now=100, scale_down_delay=60) == 0
    assert retirements_due(5, counts, excess_since=50, now=100, scale_down_delay=60) == 0
    assert retirements_due(5, counts, excess_since=40, now=100, scale_down_delay=60) == 10


def test_scale_down_is_at_most_ten_percent_but_at_least_one() -> None:
    assert scale_down_budget(100) == 10
    assert scale_down_budget(5) == 1
    assert scale_down_budget(0) == 1
    counts = PoolCounts(warm=3, live=3)
    assert retirements_due(1, counts, excess_since=0, now=1000, scale_down_delay=60) == 1


def test_stale_revisions_retire_without_waiting() -> None:
    counts = PoolCounts(warm=2, live=50, warm_stale=8)
    assert retirements_due(5, counts, excess_since=None, now=0, scale_down_delay=60) == 5


# -- demand ----------------------------------------------------------------------------


def test_misses_count_once_per_pass() -> None:
    ledger = DemandLedger()
    assert ledger.demand([], now=0, fresh_after=-20) == {}
    rows = [DemandRecord("p", "cp-a", 30, 0, 5)]
    assert ledger.demand(rows, now=10, fresh_after=-10) == {"p": 30}
    assert ledger.demand(rows, now=12, fresh_after=-8) == {"p": 0}
    rows = [DemandRecord("p", "cp-a", 33, 0, 13)]
    assert ledger.demand(rows, now=14, fresh_after=-6) == {"p": 3}


def test_every_replicas_misses_and_queued_claims_add_up() -> None:
    ledger = DemandLedger()
    ledger.demand([], now=0, fresh_after=-20)
    rows = [
        DemandRecord("p", "cp-a", 4, 2, 1),
        DemandRecord("p", "cp-b", 6, 1, 1),
        DemandRecord("q", "cp-b", 1, 0, 1),
    ]
    assert ledger.demand(rows, now=2, fresh_after=-18) == {"p": 13, "q": 1}


def test_a_new_leader_takes_existing_counters_as_baseline() -> None:
    ledger = DemandLedger()
    rows = [DemandRecord("p", "cp-a", 500, 0, 1)]
    assert ledger.demand(rows, now=2, fresh_after=-18) == {"p": 0}


def test_a_dead_replicas_queue_is_not_demand() -> None:
    ledger = DemandLedger()
    ledger.demand([], now=0, fresh_after=-20)
    rows = [DemandRecord("p", "cp-dead", 0, 9, 1), DemandRecord("p", "cp-live", 0, 2, 99)]
    assert ledger.demand(rows, now=100, fresh_after=80) == {"p": 2}


# -- reaping ---------------------------------------------------------------------------


def test_ttl_resolves_claim_then_org_then_pool_then_default() -> None:
    assert resolve_ttl(10, 20, 30, 0) == 10
    assert resolve_ttl(None, 20, 30, 0) == 20
    assert resolve_ttl(None, None, 30, 0) == 30
    assert resolve_ttl(None, None, None, 0) == 60


def test_ttl_is_clamped_by_max_ttl() -> None:
    assert resolve_ttl(3600, None, None, 600) == 600
    assert resolve_ttl(None, None, None, 30) == 30
    assert resolve_ttl(10, None, None, 600) == 10


def test_expired_hot_idle_are_reaped_oldest_first() -> None:
    ws = [
        worker("a", S.HOT_IDLE, org="o", idle_since=0, ttl_s=10),
        worker("b", S.HOT_IDLE, org="o", idle_since=5, ttl_s=10),
        worker("c", S.HOT_IDLE, org="o", idle_since=50, ttl_s=10),
    ]
    victims = hot_idle_to_reap(ws, now=20, floor=lambda pool, org: 0)
    assert [w.id for w in victims] == ["a", "b"]


def test_reaping_keeps_the_org_floor() -> None:
    ws = [
        worker("a", S.HOT_IDLE, org="o", idle_since=0, ttl_s=10),
        worker("b", S.HOT_IDLE, org="o", idle_since=1, ttl_s=10),
        worker("c", S.HOT_IDLE, org="x", idle_since=0, ttl_s=10),
    ]
    floors = {"o": 1, "x": 0}
    victims = hot_idle_to_reap(ws, now=100, floor=lambda pool, org: floors[org])
    assert sorted(w.id for w in victims) == ["a", "c"]


def test_floor_counts_unexpired_workers_too() -> None:
    ws = [
        worker("old", S.HOT_IDLE, org="o", idle_since=0, ttl_s=10),
        worker("fresh", S.HOT_IDLE, org="o", idle_since=95, ttl_s=10),
    ]
    victims = hot_idle_to_reap(ws, now=100, floor=lambda pool, org: 1)
    assert [w.id for w in victims] == ["old"]


def test_reclaim_takes_other_orgs_least_recently_used_above_their_floor() -> None:
    ws = [
        worker("mine", S.HOT_IDLE, org="me", idle_since=0),
        worker("o-old", S.HOT_IDLE, org="o", idle_since=1),
        worker("o-new", S.HOT_IDLE, org="o", idle_since=9),
        worker("x-only", S.HOT_IDLE, org="x", idle_since=2),
        worker("y", S.HOT_IDLE, org="y", idle_since=5),
        worker("hot", S.HOT, org="z"),
    ]
    floors = {"o": 1, "x": 1, "y": 0, "me": 0}
    victims = hot_idle_to_reclaim(ws, "me", floor=lambda pool, org: floors[org])
    # The claimant's own org never loses one; x keeps its only one; o keeps one.
    assert [w.id for w in victims] == ["o-old", "y"]


def test_stuck_rows_by_state_and_timeout() -> None:
    t = Timeouts(spawn_s=100, reserve_s=10, activation_s=20, drain_s=50)
    ws = [
        worker("spawn-young", S.SPAWNING, updated_at=950),
        worker("spawn-old", S.SPAWNING, updated_at=800),
        worker("res-old", S.RESERVED, updated_at=985),
        worker("act-beating", S.ACTIVATING, updated_at=900, heartbeat_at=990),
        worker("act-silent", S.ACTIVATING, updated_at=900, heartbeat_at=900),
        worker("drain-old", S.DRAINING, updated_at=900),
        worker("hot", S.HOT, updated_at=0),
    ]
    stuck = stuck_workers(ws, now=1000, timeouts_of={"p": t})
    assert sorted(w.id for w in stuck) == ["act-silent", "drain-old", "res-old", "spawn-old"]


def test_expired_claims() -> None:
    def claim(cid: str, expires_at: float, state: ClaimState = ClaimState.BOUND) -> Claim:
        return Claim(
            id=cid,
            pool="p",
            org="o",
            worker_id="w",
            worker_epoch=1,
            source=ClaimSource.WARM,
            mode=ClaimMode.PREFER_WARM,
            state=state,
            token="t",
            endpoint="e",
            lease_s=60,
            expires_at=expires_at,
            created_at=0,
            updated_at=0,
            owner="cp",
        )

    claims = [claim("a", 10), claim("b", 200), claim("c", 10, ClaimState.RELEASED)]
    assert [c.id for c in expired_claims(claims, now=100)] == ["a"]


def test_spawn_backoff_doubles_from_the_first_failure_and_stops_at_its_cap() -> None:
    backoff = SpawnBackoff()
    assert [spawn_backoff_s(n, backoff) for n in range(9)] == [0, 1, 2, 4, 8, 16, 32, 60, 60]
    assert spawn_backoff_s(10**6, backoff) == 60  # no overflow after a long outage
    assert spawn_backoff_s(3, SpawnBackoff(initial_s=5, max_s=300, factor=1)) == 5
