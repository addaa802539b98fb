"""How many warm workers a pool wants, and how many to spawn or retire this pass.

Scale-up and scale-down read the same `desired_warm`, so they cannot oscillate: a pass
either spawns towards it or, after `scale_down_delay` above it, retires towards it.
A pool whose spawns keep failing backs off (`spawn_backoff_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stoker.domain.specs import SpawnBackoff

#: Share of a pool that one pass may retire as excess (at least one worker).
SCALE_DOWN_SHARE = 0.10


@dataclass(frozen=True, slots=True)
class PoolCounts:
    """What the passive sync saw of one pool."""

    #: Ready, neutral workers of the pool's current revision.
    warm: int = 0
    #: Spawning slots that will become warm (no org attached).
    spawning_neutral: int = 0
    #: Every non-terminal worker of the pool, all revisions: what the pool cap counts.
    live: int = 0
    #: Warm workers of older revisions, to be retired as the rollout proceeds.
    warm_stale: int = 0


def effective_cap(max_workers: int, derived_cap: int) -> int:
    """The pool cap in force: the configured one, else the runtime's derived one (0 = none)."""
    return max_workers if max_workers > 0 else derived_cap


def spawn_backoff_s(failures: int, backoff: SpawnBackoff) -> float:
    """Seconds without spawns after `failures` failed spawns in a row (0: none failed)."""
    if failures <= 0:
        return 0.0
    # The exponent is bounded so a long outage never overflows a float.
    return min(backoff.max_s, backoff.initial_s * backoff.factor ** min(failures - 1, 64))


def desired_warm(warm_target: int, demand: int, cap: int) -> int:
    """Static target plus observed demand; capped only when `cap` > 0."""
    desired = warm_target + max(0, demand)
    return min(desired, cap) if cap > 0 else desired


def spawns_needed(desired: int, counts: PoolCounts, cap: int) -> int:
    """Spawn slots that close the whole gap to `desired` in one pass, within the cap."""
    gap = desired - (counts.warm + counts.spawning_neutral)
    if cap > 0:
        gap = min(gap, cap - counts.live)
    return max(0, gap)


def scale_down_budget(live: int) -> int:
    """At most max(1, 10 %) of a pool may be retired as excess in one pass."""
    return max(1, int(live * SCALE_DOWN_SHARE))


def retirements_due(
    desired: int,
    counts: PoolCounts,
    *,
    excess_since: float | None,
    now: float,
    scale_down_delay: float,
) -> int:
    """Warm workers to retire now: stale revisions first, then excess held past the delay."""
    budget = scale_down_budget(counts.live)
    stale = min(counts.warm_stale, budget)
    excess = counts.warm - desired
    if excess <= 0 or excess_since is None or now - excess_since < scale_down_delay:
        return stale
    return min(budget, stale + excess)


def forecast_headroom(
    *, busy: int, live: int, growth: float | None, warm_later: int, slots: int, most: int
) -> int:
    """Headroom placeholders (each room for `slots` workers; at most `most`) for the workers
    the forecast adds within the node lead time: the busy workers grown by `growth` (the
    forecast rate then over now; None: from nothing, so `most`) and the warm pool then,
    beyond the workers live now."""
    if growth is None:
        return most
    want = busy * growth + warm_later - live
    return min(most, max(0, math.ceil(want / max(1, slots))))
