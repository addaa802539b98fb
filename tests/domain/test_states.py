"""The transition table of `stoker.domain.states`: every legal and illegal move, the org rules."""

from __future__ import annotations

import itertools

import pytest

from stoker.domain.errors import IllegalTransition
from stoker.domain.states import (
    TERMINAL,
    TRANSITIONS,
    WorkerState,
    check_org_change,
    check_transition,
)

S = WorkerState

LEGAL = {
    (S.SPAWNING, S.WARM),
    (S.SPAWNING, S.RESERVED),
    (S.WARM, S.RESERVED),
    (S.RESERVED, S.ACTIVATING),
    (S.RESERVED, S.WARM),
    (S.RESERVED, S.HOT_IDLE),
    (S.ACTIVATING, S.HOT),
    (S.ACTIVATING, S.HOT_IDLE),
    (S.HOT, S.HOT_IDLE),
    (S.HOT_IDLE, S.RESERVED),
} | {(s, t) for s in S if s not in TERMINAL for t in (S.DRAINING, S.RETIRED) if s is not t}


def test_table_is_exactly_the_documented_lifecycle() -> None:
    table = {(s, t) for s, targets in TRANSITIONS.items() for t in targets}
    assert table == LEGAL


@pytest.mark.parametrize(("src", "dst"), sorted(itertools.product(S, S)))
def test_every_pair_is_checked(src: WorkerState, dst: WorkerState) -> None:
    activated = src is S.HOT_IDLE or (src, dst) == (S.RESERVED, S.HOT_IDLE)
    if (src, dst) in LEGAL:
        check_transition(src, dst, activated=activated)
    else:
        with pytest.raises(IllegalTransition):
            check_transition(src, dst, activated=activated)


def test_retired_is_terminal() -> None:
    for dst in S:
        with pytest.raises(IllegalTransition):
            check_transition(S.RETIRED, dst)


def test_an_activated_worker_never_becomes_neutral_again() -> None:
    check_transition(S.RESERVED, S.WARM, activated=False)
    with pytest.raises(IllegalTransition):
        check_transition(S.RESERVED, S.WARM, activated=True)


def test_only_an_activated_worker_goes_back_to_hot_idle() -> None:
    check_transition(S.RESERVED, S.HOT_IDLE, activated=True)
    with pytest.raises(IllegalTransition):
        check_transition(S.RESERVED, S.HOT_IDLE, activated=False)


def test_org_is_written_once() -> None:
    check_org_change(None, "acme", to=S.RESERVED, activated=False)
    check_org_change("acme", "acme", to=S.HOT, activated=True)
    with pytest.raises(IllegalTransition):
        check_org_change("acme", "globex", to=S.RESERVED, activated=True)
    with pytest.raises(IllegalTransition):
        check_org_change("acme", "globex", to=S.RESERVED, activated=False)


def test_org_clears_only_when_a_never_activated_worker_returns_to_warm() -> None:
    check_org_change("acme", None, to=S.WARM, activated=False)
    with pytest.raises(IllegalTransition):
        check_org_change("acme", None, to=S.WARM, activated=True)
    with pytest.raises(IllegalTransition):
        check_org_change("acme", None, to=S.HOT_IDLE, activated=False)
