"""The per-org forecast (`stoker.policy.org_forecast`) and what it frees at a full pool
(`stoker.policy.reaping.hot_idle_to_free`): pure, times are arguments."""

from __future__ import annotations

import pytest

from stoker.domain.records import OrgForecastBucket, Worker
from stoker.domain.states import WorkerState
from stoker.policy.forecast import HOUR_S
from stoker.policy.org_forecast import MIN_HOURS, OrgForecasts, day_bucket, return_chance
from stoker.policy.reaping import hot_idle_to_free

#: 2023-11-13T00:00:00Z, a Monday: hour index of its midnight.
MONDAY = 1699833600 // 3600


def learn_day(f: OrgForecasts, first_hour: int, claims: dict[str, int]) -> None:
    for hour in range(first_hour, first_hour + 24):
        f.learn(hour, claims, (hour + 1) * HOUR_S + 5)


def test_an_org_is_forecast_only_after_a_day_of_history() -> None:
    f = OrgForecasts("p", most=8)
    for hour in range(MONDAY, MONDAY + MIN_HOURS - 1):
        f.learn(hour, {"acme": 6}, (hour + 1) * HOUR_S)
    t = (MONDAY + 24 + 9.5) * HOUR_S
    assert f.tracked == 1 and f.forecast_orgs() == []
    assert f.at("acme", t, 0.99) is None and f.chance("acme", t, t + 60, 0.99) is None
    f.learn(MONDAY + MIN_HOURS - 1, {"acme": 6}, (MONDAY + MIN_HOURS) * HOUR_S)
    outlook = f.at("acme", t, 0.99)
    assert f.forecast_orgs() == ["acme"]
    assert outlook is not None and outlook.mean == pytest.approx(6 / HOUR_S)
    assert f.at("nobody", t, 0.99) is None


def test_each_hour_of_the_day_is_learned_apart_and_weekends_apart() -> None:
    f = OrgForecasts("p", most=8)
    # acme claims only at 14:00, Monday and Tuesday: tracked from its first claim on.
    for hour in range(MONDAY, MONDAY + 48):
        f.learn(hour, {"acme": 12 if hour % 24 == 14 else 0}, (hour + 1) * HOUR_S)
    wednesday = (MONDAY + 48) * HOUR_S
    at_two = f.at("acme", wednesday + 14.5 * HOUR_S, 0.5)
    at_night = f.at("acme", wednesday + 3.5 * HOUR_S, 0.5)
    assert at_two is not None and at_two.mean == pytest.approx(12 / HOUR_S)
    assert at_night is not None and at_night.mean == 0
    # Saturday has its own buckets: nothing learned of them yet.
    assert day_bucket(wednesday) == 0 and day_bucket(wednesday + 3 * 86400) == 24
    assert f.at("acme", wednesday + 3 * 86400 + 14.5 * HOUR_S, 0.5) is None


def test_orgs_are_bounded_by_volume_and_a_quiet_one_is_evicted() -> None:
    f = OrgForecasts("p", most=2)
    learned = f.learn(MONDAY, {"busy": 10, "steady": 3, "small": 1}, MONDAY * HOUR_S + HOUR_S)
    assert f.tracked == 2 and learned.dropped == []
    assert {b.org for b in learned.buckets} == {"busy", "steady"}
    # A newcomer no more than twice the quietest tracked org's volume stays out.
    learned = f.learn(MONDAY + 1, {"busy": 10, "steady": 3, "new": 6}, (MONDAY + 2) * HOUR_S)
    assert learned.dropped == [] and f.volume("new") == 0
    # steady stops claiming: its volume falls, and a busier newcomer takes its place.
    for hour in range(MONDAY + 2, MONDAY + 8):
        f.learn(hour, {"busy": 10}, (hour + 1) * HOUR_S)
    assert f.volume("steady") < 1
    learned = f.learn(MONDAY + 8, {"busy": 10, "new": 4}, (MONDAY + 9) * HOUR_S)
    assert learned.dropped == ["steady"] and f.tracked == 2
    assert {b.org for b in learned.buckets} == {"busy", "new"}
    # What was stored is what a new leader starts from, and it goes on after the last hour.
    again = OrgForecasts("p", most=2, buckets=[*learned.buckets])
    assert again.last_hour == MONDAY + 8 and again.due((MONDAY + 9.5) * HOUR_S) is None
    assert again.due((MONDAY + 10) * HOUR_S) == MONDAY + 9


def test_return_chance_is_poisson() -> None:
    assert return_chance(0.0, 600) == 0
    assert return_chance(1 / 600, 600) == pytest.approx(1 - 1 / 2.718281828, rel=1e-6)
    assert return_chance(1.0, 0) == 0


def parked(worker_id: str, org: str, idle_since: float) -> Worker:
    return Worker(
        id=worker_id,
        pool="p",
        revision="r",
        state=WorkerState.HOT_IDLE,
        epoch=1,
        owner="cp",
        created_at=0,
        updated_at=idle_since,
        org=org,
        idle_since=idle_since,
        ttl_s=600,
    )


def test_a_full_pool_frees_the_parked_workers_least_likely_to_be_claimed() -> None:
    workers = [
        parked("w1", "busy", 10),
        parked("w2", "quiet", 30),
        parked("w3", "quieter", 20),
        parked("w4", "unknown", 0),
        parked("w5", "floored", 0),
    ]
    chance = {"busy": 0.9, "quiet": 0.2, "quieter": 0.1, "unknown": None, "floored": 0.0}

    def floor(pool: str, org: str) -> int:
        return 1 if org == "floored" else 0

    def free(wanted: int) -> list[str]:
        victims = hot_idle_to_free(workers, wanted, lambda w: chance[w.org or ""], floor)
        return [w.id for w in victims]

    # Least likely first; a busy org's worker, an org without a forecast's, and one the
    # org's floor keeps all stay.
    assert free(1) == ["w3"]
    assert free(5) == ["w3", "w2"]
    assert free(0) == []


def test_learned_hours_kept_as_it_learns_match_the_buckets_after_reloading() -> None:
    """The hours an org learned, kept as it goes, are what its stored buckets say: a new
    leader reading them back forecasts the same orgs, the same way."""
    f = OrgForecasts("p", most=2)
    stored: dict[tuple[str, int], OrgForecastBucket] = {}
    for hour in range(MONDAY, MONDAY + 25):
        # On the second Monday hour a much busier newcomer evicts the quietest org.
        claims = {"acme": 6, "zeta": 1} if hour < MONDAY + 24 else {"acme": 6, "omni": 40}
        learned = f.learn(hour, claims, (hour + 1) * HOUR_S)
        stored.update({(b.org, b.bucket): b for b in learned.buckets})
        for org in learned.dropped:
            stored = {k: b for k, b in stored.items() if k[0] != org}
    assert f.forecast_orgs() == ["acme"]
    again = OrgForecasts("p", most=2, buckets=stored.values())
    assert again.forecast_orgs() == f.forecast_orgs()
    t = (MONDAY + 26.5) * HOUR_S
    assert again.at("acme", t, 0.99) == f.at("acme", t, 0.99)
    assert again.at("omni", t, 0.99) is None
