"""Demand as a rate and the learned forecast (`stoker.policy.demand`, `stoker.policy.forecast`),
on virtual time: every time is an argument."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stoker.domain.records import DemandRecord
from stoker.policy.demand import (
    DemandLedger,
    RateWindow,
    ReadyTime,
    poisson_quantile,
    warm_for_rate,
)
from stoker.policy.forecast import (
    DAY_S,
    HOUR_S,
    Forecaster,
    ForecastError,
    buckets_of,
    hour_of_week,
)
from stoker.policy.scaling import (
    HEADROOM_COLD,
    HEADROOM_FORECAST,
    HEADROOM_NONE,
    Headroom,
    PoolCounts,
    claims_waiting_for_nodes,
    forecast_short,
    paying_headroom,
)

#: 2024-01-01 00:00 UTC, a Monday.
MONDAY = 1_704_067_200.0
PASS_S = 5.0


def test_the_ledger_counts_each_replicas_claims_once() -> None:
    ledger = DemandLedger()
    ledger.observe([DemandRecord("p", "a", 0, 0, 0.0, 7)], now=1, fresh_after=-19)
    rows = [DemandRecord("p", "a", 2, 1, 5.0, 19), DemandRecord("p", "b", 0, 0, 5.0, 3)]
    seen = ledger.observe(rows, now=10, fresh_after=-10)["p"]
    # a: 12 new since its baseline of 7; b appeared since the last pass: all 3 are new.
    assert (seen.claims, seen.misses, seen.waiting) == (15, 2, 1)
    again = ledger.observe(rows, now=15, fresh_after=-5)["p"]
    assert (again.claims, again.misses, again.waiting) == (0, 0, 1)


def test_a_steady_rate_reads_the_same_in_both_windows_and_does_not_panic() -> None:
    window = RateWindow()
    t = 0.0
    window.add(t, 0)
    for _ in range(200):
        t += PASS_S
        window.add(t, 1)  # one claim a pass: 0.2 a second
    rate = window.rate(t, stable_s=300, panic_s=30, panic_ratio=2)
    assert rate.stable == pytest.approx(0.2)
    assert rate.panic == pytest.approx(0.2)
    assert not rate.panicking and rate.value == rate.stable


def test_a_burst_makes_the_panic_window_win_then_it_fades() -> None:
    window = RateWindow()
    t = 0.0
    window.add(t, 0)
    for _ in range(120):
        t += PASS_S
        window.add(t, 1 if int(t) % 20 == 0 else 0)  # 0.05 a second
    t += PASS_S
    window.add(t, 30)  # thirty claims at once
    rate = window.rate(t, stable_s=300, panic_s=30, panic_ratio=2)
    assert rate.panicking and rate.value == rate.panic == pytest.approx(31 / 30, rel=0.05)
    assert rate.stable < rate.panic / 2
    # Once the burst leaves the panic window, the stable rate (which still holds it) rules.
    for _ in range(8):
        t += PASS_S
        window.add(t, 0)
    later = window.rate(t, stable_s=300, panic_s=30, panic_ratio=2)
    assert not later.panicking and later.value == later.stable > 0.1
    # And past the stable window, nothing is left.
    t += 301
    window.add(t, 0)
    assert window.rate(t, stable_s=300, panic_s=30, panic_ratio=2).value == 0


def test_a_new_window_is_not_read_as_a_storm() -> None:
    window = RateWindow()
    window.add(100.0, 5)  # the first read is the baseline: nothing counts
    window.add(102.0, 1)
    rate = window.rate(102.0, stable_s=300, panic_s=30, panic_ratio=2)
    # One claim over two seconds is not 0.5 a second: the window covers at least 30 s.
    assert rate.stable == rate.panic == pytest.approx(1 / 30)


@given(st.floats(0.01, 400), st.floats(0.5, 0.999))
def test_the_poisson_quantile_is_the_smallest_k_that_covers_the_quantile(
    mean: float, quantile: float
) -> None:
    k = poisson_quantile(mean, quantile)

    def cdf(n: int) -> float:
        return sum(math.exp(-mean + i * math.log(mean) - math.lgamma(i + 1)) for i in range(n + 1))

    assert cdf(k) >= quantile - 1e-9
    assert k == 0 or cdf(k - 1) < quantile + 1e-9


def test_warm_for_rate_covers_a_claim_to_the_quantile() -> None:
    # 0.09 claims a second (an afternoon peak), a 6 s replacement: 0.54 claims expected
    # meanwhile. With 4 warm, a claim finds none only when 4 or more came within 6 s.
    mean = 0.09 * 6.0
    assert warm_for_rate(0.09, 6.0, 0.99) == 4
    p_at_least = 1 - sum(math.exp(-mean) * mean**i / math.factorial(i) for i in range(4))
    assert p_at_least <= 0.01 < p_at_least + math.exp(-mean) * mean**3 / math.factorial(3)
    assert warm_for_rate(0.0, 6.0, 0.99) == 0
    assert warm_for_rate(0.001, 6.0, 0.99) == 1
    assert poisson_quantile(10_000, 0.99) == pytest.approx(10_000 + 2.326 * 100, abs=2)


def test_the_spawn_to_ready_estimate_starts_from_its_seed_and_follows() -> None:
    ready = ReadyTime(10.0)
    assert ready.seconds == 10.0
    ready.observe(4.0)
    assert ready.seconds == 4.0  # the first observation replaces the seed
    for _ in range(50):
        ready.observe(80.0)  # pods now wait for new nodes
    assert ready.seconds == pytest.approx(80.0, rel=0.01)


def test_hours_of_the_week_start_on_monday() -> None:
    assert hour_of_week(MONDAY) == 0
    assert hour_of_week(MONDAY + 5 * DAY_S + 3 * HOUR_S) == 123
    assert buckets_of(MONDAY + 3 * HOUR_S) == (("week", 3), ("day", 3))
    assert buckets_of(MONDAY + 6 * DAY_S + 3 * HOUR_S) == (("week", 147), ("day", 27))


def daily_rate(t: float) -> float:
    """Claims per second: 0.01 at 02:00, 0.09 at 14:00 (the diurnal scenario's shape)."""
    return 0.05 * (1 - 0.8 * math.cos(2 * math.pi * ((t % DAY_S) - 2 * HOUR_S) / DAY_S))


def run_days(
    forecaster: Forecaster, start: float, days: float, rate: object = daily_rate, seed: int = 3
) -> float:
    """Feed `days` of Poisson claims at `rate(t)` a pass at a time; the time at the end."""
    rng = random.Random(seed)
    t = start
    forecaster.observe(t, 0)
    end = start + days * DAY_S
    while t < end:
        t += PASS_S
        mean = rate(t) * PASS_S  # type: ignore[operator]
        forecaster.observe(t, _poisson(rng, mean))
    return t


def _poisson(rng: random.Random, mean: float) -> int:
    n, p, limit = 0, 1.0, math.exp(-mean)
    while True:
        p *= rng.random()
        if p <= limit:
            return n
        n += 1


def test_no_history_means_no_forecast() -> None:
    forecaster = Forecaster("p")
    assert not forecaster.has_history()
    assert forecaster.at(MONDAY, 0.99) is None
    assert forecaster.peak(MONDAY, MONDAY + 600, 0.99) is None


def test_one_learned_day_forecasts_the_next_days_shape() -> None:
    forecaster = Forecaster("p")
    t = run_days(forecaster, MONDAY, 1)
    # Tuesday: the weekday buckets Monday taught.
    for hour in (2, 8, 14, 20):
        at = t + hour * HOUR_S + 1
        outlook = forecaster.at(at, 0.99)
        assert outlook is not None
        assert outlook.mean == pytest.approx(daily_rate(at), rel=0.25, abs=0.004), hour
        assert outlook.upper >= outlook.mean
    # The morning ramp: the forecast half an hour ahead is above the forecast now.
    morning = t + 8 * HOUR_S
    now, ahead = forecaster.at(morning, 0.99), forecaster.peak(morning, morning + 1800, 0.99)
    assert now is not None and ahead is not None and ahead.mean > now.mean
    # A weekend day was never seen: no forecast for it.
    assert forecaster.at(MONDAY + 5 * DAY_S + 12 * HOUR_S, 0.99) is None
    # At most 24 + 24 buckets after a day; 216 at most ever.
    assert len(forecaster.buckets) == 48


def test_the_buckets_stay_bounded_over_weeks() -> None:
    forecaster = Forecaster("p")
    run_days(forecaster, MONDAY, 15, rate=lambda t: 0.02)
    assert len(forecaster.buckets) == 168 + 48
    assert max(b.seen for b in forecaster.buckets if b.level == "week") == 3  # Mondays
    assert max(b.seen for b in forecaster.buckets if b.level == "day") >= 10


def test_a_restarted_leader_forecasts_from_the_stored_buckets() -> None:
    first = Forecaster("p")
    t = run_days(first, MONDAY, 1)
    second = Forecaster("p", first.buckets)
    at = t + 14 * HOUR_S
    assert second.at(at, 0.99) == first.at(at, 0.99)
    # Buckets of another pool are not this one's.
    assert not Forecaster("q", first.buckets).has_history()


def test_a_forecast_error_beyond_the_bound_is_flagged_and_noise_is_not() -> None:
    errors = ForecastError()
    t = 0.0
    for _ in range(180):  # 15 minutes of passes: forecast 0.09/s, claims as forecast
        t += PASS_S
        errors.add(t, 1 if int(t) % 10 == 0 else 0, 0.09 * PASS_S)
    assert not errors.beyond(t, 900, 0.5)
    # A holiday: almost nobody comes while the forecast says afternoon.
    for _ in range(180):
        t += PASS_S
        errors.add(t, 0, 0.09 * PASS_S)
    error, seen, expected = errors.relative(t, 900)
    assert seen == 0 and expected == pytest.approx(81) and error == pytest.approx(-1)
    assert errors.beyond(t, 900, 0.5)
    # Few claims expected: a relative miss is within Poisson noise, not an error.
    quiet = ForecastError()
    quiet.add(1.0, 3, 1.0)
    assert not quiet.beyond(1.0, 900, 0.5)


def test_forecast_short_is_the_growth_beyond_the_live_workers_and_the_warm_pool() -> None:
    # Flat forecast: 40 busy and 5 warm stay so; the warm pool is all slack.
    assert forecast_short(busy=40, live=45, warm=5, growth=1.0, warm_later=5) == -5
    # A morning ramp: 40 busy grow by a tenth within the lead time; the 6 warm wanted now
    # hand out those 4 claims while a node launches.
    assert forecast_short(busy=40, live=46, warm=6, growth=1.1, warm_later=6) == pytest.approx(-2)
    # A steep ramp: a quarter more within the lead time outruns the warm pool by 4.
    assert forecast_short(busy=40, live=46, warm=6, growth=1.25, warm_later=6) == pytest.approx(4)
    # Nothing forecast now (an empty hour): the busy workers as they are.
    assert forecast_short(busy=0, live=0, warm=2, growth=None, warm_later=3) == 1


def waiting(
    short: float | None,
    stranded: int = 0,
    *,
    slots: int = 7,
    most: int = 2,
    node_waits: int = 1,
) -> Headroom:
    """`paying_headroom` while `node_waits` spawns of the pool wait for a node."""
    return paying_headroom(
        short=short, stranded=stranded, node_waits=node_waits, slots=slots, most=most
    )


def test_paying_headroom_holds_room_only_for_what_the_warm_pool_cannot_absorb() -> None:
    none = waiting(-5.0)
    assert (none.placeholders, none.reason, none.short) == (0, HEADROOM_NONE, -5.0)
    # Ten workers short, one spawn waiting: the node launched for it has room for 6 more
    # (node-sized placeholders make room for 7); one placeholder covers the other 4.
    one = waiting(10.0)
    assert (one.placeholders, one.reason) == (1, HEADROOM_FORECAST)
    # Never more than the pool's headroom_nodes.
    assert waiting(40.0).placeholders == 2
    assert waiting(3.0, slots=1, most=2).placeholders == 2


def test_paying_headroom_counts_the_room_on_the_nodes_already_coming() -> None:
    # Four short, one spawn waiting: the node coming for it takes all four.
    coming = waiting(4.0)
    assert (coming.placeholders, coming.reason, coming.short) == (0, HEADROOM_NONE, 4.0)
    # Seven spawns fill the node coming for them: the four need a placeholder's node.
    assert waiting(4.0, node_waits=7).placeholders == 1
    # Eight spawns: two nodes coming, 6 slots free on the second.
    assert waiting(4.0, node_waits=8).placeholders == 0
    # Worker-sized placeholders say nothing of a node's size: no room is counted.
    assert waiting(2.0, slots=1).placeholders == 2


def test_paying_headroom_without_a_forecast_follows_claims_that_waited_for_nodes() -> None:
    # No forecast and no claim waited for a node: nothing says a placeholder buys anything.
    idle = waiting(None)
    assert (idle.placeholders, idle.reason, idle.short) == (0, HEADROOM_NONE, None)
    # Nine claims waited for a node while one spawn did: the node coming for it takes 6
    # of the next ones, a placeholder's node the other 3.
    cold = waiting(None, 9)
    assert (cold.placeholders, cold.reason) == (1, HEADROOM_COLD)
    assert waiting(-3.0, 9).reason == HEADROOM_COLD
    # One claim waited: the room coming takes the next one (the old rule kept both).
    assert waiting(None, 1).placeholders == 0
    # A burst: as many as the pool's headroom_nodes allow.
    assert waiting(None, 30, node_waits=20).placeholders == 2
    # Worker-sized placeholders: one for each claim that waited, up to the most.
    assert waiting(None, 1, slots=1).placeholders == 1
    # The forecast asks for more: the forecast decided.
    assert waiting(30.0, 9).reason == HEADROOM_FORECAST
    assert waiting(None, 30, most=0).placeholders == 0


def test_claims_queued_behind_spawns_on_nodes_do_not_wait_for_a_node() -> None:
    # Three warm spawns, one waiting for a node: two claims queued are served by the two
    # a node took; a third waits for the node, and so does a cold claim's spawn.
    counts = PoolCounts(spawning_neutral=3, node_waits=1)
    assert claims_waiting_for_nodes(misses=0, waiting=2, counts=counts) == 0
    assert claims_waiting_for_nodes(misses=0, waiting=3, counts=counts) == 1
    # A claim that missed is queued too: counted once.
    assert claims_waiting_for_nodes(misses=1, waiting=3, counts=counts) == 1
    assert claims_waiting_for_nodes(misses=2, waiting=0, counts=counts) == 2
    # No warm spawn on a node: every claim queued waits for one.
    assert claims_waiting_for_nodes(misses=0, waiting=2, counts=PoolCounts(node_waits=2)) == 2


def test_paying_headroom_needs_a_spawn_that_waits_for_a_node() -> None:
    # Claims went cold and the forecast is short, but every spawn found a node: a
    # placeholder would have made none of them faster.
    free = paying_headroom(short=4.0, stranded=9, node_waits=0, slots=7, most=2)
    assert (free.placeholders, free.reason, free.short) == (0, HEADROOM_NONE, 4.0)


def test_a_forecast_read_at_an_hour_centre_next_to_an_unknown_hour_is_that_hours() -> None:
    forecaster = Forecaster("p")
    forecaster.observe(MONDAY + 10 * HOUR_S, 0)
    forecaster.observe(MONDAY + 10.5 * HOUR_S, 18)
    forecaster.observe(MONDAY + 11 * HOUR_S - 1, 18)  # 10:00-11:00: 0.01 a second
    forecaster.observe(MONDAY + 11 * HOUR_S + 5, 0)
    # 09:30 is the centre of an hour never seen; the next hour's weight there is 0.
    assert forecaster.at(MONDAY + 9.5 * HOUR_S, 0.99) is None
    outlook = forecaster.at(MONDAY + 10.5 * HOUR_S, 0.99)
    assert outlook is not None and outlook.mean == pytest.approx(0.01)
    peak = forecaster.peak(MONDAY + 9 * HOUR_S, MONDAY + 10 * HOUR_S, 0.99)
    assert peak is not None and peak.mean == pytest.approx(0.01)


def test_a_forecast_error_asked_twice_in_a_pass_answers_alike_and_sees_a_new_pass() -> None:
    errors = ForecastError()
    errors.add(10.0, 2, 1.0)
    first = errors.relative(10.0, 900)
    assert errors.relative(10.0, 900) == first == (1.0, 2.0, 1.0)
    errors.add(10.0, 4, 1.0)  # another pass at the same time still counts
    assert errors.relative(10.0, 900) == (2.0, 6.0, 2.0)
    assert errors.relative(1000.0, 900) == (0.0, 0.0, 0.0)


def test_a_forecast_read_again_after_an_hour_is_learned_is_the_new_buckets() -> None:
    forecaster = Forecaster("p")
    forecaster.observe(MONDAY + 10 * HOUR_S, 0)
    forecaster.observe(MONDAY + 11 * HOUR_S - 1, 36)  # 10:00-11:00: 0.01 a second
    forecaster.observe(MONDAY + 11 * HOUR_S + 5, 0)
    at = MONDAY + 10.5 * HOUR_S + DAY_S  # Tuesday: Monday's weekday bucket
    before = forecaster.at(at, 0.99)
    assert before is not None and forecaster.at(at, 0.99) == before
    assert before.mean == pytest.approx(0.01)
    # Tuesday's 10:00 is learned at twice the rate: the same time now reads its bucket.
    forecaster.observe(MONDAY + DAY_S + 10 * HOUR_S, 0)
    forecaster.observe(MONDAY + DAY_S + 11 * HOUR_S - 1, 72)
    forecaster.observe(MONDAY + DAY_S + 11 * HOUR_S + 5, 0)
    after = forecaster.at(at, 0.99)
    assert after is not None and after.mean == pytest.approx(0.02)
    assert forecaster.at(at, 0.5) != after  # another quantile, another upper bound
