"""The leader's sizing of each pool: demand as a rate, the learned forecast, the warm pool
and the node headroom that follow from them (docs/scaling.md).

Each pass reads every replica's demand rows once (`DemandLedger`): the claims that wanted
a neutral worker since the last pass feed the pool's rate windows and its forecaster, and
the claims queued now add to the warm target one for one. The warm target is the larger of
the pool's `warm_target`, the reactive estimate (the rate over the stable or panic window,
sized to a Poisson quantile over the replacement time) and, while the forecast holds, the
forecast over the next replacement time. A miss raises the target only through the rate: a
cold claim's own spawn is its supply, so one miss never spawns twice.

The forecast buckets are loaded from the store when this replica starts leading and written
when an hour closes, so a new leader keeps what the last one learned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from stoker.control import logs
from stoker.control.demand import DemandPublisher
from stoker.control.org_forecasts import OrgOutlook
from stoker.control.shared import Shared
from stoker.control.spawning import Spawner
from stoker.domain.errors import StoreError
from stoker.domain.records import Worker
from stoker.domain.specs import PoolSpec
from stoker.domain.states import WorkerState
from stoker.policy.demand import DemandLedger, Rate, RateWindow, SeenDemand, warm_for_rate
from stoker.policy.forecast import Forecaster, ForecastError
from stoker.policy.held import HeldMax
from stoker.policy.scaling import (
    HEADROOM_CONSTANT,
    HEADROOM_DRAINING,
    Headroom,
    PoolCounts,
    claims_waiting_for_nodes,
    desired_warm,
    forecast_short,
    paying_headroom,
)
from stoker.ports.runtime import Runtime
from stoker.ports.store import ReplicaStore

#: The spawn stages that wait for a node (`SpawnProgress.stage`).
NODE_WAITS = frozenset({"unschedulable", "node_coming"})

#: Which estimate set the warm target.
STATIC, REACTIVE, FORECAST = "static", "reactive", "forecast"


@dataclass(frozen=True, slots=True)
class Sizing:
    """One pass's sizing of one pool (`GET /v1/pools/{name}`)."""

    #: Warm workers wanted, within the cap.
    desired: int
    #: Claims queued for a warm worker now (added one for one).
    waiting: int
    rate: Rate
    #: Spawn-to-ready estimate and the replacement time it makes (plus one pass).
    ready_s: float
    replace_s: float
    #: Warm workers the reactive rate wants.
    reactive: int
    #: The forecast rate in use over the next replacement time (claims per second): its
    #: upper quantile while guarded after a miss, else its mean; and the warm workers it
    #: wants. None without history or with forecast off.
    forecast_rate: float | None
    forecast_warm: int | None
    #: Claims seen against the forecast over the error window, relative (None: no forecast).
    forecast_error: float | None
    #: Whether the forecast is set aside for an error beyond the bound.
    forecast_off: bool
    #: Which estimate won: static (warm_target), reactive or forecast.
    policy: str
    #: The warm target in force: the largest of warm_target, reactive and forecast.
    base: int
    #: Warm workers wanted beyond the static target, before the cap: what the rate or the
    #: forecast adds, plus the claims queued.
    demand: int
    #: Headroom placeholders kept (None: the pool keeps none), why (`none`, `forecast`,
    #: `cold`), and the workers the forecast adds within the node lead beyond the live
    #: workers and the warm pool (None: no forecast).
    headroom: int | None = None
    headroom_reason: str | None = None
    headroom_short: float | None = None
    #: Whether new workers may gather beside sessions now: the forecast expects no growth
    #: beyond the live workers and the warm pool within the node lead (`headroom_short` at
    #: most 0), and no claim missed within `miss_hold_s` nor surged (`Runtime.gather`).
    gather: bool = False
    #: Orgs whose learned rate is in use (enough history), and orgs tracked.
    org_forecasts: int = 0
    orgs_tracked: int = 0


