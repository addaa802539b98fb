"""A pool's new-session rate by time of day and day of week, learned online (pure).

Claims are counted per hour. When an hour closes, its rate is folded into two buckets with
an exponentially weighted mean and variance: the hour of the week (168 buckets, Monday
00:00 UTC first) and the hour of a weekday or a weekend day (48 buckets), so that one
learned day already forecasts the next day of its kind, and a learned week forecasts each
day of its own. The forecast at a time is the finest bucket with history, interpolated
linearly between hour centres; its upper quantile adds the bucket's spread. A pool has at
most 216 buckets, whatever its history: the store keeps them (`ForecastBucket`), so a new
leader starts from what the last one learned.

`ForecastError` compares the claims of a recent window with what the forecast expected; while
they differ by more than a bound (and by more than Poisson noise), the forecast is set aside
and the pool is sized by the reactive rate alone.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from operator import itemgetter
from statistics import NormalDist
from typing import Protocol

from stoker.domain.records import ForecastBucket

HOUR_S = 3600.0
DAY_S = 86_400.0
WEEK_S = 7 * DAY_S
#: The epoch (1970-01-01) was a Thursday: hours to add so that Monday 00:00 is hour 0.
_EPOCH_HOUR_OF_WEEK = 3 * 24
WEEK, DAY = "week", "day"
#: Weight of a new hour in a bucket's mean and variance.
LEARNING_WEIGHT = 0.3
#: An hour is learned only when at least this share of it was observed.
MIN_COVERED = 0.5
#: Forecasts a forecaster keeps of the times it was asked (forgotten all at once beyond).
_MAX_READ = 256


def hour_of_week(t: float) -> int:
    """0-167: the hour of the week of wall time `t` (UTC), Monday 00:00 = 0."""
    return (int(t // HOUR_S) + _EPOCH_HOUR_OF_WEEK) % 168


def buckets_of(t: float) -> tuple[tuple[str, int], tuple[str, int]]:
    """The (level, bucket) pairs that the hour holding `t` belongs to."""
    how = hour_of_week(t)
    day, hour = divmod(how, 24)
    return (WEEK, how), (DAY, hour + (24 if day >= 5 else 0))


@dataclass(frozen=True, slots=True)
class Outlook:
    """The forecast rate at one time (claims per second) and its upper quantile."""

    mean: float
    upper: float


class Learned(Protocol):
    """A learned bucket: the mean and variance of a rate (claims per second)."""

    @property
    def mean(self) -> float: ...
    @property
    def var(self) -> float: ...


def interpolate(
    t: float, bucket_at: Callable[[float], Learned | None], quantile: float
) -> Outlook | None:
    """The rate at `t` from the buckets of the hours around it (`bucket_at(time)`),
    interpolated linearly between hour centres; None when neither hour has one."""
    left = math.floor((t - HOUR_S / 2) / HOUR_S)
    # The weighted sums of the hours with a bucket (added as `sum` would add them).
    total = mean = var = 0.0
    found = False
    for index in (left, left + 1):
        bucket = bucket_at(index * HOUR_S)
        weight = 1 - abs(t - (index * HOUR_S + HOUR_S / 2)) / HOUR_S
        if bucket is not None and weight > 0:
            found = True
            total += weight
            mean += weight * bucket.mean
            var += weight * bucket.var
    if not found:
        return None
    mean /= total
    var /= total
    z = normal_quantile(quantile)
    return Outlook(mean=mean, upper=mean + z * math.sqrt(max(0.0, var)))


@functools.lru_cache(maxsize=64)
def normal_quantile(quantile: float) -> float:
    """The standard normal distribution's `quantile` (a pool's is one setting: worked out
    once, not at every interpolation)."""
    return NormalDist().inv_cdf(quantile)


def folded(mean: float, var: float, rate: float) -> tuple[float, float]:
    """A bucket's mean and variance after one more hour at `rate` (exponentially weighted)."""
    delta = rate - mean
    return (
        mean + LEARNING_WEIGHT * delta,
        (1 - LEARNING_WEIGHT) * (var + LEARNING_WEIGHT * delta * delta),
    )


