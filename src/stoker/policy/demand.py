"""The demand signal (pure): every replica's counters summed per pool, turned into a rate,
and the rate turned into a number of warm workers.

Each replica publishes, per pool, cumulative counts of the claims that wanted a neutral
worker (every claim not served by reuse), of misses, and the number of claims waiting now.
The leader turns the counters into what is new since its last pass (`DemandLedger`), so a
claim counts in exactly one pass. `RateWindow` keeps those counts over a stable window and
a short panic window (the Knative autoscaler's idea: the panic rate wins when it is at least
`panic_ratio` times the stable one), and `warm_for_rate` sizes the warm pool so that a
claim finds a warm worker with a target probability, from the claims that arrive while one
worker is replaced (Poisson(rate x replacement time)).
The docs (docs/scaling.md) justify the defaults.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import NormalDist
from typing import NamedTuple

from stoker.domain.records import DemandRecord

#: Above this mean a Poisson quantile is taken from the normal approximation.
_NORMAL_ABOVE = 500.0


class SeenDemand(NamedTuple):
    """What one pass learns of a pool from every replica's rows: claims that wanted a
    neutral worker since the last pass (served warm or cold), misses since the last pass,
    and claims queued for a warm worker now on replicas whose row is fresh."""

    claims: int = 0
    misses: int = 0
    waiting: int = 0


class DemandLedger:
    """Remembers the counters it has seen; `observe` returns what is new plus what waits."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], tuple[int, int]] = {}
        self._last_pass: float | None = None

    def observe(
        self, rows: Iterable[DemandRecord], *, now: float, fresh_after: float
    ) -> dict[str, SeenDemand]:
        """Per pool: claims and misses since the last call, plus claims waiting on replicas
        whose row is younger than `fresh_after` (a dead replica's queue is not demand)."""
        claims: dict[str, int] = defaultdict(int)
        misses: dict[str, int] = defaultdict(int)
        waiting: dict[str, int] = defaultdict(int)
        for row in rows:
            key = (row.pool, row.instance)
            before = self._seen.get(key)
            self._seen[key] = (row.misses, row.claims)
            if before is not None:
                misses[row.pool] += max(0, row.misses - before[0])
                claims[row.pool] += max(0, row.claims - before[1])
            elif self._last_pass is not None and row.updated_at >= self._last_pass:
                # A replica that appeared since the last pass: all its counts are new.
                misses[row.pool] += row.misses
                claims[row.pool] += row.claims
            else:
                # A ledger that starts (a new leader) takes existing counters as its
                # baseline; the pool is still known to have rows.
                misses[row.pool] += 0
            if row.updated_at >= fresh_after:
                waiting[row.pool] += row.waiting
        self._last_pass = now
        return {
            pool: SeenDemand(claims=claims[pool], misses=misses[pool], waiting=waiting[pool])
            for pool in misses
        }

    def demand(
        self, rows: Iterable[DemandRecord], *, now: float, fresh_after: float
    ) -> dict[str, int]:
        """Demand per pool as misses since the last call plus claims waiting (`observe`)."""
        seen = self.observe(rows, now=now, fresh_after=fresh_after)
        return {pool: d.misses + d.waiting for pool, d in seen.items()}


@dataclass(frozen=True, slots=True)
class Rate:
    """A pool's claim rate (claims per second) over the stable and the panic window."""

    stable: float = 0.0
    panic: float = 0.0
    #: Whether the panic rate won (it is at least `panic_ratio` times the stable one).
    panicking: bool = False

    @property
    def value(self) -> float:
        """The rate the pool is sized for: the panic rate while it wins, else the stable."""
        return self.panic if self.panicking else self.stable


class RateWindow:
    """Claims counted per pass, kept for the stable window: the rate over either window.

    A window younger than its length (a new leader) is divided by the time it covers, but by
    no less than the panic window, so that one early claim is not read as a storm.
    """

    def __init__(self) -> None:
        self._counts: deque[tuple[float, int]] = deque()
        self._since: float | None = None

    def add(self, now: float, claims: int) -> None:
        """Count `claims` that arrived since the previous `add` (the first sets the start)."""
        if self._since is None:
            self._since = now
            return
        if claims > 0:
            self._counts.append((now, claims))

    def rate(self, now: float, *, stable_s: float, panic_s: float, panic_ratio: float) -> Rate:
        """The stable and panic rates at `now`, and which one wins."""
        while self._counts and self._counts[0][0] <= now - max(stable_s, panic_s):
            self._counts.popleft()
        if self._since is None:
            return Rate()
        covered = now - self._since
        stable = self._over(now, stable_s, covered, floor=panic_s)
        panic = self._over(now, panic_s, covered, floor=panic_s)
        return Rate(
            stable=stable, panic=panic, panicking=panic > 0 and panic >= panic_ratio * stable
        )

    def _over(self, now: float, window_s: float, covered: float, *, floor: float) -> float:
        span = max(min(window_s, covered), min(floor, window_s))
        if span <= 0:
            return 0.0
        return sum(n for t, n in self._counts if t > now - window_s) / span


class ReadyTime:
    """A running estimate of the spawn-to-ready time of one pool: an exponentially weighted
    mean of the observed durations, seeded with a default until the first one is seen."""

    def __init__(self, seed_s: float, *, weight: float = 0.2) -> None:
        self._value = seed_s
        self._weight = weight
        self.observed = 0

    @property
    def seconds(self) -> float:
        """The estimate now."""
        return self._value

    def observe(self, seconds: float) -> None:
        """Fold one spawn-to-ready duration in (the first replaces the seed)."""
        seconds = max(0.0, seconds)
        if self.observed == 0:
            self._value = seconds
        else:
            self._value += self._weight * (seconds - self._value)
        self.observed += 1


def poisson_quantile(mean: float, quantile: float) -> int:
    """The smallest k with P(Poisson(mean) <= k) >= quantile."""
    if mean <= 0:
        return 0
    quantile = min(max(quantile, 0.0), 1.0 - 1e-12)
    if mean > _NORMAL_ABOVE:
        z = NormalDist().inv_cdf(quantile)
        return max(0, math.ceil(mean + z * math.sqrt(mean) - 0.5))
    # The terms in log space: exp(-mean) underflows long before the loop's bound.
    log_term = -mean
    total = math.exp(log_term)
    k = 0
    while total < quantile:
        k += 1
        log_term += math.log(mean) - math.log(k)
        total += math.exp(log_term)
    return k


def warm_for_rate(rate: float, replace_s: float, quantile: float) -> int:
    """Warm workers such that a claim finds one with probability `quantile`.

    With k warm and each claim replaced within `replace_s`, a claim finds none when k or
    more claims came within the last replacement time: k is the smallest with
    P(Poisson(rate x replace_s) >= k) <= 1 - quantile, the quantile plus one.
    """
    mean = rate * max(0.0, replace_s)
    return poisson_quantile(mean, quantile) + 1 if mean > 0 else 0