@dataclass(frozen=True, slots=True)
class SizingStatus:
    """How the leading replica's last pass sized the pool (docs/scaling.md)."""

    #: Claims per second that wanted a neutral worker: the rate in force, the stable and
    #: panic windows' rates, and whether the panic one won.
    demand_rate: float
    stable_rate: float
    panic_rate: float
    panicking: bool
    #: The spawn-to-ready estimate, and the replacement time it makes (plus one pass).
    ready_s: float
    replace_s: float
    #: Warm workers the reactive rate wants.
    reactive_warm: int
    #: The forecast's new-session rate in use (per second) over the next replacement time:
    #: its upper quantile within `demand.miss_hold_s` of a claim that missed the warm
    #: pool, else its mean; and the warm workers it wants; null without a forecast.
    forecast_rate: float | None
    forecast_warm: int | None
    #: Claims seen against the forecast over the error window, relative; null without one.
    forecast_error: float | None
    #: True while the forecast is set aside for an error beyond its bound.
    forecast_off: bool
    #: Which estimate set the warm target: static (warm_target), reactive or forecast.
    policy: str
    #: Headroom placeholders kept (at most `headroom_nodes`); null: the pool keeps none.
    headroom: int | None
    #: What decided them: `forecast` (growth within the node lead beyond the warm pool),
    #: `cold` (the pool's claims went cold or queued within `demand.headroom_hold_s`),
    #: `none` (a placeholder would hold a node no claim waits for) or `constant`
    #: (`demand.headroom: constant`); null without headroom.
    headroom_reason: str | None = None
    #: Workers the forecast adds within the node lead beyond the live workers and the
    #: warm pool wanted now (negative: the warm pool absorbs it); null without a forecast.
    headroom_short: float | None = None
    #: True while the pool's new workers may gather beside sessions: the forecast expects
    #: no growth beyond the live workers and the warm pool within `demand.node_lead_s`, and
    #: no claim missed within `demand.miss_hold_s` nor surged. A Kubernetes runtime with
    #: `prefer_session_nodes: forecast` (the default) then has new worker pods prefer the
    #: nodes that hold the most sessions.
    gather: bool = False
    #: Orgs of the pool whose learned new-session rate is in use (a day of history), and
    #: orgs whose rate is being learned (at most `demand.org_forecast_orgs`).
    org_forecasts: int = 0
    orgs_tracked: int = 0

    @classmethod
    def of(cls, s: Sizing) -> SizingStatus:
        """The status of one sizing."""
        return cls(
            demand_rate=s.rate.value,
            stable_rate=s.rate.stable,
            panic_rate=s.rate.panic,
            panicking=s.rate.panicking,
            ready_s=s.ready_s,
            replace_s=s.replace_s,
            reactive_warm=s.reactive,
            forecast_rate=s.forecast_rate,
            forecast_warm=s.forecast_warm,
            forecast_error=s.forecast_error,
            forecast_off=s.forecast_off,
            policy=s.policy,
            headroom=s.headroom,
            headroom_reason=s.headroom_reason,
            headroom_short=s.headroom_short,
            gather=s.gather,
            org_forecasts=s.org_forecasts,
            orgs_tracked=s.orgs_tracked,
        )