class Forecaster:
    """One pool's buckets and the hour being counted."""

    def __init__(self, pool: str, buckets: Iterable[ForecastBucket] = ()) -> None:
        self.pool = pool
        self._buckets: dict[tuple[str, int], ForecastBucket] = {
            (b.level, b.bucket): b for b in buckets if b.pool == pool
        }
        #: The hour being counted: its index, claims so far, seconds covered.
        self._hour: tuple[int, int, float] | None = None
        self._last: float | None = None
        #: Forecasts read since the buckets last changed, by (time, quantile): a pass reads
        #: the same times several times over (now, and each hour centre ahead).
        self._read: dict[tuple[float, float], Outlook | None] = {}

    @property
    def buckets(self) -> list[ForecastBucket]:
        """Every bucket with history."""
        return sorted(self._buckets.values(), key=lambda b: (b.level, b.bucket))

    def has_history(self) -> bool:
        """Whether any hour was learned."""
        return bool(self._buckets)

    def observe(self, now: float, claims: int) -> list[ForecastBucket]:
        """Count `claims` that arrived since the previous call; when an hour closed, learn it
        and return the buckets it changed (to be stored)."""
        index = int(now // HOUR_S)
        last, self._last = self._last, now
        if self._hour is None or last is None:
            self._hour = (index, 0, 0.0)
            return []
        hour, count, covered = self._hour
        if index == hour:
            self._hour = (hour, count + claims, covered + now - last)
            return []
        # The claims of a pass that spans the hour's end count in the new hour.
        covered += max(0.0, (hour + 1) * HOUR_S - last)
        self._hour = (index, claims, now - index * HOUR_S)
        if covered < MIN_COVERED * HOUR_S:
            return []
        return self._learn(hour * HOUR_S, count / covered, covered, now)

    def _learn(self, start: float, rate: float, covered: float, now: float) -> list[ForecastBucket]:
        changed = []
        for level, bucket in buckets_of(start):
            old = self._buckets.get((level, bucket))
            if old is None:
                # The first hour: the variance of a Poisson rate measured over `covered`.
                new = ForecastBucket(self.pool, level, bucket, rate, rate / covered, 1, now)
            else:
                mean, var = folded(old.mean, old.var, rate)
                new = replace(old, mean=mean, var=var, seen=old.seen + 1, updated_at=now)
            self._buckets[(level, bucket)] = new
            changed.append(new)
        self._read.clear()
        return changed

    def _bucket(self, t: float) -> ForecastBucket | None:
        week, day = buckets_of(t)
        return self._buckets.get(week) or self._buckets.get(day)

    def at(self, t: float, quantile: float) -> Outlook | None:
        """The forecast rate at `t`, interpolated between hour centres; None without history."""
        key = (t, quantile)
        read = self._read
        if key in read:
            return read[key]
        if len(read) >= _MAX_READ:
            read.clear()
        outlook = read[key] = interpolate(t, self._bucket, quantile)
        return outlook

    def peak(self, start: float, end: float, quantile: float) -> Outlook | None:
        """The highest forecast over [start, end], read at both ends and each hour centre
        between them (the forecast is linear in between)."""
        times = [start, end]
        centre = math.floor((start - HOUR_S / 2) / HOUR_S) * HOUR_S + HOUR_S * 1.5
        while centre < end:
            times.append(centre)
            centre += HOUR_S
        outlooks = [o for t in times if (o := self.at(t, quantile)) is not None]
        if not outlooks:
            return None
        return max(outlooks, key=lambda o: (o.upper, o.mean))


_EXPECTED = itemgetter(2)


class ForecastError:
    """Claims seen against claims forecast over a sliding window."""

    def __init__(self) -> None:
        self._passes: deque[tuple[float, int, float]] = deque()
        #: The claims of those passes, summed as they come and go (whole numbers: exact).
        self._claims = 0
        #: The last answer of `relative` and what it was asked: a pass asks twice (the
        #: error, then `beyond`), and the sums cover an hour of passes.
        self._last: tuple[float, float, tuple[float, float, float]] | None = None

    def add(self, now: float, claims: int, expected: float) -> None:
        """One pass: the claims counted and what the forecast expected over the same time."""
        self._passes.append((now, claims, expected))
        self._claims += claims
        self._last = None

    def relative(self, now: float, window_s: float) -> tuple[float, float, float]:
        """(relative error, claims seen, claims expected) over the last `window_s`."""
        if self._last is not None and self._last[:2] == (now, window_s):
            return self._last[2]
        while self._passes and self._passes[0][0] <= now - window_s:
            self._claims -= self._passes.popleft()[1]
        seen = float(self._claims)
        # An hour of passes, summed in C (the same additions, in the same order).
        expected = sum(map(_EXPECTED, self._passes))
        answer = (seen - expected) / max(expected, 1.0), seen, expected
        self._last = (now, window_s, answer)
        return answer

    def beyond(self, now: float, window_s: float, bound: float) -> bool:
        """Whether the forecast is off by more than `bound` (relative) and by more than
        three standard deviations of Poisson noise."""
        error, seen, expected = self.relative(now, window_s)
        return abs(error) > bound and abs(seen - expected) > 3 * math.sqrt(expected + 1)
