"""PassFaults: what one pool's failing step of a pass leaves behind (counts, streaks)."""

from __future__ import annotations

import pytest

from stoker.control.faults import FAILING_AFTER, PassFaults
from stoker.control.journal import Journal
from stoker.control.metrics import Metrics
from stoker.domain.errors import StoreError


def faults() -> tuple[PassFaults, Metrics]:
    metrics = Metrics()
    return PassFaults("janitor", metrics, Journal(lambda: 0.0)), metrics


def failures(metrics: Metrics, pool: str) -> float:
    labels = {"pass": "janitor", "pool": pool}
    return metrics.registry.get_sample_value("stoker_pass_failures_total", labels) or 0.0


def run_pass(f: PassFaults, *failing: str, steps: int = 2) -> None:
    """One pass whose steps raise for the pools in `failing`."""
    f.begin()
    for _ in range(steps):
        for pool in ("a", "b"):
            with f.step(pool, "scale"):
                if pool in failing:
                    raise TypeError(f"{pool} is broken")
    f.end()


def test_a_pool_is_counted_once_per_pass_and_named_after_its_streak() -> None:
    f, metrics = faults()
    for n in range(1, FAILING_AFTER + 1):
        run_pass(f, "a")
        assert failures(metrics, "a") == n  # two failing steps, one count
        assert [x.pool for x in f.problems()] == (["a"] if n >= FAILING_AFTER else [])
    [problem] = f.problems()
    assert problem.in_a_row == FAILING_AFTER
    assert problem.detail == "janitor pass, scale: TypeError: a is broken"
    assert failures(metrics, "b") == 0


def test_a_pass_without_the_failure_ends_the_streak() -> None:
    f, _ = faults()
    for _ in range(FAILING_AFTER):
        run_pass(f, "a")
    run_pass(f)
    assert f.problems() == []
    run_pass(f, "a")
    assert f.failing(at_least=1)[0].passes == 1


def test_a_store_error_is_not_a_pools_fault() -> None:
    f, metrics = faults()
    f.begin()
    with pytest.raises(StoreError), f.step("a", "scale"):
        raise StoreError("database is locked")
    f.end()
    assert failures(metrics, "a") == 0 and f.failing(at_least=1) == []


def test_clear_forgets_the_streaks() -> None:
    f, _ = faults()
    for _ in range(FAILING_AFTER):
        run_pass(f, "a")
    f.clear()
    assert f.problems() == []
