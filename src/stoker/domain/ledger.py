"""The ledger: what warmth costs and what it buys, per pool, revision, org and hour
(docs/warmth.md), and the claim log a backtest replays (docs/claim-log.md).

Pure: the counts of one hour's cell, how a span of worker time splits over hours, a
template's resources, prices, and the summary a reader makes of every replica's cells.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from fractions import Fraction
from operator import attrgetter
from typing import Any

from stoker.domain.specs import CostSpec, PodTemplate, ProcessTemplate, RuntimeTemplate

HOUR_S = 3600.0
#: Upper bounds (seconds) of the spawn-to-ready histogram; the last bucket is open.
SPAWN_BUCKETS: tuple[float, ...] = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: Upper bounds (seconds) of the claim-wait histogram; the last bucket is open.
WAIT_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0)
#: The states worker time is kept in (`starting`: spawning, reserved and activating).
TIME_STATES = ("warm", "hot", "hot_idle", "starting", "draining", "placeholder")
#: The sources a claim is served from.
SOURCES = ("reuse", "warm", "cold")
#: How a claim in the log ended (or that it has not yet: `open`).
OUTCOMES = ("released", "expired", "failed", "no_capacity", "org_cap", "pool_cap", "open")
#: The keys of a claim's export form (`ClaimLogEntry.export`), exactly.
EXPORT_KEYS = frozenset(
    {"at", "pool", "org", "mode", "source", "wait_s", "held_s", "outcome", "revision"}
)
#: Default retention of the ledger and the claim log: 35 days.
DEFAULT_RETENTION_S = 35 * 86400.0


def hour_of(t: float) -> int:
    """The start (unix seconds) of the hour `t` falls in."""
    return int(t // HOUR_S) * int(HOUR_S)


def split_hours(start: float, end: float) -> list[tuple[int, float]]:
    """The span [start, end) as (hour, seconds in it), in order; empty when end <= start."""
    spans: list[tuple[int, float]] = []
    t = start
    while t < end:
        hour = hour_of(t)
        stop = min(end, hour + HOUR_S)
        spans.append((hour, stop - t))
        t = stop
    return spans


def bucket_of(bounds: tuple[float, ...], value: float) -> int:
    """The index of `value`'s bucket: the first bound it does not exceed (last: open)."""
    return bisect.bisect_left(bounds, value)


_SCALES: dict[str, Fraction] = {
    **{
        s: Fraction(2) ** (10 * (i + 1)) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))
    },
    "m": Fraction(1, 1000),
    **{s: Fraction(10) ** (3 * (i + 1)) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
}


def _quantity(text: str) -> float:
    """A Kubernetes quantity ("500m", "1.5Gi", "2") as a number (0 when unreadable: the
    config refuses those before they get here)."""
    value = text.strip()
    scale = Fraction(1)
    for suffix in sorted(_SCALES, key=len, reverse=True):
        if value.endswith(suffix):
            value, scale = value[: -len(suffix)], _SCALES[suffix]
            break
    try:
        return float(Fraction(value) * scale)
    except (ValueError, ZeroDivisionError):
        return 0.0


def resources_of(template: RuntimeTemplate) -> tuple[float, float]:
    """(cpus, GiB) one worker of `template` holds: a pod's requests, a process's
    `memory_mb` (and no cpu: a local process is not given a share)."""
    if isinstance(template, PodTemplate):
        return _quantity(template.cpu), _quantity(template.memory) / 2**30
    assert isinstance(template, ProcessTemplate)
    return 0.0, template.memory_mb / 1024


@dataclass(frozen=True, slots=True)
class LedgerKey:
    """One cell of the ledger: a pool's revision, an org ("" for neutral workers) and an
    hour (its start in unix seconds)."""

    pool: str
    revision: str
    org: str
    hour: int


def _zeros(n: int) -> list[int]:
    return [0] * n


