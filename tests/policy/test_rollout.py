"""The rollout plan: a canary sized from the claims it will get (#25),
with picchu's own numbers where its bugs are the ones avoided (#602, #614-#617, #648)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stoker.domain.errors import InvalidRequest
from stoker.domain.pools import Rollout
from stoker.domain.rollouts import (
    CanaryStrategy,
    ReplaceStrategy,
    RolloutState,
    strategy_from,
    strategy_json,
)
from stoker.policy.rollout import (
    MIN_ATTEMPTS,
    MIN_ROUTED_CLAIMS,
    Decision,
    PoolDemand,
    RevisionCounts,
    RevisionFailures,
    Role,
    RolloutPlan,
    org_position,
    rollout_plan,
)

CANARY = CanaryStrategy(steps=(10, 50, 100), step_interval_s=60, max_failure_ratio=0.2)


def ramp(
    step: int = 0, started: float = 0.0, state: RolloutState = RolloutState.RAMPING
) -> Rollout:
    return Rollout(
        id="r1",
        pool="p",
        revision="new",
        base_revision="old",
        strategy=CANARY,
        state=state,
        started_at=started,
        step=step,
        share=CANARY.steps[step],
    )


def plan(
    counts: dict[str, RevisionCounts],
    *,
    r: Rollout | None = None,
    pool: PoolDemand | None = None,
    failures: RevisionFailures | None = None,
    now: float = 10.0,
) -> RolloutPlan:
    return rollout_plan(
        stable="old",
        ramp=r if r is not None else ramp(),
        counts=counts,
        failures=failures or RevisionFailures(),
        pool=pool or PoolDemand(),
        now=now,
    )


def test_the_ramp_is_its_steps_share_of_the_pools_demand_driven_target() -> None:
    p = plan({"old": RevisionCounts(busy=1000)}, pool=PoolDemand(warm_target=20))
    assert p.ramping == "new"
    new, old = p.part("new"), p.part("old")
    assert new.role is Role.RAMPING and new.share == pytest.approx(0.1)
    # 10 % of 20, not 10 % of the 1,000 sessions the old revision serves: a session never
    # moves, so only new claims use the new revision's workers.
    assert new.warm_target == 2
    assert old.warm_target == 18  # the stable revision gives up as much


@given(busy=st.integers(0, 5000), own_busy=st.integers(0, 5000), warm=st.integers(0, 500))
def test_busy_sessions_never_size_the_ramp(busy: int, own_busy: int, warm: int) -> None:
    pool = PoolDemand(warm_target=40, demand=3)
    base = plan({}, pool=pool)
    p = plan(
        {"old": RevisionCounts(busy=busy, warm=warm), "new": RevisionCounts(busy=own_busy)},
        pool=pool,
    )
    assert p.part("new").warm_target == base.part("new").warm_target == 5  # 10 % of 43
    assert p.part("new").warm_target + p.part("old").warm_target == 43


def test_the_ramp_never_counts_its_own_workers() -> None:
    pool = PoolDemand(warm_target=100)
    alone = plan({"old": RevisionCounts(busy=100)}, pool=pool).part("new").warm_target
    # However many workers the ramp holds already, its target stays 10 % of the pool's:
    # no 100 -> 232 feedback loop.
    for own in (10, 50, 232):
        for counts in (RevisionCounts(warm=own), RevisionCounts(busy=own)):
            p = plan({"old": RevisionCounts(busy=100), "new": counts}, pool=pool)
            assert p.part("new").warm_target == alone == 10


def test_the_pools_target_stays_within_the_cap() -> None:
    p = plan(
        {"old": RevisionCounts(busy=450), "new": RevisionCounts(busy=383)},
        r=ramp(step=1),
        pool=PoolDemand(warm_target=500, demand=600, cap=900),
    )
    assert p.part("new").warm_target + p.part("old").warm_target == 900


def test_orgs_routed_to_the_ramp_that_claim_more_than_its_share_size_it() -> None:
    pool = PoolDemand(warm_target=20)
    heavy = RevisionFailures(neutral=100, routed=30)
    p = plan({"old": RevisionCounts(busy=50)}, pool=pool, failures=heavy)
    # 10 % of the orgs made 30 % of the claims: sticky routing sends them all here.
    assert p.part("new").warm_target == 6 and p.part("old").warm_target == 14
    few = RevisionFailures(neutral=MIN_ROUTED_CLAIMS - 1, routed=MIN_ROUTED_CLAIMS - 1)
    assert plan({}, pool=pool, failures=few).part("new").warm_target == 2
    light = RevisionFailures(neutral=100, routed=1)
    assert plan({}, pool=pool, failures=light).part("new").warm_target == 2


def test_warm_target_zero_sizes_from_demand() -> None:
    p = plan({}, pool=PoolDemand(warm_target=0, demand=9))
    assert p.part("new").warm_target == 1 and p.part("old").warm_target == 8
    assert plan({}, pool=PoolDemand()).part("new").warm_target == 0


def test_a_step_that_holds_nothing_is_taken_at_once() -> None:
    preparing = ramp().evolve(share=0)
    p = plan({}, r=preparing, pool=PoolDemand(), now=0)
    assert p.decision is Decision.ADVANCE and p.written is not None
    assert p.written.share == 10


def test_the_stable_revision_keeps_demand_driven_scaling() -> None:
    quiet = plan({"old": RevisionCounts(busy=48)}, pool=PoolDemand(warm_target=10))
    busy = plan({"old": RevisionCounts(busy=48)}, pool=PoolDemand(warm_target=10, demand=40))
    assert quiet.part("old").role is Role.STABLE
    assert quiet.part("old").warm_target == 9  # 90 % of 10
    assert busy.part("old").warm_target == 45  # 90 % of 50: demand still counts
    assert busy.part("old").share == pytest.approx(0.9)


def test_a_step_waits_for_its_interval() -> None:
    counts = {"old": RevisionCounts(busy=100), "new": RevisionCounts(warm=60)}
    assert plan(counts, now=59).decision is Decision.HOLD
    p = plan(counts, now=60)
    assert p.decision is Decision.ADVANCE
    assert p.ramp is not None and p.ramp.step == 1 and p.ramp.step_started_at == 60
    assert p.written == p.ramp and p.written.share == 50
    assert p.part("new").share == pytest.approx(0.5)


def test_a_step_waits_for_its_warm_workers_and_grows_towards_them() -> None:
    pool = PoolDemand(warm_target=20)
    counts = {"old": RevisionCounts(busy=100, warm=18), "new": RevisionCounts(warm=5)}
    p = plan(counts, pool=pool, now=61)
    assert p.decision is Decision.HOLD and p.ramp is not None and p.ramp.share == 10
    assert p.needed == 10 and "holds 5 of the 10 warm workers" in p.waits
    # Still 10 % of new claims, but the warm target is the next step's already; the
    # stable revision keeps its part until the step takes effect.
    assert p.part("new").share == pytest.approx(0.1)
    assert p.part("new").warm_target == 10 and p.part("old").warm_target == 18
    held = plan({**counts, "new": RevisionCounts(warm=9)}, pool=pool, now=61)
    assert held.decision is Decision.ADVANCE  # 9 of 10: within the hold ratio


def test_a_step_asks_no_more_than_the_stable_revision_holds_of_its_own() -> None:
    # Claims take the pool's workers as fast as they get ready: the stable revision holds
    # 4 of its 18; the new one need hold only as large a part of its step's 10.
    pool = PoolDemand(warm_target=20)
    starved = {"old": RevisionCounts(busy=100, warm=4)}
    assert plan({**starved, "new": RevisionCounts(warm=1)}, pool=pool, now=61).held_back
    p = plan({**starved, "new": RevisionCounts(warm=2)}, pool=pool, now=61)
    assert p.decision is Decision.ADVANCE  # ceil(10 x 0.9 x 4/18) = 2


def test_the_ramp_grows_ahead_of_its_step() -> None:
    counts = {"old": RevisionCounts(busy=100)}
    # A replacement time ahead (40 s) ...
    early = plan(counts, pool=PoolDemand(warm_target=20, lead_s=40), now=19)
    assert early.part("new").warm_target == 2 and "interval" in early.waits
    ahead = plan(counts, pool=PoolDemand(warm_target=20, lead_s=40), now=20)
    assert ahead.decision is Decision.HOLD and ahead.part("new").warm_target == 10
    # ... and at least half an interval (30 s): a new image's spawns are slower.
    assert plan(counts, pool=PoolDemand(warm_target=20), now=29).part("new").warm_target == 2
    assert plan(counts, pool=PoolDemand(warm_target=20), now=30).part("new").warm_target == 10


def test_at_a_full_pool_the_stable_revision_makes_room_for_the_ramp() -> None:
    counts = {"old": RevisionCounts(busy=380, warm=18), "new": RevisionCounts(busy=2)}
    p = plan(counts, pool=PoolDemand(warm_target=20, cap=400), now=61)
    assert p.part("new").warm_target == 10 and p.part("old").warm_target == 10
    roomy = plan(counts, pool=PoolDemand(warm_target=20, cap=800), now=61)
    assert roomy.part("new").warm_target == 10 and roomy.part("old").warm_target == 18


def test_a_step_not_held_within_the_deadline_pauses_with_the_reason() -> None:
    strategy = CanaryStrategy(steps=(10, 50, 100), step_interval_s=60, hold_deadline_s=300)
    r = ramp().evolve(strategy=strategy)
    counts = {"old": RevisionCounts(busy=390, warm=10), "new": RevisionCounts(warm=2)}
    pool = PoolDemand(warm_target=20, cap=400)
    assert plan(counts, r=r, pool=pool, now=359).decision is Decision.HOLD
    p = plan(counts, r=r, pool=pool, now=360)
    assert p.decision is Decision.PAUSE and p.written is not None
    assert p.written.state is RolloutState.PAUSED
    assert p.written.reason is not None and "holds 2 of the 10" in p.written.reason
    assert "cap of 400" in p.written.reason and "300 s" in p.written.reason
    assert p.part("new").role is Role.PAUSED and p.part("new").share == pytest.approx(0.1)
    assert p.waits.startswith("paused: ")


def test_a_canary_prepares_its_first_step_before_it_takes_any_claim() -> None:
    preparing = ramp().evolve(share=0)
    counts = {"old": RevisionCounts(busy=100, warm=100)}
    pool = PoolDemand(warm_target=100)
    p = plan(counts, r=preparing, pool=pool, now=1)
    assert p.decision is Decision.HOLD
    assert p.part("new").share == 0 and p.route("any-org") == "old"
    assert p.part("new").warm_target == 10 and p.needed == 10
    assert p.part("old").warm_target == 100 and p.part("old").share == 1.0
    held = plan({**counts, "new": RevisionCounts(warm=10)}, r=preparing, pool=pool, now=1)
    assert held.decision is Decision.ADVANCE  # no interval to wait: the first step
    assert held.written is not None and held.written.share == 10 and held.written.step == 0
    assert held.part("new").share == pytest.approx(0.1)


def test_a_paused_rollout_holds_its_share() -> None:
    counts = {"old": RevisionCounts(busy=100), "new": RevisionCounts(warm=60)}
    p = plan(counts, r=ramp(state=RolloutState.PAUSED), now=600)
    assert p.decision is Decision.HOLD
    assert p.part("new").role is Role.PAUSED and p.part("new").share == pytest.approx(0.1)


def test_the_last_step_promotes() -> None:
    counts = {"old": RevisionCounts(busy=10), "new": RevisionCounts(busy=50, warm=10)}
    p = plan(counts, r=ramp(step=2), now=60)
    assert p.decision is Decision.PROMOTE
    assert p.written is not None and p.written.state is RolloutState.PROMOTED
    assert p.stable == "new" and p.ramping is None
    assert p.part("old").role is Role.RETIRING and p.part("new").share == 1.0


def test_failures_mid_ramp_roll_back_and_restore_the_stable_target_at_once() -> None:
    counts = {"old": RevisionCounts(busy=50, warm=2), "new": RevisionCounts(busy=5, warm=20)}
    bad = RevisionFailures(activations=10, activation_failures=5)
    p = plan(counts, r=ramp(step=1), failures=bad, pool=PoolDemand(warm_target=20))
    assert p.decision is Decision.ROLL_BACK and "activation" in p.why
    assert p.ramping is None
    assert p.written is not None and p.written.state is RolloutState.ROLLED_BACK
    assert p.written.share == 0 and p.written.ended_at == 10.0
    assert p.part("new").role is Role.FAILED and p.part("new").share == 0
    assert p.part("new").warm_target == 0
    assert p.part("old").share == 1.0 and p.part("old").warm_target == 20
    assert p.route("any-org") == "old"


def test_a_single_early_failure_is_no_verdict() -> None:
    few = RevisionFailures(spawns=MIN_ATTEMPTS - 1, spawn_failures=MIN_ATTEMPTS - 1)
    assert plan({"old": RevisionCounts(busy=10)}, failures=few).decision is Decision.HOLD


def test_failures_under_the_threshold_still_let_a_step_advance() -> None:
    counts = {"old": RevisionCounts(busy=100), "new": RevisionCounts(warm=60)}
    some = RevisionFailures(activations=100, activation_failures=10)
    assert plan(counts, failures=some, now=60).decision is Decision.ADVANCE


def test_an_ended_rollout_leaves_no_ramp() -> None:
    counts = {"old": RevisionCounts(busy=3), "new": RevisionCounts(warm=2)}
    for state, role in (
        (RolloutState.ROLLED_BACK, Role.FAILED),
        (RolloutState.ABORTED, Role.FAILED),
        (RolloutState.SUPERSEDED, Role.RETIRING),
    ):
        p = plan(counts, r=ramp(state=state))
        assert p.ramping is None and p.part("new").role is role
        assert p.part("old").share == 1.0


def test_replace_switches_every_claim_at_once() -> None:
    r = ramp().evolve(strategy=ReplaceStrategy())
    p = plan({"old": RevisionCounts(warm=5)}, r=r, pool=PoolDemand(warm_target=5))
    assert p.decision is Decision.PROMOTE
    assert p.part("new").warm_target == 5 and p.part("old").role is Role.RETIRING


def test_revisions_the_plan_does_not_name_retire() -> None:
    p = plan({"old": RevisionCounts(busy=1), "older": RevisionCounts(warm=3)})
    assert p.part("older").role is Role.RETIRING and not p.serving("older")
    assert p.serving("old") and p.serving("new")


def test_routing_gives_the_ramp_about_its_share() -> None:
    p = plan({"old": RevisionCounts(busy=100)})
    orgs = [f"org-{i}" for i in range(4000)]
    on_new = sum(p.route(org) == "new" for org in orgs)
    assert 0.08 * len(orgs) < on_new < 0.12 * len(orgs)


def test_an_org_that_moved_stays_on_the_ramp_at_later_steps() -> None:
    counts = {"old": RevisionCounts(busy=100)}
    first = plan(counts)
    later = plan(counts, r=ramp(step=1))
    moved = [f"o{i}" for i in range(500) if first.route(f"o{i}") == "new"]
    assert moved and all(later.route(org) == "new" for org in moved)


@given(
    other_busy=st.integers(0, 500),
    other_warm=st.integers(0, 100),
    own_busy=st.integers(0, 500),
    own_warm=st.integers(0, 500),
    warm_target=st.integers(0, 300),
    demand=st.integers(0, 100),
    cap=st.integers(0, 2000),
    step=st.integers(0, 2),
    now=st.floats(0, 400),
)
def test_the_revisions_share_the_pools_target_and_no_more(
    other_busy: int,
    other_warm: int,
    own_busy: int,
    own_warm: int,
    warm_target: int,
    demand: int,
    cap: int,
    step: int,
    now: float,
) -> None:
    counts = {
        "old": RevisionCounts(busy=other_busy, warm=other_warm),
        "new": RevisionCounts(busy=own_busy, warm=own_warm),
    }
    pool = PoolDemand(warm_target=warm_target, demand=demand, cap=cap, lead_s=30)
    p = plan(counts, r=ramp(step=step), pool=pool, now=now)
    whole = warm_target + demand if cap == 0 else min(cap, warm_target + demand)
    new, old = p.part("new"), p.part("old")
    share = CANARY.share(step)
    following = CANARY.share(min(step + 1, 2))
    # The ramp holds its step's part or, ahead of the next step, that one's; never more.
    assert new.warm_target in (math.ceil(whole * share), math.ceil(whole * following))
    # The stable revision gives up the step's part (and the ramp's whole part at a full
    # pool): together they never want more than the pool's target plus the step ahead.
    assert old.warm_target in (whole - math.ceil(whole * share), whole - new.warm_target)
    live = other_busy + other_warm + own_busy + own_warm
    if cap > 0 and live + max(0, new.warm_target - own_warm) > cap:
        assert new.warm_target + old.warm_target == whole


def test_org_positions_are_stable_and_spread() -> None:
    assert org_position("r1", "acme") == org_position("r1", "acme")
    assert org_position("r1", "acme") != org_position("r2", "acme")
    assert 0 <= org_position("r1", "x") < 1


def test_strategies_read_and_write_their_json() -> None:
    canary = strategy_from({"kind": "canary", "steps": [5, 25, 100], "step_interval_s": 30})
    assert canary == CanaryStrategy(steps=(5, 25, 100), step_interval_s=30)
    assert strategy_from(strategy_json(canary)) == canary
    assert strategy_from({"kind": "replace"}) == ReplaceStrategy()
    assert strategy_from({}) == CanaryStrategy()


@pytest.mark.parametrize(
    "body",
    [
        {"steps": [50, 10]},
        {"steps": [10, 10]},
        {"steps": [0, 100]},
        {"steps": [10, 101]},
        {"steps": []},
        {"steps": "10"},
        {"steps": [10.5]},
        {"step_interval_s": 0},
        {"max_failure_ratio": 1.5},
        {"max_failure_ratio": "x"},
        {"kind": "blue-green"},
    ],
)
def test_bad_strategies_are_refused(body: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest):
        strategy_from(body)


def test_a_plan_that_does_not_decide_only_reflects_the_stored_rollout() -> None:
    counts = {"old": RevisionCounts(busy=100), "new": RevisionCounts(warm=60)}
    bad = RevisionFailures(activations=10, activation_failures=9)
    for failures in (RevisionFailures(), bad):
        p = rollout_plan(
            stable="old",
            ramp=ramp(),
            counts=counts,
            failures=failures,
            pool=PoolDemand(),
            now=600,
            decide=False,
        )
        assert p.decision is Decision.HOLD and p.ramping == "new"
        assert p.part("new").share == pytest.approx(0.1)
