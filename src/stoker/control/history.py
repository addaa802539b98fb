"""The last hour of each pool's warm target, demand and workers (and each revision's share
and workers, the rollout view's), sampled by this replica.

The dashboard's chart reads it (docs/getting-started.md): kept on the server, a page opened
now shows the hour before it, every viewer sees the same curve, and a reload loses
nothing. One sample per pool every `PlaneSettings.pool_sample_s`, in a ring of one hour:
at the default 10 s, 360 samples of a few integers per pool.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

#: How far back the history reaches.
SPAN_S = 3600.0


@dataclass(frozen=True, slots=True)
class RevisionSample:
    """One revision of a pool at one instant: its share (0-1) of new claims by the rollout
    plan, and its warm and busy (reserved, activating, hot, hot_idle) workers."""

    revision: str
    share: float
    warm: int
    busy: int


@dataclass(frozen=True, slots=True)
class PoolSample:
    """One pool at one instant; `at` in seconds since the Unix epoch."""

    at: float
    warm_target: int
    desired_warm: int
    demand: int
    warm: int
    hot: int
    hot_idle: int
    spawning: int
    #: Each revision with live workers or a share, the stable one first.
    revisions: tuple[RevisionSample, ...] = ()
    #: `desired_warm` and `demand` are the last published sizing, which no replica has
    #: renewed for three janitor intervals (`GET /v1/pools`' `sizing_stale`).
    sizing_stale: bool = False


class History:
    """One ring of samples per pool, each covering `SPAN_S`."""

    def __init__(self, interval_s: float, span_s: float = SPAN_S) -> None:
        self.interval_s = interval_s
        self._size = max(1, math.ceil(span_s / interval_s))
        self._pools: dict[str, deque[PoolSample]] = {}

    def add(self, pool: str, sample: PoolSample) -> None:
        """Keep `sample` of `pool` (the oldest goes once the ring is full)."""
        ring = self._pools.get(pool)
        if ring is None:
            ring = self._pools[pool] = deque(maxlen=self._size)
        ring.append(sample)

    def forget(self, pool: str) -> None:
        """Drop the samples of `pool` (deleted from the store: the chart shows it no more)."""
        self._pools.pop(pool, None)

    def samples(self, *, since: float = -math.inf) -> Mapping[str, list[PoolSample]]:
        """Every pool's samples taken after `since`, oldest first."""
        return {
            pool: [s for s in ring if s.at > since] for pool, ring in sorted(self._pools.items())
        }