@dataclass(slots=True)
class LedgerCounts:
    """What one cell counts. Seconds are worker-seconds in each state; `cpu_s` and `gib_s`
    the resource-seconds of every state but `placeholder`; `placeholder_cpu_s` and
    `placeholder_gib_s` those of the placeholders (their own requests, which need not be
    a whole number of workers')."""

    warm_s: float = 0.0
    hot_s: float = 0.0
    hot_idle_s: float = 0.0
    starting_s: float = 0.0
    draining_s: float = 0.0
    placeholder_s: float = 0.0
    cpu_s: float = 0.0
    gib_s: float = 0.0
    placeholder_cpu_s: float = 0.0
    placeholder_gib_s: float = 0.0
    spawns: int = 0
    ready: int = 0
    ready_sum_s: float = 0.0
    ready_hist: list[int] = field(default_factory=lambda: _zeros(len(SPAWN_BUCKETS) + 1))
    claims_reuse: int = 0
    claims_warm: int = 0
    claims_cold: int = 0
    wait_reuse_s: float = 0.0
    wait_warm_s: float = 0.0
    wait_cold_s: float = 0.0
    wait_hist: list[int] = field(default_factory=lambda: _zeros(len(WAIT_BUCKETS) + 1))
    failed: int = 0
    failed_wait_s: float = 0.0

    def add_time(self, state: str, seconds: float, cpus: float, gib: float) -> None:
        """`seconds` of one worker in `state` (one of `TIME_STATES`) holding `cpus` and
        `gib`; of a placeholder, worker-slot seconds and the resources per slot."""
        name = _TIME_FIELD[state]
        setattr(self, name, getattr(self, name) + seconds)
        if state != "placeholder":
            self.cpu_s += seconds * cpus
            self.gib_s += seconds * gib
        else:
            self.placeholder_cpu_s += seconds * cpus
            self.placeholder_gib_s += seconds * gib

    def add_ready(self, seconds: float) -> None:
        """One spawn that got ready `seconds` after it started."""
        self.ready += 1
        self.ready_sum_s += seconds
        self.ready_hist[bucket_of(SPAWN_BUCKETS, seconds)] += 1

    def add_claim(self, source: str, wait_s: float) -> None:
        """One claim bound from `source` after waiting `wait_s`."""
        setattr(self, f"claims_{source}", getattr(self, f"claims_{source}") + 1)
        setattr(self, f"wait_{source}_s", getattr(self, f"wait_{source}_s") + wait_s)
        self.wait_hist[bucket_of(WAIT_BUCKETS, wait_s)] += 1

    def add_failure(self, wait_s: float) -> None:
        """One claim that got no worker, after waiting `wait_s`."""
        self.failed += 1
        self.failed_wait_s += wait_s

    def merge(self, other: LedgerCounts) -> None:
        """Add `other`'s counts to these."""
        for name in SCALAR_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in _HISTS:
            mine = getattr(self, name)
            for i, n in enumerate(getattr(other, name)[: len(mine)]):
                mine[i] += n

    def copy(self) -> LedgerCounts:
        """An independent copy (a flush copies every cell it writes)."""
        out = LedgerCounts(ready_hist=list(self.ready_hist), wait_hist=list(self.wait_hist))
        for name, value in zip(SCALAR_FIELDS, self.scalar_values(), strict=True):
            setattr(out, name, value)
        return out

    def scalars(self) -> dict[str, float]:
        """Every count but the histograms, by name."""
        return dict(zip(SCALAR_FIELDS, self.scalar_values(), strict=True))

    def scalar_values(self) -> tuple[float, ...]:
        """Every count but the histograms, in `SCALAR_FIELDS` order (a store's columns)."""
        values: tuple[float, ...] = _SCALAR_VALUES(self)
        return values

    def hists(self) -> dict[str, list[int]]:
        """The histograms, by name."""
        return {"ready_hist": list(self.ready_hist), "wait_hist": list(self.wait_hist)}

    @classmethod
    def from_parts(cls, scalars: Mapping[str, Any], hists: Mapping[str, Any]) -> LedgerCounts:
        """The counts `scalars` and `hists` wrote (unknown names ignored)."""
        out = cls()
        for name in SCALAR_FIELDS:
            if name in scalars and scalars[name] is not None:
                kind = type(getattr(out, name))
                setattr(out, name, kind(scalars[name]))
        for name in _HISTS:
            stored = list(hists.get(name) or [])
            mine = getattr(out, name)
            for i, n in enumerate(stored[: len(mine)]):
                mine[i] = int(n)
        return out


