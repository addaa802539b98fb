"""Each pool's busiest orgs' new-session rates by hour of the day, learned online (pure).

When an hour closes, the leader counts each org's claims in it (every claim the store
created in that hour, whichever replica served it and whoever led meanwhile) and folds each
tracked org's rate into the bucket of that hour: the hour of a weekday (0-23) or of a
weekend day (24-47), an exponentially weighted mean and variance as the pool's forecast
(`policy.forecast`). An org has fewer claims than its pool, so it gets the 48 coarse
buckets only, not the 168 hours of the week.

The size is bounded: at most `most` orgs per pool (`demand.org_forecast_orgs`), 48 rows
each. Orgs enter by volume: while there is room, every org that claimed; once full, an org
whose claims in the hour exceed `ADMIT_FACTOR` times the quietest tracked org's mean hourly
rate takes its place, and that org's rows are dropped. An org that stops claiming learns
hours of nothing, its volume falls, and a busier newcomer evicts it.

An org's forecast is used only with enough history: `MIN_HOURS` learned hours (a day).
Before that, and for an org not tracked, there is none (`None`), and whatever uses it
behaves as without it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from stoker.domain.records import OrgForecastBucket
from stoker.policy.forecast import HOUR_S, Outlook, buckets_of, folded, interpolate

#: Learned hours an org needs before its forecast is used: one whole day.
MIN_HOURS = 24
#: Once a pool tracks its most orgs, a newcomer's claims in one hour must exceed this many
#: times the quietest tracked org's mean hourly claims: one busy hour of a small org does
#: not evict a steady one.
ADMIT_FACTOR = 2.0


def day_bucket(t: float) -> int:
    """0-47: the hour of a weekday (0-23) or of a weekend day (24-47) holding `t` (UTC)."""
    return buckets_of(t)[1][1]


def return_chance(rate: float, seconds: float) -> float:
    """The chance of at least one claim within `seconds` at a Poisson `rate` (per second)."""
    return 1.0 - math.exp(-max(0.0, rate) * max(0.0, seconds))


@dataclass(frozen=True, slots=True)
class Learned:
    """What one closed hour changed: buckets to write, orgs whose rows to delete."""

    buckets: list[OrgForecastBucket]
    dropped: list[str]


class OrgForecasts:
    """One pool's tracked orgs and their buckets, and the last hour learned."""

    def __init__(self, pool: str, most: int, buckets: Iterable[OrgForecastBucket] = ()) -> None:
        self.pool = pool
        self.most = most
        self._orgs: dict[str, dict[int, OrgForecastBucket]] = {}
        for b in buckets:
            if b.pool == pool:
                self._orgs.setdefault(b.org, {})[b.bucket] = b
        #: The index of the last hour learned (from the stored buckets: a new leader goes
        #: on from there), None before any.
        stamps = [b.updated_at for org in self._orgs.values() for b in org.values()]
        self.last_hour: int | None = int(max(stamps) // HOUR_S) - 1 if stamps else None
        #: `forecast_orgs`, kept until the next hour is learned: it changes only then, and
        #: the janitor asks every pass.
        self._ready: list[str] | None = None
        #: Each org's learned hours (the sum of its buckets' `seen`), kept as it learns:
        #: every forecast of an org asks.
        self._learned: dict[str, int] = {
            org: sum(b.seen for b in buckets.values()) for org, buckets in self._orgs.items()
        }

    @property
    def tracked(self) -> int:
        """Orgs tracked now."""
        return len(self._orgs)

    def forecast_orgs(self) -> list[str]:
        """Tracked orgs with enough history for their forecast to be used, busiest first."""
        if self._ready is None:
            ready = [org for org in self._orgs if self._hours(org) >= MIN_HOURS]
            self._ready = sorted(ready, key=lambda org: (-self.volume(org), org))
        return list(self._ready)

    def volume(self, org: str) -> float:
        """The org's mean hourly claims over its buckets (0 when untracked)."""
        buckets = self._orgs.get(org)
        if not buckets:
            return 0.0
        return HOUR_S * sum(b.mean for b in buckets.values()) / len(buckets)

    def _hours(self, org: str) -> int:
        return self._learned.get(org, 0)

    def due(self, now: float) -> int | None:
        """The closed hour to learn now (the one before the current), or None when it was
        learned already."""
        hour = int(now // HOUR_S) - 1
        return hour if self.last_hour is None or hour > self.last_hour else None

    def learn(self, hour: int, claims: Mapping[str, int], now: float) -> Learned:
        """Fold the claims each org made in hour `hour` in (orgs without claims learn a rate
        of 0), admitting and evicting orgs by volume."""
        self.last_hour = hour
        self._ready = None
        dropped = self._admit(claims)
        bucket = day_bucket(hour * HOUR_S)
        changed = []
        for org, buckets in self._orgs.items():
            rate = claims.get(org, 0) / HOUR_S
            old = buckets.get(bucket)
            if old is None:
                # The first hour: the variance of a Poisson rate measured over an hour.
                new = OrgForecastBucket(self.pool, org, bucket, rate, rate / HOUR_S, 1, now)
            else:
                mean, var = folded(old.mean, old.var, rate)
                new = OrgForecastBucket(self.pool, org, bucket, mean, var, old.seen + 1, now)
            buckets[bucket] = new
            self._learned[org] = self._learned.get(org, 0) + new.seen - (old.seen if old else 0)
            changed.append(new)
        return Learned(buckets=changed, dropped=dropped)

    def _admit(self, claims: Mapping[str, int]) -> list[str]:
        """Track newcomers by their claims, busiest first: into free room, else in place of
        the quietest tracked org when `ADMIT_FACTOR` times busier. The orgs evicted."""
        newcomers = sorted(
            ((n, org) for org, n in claims.items() if n > 0 and org not in self._orgs),
            key=lambda item: (-item[0], item[1]),
        )
        dropped: list[str] = []
        admitted: set[str] = set()
        for n, org in newcomers:
            if len(self._orgs) >= self.most:
                settled = (o for o in self._orgs if o not in admitted)
                quietest = min(settled, key=lambda o: (self.volume(o), o), default=None)
                if quietest is None or n <= ADMIT_FACTOR * self.volume(quietest):
                    break  # the rest are quieter still
                del self._orgs[quietest]
                del self._learned[quietest]
                dropped.append(quietest)
            self._orgs[org] = {}
            self._learned[org] = 0
            admitted.add(org)
        return dropped

    def at(self, org: str, t: float, quantile: float) -> Outlook | None:
        """The org's forecast rate at `t`; None without enough history."""
        buckets = self._orgs.get(org)
        if buckets is None or self._hours(org) < MIN_HOURS:
            return None
        return interpolate(t, lambda at: buckets.get(day_bucket(at)), quantile)

    def chance(self, org: str, start: float, end: float, quantile: float) -> float | None:
        """The chance that `org` claims within [start, end], from its forecast's upper
        quantile (the larger at either end); None without enough history."""
        rates = [self.at(org, t, quantile) for t in (start, end)]
        known = [o.upper for o in rates if o is not None]
        if not known:
            return None
        return return_chance(max(known), end - start)
