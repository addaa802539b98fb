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
    #: Spawning workers of the pool that wait for a node (none fits them, or one is on its
    #: way): what a headroom placeholder would have spared them.
    node_waits: int = 0


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


#: Why a pool keeps the headroom placeholders it keeps (`SizingStatus.headroom_reason`).
HEADROOM_NONE, HEADROOM_FORECAST, HEADROOM_COLD = "none", "forecast", "cold"
#: `demand.headroom: constant`: the pool's `headroom_nodes`, whatever they buy.
HEADROOM_CONSTANT = "constant"
#: A draining pool hands out no claims: its headroom buys nothing.
HEADROOM_DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class Headroom:
    """The placeholders one pass wants for a pool, and what decided them."""

    #: Placeholders wanted (at most the pool's `headroom_nodes`).
    placeholders: int
    #: `forecast` (growth within the node lead beyond the warm pool), `cold` (claims went
    #: cold or queued this pass) or `none` (neither: a placeholder would buy nothing).
    reason: str
    #: Workers the forecast added within the node lead beyond the workers live now and the
    #: warm pool when these were wanted (negative: the warm pool absorbed the growth);
    #: None without a forecast.
    short: float | None


def forecast_short(
    *, busy: int, live: int, warm: int, growth: float | None, warm_later: int
) -> float:
    """Workers the forecast adds within the node lead that neither the workers live now nor
    the warm pool cover: the busy workers grown by `growth` (the forecast rate then over
    now; None: from nothing, so the busy workers as they are) and the warm pool wanted
    then, beyond the `live` workers and the `warm` workers wanted now.

    The warm pool is what hands out claims while a new node launches: refills that wait
    for the node cost a cold start only once the growth has taken the whole of it."""
    grown = busy * (growth if growth is not None else 1.0)
    return grown + warm_later - live - warm


def claims_waiting_for_nodes(*, misses: int, waiting: int, counts: PoolCounts) -> int:
    """How many of the pass's claims may wait for a node, which a placeholder would have
    spared: those that missed the warm pool since the last pass (each cold spawn may wait
    for one), or those queued now beyond the warm spawns a node has taken already (those
    serve the first ones within seconds), whichever are more: a claim that missed is
    queued too until its spawn or a warm worker serves it."""
    on_nodes = max(0, counts.spawning_neutral - counts.node_waits)
    return max(misses, waiting - on_nodes, 0)


def paying_headroom(
    *, short: float | None, stranded: int, node_waits: int, slots: int, most: int
) -> Headroom:
    """The placeholders (each room for `slots` workers; at most `most`) that buy something.

    A placeholder buys a spawn that does not wait for a node: with none of the pool's
    spawns waiting for one (`node_waits`), none. Else room for the forecast's `short`
    workers, or for as many claims as this pass saw wait for a node (`stranded`: the
    next ones of a burst nobody forecast), whichever is more, beyond the room already
    coming.

    The room already coming: the node autoscaler launches nodes for the spawns that wait,
    and what those spawns leave free on them (`slots` per node, for node-sized
    placeholders; none counted for smaller ones) takes the next workers as soon as a
    placeholder's node would. A placeholder launched on top of them costs far more than
    its own time: the extra node takes sessions as soon as it stands, and a node holding
    a session is not consolidated until the last one ends."""
    if node_waits <= 0:
        return Headroom(0, HEADROOM_NONE, short)
    width = max(1, slots)
    coming = math.ceil(node_waits / width) * width - node_waits

    def placeholders(workers: float) -> int:
        return min(most, math.ceil(max(0.0, workers - coming) / width))

    wanted = placeholders(short) if short is not None and short > 0 else 0
    cold = placeholders(stranded)
    if cold > wanted:
        return Headroom(cold, HEADROOM_COLD, short)
    return Headroom(wanted, HEADROOM_FORECAST if wanted else HEADROOM_NONE, short)