_HISTS = ("ready_hist", "wait_hist")
#: Each time state's field (`add_time` runs for every open span at every flush).
_TIME_FIELD = {state: f"{state}_s" for state in TIME_STATES}
#: The scalar counts, in the store's column order.
SCALAR_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(LedgerCounts) if f.name not in _HISTS)
#: The scalar counts of a cell, in `SCALAR_FIELDS` order, in one call (a flush writes
#: every cell that changed, each replica every minute).
_SCALAR_VALUES = attrgetter(*SCALAR_FIELDS)
#: The scalar counts that are whole numbers.
INT_FIELDS = frozenset({"spawns", "ready", "claims_reuse", "claims_warm", "claims_cold", "failed"})


@dataclass(frozen=True, slots=True)
class ClaimLogEntry:
    """One claim as the log keeps it (docs/claim-log.md): no config, no token."""

    #: The claim's id; read back from an export (which has no ids), where it was read.
    id: str
    at: float
    pool: str
    org: str
    mode: str
    source: str | None
    wait_s: float
    held_s: float | None
    outcome: str
    revision: str | None

    def export(self) -> dict[str, Any]:
        """The fixed export form: one JSON object of a JSON-lines export."""
        return {
            "at": self.at,
            "pool": self.pool,
            "org": self.org,
            "mode": self.mode,
            "source": self.source,
            "wait_s": self.wait_s,
            "held_s": self.held_s,
            "outcome": self.outcome,
            "revision": self.revision,
        }


@dataclass(frozen=True, slots=True)
class ClaimEnding:
    """How a bound claim ended, for its log row (written by whichever replica ended it).
    The rest of the row, in case its arrival is not written yet: bound at `bound_at`."""

    id: str
    pool: str
    org: str
    mode: str
    source: str
    bound_at: float
    held_s: float
    outcome: str


def summed(
    rows: Iterable[tuple[LedgerKey, LedgerCounts]], by: str | None
) -> dict[str, LedgerCounts]:
    """Every replica's cells summed per hour and group: "hour|group" -> counts, where the
    group is the org or the revision (`by`), or "" (`by` None)."""
    out: dict[str, LedgerCounts] = {}
    for key, counts in rows:
        group = "" if by is None else (key.org if by == "org" else key.revision)
        slot = out.setdefault(f"{key.hour}|{group}", LedgerCounts())
        slot.merge(counts)
    return out


