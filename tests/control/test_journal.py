"""The replica's ring of recent events (the dashboard's "Recent events")."""

from __future__ import annotations

import itertools

from stoker.control.journal import EventKind, Journal


def test_the_ring_keeps_the_newest_events_only() -> None:
    ticks = itertools.count(100)
    journal = Journal(lambda: float(next(ticks)), capacity=3)
    for n in range(5):
        journal.record(EventKind.SPAWNED, pool="demo", worker=f"w-{n}")
    recent = journal.recent()
    assert [e.worker for e in recent] == ["w-4", "w-3", "w-2"]
    assert [e.seq for e in recent] == [5, 4, 3]
    assert recent[0].at == 104.0


def test_recent_after_a_seq_and_within_a_limit() -> None:
    journal = Journal(lambda: 0.0)
    for n in range(10):
        journal.record(EventKind.RETIRED, pool="demo", reason="ttl", detail=str(n))
    assert [e.seq for e in journal.recent(after=7)] == [10, 9, 8]
    assert [e.seq for e in journal.recent(limit=2)] == [10, 9]
    assert journal.recent(after=10) == []
