"""A ledger cell's counts: copies, sums, and what they cost."""

from __future__ import annotations

from dataclasses import astuple

import pytest

from stoker.domain.ledger import SCALAR_FIELDS, LedgerCounts, money
from stoker.domain.specs import CostSpec

#: A cpu-hour at 1, a GiB-hour at 0.1: a cpu/memory mix-up shows.
BY_RESOURCES = CostSpec(per_cpu_hour=1.0, per_gib_hour=0.1)


def _counts() -> LedgerCounts:
    counts = LedgerCounts()
    counts.add_time("warm", 30.0, 2.0, 4.0)
    counts.add_time("placeholder", 12.5, 2.0, 4.0)
    counts.add_ready(7.0)
    counts.add_claim("cold", 3.5)
    counts.add_failure(1.0)
    counts.spawns = 2
    return counts


def test_a_copy_is_equal_and_independent() -> None:
    counts = _counts()
    copy = counts.copy()
    assert copy == counts and astuple(copy) == astuple(counts)
    assert copy.ready_hist is not counts.ready_hist and copy.wait_hist is not counts.wait_hist
    copy.add_claim("warm", 0.1)
    copy.add_time("hot", 1.0, 1.0, 1.0)
    assert counts == _counts()


def test_merged_counts_add_up_field_by_field() -> None:
    total = _counts()
    total.merge(_counts())
    one = _counts()
    assert total.scalar_values() == tuple(2 * v for v in one.scalar_values())
    assert total.scalars() == dict(zip(SCALAR_FIELDS, total.scalar_values(), strict=True))
    assert total.ready_hist == [2 * n for n in one.ready_hist]
    assert total.wait_hist == [2 * n for n in one.wait_hist]
    assert isinstance(total.spawns, int) and total.spawns == 4


def test_headroom_is_priced_from_the_placeholders_own_requests() -> None:
    """A placeholder of 1.1 CPUs and 0.25 GiB makes room for 4 workers of 250m and 64 MiB:
    an hour of it holds 1.1 cpu-hours on its node, not 4 workers' 1.0. Headroom was priced
    at the workers' mix of the cell: at 1.0 CPU, and at nothing in a cell without worker
    time (an hour of a pool whose warm target is 0, which only its headroom costs)."""
    alone = LedgerCounts()
    # An hour of 4 worker slots; per slot-second a quarter of the placeholder's requests.
    alone.add_time("placeholder", 4 * 3600.0, 1.1 / 4, 0.25 / 4)
    worth = money(alone, BY_RESOURCES)
    assert worth["headroom_cost"] == pytest.approx(1.1 + 0.025)
    assert worth["total_cost"] == pytest.approx(1.1 + 0.025)
    assert worth["idle_warm_cost"] == 0.0
    # Kept apart from the workers' resource-seconds.
    assert (alone.placeholder_s, alone.cpu_s, alone.gib_s) == (4 * 3600.0, 0.0, 0.0)
    assert alone.placeholder_cpu_s == pytest.approx(1.1 * 3600)
    assert alone.placeholder_gib_s == pytest.approx(0.25 * 3600)

    beside = alone.copy()
    beside.add_time("warm", 3600.0, 0.25, 64 / 1024)
    worth = money(beside, BY_RESOURCES)
    assert worth["headroom_cost"] == pytest.approx(1.1 + 0.025)
    assert worth["idle_warm_cost"] == pytest.approx(0.25 + 0.1 * 64 / 1024)
    assert worth["total_cost"] == pytest.approx(1.1 + 0.025 + 0.25 + 0.1 * 64 / 1024)
    # By the worker-hour, a slot-hour is a worker-hour.
    by_worker = money(beside, CostSpec(per_worker_hour=2.0))
    assert by_worker["headroom_cost"] == pytest.approx(4 * 2.0)


def test_headroom_written_without_its_requests_is_priced_at_the_workers_mix() -> None:
    """Rows written before the placeholders' requests were kept hold slot-seconds only:
    priced, as then, at the cell's workers' resources."""
    old = LedgerCounts(placeholder_s=4 * 3600.0)
    old.add_time("warm", 3600.0, 0.25, 0.5)
    assert money(old, BY_RESOURCES)["headroom_cost"] == pytest.approx(4 * (0.25 + 0.05))
