"""The one mapping of an API server's HTTP status to the ClusterAPI port's errors."""

from __future__ import annotations

import pytest

from stoker.ports.cluster import (
    ClusterError,
    ClusterUnavailable,
    Conflict,
    Forbidden,
    Gone,
    Invalid,
    ObjectNotFound,
    Throttled,
    error_for_status,
)


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (404, ObjectNotFound),
        (409, Conflict),
        (410, Gone),
        (429, Throttled),
        (400, Invalid),
        (422, Invalid),
        (401, Forbidden),
        (403, Forbidden),
        (500, ClusterUnavailable),
        (503, ClusterUnavailable),
        (418, ClusterError),
    ],
)
def test_each_status_maps_to_its_error(status: int, error: type[ClusterError]) -> None:
    mapped = error_for_status(status, "create pod: refused", retry_after=2.0)
    assert type(mapped) is error
    assert mapped.status == status
    assert str(mapped) == "create pod: refused"


def test_only_a_throttle_carries_the_retry_after() -> None:
    throttled = error_for_status(429, "slow down", retry_after=2.0)
    assert isinstance(throttled, Throttled) and throttled.retry_after == 2.0
    assert not hasattr(error_for_status(503, "busy", retry_after=2.0), "retry_after")
