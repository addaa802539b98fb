"""A ledger cell's counts: copies and sums."""

from __future__ import annotations

from dataclasses import astuple

from stoker.domain.ledger import SCALAR_FIELDS, LedgerCounts


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
