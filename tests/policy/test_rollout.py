"""The rollout plan, with picchu's own numbers (#602, #614-#617, #648)."""

from __future__ import annotations

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


def test_a_ten_percent_step_over_120_busy_wants_at_least_12() -> None:
    p = plan({"old": RevisionCounts(busy=120)})
    assert p.ramping == "new"
    new = p.part("new")
    assert new.role is Role.RAMPING and new.share == pytest.approx(0.1)
    assert new.warm_target >= 12


def test_the_ramp_never_counts_its_own_workers() -> None:
    alone = plan({"old": RevisionCounts(busy=100)}).part("new").warm_target
    # However many workers the ramp holds already, its capacity stays 10 % of the others:
    # what it holds only lowers what it still needs (no 100 -> 232 feedback loop).
    for own in (10, 50, 232):
        p = plan({"old": RevisionCounts(busy=100), "new": RevisionCounts(warm=own)})
        assert p.part("new").warm_target == alone
        busy = plan({"old": RevisionCounts(busy=100), "new": RevisionCounts(busy=own)})
        assert own + busy.part("new").warm_target <= max(alone, own)


def test_the_total_stays_within_the_cap() -> None:
    # 450 + 383 -> 752 for the new one was picchu's; here the cap holds the sum.
    p = plan(
        {"old": RevisionCounts(busy=450), "new": RevisionCounts(busy=383)},
        r=ramp(step=1),
        pool=PoolDemand(cap=900),
    )
    new = p.part("new")
    assert 450 + 383 + new.warm_target <= 900


def test_unbounded_the_ramp_stays_within_the_others_plus_demand() -> None:
    p = plan({"old": RevisionCounts(busy=100)}, r=ramp(step=2), pool=PoolDemand(demand=7))
    assert p.part("new").warm_target <= 100 + 7


def test_warm_target_zero_and_nothing_else_live_sizes_from_demand() -> None:
    p = plan({}, pool=PoolDemand(warm_target=0, demand=9))
    assert p.part("new").warm_target == 9
    assert plan({}, pool=PoolDemand()).part("new").warm_target == 0


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


def test_a_step_waits_for_the_capacity_of_the_next_and_grows_towards_it() -> None:
    counts = {"old": RevisionCounts(busy=100), "new": RevisionCounts(warm=12)}
    p = plan(counts, now=61)
    assert p.decision is Decision.HOLD
    assert p.needed == 50
    assert p.part("new").warm_target == 50


def test_a_canary_prepares_its_first_step_before_it_takes_any_claim() -> None:
    preparing = ramp().evolve(share=0)
    counts = {"old": RevisionCounts(busy=100)}
    p = plan(counts, r=preparing, now=1)
    assert p.decision is Decision.HOLD
    assert p.part("new").share == 0 and p.route("any-org") == "old"
    assert p.part("new").warm_target == 10 and p.needed == 10
    held = plan({**counts, "new": RevisionCounts(warm=10)}, r=preparing, now=1)
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
    demand=st.integers(0, 100),
    cap=st.integers(0, 2000),
    step=st.integers(0, 2),
)
def test_the_ramp_never_lifts_the_total_over_its_limit(
    other_busy: int,
    other_warm: int,
    own_busy: int,
    own_warm: int,
    demand: int,
    cap: int,
    step: int,
) -> None:
    counts = {
        "old": RevisionCounts(busy=other_busy, warm=other_warm),
        "new": RevisionCounts(busy=own_busy, warm=own_warm),
    }
    p = plan(counts, r=ramp(step=step), pool=PoolDemand(demand=demand, cap=cap))
    wanted = own_busy + p.part("new").warm_target
    if cap > 0:
        assert other_busy + other_warm + wanted <= max(cap, other_busy + other_warm + own_busy)
    else:
        assert wanted <= max(own_busy, other_busy + other_warm + demand)


@given(own=st.integers(0, 1000), other=st.integers(1, 1000))
def test_the_ramp_target_does_not_grow_with_its_own_warm_workers(own: int, other: int) -> None:
    base = plan({"old": RevisionCounts(busy=other)})
    more = plan({"old": RevisionCounts(busy=other), "new": RevisionCounts(warm=own)})
    assert more.part("new").warm_target == base.part("new").warm_target


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
