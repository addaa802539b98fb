"""What each session felt: its claim attempts, its back-offs, and its time to a worker.

A claim attempt's latency is what the control plane did for one request; a user feels
the whole session: every attempt, every back-off between attempts, until a worker is
bound (or the client gives up). `SessionLog` keeps one record per attempt (the per-claim
log, `claims.jsonl` in the report) and one time-to-worker per session:

- a session that got a worker counts from its arrival to the bind, back-offs included;
- a session that never got one (every attempt failed) counts with the time it spent
  trying, and one still trying when the run ends with the time it has waited so far:
  both are lower bounds, so the quantiles are never flattered by leaving them out.

`waited_ge_claim_timeout` counts sessions whose time to a worker reached their claim
timeout (the point at which a client would have seen its first attempt fail): the
tenant's own `claim_timeout_s` when it sets one, else the pool's. A timeout of 0 (take a
free worker at once, or fail) is reached by the sessions whose first attempt did not bind.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The `q` quantile (0..1) by linear interpolation between closest ranks."""
    if not sorted_values:
        raise ValueError("no values")
    position = q * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def quantiles(values: Iterable[float]) -> dict[str, float | int] | None:
    """Count, p50, p90, p99 and max of `values` (None when there are none)."""
    ordered = sorted(values)
    if not ordered:
        return None
    return {
        "count": len(ordered),
        "p50": quantile(ordered, 0.50),
        "p90": quantile(ordered, 0.90),
        "p99": quantile(ordered, 0.99),
        "max": ordered[-1],
    }


@dataclass(frozen=True, slots=True)
class Attempt:
    """One claim attempt of a session, as the per-claim log holds it."""

    session: int
    org: str
    attempt: int
    replica: int
    #: Run seconds when the attempt was sent and when it was answered.
    start_s: float
    end_s: float
    #: `bound`, or the failure's reason (`timeout`, `pool_cap`, ...).
    outcome: str
    #: Where the worker came from when bound (`warm`, `reuse`, `cold`), else None.
    source: str | None
    #: The back-off slept after this attempt failed (0 when none followed).
    backoff_s: float

    def as_dict(self) -> dict[str, Any]:
        """One line of claims.jsonl."""
        return {
            "session": self.session,
            "org": self.org,
            "attempt": self.attempt,
            "replica": self.replica,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "wait_s": self.end_s - self.start_s,
            "outcome": self.outcome,
            "source": self.source,
            "backoff_s": self.backoff_s,
        }


@dataclass(slots=True)
class SessionLog:
    """Every attempt and every session's time to a worker, in arrival order."""

    attempts: list[Attempt] = field(default_factory=list)
    #: Seconds from arrival to a bound worker, per session that got one.
    bound_after_s: dict[int, float] = field(default_factory=dict)
    #: Seconds spent trying, per session whose every attempt failed.
    gave_up_after_s: dict[int, float] = field(default_factory=dict)
    #: Arrival time of sessions still without a worker and still trying.
    trying_since_s: dict[int, float] = field(default_factory=dict)
    #: The claim timeout of each session whose client sets its own (others: the pool's).
    timeouts: dict[int, float] = field(default_factory=dict)

    def arrived(self, session: int, now: float, timeout_s: float | None = None) -> None:
        """A session opened and starts claiming, with its own claim timeout if it has one."""
        self.trying_since_s[session] = now
        if timeout_s is not None:
            self.timeouts[session] = timeout_s

    def bound(self, session: int, now: float) -> None:
        """The session got a worker."""
        self.bound_after_s[session] = now - self.trying_since_s.pop(session, now)

    def gave_up(self, session: int, now: float) -> None:
        """Every attempt of the session failed."""
        self.gave_up_after_s[session] = now - self.trying_since_s.pop(session, now)

    def times_to_worker(self, now: float) -> list[float]:
        """Every session's time to a worker (lower bounds for the unserved ones)."""
        return list(self._by_session(now).values())

    def _by_session(self, now: float) -> dict[int, float]:
        waiting = {session: now - since for session, since in self.trying_since_s.items()}
        return {**self.bound_after_s, **self.gave_up_after_s, **waiting}

    def summary(self, now: float, claim_timeout_s: float) -> dict[str, Any]:
        """`sessions.time_to_worker_s` and its companions for summary.json;
        `claim_timeout_s` the pool's."""
        times = self._by_session(now)
        retried = {a.session for a in self.attempts if a.attempt > 0}
        at_once = bound_at_once(self.attempts)
        waited = sum(
            reached_timeout(t, self.timeouts.get(session, claim_timeout_s), session in at_once)
            for session, t in times.items()
        )
        return {
            "time_to_worker_s": quantiles(times.values()),
            "claim_timeout_s": claim_timeout_s,
            "waited_ge_claim_timeout": waited,
            "without_worker": len(self.gave_up_after_s) + len(self.trying_since_s),
            "still_trying": len(self.trying_since_s),
            "retried": len(retried),
        }


