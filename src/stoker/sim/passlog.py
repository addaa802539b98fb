"""The warm pool at the janitor's own resolution: demand, desired and warm, every pass.

The timeseries samples the whole cluster every `sample_interval_s` (a minute in a day-long
scenario), too coarse to see a pool of 2 run dry and refill within a pass or two. This
log reads only what the leader's janitor decided in its last pass (`Janitor.demand`,
`Janitor.desired`) and the pool's warm and spawning workers from the store, once every
janitor interval, so each row holds one pass's decision and what it left; the report
writes it as `passes.csv` and plots it.

`waiting_with_warm` counts rows at which a claim had waited over `WAIT_S` while a warm
worker sat ready: the waste the claim path must not allow (a waiting claim takes the
first ready worker). A claim served from the warm pool takes milliseconds, so one caught
in flight by a row never counts; a client sleeping in its retry back-off has no claim
waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from stoker.domain.states import WorkerState
from stoker.ports.store import Store
from stoker.sim.load import LoadDriver
from stoker.sim.replicas import PolicyReplicas

#: A claim waiting longer than this while a worker is warm is one that did not take it.
WAIT_S = 1.0
#: The columns of one row (passes.csv has them after `policy`).
COLUMNS = ("t_s", "demand", "desired", "warm", "spawning", "active", "waiting")


@dataclass(slots=True)
class PassLog:
    """Rows of (t, demand, desired, warm, spawning, active sessions, waiting claims)."""

    rows: list[tuple[float, int | None, int | None, int, int, int, int]] = field(
        default_factory=list
    )
    waiting_with_warm: int = 0

    async def run(
        self,
        *,
        interval_s: float,
        pool: str,
        now: Callable[[], float],
        store: Store,
        replicas: PolicyReplicas,
        driver: LoadDriver,
    ) -> None:
        """Record a row every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            warm = spawning = 0
            for count in await store.count_workers():
                if count.pool != pool:
                    continue
                if count.state is WorkerState.WARM:
                    warm += count.count
                elif count.state is WorkerState.SPAWNING:
                    spawning += count.count
            leader = replicas.leader()
            janitor = None if leader is None else replicas.planes[leader].janitor
            demand = None if janitor is None else janitor.demand.get(pool)
            desired = None if janitor is None else janitor.desired.get(pool)
            self.rows.append(
                (round(now(), 6), demand, desired, warm, spawning, driver.active, driver.waiting)
            )
            if warm > 0 and driver.waiting_longer_than(WAIT_S) > 0:
                self.waiting_with_warm += 1
