"""Which workers' nodes must not be disrupted (`wants_pin`): pure, no I/O."""

from __future__ import annotations

import pytest

from stoker.control.pins import wants_pin
from stoker.domain.records import Worker
from stoker.domain.states import WorkerState

S = WorkerState


def worker(state: WorkerState, *, activated: bool = False) -> Worker:
    return Worker(
        id="w-1",
        pool="p",
        revision="r",
        state=state,
        epoch=1,
        owner="cp",
        created_at=0.0,
        updated_at=0.0,
        activated=activated,
    )


@pytest.mark.parametrize(
    ("state", "activated", "wanted"),
    [
        (S.WARM, False, False),
        (S.RESERVED, False, False),  # picked from warm: neutral until activated
        (S.RESERVED, True, True),  # reserved for reuse by its org
        (S.ACTIVATING, True, True),
        (S.HOT, True, True),
        (S.HOT_IDLE, True, True),
        (S.SPAWNING, False, None),
        (S.DRAINING, True, None),
        (S.RETIRED, True, None),
    ],
)
def test_a_worker_is_pinned_once_it_holds_an_orgs_data(
    state: WorkerState, activated: bool, wanted: bool | None
) -> None:
    assert wants_pin(worker(state, activated=activated)) is wanted