def bound_at_once(attempts: Iterable[Attempt]) -> set[int]:
    """The sessions whose first attempt bound a worker."""
    return {a.session for a in attempts if a.attempt == 0 and a.outcome == "bound"}


def reached_timeout(waited_s: float, timeout_s: float, bound_at_once: bool) -> bool:
    """Whether a session that waited `waited_s` for a worker reached its claim timeout;
    a timeout of 0 is reached by every session its first attempt did not serve (each
    waited at least 0 s)."""
    if timeout_s > 0:
        return waited_s >= timeout_s
    return not bound_at_once


DAY_S = 86_400.0


def per_day(
    attempts: Sequence[Attempt],
    samples: Sequence[dict[str, Any]],
    *,
    duration_s: float,
    claim_timeout_s: float,
    timeouts: Mapping[int, float] | None = None,
) -> list[dict[str, Any]]:
    """The run's figures day by day (run days of 24 h from the start; a last partial
    day counts too): claims bound and cold, failed attempts, the time to a worker of the
    sessions that arrived that day, and the node cost accrued that day. `timeouts`: the
    claim timeout of each session that sets its own (others: `claim_timeout_s`)."""
    days = max(1, math.ceil(duration_s / DAY_S - 1e-9))
    bound = [0] * days
    cold = [0] * days
    failed = [0] * days
    first: dict[int, float] = {}
    served: dict[int, float] = {}
    for a in attempts:
        day = min(days - 1, int(a.end_s // DAY_S))
        if a.outcome == "bound":
            bound[day] += 1
            cold[day] += a.source == "cold"
            served[a.session] = a.end_s
        else:
            failed[day] += 1
        first.setdefault(a.session, a.start_s)
    waits: list[list[float]] = [[] for _ in range(days)]
    reached = [0] * days
    at_once = bound_at_once(attempts)
    for session, start in first.items():
        end = served.get(session, duration_s)
        day = min(days - 1, int(start // DAY_S))
        waits[day].append(end - start)
        timeout = (timeouts or {}).get(session, claim_timeout_s)
        reached[day] += reached_timeout(end - start, timeout, session in at_once)
    cost = [0.0] * (days + 1)
    for row in samples:
        day = min(days, math.ceil(row["t_s"] / DAY_S - 1e-9))
        cost[day] = max(cost[day], row["cost_usd"])
    for day in range(1, days + 1):
        cost[day] = max(cost[day], cost[day - 1])
    return [
        {
            "day": day,
            "claims_bound": bound[day],
            "cold": cold[day],
            "cold_share": cold[day] / bound[day] if bound[day] else None,
            "failed_attempts": failed[day],
            "time_to_worker_s": quantiles(waits[day]),
            "waited_ge_claim_timeout": reached[day],
            "cost_usd": cost[day + 1] - cost[day],
        }
        for day in range(days)
    ]