def money(
    counts: LedgerCounts, cost: CostSpec | None, *, mean_ready_s: float | None = None
) -> dict[str, float | None]:
    """What the counts read in money (None without prices): the idle warm, idle parked
    (hot_idle) and headroom (placeholder) cost, the cost of all worker time, and the
    seconds of cold start the claims served warm or by reuse did not wait, at
    `mean_ready_s` (the pool's mean over the whole window) or else the counts' own mean."""
    worker_s = counts.warm_s + counts.hot_s + counts.hot_idle_s + counts.starting_s
    worker_s += counts.draining_s
    mean_ready = counts.ready_sum_s / counts.ready if counts.ready else None
    at = mean_ready_s if mean_ready_s is not None else mean_ready
    avoided = None
    if at is not None:
        avoided = (counts.claims_warm + counts.claims_reuse) * at
    out: dict[str, float | None] = {
        "mean_ready_s": mean_ready,
        "cold_start_s_avoided": avoided,
        "idle_warm_cost": None,
        "idle_parked_cost": None,
        "headroom_cost": None,
        "total_cost": None,
    }
    if cost is None or (worker_s <= 0 and counts.placeholder_s <= 0):
        if cost is not None:
            out.update(idle_warm_cost=0.0, idle_parked_cost=0.0, headroom_cost=0.0, total_cost=0.0)
        return out
    # Resource-seconds per worker-second, the pool's mix in this cell.
    cpus = counts.cpu_s / worker_s if worker_s else 0.0
    gib = counts.gib_s / worker_s if worker_s else 0.0

    def price(seconds: float) -> float:
        return cost.of(seconds, seconds * cpus, seconds * gib)

    if counts.placeholder_cpu_s > 0 or counts.placeholder_gib_s > 0:
        # What the placeholders hold on their nodes: their own requests.
        headroom = cost.of(counts.placeholder_s, counts.placeholder_cpu_s, counts.placeholder_gib_s)
    else:
        # Rows written before the placeholders' requests were kept: as a worker's.
        headroom = price(counts.placeholder_s)
    total = cost.of(worker_s, counts.cpu_s, counts.gib_s) + headroom
    out.update(
        idle_warm_cost=price(counts.warm_s),
        idle_parked_cost=price(counts.hot_idle_s),
        headroom_cost=headroom,
        total_cost=total,
    )
    return out


#: The units of a relative time (`24h`, `7d`), in seconds.
_UNITS = {"s": 1.0, "m": 60.0, "h": HOUR_S, "d": 86400.0, "w": 7 * 86400.0}
#: The longest window a ledger or log read may span: a year.
MAX_WINDOW_S = 366 * 86400.0


#: A decimal number as `parse_time` reads it: digits, an optional fraction and exponent.
_DECIMAL = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def parse_time(text: str, now: float) -> float:
    """A point in time: unix seconds (`1733400000`), or a duration before `now` (`24h`,
    `7d`, `90m`). ValueError for anything else."""
    value = text.strip()
    if value and value[-1] in _UNITS and len(value) <= 16:
        amount = _number(value[:-1], text)
        if (
            not math.isfinite(amount)
            or amount < 0
            or amount * _UNITS[value[-1]] > 100 * 365 * 86400
        ):
            raise ValueError(f"not a duration: {text!r}")
        return now - amount * _UNITS[value[-1]]
    if len(value) > 32:
        raise ValueError("too long for a time")
    at = _number(value, text)
    if not math.isfinite(at) or not 0 <= at <= 1e11:
        raise ValueError(f"not a time: {text!r}")
    return at


def _number(value: str, text: str) -> float:
    """`value` as a decimal number (not Python's other spellings: `1_000`, `inf`);
    ValueError naming the whole `text` (float's own message would name a part of it,
    `'bogu'` of `'bogus'`)."""
    if _DECIMAL.fullmatch(value) is None:
        raise ValueError(f"expected unix seconds or a duration such as 24h or 7d, got {text!r}")
    return float(value)


def _named(name: str, text: str, now: float) -> float:
    """`parse_time`, its ValueError prefixed with the parameter's name."""
    try:
        return parse_time(text, now)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def window(
    since: str | None, until: str | None, now: float, default_s: float
) -> tuple[float, float]:
    """[since, until) from their texts (`parse_time`): until defaults to now, since to
    `default_s` before until, when not given (an empty text is given, and no time).
    ValueError when since is not before until or the window is longer than
    `MAX_WINDOW_S`."""
    end = _named("until", until, now) if until is not None else now
    start = _named("since", since, now) if since is not None else end - default_s
    if start >= end:
        raise ValueError("since must be before until")
    if end - start > MAX_WINDOW_S:
        raise ValueError("a window spans a year at most")
    return start, end