class PoolSizer:
    """The leader's demand state per pool: rate windows, forecasters and errors."""

    def __init__(
        self,
        shared: Shared,
        *,
        store: ReplicaStore,
        runtime: Runtime,
        spawner: Spawner,
        publisher: DemandPublisher,
    ) -> None:
        self._catalog, self._settings = shared.catalog, shared.settings
        self._metrics = shared.metrics
        self._store, self._runtime = store, runtime
        self._spawner, self._publisher = spawner, publisher
        self._ledger = DemandLedger()
        #: Each pool's busiest orgs' forecasts.
        self.orgs = OrgOutlook(store)
        self._rates: dict[str, RateWindow] = {}
        self._forecasters: dict[str, Forecaster] | None = None
        self._errors: dict[str, ForecastError] = {}
        self._seen: dict[str, SeenDemand] = {}
        #: Seconds the last read covered (since the read before it).
        self._covered = 0.0
        self._last_read: float | None = None
        #: The headroom each pass wanted, over the hold: the headroom in force is their
        #: largest (the latest of equals: what decided it).
        self._headroom_held: dict[str, HeldMax[Headroom]] = {}
        #: When each pool's claims last went cold or queued (a pass that saw a miss).
        self._missed_at: dict[str, float] = {}
        #: The last sizing of each pool.
        self.last: dict[str, Sizing] = {}

    async def read(self, now: float) -> None:
        """Once per pass: publish this replica's rows, read every replica's, count what is
        new into each pool's rate window and forecaster."""
        await self._publisher.publish()
        rows = await self._store.read_demand()
        fresh_after = now - self._settings.instance_expiry_s
        self._seen = self._ledger.observe(rows, now=now, fresh_after=fresh_after)
        self._covered = 0.0 if self._last_read is None else now - self._last_read
        self._last_read = now
        forecasters = await self._load_forecasters()
        learned = []
        for name in self._catalog.pools:
            claims = self._seen.get(name, SeenDemand()).claims
            self._rates.setdefault(name, RateWindow()).add(now, claims)
            if forecasters is not None:
                forecaster = forecasters.setdefault(name, Forecaster(name))
                learned += forecaster.observe(now, claims)
        await self.orgs.read(list(self._catalog.pools.values()), now)
        if learned:
            try:
                await self._store.record_forecast(learned)
            except StoreError as exc:
                # The buckets stay in memory; the next hour's write carries them again.
                logs.event("forecast_write_failed", error=str(exc), level=logs.WARNING)

    async def _load_forecasters(self) -> dict[str, Forecaster] | None:
        """The forecasters, loaded from the store the first time (None while it fails)."""
        if self._forecasters is None:
            try:
                buckets = await self._store.read_forecast()
            except StoreError as exc:
                logs.event("forecast_read_failed", error=str(exc), level=logs.WARNING)
                return None
            self._forecasters = {name: Forecaster(name, buckets) for name in self._catalog.pools}
        return self._forecasters

    def size(self, pool: PoolSpec, counts: PoolCounts, *, cap: int, now: float) -> Sizing:
        """The warm target of `pool` now, and the headroom the forecast wants."""
        spec = pool.demand
        seen = self._seen.get(pool.name, SeenDemand())
        window = self._rates.setdefault(pool.name, RateWindow())
        rate = window.rate(
            now,
            stable_s=spec.stable_s(self._settings.demand_window_s),
            panic_s=spec.panic_window_s,
            panic_ratio=spec.panic_ratio,
        )
        ready_s = self._spawner.ready_s(pool)
        # A replacement starts at the next pass after the claim, and takes a spawn.
        replace_s = ready_s + self._settings.janitor_interval_s
        reactive = warm_for_rate(rate.value, replace_s, spec.quantile)
        forecaster = (self._forecasters or {}).get(pool.name) if spec.forecast else None
        outlook = None
        error: float | None = None
        off = False
        now_rate = None
        missed = seen.misses > 0 or seen.waiting > 0
        if missed:
            self._missed_at[pool.name] = now
        # Within `miss_hold_s` of a miss the pool is guarded: sized by the largest of the
        # reactive rate and the forecast's upper quantile. Otherwise a forecast leads by its
        # mean: the spread, and a window's noise, bought no warm claim lately.
        guarded = now - self._missed_at.get(pool.name, -math.inf) <= spec.miss_hold_s
        if forecaster is not None and forecaster.has_history():
            errors = self._errors.setdefault(pool.name, ForecastError())
            now_rate = forecaster.at(now, spec.quantile)
            if now_rate is not None:
                errors.add(now, seen.claims, now_rate.mean * self._covered)
            error = errors.relative(now, spec.error_window_s)[0]
            off = errors.beyond(now, spec.error_window_s, spec.forecast_error_bound)
            if not off:
                outlook = forecaster.peak(now, now + replace_s, spec.quantile)
        forecast_warm = forecast_rate = None
        rising = False
        if outlook is not None:
            # A ramp the forecast expects: its mean leads it, and the reactive rate, which
            # follows what comes, keeps the pool from falling behind a ramp that runs early.
            rising = now_rate is not None and outlook.mean > now_rate.mean
            forecast_rate = outlook.upper if guarded else outlook.mean
            forecast_warm = warm_for_rate(forecast_rate, replace_s, spec.quantile)
        leads = forecast_warm is not None and not guarded
        if leads:
            # The reactive rate still counts while its panic window wins: a surge the
            # forecast did not see.
            follow = rate.panicking or rising
            base = max(pool.warm_target, forecast_warm or 0, reactive if follow else 0)
        else:
            base = max(pool.warm_target, reactive, forecast_warm or 0)
        if self._catalog.draining(pool.name):
            base = 0  # a draining pool hands out no claims: its warm workers retire
        if base == pool.warm_target:
            policy = STATIC
        elif base == forecast_warm and (leads or base > reactive):
            policy = FORECAST
        else:
            policy = REACTIVE
        org_forecasts, orgs_tracked = self._org_counts(pool.name)
        desired = desired_warm(base, seen.waiting, cap)
        short = self._short(
            pool, counts, forecaster if not off else None, warm=desired, guarded=guarded, now=now
        )
        headroom = self._headroom(
            pool,
            counts,
            short,
            stranded=claims_waiting_for_nodes(
                misses=seen.misses, waiting=seen.waiting, counts=counts
            ),
            now=now,
        )
        # New workers may gather beside sessions while the forecast expects no growth the
        # room already there does not cover, and no claim missed lately nor surged.
        gather = (
            short is not None
            and short <= 0
            and not guarded
            and not rate.panicking
            and not self._catalog.draining(pool.name)
        )
        self._runtime.gather(pool.name, gather)
        sizing = Sizing(
            desired=desired,
            waiting=seen.waiting,
            rate=rate,
            ready_s=ready_s,
            replace_s=replace_s,
            reactive=reactive,
            forecast_rate=forecast_rate,
            forecast_warm=forecast_warm,
            forecast_error=error,
            forecast_off=off,
            policy=policy,
            base=base,
            demand=seen.waiting + base - pool.warm_target,
            headroom=headroom.placeholders if headroom is not None else None,
            headroom_reason=headroom.reason if headroom is not None else None,
            headroom_short=short,
            gather=gather,
            org_forecasts=org_forecasts,
            orgs_tracked=orgs_tracked,
        )
        self.last[pool.name] = sizing
        self._gauges(pool.name, sizing)
        return sizing

    def _short(
        self,
        pool: PoolSpec,
        counts: PoolCounts,
        forecaster: Forecaster | None,
        *,
        warm: int,
        guarded: bool,
        now: float,
    ) -> float | None:
        """The workers the forecast adds within the node lead beyond the workers live now
        and the warm pool (`warm` wanted now; the warm pool then at its upper quantile
        while `guarded`): `forecast_short`. None without a forecast in use."""
        if forecaster is None:
            return None
        spec = pool.demand
        current = forecaster.at(now, spec.quantile)
        later = forecaster.peak(now, now + spec.node_lead_s, spec.quantile)
        if current is None or later is None:
            return None
        replace_s = self._spawner.ready_s(pool) + self._settings.janitor_interval_s
        return forecast_short(
            busy=counts.live - counts.warm - counts.spawning_neutral - counts.warm_stale,
            live=counts.live,
            warm=warm,
            growth=later.mean / current.mean if current.mean > 0 else None,
            warm_later=warm_for_rate(
                later.upper if guarded else later.mean, replace_s, spec.quantile
            ),
        )

    def _headroom(
        self, pool: PoolSpec, counts: PoolCounts, short: float | None, *, stranded: int, now: float
    ) -> Headroom | None:
        """The placeholders that buy something (docs/scaling.md, "Node headroom"), while
        a spawn of the pool waits for a node: room for the growth the forecast expects
        within the node lead beyond the warm pool (`short`, `_short`), or for the
        `stranded` claims that waited for a node, beyond the room already coming; the
        largest of the last `headroom_hold_s`. None: the pool keeps no headroom. A
        draining pool keeps none, constant or held: it hands out no claims, so no spawn
        of its will wait for a node."""
        if pool.headroom_nodes <= 0:
            return None
        if self._catalog.draining(pool.name):
            return Headroom(0, HEADROOM_DRAINING, None)
        spec = pool.demand
        if spec.headroom == "constant":
            return Headroom(pool.headroom_nodes, HEADROOM_CONSTANT, None)
        wanted = paying_headroom(
            short=short,
            stranded=stranded,
            node_waits=counts.node_waits,
            slots=self._runtime.placeholder_slots(pool),
            most=pool.headroom_nodes,
        )
        held = self._headroom_held.setdefault(
            pool.name, HeldMax(key=lambda headroom: headroom.placeholders)
        )
        # The headroom in force, as the pass that wanted it decided it (the pool's
        # `headroom_short` now is `Sizing`'s own).
        return held.add(now, wanted, spec.headroom_hold_s)

    def node_waits(self, pool: PoolSpec, workers: Iterable[Worker]) -> int:
        """How many of `pool`'s spawning `workers` wait for a node, as the runtime sees
        them: none fits them, or a node is on its way (a preemption included)."""
        return sum(
            1
            for w in workers
            if w.pool == pool.name
            and w.state is WorkerState.SPAWNING
            and (progress := self._runtime.progress(w)) is not None
            and progress.stage in NODE_WAITS
        )

    def _org_counts(self, pool: str) -> tuple[int, int]:
        """(orgs whose forecast is in use, orgs tracked) of `pool`."""
        orgs = self.orgs.of(pool)
        return (len(orgs.forecast_orgs()), orgs.tracked) if orgs is not None else (0, 0)

    def _gauges(self, pool: str, sizing: Sizing) -> None:
        self._metrics.demand_rate.labels(pool).set(sizing.rate.value)
        self._metrics.forecast_sessions.labels(pool).set(
            sizing.forecast_rate * sizing.replace_s if sizing.forecast_rate is not None else 0
        )
        self._metrics.forecast_error.labels(pool).set(sizing.forecast_error or 0.0)
        self._metrics.org_forecasts.labels(pool).set(sizing.org_forecasts)
