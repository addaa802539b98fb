"""This replica's recent events, kept in memory for the dashboard (docs/getting-started.md).

A bounded ring: spawns, retirements with their reasons, failures (spawns, activations,
durable writes, passes) and rollouts' steps, holds, pauses and verdicts, newest last. It
is what one replica saw since it started, not the fleet's history (the store keeps retired
rows, and the logs every change); it never grows past `capacity`, and recording costs one
append.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypedDict, Unpack

from stoker.domain.records import Worker


class EventKind(StrEnum):
    """What happened."""

    SPAWNED = "spawned"
    RETIRED = "retired"
    SPAWN_FAILED = "spawn_failed"
    ACTIVATION_FAILED = "activation_failed"
    PERSIST_FAILED = "persist_failed"
    PASS_FAILED = "pass_failed"
    #: A rollout's step took effect, waits for its workers, paused, or ended by a verdict
    #: (or an admin's action).
    ROLLOUT_STEP = "rollout_step"
    ROLLOUT_HELD = "rollout_held"
    ROLLOUT_PAUSED = "rollout_paused"
    ROLLOUT_RESUMED = "rollout_resumed"
    ROLLOUT_PROMOTED = "rollout_promoted"
    ROLLOUT_ROLLED_BACK = "rollout_rolled_back"
    ROLLOUT_ABORTED = "rollout_aborted"


class About(TypedDict, total=False):
    """What an event is about, each part when known (`Event`'s fields of that name)."""

    pool: str | None
    worker: str | None
    org: str | None
    reason: str | None
    detail: str | None


@dataclass(frozen=True, slots=True)
class Event:
    """One recorded event; `seq` grows by one per event of this replica."""

    seq: int
    at: float
    kind: EventKind
    pool: str | None = None
    worker: str | None = None
    org: str | None = None
    reason: str | None = None
    detail: str | None = None


class Journal:
    """The last `capacity` events of this replica."""

    def __init__(self, now: Callable[[], float], capacity: int = 500) -> None:
        self._now = now
        self._events: deque[Event] = deque(maxlen=capacity)
        self._seq = itertools.count(1)

    def record(self, kind: EventKind, **about: Unpack[About]) -> None:
        """Keep one event (the oldest goes once the ring is full)."""
        self._events.append(Event(next(self._seq), self._now(), kind, **about))

    def worker(self, kind: EventKind, worker: Worker, *, detail: str | None = None) -> None:
        """Keep one event about `worker` (its pool, org and retirement reason)."""
        self.record(
            kind,
            pool=worker.pool,
            worker=worker.id,
            org=worker.org,
            reason=worker.reason,
            detail=detail,
        )

    def recent(self, *, after: int = 0, limit: int = 100) -> list[Event]:
        """Up to `limit` events newer than `after` (a `seq`), newest first."""
        out: list[Event] = []
        for event in reversed(self._events):
            if event.seq <= after or len(out) >= limit:
                break
            out.append(event)
        return out
